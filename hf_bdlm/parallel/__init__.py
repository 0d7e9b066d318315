"""Block parallelism: the layout declaration, the plan (who owns which rows), the collectives, the sharded attention.

- :mod:`.dims`: :class:`ParallelDims`, the layout (P, C, mode, schedule, transport, cp layout, world) validated once,
  and its DeviceMesh;
- :mod:`.plan`: pure functions of a layout and a sequence length: which rows each rank holds;
- :mod:`.groups`: the process groups of a rank and the cached, agreed plan of each batch;
- :mod:`.collectives`, :mod:`.ring`: communication whose results exist only after their wait;
- :mod:`.exchange`: the exchange of K/V between the ranks of a group (all-gather, halo all-to-all, ring), written
  once for every layout;
- :mod:`.sharded`: the ``cp`` / ``bp`` / ``csbp`` layout of one rank for the vectorized ``[noisy ; clean]`` batch
  (a model family with another batch layout builds its own on the same plan and exchange: ``hf_bdlm.models``);
- :mod:`.plugin`: the trainer's side (data sharding, reductions).
"""

from .collectives import ByteMeter, CollectiveTimeout, CommContext
from .dims import CP_LAYOUTS, MODES, SCHEDULES, TRANSPORTS, ParallelDims
from .groups import BlockParallelGroups, verify_plan_agreement
from .plan import GroupPlan, PlanConfig, RankPlan, make_plan
from .plugin import BlockParallelPlugin
from .sharded import ShardedLayout

__all__ = [
    "CP_LAYOUTS",
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
    "ShardedLayout",
    "make_plan",
    "verify_plan_agreement",
]
