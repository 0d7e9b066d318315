"""The ``flash`` backend: the block-sparse plan of :mod:`.tiles` run by flash-attn 2 kernels.

flash-attn takes no arbitrary mask, only ``causal`` and a sliding ``window_size``, so every
kernel call of the plan is mapped to those flags (:func:`flash_call`): an unmasked call runs
non-causal; a masked tile is always a band of the diagonal (the token-causal diagonal of the
clean stream, a sliding-window edge, or both), which becomes ``causal`` / ``window_size``
after trimming the leading and trailing query rows and keys the mask leaves empty (flash-attn
aligns its diagonal to the bottom-right corner, so a band off that diagonal needs the trim);
any other mask raises ``NotImplementedError`` naming the tile. Partial results are merged by
log-sum-exp and the backward re-runs each call with the merged output and LSE: the loops are
:class:`.kernels.BlockSparseAttention`'s, with :class:`FlashAttnKernel` running each call; GQA is
passed through unexpanded (flash-attn supports it).

Needs CUDA, fp16/bf16 tensors, head dim a multiple of 8 (<= 256) and ``flash-attn >= 2.6``
(``pip install 'hf-bdlm[flash]'``). It uses flash-attn's internal ``_flash_attn_forward`` /
``_flash_attn_backward`` (the public functions do not return the LSE with a backward):
2.6.x takes ``window_size=(left, right)`` and returns 8 values from the forward, 2.7+ takes
``window_size_left/right`` and returns 4; both write ``dq, dk, dv`` into given buffers.
Usage: ``BlockDiffusionConfig(..., attention_backend="flash")`` on a CUDA model in bf16.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from .kernels import BackendUnavailable, block_sparse_attention
from .tiles import KernelCall, TilePlan, batch_plans


@dataclass(frozen=True)
class FlashCall:
    """A kernel call in flash-attn terms: rows (after trimming), ``causal`` and ``window`` flags.

    ``trim = (q_head, q_tail, k_head, k_tail)``: rows/keys dropped at both ends of the call's
    tile, which the mask leaves without any allowed pair.
    """

    q_rows: tuple[int, int] | torch.Tensor
    source: int
    k_rows: tuple[int, int] | torch.Tensor
    causal: bool
    window: tuple[int, int]
    trim: tuple[int, int, int, int]
    empty_rows: torch.Tensor | None


def _trim(rows, head: int, tail: int):
    if isinstance(rows, tuple):
        return (rows[0] + head, rows[1] - tail)
    return rows[:, head : rows.shape[1] - tail]


def flash_call(call: KernelCall) -> FlashCall:
    """Map a plan's kernel call to flash-attn flags, or raise ``NotImplementedError``."""
    if call.mask is None:
        return FlashCall(call.q_rows, call.source, call.k_rows, False, (-1, -1), (0, 0, 0, 0), None)
    mask = call.mask.cpu()
    rows_used, keys_used = mask.any(1).nonzero().flatten(), mask.any(0).nonzero().flatten()
    q0, q1 = int(rows_used[0]), mask.shape[0] - 1 - int(rows_used[-1])
    k0, k1 = int(keys_used[0]), mask.shape[1] - 1 - int(keys_used[-1])
    sub = mask[q0 : mask.shape[0] - q1, k0 : mask.shape[1] - k1]
    cq, ck = sub.shape
    # Offset of each allowed pair from flash-attn's (bottom-right aligned) diagonal.
    offset = torch.arange(ck)[None, :] - torch.arange(cq)[:, None] - (ck - cq)
    lo, hi = int(offset[sub].min()), int(offset[sub].max())
    band = (offset >= lo) & (offset <= hi)
    if not (lo <= 0 <= hi and torch.equal(band, sub)):
        q_desc = call.q_rows if isinstance(call.q_rows, tuple) else f"index {tuple(call.q_rows.shape)}"
        k_desc = call.k_rows if isinstance(call.k_rows, tuple) else f"index {tuple(call.k_rows.shape)}"
        raise NotImplementedError(
            f"attention_backend='flash' cannot express the mask of the tile at query rows {q_desc}, "
            f"key rows {k_desc} of source {call.source} (not a causal/sliding-window band):\n{mask.int()}\n"
            "Use attention_backend='blockwise' or 'flex'."
        )
    # A bound that cuts nothing is unbounded (-1): (-1, 0) is flash-attn's plain causal case.
    left = -1 if lo == int(offset.min()) else -lo
    right = -1 if hi == int(offset.max()) else hi
    empty = ~sub.any(1)
    return FlashCall(
        _trim(call.q_rows, q0, q1),
        call.source,
        _trim(call.k_rows, k0, k1),
        right == 0 and left == -1,
        (left, right),
        (q0, q1, k0, k1),
        empty if bool(empty.any()) else None,
    )


