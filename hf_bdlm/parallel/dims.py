"""The block-parallel layout, declared once: :class:`ParallelDims` validates it and builds its mesh.

A run's parallel layout is eight numbers and names: the block-parallel group size ``P``, the clean
ring size ``C`` (``C | P``), the mode (``cp`` | ``bp`` | ``csbp``), the noisy-block schedule, the
K/V transport, ``cp``'s layout (``balanced`` | ``paper``), the tensor-parallel size ``T``, and the world
(``W = D x P x T``, ``D`` data-parallel replicas). They are checked here and nowhere else; the trainer config, the
plugin, the plan and the sharded attention all take a :class:`ParallelDims`.

:meth:`ParallelDims.build_mesh` turns it into one ``DeviceMesh`` of shape ``(D, P/C, C, T)``, dims
``("dp", "ring", "clean_ring", "tp")``: rank ``(g*P + r)*T + t`` is group ``g``, group rank ``r``, ring
``r // C``, ring rank ``r % C``, tensor-parallel rank ``t``. Tensor parallelism is innermost (the ``T`` ranks of a
node share one batch and split every layer's heads; :mod:`.tensor`), and a block-parallel group is made of the ranks
of equal ``t``: each exchanges the K/V of its own heads. The sub-meshes are the block-parallel group (``"ring"`` and
``"clean_ring"`` flattened to ``"bp"``), the clean rings (``"clean_ring"``), the tensor-parallel group (``"tp"``) and
the data world (``"dp"``, ``"ring"``, ``"clean_ring"`` flattened to ``"dp_bp"``: the ranks holding distinct rows,
what FSDP2 shards parameters over and gradients are averaged over). See :mod:`.groups` for the process groups and
batch planning on top of it.

    python -c "from hf_bdlm.parallel.dims import ParallelDims; \\
print(ParallelDims(block_parallel_size=4, clean_ring_size=2, world_size=8))"
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


class _Choice(StrEnum):
    """A named choice of a config field: equal to its string, and shown as the string users write (``'csbp'``) in
    reprs and error messages."""

    def __repr__(self) -> str:
        return repr(self.value)


class Mode(_Choice):
    """The block-parallel modes (``docs/design.md`` §3) and what travels under each.

    A member equals its string (``Mode.CSBP == "csbp"``), so configs and records keep plain strings; code asks the
    traits below instead of comparing names.
    """

    CP = "cp"
    BP = "bp"
    CSBP = "csbp"

    @property
    def exchanges_kv(self) -> bool:
        """Whether the ranks of a group receive each other's K/V (``bp`` computes its clean prefix itself)."""
        return self is not Mode.BP

    @property
    def sends_noisy_kv(self) -> bool:
        """Whether a rank's noisy K/V travel with its clean ones (``cp``, over the whole group); ``csbp`` keeps them
        local and exchanges clean K/V over its clean ring."""
        return self is Mode.CP


class Schedule(_Choice):
    """How noisy blocks (and, for ``csbp``, clean shards) are dealt to the ranks of a group."""

    DUAL_END = "dual_end"
    CONTIGUOUS = "contiguous"


class CPLayout(_Choice):
    """How ``cp`` lays out and moves a group's rows (``docs/design.md`` §3, "The paper's CP baseline").

    ``balanced``: the zigzag chunks of the ``2L`` rows (rank ``r`` holds chunk ``r`` and ``2P-1-r``: noisy blocks and
    a clean chunk of equal cost), the K/V gather overlapped with the local attention, window halos on sliding layers.
    ``paper``: the CP-only layout of the paper's reference code, the baseline its published ratios are measured
    against: a contiguous clean shard per rank (the last rank does ``(2P-1)/P`` of the mean clean work), a two-ended
    token slice of every noisy block, the K/V all-gathered before any attention and the dK/dV reduce-scattered after
    every gradient (blocking), and the whole sequence gathered on sliding-window layers too.
    """

    BALANCED = "balanced"
    PAPER = "paper"


class Transport(_Choice):
    """How gathered K/V travel: one all-gather per layer, or shards rotating peer to peer."""

    ALLGATHER = "allgather"
    RING = "ring"


MODES = tuple(Mode)
CP_LAYOUTS = tuple(CPLayout)
SCHEDULES = tuple(Schedule)
TRANSPORTS = tuple(Transport)


def _member(enum: type[StrEnum], value, field_name: str):
    """``value`` as a member of ``enum``, or a ValueError naming the field and the choices."""
    try:
        return enum(value)
    except ValueError:
        raise ValueError(f"{field_name} must be one of {tuple(m.value for m in enum)}, got {value!r}.") from None


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")


