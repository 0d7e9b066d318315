"""The ``flex`` backend: one compiled FlexAttention call per key source, merged by log-sum-exp.

The CUDA training path (``attention_backend="auto"`` picks it on CUDA tensors). For each key source of a layer (one on
a single device; the local rows and the peers' rows under a sharded layout) it runs ``flex_attention`` over a
:class:`~torch.nn.attention.flex_attention.BlockMask` built from the block structure (:mod:`.block_mask`: no
per-element mask evaluation, no ``L x L`` tensor) with GQA through ``enable_gqa`` (K/V are never repeated per query
head), and merges the partial results by their log-sum-exp with ordinary autograd ops, so the backward of every call
is FlexAttention's own fused kernel. Block masks live in the layout's cache (per rule and source: one per layer kind,
built once per shape and documents and reused by every layer and step); the compiled function is built once per
process and reuses its graph for every call of the same shape and rule (a new mask of the same shape recompiles
nothing).

A source that arrives by communication (a :class:`~.kernels.DeferredKV`) starts its transfer first; the local sources
are computed meanwhile and the peers' rows are read only after the wait (:class:`_StartTransfer` /
:class:`_AwaitTransfer`). In backward, the peers' gradients start travelling home as soon as their attention's
backward produced them, while the local sources' backward runs.

On CPU PyTorch has no FlexAttention backward, and its compiled CPU kernel returns no log-sum-exp and takes no float64:
a single float32/bf16 source runs compiled (forward only); several sources, or float64, run eagerly (inference sizes:
eager FlexAttention materialises the scores). Training on CPU is refused with a message naming ``blockwise``.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import flex_attention

from .block_mask import build_block_mask
from .kernels import BackendUnavailable


@functools.cache
def compiled_flex_attention(dynamic: bool = False):
    """``torch.compile(flex_attention)``, built once per process: graphs are cached per shape and rule (a training
    run has a few shapes); ``dynamic=True`` compiles one graph for every length (a decoding context that grows)."""
    return torch.compile(flex_attention, dynamic=dynamic)


def _eager_flex_attention(*args, **kwargs):
    return flex_attention(*args, **kwargs)


def flex_call(q, k, v, block_mask, scale: float, with_lse: bool, dynamic: bool = False):
    """One FlexAttention call: ``out [b, H, Tq, d]`` and, with ``with_lse``, the natural-log LSE ``[b, H, Tq]``
    (``dynamic``: the key length changes from call to call, as a decoding context's does)."""
    # lazy: AuxRequest is torch >= 2.9's (pyproject allows 2.6): an older torch fails only the LSE call
    from torch.nn.attention.flex_attention import AuxRequest

    gqa = k.shape[1] != q.shape[1]
    if q.device.type != "cuda":
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            raise BackendUnavailable(
                "FlexAttention has no backward pass on CPU in PyTorch; train on CPU with attention_backend="
                "'blockwise' (or 'auto', which picks it there); flex runs CPU inference only.")
        q, k, v = q.detach(), k.detach(), v.detach()  # PyTorch's CPU check looks at requires_grad even under no_grad
    # torch's compiled CPU kernel returns no LSE and takes no float64: those CPU calls run eagerly (inference only).
    compiled = q.device.type == "cuda" or not (with_lse or q.dtype == torch.float64)
    # Dynamic shapes on CUDA only: torch 2.13's CPU code generation for FlexAttention fails to compile them.
    fn = compiled_flex_attention(dynamic and q.device.type == "cuda") if compiled else _eager_flex_attention
    if not with_lse:
        return fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa), None
    out, aux = fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa, return_aux=AuxRequest(lse=True))
    return out, aux.lse


