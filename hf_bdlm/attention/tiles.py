"""Planning block-sparse attention: which dense kernel calls cover exactly the allowed pairs.

Pure functions of row metadata (no tensors of activations): rows are cut into *chunks* (runs
of consecutive positions of one stream in one block and document), every (query chunk, key
chunk) tile is classified by :func:`hf_bdlm.attention.masks.tile_classes`, and the allowed
tiles become a short list of :class:`KernelCall`:

- consecutive fully allowed key chunks of one source merge into one contiguous key range, so
  a clean query block attends to its whole prefix in one call without any mask (the CPU
  kernel is fastest without a mask);
- query chunks that share a key range share a call (e.g. clean block ``b`` and noisy block
  ``b + 1`` both see the clean prefix ``[0, (b + 1) B)`` under ``block_causal``);
- small equally shaped tiles are batched into one call (the noisy block diagonal: ``N``
  ``B x B`` tiles become one kernel call over a batch of ``N`` blocks);
- partially allowed tiles (token-causal diagonal, sliding-window edge) get an exact mask built
  by the rule's predicate;
- consecutive chunks of one stream form *groups* of up to ``group_rows`` rows (512 by
  default). A group tile whose chunk tiles are all full joins the unmasked ranges above; one
  that is dense enough (at least 40% of its pairs allowed, e.g. the block-triangular region
  next to the diagonal) runs as one masked call; the rest (the noisy block diagonal, window
  edges) is planned chunk by chunk: far fewer kernel calls for a few percent more pairs
  computed and masked out (``python -m hf_bdlm.benchmarks.attention --compare-block-tiles``
  measures it; docs/benchmarks.md has the numbers).
  ``group_rows=0`` plans chunk by chunk only: every mask is then a causal band or a window
  edge.

A plan is built once per forward and layer kind and reused by every layer.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from .masks import TILE_FULL, TILE_NONE, TILE_PARTIAL, MaskRule, allowed, tile_classes
from .rows import RowMeta

# Tiles up to this many key rows (in units of the block size) are batched when equally shaped.
_BATCH_MAX_KEY_BLOCKS = 2
# Groups of consecutive chunks up to this many rows are planned as one tile when dense enough.
DEFAULT_GROUP_ROWS = 512
# A group tile runs as one masked call when at least this fraction of its pairs is allowed.
_MIN_DENSITY = 0.4


@dataclass(frozen=True)
class Chunks:
    """Chunks of a row set: row range ``[start, end)``, stream, block, document, first/last position."""

    start: torch.Tensor
    end: torch.Tensor
    stream: torch.Tensor
    block: torch.Tensor
    doc: torch.Tensor | None
    first: torch.Tensor
    last: torch.Tensor

    @property
    def count(self) -> int:
        return int(self.start.shape[0])


def split_chunks(rows: RowMeta, block_size: int) -> Chunks:
    """Cut rows (one batch item) into runs of one stream, one block, consecutive positions, one document."""
    t = rows.num_rows
    if t == 0:
        empty = torch.zeros(0, dtype=torch.long)
        return Chunks(empty, empty, empty, empty, None if rows.doc is None else empty, empty, empty)
    pos = rows.pos.cpu()
    stream = rows.stream.cpu()
    block = torch.div(pos, block_size, rounding_mode="floor")
    brk = torch.zeros(t, dtype=torch.bool)
    brk[0] = True
    brk[1:] = (stream[1:] != stream[:-1]) | (block[1:] != block[:-1]) | (pos[1:] != pos[:-1] + 1)
    doc = None
    if rows.doc is not None:
        if rows.doc.shape[0] != 1:
            raise ValueError("split_chunks takes the rows of one batch item (doc of shape [1, T]).")
        d = rows.doc[0].cpu()
        brk[1:] |= d[1:] != d[:-1]
    start = brk.nonzero().flatten()
    end = torch.cat([start[1:], torch.tensor([t])])
    if rows.doc is not None:
        doc = rows.doc[0].cpu()[start]
    return Chunks(start, end, stream[start], block[start], doc, pos[start], pos[end - 1])


@dataclass(frozen=True, eq=False)
class KernelCall:
    """One dense kernel call.

    ``q_rows``/``k_rows`` are a ``(start, end)`` range or an index tensor ``[n, c]``; with
    ``n > 1`` the call is batched: pair ``i`` is query rows ``q_rows[i]`` with key rows
    ``k_rows[i]``. ``mask`` (``[cq, ck]`` boolean, shared by the batch) is ``None`` when every
    pair is allowed; ``empty_rows`` marks query rows the mask leaves without any key.
    """

    q_rows: tuple[int, int] | torch.Tensor
    source: int
    k_rows: tuple[int, int] | torch.Tensor
    mask: torch.Tensor | None = None
    empty_rows: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class TilePlan:
    calls: tuple[KernelCall, ...]
    num_query_rows: int
    key_rows: tuple[int, ...]

    def allowed_pairs(self) -> int:
        """Query-key pairs the plan computes (for cost accounting and tests)."""
        total = 0
        for c in self.calls:
            n_q = c.q_rows[1] - c.q_rows[0] if isinstance(c.q_rows, tuple) else c.q_rows.numel()
            if isinstance(c.q_rows, tuple) or c.q_rows.shape[0] == 1:
                n_k = c.k_rows[1] - c.k_rows[0] if isinstance(c.k_rows, tuple) else c.k_rows.numel()
                total += int(c.mask.sum()) if c.mask is not None else n_q * n_k
            else:
                n = c.q_rows.shape[0]
                per = int(c.mask.sum()) if c.mask is not None else c.q_rows.shape[1] * c.k_rows.shape[1]
                total += n * per
        return total


def _rows_spec(index: list[torch.Tensor]):
    """A single range when the rows are contiguous, else an index ``[1, n]``."""
    idx = torch.cat(index)
    first = int(idx[0])
    if bool((idx == torch.arange(first, first + idx.numel())).all()):
        return (first, first + idx.numel())
    return idx.view(1, -1)


def _groups(chunks: Chunks, max_rows: int) -> torch.Tensor:
    """Group id of every chunk: runs of consecutive chunks of one stream with at most ``max_rows`` rows.

    ``max_rows <= 0`` keeps every chunk alone (the fine plan).
    """
    ids = torch.zeros(chunks.count, dtype=torch.long)
    group, rows = 0, 0
    for i in range(chunks.count):
        n = int(chunks.end[i] - chunks.start[i])
        if i and (max_rows <= 0 or rows + n > max_rows or int(chunks.stream[i]) != int(chunks.stream[i - 1])):
            group, rows = group + 1, 0
        ids[i] = group
        rows += n
    return ids


def _group_sum(x: torch.Tensor, q_group: torch.Tensor, k_group: torch.Tensor, nq: int, nk: int) -> torch.Tensor:
    """Sums of a per-tile matrix over (query group, key group), in int64."""
    per_q = torch.zeros(nq, x.shape[1], dtype=x.dtype).index_add_(0, q_group, x)
    return torch.zeros(nq, nk, dtype=torch.int64).index_add_(1, k_group, per_q.to(torch.int64))


def _runs(full: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(row, first, last)`` of every run of consecutive ``True`` along the last dimension."""
    prev = torch.zeros_like(full)
    prev[:, 1:] = full[:, :-1]
    nxt = torch.zeros_like(full)
    nxt[:, :-1] = full[:, 1:]
    starts = (full & ~prev).nonzero().tolist()
    ends = (full & ~nxt).nonzero().tolist()
    return [(qi, k0, k1) for (qi, k0), (_, k1) in zip(starts, ends)]


