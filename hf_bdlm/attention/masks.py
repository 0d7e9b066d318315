"""The block-diffusion attention rule, written once.

Every row of a block-diffusion forward belongs to a *stream* (the clean sequence ``x`` or its
corrupted copy ``x_t``), sits at a global *position* of the sequence and belongs to a
*document* (packed sequences). Whether a query row may attend to a key row is a function of
those three facts only, so the same predicate serves the single-device vectorized layout,
inference over a KV cache, and every sharded layout of ``hf_bdlm.parallel``:

| query | key   | allowed when                                                      |
|-------|-------|-------------------------------------------------------------------|
| noisy | noisy | ``blk(k) == blk(q)`` (bidirectional inside the block)             |
| noisy | clean | ``blk(k) <  blk(q)``                                              |
| clean | clean | ``blk(k) <= blk(q)`` (``block_causal``) or ``k <= q`` (``causal``) |
| clean | noisy | never                                                             |

and always the same document. This is BD3-LM's ``block_diff_mask`` (and Fast-dLLM v2's) with
``block_causal``; ``causal`` keeps the clean stream token-causal, as a causal LM or a causal
encoder computes it.

Sliding-window layers of width ``W`` add a window, whose meaning for a block of queries is a
*convention* of the model (``window_convention``); it must be the one the model runs at
inference. With ``s_b = blk(q) * B`` the start of the query's block:

| convention      | query                                  | keys in the window                        |
|-----------------|----------------------------------------|-------------------------------------------|
| ``per_query``   | any                                    | ``|q - k| < W`` (token by token)          |
| ``block_start`` | noisy; clean under ``block_causal``    | ``k >= s_b - W + 1`` (and its own block)  |
| ``block_start`` | clean under ``causal``                 | ``q - W + 1 <= k <= q``                   |

``block_start`` is what a canvas block sees over a sliding cache holding the ``W - 1``
positions before its start, plus its whole block (an encoder-decoder's canvas, Turbo-dLLM); a
token-causal clean row keeps the causal encoder's own window. ``per_query`` applies the
distance of transformers' sliding masks to every row (a noisy query at ``p`` sees clean keys
from ``p - W + 1`` on, and its own block only within distance ``W``). The window of a query is an
interval of key positions (:func:`window_key_range`), so the sharded layouts fetch exactly the
keys it reaches (:func:`keys_in_window`).

Backends never re-derive these tables: the dense reference materialises :func:`dense_mask`,
the block-sparse planner classifies block tiles with :func:`tile_classes`, and FlexAttention
calls :func:`allowed` from its ``mask_mod``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..protocols.diffusion_fields import CLEAN_ATTENTION_KINDS, WINDOW_CONVENTIONS  # the names; their rules are below

CLEAN = 0
NOISY = 1


@dataclass(frozen=True)
class MaskRule:
    """Static parameters of the rule.

    Args:
        block_size (`int`): tokens per diffusion block.
        clean_attention (`str`, defaults to `"block_causal"`): `"block_causal"` or `"causal"` (clean stream).
        sliding_window (`int`, *optional*): the layer's window `W`; `None` on full-attention layers.
        window_convention (`str`, defaults to `"per_query"`): what the window means for a block of queries,
            `"per_query"` or `"block_start"` (see the module docstring).
    """

    block_size: int
    clean_attention: str = "block_causal"
    sliding_window: int | None = None
    window_convention: str = "per_query"

    def __post_init__(self):
        if self.block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size}.")
        if self.clean_attention not in CLEAN_ATTENTION_KINDS:
            raise ValueError(
                f"clean_attention must be one of {CLEAN_ATTENTION_KINDS}, got {self.clean_attention!r}."
            )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive or None, got {self.sliding_window}.")
        if self.window_convention not in WINDOW_CONVENTIONS:
            raise ValueError(
                f"window_convention must be one of {WINDOW_CONVENTIONS}, got {self.window_convention!r}."
            )

    def with_window(self, sliding_window: int | None) -> "MaskRule":
        if sliding_window == self.sliding_window:
            return self
        return replace(self, sliding_window=sliding_window)


def window_key_range(q_stream, q_pos, rule: MaskRule):
    """Inclusive range ``(lo, hi)`` of key positions inside each query's sliding window.

    The window part of the rule alone (the stream/block table and documents still apply); ``rule`` must have a
    ``sliding_window``. Elementwise over broadcastable integer tensors; within one block of one stream both ends
    are non-decreasing in ``q_pos``, which :func:`tile_classes` relies on.
    """
    reach = rule.sliding_window - 1
    if rule.window_convention == "per_query":
        return q_pos - reach, q_pos + reach
    start = torch.div(q_pos, rule.block_size, rounding_mode="floor") * rule.block_size
    if rule.clean_attention == "block_causal":  # every query sees its whole block
        return start - reach, start + (rule.block_size - 1)
    block_level = q_stream == NOISY
    return (
        torch.where(block_level, start - reach, q_pos - reach),
        torch.where(block_level, start + (rule.block_size - 1), q_pos),
    )


def keys_in_window(q_stream, q_pos, k_pos, rule: MaskRule, k_stream=None) -> torch.Tensor:
    """Whether each key position (``k_pos [n]``) lies in the window of at least one query (``[m]`` rows).

    What a rank holding these queries must fetch on a sliding-window layer: the window, cut at the last position
    the stream table lets the query see (its block's end, or itself in a token-causal clean stream). With the keys'
    streams (``k_stream [n]``) the stream table cuts each reach per key stream: a noisy query reaches clean keys
    before its block and noisy keys of its own block only, a clean query no noisy key; a noisy block then fetches
    exactly the ``W - 1`` clean positions of its halo. Memory O(span of the positions).
    """
    if k_stream is None:
        return _covered(*_reach(q_stream, q_pos, rule, None), k_pos)
    out = torch.zeros(k_pos.shape, dtype=torch.bool, device=k_pos.device)
    for stream in (CLEAN, NOISY):
        sel = k_stream == stream
        if bool(sel.any()):
            out[sel] = _covered(*_reach(q_stream, q_pos, rule, stream), k_pos[sel])
    return out


def key_reach(q_stream, q_pos, rule: MaskRule, k_stream: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query, the inclusive range ``(lo, hi)`` of positions of ``k_stream`` keys the rule lets it see, documents
    aside (an empty range has ``lo > hi``). Both ends are non-decreasing in the query's position within one query
    stream, which is what lets :mod:`.block_mask` turn them into runs of tiles. With or without a window."""
    return _reach(q_stream, q_pos, rule, k_stream)


def _reach(q_stream, q_pos, rule: MaskRule, k_stream: int | None):
    """Per query, the inclusive key-position range ``(lo, hi)`` its window and stream table allow (keys of
    ``k_stream``; ``None``: either stream); an empty range has ``lo > hi``. Without a window the range starts at 0."""
    if rule.sliding_window is None:
        lo, hi = torch.zeros_like(q_pos), torch.full_like(q_pos, torch.iinfo(torch.int64).max // 2)
    else:
        lo, hi = window_key_range(q_stream, q_pos, rule)
    start = torch.div(q_pos, rule.block_size, rounding_mode="floor") * rule.block_size
    block_end = start + (rule.block_size - 1)
    noisy = q_stream == NOISY
    clean_end = q_pos if rule.clean_attention == "causal" else block_end
    if k_stream is None:
        hi = torch.minimum(hi, torch.where(noisy, block_end, clean_end))
    elif k_stream == CLEAN:
        hi = torch.minimum(hi, torch.where(noisy, start - 1, clean_end))
    else:  # noisy keys: the query's own block, and never for a clean query
        lo = torch.maximum(lo, start)
        hi = torch.where(noisy, torch.minimum(hi, block_end), lo - 1)
    return torch.broadcast_to(lo, q_pos.shape), torch.broadcast_to(hi, q_pos.shape)


def _covered(lo: torch.Tensor, hi: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """Whether each key position lies in at least one of the ranges ``[lo, hi]``."""
    keep = lo <= hi
    lo, hi = lo[keep], hi[keep]
    if lo.numel() == 0 or k_pos.numel() == 0:
        return torch.zeros(k_pos.shape, dtype=torch.bool, device=k_pos.device)
    base = int(torch.minimum(lo.min(), k_pos.min()))
    size = int(torch.maximum(hi.max(), k_pos.max())) - base + 2
    # +1 where a window opens, -1 one past where it closes: positive prefix sums are covered positions.
    delta = torch.zeros(size, dtype=torch.long, device=lo.device)
    delta.index_add_(0, (lo - base).long(), torch.ones_like(lo, dtype=torch.long))
    delta.index_add_(0, (hi - base + 1).long(), -torch.ones_like(hi, dtype=torch.long))
    return (delta.cumsum(0) > 0)[(k_pos - base).long()]


def allowed(q_stream, q_pos, q_doc, k_stream, k_pos, k_doc, rule: MaskRule):
    """Whether query rows may attend to key rows. Arguments are broadcastable integer tensors.

    Works elementwise, so it builds dense masks (outer broadcasting), block masks (block-level
    indices) and FlexAttention ``mask_mod`` closures alike. ``q_doc``/``k_doc`` may be ``None``
    when the batch is not packed.
    """
    q_blk = torch.div(q_pos, rule.block_size, rounding_mode="floor")
    k_blk = torch.div(k_pos, rule.block_size, rounding_mode="floor")
    q_noisy = q_stream == NOISY
    k_noisy = k_stream == NOISY
    if rule.clean_attention == "causal":
        clean_clean = k_pos <= q_pos
    else:
        clean_clean = k_blk <= q_blk
    ok = torch.where(
        q_noisy,
        torch.where(k_noisy, k_blk == q_blk, k_blk < q_blk),
        (~k_noisy) & clean_clean,
    )
    if q_doc is not None and k_doc is not None:
        ok = ok & (q_doc == k_doc)
    if rule.sliding_window is not None:
        lo, hi = window_key_range(q_stream, q_pos, rule)
        ok = ok & (k_pos >= lo) & (k_pos <= hi)
    return ok


def all_pairs_allowed(q_rows, k_rows, rule: MaskRule) -> bool:
    """Whether every query row may see every key row (e.g. a decoding step: a noisy block over its clean prefix and
    itself), decided in O(rows) from the rule's key ranges: then attention needs no mask at all."""
    if q_rows.num_rows == 0 or k_rows.num_rows == 0:
        return False
    if q_rows.doc is not None or k_rows.doc is not None:
        docs = torch.cat([d.flatten() for d in (q_rows.doc, k_rows.doc) if d is not None])
        if bool((docs != docs[0]).any()):
            return False
    for stream in (CLEAN, NOISY):
        k_pos = k_rows.pos[k_rows.stream == stream]
        if k_pos.numel() == 0:
            continue
        lo, hi = key_reach(q_rows.stream, q_rows.pos.long(), rule, stream)
        if int(lo.max()) > int(k_pos.min()) or int(hi.min()) < int(k_pos.max()):
            return False
    return True


def dense_mask(q_rows, k_rows, rule: MaskRule) -> torch.Tensor:
    """Boolean mask ``[batch or 1, Tq, Tk]`` of allowed pairs between two :class:`RowMeta`."""
    q_doc = None if q_rows.doc is None else q_rows.doc[:, :, None]
    k_doc = None if k_rows.doc is None else k_rows.doc[:, None, :]
    if (q_doc is None) != (k_doc is None):
        raise ValueError("Query and key rows must both carry document ids or both omit them.")
    return allowed(
        q_rows.stream[None, :, None],
        q_rows.pos[None, :, None],
        q_doc,
        k_rows.stream[None, None, :],
        k_rows.pos[None, None, :],
        k_doc,
        rule,
    )


def count_allowed_pairs(q_rows, k_rows, rule: MaskRule, chunk: int = 4096) -> int:
    """Number of allowed (query, key) pairs, counted in query chunks (memory O(chunk * Tk))."""
    total = 0
    for start in range(0, q_rows.num_rows, chunk):
        total += int(dense_mask(q_rows.slice(start, start + chunk), k_rows, rule).sum())
    return total


TILE_NONE, TILE_FULL, TILE_PARTIAL = 0, 1, 2


def tile_classes(q_chunks, k_chunks, rule: MaskRule) -> torch.Tensor:
    """Classify every (query chunk, key chunk) tile as none, full or partially allowed.

    A chunk is a run of consecutive positions of one stream inside one block and one document
    (see :class:`hf_bdlm.attention.tiles.Chunks`: ``stream, block, doc, first, last`` tensors).
    This is :func:`allowed` lifted to tiles; tests check it against :func:`dense_mask`. A tile
    is ``TILE_PARTIAL`` when the rule can differ inside it (the token-causal diagonal of the
    clean stream, a sliding-window edge); the planner then builds that tile's exact mask with
    :func:`allowed`.
    """
    qs, qb, qf, ql = (t[:, None] for t in (q_chunks.stream, q_chunks.block, q_chunks.first, q_chunks.last))
    ks, kb, kf, kl = (t[None, :] for t in (k_chunks.stream, k_chunks.block, k_chunks.first, k_chunks.last))
    q_noisy, k_noisy = qs == NOISY, ks == NOISY
    if rule.clean_attention == "causal":
        clean_full = kl <= qf
        clean_any = kf <= ql
    else:
        clean_full = clean_any = kb <= qb
    any_ok = torch.where(q_noisy, torch.where(k_noisy, kb == qb, kb < qb), (~k_noisy) & clean_any)
    all_ok = torch.where(q_noisy, torch.where(k_noisy, kb == qb, kb < qb), (~k_noisy) & clean_full)
    if q_chunks.doc is not None and k_chunks.doc is not None:
        same_doc = q_chunks.doc[:, None] == k_chunks.doc[None, :]
        any_ok, all_ok = any_ok & same_doc, all_ok & same_doc
    if rule.sliding_window is not None:
        # Window ends are non-decreasing along a chunk and consecutive windows overlap, so the chunk's windows
        # cover [lo(first), hi(last)] and all of them contain [lo(last), hi(first)].
        lo_first, hi_first = window_key_range(qs, qf, rule)
        lo_last, hi_last = window_key_range(qs, ql, rule)
        any_ok = any_ok & (kl >= lo_first) & (kf <= hi_last)
        all_ok = all_ok & (kf >= lo_last) & (kl <= hi_first)
    classes = torch.full(any_ok.shape, TILE_NONE, dtype=torch.int8)
    classes[any_ok] = TILE_PARTIAL
    classes[all_ok] = TILE_FULL
    return classes
