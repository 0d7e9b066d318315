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

and always: same document, and ``|q - k| < sliding_window`` on sliding-window layers (the
distance convention of transformers' sliding-window masks).

Backends never re-derive this table: the dense reference materialises :func:`dense_mask`,
the block-sparse planner classifies block tiles with :func:`tile_classes`, and FlexAttention
calls :func:`allowed` from its ``mask_mod``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CLEAN = 0
NOISY = 1
CLEAN_ATTENTION_KINDS = ("block_causal", "causal")


@dataclass(frozen=True)
class MaskRule:
    """Static parameters of the rule: block size, clean-stream kind and (per layer) window."""

    block_size: int
    clean_attention: str = "block_causal"
    sliding_window: int | None = None

    def __post_init__(self):
        if self.block_size <= 0:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size}.")
        if self.clean_attention not in CLEAN_ATTENTION_KINDS:
            raise ValueError(
                f"clean_attention must be one of {CLEAN_ATTENTION_KINDS}, got {self.clean_attention!r}."
            )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive or None, got {self.sliding_window}.")

    def with_window(self, sliding_window: int | None) -> "MaskRule":
        if sliding_window == self.sliding_window:
            return self
        return MaskRule(self.block_size, self.clean_attention, sliding_window)


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
        ok = ok & ((q_pos - k_pos).abs() < rule.sliding_window)
    return ok


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
        w = rule.sliding_window
        max_dist = torch.maximum((ql - kf).abs(), (kl - qf).abs())
        min_dist = torch.clamp(torch.maximum(kf - ql, qf - kl), min=0)
        any_ok = any_ok & (min_dist < w)
        all_ok = all_ok & (max_dist < w)
    classes = torch.full(any_ok.shape, TILE_NONE, dtype=torch.int8)
    classes[any_ok] = TILE_PARTIAL
    classes[all_ok] = TILE_FULL
    return classes