def _bounds(chunks: Chunks, group: torch.Tensor, n: int) -> tuple[list[int], list[int]]:
    first = torch.full((n,), chunks.count, dtype=torch.long).scatter_reduce_(
        0, group, torch.arange(chunks.count), "amin")
    last = torch.zeros(n, dtype=torch.long).scatter_reduce_(0, group, torch.arange(chunks.count), "amax")
    return chunks.start[first].tolist(), chunks.end[last].tolist()


def plan_attention(
    q_rows: RowMeta, k_sources: list[RowMeta], rule: MaskRule, group_rows: int = DEFAULT_GROUP_ROWS
) -> TilePlan:
    """Plan block-sparse attention of ``q_rows`` over key sources (all of one batch item).

    ``group_rows`` > 0 lets the planner cover a dense region of up to ``group_rows x group_rows``
    rows with one masked call (see the module docstring); ``0`` plans block-sized tiles only,
    each mask a band of the token-causal diagonal or a window edge.
    """
    qc = split_chunks(q_rows, rule.block_size)
    q_group = _groups(qc, group_rows)
    nqg = int(q_group.max()) + 1 if qc.count else 0
    q_lo, q_hi = _bounds(qc, q_group, nqg)
    shared: dict[tuple, list[torch.Tensor]] = defaultdict(list)  # (source, ks, ke) -> query row ranges
    masked: list[tuple[torch.Tensor, int, int, int, torch.Tensor]] = []  # (q index, source, ks, ke, mask)
    for source, k_rows in enumerate(k_sources):
        kc = split_chunks(k_rows, rule.block_size)
        if kc.count == 0 or qc.count == 0:
            continue
        full, pairs, tiles = _classify_tiles(q_rows, qc, k_rows, kc, rule)
        # Groups of tiles: all full -> one unmasked range; dense enough -> one masked call; else tile by tile.
        k_group = _groups(kc, group_rows)
        nkg = int(k_group.max()) + 1
        k_lo, k_hi = _bounds(kc, k_group, nkg)
        g_full, g_masked = _classify_groups(pairs, full, q_group, k_group, q_lo, q_hi, k_lo, k_hi)
        for qg, kg0, kg1 in _runs(g_full):
            shared[(source, k_lo[kg0], k_hi[kg1])].append(torch.arange(q_lo[qg], q_hi[qg]))
        for qg, kg in g_masked.nonzero().tolist():
            qs, qe, ks, ke = q_lo[qg], q_hi[qg], k_lo[kg], k_hi[kg]
            masked.append((torch.arange(qs, qe), source, ks, ke, _tile_mask(q_rows, qs, qe, k_rows, ks, ke, rule)))
        # Tile by tile where a group is neither.
        fine = ~(g_full | g_masked)[q_group][:, k_group]
        _add_fine_tiles(source, qc, kc, full, fine, tiles, shared, masked)
    calls, batchable = _unmasked_calls(shared, _BATCH_MAX_KEY_BLOCKS * rule.block_size)
    masks = _file_masked_tiles(masked, batchable)
    calls += _batched_calls(batchable, masks)
    # Calls run in source order: sources listed first (local K/V) are computed while later ones
    # (gathered K/V) may still be in flight.
    calls.sort(key=lambda c: c.source)
    return TilePlan(tuple(calls), q_rows.num_rows, tuple(k.num_rows for k in k_sources))