def _flash_api():
    try:
        from flash_attn import flash_attn_interface as fa
    except ImportError as exc:
        raise BackendUnavailable(
            f"attention_backend='flash' needs flash-attn >= 2.6 ({exc}); pip install 'hf-bdlm[flash]'."
        ) from exc
    # 2.7+ wraps the function in a torch custom op, whose own signature is (*args, **kwargs).
    forward = getattr(fa._flash_attn_forward, "_init_fn", fa._flash_attn_forward)
    split_window = "window_size_left" in inspect.signature(forward).parameters
    return fa, split_window


def _flags(fc: FlashCall, scale: float, split_window: bool) -> dict:
    flags = dict(dropout_p=0.0, softmax_scale=scale, causal=fc.causal, softcap=0.0, alibi_slopes=None)
    if split_window:
        flags.update(window_size_left=fc.window[0], window_size_right=fc.window[1])
    else:
        flags.update(window_size=fc.window)
    return flags


def _bthd(x: torch.Tensor) -> torch.Tensor:
    # [b, H, T, d] -> flash-attn's [b, T, H, d]; only the last dim must be contiguous.
    x = x.transpose(1, 2)
    return x if x.stride(-1) == 1 else x.contiguous()


class FlashAttnKernel:
    """:class:`~.kernels.AttentionKernel` over flash-attn: block-sized tiles, calls mapped by :func:`flash_call`."""

    expands_gqa = False  # flash-attn takes GQA K/V as they are
    group_rows = 0  # block tiles only: a tile's mask must be a causal band or a window

    def __init__(self):
        self._prepared: dict[int, tuple] = {}

    def prepare(self, plan: TilePlan) -> tuple:
        found = self._prepared.get(id(plan))
        if found is None or found[0] is not plan:
            found = self._prepared[id(plan)] = (plan, tuple(flash_call(c) for c in plan.calls))
        return found[1]

    def forward(self, call: FlashCall, q, k, v, scale, cache):
        fa, split_window = _flash_api()
        res = fa._flash_attn_forward(_bthd(q), _bthd(k), _bthd(v), return_softmax=False,
                                     **_flags(call, scale, split_window))
        # 2.6 returns (out, q, k, v, out_padded, lse, S, rng), 2.7+ (out_padded, lse, S, rng).
        return res[0].transpose(1, 2), res[-3], None

    def backward(self, call: FlashCall, grad_out, q, k, v, out, lse, extra, scale, cache):
        fa, split_window = _flash_api()
        qs, ks, vs = _bthd(q), _bthd(k), _bthd(v)
        dq, dk, dv = torch.empty_like(qs), torch.empty_like(ks), torch.empty_like(vs)
        fa._flash_attn_backward(
            _bthd(grad_out), qs, ks, vs, _bthd(out), lse, dq, dk, dv,
            deterministic=False, rng_state=None, **_flags(call, scale, split_window),
        )  # fmt: skip
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def attend_flash_attn(q, sources, q_rows, k_rows, rule, scale, cache):
    """The ``flash`` backend (same contract as :func:`hf_bdlm.attention.backends.attend`)."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise BackendUnavailable(
            f"attention_backend='flash' runs in float16/bfloat16 only, got {q.dtype}; load the model in bf16 or "
            "use attention_backend='blockwise' (any dtype)."
        )
    if q.shape[-1] % 8 or q.shape[-1] > 256:
        raise BackendUnavailable(
            f"attention_backend='flash' needs a head dim that is a multiple of 8 and at most 256, got "
            f"{q.shape[-1]}; use attention_backend='blockwise'."
        )
    _flash_api()
    kernel = cache.setdefault("flash_kernel", FlashAttnKernel())
    plans = batch_plans(q_rows, k_rows, rule, cache, q.shape[0], group_rows=kernel.group_rows)
    return block_sparse_attention(plans, q, sources, scale, kernel)[0]