def merge_by_lse(partials: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> torch.Tensor:
    """Softmax attention over the union of disjoint key sets from the partial results ``(out_i, lse_i)``; rows no
    key reaches get 0. Autograd ops only: gradients reach every ``out_i`` and ``lse_i``."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    lse = torch.stack([p[1].to(acc) for p in partials])
    top = lse.amax(0).detach()
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weights = torch.exp(lse - top)  # 0 for a source that has no key for the row
    total = weights.sum(0)
    out = sum(w.unsqueeze(-1) * p[0].to(acc) for w, p in zip(weights, partials))
    return (out / total.clamp_min(torch.finfo(acc).tiny).unsqueeze(-1)).to(dtype)


class _Transfer:
    """The in-flight handles of one deferred source between :class:`_StartTransfer` and :class:`_AwaitTransfer`."""

    __slots__ = ("source", "forward", "backward", "token")

    def __init__(self, source):
        self.source, self.forward, self.backward, self.token = source, None, None, None


class _StartTransfer(torch.autograd.Function):
    """Starts sending this rank's rows; returns an empty token ordering :class:`_AwaitTransfer` after it. Backward:
    waits for the gradients of those rows (started by :class:`_AwaitTransfer`'s backward)."""

    @staticmethod
    def forward(ctx, transfer: _Transfer, k, v):
        transfer.forward = transfer.source.start_forward(k, v)
        ctx.transfer = transfer
        return k.new_empty(0)

    @staticmethod
    def backward(ctx, _token_grad):
        dk, dv = ctx.transfer.backward.wait()
        ctx.transfer.backward = None
        return None, dk, dv


class _AwaitTransfer(torch.autograd.Function):
    """Waits for the peers' rows (the only way to them). Backward: starts sending their gradients home."""

    @staticmethod
    def forward(ctx, transfer: _Transfer, token):
        k, v = transfer.forward.wait()
        transfer.forward = None
        ctx.transfer = transfer
        return k, v

    @staticmethod
    def backward(ctx, dk, dv):
        ctx.transfer.backward = ctx.transfer.source.start_backward(dk, dv)  # the collective lays them out itself
        return None, dk.new_empty(0)


def _block_mask(cache: dict, index: int, q_rows, rows, rule, device):
    key = ("flex_block_mask", rule, index, device)
    found = cache.get(key)
    if found is None:
        found = cache[key] = build_block_mask(q_rows, rows, rule, device=device)
    return found


def attend_flex(q, sources, q_rows, k_rows, rule, scale, cache):
    """The ``flex`` backend (contract of :func:`hf_bdlm.attention.backends.attend`)."""
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or any(
        t.requires_grad for s in sources for t in (s if isinstance(s, tuple) else (s.k, s.v))))
    if q.device.type != "cuda":
        if needs_grad:
            raise BackendUnavailable(
                "attention_backend='flex' has no backward pass on CPU in PyTorch; train on CPU with "
                "attention_backend='blockwise' (or 'auto', which picks it there); flex runs CPU inference only."
            )
        # PyTorch's CPU check looks at requires_grad even under no_grad.
        q = q.detach()
        sources = [s if isinstance(s, tuple) else s.materialize() for s in sources]
        sources = [(k.detach(), v.detach()) for k, v in sources]
    with_lse = len(sources) > 1
    # Inference (generation's committing steps, scoring) meets a new length at every block: one dynamic-shape graph.
    dynamic = not torch.is_grad_enabled()

    def partial(i, q, k, v):
        mask = _block_mask(cache, i, q_rows, k_rows[i], rule, q.device)
        return flex_call(q, k, v, mask, scale, with_lse, dynamic=dynamic)

    return attend_sources(q, sources, partial)


def attend_sources(q, sources, partial):
    """Attention of ``q`` over key sources, each computed by ``partial(i, q, k, v) -> (out, lse)`` and merged by
    log-sum-exp (one source: its output as it is). Deferred sources start their transfer first and are computed
    last, from the rows their wait returns; their gradients start home from their attention's backward."""
    transfers = {}
    for i, s in enumerate(sources):
        if not isinstance(s, tuple):
            transfer = transfers[i] = _Transfer(s)
            transfer.token = _StartTransfer.apply(transfer, s.k, s.v)
    partials: list = [None] * len(sources)
    for i in sorted(range(len(sources)), key=lambda j: j in transfers):  # local sources while the others travel
        k, v = _AwaitTransfer.apply(transfers[i], transfers[i].token) if i in transfers else sources[i]
        partials[i] = partial(i, q, k, v)
    if len(partials) == 1:
        return partials[0][0]
    return merge_by_lse(partials, q.dtype)