def _classify_tiles(
    q_rows: RowMeta, qc: Chunks, k_rows: RowMeta, kc: Chunks, rule: MaskRule
) -> tuple[torch.Tensor, torch.Tensor, dict[tuple[int, int], torch.Tensor]]:
    """Which (query chunk, key chunk) tiles are fully allowed, the allowed pairs of every tile, and the masks of the
    partially allowed ones.

    Every partially allowed tile gets its exact mask: one that allows every pair counts as full, one that allows
    none as empty; the others are returned by ``(query chunk, key chunk)``. Returns ``(full, pairs, tiles)``.
    """
    classes = tile_classes(qc, kc, rule)
    # Per-tile bookkeeping in int32 (a tile holds at most B x B pairs): at 256K tokens the tile matrix is large.
    q_len = (qc.end - qc.start).to(torch.int32)
    k_len = (kc.end - kc.start).to(torch.int32)
    pairs = torch.zeros(classes.shape, dtype=torch.int32)  # allowed pairs of every tile
    tiles: dict[tuple[int, int], torch.Tensor] = {}
    for qi, kj in (classes == TILE_PARTIAL).nonzero().tolist():
        qs, qe, ks, ke = int(qc.start[qi]), int(qc.end[qi]), int(kc.start[kj]), int(kc.end[kj])
        tile = _tile_mask(q_rows, qs, qe, k_rows, ks, ke, rule)
        count = int(tile.sum())
        if count == tile.numel():
            classes[qi, kj] = TILE_FULL
        else:
            classes[qi, kj] = TILE_NONE
            if count:
                tiles[(qi, kj)] = tile
                pairs[qi, kj] = count
    full = classes == TILE_FULL
    pairs[full] = (q_len[:, None] * k_len[None, :])[full]
    return full, pairs, tiles


