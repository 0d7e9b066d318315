"""Block parallelism: the plan (who owns which rows), the collectives, the sharded attention."""

from .collectives import ByteMeter, CollectiveTimeout, CommContext
from .plan import GroupPlan, PlanConfig, RankPlan, make_plan, required_multiple
from .plugin import BlockParallelPlugin
from .sharded import BlockParallelGroups, ShardedLayout, verify_plan_agreement

__all__ = [
    "BlockParallelGroups",
    "BlockParallelPlugin",
    "ByteMeter",
    "CollectiveTimeout",
    "CommContext",
    "GroupPlan",
    "PlanConfig",
    "RankPlan",
    "ShardedLayout",
    "make_plan",
    "required_multiple",
    "verify_plan_agreement",
]
