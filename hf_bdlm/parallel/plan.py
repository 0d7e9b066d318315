"""Layout plan of a block-parallel group: which rows of the vectorized forward each rank owns.

Pure functions, no processes: given the sequence length ``L``, block size ``B``, group size
``P``, clean-ring size ``C`` (``C | P``), the mode (``cp`` | ``bp`` | ``csbp``) and the
noisy-block schedule (``dual_end`` | ``contiguous``), :func:`make_plan` says which noisy
blocks and clean positions every rank holds, in which order they are laid out locally, and
whose K/V each rank receives. The sharded attention, the trainer and the benchmarks all read
the layout from here.

Conventions (see ``docs/design.md`` §3):

- Global rows are the ``2L`` rows of :func:`hf_bdlm.attention.rows.vectorized_rows`: row
  ``g < L`` is noisy position ``g``, row ``g >= L`` is clean position ``g - L``.
- A rank's local rows are its noisy rows (owned blocks ascending, ``B`` rows each) followed
  by its clean rows (ascending position). In ``cp`` that is exactly its zigzag chunk ``r``
  then chunk ``2P-1-r``, because chunk ``r < P`` is all noisy and chunk ``2P-1-r`` all clean.
- Ring ``r // C`` holds ranks ``[C * ring, C * (ring + 1))``; ring rank is ``r % C``. ``cp``
  is one ring of ``P`` (all ``2L`` rows are gathered over the group), ``bp`` is ``P`` rings
  of one (nothing is gathered).

Schedules. A noisy block ``j`` costs ``(j + 1) B^2`` allowed pairs (its own block plus ``j``
earlier clean blocks), so the dual-end pair ``(j, N-1-j)`` always costs ``(N + 1) B^2``:
dealing whole pairs balances noisy work exactly, whatever the dealing order.

- ``bp``, ``dual_end``: pair ``j`` goes to rank ``j mod P`` (round robin; a snake order
  balances no better because all pairs cost the same). Rank ``r``'s last block is then
  ``N-1-r``, the largest possible, so the replicated clean prefixes differ as little as they
  can. ``contiguous``: rank ``r`` owns blocks ``[r N/P, (r+1) N/P)``.
- ``csbp``, ``dual_end``: the clean stream is cut into ``2C`` chunks of ``N/(2C)`` blocks;
  ring rank ``c`` holds chunks ``c`` and ``2C-1-c``. Those two chunks are mirror images, so
  they consist of exactly the dual-end pairs ``(j, N-1-j)`` with ``j`` in chunk ``c``; the
  ``P/C`` ranks with ring rank ``c`` (one per ring) split those pairs into equal contiguous
  runs of ``j``, ring ``i`` taking run ``i``. (Round robin would balance equally, but runs
  keep the noisy rows in fewer contiguous ranges; unlike ``bp`` there is no clean prefix
  whose length depends on the dealing.) With ``C = P`` a rank thus owns exactly the noisy
  blocks of its own clean chunks.
- ``csbp``, ``contiguous``: ring rank ``c`` holds clean blocks ``[c N/C, (c+1) N/C)`` and
  the ``P/C`` ranks with ring rank ``c`` split them into contiguous runs, ring ``i`` taking
  run ``i``. (A comparison baseline: it is not balanced.)
- ``cp`` with ``cp_layout="paper"`` (the paper's CP baseline, :class:`~.dims.CPLayout`): rank ``r`` holds the
  contiguous clean shard ``[r L/P, (r+1) L/P)`` and, in *every* noisy block, the two-ended token slice of offsets
  ``[r h, (r+1) h)`` and ``[B-(r+1) h, B-r h)`` with ``h = B/(2P)`` (one contiguous run of ``B/P`` offsets when
  ``B/P`` is odd), as the reference's ``active_query_offsets_for_context_rank`` deals them. Its noisy work is
  balanced exactly; its clean work is not: clean rows at the end of the sequence attend to the longest prefix, so the
  last rank does ``(2P-1)/P`` of the mean clean->clean work. ``B`` must be a multiple of ``P``.
- ``csbp`` with ``C = 1`` is valid (each rank holds the whole clean stream and gathers
  nothing); it is what ``P = 1`` needs, though ``bp`` is cheaper for ``P > 1``.

Every row's loss must count once per group, but ``bp`` and hybrid ``csbp`` compute some clean
rows on several ranks. :attr:`RankPlan.loss_clean_positions` names the clean positions whose
loss a rank counts: the positions of its own noisy blocks (``cp``: its own clean chunk).

**Noisy rows on a subset of the blocks** (``PlanConfig.noisy_blocks``; an encoder-decoder family whose
decoder denoises only the response blocks of a frame: its own layout, under ``hf_bdlm/models/``).
The clean stream is laid out as above over all ``N`` blocks (``cp`` as ``csbp`` with ``C = P``:
an encoder-decoder has two passes, each balanced on its own, so both are cut head-tail). The
subset is dealt as if it were a sequence of its own: the plan of ``len(noisy_blocks)`` blocks in
the same mode, its block ``j`` mapped to ``noisy_blocks[j]``. Its dual-end pairs ``(j, n-1-j)``
cost the same when the subset is a contiguous run (one response) and about the same otherwise, and
every rank gets the same number of noisy rows (the subset is padded to a multiple of ``2P``
blocks). With ``bp`` the rank owning the last noisy block holds the whole clean stream (as block
``N-1``'s owner does without a subset), the others the prefix up to their last owned block.
Each clean block is counted by one of the ranks holding it, dealt round robin by block index.

Example (CPU, instant)::

    python -c "from hf_bdlm.parallel.plan import ParallelDims, PlanConfig, make_plan; \\
print(make_plan(PlanConfig(ParallelDims(4, mode='csbp'), seq_len=64, block_size=4)).describe())"
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.masks import CLEAN, NOISY, MaskRule, keys_in_window
from ..attention.rows import RowMeta
from .dims import MODES, SCHEDULES, Mode, ParallelDims, Schedule  # noqa: F401  (re-exported)

Range = tuple[int, int]


@dataclass(frozen=True)
class PlanConfig:
    """The plan of one batch: a group's declared layout applied to sequences of one length.

    Parameters:
        dims (`ParallelDims`): the run's layout, held by reference (group size ``P``, clean ring ``C``, mode,
            schedule; its world size is not part of the plan: equal layouts on any world share their plans).
        seq_len (`int`): sequence length ``L`` (a multiple of ``dims.block_multiple()`` blocks).
        block_size (`int`): diffusion block size ``B``.
        noisy_blocks (`tuple[int, ...]`, *optional*): the blocks that have noisy rows, ascending
            (an encoder-decoder's canvas blocks); ``None``: every block. Their number must be a
            multiple of :func:`noisy_subset_multiple`.

    What the sequence must satisfy under the layout is checked here, at construction, naming the values and the fix;
    the layout's own rules were checked by ``ParallelDims``.
    """

    dims: ParallelDims
    seq_len: int
    block_size: int
    noisy_blocks: tuple[int, ...] | None = None

    def __post_init__(self):
        if not isinstance(self.dims, ParallelDims):
            raise TypeError(f"PlanConfig takes the layout as a ParallelDims, got {type(self.dims).__name__}.")
        for name in ("seq_len", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        dims, mode, schedule = self.dims, self.mode, self.schedule
        L, B = self.seq_len, self.block_size
        if L % B:
            raise ValueError(
                f"seq_len={L} is not a multiple of block_size={B}; pad the sequence to a multiple of {B}."
            )
        if self.noisy_blocks is not None:
            object.__setattr__(self, "noisy_blocks", tuple(int(b) for b in self.noisy_blocks))
            dims = _subset_rows_dims(dims)  # how the clean stream is cut when noisy rows cover a subset
        blocks, why = dims.block_multiple()
        multiple = blocks * B
        layout = f"mode={mode!r}" if mode is Mode.CP else f"mode={mode!r} with schedule={schedule!r}"
        if L // B < blocks:
            raise ValueError(
                f"seq_len={L} has {L // B} blocks of block_size={B}, fewer than the {blocks} that "
                f"{layout} needs ({why}); use a smaller group_size or a "
                f"longer sequence: pad the sequence to a multiple of {multiple}."
            )
        if L % multiple:
            raise ValueError(
                f"seq_len={L} is not a multiple of {multiple} ({blocks} blocks of block_size={B}), which "
                f"{layout} needs ({why}); pad the sequence to a multiple of {multiple}."
            )
        if self.noisy_blocks is not None:
            _check_noisy_blocks(self.noisy_blocks, L // B, noisy_subset_multiple(dims))
        if dims.is_paper_cp and B % dims.block_parallel_size:
            P = dims.block_parallel_size
            raise ValueError(
                f"block_parallel_cp_layout='paper' gives each of the group_size={P} ranks a token slice of every noisy "
                f"block, so block_size={B} must be a multiple of {P}; use a block size that is, a smaller group, or "
                "block_parallel_cp_layout='balanced'."
            )

    @classmethod
    def from_dims(cls, dims: ParallelDims, seq_len: int, block_size: int,
                  noisy_blocks: tuple[int, ...] | None = None) -> "PlanConfig":
        """The plan of one batch of sequences of length ``seq_len`` under a declared layout (noisy rows on
        ``noisy_blocks`` only, when given)."""
        return cls(dims, seq_len, block_size, noisy_blocks)

    # The layout's values, read from the one ParallelDims.
    @property
    def group_size(self) -> int:
        return self.dims.block_parallel_size

    @property
    def clean_ring_size(self) -> int:
        return self.dims.clean_ring_size

    @property
    def mode(self) -> Mode:
        return self.dims.mode

    @property
    def schedule(self) -> Schedule:
        return self.dims.schedule

    @property
    def num_blocks(self) -> int:
        return self.seq_len // self.block_size


def _subset_rows_dims(dims: ParallelDims) -> ParallelDims:
    """The layout whose clean shards and dealing a plan with ``noisy_blocks`` uses: ``cp`` as ``csbp`` with ``C = P``
    (both passes of an encoder-decoder cut head-tail, as context parallelism cuts each pass's rows; ``cp`` then differs
    from ``csbp`` only in what travels), the others (and the paper's CP baseline) as declared."""
    if dims.mode is not Mode.CP or dims.is_paper_cp:
        return dims
    return ParallelDims(dims.block_parallel_size, dims.block_parallel_size, Mode.CSBP, Schedule.DUAL_END)


def noisy_subset_multiple(dims: ParallelDims) -> int:
    """How many blocks a ``noisy_blocks`` subset must be a multiple of: ``2P`` (``dual_end``; ``cp``), ``P``
    (``contiguous``), ``1`` without sharding. Pad it with blocks nobody scores to reach it."""
    return _subset_rows_dims(dims).block_multiple()[0] if dims.is_sharded else 1


def subset_sequence_multiple(dims: ParallelDims, block_size: int) -> int:
    """The multiple a sequence (an encoder-decoder's frame) is padded to when its noisy rows cover a subset of
    blocks."""
    return _subset_rows_dims(dims).required_multiple(block_size)


def _check_noisy_blocks(blocks: tuple[int, ...], num_blocks: int, multiple: int) -> None:
    if any(b < 0 or b >= num_blocks for b in blocks) or any(a >= b for a, b in zip(blocks, blocks[1:])):
        raise ValueError(
            f"noisy_blocks must be ascending, distinct block indices in [0, {num_blocks}), got {list(blocks)[:16]}"
            f"{'...' if len(blocks) > 16 else ''}."
        )
    if not blocks or len(blocks) % multiple:
        raise ValueError(
            f"noisy_blocks has {len(blocks)} blocks; this layout deals them in equal shares and needs a positive "
            f"multiple of {multiple}: pad the subset with blocks whose rows nobody scores."
        )


def _block_ranges(blocks: tuple[int, ...], block_size: int) -> tuple[Range, ...]:
    """Position ranges covered by ascending blocks, adjacent blocks merged."""
    ranges: list[list[int]] = []
    for b in blocks:
        if ranges and ranges[-1][1] == b * block_size:
            ranges[-1][1] = (b + 1) * block_size
        else:
            ranges.append([b * block_size, (b + 1) * block_size])
    return tuple((s, e) for s, e in ranges)


def _offset_ranges(blocks: tuple[int, ...], block_size: int, offsets: tuple[Range, ...]) -> tuple[Range, ...]:
    """Position ranges of the token ``offsets`` inside each of ``blocks``, ascending, adjacent ranges merged."""
    ranges: list[list[int]] = []
    for b in blocks:
        for s, e in offsets:
            start, stop = b * block_size + s, b * block_size + e
            if ranges and ranges[-1][1] == start:
                ranges[-1][1] = stop
            else:
                ranges.append([start, stop])
    return tuple((s, e) for s, e in ranges)


def paper_cp_offsets(block_size: int, group_size: int, rank: int) -> tuple[Range, ...]:
    """The token offsets of every noisy block that ``rank`` holds under the paper's CP baseline: a two-ended slice of
    ``B/P`` offsets (``[r h, (r+1) h)`` and ``[B-(r+1) h, B-r h)``, ``h = B/(2P)``), or one contiguous run when ``B/P``
    is odd. Over the group every offset is held exactly once."""
    per_rank = block_size // group_size
    if per_rank % 2:
        return ((rank * per_rank, (rank + 1) * per_rank),)
    h = per_rank // 2
    head, tail = (rank * h, (rank + 1) * h), (block_size - (rank + 1) * h, block_size - rank * h)
    return (head, tail) if head[1] < tail[0] else ((head[0], tail[1]),)


def _range_index(ranges: tuple[Range, ...]) -> torch.Tensor:
    if not ranges:
        return torch.empty(0, dtype=torch.long)
    return torch.cat([torch.arange(s, e, dtype=torch.long) for s, e in ranges])


def _empty_rows(doc: torch.Tensor | None) -> RowMeta:
    empty = torch.empty(0, dtype=torch.long)
    return RowMeta(empty, empty.clone(), None if doc is None else doc[:, :0])


@dataclass(frozen=True)
class RankPlan:
    """What one rank of the group holds.

    Parameters:
        rank (`int`): rank within the group.
        ring (`int`), ring_rank (`int`): its clean ring and its rank inside it.
        noisy_blocks (`tuple[int, ...]`): owned noisy blocks, ascending.
        clean_positions (`tuple[tuple[int, int], ...]`): half-open clean position ranges held
            locally, ascending (``csbp``: its shard; ``bp``: ``(0, prefix_end)``; ``cp``: the
            clean part of its chunks).
        loss_clean_positions (`tuple[tuple[int, int], ...]`): clean positions whose loss this
            rank counts; over the group every position is counted exactly once.
        seq_len (`int`), block_size (`int`): ``L`` and ``B`` of the plan.
        noisy_offsets (`tuple[tuple[int, int], ...]`, *optional*): the token offsets of each owned noisy block that
            the rank holds (the paper's CP baseline holds a slice of every block); ``None``: whole blocks.
    """

    rank: int
    ring: int
    ring_rank: int
    noisy_blocks: tuple[int, ...]
    clean_positions: tuple[Range, ...]
    loss_clean_positions: tuple[Range, ...]
    seq_len: int
    block_size: int
    noisy_offsets: tuple[Range, ...] | None = None

    @property
    def noisy_rows_per_block(self) -> int:
        """Rows this rank holds of each of its noisy blocks: ``B``, or the width of its token slice."""
        return self.block_size if self.noisy_offsets is None else sum(e - s for s, e in self.noisy_offsets)

    @property
    def local_noisy_rows(self) -> int:
        return len(self.noisy_blocks) * self.noisy_rows_per_block

    def noisy_offset_index(self) -> torch.LongTensor:
        """Offsets inside a block of the rows this rank holds of each of its noisy blocks, ascending."""
        return _range_index(((0, self.block_size),) if self.noisy_offsets is None else self.noisy_offsets)

    @property
    def local_clean_rows(self) -> int:
        return sum(e - s for s, e in self.clean_positions)

    @property
    def noisy_ranges(self) -> tuple[Range, ...]:
        """Position ranges of the held noisy rows (owned blocks, or their token slices), adjacent ranges merged."""
        if self.noisy_offsets is None:
            return _block_ranges(self.noisy_blocks, self.block_size)
        return _offset_ranges(self.noisy_blocks, self.block_size, self.noisy_offsets)

    @property
    def num_rows(self) -> int:
        return self.local_noisy_rows + self.local_clean_rows

    def noisy_positions(self) -> torch.LongTensor:
        """Global positions of the local noisy rows, in layout order."""
        return _range_index(self.noisy_ranges)

    def clean_position_index(self) -> torch.LongTensor:
        """Global positions of the local clean rows, in layout order."""
        return _range_index(self.clean_positions)

    def rows(self, doc: torch.Tensor | None = None) -> RowMeta:
        """Local rows in layout order; ``doc`` (``[batch, L]`` document ids) is gathered per row."""
        noisy, clean = self.noisy_positions(), self.clean_position_index()
        pos = torch.cat([noisy, clean])
        stream = torch.cat([torch.full_like(noisy, NOISY), torch.full_like(clean, CLEAN)])
        return RowMeta(stream, pos, None if doc is None else doc[:, pos])

    def global_row_index(self) -> torch.LongTensor:
        """Index of each local row into the ``2L`` vectorized rows, in layout order."""
        return torch.cat([self.noisy_positions(), self.seq_len + self.clean_position_index()])

    def loss_row_mask(self) -> torch.BoolTensor:
        """Which local rows count in this rank's loss (all noisy rows, the owned clean rows)."""
        clean = self.clean_position_index()
        owned = torch.zeros_like(clean, dtype=torch.bool)
        for s, e in self.loss_clean_positions:
            owned |= (clean >= s) & (clean < e)
        return torch.cat([torch.ones(self.local_noisy_rows, dtype=torch.bool), owned])


@dataclass(frozen=True)
class GroupPlan:
    """The layout of every rank of one block-parallel group (see :func:`make_plan`)."""

    config: PlanConfig
    ranks: tuple[RankPlan, ...]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < len(self.ranks):
            raise ValueError(f"rank must be in [0, {len(self.ranks)}) for group_size={len(self.ranks)}, got {rank}.")

    def ring_members(self, rank: int) -> tuple[int, ...]:
        """Group ranks in the same clean ring as ``rank``, in ring-rank order: the ranks it exchanges K/V with (under
        ``cp`` the ring is the whole group, ``C = P``)."""
        self._check_rank(rank)
        C = self.config.clean_ring_size
        start = rank // C * C
        return tuple(range(start, start + C))

    def gathered_key_rows(self, rank: int, doc: torch.Tensor | None = None) -> RowMeta:
        """Rows whose K/V ``rank`` receives by communication, in gathered order.

        ``cp``: all ``2L`` rows, concatenated over group ranks ``0..P-1`` (own rows included).
        ``csbp``: the ring's clean rows, concatenated over ring ranks (own clean rows
        included); the rank's noisy rows are local keys and never travel. ``bp``: none.
        """
        self._check_rank(rank)
        if not self.config.mode.exchanges_kv:
            return _empty_rows(doc)
        return RowMeta.cat([self.sent_rows(member, doc) for member in self.ring_members(rank)])

    def exchange_members(self, rank: int) -> tuple[int, ...]:
        """The group ranks whose K/V ``rank`` attends to, itself included, in ring order: its clean ring (the whole
        group under ``cp``), or itself alone under ``bp``."""
        return self.ring_members(rank) if self.config.mode.exchanges_kv else (rank,)

    def sent_ranges(self, rank: int) -> list[Range]:
        """Position ranges of :meth:`sent_rows`: the clean ranges, preceded under ``cp`` by the noisy blocks' (a
        position may then appear in both streams)."""
        rp = self.ranks[rank]
        noisy = list(rp.noisy_ranges) if self.config.mode.sends_noisy_kv else []
        return noisy + list(rp.clean_positions)

    def sent_row_start(self, rank: int) -> int:
        """Index of the first row ``rank`` sends among its rows: after its noisy rows when they stay local (``csbp``),
        0 when they travel too (``cp``)."""
        return 0 if self.config.mode.sends_noisy_kv else self.ranks[rank].local_noisy_rows

    def sent_rows(self, rank: int, doc: torch.Tensor | None = None) -> RowMeta:
        """The rows whose K/V ``rank`` sends to its clean ring (``cp``: all its rows, ``csbp``: its clean rows)."""
        rows = self.ranks[rank].rows(doc)
        return rows.slice(self.sent_row_start(rank), rows.num_rows)

    def gathered_key_global_index(self, rank: int) -> torch.LongTensor:
        """Index into the ``2L`` vectorized rows of :meth:`gathered_key_rows`, in gathered order."""
        self._check_rank(rank)
        if not self.config.mode.exchanges_kv:
            return torch.empty(0, dtype=torch.long)
        return torch.cat([self.ranks[m].global_row_index()[self.sent_row_start(m):]
                          for m in self.ring_members(rank)])

    def describe(self) -> str:
        """One line per rank: ring, owned noisy blocks, clean ranges, row counts."""
        c = self.config
        lines = [
            f"mode={c.mode}{' (paper layout)' if c.dims.is_paper_cp else ''} schedule={c.schedule} L={c.seq_len} B={c.block_size} N={c.num_blocks} "
            f"P={c.group_size} C={c.clean_ring_size}"
        ]
        for r in self.ranks:
            sliced = "" if r.noisy_offsets is None else f" offsets {list(r.noisy_offsets)}"
            lines.append(
                f"rank {r.rank}: ring {r.ring}.{r.ring_rank} noisy blocks {list(r.noisy_blocks)}{sliced} "
                f"clean {list(r.clean_positions)} rows {r.local_noisy_rows}+{r.local_clean_rows} "
                f"gathered {self.gathered_key_global_index(r.rank).numel()}"
            )
        return "\n".join(lines)


def _cp_ranks(cfg: PlanConfig) -> list[RankPlan]:
    P, B, N = cfg.group_size, cfg.block_size, cfg.num_blocks
    k = N // P  # blocks per chunk of L/P rows
    ranks = []
    for r in range(P):
        # Chunk r (< P) is noisy blocks [rk, (r+1)k); chunk 2P-1-r is clean chunk P-1-r.
        clean = (((P - 1 - r) * k * B, (P - r) * k * B),)
        ranks.append(RankPlan(r, 0, r, tuple(range(r * k, (r + 1) * k)), clean, clean, cfg.seq_len, B))
    return ranks


def _paper_cp_ranks(cfg: PlanConfig) -> list[RankPlan]:
    """The paper's CP baseline: contiguous clean shards, a token slice of every noisy block (module docstring)."""
    P, B, N = cfg.group_size, cfg.block_size, cfg.num_blocks
    k = N // P
    blocks = tuple(range(N))
    ranks = []
    for r in range(P):
        clean = ((r * k * B, (r + 1) * k * B),)
        ranks.append(RankPlan(r, 0, r, blocks, clean, clean, cfg.seq_len, B, paper_cp_offsets(B, P, r)))
    return ranks


def _bp_ranks(cfg: PlanConfig) -> list[RankPlan]:
    P, B, N = cfg.group_size, cfg.block_size, cfg.num_blocks
    ranks = []
    for r in range(P):
        if cfg.schedule is Schedule.DUAL_END:
            blocks = tuple(sorted(b for j in range(r, N // 2, P) for b in (j, N - 1 - j)))
        else:
            blocks = tuple(range(r * N // P, (r + 1) * N // P))
        # Noisy block j needs clean blocks < j; the prefix also spans the owned blocks so that
        # their clean rows (next-token / AR losses) are computed where they are counted.
        prefix = ((0, (blocks[-1] + 1) * B),)
        ranks.append(RankPlan(r, r, 0, blocks, prefix, _block_ranges(blocks, B), cfg.seq_len, B))
    return ranks


def _csbp_ranks(cfg: PlanConfig) -> list[RankPlan]:
    P, C, B, N = cfg.group_size, cfg.clean_ring_size, cfg.block_size, cfg.num_blocks
    rings = P // C
    ranks = []
    for r in range(P):
        ring, c = divmod(r, C)
        if cfg.schedule is Schedule.DUAL_END:
            k = N // (2 * C)
            shard = tuple(range(c * k, (c + 1) * k)) + tuple(range((2 * C - 1 - c) * k, (2 * C - c) * k))
            # Chunks c and 2C-1-c mirror each other: their blocks are the pairs (j, N-1-j), j in chunk c.
            # Whole runs of pairs per ring keep the noisy rows in few contiguous ranges; every
            # pair costs the same, so runs balance as well as any dealing.
            m = k // rings
            pairs = range(c * k + ring * m, c * k + (ring + 1) * m)
            blocks = tuple(sorted(b for j in pairs for b in (j, N - 1 - j)))
        else:
            k = N // C
            shard = tuple(range(c * k, (c + 1) * k))
            m = k // rings
            blocks = tuple(range(c * k + ring * m, c * k + (ring + 1) * m))
        ranks.append(
            RankPlan(r, ring, c, blocks, _block_ranges(shard, B), _block_ranges(blocks, B), cfg.seq_len, B)
        )
    return ranks


def _subset_ranks(cfg: PlanConfig) -> list[RankPlan]:
    """Noisy rows on ``cfg.noisy_blocks`` only (see the module docstring)."""
    P, B, L = cfg.group_size, cfg.block_size, cfg.seq_len
    rows = _subset_rows_dims(cfg.dims)
    mode = rows.mode
    subset = cfg.noisy_blocks
    dealt = make_plan(PlanConfig(rows, len(subset) * B, B))
    owned = [tuple(subset[j] for j in r.noisy_blocks) for r in dealt.ranks]
    if mode is Mode.BP:
        last = max(range(P), key=lambda r: owned[r][-1])
        clean = [((0, L if r == last else (owned[r][-1] + 1) * B),) for r in range(P)]
    else:
        clean = [r.clean_positions for r in make_plan(PlanConfig(rows, L, B)).ranks]
    held = torch.zeros(P, L // B, dtype=torch.bool)
    for r in range(P):
        for s, e in clean[r]:
            held[r, s // B : e // B] = True
    # Block b is counted by its (b mod holders)-th holder: the holder whose running count of holders reaches it.
    choice = torch.arange(L // B) % held.sum(0) + 1
    counted = held & (held.long().cumsum(0) == choice)
    return [
        RankPlan(r, dealt.ranks[r].ring, dealt.ranks[r].ring_rank, owned[r], clean[r],
                 _block_ranges(tuple(counted[r].nonzero().flatten().tolist()), B), L, B, dealt.ranks[r].noisy_offsets)
        for r in range(P)
    ]


def make_plan(cfg: PlanConfig) -> GroupPlan:
    """Build the layout of every rank of a group. ``cfg`` is validated when constructed."""
    if cfg.noisy_blocks is not None:
        return GroupPlan(cfg, tuple(_subset_ranks(cfg)))
    if cfg.dims.is_paper_cp:
        return GroupPlan(cfg, tuple(_paper_cp_ranks(cfg)))
    build = {Mode.CP: _cp_ranks, Mode.BP: _bp_ranks, Mode.CSBP: _csbp_ranks}[cfg.mode]
    return GroupPlan(cfg, tuple(build(cfg)))


def window_exchange(me: int, queries: list[RowMeta], sent: list[RowMeta],
                    rule: MaskRule) -> tuple[torch.Tensor, list[int], list[int], RowMeta]:
    """All-to-all lists of a sliding-window layer: which sent rows each member needs from each other member.

    ``queries[m]`` are the query rows member ``m`` runs, ``sent[m]`` the rows it offers; ``me`` is this rank's
    index among the members. A row is needed when some query's window and the stream table reach it
    (:func:`~hf_bdlm.attention.masks.keys_in_window` with the keys' streams): a noisy query reaches clean rows before
    its block and noisy rows of its own block only, a clean query no noisy row. Documents are not consulted (the
    lists serve every item of a batch). The rank's own rows are a local source: nothing is exchanged with itself.

    Returns ``(send_index, send_counts, recv_counts, recv_rows)``: indices into ``sent[me]`` for peer 0, then
    peer 1, ...; the rows sent to and received from each member; the received rows, in member order.
    """

    def needed(requester: int, owner: int) -> torch.Tensor:
        q, k = queries[requester], sent[owner]
        if q.num_rows == 0 or k.num_rows == 0:
            return torch.empty(0, dtype=torch.long)
        reached = keys_in_window(q.stream.cpu(), q.pos.cpu(), k.pos.cpu(), rule, k_stream=k.stream.cpu())
        return reached.nonzero().flatten()

    send_parts, send_counts, recv_counts, recv_rows = [], [], [], []
    for peer in range(len(sent)):
        if peer == me:
            send_parts.append(torch.empty(0, dtype=torch.long))
            send_counts.append(0)
            recv_counts.append(0)
            continue
        out = needed(peer, me)
        send_parts.append(out)
        send_counts.append(int(out.numel()))
        received = needed(me, peer)
        recv_counts.append(int(received.numel()))
        recv_rows.append(sent[peer].select(received.to(sent[peer].pos.device)))
    return torch.cat(send_parts), send_counts, recv_counts, RowMeta.cat(recv_rows)
