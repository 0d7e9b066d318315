"""Block-sparse attention as an autograd function over a list of dense kernel calls.

A :class:`~hf_bdlm.attention.tiles.TilePlan` lists *calls*: a set of query rows attends to a
contiguous range of key rows of one key *source* (or ``n`` equally shaped pairs, batched), with
an optional boolean mask. Each call runs a fused attention kernel that returns the output and
the log-sum-exp (LSE) of its scores; partial results are merged by LSE (online softmax). The
backward pass re-runs each call's kernel backward with the *merged* output and LSE — exactly
the gradient of the full softmax, the way ring attention does it — so memory stays linear:
only ``q``, ``k``, ``v``, the output and the LSE are saved, never a score matrix.

Several key sources exist because sharded layouts attend to keys held in different tensors
(local noisy K/V and the all-gathered clean K/V of the ring); their gradients come back
separately so each can travel its own way (stay local, or be reduce-scattered). A source that
arrives by communication is a :class:`DeferredKV`: the function starts its transfer, computes
the local sources meanwhile and reads the arrived rows only from the transfer's handle, after
its wait; in backward it starts returning their gradients before computing the local ones.

The loops (row selection, batching, LSE merge, gradient scatter) are written once, here; what
runs one call is an :class:`AttentionKernel`: :data:`SDPA_KERNEL`, PyTorch's fused kernels with an
arbitrary additive mask (on CPU ``_scaled_dot_product_flash_attention_for_cpu``, on CUDA the
memory-efficient kernel, whose bias :func:`aligned_bias` pads to its alignment).
"""

from __future__ import annotations

from typing import Protocol

import torch

from .tiles import DEFAULT_GROUP_ROWS, TilePlan


class BackendUnavailable(RuntimeError):
    """The requested attention backend (or one of its kernels) cannot run in this environment."""


def _additive_mask(mask: torch.Tensor | None, dtype, device, cache: dict) -> torch.Tensor | None:
    if mask is None:
        return None
    key = (id(mask), dtype, device)
    found = cache.get(key)
    if found is None:
        found = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask.to(device), float("-inf"))
        cache[key] = found
    return found


# CUDA's memory-efficient kernel reads the bias in 16-byte vectors: its batch, head and row strides must be multiples
# of 16 bytes (kAlignmentQ: 8 bf16/fp16 values, 4 fp32, 2 fp64), else it raises "attn_bias is not correctly aligned".
BIAS_ALIGNMENT_BYTES = 16