@dataclass(frozen=True)
class ParallelDims:
    """The block-parallel layout of a run.

    Parameters:
        block_parallel_size (`int`, defaults to `1`):
            Ranks `P` of a block-parallel group (they share one batch).
        clean_ring_size (`int`, *optional*):
            Ranks `C` of a clean ring, `C | P`. `None` resolves to `P` (`cp`, `csbp`) or `1` (`bp`); after
            construction it is always an integer.
        mode (`str`, defaults to `"csbp"`): `"cp"`, `"bp"` or `"csbp"`.
        schedule (`str`, defaults to `"dual_end"`): `"dual_end"` (balanced block pairs) or `"contiguous"`.
        transport (`str`, defaults to `"allgather"`): `"allgather"` or `"ring"` (K/V shards rotate peer to peer).
        world_size (`int`, *optional*): total ranks `W`; must be a multiple of `P x T`. `None` when not known yet.
        cp_layout (`str`, defaults to `"balanced"`): under `"cp"`, `"balanced"` (zigzag, overlapped, window halos) or
            `"paper"` (the paper's CP baseline: contiguous clean shards, token slices of every noisy block, blocking
            transfers, whole-sequence gathers on sliding layers); see :class:`CPLayout`.
        tensor_parallel_size (`int`, defaults to `1`): ranks `T` splitting every layer's heads and MLP with the
            backbone's own transformers tensor-parallel plan (:mod:`.tensor`); each block-parallel group is made of
            ranks of equal tensor-parallel rank.

    Invalid combinations raise `ValueError` naming the values and the fix.
    """

    block_parallel_size: int = 1
    clean_ring_size: int | None = None
    mode: Mode = Mode.CSBP
    schedule: Schedule = Schedule.DUAL_END
    transport: Transport = Transport.ALLGATHER
    world_size: int | None = field(default=None, compare=False)
    cp_layout: CPLayout = CPLayout.BALANCED
    tensor_parallel_size: int = 1

    def __post_init__(self):
        P = self.block_parallel_size
        _positive_int("block_parallel_size", P)
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        # Names become members here, where they enter: a typo fails now, and code downstream compares members.
        mode = _member(Mode, self.mode, "block_parallel_mode")
        schedule = _member(Schedule, self.schedule, "block_schedule")
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "schedule", schedule)
        object.__setattr__(self, "transport", _member(Transport, self.transport, "block_parallel_transport"))
        cp_layout = _member(CPLayout, self.cp_layout, "block_parallel_cp_layout")
        object.__setattr__(self, "cp_layout", cp_layout)
        if cp_layout is CPLayout.PAPER and mode is not Mode.CP:
            raise ValueError(
                f"block_parallel_cp_layout='paper' is a layout of mode='cp' (the paper's CP baseline), got "
                f"mode={mode!r}; use mode='cp', or leave block_parallel_cp_layout='balanced'."
            )
        if cp_layout is CPLayout.PAPER and self.transport is not Transport.ALLGATHER:
            raise ValueError(
                "block_parallel_cp_layout='paper' moves K/V by blocking all-gathers, as the paper's baseline does; "
                f"got block_parallel_transport={self.transport!r}. Use 'allgather' with it."
            )
        C = self.clean_ring_size
        if C is None:
            C = 1 if mode is Mode.BP else P
            object.__setattr__(self, "clean_ring_size", C)
        elif not isinstance(C, int) or isinstance(C, bool) or C <= 0:
            raise ValueError(f"clean_ring_size must be a positive integer or None, got {C!r}.")
        if mode is Mode.BP and C != 1:
            raise ValueError(
                f"mode='bp' has no clean ring (each rank computes its clean prefix itself), so clean_ring_size "
                f"must be 1 or None, got {C}; use mode='csbp' to shard the clean stream over rings of {C} ranks."
            )
        if mode is Mode.CP and C != P:
            raise ValueError(
                f"mode='cp' gathers the K/V of all 2L rows over the whole group, so clean_ring_size must be None "
                f"or group_size={P}, got {C}; use mode='csbp' for a clean ring smaller than the group."
            )
        if mode is Mode.CP and schedule is not Schedule.DUAL_END:
            raise ValueError(
                f"mode='cp' always shards the 2L rows head-tail (zigzag), got schedule={schedule!r}; "
                "use schedule='dual_end' (the default)."
            )
        if P % C:
            raise ValueError(f"clean_ring_size={C} does not divide group_size={P}; choose one of {divisors(P)}.")
        W, T = self.world_size, self.tensor_parallel_size
        if W is not None:
            _positive_int("world_size", W)
            if W % T:
                raise ValueError(
                    f"tensor_parallel_size={T} does not divide the world size {W}. Choose one of {divisors(W)}, or "
                    f"launch a multiple of {T} processes."
                )
            if (W // T) % P:
                of_tp = "" if T == 1 else f" / tensor_parallel_size={T}"
                per_replica = f"{P} ranks" if T == 1 else f"{P} ranks, once per tensor-parallel rank ({P * T} ranks)"
                raise ValueError(
                    f"block_parallel_size={P} does not divide the world size {W}{of_tp}: the world is split into "
                    f"data-parallel replicas of block-parallel groups of {per_replica}. Choose one of "
                    f"{divisors(W // T)}, or launch a multiple of {P * T} processes."
                )

    # --- derived sizes -------------------------------------------------------------------------
    @property
    def data_parallel_size(self) -> int:
        """Data-parallel replicas `D = W / (P x T)` (1 while the world size is unknown)."""
        per_replica = self.block_parallel_size * self.tensor_parallel_size
        return (self.world_size or per_replica) // per_replica

    @property
    def is_tensor_parallel(self) -> bool:
        return self.tensor_parallel_size > 1

    @property
    def rings_per_group(self) -> int:
        return self.block_parallel_size // self.clean_ring_size

    @property
    def is_sharded(self) -> bool:
        """Whether a batch is split over several ranks (``P > 1``)."""
        return self.block_parallel_size > 1

    @property
    def is_paper_cp(self) -> bool:
        """Whether this is the paper's CP baseline layout (``mode='cp'``, ``cp_layout='paper'``)."""
        return self.cp_layout is CPLayout.PAPER

    def with_world(self, world_size: int) -> "ParallelDims":
        return replace(self, world_size=world_size)

    def block_multiple(self) -> tuple[int, str]:
        """How many blocks a sequence must be a multiple of under this layout, and why (for error messages)."""
        P, C = self.block_parallel_size, self.clean_ring_size
        if self.is_paper_cp:
            return P, f"each of the group_size={P} contiguous clean shards must hold whole blocks"
        if self.mode is Mode.CP:
            return P, f"each of the 2*group_size={2 * P} zigzag chunks of the 2L rows must hold whole blocks"
        if self.schedule is Schedule.CONTIGUOUS:
            return P, f"the blocks are split evenly over the group_size={P} ranks"
        if self.mode is Mode.BP:
            return 2 * P, f"each of the group_size={P} ranks owns whole dual-end block pairs (j, N-1-j)"
        return 2 * P, (
            f"the clean stream is cut into 2*clean_ring_size={2 * C} head-tail chunks of whole blocks and the "
            f"dual-end block pairs (j, N-1-j) are dealt evenly over the group_size={P} ranks"
        )

    def required_multiple(self, block_size: int) -> int:
        """The multiple sequences are padded to: ``B`` when nothing is sharded, else what the layout needs.

        ``cp`` (either layout): ``P * B``; ``bp`` and ``csbp``: ``2 * P * B`` with ``dual_end``, ``P * B`` with ``contiguous``.
        """
        return self.block_multiple()[0] * block_size if self.is_sharded else block_size

    # --- runtime ---------------------------------------------------------------------------------
    def build_mesh(self, device_type: str = "cpu", timeout=None):
        """One ``DeviceMesh`` ``(dp, ring, clean_ring, tp)`` over the initialised world, with the flattened
        ``"bp"`` (block-parallel group) and ``"dp_bp"`` (the data world: every rank but the tensor-parallel ones)
        dims registered on it. Returns ``(mesh, bp_mesh, data_mesh)``; ``mesh["tp"]`` is the tensor-parallel group.

        ``timeout`` (a ``timedelta``): the collective timeout of every group smaller than the world (DeviceMesh would
        give them torch's default, 30 minutes with gloo and 10 with NCCL, whatever the default group's); a dim that
        spans the world is the default group, with its own timeout (``ddp_timeout`` under the trainer).

        Every rank must call it, in the same order (it creates process groups).
        """
        world = dist.get_world_size()
        if self.world_size is not None and self.world_size != world:
            raise ValueError(f"ParallelDims was declared for world_size={self.world_size}, the world has {world} ranks.")
        dims = self.with_world(world)
        shape = (dims.data_parallel_size, dims.rings_per_group, dims.clean_ring_size, dims.tensor_parallel_size)
        names = ("dp", "ring", "clean_ring", "tp")
        options = _group_options(timeout)

        def override(size: int):
            return options if options is not None and size < world else None

        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names,
                                backend_override={n: o for n, size in zip(names, shape) if (o := override(size))})
        bp = dims.rings_per_group * dims.clean_ring_size
        return (mesh, mesh["ring", "clean_ring"]._flatten("bp", backend_override=override(bp)),
                mesh["dp", "ring", "clean_ring"]._flatten("dp_bp", backend_override=override(bp * shape[0])))


def _group_options(timeout):
    """Process-group options carrying ``timeout`` for the default group's backend (gloo or NCCL), or ``None``."""
    if timeout is None:
        return None
    # (None, options): the default group's backend, with these options (DeviceMesh reads the timeout from them).
    backend = dist.get_backend()
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return None, options
    if backend == "gloo":
        return None, dist.ProcessGroupGloo.Options(backend, timeout)
    return None  # another backend (or a mixed one): torch's defaults
