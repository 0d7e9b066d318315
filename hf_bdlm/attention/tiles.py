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
  by the rule's predicate.

A plan is built once per forward and layer kind and reused by every layer.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from .masks import TILE_FULL, TILE_PARTIAL, MaskRule, allowed, tile_classes
from .rows import RowMeta

# Tiles up to this many key rows (in units of the block size) are batched when equally shaped.
_BATCH_MAX_KEY_BLOCKS = 2


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


def plan_attention(q_rows: RowMeta, k_sources: list[RowMeta], rule: MaskRule) -> TilePlan:
    """Plan block-sparse attention of ``q_rows`` over key sources (all of one batch item)."""
    qc = split_chunks(q_rows, rule.block_size)
    shared: dict[tuple, list[torch.Tensor]] = defaultdict(list)  # (source, ks, ke) -> query row ranges
    masked: list[tuple[int, int, int, int, int, torch.Tensor]] = []
    for source, k_rows in enumerate(k_sources):
        kc = split_chunks(k_rows, rule.block_size)
        if kc.count == 0 or qc.count == 0:
            continue
        classes = tile_classes(qc, kc, rule)
        for qi, kj in (classes == TILE_PARTIAL).nonzero().tolist():
            qs, qe, ks, ke = int(qc.start[qi]), int(qc.end[qi]), int(kc.start[kj]), int(kc.end[kj])
            tile = allowed(
                q_rows.stream[qs:qe, None].cpu(),
                q_rows.pos[qs:qe, None].cpu(),
                None,
                k_rows.stream[None, ks:ke].cpu(),
                k_rows.pos[None, ks:ke].cpu(),
                None,
                rule,
            )
            if bool(tile.all()):
                classes[qi, kj] = TILE_FULL
            else:
                classes[qi, kj] = 0
                if bool(tile.any()):
                    masked.append((qs, qe, source, ks, ke, tile))
        full = classes == TILE_FULL
        # Runs of consecutive full key chunks: a run starts where a full tile follows a non-full one.
        prev = torch.zeros_like(full)
        prev[:, 1:] = full[:, :-1]
        nxt = torch.zeros_like(full)
        nxt[:, :-1] = full[:, 1:]
        run_starts = (full & ~prev).nonzero().tolist()
        run_ends = (full & ~nxt).nonzero().tolist()
        for (qi, kj0), (qi2, kj1) in zip(run_starts, run_ends):
            assert qi == qi2
            key = (source, int(kc.start[kj0]), int(kc.end[kj1]))
            shared[key].append(torch.arange(int(qc.start[qi]), int(qc.end[qi])))
    calls: list[KernelCall] = []
    batchable: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
    limit = _BATCH_MAX_KEY_BLOCKS * rule.block_size
    for (source, ks, ke), q_parts in shared.items():
        if len(q_parts) == 1 and ke - ks <= limit:
            batchable[(source, q_parts[0].numel(), ke - ks, None)].append((q_parts[0], torch.arange(ks, ke)))
        else:
            calls.append(KernelCall(_rows_spec(q_parts), source, (ks, ke)))
    mask_index: dict[bytes, int] = {}
    masks: list[torch.Tensor] = []
    for qs, qe, source, ks, ke, tile in masked:
        mi = mask_index.setdefault(tile.numpy().tobytes() + str(tuple(tile.shape)).encode(), len(masks))
        if mi == len(masks):
            masks.append(tile)
        batchable[(source, qe - qs, ke - ks, mi)].append((torch.arange(qs, qe), torch.arange(ks, ke)))
    for (source, _, _, mi), group in batchable.items():
        mask = None if mi is None else masks[mi]
        empty = None
        if mask is not None and not bool(mask.any(-1).all()):
            empty = ~mask.any(-1)
        # A batched call merges its results into its query rows at once, so a query chunk may
        # appear only once per call: pairs repeating a chunk go to a later call.
        rounds: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        seen: dict[int, int] = defaultdict(int)
        for pair in group:
            r = seen[int(pair[0][0])]
            seen[int(pair[0][0])] += 1
            if r == len(rounds):
                rounds.append([])
            rounds[r].append(pair)
        for pairs in rounds:
            calls.append(_batched_call(pairs, source, mask, empty))
    # Calls run in source order: sources listed first (local K/V) are computed while later ones
    # (gathered K/V) may still be in flight.
    calls.sort(key=lambda c: c.source)
    return TilePlan(tuple(calls), q_rows.num_rows, tuple(k.num_rows for k in k_sources))


def _batched_call(pairs, source: int, mask, empty) -> KernelCall:
    q_idx = torch.stack([p[0] for p in pairs])
    k_idx = torch.stack([p[1] for p in pairs])
    if q_idx.shape[0] == 1:
        q_spec = (int(q_idx[0, 0]), int(q_idx[0, -1]) + 1)
        k_spec = (int(k_idx[0, 0]), int(k_idx[0, -1]) + 1)
        return KernelCall(q_spec, source, k_spec, mask, empty)
    return KernelCall(q_idx, source, k_idx, mask, empty)
