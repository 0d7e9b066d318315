"""`BlockParallelPlugin`: block-parallel groups and data sharding on top of Accelerate's world.

Accelerate has no plug-in point for a new parallelism (and its own context parallelism drops
attention masks), so the plugin builds what block parallelism needs from the world that
`accelerate launch` / `torchrun` set up:

- the world of ``W = D x P`` ranks is cut into ``D`` block-parallel groups of ``P`` consecutive
  ranks (data-parallel replicas), each with its clean rings: one ``DeviceMesh`` ``(dp, ring, clean_ring, tp)``
  built from the validated :class:`~hf_bdlm.parallel.dims.ParallelDims` (:class:`BlockParallelGroups`); with
  tensor parallelism (``T`` ranks, innermost) ``W = D x P x T`` and a group is the ``P`` ranks of one ``t``;
- :class:`BlockParallelBatchSampler` gives every rank of a group the *same* batches and the
  groups *disjoint* ones: the data is sharded by data-parallel group index, not by global rank;
- :meth:`BlockParallelPlugin.layout` builds the :class:`ShardedLayout` of one batch for this rank.

With ``P = 1`` the plugin is plain data parallelism. It composes with DDP (CPU/gloo and GPU/NCCL):
every rank returns the loss of the rows it owns, scaled so that DDP's mean over ``W`` ranks is the
single-device gradient. FSDP2 shards parameters over the whole world (the mesh's flattened ``dp_bp``).

    torchrun --nproc_per_node 4 -m hf_bdlm.parallel.plugin     # prints each rank's groups and first batches
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from ..attention.interface import KEPT_LAYOUTS, LocalLayout, documents_key
from .dims import CPLayout, Mode, ParallelDims, Schedule, Transport
from .groups import BlockParallelGroups
from .emulated_link import LinkModel
from .liveness import Heartbeat, is_distributed_failure, start_heartbeat
from .plan import PlanConfig
from .sharded import ShardedLayout


class BlockParallelBatchSampler(Sampler[list[int]]):
    """Batches of dataset indices for one data-parallel replica, identical on every rank of its group.

    The epoch's order (a permutation seeded by ``seed + epoch``, or ``0..n-1``) is cut into global
    batches of ``batch_size * num_replicas`` samples; replica ``r`` takes the ``r``-th share of each.
    A last, incomplete global batch is shared as evenly as possible (shares differ by at most one
    sample, and may be empty: the trainer then runs a step that contributes nothing), unless
    ``drop_last``. Every sample of an epoch is thus seen by exactly one replica, exactly once.

    Args:
        num_samples (`int`): dataset size.
        batch_size (`int`): samples per replica per micro-batch.
        num_replicas (`int`): data-parallel replicas `D`.
        replica (`int`): this rank's replica (block-parallel group index).
        shuffle (`bool`, defaults to `True`), seed (`int`, defaults to `0`), drop_last (`bool`, defaults to `False`).
    """

    def __init__(self, num_samples: int, batch_size: int, num_replicas: int, replica: int, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False):
        if num_samples <= 0:
            raise ValueError(f"the dataset is empty (num_samples={num_samples}); nothing to train on.")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}.")
        if not 0 <= replica < num_replicas:
            raise ValueError(f"replica must be in [0, {num_replicas}), got {replica}.")
        if drop_last and num_samples < batch_size * num_replicas:
            raise ValueError(
                f"drop_last=True with {num_samples} samples leaves no batch: one global batch needs "
                f"batch_size={batch_size} x {num_replicas} data-parallel replicas = {batch_size * num_replicas}."
            )
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.num_replicas = num_replicas
        self.replica = replica
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.num_replicas

    def order(self) -> list[int]:
        """The epoch's sample order, the same on every rank."""
        if not self.shuffle:
            return list(range(self.num_samples))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def global_batches(self) -> list[list[int]]:
        """The epoch's global batches (every replica's share concatenated, in replica order)."""
        order, size = self.order(), self.global_batch_size
        batches = [order[i : i + size] for i in range(0, len(order), size)]
        if self.drop_last and batches and len(batches[-1]) < size:
            batches.pop()
        return batches

    def share(self, batch: list[int], replica: int) -> list[int]:
        """Replica ``replica``'s share of one global batch (contiguous, sizes differ by at most one)."""
        base, extra = divmod(len(batch), self.num_replicas)
        start = replica * base + min(replica, extra)
        return batch[start : start + base + (replica < extra)]

    def __iter__(self):
        for batch in self.global_batches():
            yield self.share(batch, self.replica)

    def __len__(self) -> int:
        size = self.global_batch_size
        return self.num_samples // size if self.drop_last else math.ceil(self.num_samples / size)