def aligned_bias(bias: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``bias`` (in ``dtype``) as a view whose storage's last dimension is padded to the kernel's alignment.

    Same shape and values; every stride but the last is a multiple of :data:`BIAS_ALIGNMENT_BYTES` for a contiguous
    input (and stays so once expanded over batch and heads: expanded strides are 0). Returns ``bias`` itself when
    it is already aligned. ``F.scaled_dot_product_attention`` pads the same way before calling the kernel; the direct
    ``_scaled_dot_product_efficient_attention`` call does not, and odd tile widths (23, 25 keys in packed Gemma-3
    batches) occur.
    """
    dtype = bias.dtype if dtype is None else dtype
    multiple = max(1, BIAS_ALIGNMENT_BYTES // torch.empty((), dtype=dtype).element_size())
    width = bias.shape[-1]
    if bias.dtype == dtype and bias.stride(-1) == 1 and all(
        (s * bias.element_size()) % BIAS_ALIGNMENT_BYTES == 0 for s in (*bias.stride()[:-1], bias.storage_offset())
    ):
        return bias
    padded = -(-width // multiple) * multiple
    storage = torch.zeros((*bias.shape[:-1], padded), dtype=dtype, device=bias.device)
    storage[..., :width] = bias
    return storage[..., :width]


def cuda_bias(mask: torch.Tensor | None, q: torch.Tensor, cache: dict) -> torch.Tensor | None:
    """The bias the CUDA branch of :class:`SDPAKernel` hands the memory-efficient kernel for a call's boolean mask:
    the additive mask, aligned (:func:`aligned_bias`, built once per mask, dtype and device and cached like
    :func:`_additive_mask`), expanded to ``[n, H, cq, ck]`` for ``q [n, H, cq, d]``."""
    if mask is None:
        return None
    key = ("aligned", id(mask), q.dtype, q.device)
    found = cache.get(key)
    if found is None:
        additive = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask.to(q.device),
                                                                                       float("-inf"))
        found = cache[key] = aligned_bias(additive, q.dtype)
    return found.expand(q.shape[0], q.shape[1], *found.shape[-2:])


class AttentionKernel(Protocol):
    """Runs one planned call: the dense attention of selected query rows over selected key rows.

    ``forward(call, q, k, v, scale, cache) -> (out [n, H, c, d], lse [n, H, c], extra)`` and
    ``backward(call, grad_out, q, k, v, out, lse, extra, scale, cache) -> (dq, dk, dv)``, all in
    ``[batch, heads, rows, dim]`` layout; ``expands_gqa`` says whether ``k``/``v`` must arrive with the
    query's head count; ``group_rows`` is the planner granularity the kernel can run
    (:func:`~.tiles.plan_attention`); ``prepare(plan)`` maps a plan's calls to what the kernel runs.
    """

    expands_gqa: bool
    group_rows: int

    def prepare(self, plan: TilePlan) -> tuple: ...

    def forward(self, call, q, k, v, scale: float, cache: dict): ...

    def backward(self, call, grad_out, q, k, v, out, lse, extra, scale: float, cache: dict): ...


class SDPAKernel:
    """PyTorch's fused kernels with an additive mask: CPU flash attention; CUDA memory-efficient attention."""

    expands_gqa = True
    group_rows = DEFAULT_GROUP_ROWS

    def prepare(self, plan: TilePlan) -> tuple:
        return plan.calls

    def forward(self, call, q, k, v, scale, cache):
        if q.device.type == "cpu":
            mask = _additive_mask(call.mask, q.dtype, q.device, cache)
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, False, attn_mask=mask, scale=scale
            )
            return out, lse, None
        bias = cuda_bias(call.mask, q, cache)  # backward reuses it through ``extra``
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, 0.0, False, scale=scale
        )
        return out, lse[..., : q.shape[2]], (bias, seed, offset, lse)

    def backward(self, call, grad_out, q, k, v, out, lse, extra, scale, cache):
        if q.device.type == "cpu":
            mask = _additive_mask(call.mask, q.dtype, q.device, cache)
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out, q, k, v, out, lse, 0.0, False, attn_mask=mask, scale=scale
            )
        bias, seed, offset, padded_lse = extra
        # The efficient kernel pads its LSE to a multiple of 32 rows; write the merged LSE into that layout.
        full_lse = padded_lse.clone()
        full_lse[..., : q.shape[2]] = lse
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            grad_out, q, k, v, bias, out, full_lse, seed, offset, 0.0, (True, True, True, False), False, scale=scale
        )
        return dq, dk, dv


SDPA_KERNEL = SDPAKernel()


def select_rows(x: torch.Tensor, rows) -> torch.Tensor:
    """Rows of ``x [b, H, T, d]`` selected by a call: a (start, end) range or an index ``[n, c]``.

    An ``[n, c]`` index with ``n > 1`` becomes a batch of ``b * n`` sequences of ``c`` rows.
    """
    if isinstance(rows, tuple):
        return x[:, :, rows[0] : rows[1]]
    n, c = rows.shape
    if n > 1 and x.shape[0] == 1 and x.device.type == "cpu" and x.stride(3) == 1:
        regular = _equally_spaced(rows)
        if regular is not None:
            # n equally spaced runs of one sequence (the noisy block diagonal, the group tiles): a strided view instead
            # of a copy. The CPU kernels read any strides; CUDA keeps the copy until this is checked on a GPU.
            start, step = regular
            return x.as_strided(
                (n, x.shape[1], c, x.shape[3]),
                (step * x.stride(2), x.stride(1), x.stride(2), x.stride(3)),
                x.storage_offset() + start * x.stride(2),
            )
    picked = x.index_select(2, rows.reshape(-1))
    if n == 1:
        return picked
    b, h, _, d = x.shape
    return picked.view(b, h, n, c, d).transpose(1, 2).reshape(b * n, h, c, d)


