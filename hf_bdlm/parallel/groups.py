"""Process groups of a declared layout, and the planning of each batch on top of them.

:class:`BlockParallelGroups` is what a rank holds at run time: its block-parallel group and
clean ring as :class:`~.collectives.CommContext` s (taken from the one ``DeviceMesh`` of
:meth:`ParallelDims.build_mesh <.dims.ParallelDims.build_mesh>`), and :meth:`BlockParallelGroups.layout`,
which plans a batch: plans are cached by their inputs (a :class:`~.plan.PlanConfig` is a
frozen dataclass), and the ranks of a group check that they agree on a plan once, the first
time they see it, instead of on every micro-batch.

    torchrun --nproc_per_node 4 -m hf_bdlm.parallel.groups     # prints each rank's groups and a plan
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from functools import lru_cache

import torch.distributed as dist

from .collectives import ByteMeter, CommContext
from .emulated_link import LinkModel
from .dims import Mode, ParallelDims
from .plan import GroupPlan, PlanConfig, make_plan


@lru_cache(maxsize=64)
def cached_plan(config: PlanConfig) -> GroupPlan:
    """:func:`~.plan.make_plan`, memoised: a plan is a pure function of its (frozen, hashable) config."""
    return make_plan(config)


def verify_plan_agreement(config: PlanConfig, comm: CommContext) -> None:
    """Every rank of the group must run the same plan; raise the same error on all ranks if not."""
    mine = (config.seq_len, config.block_size, config.group_size, config.clean_ring_size, config.mode, config.schedule,
            config.dims.cp_layout, config.noisy_blocks)
    everyone: list = [None] * comm.size
    dist.all_gather_object(everyone, mine, group=comm.group)
    if any(other != everyone[0] for other in everyone):
        fields = "(seq_len, block_size, group_size, clean_ring_size, mode, schedule, cp_layout, noisy_blocks)"
        listing = "; ".join(f"rank {i}: {p}" for i, p in enumerate(everyone))
        raise ValueError(
            f"ranks of process group '{comm.name}' disagree on the block-parallel plan {fields}: {listing}. "
            "Every rank of a block-parallel group must receive the same batch and configuration."
        )


@dataclass
class BlockParallelGroups:
    """This rank's block-parallel group and clean ring, built from a :class:`ParallelDims`.

    Attributes:
        dims: the declared layout (with the world size filled in).
        group, ring: :class:`CommContext` of the block-parallel group and of the clean ring.
        mesh: the ``(dp, ring, clean_ring, tp)`` DeviceMesh; ``bp_mesh`` / ``world_mesh`` its flattened
            block-parallel and data-world (``dp_bp``: all ranks of one tensor-parallel rank) dims; FSDP2 shards over
            ``world_mesh``. ``tp_mesh``: the tensor-parallel group (size 1 without tensor parallelism).
        group_rank, group_index, num_groups: rank inside the group, data-parallel replica, replicas.
        tp_rank: rank inside the tensor-parallel group.
    """

    dims: ParallelDims
    group: CommContext
    ring: CommContext
    mesh: object
    bp_mesh: object
    world_mesh: object
    group_rank: int
    group_index: int
    num_groups: int
    tp_rank: int = 0
    verify: bool = True
    _verified: set = field(default_factory=set, repr=False)

    @classmethod
    def build(cls, dims: ParallelDims, device_type: str = "cpu", meter: ByteMeter | None = None,
              timeout: timedelta | None = None, verify: bool = True, link: LinkModel | None = None
              ) -> "BlockParallelGroups":
        """Create the mesh and this rank's groups (every rank calls it, in the same order). ``link``: an emulated
        link (:class:`~.emulated_link.LinkModel`) every K/V transfer of this rank goes through, both communicators
        sharing it as they share the rank's network interface."""
        if timeout is not None:
            # Every group's collectives (FSDP2's, the barriers') and the K/V waits below use the run's timeout.
            timeout = timedelta(seconds=timeout) if isinstance(timeout, (int, float)) else timeout
        mesh, bp_mesh, world_mesh = dims.build_mesh(device_type, timeout)
        dims = dims.with_world(dist.get_world_size())
        meter = meter or ByteMeter()
        gi, ring, ring_rank, tp = mesh.get_coordinate()
        # Names tell the tensor-parallel replicas of a group apart (their K/V are different heads).
        of_tp = f".tp{tp}" if dims.is_tensor_parallel else ""
        kw = {} if timeout is None else {"timeout": timeout}
        kw["link"] = link
        return cls(
            dims=dims,
            group=CommContext(bp_mesh.get_group(), f"block_parallel[{gi}{of_tp}]", meter, **kw),
            ring=CommContext(mesh.get_group("clean_ring"), f"clean_ring[{gi}.{ring}{of_tp}]", meter, **kw),
            mesh=mesh,
            bp_mesh=bp_mesh,
            world_mesh=world_mesh,
            group_rank=ring * dims.clean_ring_size + ring_rank,
            group_index=gi,
            num_groups=dims.data_parallel_size,
            tp_rank=tp,
            verify=verify,
        )

    @property
    def tp_mesh(self):
        """The tensor-parallel group's 1-D mesh (what :func:`~.tensor.apply_tensor_parallel` shards over)."""
        return self.mesh["tp"]

    @classmethod
    def create(cls, group_size: int, clean_ring_size: int, meter: ByteMeter | None = None, timeout=None,
               device_type: str = "cpu") -> "BlockParallelGroups":
        """Groups of ``group_size`` ranks with rings of ``clean_ring_size`` (any mode that allows that shape)."""
        mode = "bp" if clean_ring_size == 1 and group_size > 1 else "csbp"
        return cls.build(ParallelDims(group_size, clean_ring_size, mode), device_type, meter, timeout)

    @property
    def meter(self) -> ByteMeter:
        return self.group.meter

    def kv_exchange(self, mode: Mode) -> CommContext:
        """Where K/V travel under the plan's ``mode``: the clean ring (``csbp``), whose members are
        ``plan.ring_members``; under ``cp`` the ring is the whole group and its exchange is named as the group's."""
        return self.group if mode.sends_noisy_kv else self.ring

    def plan(self, config: PlanConfig) -> GroupPlan:
        """The (cached) plan of ``config``; the group checks agreement the first time it meets a config."""
        if self.verify and config not in self._verified:
            verify_plan_agreement(config, self.group)
            if len(self._verified) >= 4096:  # configs with noisy_blocks vary per batch: bound the memory, re-verify
                self._verified.clear()
            self._verified.add(config)
        return cached_plan(config)


def _demo() -> None:  # pragma: no cover - a manual check under torchrun
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    groups = BlockParallelGroups.build(ParallelDims(block_parallel_size=2 if world % 2 == 0 else 1))
    plan = groups.plan(PlanConfig.from_dims(groups.dims, 64, 4))
    print(f"rank {dist.get_rank()}: {groups.group.name} {groups.ring.name} mesh {groups.mesh}\n"
          f"{plan.describe()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    _demo()
