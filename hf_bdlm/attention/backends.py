"""Attention backends behind one interface, each exact against the dense reference.

``attend(q, sources, q_rows, k_rows, rule, scale, cache) -> out``

- ``q``: ``[b, H, Tq, d]``; ``sources``: ``[(k, v), ...]`` with ``[b, H_kv, Tk_i, d]`` (GQA not
  expanded); ``k_rows``: one :class:`~hf_bdlm.attention.rows.RowMeta` per source. Several
  sources exist because sharded layouts hold keys in several tensors (see
  ``hf_bdlm.parallel``); gradients flow back to each source tensor.
- ``cache``: a dict living for one forward pass; plans and masks depend only on row metadata
  and the rule, so every layer of the same kind reuses them.

Backends:

``dense``      SDPA with the boolean mask of the rule: the reference; ``O(T^2)`` memory.
``blockwise``  block-sparse plan (:mod:`.tiles`) run by fused kernels merged by log-sum-exp
               (:mod:`.kernels`); never builds a ``T x T`` mask or score matrix. CPU and CUDA.
``flex``       compiled FlexAttention, one call per key source over a ``BlockMask`` built from the block
               structure (:mod:`.flex`, :mod:`.block_mask`); the CUDA training path. On CPU forward only
               (PyTorch has no CPU backward for it).
``auto``       ``flex`` on CUDA tensors, ``blockwise`` elsewhere (the default).

Whatever the backend, a call in which every query may see every key (a decoding step: one noisy block over its
clean prefix and itself) runs one SDPA call without any mask.

A backend that cannot run here raises :class:`BackendUnavailable` naming the reason; nothing
is replaced silently by another backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..protocols.diffusion_fields import BACKENDS  # every backend attend() dispatches to
from .flex import attend_flex
from .kernels import BackendUnavailable, block_sparse_attention
from .masks import MaskRule, all_pairs_allowed, dense_mask
from .rows import RowMeta
from .tiles import batch_plans


def _cat_sources(sources, k_rows: list[RowMeta]):
    if len(sources) == 1:
        return sources[0][0], sources[0][1], k_rows[0]
    k = torch.cat([s[0] for s in sources], dim=2)
    v = torch.cat([s[1] for s in sources], dim=2)
    return k, v, RowMeta.cat(k_rows)


def attend_dense(q, sources, q_rows, k_rows, rule, scale, cache):
    k, v, rows = _cat_sources(sources, k_rows)
    key = ("dense", rule)
    mask = cache.get(key)
    if mask is None:
        mask = dense_mask(q_rows, rows, rule).to(q.device)[:, None]
        cache[key] = mask
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def attend_blockwise(q, sources, q_rows, k_rows, rule, scale, cache):
    plans = batch_plans(q_rows, k_rows, rule, cache, q.shape[0])
    return block_sparse_attention(plans, q, sources, scale)[0]


def common_dtype(q, sources):
    """Bring q/k/v to one dtype, as SDPA does: under autocast its dtype, else the promoted one.

    Rotary embeddings compute in float32, so under bf16 autocast q/k arrive in float32 and v in bf16.
    A :class:`~.kernels.DeferredKV` source is converted on its local contribution, before anything is sent.
    """
    pairs = [s if isinstance(s, tuple) else (s.k, s.v) for s in sources]
    tensors = [q] + [t for kv in pairs for t in kv]
    device = q.device.type
    if torch.is_autocast_enabled(device):
        target = torch.get_autocast_dtype(device)
    else:
        target = tensors[0].dtype
        for t in tensors[1:]:
            target = torch.promote_types(target, t.dtype)
    if all(t.dtype == target for t in tensors):
        return q, sources
    converted = []
    for s, (k, v) in zip(sources, pairs):
        k, v = k.to(target), v.to(target)
        converted.append((k, v) if isinstance(s, tuple) else s.with_kv(k, v))
    return q.to(target), converted


def source_rows(source) -> int:
    """Key rows a source provides (a deferred source: after its transfer)."""
    return source[0].shape[2] if isinstance(source, tuple) else source.num_rows


def _unmasked(q_rows: RowMeta, k_rows: RowMeta, rule: MaskRule, cache: dict) -> bool:
    key = ("unmasked", rule)
    found = cache.get(key)
    if found is None:
        found = cache[key] = all_pairs_allowed(q_rows, k_rows, rule)
    return found


_DISPATCH = {
    "dense": attend_dense,
    "blockwise": attend_blockwise,
    "flex": attend_flex,
}


def attend(
    backend: str,
    q: torch.Tensor,
    sources: list,
    q_rows: RowMeta,
    k_rows: list[RowMeta],
    rule: MaskRule,
    scale: float,
    cache: dict,
) -> torch.Tensor:
    """Block-diffusion attention of ``q`` over ``sources`` with the named backend; ``[b, H, Tq, d]``.

    A source is a ``(k, v)`` pair or a :class:`~.kernels.DeferredKV` (rows that arrive by
    communication). ``blockwise`` starts the transfer, computes the local sources meanwhile and
    reads the deferred rows after their wait; the other backends gather synchronously first.
    """
    if backend == "auto":
        backend = "flex" if q.device.type == "cuda" else "blockwise"
    fn = _DISPATCH.get(backend)
    if fn is None:
        raise ValueError(f"Unknown attention backend {backend!r}; choose one of {BACKENDS}.")
    if q.shape[2] != q_rows.num_rows or any(source_rows(s) != r.num_rows for s, r in zip(sources, k_rows)):
        raise ValueError(
            f"attention rows do not match the layout: {q.shape[2]} query rows for {q_rows.num_rows} described, "
            f"{[source_rows(s) for s in sources]} key rows for {[r.num_rows for r in k_rows]} described."
        )
    q, sources = common_dtype(q, sources)
    if len(sources) == 1 and isinstance(sources[0], tuple) and _unmasked(q_rows, k_rows[0], rule, cache):
        k, v = sources[0]
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    if fn not in (attend_blockwise, attend_flex):
        sources = [s if isinstance(s, tuple) else s.materialize() for s in sources]
    return fn(q, sources, q_rows, k_rows, rule, scale, cache)
