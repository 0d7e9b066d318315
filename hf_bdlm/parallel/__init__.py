"""Block parallelism: the layout declaration, the plan (who owns which rows), the collectives, the sharded attention.

- :mod:`.dims`: :class:`ParallelDims`, the layout (P, C, mode, schedule, transport, world) validated once,
  and its DeviceMesh;
- :mod:`.plan`: pure functions of a layout and a sequence length: which rows each rank holds;
- :mod:`.groups`: the process groups of a rank and the cached, agreed plan of each batch;
- :mod:`.collectives`, :mod:`.ring`: communication whose results exist only after their wait;
- :mod:`.sharded`: the ``cp`` / ``bp`` / ``csbp`` attention of one rank;
- :mod:`.diffusion_gemma`: the same for DiffusionGemma's encoder-decoder (clean rows, canvas blocks);
- :mod:`.plugin`: the trainer's side (data sharding, reductions).
"""

from .collectives import ByteMeter, CollectiveTimeout, CommContext
from .diffusion_gemma import ShardedDiffusionGemmaLayout
from .dims import MODES, SCHEDULES, TRANSPORTS, ParallelDims
from .groups import BlockParallelGroups, verify_plan_agreement
from .plan import GroupPlan, PlanConfig, RankPlan, make_plan, required_multiple
from .plugin import BlockParallelPlugin
from .sharded import ShardedLayout

__all__ = [
    "MODES",
    "SCHEDULES",
    "TRANSPORTS",
    "BlockParallelGroups",
    "BlockParallelPlugin",
    "ByteMeter",
    "CollectiveTimeout",
    "CommContext",
    "GroupPlan",
    "ParallelDims",
    "PlanConfig",
    "RankPlan",
    "ShardedDiffusionGemmaLayout",
    "ShardedLayout",
    "make_plan",
    "required_multiple",
    "verify_plan_agreement",
]