def _classify_groups(
    pairs: torch.Tensor, full: torch.Tensor, q_group: torch.Tensor, k_group: torch.Tensor,
    q_lo: list[int], q_hi: list[int], k_lo: list[int], k_hi: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which (query group, key group) tiles are all full (``g_full``) and which are dense enough to run as one masked
    call (``g_masked``: several chunk tiles, some pairs allowed, at least :data:`_MIN_DENSITY` of the area)."""
    nqg, nkg = len(q_lo), len(k_lo)
    g_pairs = _group_sum(pairs, q_group, k_group, nqg, nkg)
    g_tiles = torch.bincount(q_group, minlength=nqg)[:, None] * torch.bincount(k_group, minlength=nkg)[None, :]
    g_full = _group_sum(full.to(torch.int32), q_group, k_group, nqg, nkg) == g_tiles
    q_size = torch.tensor(q_hi) - torch.tensor(q_lo)
    area = q_size[:, None] * (torch.tensor(k_hi) - torch.tensor(k_lo))
    g_masked = ~g_full & (g_tiles > 1) & (g_pairs >= _MIN_DENSITY * area) & (g_pairs > 0)
    return g_full, g_masked


def _add_fine_tiles(
    source: int, qc: Chunks, kc: Chunks, full: torch.Tensor, fine: torch.Tensor,
    tiles: dict[tuple[int, int], torch.Tensor], shared: dict[tuple, list[torch.Tensor]], masked: list,
) -> None:
    """Plans the chunk tiles of the ``fine`` groups one by one: runs of full key chunks join the unmasked ranges of
    ``shared``, partial tiles join ``masked`` with their mask."""
    for qi, kj0, kj1 in _runs(full & fine):
        q_range = torch.arange(int(qc.start[qi]), int(qc.end[qi]))
        shared[(source, int(kc.start[kj0]), int(kc.end[kj1]))].append(q_range)
    for (qi, kj), tile in tiles.items():
        if fine[qi, kj]:
            masked.append((torch.arange(int(qc.start[qi]), int(qc.end[qi])), source, int(kc.start[kj]),
                           int(kc.end[kj]), tile))


def _unmasked_calls(
    shared: dict[tuple, list[torch.Tensor]], limit: int
) -> tuple[list[KernelCall], dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]]]:
    """One call per unmasked key range shared by several query chunks or longer than ``limit`` rows; the others are
    left in the returned ``batchable`` (by source and shape) to be batched with equally shaped tiles."""
    calls: list[KernelCall] = []
    batchable: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
    for (source, ks, ke), q_parts in shared.items():
        if len(q_parts) == 1 and ke - ks <= limit:
            batchable[(source, q_parts[0].numel(), ke - ks, None)].append((q_parts[0], torch.arange(ks, ke)))
        else:
            calls.append(KernelCall(_rows_spec(q_parts), source, (ks, ke)))
    return calls, batchable


def _file_masked_tiles(masked: list, batchable: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]]) -> list:
    """Adds every masked tile to ``batchable`` by source, shape and mask; returns the distinct masks (equal masks
    share one index)."""
    mask_index: dict[bytes, int] = {}
    masks: list[torch.Tensor] = []
    for q_idx, source, ks, ke, tile in masked:
        mi = mask_index.setdefault(tile.numpy().tobytes() + str(tuple(tile.shape)).encode(), len(masks))
        if mi == len(masks):
            masks.append(tile)
        batchable[(source, q_idx.numel(), ke - ks, mi)].append((q_idx, torch.arange(ks, ke)))
    return masks


def _batched_calls(
    batchable: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]], masks: list[torch.Tensor]
) -> list[KernelCall]:
    """The calls of every batchable group of equally shaped tiles, one per round of :func:`_rounds`."""
    calls: list[KernelCall] = []
    for (source, _, _, mi), group in batchable.items():
        mask = None if mi is None else masks[mi]
        empty = None
        if mask is not None and not bool(mask.any(-1).all()):
            empty = ~mask.any(-1)
        for pairs in _rounds(group):
            calls.append(_batched_call(pairs, source, mask, empty))
    return calls


def _rounds(group: list[tuple[torch.Tensor, torch.Tensor]]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Splits a group of (query rows, key rows) pairs into rounds in which every query chunk appears at most once.

    A batched call merges its results into its query rows at once, so a query chunk may appear only once per call:
    pairs repeating a chunk go to a later call.
    """
    rounds: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    seen: dict[int, int] = defaultdict(int)
    for pair in group:
        r = seen[int(pair[0][0])]
        seen[int(pair[0][0])] += 1
        if r == len(rounds):
            rounds.append([])
        rounds[r].append(pair)
    return rounds


def _tile_mask(q_rows: RowMeta, qs: int, qe: int, k_rows: RowMeta, ks: int, ke: int, rule: MaskRule) -> torch.Tensor:
    """Exact mask of query rows ``[qs, qe)`` over key rows ``[ks, ke)`` from the rule's predicate."""
    q_doc = None if q_rows.doc is None else q_rows.doc[0, qs:qe, None].cpu()
    k_doc = None if k_rows.doc is None else k_rows.doc[0, None, ks:ke].cpu()
    return allowed(
        q_rows.stream[qs:qe, None].cpu(),
        q_rows.pos[qs:qe, None].cpu(),
        q_doc,
        k_rows.stream[None, ks:ke].cpu(),
        k_rows.pos[None, ks:ke].cpu(),
        k_doc,
        rule,
    )


def _batched_call(pairs, source: int, mask, empty) -> KernelCall:
    q_idx = torch.stack([p[0] for p in pairs])
    k_idx = torch.stack([p[1] for p in pairs])
    if q_idx.shape[0] == 1:
        q_spec = (int(q_idx[0, 0]), int(q_idx[0, -1]) + 1)
        k_spec = (int(k_idx[0, 0]), int(k_idx[0, -1]) + 1)
        return KernelCall(q_spec, source, k_spec, mask, empty)
    return KernelCall(q_idx, source, k_idx, mask, empty)


def batch_plans(q_rows, k_rows, rule, cache: dict, batch: int, group_rows: int = DEFAULT_GROUP_ROWS) -> list:
    """One plan for the whole batch, or one per batch item when packed documents differ (cached in ``cache``)."""
    key = ("plan", rule, group_rows)
    plans = cache.get(key)
    if plans is None:
        docs = [q_rows.doc] + [r.doc for r in k_rows]
        same = all(d is None for d in docs) or all(bool((d == d[:1]).all()) for d in docs if d is not None)
        items = [0] if same else list(range(batch))
        plans = [
            plan_attention(q_rows.batch_item(i), [r.batch_item(i) for r in k_rows], rule, group_rows) for i in items
        ]
        cache[key] = plans
    return plans