def _equally_spaced(rows: torch.Tensor) -> tuple[int, int] | None:
    """``(start, step)`` when an index ``[n, c]`` lists runs of ``c`` consecutive rows ``step > 0`` rows apart."""
    n, c = rows.shape
    start, step = int(rows[0, 0]), int(rows[1, 0] - rows[0, 0])
    if step <= 0:
        return None
    expected = start + step * torch.arange(n, device=rows.device)[:, None] + torch.arange(c, device=rows.device)
    return (start, step) if torch.equal(rows, expected) else None


def unbatch_rows(t: torch.Tensor, rows, batch: int) -> torch.Tensor:
    """Inverse of the batching in :func:`select_rows` for a result ``[b*n, H, c, ...]``."""
    if isinstance(rows, tuple) or rows.shape[0] == 1:
        return t
    n = rows.shape[0]
    rest = t.shape[2:]
    return t.view(batch, n, t.shape[1], *rest).transpose(1, 2).reshape(batch, t.shape[1], n * rest[0], *rest[1:])


def scatter_add_rows(target: torch.Tensor, rows, value: torch.Tensor) -> None:
    if isinstance(rows, tuple):
        target[:, :, rows[0] : rows[1]] += value
    else:
        target.index_add_(2, rows.reshape(-1), value)


def _read_rows(x: torch.Tensor, rows) -> torch.Tensor:
    return x[:, :, rows[0] : rows[1]] if isinstance(rows, tuple) else x.index_select(2, rows.reshape(-1))


def _write_rows(x: torch.Tensor, rows, value: torch.Tensor) -> None:
    if isinstance(rows, tuple):
        x[:, :, rows[0] : rows[1]] = value
    else:
        x.index_copy_(2, rows.reshape(-1), value)


def merge_partial(out_acc, lse_acc, rows, out, lse):
    """Merge a partial result (``out``, ``lse``) into accumulators on the given query rows."""
    old_lse = _read_rows(lse_acc.unsqueeze(-1), rows).squeeze(-1)
    old_out = _read_rows(out_acc, rows)
    new_lse = torch.logaddexp(old_lse, lse)
    # Rows still empty on both sides keep -inf and a zero output instead of NaN.
    safe = torch.where(torch.isinf(new_lse), torch.zeros_like(new_lse), new_lse)
    w_old = torch.exp(old_lse - safe).unsqueeze(-1)
    w_new = torch.exp(lse - safe).unsqueeze(-1)
    _write_rows(out_acc, rows, old_out * w_old + out.to(out_acc.dtype) * w_new)
    _write_rows(lse_acc.unsqueeze(-1), rows, new_lse.unsqueeze(-1))


