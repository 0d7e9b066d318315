"""FlexAttention block masks built from the block structure, never from a per-element mask.

FlexAttention skips the ``TILE x TILE`` tiles of the score matrix a :class:`BlockMask` leaves out, runs *full* tiles
without calling ``mask_mod`` and calls it only on *partial* ones. ``create_block_mask`` finds out which is which by
evaluating ``mask_mod`` for every (query, key) pair: an ``(2L)^2`` cost (a materialised tensor, uncompiled) at the
lengths the paper trains at. Here the index arrays come from the rule itself (:func:`~.masks.key_reach`):

- rows are cut into *runs*: maximal stretches of one stream at consecutive positions (the single-device layout has
  two, a csbp rank a handful, the paper's CP one per block slice);
- for every query tile, the positions of each key stream that any of its rows may see (the hull of their ranges) and
  those that all of them see (the intersection) are two intervals, because both ends of a row's range are
  non-decreasing in its position; mapped through the key runs they become intervals of key tiles: partial at the
  ends, full inside;
- the transposed arrays (key tile -> query tiles, which the backward reads) come the same way from the inverse
  ranges (:func:`_inverse_reach`), so a tile pair is full on both sides or on neither;
- packed documents (each id one run of positions, as packing lays them out) cut every row's ranges to its document;
  were an id to label separate runs, a pair of tiles whose ids cannot meet is dropped and one whose rows are not all
  of one document is partial.

A tile is *full* only when every pair in it is allowed (exact: the query tile lies in one query run, the key tile in
one key run, and the intervals contain them); anything else the hulls reach is *partial*, and ``mask_mod`` (the
rule's own predicate, :func:`~.masks.allowed`) decides there. The work is O(rows + runs touched + nonzero tiles); the
index arrays are torch's ``[batch, 1, tiles, tiles]`` int32 layout. A :class:`BlockMask` depends only on the rows, the
rule and the documents, so callers cache it per (rows, rule, documents) and reuse it for every layer and step.

Example (CPU, instant)::

    python -c "from hf_bdlm.attention.block_mask import *; from hf_bdlm.attention import *; \\
r = vectorized_rows(1024); m = build_block_mask(r, r, MaskRule(32)); print(m.kv_num_blocks.shape, m.sparsity())"
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch.nn.attention.flex_attention import BlockMask, _dense_to_ordered

from .masks import CLEAN, NOISY, MaskRule, allowed, key_reach
from .rows import RowMeta

TILE = 128  # FlexAttention's default sparse block size (rows and keys per tile)
_EMPTY_LO = torch.iinfo(torch.int64).max // 4  # an empty interval is (_EMPTY_LO, -_EMPTY_LO)
_PAD_POS = -(1 << 40)  # position of the rows padding a side to whole tiles: no rule lets a real row see them


@dataclass(frozen=True)
class Runs:
    """Maximal runs of rows of one stream at consecutive positions: rows ``[start, start + length)`` hold positions
    ``[first, first + length)``."""

    start: torch.Tensor
    length: torch.Tensor
    stream: torch.Tensor
    first: torch.Tensor

    @property
    def count(self) -> int:
        return int(self.start.shape[0])


def row_runs(rows: RowMeta) -> Runs:
    """The runs of ``rows`` (documents are not part of a run: the rule's ranges ignore them)."""
    pos, stream = rows.pos.cpu().long(), rows.stream.cpu().long()
    if pos.numel() == 0:
        empty = torch.zeros(0, dtype=torch.long)
        return Runs(empty, empty, empty, empty)
    brk = torch.ones(pos.shape, dtype=torch.bool)
    brk[1:] = (stream[1:] != stream[:-1]) | (pos[1:] != pos[:-1] + 1)
    start = brk.nonzero().flatten()
    length = torch.diff(start, append=torch.tensor([pos.numel()]))
    return Runs(start, length, stream[start], pos[start])


def _tiles(n: int, tile: int) -> int:
    return -(-n // tile)


def _tile_reduce(x: torch.Tensor, tile: int, fill: int, how: str) -> torch.Tensor:
    """``min``/``max`` of ``x [n]`` over each tile of ``tile`` consecutive entries (the last one padded by ``fill``)."""
    n = x.shape[0]
    padded = torch.full((_tiles(n, tile) * tile,), fill, dtype=x.dtype)
    padded[:n] = x
    padded = padded.view(-1, tile)
    return padded.amin(1) if how == "min" else padded.amax(1)


def _pieces(side: RowMeta, tile: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The side's rows cut at tile boundaries and run starts: ``(piece of every row, tile of every piece, whether the
    piece is a whole tile inside one run)``."""
    n = side.num_rows
    runs = row_runs(side)
    cuts = torch.unique(torch.cat([torch.arange(0, n, tile), runs.start]))
    piece = torch.searchsorted(cuts, torch.arange(n), right=True) - 1
    length = torch.diff(cuts, append=torch.tensor([n]))
    return piece, torch.div(cuts, tile, rounding_mode="floor"), length == tile


def _piece_reduce(x: torch.Tensor, piece: torch.Tensor, count: int, how: str) -> torch.Tensor:
    fill = _EMPTY_LO if how == "amin" else -_EMPTY_LO
    return torch.full((count,), fill, dtype=x.dtype).scatter_reduce_(0, piece, x, how)


def _intervals(side: RowMeta, other: Runs, reach, tile: int):
    """Per piece of ``side`` (:func:`_pieces`) and run of ``other``: the tile interval some row reaches and the one
    every row reaches (whole-tile pieces only).

    ``reach(stream, pos, other_stream) -> (lo, hi)``: per row of ``side``, the positions of ``other_stream`` rows it
    meets. Returns ``(tile, any_lo, any_hi, full_lo, full_hi)`` (tile indices of ``other``; an empty full interval has
    ``full_lo > full_hi``).
    """
    stream, pos = side.stream.cpu().long(), side.pos.cpu().long()
    piece, piece_tile, whole = _pieces(side, tile)
    n_pieces = piece_tile.shape[0]
    parts = []
    for other_stream in (CLEAN, NOISY):
        sel = (other.stream == other_stream).nonzero().flatten()
        if sel.numel() == 0:
            continue
        order = sel[torch.argsort(other.first[sel])]  # runs of one stream hold distinct positions: sorted by position
        r_first = other.first[order]
        r_last = r_first + other.length[order] - 1
        lo, hi = reach(stream, pos, other_stream)
        empty = lo > hi
        # Within a piece both ends are non-decreasing: the hull and the intersection of its rows' ranges.
        hull_lo = _piece_reduce(torch.where(empty, _EMPTY_LO, lo), piece, n_pieces, "amin")
        hull_hi = _piece_reduce(torch.where(empty, -_EMPTY_LO, hi), piece, n_pieces, "amax")
        all_lo = _piece_reduce(torch.where(empty, _EMPTY_LO, lo), piece, n_pieces, "amax")
        all_hi = _piece_reduce(torch.where(empty, -_EMPTY_LO, hi), piece, n_pieces, "amin")
        first_run = torch.searchsorted(r_last, hull_lo)
        end_run = torch.searchsorted(r_first, hull_hi, right=True)
        count = (end_run - first_run).clamp(min=0)
        p = torch.repeat_interleave(torch.arange(n_pieces), count)
        k = torch.arange(int(count.sum())) - torch.repeat_interleave(count.cumsum(0) - count, count)
        j = first_run[p] + k
        rf, rl, r0 = r_first[j], r_last[j], other.start[order[j]]
        # Hull and intersection, cut to the run, as rows of ``other`` and then tiles.
        a_lo = torch.maximum(hull_lo[p], rf) - rf + r0
        a_hi = torch.minimum(hull_hi[p], rl) - rf + r0
        f_lo = torch.maximum(all_lo[p], rf) - rf + r0
        f_hi = torch.minimum(all_hi[p], rl) - rf + r0
        full_ok = whole[p] & (f_lo <= f_hi)
        ft_lo = torch.div(f_lo + tile - 1, tile, rounding_mode="floor")
        ft_hi = torch.div(f_hi + 1, tile, rounding_mode="floor") - 1
        parts.append((piece_tile[p], torch.div(a_lo, tile, rounding_mode="floor"),
                      torch.div(a_hi, tile, rounding_mode="floor"),
                      torch.where(full_ok, ft_lo, 1), torch.where(full_ok, ft_hi, 0)))
    if not parts:
        z = torch.zeros(0, dtype=torch.long)
        return z, z, z, z, z
    return tuple(torch.cat(c) for c in zip(*parts))


def _ordered_arrays(t, lo, count, num_out: torch.Tensor, idx_out: torch.Tensor) -> None:
    """Writes torch's ``(num_blocks [n_rows], indices [n_rows, n_cols])`` from intervals ``[lo, lo + count)`` of row
    ``t`` into the zeroed ``num_out`` / ``idx_out`` (``t`` ascending; a row's intervals disjoint, in listing order).

    Only each row's first ``num`` slots are written. With a few intervals per row (every layout but the paper's CP,
    whose rows see one short run per block), each interval is one slice copy of a shared ``arange``: O(nonzero tiles)
    bytes, O(rows) copies; with many, the flat values (a cumulative sum of their steps) are scattered through the
    slots' mask.
    """
    num = torch.zeros(num_out.shape[0], dtype=torch.long).index_add_(0, t, count)
    num_out.copy_(num)
    keep = count > 0
    t, lo, count = t[keep], lo[keep], count[keep]
    if count.numel() == 0:
        return
    starts = count.cumsum(0) - count
    if count.numel() <= 4 * num_out.shape[0] + 64:
        offset = (starts - (num.cumsum(0) - num)[t]).tolist()
        # Slice copies through numpy views of the same memory: a microsecond each, against several for torch's.
        base, out = torch.arange(idx_out.shape[1], dtype=torch.int32).numpy(), idx_out.numpy()
        for row, off, first, n in zip(t.tolist(), offset, lo.tolist(), count.tolist()):
            out[row, off : off + n] = base[first : first + n]
        return
    steps = torch.ones(int(count.sum()), dtype=torch.int32)
    steps[starts[0]] = lo[0]
    steps[starts[1:]] = (lo[1:] - (lo[:-1] + count[:-1] - 1)).to(torch.int32)
    values = steps.cumsum(0, dtype=torch.int32)
    slots = torch.arange(idx_out.shape[1], dtype=torch.int32)[None, :] < num_out[:, None]
    idx_out.masked_scatter_(slots, values)


def _side_arrays(side: RowMeta, other: RowMeta, reach, tile: int, out: tuple, doc_pair=None) -> None:
    """Writes ``out = (num, indices, full_num, full_indices)`` of one side (rows of ``side`` in tiles, listing tiles of
    ``other``); ``doc_pair(side_tiles, other_tiles) -> (any, all)`` filters by documents."""
    n_cols = _tiles(other.num_rows, tile)
    t, a_lo, a_hi, f_lo, f_hi = _intervals(side, row_runs(other), reach, tile)
    has_full = f_lo <= f_hi
    # Partial: [a_lo, f_lo) and (f_hi, a_hi] (the whole any-interval when nothing is full); in order of start within
    # each row, each cut after the last tile an earlier one listed (pieces and runs meeting inside one tile share it).
    left_hi = torch.where(has_full, f_lo - 1, a_hi)
    right_lo = torch.where(has_full, f_hi + 1, a_hi + 1)
    starts = torch.stack([a_lo, right_lo], 1).flatten()
    ends = torch.stack([left_hi, a_hi], 1).flatten()
    rows = t.repeat_interleave(2)
    keep = starts <= ends
    starts, ends, rows = starts[keep], ends[keep], rows[keep]
    order = torch.argsort(rows * (n_cols + 1) + starts)
    starts, ends, rows = starts[order], ends[order], rows[order]
    seen = _segment_cummax(rows, ends, n_cols)
    starts = torch.maximum(starts, seen + 1)
    count = (ends - starts + 1).clamp(min=0)
    # Full intervals belong to whole-tile pieces (one per tile), so they never overlap; in order of start.
    order = torch.argsort(t * (n_cols + 1) + f_lo)
    t, f_lo, f_hi, has_full = t[order], f_lo[order], f_hi[order], has_full[order]
    full_count = torch.where(has_full, f_hi - f_lo + 1, 0)
    if doc_pair is None:
        _ordered_arrays(rows, starts, count, out[0], out[1])
        _ordered_arrays(t, f_lo, full_count, out[2], out[3])
        return
    # Documents: expand to tile pairs, drop those whose documents cannot meet, demote full pairs of mixed documents.
    p_rows, p_cols = _expand(rows, starts, count)
    f_rows, f_cols = _expand(t, f_lo, full_count)
    p_any, _ = doc_pair(p_rows, p_cols)
    f_any, f_all = doc_pair(f_rows, f_cols)
    p_rows = torch.cat([p_rows[p_any], f_rows[f_any & ~f_all]])
    p_cols = torch.cat([p_cols[p_any], f_cols[f_any & ~f_all]])
    order = torch.argsort(p_rows * n_cols + p_cols)
    _ordered_arrays(p_rows[order], p_cols[order], torch.ones_like(p_rows), out[0], out[1])
    _ordered_arrays(f_rows[f_all], f_cols[f_all], torch.ones_like(f_rows[f_all]), out[2], out[3])


def _expand(t, lo, count):
    rows = torch.repeat_interleave(t, count)
    k = torch.arange(rows.shape[0]) - torch.repeat_interleave(count.cumsum(0) - count, count)
    return rows, torch.repeat_interleave(lo, count) + k


def _segment_cummax(seg: torch.Tensor, values: torch.Tensor, span: int) -> torch.Tensor:
    """For each entry, the largest ``values`` of the entries before it with the same ``seg`` (``-1`` if none);
    ``seg`` ascending, ``values`` in ``[-1, span)`` or empty intervals' ends (clamped)."""
    if seg.numel() == 0:
        return seg
    v = values.clamp(-1, span) + 1  # in [0, span + 1]
    shifted = torch.cat([v.new_zeros(1), v[:-1]])
    shifted[1:][seg[1:] != seg[:-1]] = 0
    key = seg * (span + 2) + shifted
    return key.cummax(0).values - seg * (span + 2) - 1


def _inverse_reach(q_rows: RowMeta, rule: MaskRule, seq_len: int):
    """``reach`` for the key side: per key row, the positions of ``q_stream`` queries that may see it, from tables of
    the queries' ranges over every position (both ends non-decreasing, so a key's queries are one interval)."""
    positions = torch.arange(seq_len)
    tables = {}
    for q_stream in (CLEAN, NOISY):
        for k_stream in (CLEAN, NOISY):
            lo, hi = key_reach(torch.full_like(positions, q_stream), positions, rule, k_stream)
            tables[q_stream, k_stream] = (lo.contiguous(), hi.contiguous())

    def reach(k_stream: torch.Tensor, k_pos: torch.Tensor, q_stream: int):
        lo = torch.full_like(k_pos, _EMPTY_LO)
        hi = torch.full_like(k_pos, -_EMPTY_LO)
        for s in (CLEAN, NOISY):
            sel = k_stream == s
            if not bool(sel.any()):
                continue
            q_lo, q_hi = tables[q_stream, s]
            p = k_pos[sel]
            first = torch.searchsorted(q_hi, p)  # the first query whose range ends at or after p
            last = torch.searchsorted(q_lo, p, right=True) - 1  # the last one whose range starts at or before p
            lo[sel], hi[sel] = first, last
        return lo, hi

    return reach


def _zeroed(shape: tuple[int, ...]) -> torch.Tensor:
    """A zeroed int32 tensor on fresh anonymous pages: the slots past a row's count are never written, so a sparse
    array's untouched pages cost neither time nor memory (no huge-page advice: one write would fault 2 MB in)."""
    n = 1
    for d in shape:
        n *= d
    if n * 4 < (1 << 20):
        return torch.zeros(shape, dtype=torch.int32)
    return torch.frombuffer(mmap.mmap(-1, n * 4), dtype=torch.int32).view(shape)


def _document_ranges(q_rows: RowMeta, k_rows: RowMeta, item: int):
    """Documents as ranges of positions, when each document id labels one run of positions (as packing lays them
    out): per query row, the first and last key position of its document, and per key row, the first and last query
    position of its. ``None`` when an id labels separate runs (the rule's same-id test then reaches across them):
    tiles are filtered by their documents instead."""
    qd, kd = q_rows.doc[item].cpu().long(), k_rows.doc[item].cpu().long()
    qp, kp = q_rows.pos.cpu().long(), k_rows.pos.cpu().long()
    missing = torch.iinfo(torch.int64).min
    doc_at = torch.full((int(max(qp.max(), kp.max())) + 1,), missing, dtype=torch.long)
    doc_at[qp] = qd
    if bool((doc_at[qp] != qd).any()):
        return None
    seen = doc_at[kp]
    if bool(((seen != missing) & (seen != kd)).any()):  # one position, two documents
        return None
    doc_at[kp] = kd
    present = (doc_at != missing).nonzero().flatten()
    ids = doc_at[present]
    change = torch.ones(ids.shape, dtype=torch.bool)
    change[1:] = ids[1:] != ids[:-1]
    if int(change.sum()) != torch.unique(ids[change]).numel():
        return None
    run_at = torch.zeros(doc_at.shape, dtype=torch.long)
    run_at[present] = change.cumsum(0) - 1  # the run (document) of every position that holds a row

    def bounds(run, positions):
        n = int(change.sum())
        lo = torch.full((n,), _EMPTY_LO, dtype=torch.long).scatter_reduce_(0, run, positions, "amin")
        hi = torch.full((n,), -_EMPTY_LO, dtype=torch.long).scatter_reduce_(0, run, positions, "amax")
        return lo, hi

    run_q, run_k = run_at[qp], run_at[kp]
    (k_lo, k_hi), (q_lo, q_hi) = bounds(run_k, kp), bounds(run_q, qp)
    return (k_lo[run_q], k_hi[run_q]), (q_lo[run_k], q_hi[run_k])


def _clamped(reach, bounds):
    """``reach`` cut to per-row bounds (a row's document)."""
    lo_b, hi_b = bounds

    def clamped(stream, pos, other):
        lo, hi = reach(stream, pos, other)
        return torch.maximum(lo, lo_b), torch.minimum(hi, hi_b)

    return clamped


def _doc_bounds(rows: RowMeta, item: int, tile: int):
    doc = rows.doc[item].cpu().long()
    return _tile_reduce(doc, tile, doc.max().item() + 1, "min"), _tile_reduce(doc, tile, doc.min().item() - 1, "max")


def _padded(x: torch.Tensor, n: int, fill: int) -> torch.Tensor:
    out = torch.full((*x.shape[:-1], n), fill, dtype=x.dtype, device=x.device)
    out[..., : x.shape[-1]] = x
    return out


def block_mask_mod(q_rows: RowMeta, k_rows: RowMeta, rule: MaskRule, tile: int = TILE, device=None):
    """The ``mask_mod`` of partial tiles: :func:`~.masks.allowed` on the rows' metadata, padded to whole tiles with
    rows no real row may see (so the kernel never reads past the metadata)."""
    nq, nk = _tiles(q_rows.num_rows, tile) * tile, _tiles(k_rows.num_rows, tile) * tile
    qs = _padded(q_rows.stream.to(device), nq, NOISY)
    qp = _padded(q_rows.pos.to(device).long(), nq, _PAD_POS)
    ks = _padded(k_rows.stream.to(device), nk, NOISY)
    kp = _padded(k_rows.pos.to(device).long(), nk, _PAD_POS)
    qd = kd = None
    if q_rows.doc is not None:
        qd = _padded(q_rows.doc.to(device).long(), nq, -1)
        kd = _padded(k_rows.doc.to(device).long(), nk, -2)

    if qd is None:
        def mask_mod(b, h, q_idx, kv_idx):
            return allowed(qs[q_idx], qp[q_idx], None, ks[kv_idx], kp[kv_idx], None, rule)
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return allowed(qs[q_idx], qp[q_idx], qd[b, q_idx], ks[kv_idx], kp[kv_idx], kd[b, kv_idx], rule)

    return mask_mod


def build_block_mask(q_rows: RowMeta, k_rows: RowMeta, rule: MaskRule, tile: int = TILE, device=None):
    """The :class:`~torch.nn.attention.flex_attention.BlockMask` of ``q_rows`` attending to ``k_rows`` under
    ``rule`` (documents from the rows' ``doc``; batch dimension 1 when every item has the same documents).

    Built on the host from the block structure (module docstring) and moved to ``device``.
    """
    if (q_rows.doc is None) != (k_rows.doc is None):
        raise ValueError("Query and key rows must both carry document ids or both omit them.")
    seq_len = int(max(q_rows.pos.max().item() if q_rows.num_rows else 0,
                      k_rows.pos.max().item() if k_rows.num_rows else 0)) + 1
    forward_reach = lambda stream, pos, other: key_reach(stream, pos, rule, other)  # noqa: E731
    backward_reach = _inverse_reach(q_rows, rule, seq_len)
    docs = q_rows.doc is not None
    same = not docs or (bool((q_rows.doc == q_rows.doc[:1]).all()) and bool((k_rows.doc == k_rows.doc[:1]).all()))
    n_items = 1 if same else q_rows.doc.shape[0]
    qt, kt = _tiles(q_rows.num_rows, tile), _tiles(k_rows.num_rows, tile)
    arrays = [_zeroed((n_items, 1, *shape))
              for shape in ((qt,), (qt, kt), (qt,), (qt, kt), (kt,), (kt, qt), (kt,), (kt, qt))]
    for item in range(n_items):
        kv_pair = q_pair = None
        ranges = _document_ranges(q_rows, k_rows, item) if docs else None
        kv_reach, q_reach = forward_reach, backward_reach
        if ranges is not None:  # documents cut each row's ranges: nothing to filter afterwards
            kv_reach, q_reach = _clamped(forward_reach, ranges[0]), _clamped(backward_reach, ranges[1])
        elif docs:
            q_min, q_max = _doc_bounds(q_rows, item, tile)
            k_min, k_max = _doc_bounds(k_rows, item, tile)

            def kv_pair(qt, kt):
                return ((q_min[qt] <= k_max[kt]) & (k_min[kt] <= q_max[qt]),
                        (q_min[qt] == q_max[qt]) & (k_min[kt] == k_max[kt]) & (q_min[qt] == k_min[kt]))

            def q_pair(kt, qt):
                return kv_pair(qt, kt)

        _side_arrays(q_rows, k_rows, kv_reach, tile, [a[item, 0] for a in arrays[:4]], kv_pair)
        _side_arrays(k_rows, q_rows, q_reach, tile, [a[item, 0] for a in arrays[4:]], q_pair)
    stacked = [a.to(device) for a in arrays]
    return BlockMask(
        seq_lengths=(q_rows.num_rows, k_rows.num_rows),
        kv_num_blocks=stacked[0], kv_indices=stacked[1],
        full_kv_num_blocks=stacked[2], full_kv_indices=stacked[3],
        q_num_blocks=stacked[4], q_indices=stacked[5],
        full_q_num_blocks=stacked[6], full_q_indices=stacked[7],
        BLOCK_SIZE=(tile, tile),
        mask_mod=block_mask_mod(q_rows, k_rows, rule, tile, device),
    )


def tile_matrix(mask) -> torch.Tensor:
    """``[batch, q tiles, kv tiles]`` int8 classes of a BlockMask's kv side (0 none, 1 partial, 2 full): for tests and
    for comparing with ``create_block_mask``."""

    def dense(num, idx):
        b, _, rows, cols = idx.shape
        out = torch.zeros(b, rows, cols + 1, dtype=torch.int8)
        valid = torch.arange(cols)[None, None] < num[:, 0, :, None].cpu()
        col = torch.where(valid, idx[:, 0].cpu().long(), cols)
        out.scatter_(2, col, 1)
        return out[..., :cols]

    partial = dense(mask.kv_num_blocks, mask.kv_indices)
    full = dense(mask.full_kv_num_blocks, mask.full_kv_indices) if mask.full_kv_num_blocks is not None else 0
    return partial + 2 * full


def transposed_tile_matrix(mask) -> torch.Tensor:
    """Like :func:`tile_matrix` from the q side (``q_num_blocks`` / ``q_indices``), as ``[batch, q tiles, kv tiles]``."""
    t = SimpleNamespace(kv_num_blocks=mask.q_num_blocks, kv_indices=mask.q_indices,
                        full_kv_num_blocks=mask.full_q_num_blocks, full_kv_indices=mask.full_q_indices)
    return tile_matrix(t).transpose(1, 2)


def interval_block_mask(lo: torch.Tensor, hi: torch.Tensor, key_pos: torch.Tensor, tile: int = TILE, device=None):
    """The :class:`~torch.nn.attention.flex_attention.BlockMask` of queries that each see the keys whose position lies
    in an interval: query ``i`` of item ``b`` sees key ``j`` iff ``lo[b, i] <= key_pos[b, j] <= hi[b, i]`` (empty when
    ``lo > hi``). A drafter's context rule has this form (its queries are blocks after anchors, not rows of a
    sequence). Tiles are classified from each query tile's hull and intersection of intervals and each key tile's
    position range: ``[batch, q tiles, kv tiles]`` work, meant for a few thousand queries over a long context.
    """
    b, nq = lo.shape
    nk = key_pos.shape[1]
    qt, kt = _tiles(nq, tile), _tiles(nk, tile)
    big = _EMPTY_LO
    lo_c, hi_c, kp = lo.detach().cpu().long(), hi.detach().cpu().long(), key_pos.detach().cpu().long()
    empty = lo_c > hi_c
    pad_q = qt * tile - nq

    def per_tile(x, fill, how):
        x = torch.nn.functional.pad(x, (0, pad_q), value=fill).view(b, qt, tile)
        return x.amin(-1) if how == "min" else x.amax(-1)

    hull_lo = per_tile(torch.where(empty, big, lo_c), big, "min")
    hull_hi = per_tile(torch.where(empty, -big, hi_c), -big, "max")
    all_lo = per_tile(torch.where(empty, big, lo_c), -big, "max")
    all_hi = per_tile(torch.where(empty, -big, hi_c), big, "min")
    pad_k = kt * tile - nk
    k_min = torch.nn.functional.pad(kp, (0, pad_k), value=big).view(b, kt, tile).amin(-1)
    k_max = torch.nn.functional.pad(kp, (0, pad_k), value=-big).view(b, kt, tile).amax(-1)
    k_whole = torch.arange(kt) < nk // tile
    anyv = (hull_lo[:, :, None] <= k_max[:, None]) & (k_min[:, None] <= hull_hi[:, :, None])
    q_whole = torch.arange(qt) < nq // tile  # a tile holding padding is never full (as in build_block_mask)
    full = ((all_lo[:, :, None] <= k_min[:, None]) & (k_max[:, None] <= all_hi[:, :, None])
            & k_whole[None, None] & q_whole[None, :, None])
    partial = anyv & ~full
    arrays = []
    for dense in (partial, full):
        arrays += list(_dense_to_ordered(dense[:, None]))
    for dense in (partial, full):
        arrays += list(_dense_to_ordered(dense.transpose(1, 2)[:, None]))
    arrays = [a.to(device) for a in arrays]
    lo_p = _padded(lo.to(device).long(), qt * tile, 1)
    hi_p = _padded(hi.to(device).long(), qt * tile, 0)
    kp_p = _padded(key_pos.to(device).long(), kt * tile, _PAD_POS)

    if b == 1:  # one mask for the whole batch (flex broadcasts it; the batch index still varies)
        lo_p, hi_p, kp_p = lo_p[0], hi_p[0], kp_p[0]

        def mask_mod(batch, h, q_idx, kv_idx):
            p = kp_p[kv_idx]
            return (p >= lo_p[q_idx]) & (p <= hi_p[q_idx])
    else:
        def mask_mod(batch, h, q_idx, kv_idx):
            p = kp_p[batch, kv_idx]
            return (p >= lo_p[batch, q_idx]) & (p <= hi_p[batch, q_idx])

    return BlockMask(seq_lengths=(nq, nk), kv_num_blocks=arrays[0], kv_indices=arrays[1],
                     full_kv_num_blocks=arrays[2], full_kv_indices=arrays[3], q_num_blocks=arrays[4],
                     q_indices=arrays[5], full_q_num_blocks=arrays[6], full_q_indices=arrays[7],
                     BLOCK_SIZE=(tile, tile), mask_mod=mask_mod)
