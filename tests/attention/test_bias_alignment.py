"""The additive bias handed to CUDA's memory-efficient attention kernel is aligned (hf_bdlm/attention/kernels.py).

The kernel requires the bias's batch, head and row strides to be multiples of 16 bytes and raises "attn_bias is not
correctly aligned (strideM)" otherwise; ``F.scaled_dot_product_attention`` pads the bias before calling it, the direct
call of :class:`~hf_bdlm.attention.kernels.SDPAKernel` must do the same. Tiles 23 or 25 keys wide occur in packed
batches. These checks run on CPU: the strides are what the kernel checks, whatever the device.
"""

from __future__ import annotations

import pytest
import torch

from hf_bdlm.attention import MaskRule, vectorized_rows
from hf_bdlm.attention.kernels import BIAS_ALIGNMENT_BYTES, SDPA_KERNEL, aligned_bias, cuda_bias
from hf_bdlm.attention.tiles import KernelCall, plan_attention

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _assert_kernel_aligned(bias: torch.Tensor) -> None:
    size = bias.element_size()
    assert bias.stride(-1) == 1
    for dim in (0, 1, 2):
        assert bias.stride(dim) * size % BIAS_ALIGNMENT_BYTES == 0, (
            f"stride({dim}) = {bias.stride(dim)} {bias.dtype} values of a bias {tuple(bias.shape)}: not a multiple of "
            f"{BIAS_ALIGNMENT_BYTES} bytes"
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_aligned_bias_keeps_shape_and_values_and_aligns_every_stride(dtype):
    for width in range(1, 41):
        bias = torch.randn(2, 3, 5, width, dtype=torch.float64).to(dtype)
        bias[..., ::3] = float("-inf")
        got = aligned_bias(bias, dtype)
        assert got.shape == bias.shape and got.dtype == dtype
        assert torch.equal(got, bias), f"width {width}"
        _assert_kernel_aligned(got)


def test_aligned_bias_is_a_no_op_when_already_aligned_and_converts_the_dtype():
    bias = torch.randn(2, 3, 5, 16)
    assert aligned_bias(bias, torch.float32) is bias
    got = aligned_bias(torch.randn(1, 1, 4, 23), torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.stride(2) == 24


def _packed_plan():
    """A planned packed-document batch whose masked tiles are 7, 9 (and 16) keys wide."""
    lengths = [23, 25, 16]
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    rows = vectorized_rows(sum(lengths), doc).batch_item(0)
    plan = plan_attention(rows, [rows], MaskRule(16, "causal", 5))
    masked = [c for c in plan.calls if c.mask is not None]
    assert any(c.mask.shape[-1] % 8 for c in masked), [tuple(c.mask.shape) for c in masked]
    return masked


def _call_shape(call: KernelCall, batch: int) -> int:
    """The batch a call's kernel sees (``select_rows`` batches an ``[n, c]`` index into ``batch * n``)."""
    return batch if isinstance(call.q_rows, tuple) else batch * call.q_rows.shape[0]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_cuda_bias_of_an_odd_width_packed_tile_is_aligned(dtype):
    heads, dim, cache = 3, 8, {}
    for call in _packed_plan():
        cq, ck = call.mask.shape
        q = torch.zeros(_call_shape(call, 2), heads, cq, dim, dtype=dtype)
        bias = cuda_bias(call.mask, q, cache)
        assert bias.shape == (q.shape[0], heads, cq, ck) and bias.dtype == dtype
        want = torch.zeros(cq, ck, dtype=dtype).masked_fill(~call.mask, float("-inf"))
        assert torch.equal(bias, want.expand_as(bias))
        _assert_kernel_aligned(bias)
        assert cuda_bias(call.mask, q, cache).untyped_storage().data_ptr() == bias.untyped_storage().data_ptr()


def test_the_cuda_branch_hands_the_kernel_the_aligned_bias_forward_and_backward(monkeypatch):
    # Meta tensors take SDPAKernel's non-CPU branch; the kernel ops are replaced by fakes that record the bias.
    seen = {}

    def forward_op(q, k, v, bias, compute_lse, dropout_p, is_causal, scale=None):
        seen["forward"] = bias
        return torch.empty_like(q), q.new_empty(*q.shape[:2], 32, dtype=torch.float32), q.new_empty(()), q.new_empty(())

    def backward_op(grad_out, q, k, v, bias, out, lse, seed, offset, dropout_p, grad_input_mask, is_causal, scale=None):
        seen["backward"] = bias
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_efficient_attention", forward_op)
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_efficient_attention_backward", backward_op)
    for dtype in DTYPES:
        cache = {}
        for call in _packed_plan():
            cq, ck = call.mask.shape
            q = torch.empty(_call_shape(call, 2), 3, cq, 8, dtype=dtype, device="meta")
            k = torch.empty(q.shape[0], 3, ck, 8, dtype=dtype, device="meta")
            out, lse, extra = SDPA_KERNEL.forward(call, q, k, k, 0.5, cache)
            SDPA_KERNEL.backward(call, out, q, k, k, out, lse, extra, 0.5, cache)
            assert seen["backward"] is seen["forward"]
            assert seen["forward"].shape == (q.shape[0], 3, cq, ck)
            _assert_kernel_aligned(seen["forward"])