def new_accumulators(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed output and ``-inf`` LSE accumulators for ``q`` (float32 at least)."""
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out_acc = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    lse_acc = torch.full(q.shape[:-1], float("-inf"), dtype=acc_dtype, device=q.device)
    return out_acc, lse_acc


def forward_calls(calls, q, keys: dict, values: dict, scale, out_acc, lse_acc, cache, kernel=SDPA_KERNEL) -> list:
    """Run kernel calls and merge them into the accumulators (``keys``/``values`` by source, GQA-expanded
    when the kernel needs it). Returns what each call's backward needs besides the tensors."""
    batch = q.shape[0]
    extras = []
    for call in calls:
        qs = select_rows(q, call.q_rows)
        ks = select_rows(keys[call.source], call.k_rows)
        vs = select_rows(values[call.source], call.k_rows)
        out, lse, extra = kernel.forward(call, qs, ks, vs, scale, cache)
        if call.empty_rows is not None:
            # PyTorch's kernels report LSE 0 for a row whose keys are all masked; an empty row must not weigh in
            # the merge.
            lse = lse.masked_fill(call.empty_rows.to(lse.device), float("-inf"))
        extras.append(extra)
        merge_partial(
            out_acc,
            lse_acc,
            call.q_rows,
            unbatch_rows(out, call.q_rows, batch),
            unbatch_rows(lse.unsqueeze(-1), call.q_rows, batch).squeeze(-1),
        )
    return extras


def backward_calls(calls, extras, q, keys: dict, values: dict, grad_out, out, lse, scale, cache, dq, dks, dvs,
                   kernel=SDPA_KERNEL):
    """Gradients of kernel calls given the *merged* output and LSE, added into ``dq``/``dks``/``dvs``."""
    batch = q.shape[0]
    lse_kernel = lse if q.dtype == torch.float64 else lse.float()
    for call, extra in zip(calls, extras):
        qs = select_rows(q, call.q_rows)
        ks = select_rows(keys[call.source], call.k_rows)
        vs = select_rows(values[call.source], call.k_rows)
        go = select_rows(grad_out, call.q_rows)
        os_ = select_rows(out, call.q_rows)
        ls = select_rows(lse_kernel.unsqueeze(-1), call.q_rows).squeeze(-1).contiguous()
        dqs, dks_, dvs_ = kernel.backward(call, go, qs, ks, vs, os_, ls, extra, scale, cache)
        scatter_add_rows(dq, call.q_rows, unbatch_rows(dqs, call.q_rows, batch))
        scatter_add_rows(dks[call.source], call.k_rows, unbatch_rows(dks_, call.k_rows, batch))
        scatter_add_rows(dvs[call.source], call.k_rows, unbatch_rows(dvs_, call.k_rows, batch))


class DeferredKV(Protocol):
    """A key source whose rows arrive by communication (e.g. :class:`hf_bdlm.parallel.collectives.GatheredKV`).

    ``k``/``v`` are this rank's contribution (the autograd inputs); :meth:`start_forward` starts
    the transfer and returns a handle whose ``wait()`` yields the full ``(k, v)``; :meth:`start_backward`
    sends the full gradients back and its handle's ``wait()`` yields the gradients of ``k``/``v``.
    The rows are reachable only through those handles, so nothing reads them before they arrive.
    """

    k: torch.Tensor
    v: torch.Tensor

    @property
    def num_rows(self) -> int: ...

    def with_kv(self, k: torch.Tensor, v: torch.Tensor) -> "DeferredKV": ...

    def start_forward(self, k: torch.Tensor, v: torch.Tensor): ...

    def start_backward(self, dk: torch.Tensor, dv: torch.Tensor): ...

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]: ...


def _item_views(call_lists, *tensors):
    """``(calls, views)`` per batch item group: one shared call list covers the whole batch; per-item lists
    get per-item views (``t[i:i+1]``, writes go through to ``t``)."""
    if len(call_lists) == 1:
        return [(call_lists[0], tensors)]
    return [(calls, tuple(t[i : i + 1] for t in tensors)) for i, calls in enumerate(call_lists)]