@dataclass
class BlockParallelPlugin:
    r"""
    Block parallelism for the Trainer / Accelerate: process groups, data sharding and per-batch layouts.

    Parameters:
        block_parallel_size (`int`, defaults to `1`):
            Ranks `P` of a block-parallel group (must divide the world size).
        clean_ring_size (`int`, *optional*):
            Ranks `C` of a clean ring, `C | P`; defaults to `P` (`csbp`, `cp`) or `1` (`bp`).
        mode (`str`, defaults to `"csbp"`): `"csbp"`, `"bp"` or `"cp"`.
        schedule (`str`, defaults to `"dual_end"`): `"dual_end"` or `"contiguous"`.
        transport (`str`, defaults to `"allgather"`): `"allgather"` or `"ring"` (passed on to the layout).
        cp_layout (`str`, defaults to `"balanced"`): under `"cp"`, `"balanced"` or `"paper"` (the paper's CP
            baseline, :class:`~.dims.CPLayout`).
        timeout (`timedelta`, *optional*): timeout of the block-parallel groups' collectives (the trainer passes
            `ddp_timeout`, the default group's: every group of the run then has the same).
        verify_layout (`bool`, defaults to `True`):
            The first time the ranks of a group meet a plan, check that they agree on it (one small all-gather);
            a disagreement raises the same clear error on every rank instead of hanging in a collective.
        dims (`ParallelDims`, *optional*):
            A layout declared already (the trainer passes its config's ``parallel_dims``); when given, the five
            layout fields above are read from it.
        link (`LinkModel`, *optional*):
            An emulated link every K/V transfer of this rank goes through (:mod:`~.emulated_link`; measurements only).

    The values are validated once, by :class:`~hf_bdlm.parallel.dims.ParallelDims` (``plugin.dims``). Call
    :meth:`setup` once the distributed world exists (the trainer does it).
    """

    block_parallel_size: int = 1
    clean_ring_size: int | None = None
    mode: Mode = Mode.CSBP
    schedule: Schedule = Schedule.DUAL_END
    transport: Transport = Transport.ALLGATHER
    cp_layout: CPLayout = CPLayout.BALANCED
    timeout: timedelta | None = None
    verify_layout: bool = True
    dims: ParallelDims | None = None
    link: LinkModel | None = None
    # Set by setup()
    world_size: int = field(default=1, init=False)
    rank: int = field(default=0, init=False)
    groups: BlockParallelGroups | None = field(default=None, init=False, repr=False)
    device_mesh: object | None = field(default=None, init=False, repr=False)
    heartbeat: Heartbeat | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if self.dims is None:
            self.dims = ParallelDims(self.block_parallel_size, self.clean_ring_size, self.mode, self.schedule,
                                     self.transport, cp_layout=self.cp_layout)
        # The fields show the resolved layout; the plugin holds the one ParallelDims of the run.
        d = self.dims
        self.block_parallel_size, self.clean_ring_size = d.block_parallel_size, d.clean_ring_size
        self.mode, self.schedule, self.transport, self.cp_layout = d.mode, d.schedule, d.transport, d.cp_layout
        self._ready = False
        self._layouts: dict = {}

    @classmethod
    def from_config(cls, args, link: LinkModel | None = None) -> "BlockParallelPlugin":
        """The plugin of a :class:`~hf_bdlm.BDLMSFTConfig`: it holds the config's ``parallel_dims`` by reference
        (``link``: the emulated link its ``block_parallel_link`` names, resolved by the caller)."""
        timeout = getattr(args, "ddp_timeout", None)
        return cls(dims=args.parallel_dims, timeout=timedelta(seconds=timeout) if timeout else None, link=link)

    # --- world ---------------------------------------------------------------------------------
    def setup(self, device_type: str = "cpu") -> "BlockParallelPlugin":
        """Create the mesh and groups of this rank from the initialised ``torch.distributed`` world (idempotent)."""
        if self._ready:
            return self
        distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size() if distributed else 1
        self.rank = dist.get_rank() if distributed else 0
        self.dims = self.dims.with_world(self.world_size)  # raises if P does not divide the world
        if distributed and self.world_size > 1:
            self.groups = BlockParallelGroups.build(self.dims, device_type, timeout=self.timeout,
                                                    verify=self.verify_layout, link=self.link)
            self.device_mesh = self.groups.mesh
            self.heartbeat = start_heartbeat()
        self._ready = True
        return self

    def begin_step(self, step: int) -> None:
        """The optimizer step about to run (1-based): what a failed collective's error names; the byte meter keeps
        this step's records only (a long run would otherwise hold every step's)."""
        if self.groups is not None:
            meter = self.groups.meter
            meter.step = step
            meter.records = [r for r in meter.records if r[0] == step]

    def explain_failure(self, err: BaseException) -> BaseException | None:
        """For a failed or timed-out collective, an error that names the lost ranks (from their heartbeats: see
        :mod:`~.liveness`), raised ``from`` the original; ``None`` for any other error."""
        if self.heartbeat is None or not is_distributed_failure(err):
            return None
        step = f" at step {self.groups.meter.step}" if self.groups is not None else ""
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return RuntimeError(
            f"rank {self.rank}: a collective failed{step} ({first[:600]}). Of the {self.world_size} ranks, "
            f"{self.heartbeat.diagnosis()} The job cannot continue: restart it and resume from the last checkpoint "
            "(resume_from_checkpoint=True takes the last complete one)."
        )

    @property
    def is_active(self) -> bool:
        """Whether batches are sharded over a block-parallel group (``P > 1``)."""
        return self.block_parallel_size > 1

    @property
    def tensor_parallel_size(self) -> int:
        return self.dims.tensor_parallel_size

    @property
    def data_parallel_size(self) -> int:
        return self.dims.with_world(self.world_size).data_parallel_size

    @property
    def data_world_size(self) -> int:
        """Ranks holding distinct rows, ``D x P = W / T``: what DDP / FSDP2 average gradients over."""
        return self.world_size // self.tensor_parallel_size

    @property
    def data_parallel_rank(self) -> int:
        """Index of this rank's block-parallel group, i.e. its data-parallel replica (rank ``(g*P + r)*T + t``)."""
        return self.rank // (self.block_parallel_size * self.tensor_parallel_size)

    @property
    def group_rank(self) -> int:
        return (self.rank // self.tensor_parallel_size) % self.block_parallel_size

    def _check_ready(self) -> None:
        if not self._ready:
            raise RuntimeError("BlockParallelPlugin.setup() has not been called (the trainer calls it at init).")

    # --- data ----------------------------------------------------------------------------------
    def batch_sampler(self, num_samples: int, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                      drop_last: bool = False) -> BlockParallelBatchSampler:
        """The batch sampler of this rank: its group's share of every global batch."""
        self._check_ready()
        return BlockParallelBatchSampler(num_samples, batch_size, self.data_parallel_size, self.data_parallel_rank,
                                         shuffle=shuffle, seed=seed, drop_last=drop_last)

    def pad_multiple(self, block_size: int) -> int:
        """The multiple sequences are padded to: the block size, or what the layout needs when ``P > 1``."""
        return self.dims.required_multiple(block_size)

    # --- layout --------------------------------------------------------------------------------
    def plan_config(self, seq_len: int, block_size: int) -> PlanConfig:
        return PlanConfig.from_dims(self.dims, seq_len, block_size)

    def layout(self, seq_len: int, block_size: int, rule, backend: str, document_ids=None):
        """The rows this rank runs for a batch of sequences of length ``seq_len``: its :class:`ShardedLayout`, or
        with ``P = 1`` the whole batch (:meth:`LocalLayout.vectorized <hf_bdlm.attention.interface.LocalLayout.vectorized>`).

        A layout depends only on its arguments (packed documents included), so the last
        :data:`~hf_bdlm.attention.interface.KEPT_LAYOUTS` are kept and reused with their tile plans and block masks
        (built once per layer kind): a later batch of the same shape and documents plans nothing.
        """
        self._check_ready()
        if not self.is_active:
            return LocalLayout.vectorized(seq_len, rule, backend, document_ids)
        key = (seq_len, block_size, rule, backend, documents_key(document_ids))
        found = self._layouts.get(key)
        if found is None:
            found = ShardedLayout.build(self.plan_config(seq_len, block_size), self.groups, rule, backend,
                                        document_ids)
            self._layouts[key] = found
            while len(self._layouts) > KEPT_LAYOUTS:
                self._layouts.pop(next(iter(self._layouts)))
        return found

    def sharding_groups(self) -> BlockParallelGroups | None:
        """The groups this rank shares its batch with, for a model family that builds its own sharded layout
        (``hf_bdlm.models``); ``None`` when the batch is not sharded (``P = 1``)."""
        self._check_ready()
        return self.groups if self.is_active else None

    # --- reductions ----------------------------------------------------------------------------
    def sum_over_world(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks holding distinct rows: every rank, or with tensor parallelism the ranks of this rank's
        tensor-parallel index (its ``T - 1`` tensor-parallel peers hold the same rows and values). In place; a no-op
        in a single process."""
        if self.world_size > 1:
            dist.all_reduce(tensor, group=self.groups.world_mesh.get_group() if self.dims.is_tensor_parallel else None)
        return tensor

    def sum_over_group(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over this rank's block-parallel group (in place)."""
        if self.is_active:
            dist.all_reduce(tensor, group=self.groups.group.group)
        return tensor

    def sum_over_replicas(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum of a value every rank of a group holds identically, over the data-parallel replicas."""
        return self.sum_over_world(tensor).div_(self.block_parallel_size)


def _demo() -> None:  # pragma: no cover - a manual check under torchrun
    dist.init_process_group("gloo")
    plugin = BlockParallelPlugin(block_parallel_size=2 if dist.get_world_size() % 2 == 0 else 1).setup()
    sampler = plugin.batch_sampler(10, 2, seed=0)
    print(f"rank {plugin.rank}: replica {plugin.data_parallel_rank}/{plugin.data_parallel_size}, group rank "
          f"{plugin.group_rank}, mesh {plugin.device_mesh}, batches {list(sampler)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    _demo()