class BlockSparseAttention(torch.autograd.Function):
    """``out = softmax(q k^T * scale + mask) v`` over the planned calls, run by ``kernel``.

    ``call_lists`` holds one call list for the whole batch, or one per batch item (packed documents
    that differ between items). ``deferred[i]`` is ``None`` for a local source ``i`` and a
    :class:`DeferredKV` for one that arrives by communication: its transfer starts first, the
    local sources are computed meanwhile, and its rows are read only from the handle's wait. In
    backward the deferred sources go first, so their gradients travel while the local ones compute.
    """

    @staticmethod
    def forward(ctx, call_lists, scale: float, kernel, deferred: tuple, q: torch.Tensor, *kv):
        num_sources = len(kv) // 2
        groups = q.shape[1] // kv[0].shape[1] if kernel.expands_gqa else 1
        in_flight = {i: d.start_forward(kv[2 * i], kv[2 * i + 1]) for i, d in enumerate(deferred) if d is not None}
        out_acc, lse_acc = new_accumulators(q)
        cache: dict = {}
        extras: dict = {}
        resolved: list = [None] * num_sources
        for source in sorted(range(num_sources), key=lambda i: i in in_flight):  # local sources first
            k, v = in_flight[source].wait() if source in in_flight else (kv[2 * source], kv[2 * source + 1])
            resolved[source] = (k, v)
            k, v = repeat_kv(k, groups), repeat_kv(v, groups)
            per_item = len(call_lists) > 1
            for item, (calls, (q_i, out_i, lse_i)) in enumerate(_item_views(call_lists, q, out_acc, lse_acc)):
                calls = [c for c in calls if c.source == source]
                sl = slice(item, item + 1) if per_item else slice(None)
                extras[source, item] = forward_calls(calls, q_i, {source: k[sl]}, {source: v[sl]}, scale, out_i,
                                                     lse_i, cache, kernel)
        out = out_acc.to(q.dtype)
        ctx.call_lists, ctx.scale, ctx.kernel, ctx.groups, ctx.deferred = call_lists, scale, kernel, groups, deferred
        ctx.cache, ctx.extras = cache, extras
        ctx.save_for_backward(q, out, lse_acc, *[t for pair in resolved for t in pair])
        ctx.mark_non_differentiable(lse_acc)
        return out, lse_acc

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, out, lse, *kv = ctx.saved_tensors
        groups, call_lists, deferred = ctx.groups, ctx.call_lists, ctx.deferred
        grad_out = grad_out.contiguous()
        dq = torch.zeros_like(q)
        grads: list = [None] * len(kv)
        returning = {}
        per_item = len(call_lists) > 1
        for source in sorted(range(len(kv) // 2), key=lambda i: deferred[i] is None):  # deferred sources first
            k, v = repeat_kv(kv[2 * source], groups), repeat_kv(kv[2 * source + 1], groups)
            dk, dv = torch.zeros_like(k), torch.zeros_like(v)
            views = _item_views(call_lists, q, grad_out, out, lse, dq)
            for item, (calls, (q_i, go_i, out_i, lse_i, dq_i)) in enumerate(views):
                calls = [c for c in calls if c.source == source]
                sl = slice(item, item + 1) if per_item else slice(None)
                backward_calls(calls, ctx.extras[source, item], q_i, {source: k[sl]}, {source: v[sl]}, go_i, out_i,
                               lse_i, ctx.scale, ctx.cache, dq_i, {source: dk[sl]}, {source: dv[sl]}, ctx.kernel)
            dk, dv = sum_kv_groups(dk, groups), sum_kv_groups(dv, groups)
            if deferred[source] is not None:
                returning[source] = deferred[source].start_backward(dk, dv)
            else:
                grads[2 * source], grads[2 * source + 1] = dk, dv
        for source, handle in returning.items():
            grads[2 * source], grads[2 * source + 1] = handle.wait()
        return (None, None, None, None, dq, *grads)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Expand ``[b, H_kv, T, d]`` to ``[b, H_kv * groups, T, d]``: query head ``h`` uses key head ``h // groups``."""
    if groups == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, groups, t, d).reshape(b, h * groups, t, d)


def sum_kv_groups(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """Adjoint of :func:`repeat_kv`."""
    if groups == 1:
        return grad
    b, h, t, d = grad.shape
    return grad.view(b, h // groups, groups, t, d).sum(2)


def block_sparse_attention(plans, q: torch.Tensor, kv_sources, scale: float, kernel: AttentionKernel = SDPA_KERNEL):
    """Attention of ``q [b, H, Tq, d]`` over ``kv_sources``: ``(k, v)`` pairs (``[b, H_kv, Tk_i, d]``) or
    :class:`DeferredKV` sources, planned by ``plans`` (one :class:`TilePlan`, or one per batch item) and run by
    ``kernel``.

    Returns ``(out [b, H, Tq, d], lse [b, H, Tq])``; the LSE carries no gradient.
    """
    plans = (plans,) if isinstance(plans, TilePlan) else tuple(plans)
    if len(plans) not in (1, q.shape[0]):
        raise ValueError(f"got {len(plans)} plans for a batch of {q.shape[0]}: pass one plan, or one per item.")
    deferred = tuple(None if isinstance(s, tuple) else s for s in kv_sources)
    flat = [t for s in kv_sources for t in (s if isinstance(s, tuple) else (s.k, s.v))]
    call_lists = tuple(kernel.prepare(plan) for plan in plans)
    return BlockSparseAttention.apply(call_lists, scale, kernel, deferred, q, *flat)
