"""`DFlashDraftModel` and `DFlash2DraftModel`: DFlash speculative drafters, small Qwen3-style layer stacks conditioned
on a frozen target causal LM.

The drafter reads the target's hidden states at `config.target_layer_ids` (captured features, `[b, T, n * H_t]`),
projects them with ``fc`` and ``hidden_norm`` to its width, and lets them into attention only as keys and values
(each layer's own ``k_proj`` / ``v_proj`` / ``k_norm``, RoPE at the context positions). A draft block
``[anchor token, mask x (B - 1)]``, embedded by the target's frozen input embedding at RoPE positions
``pos(anchor) + k``, attends to its own ``B`` tokens (bidirectionally; causally on sliding-window layers unless the
config says non-causal) and to the context strictly before its anchor, in the anchor's document and, on a
sliding-window layer, within the window (:func:`draft_context_mask`, the one statement of that rule). The final
``norm`` and the target's frozen LM head give the logits. DFlash2 adds block-local causal depthwise dynamic
convolutions around attention and MLP (identity at initialisation) and a candidate selector head.

The target's embedding and head are bound, not owned (:meth:`DFlashDraftModel.bind_target`): they never enter the
drafter's ``state_dict`` or ``save_pretrained`` folder, whose weight names are the serving engines' (``fc.weight``,
``layers.0.self_attn.q_proj.weight``, ``layers.0.attention_conv.base_kernel``, ...). Tiny CPU example::

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from hf_bdlm.models.dflash.modeling import DFlash2DraftModel
    target = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, pad_token_id=0))
    drafter = DFlash2DraftModel.from_target(target, num_hidden_layers=2, selector_rank=8, selector_top_k=4)
    ids = torch.randint(1, 64, (1, 24))
    states = target(ids, output_hidden_states=True).hidden_states
    features = torch.cat([states[i] for i in drafter.config.target_layer_ids], dim=-1)     # [1, 24, 64]
    out = drafter(features, ids, anchor_positions=torch.tensor([[3, 11]]))
    out.logits.shape                                                                        # [1, 2 * 8, 64]
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.utils import ModelOutput

from ...attention.block_mask import interval_block_mask
from ...attention.flex import flex_call
from ...attention.kernels import merge_partial, new_accumulators, repeat_kv
from ...attention.rows import document_starts
from .configuration import DFlashConfig

logger = logging.getLogger(__name__)


@dataclass
class DFlashDraftOutput(ModelOutput):
    """
    Args:
        hidden_states (`torch.FloatTensor` of shape `[batch, anchors * block_size, hidden_size]`):
            The drafter's last hidden states (after the final `norm`), block after block.
        logits (`torch.FloatTensor` of shape `[batch, anchors * block_size, vocab_size]`, *optional*):
            The target head's logits of those states (`None` with `return_logits=False`).
    """

    hidden_states: torch.Tensor | None = None
    logits: torch.Tensor | None = None


# --- the mask rule --------------------------------------------------------------------------------------------------
@dataclass(eq=False)
class DraftContext:
    """Which context rows each draft query may see: the sequence indices ``lo[b, i] .. hi[b, i]`` (inclusive; empty
    when ``lo > hi``) of query row ``i`` (block ``a``, offset ``k`` at ``i = a * block_size + k``), over context rows
    at sequence indices ``positions [b, T]``. An interval per query, so the CUDA path builds its FlexAttention block
    mask from the intervals (:func:`hf_bdlm.attention.block_mask.interval_block_mask`) and never a ``[queries x T]``
    tensor; :meth:`dense` is that tensor, for the CPU path and the tests."""

    lo: torch.Tensor
    hi: torch.Tensor
    positions: torch.Tensor

    def __post_init__(self):
        self._block_masks: dict = {}

    @property
    def num_context_rows(self) -> int:
        return int(self.positions.shape[-1])

    def dense(self) -> torch.Tensor:
        """`torch.BoolTensor` of shape `[b, queries, T]`."""
        context = self.positions[:, None, :]
        return (context >= self.lo[..., None]) & (context <= self.hi[..., None])

    def sees_everything(self) -> bool:
        """Whether every query sees every context row (a decoding step over an unwindowed context of equal lengths):
        then attention needs no mask at all."""
        if self.positions.numel() == 0:
            return False
        return bool((self.lo <= self.positions.min(-1, keepdim=True).values).all()
                    and (self.hi >= self.positions.max(-1, keepdim=True).values).all())

    def block_mask(self, device):
        found = self._block_masks.get(device)
        if found is None:
            found = self._block_masks[device] = interval_block_mask(self.lo, self.hi, self.positions, device=device)
        return found

    def select(self, positions: torch.Tensor) -> "DraftContext":
        """The same queries over other context rows (a shard, the peers' rows)."""
        return DraftContext(self.lo, self.hi, positions)


def draft_context(
    anchor_positions: torch.Tensor,
    context_positions: torch.Tensor,
    block_size: int,
    *,
    anchor_document_starts: torch.Tensor | None = None,
    anchor_valid: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> DraftContext:
    """Which context features each draft token may attend to: the one statement of DFlash's context rule.

    The query at offset ``k`` of the block of anchor ``a`` (sequence index ``s_a``) may see the context token at
    sequence index ``p`` iff the anchor is valid, ``p < s_a`` (strictly before the anchor), ``p >= start_a`` (the
    anchor's document) and, with a sliding window ``W``, ``p >= s_a + k - (W - 1)`` (within ``W`` of the query's own
    index ``s_a + k``, itself included). All positions are indices into the token sequence.

    Args:
        anchor_positions (`torch.LongTensor` of shape `[batch, A]`): sequence indices of the anchors.
        context_positions (`torch.LongTensor` of shape `[batch, T]`): sequence indices of the context features (all
            of them or one shard).
        block_size (`int`): tokens per draft block.
        anchor_document_starts (`torch.LongTensor` of shape `[batch, A]`, *optional*): index of the first token of
            each anchor's document (:func:`hf_bdlm.attention.rows.document_starts`); `None`: one document.
        anchor_valid (`torch.BoolTensor` of shape `[batch, A]`, *optional*): an invalid anchor sees no context.
        sliding_window (`int`, *optional*): the layer's window; `None` on a full-attention layer.

    Returns:
        [`DraftContext`] over `A * block_size` queries, block after block.
    """
    anchor = anchor_positions[:, :, None]
    offsets = torch.arange(block_size, device=anchor.device)[None, None, :]
    lo = torch.zeros_like(anchor)
    if anchor_document_starts is not None:
        lo = torch.maximum(lo, anchor_document_starts[:, :, None])
    if sliding_window is not None:
        lo = torch.maximum(lo, anchor + offsets - (sliding_window - 1))
    lo = lo.expand(-1, -1, block_size)
    hi = (anchor - 1).expand(-1, -1, block_size)
    if anchor_valid is not None:
        lo = torch.where(anchor_valid[:, :, None], lo, hi + 1)
    return DraftContext(lo.flatten(1), hi.flatten(1), context_positions)


def draft_context_mask(anchor_positions: torch.Tensor, context_positions: torch.Tensor, block_size: int,
                       **kwargs) -> torch.Tensor:
    """:func:`draft_context` as a `torch.BoolTensor` of shape `[batch, A, block_size, T]` (the CPU path, tests)."""
    b, anchors = anchor_positions.shape
    return draft_context(anchor_positions, context_positions, block_size, **kwargs).dense().view(
        b, anchors, block_size, context_positions.shape[-1])


def draft_block_mask(block_size: int, causal: bool, device=None) -> torch.Tensor | None:
    """Attention inside one draft block: `None` (every token sees the whole block) or, causal, `[B, B]` lower
    triangular (token ``k`` sees tokens ``0..k``)."""
    if not causal:
        return None
    return torch.ones(block_size, block_size, dtype=torch.bool, device=device).tril()


def fused_attention(query: torch.Tensor) -> bool:
    """Whether the drafter's attention runs FlexAttention (CUDA: fused kernels, no dense mask) rather than the
    explicit softmax of :func:`attend_with_lse` (CPU, where FlexAttention has no backward)."""
    return query.device.type == "cuda"


@functools.lru_cache(maxsize=16)
def _draft_block_mask(n: int, block_size: int, causal: bool, device):
    """FlexAttention block mask of ``n`` draft rows over themselves: each sees its own block (causally on a
    block-causal layer), built once per shape."""
    rows = torch.arange(n)
    lo = (rows // block_size * block_size)[None]
    hi = rows[None] if causal else (lo + block_size - 1)
    return interval_block_mask(lo, hi, rows[None], device=device)


# --- attention over [context keys ; block keys], mergeable by log-sum-exp --------------------------------------------
def attend_with_lse(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over one set of keys that also returns the log-sum-exp of its scores, so partial results over
    disjoint key sets (the draft block, context shards) merge exactly (:func:`merge_partials`).

    Args:
        query (`torch.Tensor` of shape `[..., heads, n, d]`), key, value (`[..., heads, m, d]`).
        mask (`torch.BoolTensor` broadcastable to `[..., heads, n, m]`, *optional*): `True` where allowed.
        scale (`float`): score scale.

    Returns:
        `(output [..., heads, n, d], lse [..., heads, n])` in float32 (float64 for float64 inputs). A query with no
        allowed key gets a zero output and an lse of `-inf` (it adds nothing to a merge).
    """
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    scores = torch.matmul(query.to(acc), key.to(acc).transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - safe[..., None])
    return torch.matmul(probs, value.to(acc)), lse


def merge_partials(partials: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Merge partial attention results ``(output [b, H, n, d], lse [b, H, n])`` over disjoint key sets into the
    attention over their union (the ring-attention merge of ``hf_bdlm.attention.kernels``, autograd-safe: rows are
    addressed by index, so no view of an accumulator is saved for backward)."""
    out_acc, lse_acc = new_accumulators(partials[0][0])
    rows = torch.arange(out_acc.shape[2], device=out_acc.device)
    for out, lse in partials:
        merge_partial(out_acc, lse_acc, rows, out, lse)
    return out_acc


# --- layers ---------------------------------------------------------------------------------------------------------
class Rotary(NamedTuple):
    """Rotary factors ``cos`` / ``sin`` of shape `[b, n, 1, head_dim]`."""

    cos: torch.Tensor
    sin: torch.Tensor


def rotary_factors(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> Rotary:
    """Plain RoPE factors at ``positions [b, n]``: angles in float32 (float64 for a float64 model), then cast."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    angle_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    angles = positions.to(angle_dtype)[..., None] * inv_freq.to(angle_dtype)
    angles = torch.cat((angles, angles), dim=-1)[:, :, None, :]
    return Rotary(angles.cos().to(dtype), angles.sin().to(dtype))


def apply_rotary(states: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    first, second = states.chunk(2, dim=-1)
    return states * rotary.cos + torch.cat((-second, first), dim=-1) * rotary.sin


class ContextAttention(Protocol):
    """Where a layer's draft queries find their context when it is not one local tensor of projected features: the
    sharded training forward (``hf_bdlm.models.dflash.training.sharded``, whose context rows live on several ranks) and
    decoding from a :class:`DFlashContextCache` (whose keys and values were projected when their rows were committed).

    A layer's attention passes itself and its queries; the provider returns partial attention results over disjoint
    sets of context keys (each from :meth:`DFlashAttention.attend_context`), which the layer merges with its draft
    block's by log-sum-exp. Keys are the layer's own :meth:`DFlashAttention.key_value` of projected features.
    """

    def partials(self, attention: "DFlashAttention", query: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        ...


class DFlashRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(hidden_states, (hidden_states.shape[-1],), self.weight, self.eps)


class DFlashMLP(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(hidden_states)) * self.up_proj(hidden_states))


class DFlashAttention(nn.Module):
    """Draft-block queries over ``[context keys ; block keys]``: the context K/V come from the projected target
    features through this layer's own ``k_proj`` / ``v_proj`` / ``k_norm``."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scaling = config.head_dim**-0.5
        self.block_size = config.block_size
        self.layer_idx = layer_idx
        self.sliding_window = config.layer_window(layer_idx)
        self.block_causal = config.layer_block_causal(layer_idx)
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)

    def _heads(self, states: torch.Tensor, heads: int) -> torch.Tensor:
        return states.view(*states.shape[:2], heads, self.head_dim)

    def key_value(self, states: torch.Tensor, rotary: Rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``states [b, n, hidden]`` (context features or draft tokens), ``[b, H_kv, n, d]``."""
        key = apply_rotary(self.k_norm(self._heads(self.k_proj(states), self.num_kv_heads)), rotary)
        value = self._heads(self.v_proj(states), self.num_kv_heads)
        return key.transpose(1, 2), value.transpose(1, 2)

    def attend_context(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       context: "DraftContext | torch.Tensor") -> tuple[torch.Tensor, torch.Tensor]:
        """Partial attention of ``query [b, H, n, d]`` over context keys ``key`` / ``value`` (``[b, H_kv, m, d]``,
        from :meth:`key_value`) where ``context`` (a :class:`DraftContext`, or a mask ``[b, n, m]``) allows;
        ``(output, lse)`` as :func:`attend_with_lse`. On CUDA a :class:`DraftContext` runs one FlexAttention call over
        its interval block mask (no mask at all when every query sees every row), GQA in the kernel."""
        if isinstance(context, DraftContext):
            if fused_attention(query):
                if context.sees_everything():  # a decoding step: no mask, one graph for every context length
                    return flex_call(query, key, value, None, self.scaling, with_lse=True, dynamic=True)
                return flex_call(query, key, value, context.block_mask(query.device), self.scaling, with_lse=True)
            context = context.dense()
        groups = self.num_heads // self.num_kv_heads
        return attend_with_lse(query, repeat_kv(key, groups), repeat_kv(value, groups), context[:, None],
                               self.scaling)

    def attend_block(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor,
                                                                                                   torch.Tensor]:
        """Partial attention of the draft queries ``[b, H, n, d]`` over their own block's keys (``[b, H_kv, n, d]``):
        the whole block, or its causal part on a block-causal layer. On CUDA one FlexAttention call over the blocks'
        diagonal (no mask when ``n`` is one block that sees itself whole), GQA in the kernel."""
        b, _, n, _ = query.shape
        blocks = n // self.block_size
        if fused_attention(query):
            mask = None
            if blocks > 1 or self.block_causal:
                mask = _draft_block_mask(n, self.block_size, self.block_causal, query.device)
            return flex_call(query, key, value, mask, self.scaling, with_lse=True)
        groups = self.num_heads // self.num_kv_heads

        def per_block(x):
            return x.reshape(b, x.shape[1], blocks, self.block_size, self.head_dim)

        out, lse = attend_with_lse(per_block(query), per_block(repeat_kv(key, groups)),
                                   per_block(repeat_kv(value, groups)),
                                   draft_block_mask(self.block_size, self.block_causal, query.device), self.scaling)
        return out.reshape(b, self.num_heads, n, self.head_dim), lse.reshape(b, self.num_heads, n)

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: "torch.Tensor | ContextAttention",
        *,
        draft_rotary: Rotary,
        context_rotary: Rotary | None = None,
        context_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        b, n, _ = hidden_states.shape
        query = apply_rotary(self.q_norm(self._heads(self.q_proj(hidden_states), self.num_heads)), draft_rotary)
        query = query.transpose(1, 2)                                                    # [b, H, n, d]
        partials = [self.attend_block(query, *self.key_value(hidden_states, draft_rotary))]
        if isinstance(context, torch.Tensor):
            partials.append(self.attend_context(query, *self.key_value(context, context_rotary), context_mask))
        else:
            partials += context.partials(self, query)
        out = merge_partials(partials).to(hidden_states.dtype)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim))


class DFlashDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, context: "torch.Tensor | ContextAttention",
                **attention_kwargs) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), context,
                                                       **attention_kwargs)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class BlockConvolution(nn.Module):
    """Block-local causal depthwise dynamic convolution (DFlash2): output ``t`` of a draft block is
    ``sum_j (base[j] + dynamic[t, j]) * x[t - j]`` over ``j < taps`` (``x`` zero before the block's start), with a
    static per-channel kernel ``base`` and a per-token, per-channel-group kernel ``dynamic`` projected from the
    normalised input. One module wraps a sublayer: side 0 of its kernels convolves the sublayer's input
    (:meth:`prepare`), side 1 its output (:meth:`finish`). Identity at initialisation (``base[:, 0] = 1``, the
    projection zero)."""

    def __init__(self, hidden_size: int, block_size: int, taps: int, group_size: int):
        super().__init__()
        self.block_size, self.taps, self.group_size = block_size, taps, group_size
        self.num_groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(identity_kernel(taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.num_groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def _convolve(self, hidden_states: torch.Tensor, dynamic: torch.Tensor, side: int) -> torch.Tensor:
        b, n, width = hidden_states.shape
        shape = (b, n // self.block_size, self.block_size)
        x = hidden_states.view(*shape, self.num_groups, self.group_size)
        dynamic = dynamic.view(*shape, self.taps, self.num_groups)
        base = self.base_kernel[side].view(self.taps, self.num_groups, self.group_size)
        out = None
        for j in range(self.taps):
            shifted = x if j == 0 else F.pad(x[:, :, : self.block_size - j], (0, 0, 0, 0, j, 0))
            term = (base[j] + dynamic[:, :, :, j, :, None]) * shifted
            out = term if out is None else out + term
        return out.reshape(b, n, width)

    def prepare(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Convolve a sublayer's input; returns it and the kernels :meth:`finish` applies to the sublayer's output."""
        kernels = self.kernel_projection(hidden_states).view(*hidden_states.shape[:-1], 2, self.taps,
                                                             self.num_groups)
        return self._convolve(hidden_states, kernels[..., 0, :, :], side=0), kernels[..., 1, :, :]

    def finish(self, hidden_states: torch.Tensor, kernels: torch.Tensor) -> torch.Tensor:
        return self._convolve(hidden_states, kernels, side=1)


def identity_kernel(taps: int, hidden_size: int) -> torch.Tensor:
    """The ``[2, taps, hidden]`` base kernel of an identity convolution (tap 0 is one, the others zero)."""
    kernel = torch.zeros(2, taps, hidden_size)
    kernel[:, 0] = 1.0
    return kernel


class DFlash2DecoderLayer(DFlashDecoderLayer):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        method = config.dflash_config
        conv = (config.hidden_size, config.block_size, method["conv_kernel_size"], method["conv_group_size"])
        self.attention_conv = BlockConvolution(*conv)
        self.mlp_conv = BlockConvolution(*conv)

    def forward(self, hidden_states: torch.Tensor, context: "torch.Tensor | ContextAttention",
                **attention_kwargs) -> torch.Tensor:
        x, kernels = self.attention_conv.prepare(self.input_layernorm(hidden_states))
        hidden_states = hidden_states + self.attention_conv.finish(self.self_attn(x, context, **attention_kwargs),
                                                                   kernels)
        x, kernels = self.mlp_conv.prepare(self.post_attention_layernorm(hidden_states))
        return hidden_states + self.mlp_conv.finish(self.mlp(x), kernels)


class CandidateSelector(nn.Module):
    """DFlash2's candidate selector: rescores a position's top-``k`` candidate tokens by a low-rank term of the
    preceding token, ``score = unary + <predecessor_codebook[prev] * hidden_projection(h), successor_codebook[c]>``.
    The successor codebook starts at zero, so at initialisation the scores are the unary logits."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        nn.init.normal_(self.predecessor_codebook, std=0.02)

    def score_candidates(
        self,
        *,
        candidate_ids: torch.Tensor,
        unary_logits: torch.Tensor,
        hidden_states: torch.Tensor,
        predecessor_ids: torch.Tensor,
    ) -> torch.Tensor:
        """Scores of candidates ``candidate_ids [..., K]`` (unary logits ``[..., K]``) at positions with drafter
        states ``hidden_states [..., hidden]`` following tokens ``predecessor_ids [...]``; returns ``[..., K]``."""
        state = self.predecessor_codebook[predecessor_ids] * self.hidden_projection(hidden_states)
        return unary_logits + torch.einsum("...r,...kr->...k", state, self.successor_codebook[candidate_ids])

    def greedy_path(
        self,
        *,
        candidate_ids: torch.Tensor,
        unary_logits: torch.Tensor,
        hidden_states: torch.Tensor,
        anchor_token_ids: torch.Tensor,
    ) -> torch.Tensor:
        """Decoding: pick, position after position, the best-scoring candidate given the previous pick (the anchor
        before the first). ``candidate_ids`` / ``unary_logits`` ``[b, P, K]``, ``hidden_states [b, P, hidden]``,
        ``anchor_token_ids [b]``; returns the chosen ids ``[b, P]``."""
        previous, path = anchor_token_ids, []
        for p in range(candidate_ids.shape[1]):
            scores = self.score_candidates(candidate_ids=candidate_ids[:, p], unary_logits=unary_logits[:, p],
                                           hidden_states=hidden_states[:, p], predecessor_ids=previous)
            previous = candidate_ids[:, p].gather(1, scores.argmax(dim=-1, keepdim=True))[:, 0]
            path.append(previous)
        return torch.stack(path, dim=1)


# --- the models -----------------------------------------------------------------------------------------------------
class DFlashPreTrainedModel(PreTrainedModel):
    config_class = DFlashConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DFlashDecoderLayer", "DFlash2DecoderLayer"]
    # Tensors of the target (or of other trainers' exports) that a drafter folder may carry: the drafter uses the
    # bound target's own embedding and head instead.
    _keys_to_ignore_on_load_unexpected = [r"^embed_tokens\.", r"^lm_head\.", r"^verifier_", r"^t2d$", r"^d2t$"]

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, DFlashRMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, BlockConvolution):  # after its kernel_projection (children first): zero it again
            init.copy_(module.base_kernel, identity_kernel(module.taps, module.base_kernel.shape[-1]))
            init.zeros_(module.kernel_projection.weight)
        elif isinstance(module, CandidateSelector):
            init.normal_(module.predecessor_codebook, mean=0.0, std=std)
            init.zeros_(module.successor_codebook)


class DFlashDraftModel(DFlashPreTrainedModel):
    """A DFlash drafter. Weight names are the serving engines' (no prefix); the target's embedding and LM head are
    bound with :meth:`bind_target` (or :meth:`from_target`) and never saved.

    Args:
        config ([`DFlashConfig`]): a DFlash config (a DFlash2 one builds a [`DFlash2DraftModel`]).
    """

    decoder_layer_class = DFlashDecoderLayer
    is_dflash2 = False

    def __init__(self, config: DFlashConfig):
        if config.is_dflash2 != self.is_dflash2:
            wanted = "DFlash2DraftModel" if config.is_dflash2 else "DFlashDraftModel"
            raise ValueError(f"this config describes a {wanted} (dflash_config "
                             f"{'has' if config.is_dflash2 else 'lacks'} conv_kernel_size, conv_group_size, "
                             f"selector_rank, selector_top_k): build {wanted} instead of {type(self).__name__}.")
        super().__init__(config)
        self.fc = nn.Linear(config.feature_width, config.hidden_size, bias=False)
        self.hidden_norm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(self.decoder_layer_class(config, i) for i in range(config.num_hidden_layers))
        self.norm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self._add_heads(config)
        self._bound_target: tuple[nn.Module, nn.Module] | None = None  # a plain attribute: not a submodule
        self.post_init()

    def _add_heads(self, config: DFlashConfig) -> None:
        """Modules a subclass adds next to the layer stack (DFlash2: the candidate selector)."""

    # --- the target's frozen embedding and head --------------------------------------------------------------------
    def bind_target(self, target: PreTrainedModel) -> "DFlashDraftModel":
        """Use ``target``'s own input embedding and LM head (frozen: ``requires_grad`` is turned off on them). They
        are referenced, not copied, and stay out of this model's parameters, ``state_dict`` and saved folder.

        Args:
            target (`PreTrainedModel`): the causal LM the drafter drafts for.

        Returns:
            `DFlashDraftModel`: ``self``.
        """
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()
        if embed is None or head is None:
            raise ValueError(f"{type(target).__name__} has no input embedding or no output head to bind "
                             "(get_input_embeddings / get_output_embeddings returned None): bind a causal LM.")
        width, vocab = self.config.hidden_size, self.config.vocab_size
        if tuple(embed.weight.shape) != (vocab, width):
            raise ValueError(f"the target's input embedding is {tuple(embed.weight.shape)}, the drafter needs "
                             f"(vocab_size={vocab}, hidden_size={width}): a drafter shares the target's vocabulary "
                             "and width (build its config with DFlashConfig.for_target).")
        if tuple(head.weight.shape) != (vocab, width):
            raise ValueError(f"the target's LM head is {tuple(head.weight.shape)}, the drafter needs "
                             f"(vocab_size={vocab}, hidden_size={width}).")
        for parameter in (*embed.parameters(), *head.parameters()):
            parameter.requires_grad_(False)
        self._bound_target = (embed, head)
        return self

    @property
    def embed_tokens(self) -> nn.Module | None:
        """The bound target's input embedding (`None` before :meth:`bind_target`)."""
        return self._bound_target[0] if self._bound_target is not None else None

    @property
    def lm_head(self) -> nn.Module | None:
        """The bound target's LM head (`None` before :meth:`bind_target`)."""
        return self._bound_target[1] if self._bound_target is not None else None

    def get_input_embeddings(self):
        return self.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def _require_target(self) -> tuple[nn.Module, nn.Module]:
        if self._bound_target is None:
            raise RuntimeError("this drafter has no target bound: call drafter.bind_target(target) (the target's "
                               "frozen embedding and head are not part of a saved drafter).")
        return self._bound_target

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The target head's logits of drafter states ``[..., hidden]``, times ``output_multiplier`` and soft-capped
        by ``final_logit_softcapping`` when the config sets them."""
        head = self._require_target()[1]
        # The head is called as the module it is, not through F.linear on its weight: its hooks fire, so whatever
        # counts the target head's forwards (the decoding study's cost model) counts the drafter's proposals too.
        logits = head(hidden_states.to(head.weight.dtype))
        multiplier, softcap = self.config.output_multiplier, self.config.final_logit_softcapping
        if multiplier != 1.0 or softcap is not None:
            logits = logits.float() * multiplier
            if softcap is not None:
                logits = torch.tanh(logits / softcap) * softcap
        return logits

    # --- the pieces of the forward (shared with the sharded training forward) ----------------------------------
    def project_context(self, target_hidden_states: torch.Tensor) -> torch.Tensor:
        """``hidden_norm(fc(features))`` of detached target features ``[b, T, feature_width]``: the states every
        layer's context keys and values are projected from (``[b, T, hidden_size]``)."""
        return self.hidden_norm(self.fc(target_hidden_states.detach().to(self.fc.weight.dtype)))

    def rotary(self, positions: torch.Tensor) -> Rotary:
        """RoPE factors of this drafter at RoPE positions ``positions [b, n]``."""
        theta = float((self.config.rope_parameters or {}).get("rope_theta", 10_000.0))
        return rotary_factors(positions, self.config.head_dim, theta, self.fc.weight.dtype)

    def draft_blocks(self, input_ids: torch.LongTensor, anchor_positions: torch.LongTensor,
                     position_ids: torch.LongTensor) -> tuple[torch.Tensor, Rotary]:
        """The embedded draft blocks ``[anchor token, mask x (B - 1)]`` of ``anchor_positions [b, A]``
        (``[b, A * B, hidden_size]``, the target's frozen embedding) and their RoPE factors at ``pos(anchor) + k``."""
        embed = self._require_target()[0]
        b, block = input_ids.shape[0], self.config.block_size
        draft_ids = torch.full((b, anchor_positions.shape[1], block), self.config.mask_token_id,
                               device=input_ids.device, dtype=input_ids.dtype)
        draft_ids[:, :, 0] = input_ids.gather(1, anchor_positions)
        hidden_states = F.embedding(draft_ids.view(b, -1), embed.weight).to(self.fc.weight.dtype)
        offsets = torch.arange(block, device=input_ids.device, dtype=position_ids.dtype)
        draft_positions = (position_ids.gather(1, anchor_positions)[..., None] + offsets).view(b, -1)
        return hidden_states, self.rotary(draft_positions)

    # --- forward ---------------------------------------------------------------------------------------------------
    def forward(
        self,
        target_hidden_states: torch.Tensor,
        input_ids: torch.LongTensor,
        anchor_positions: torch.LongTensor,
        anchor_valid: torch.BoolTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        context_positions: torch.LongTensor | None = None,
        document_ids: torch.LongTensor | None = None,
        return_logits: bool = True,
    ) -> DFlashDraftOutput:
        r"""
        Draft one block per anchor (training and decoding share this forward).

        Args:
            target_hidden_states (`torch.FloatTensor` of shape `[b, T, len(target_layer_ids) * target_hidden_size]`):
                The target's hidden states at `config.target_layer_ids`, concatenated in that order, for the
                context tokens `context_positions`.
            input_ids (`torch.LongTensor` of shape `[b, L]`): the token sequence (anchors index it).
            anchor_positions (`torch.LongTensor` of shape `[b, A]`): sequence indices of the anchors.
            anchor_valid (`torch.BoolTensor` of shape `[b, A]`, *optional*): `False` marks padding anchors (they see
                no context; their outputs are meaningless). Defaults to all valid.
            position_ids (`torch.LongTensor` of shape `[b, L]`, *optional*): RoPE positions of the sequence (the
                target's). Defaults to `arange(L)`.
            context_positions (`torch.LongTensor` of shape `[b, T]`, *optional*): sequence indices of the features.
                Defaults to `arange(T)` (the first `T <= L` tokens).
            document_ids (`torch.LongTensor` of shape `[b, L]`, *optional*): packed documents (maximal runs of equal
                ids); a block sees only its anchor's document. Defaults to one document.
            return_logits (`bool`, defaults to `True`): also apply the target's head.

        Returns:
            [`DFlashDraftOutput`]: `hidden_states` and `logits` of shape `[b, A * block_size, ...]`, block `a` at
            rows `a * block_size ... (a + 1) * block_size - 1`; row `k` of a block drafts the token at `anchor + k`
            (row 0 holds the anchor itself).
        """
        self._require_target()
        block = self.config.block_size
        self._check_inputs(target_hidden_states, input_ids, anchor_positions, anchor_valid, position_ids,
                           context_positions, document_ids)
        b, length = input_ids.shape
        device = input_ids.device
        if position_ids is None:
            position_ids = torch.arange(length, device=device).expand(b, length)
        if context_positions is None:
            context_positions = torch.arange(target_hidden_states.shape[1], device=device).expand(b, -1)
        anchor_starts = None
        if document_ids is not None:
            anchor_starts = document_starts(document_ids).gather(1, anchor_positions)

        context = self.project_context(target_hidden_states)
        hidden_states, draft_rotary = self.draft_blocks(input_ids, anchor_positions, position_ids)
        attention_kwargs = {
            "draft_rotary": draft_rotary,
            "context_rotary": self.rotary(position_ids.gather(1, context_positions)),
        }
        masks: dict[int | None, DraftContext] = {}
        for layer in self.layers:
            window = layer.self_attn.sliding_window
            if window not in masks:
                masks[window] = draft_context(anchor_positions, context_positions, block,
                                              anchor_document_starts=anchor_starts, anchor_valid=anchor_valid,
                                              sliding_window=window)
            hidden_states = layer(hidden_states, context, context_mask=masks[window], **attention_kwargs)
        hidden_states = self.norm(hidden_states)
        logits = self.compute_logits(hidden_states) if return_logits else None
        return DFlashDraftOutput(hidden_states=hidden_states, logits=logits)

    def draft_from_cache(
        self,
        context_cache: "DFlashContextCache",
        anchor_token_ids: torch.LongTensor,
        return_logits: bool = True,
    ) -> DFlashDraftOutput:
        r"""
        Decoding: draft the block after each row's cached context, reading keys and values the cache projected when
        their rows were appended (nothing of the context is projected again).

        Row ``r``'s anchor sits at sequence index ``context_cache.lengths[r]``, right after its context; the block
        sees that context under :func:`draft_context_mask`, as :meth:`forward` would with the same features,
        ``input_ids`` whose column ``lengths[r]`` holds the anchor, and ``anchor_positions = lengths[:, None]``.

        Args:
            context_cache ([`DFlashContextCache`]): this drafter's cache of every row's committed context.
            anchor_token_ids (`torch.LongTensor` of shape `[b]`): each row's anchor token.
            return_logits (`bool`, defaults to `True`): also apply the target's head.

        Returns:
            [`DFlashDraftOutput`]: `hidden_states` and `logits` of the `B - 1` drafted rows only (`[b, B - 1, ...]`,
            row `k - 1` drafting the token at `anchor + k`): the anchor's own row is never read out.
        """
        self._require_target()
        if context_cache.drafter is not self:
            raise ValueError("this context cache was built for another drafter: build one with "
                             "DFlashContextCache(drafter, batch_size) for the drafter that drafts from it.")
        anchors = context_cache.lengths
        if tuple(anchor_token_ids.shape) != tuple(anchors.shape) or anchor_token_ids.dtype.is_floating_point:
            raise ValueError(f"anchor_token_ids must be an integer tensor [batch={anchors.shape[0]}] (one anchor per "
                             f"cache row), got {tuple(anchor_token_ids.shape)} {anchor_token_ids.dtype}.")
        hidden_states, draft_rotary = self.draft_blocks(anchor_token_ids[:, None], torch.zeros_like(anchors)[:, None],
                                                        anchors[:, None])
        context = context_cache.context_for(anchors)
        for layer in self.layers:
            hidden_states = layer(hidden_states, context, draft_rotary=draft_rotary)
        hidden_states = self.norm(hidden_states[:, 1:])
        logits = self.compute_logits(hidden_states) if return_logits else None
        return DFlashDraftOutput(hidden_states=hidden_states, logits=logits)

    def _check_inputs(self, features, input_ids, anchors, anchor_valid, position_ids, context_positions,
                      document_ids) -> None:
        config = self.config
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, L], got shape {tuple(input_ids.shape)}.")
        b, length = input_ids.shape
        if features.dim() != 3 or features.shape[0] != b:
            raise ValueError(f"target_hidden_states must be [batch={b}, T, features], got shape "
                             f"{tuple(features.shape)}.")
        if features.shape[-1] != config.feature_width:
            raise ValueError(
                f"target_hidden_states has {features.shape[-1]} features per token; this drafter reads "
                f"{len(config.target_layer_ids)} target layers {list(config.target_layer_ids)} (canonical ids) x "
                f"target_hidden_size {config.target_hidden_size} = {config.feature_width}: capture the target's "
                "hidden_states at these layers, concatenated in this order.")
        if anchors.dim() != 2 or anchors.shape[0] != b or anchors.dtype.is_floating_point:
            raise ValueError(f"anchor_positions must be an integer tensor [batch={b}, A], got "
                             f"{tuple(anchors.shape)} {anchors.dtype}.")
        if anchors.numel() and (int(anchors.min()) < 0 or int(anchors.max()) >= length):
            raise ValueError(f"anchor_positions must index input_ids (0 <= anchor < L = {length}), got values in "
                             f"[{int(anchors.min())}, {int(anchors.max())}].")
        if anchor_valid is not None and (anchor_valid.shape != anchors.shape or anchor_valid.dtype != torch.bool):
            raise ValueError(f"anchor_valid must be a bool tensor of anchor_positions' shape {tuple(anchors.shape)}, "
                             f"got {tuple(anchor_valid.shape)} {anchor_valid.dtype}.")
        for name, value in (("position_ids", position_ids), ("document_ids", document_ids)):
            if value is not None and tuple(value.shape) != (b, length):
                raise ValueError(f"{name} must have input_ids' shape {(b, length)}, got {tuple(value.shape)}.")
        t = features.shape[1]
        if context_positions is None:
            if t > length:
                raise ValueError(f"target_hidden_states has {t} positions, more than input_ids' {length}: pass "
                                 "context_positions to say which tokens the features belong to.")
        else:
            if tuple(context_positions.shape) != (b, t):
                raise ValueError(f"context_positions must be [batch, T] = {(b, t)} (one per feature row), got "
                                 f"{tuple(context_positions.shape)}.")
            if t and (int(context_positions.min()) < 0 or int(context_positions.max()) >= length):
                raise ValueError(f"context_positions must index input_ids (0 <= p < L = {length}), got values in "
                                 f"[{int(context_positions.min())}, {int(context_positions.max())}].")

    # --- construction from a target --------------------------------------------------------------------------------
    @classmethod
    def from_target(
        cls,
        target: PreTrainedModel,
        config: DFlashConfig | None = None,
        *,
        init: str = "target_layers",
        **config_kwargs,
    ) -> "DFlashDraftModel":
        """A new drafter for a causal LM (Llama, Qwen2/3, Gemma, ...), bound to it, on its device and in its dtype.

        Args:
            target (`PreTrainedModel`): the target causal LM.
            config ([`DFlashConfig`], *optional*): defaults to `DFlashConfig.for_target(target.config,
                dflash2=<this class is DFlash2DraftModel>, **config_kwargs)`.
            init (`str`, defaults to `"target_layers"`): `"scratch"` (transformers-style initialisation: normal
                linear weights, unit norms, identity convolutions) or `"target_layers"` (then copy, where the shapes
                match, the attention, MLP and norm weights of the target's last `num_hidden_layers` decoder layers
                into the drafter's layers, in order; norms are copied as the scale they apply, so a Gemma-style
                `1 + weight` norm gives `1 + weight`; a target without q/k norms leaves those at one).
            config_kwargs: arguments of [`DFlashConfig.for_target`] (with `config=None`).
        """
        if init not in ("target_layers", "scratch"):
            raise ValueError(f"init must be 'target_layers' or 'scratch', got {init!r}.")
        if config is None:
            if config_kwargs.pop("dflash2", cls.is_dflash2) != cls.is_dflash2:
                raise ValueError(f"{cls.__name__} builds a {'DFlash2' if cls.is_dflash2 else 'DFlash'} drafter; use "
                                 f"{'DFlashDraftModel' if cls.is_dflash2 else 'DFlash2DraftModel'} for the other.")
            config = DFlashConfig.for_target(target.config, dflash2=cls.is_dflash2, **config_kwargs)
        elif config_kwargs:
            raise ValueError(f"pass either config or config arguments, not both (got {sorted(config_kwargs)}).")
        parameter = next(target.parameters())
        model = cls(config).to(device=parameter.device, dtype=parameter.dtype)
        if init == "target_layers":
            copied = model._copy_target_layers(target)
            logger.info("DFlash drafter initialised from the target's last %d layers (%d tensors copied).",
                        config.num_hidden_layers, len(copied))
        return model.bind_target(target)

    @torch.no_grad()
    def _copy_target_layers(self, target: PreTrainedModel) -> list[str]:
        """Copy the target's last decoder layers into this drafter's layers where names and shapes match; returns the
        drafter names copied."""
        target_layers = _decoder_layers(target)
        if len(target_layers) < len(self.layers):
            raise ValueError(f"the target has {len(target_layers)} decoder layers, fewer than the drafter's "
                             f"{len(self.layers)}: use init='scratch' or fewer drafter layers.")
        copied = []
        for i, (layer, source) in enumerate(zip(self.layers, target_layers[len(target_layers) - len(self.layers):])):
            sources = {
                "input_layernorm": getattr(source, "input_layernorm", None),
                # Gemma 2/3 norm the MLP input with pre_feedforward_layernorm (post_attention_layernorm is their
                # norm of the attention output); Llama/Qwen with post_attention_layernorm.
                "post_attention_layernorm": getattr(source, "pre_feedforward_layernorm", None)
                or getattr(source, "post_attention_layernorm", None),
                "self_attn.q_norm": _submodule(source, "self_attn.q_norm"),
                "self_attn.k_norm": _submodule(source, "self_attn.k_norm"),
            }
            for name, norm in sources.items():
                mine = layer.get_submodule(name)
                if norm is not None:
                    scale = _norm_scale(norm, mine.weight.shape[0])
                    if scale is not None and scale.shape == mine.weight.shape:
                        mine.weight.copy_(scale)
                        copied.append(f"layers.{i}.{name}.weight")
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                copied += _copy_linear(layer.self_attn.get_submodule(name), _submodule(source, f"self_attn.{name}"),
                                       f"layers.{i}.self_attn.{name}")
            for name in ("gate_proj", "up_proj", "down_proj"):
                copied += _copy_linear(layer.mlp.get_submodule(name), _submodule(source, f"mlp.{name}"),
                                       f"layers.{i}.mlp.{name}")
        return copied


class DFlash2DraftModel(DFlashDraftModel):
    """A DFlash2 drafter: DFlash with block-local dynamic convolutions around each layer's attention and MLP
    (``layers.{i}.attention_conv``, ``layers.{i}.mlp_conv``) and a `candidate_selector` head."""

    decoder_layer_class = DFlash2DecoderLayer
    is_dflash2 = True

    def _add_heads(self, config: DFlashConfig) -> None:
        method = config.dflash_config
        self.candidate_selector = CandidateSelector(config.hidden_size, config.vocab_size, method["selector_rank"],
                                                    method["selector_top_k"])


# --- decoding: the drafter's context cache --------------------------------------------------------------------------
# Sequence index of an empty cache slot: never before an anchor, so the mask rule hides it.
_EMPTY = torch.iinfo(torch.long).max // 2


class DFlashContextCache:
    """The projected context of a drafter while it decodes: per layer, the context keys (after ``k_norm`` and RoPE)
    and values of every committed row, computed once when the row is appended (``fc``, ``hidden_norm`` and each
    layer's ``k_proj`` / ``v_proj``), so that a draft step projects only the rows committed since the last one.

    Each batch row has its own length (:attr:`lengths`): its context is its own rows ``0 .. lengths[r] - 1``, at
    sequence indices (and RoPE positions) ``0 .. lengths[r] - 1``, however many rows the others have (a ragged,
    left-padded batch keeps each row compact from 0). A full-attention layer keeps every row (its buffer doubles when
    full); a sliding-window layer keeps only its last ``sliding_window - 1 + block_size`` rows, a ring: the
    ``sliding_window - 1`` any next block can see, and ``block_size`` more so that a :meth:`crop` of up to a block
    stays exact. Slots carry their sequence index (:data:`_EMPTY` when empty), so the one mask rule,
    :func:`draft_context_mask`, decides what each draft token sees. It is the :class:`ContextAttention` of
    :meth:`DFlashDraftModel.draft_from_cache` (through :meth:`context_for`).

    Args:
        drafter ([`DFlashDraftModel`]): the drafter whose layers project (and later attend to) the context.
        batch_size (`int`): rows of the batch.
        capacity (`int`, *optional*, defaults to 256): context rows per batch row the full-attention buffers hold
            before they grow.

    Example::

        cache = DFlashContextCache(drafter, batch_size=1)
        cache.append(features)                                      # [1, T, feature_width]: rows 0 .. T-1
        out = drafter.draft_from_cache(cache, anchor_token_ids=ids[:, T])      # the block after position T
        cache.append(new_features, counts=torch.tensor([accepted + 1]))       # what the target kept
    """

    def __init__(self, drafter: "DFlashDraftModel", batch_size: int, capacity: int = 256):
        if batch_size < 1 or capacity < 1:
            raise ValueError(f"batch_size and capacity must be >= 1, got {batch_size} and {capacity}.")
        self.drafter = drafter
        weight = drafter.fc.weight
        self.block_size = int(drafter.config.block_size)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=weight.device)
        self._longest = 0  # max(lengths), kept on the host: slicing the buffers needs no device sync
        attentions = [layer.self_attn for layer in drafter.layers]
        self._windows = sorted({a.sliding_window for a in attentions}, key=lambda w: -1 if w is None else w)
        # Per window (None: full attention): slot count, then per layer the key and value buffers, [b, H_kv, slots + 1,
        # d]; slot `slots` is a trash slot that absorbs the rows an append does not keep.
        self._slots = {w: capacity if w is None else w - 1 + self.block_size for w in self._windows}
        self._positions = {w: torch.full((batch_size, self._slots[w] + 1), _EMPTY, dtype=torch.long,
                                         device=weight.device) for w in self._windows}
        shape = (batch_size, drafter.config.num_key_value_heads)

        def buffer(window):
            return torch.zeros(*shape, self._slots[window] + 1, drafter.config.head_dim, dtype=weight.dtype,
                               device=weight.device)

        self._keys = [buffer(a.sliding_window) for a in attentions]
        self._values = [buffer(a.sliding_window) for a in attentions]

    def append(self, features: torch.Tensor, counts: torch.Tensor | None = None) -> None:
        """Project and keep the next context rows of every batch row.

        Args:
            features (`torch.Tensor` of shape `[b, n, feature_width]`): the target's features of each row's next `n`
                tokens, at sequence indices ``lengths[r] .. lengths[r] + n - 1``.
            counts (`torch.LongTensor` of shape `[b]`, *optional*): how many of them row ``r`` commits (its first
                ``counts[r]``; the others are ignored). Defaults to all `n`.
        """
        if features.dim() != 3 or features.shape[0] != self.lengths.shape[0]:
            raise ValueError(f"features must be [batch={self.lengths.shape[0]}, n, feature_width], got "
                             f"{tuple(features.shape)}.")
        b, n = features.shape[0], features.shape[1]
        device = self.lengths.device
        if counts is None:
            counts = torch.full_like(self.lengths, n)
        elif tuple(counts.shape) != (b,) or counts.dtype.is_floating_point:
            raise ValueError(f"counts must be an integer tensor [batch={b}], got {tuple(counts.shape)} {counts.dtype}.")
        counts = counts.to(device)
        if n == 0:
            return
        offsets = torch.arange(n, device=device)
        if None not in self._windows:  # every layer slides: rows older than every ring are never needed
            first = int((counts - min(self._slots.values())).clamp_min(0).min())
            features, offsets = features[:, first:], offsets[first:]
        positions = self.lengths[:, None] + offsets                                         # [b, n]
        committed = offsets[None] < counts[:, None]
        new_lengths = self.lengths + counts
        longest = int(new_lengths.max())
        if None in self._windows and longest > self._slots[None]:
            self._grow(max(longest, 2 * self._slots[None]))
        states = self.drafter.project_context(features.to(device))
        rotary = self.drafter.rotary(positions)
        slots = {}
        for window in self._windows:
            size = self._slots[window]
            if window is None:
                slot, keep = positions, committed
            else:  # a ring keeps the newest `size` rows of the append
                slot, keep = positions % size, committed & (offsets[None] >= counts[:, None] - size)
            slots[window] = torch.where(keep, slot, size)
            self._positions[window].scatter_(1, slots[window], torch.where(keep, positions, _EMPTY))
        for i, layer in enumerate(self.drafter.layers):
            key, value = layer.self_attn.key_value(states, rotary)                          # [b, H_kv, n, d]
            index = slots[layer.self_attn.sliding_window][:, None, :, None].expand_as(key)
            self._keys[i].scatter_(2, index, key.to(self._keys[i].dtype))
            self._values[i].scatter_(2, index, value.to(self._values[i].dtype))
        self.lengths = new_lengths
        self._longest = longest

    def crop(self, lengths: torch.Tensor) -> None:
        """Forget the rows at or after ``lengths[r]`` of each row ``r`` (a row shorter than that keeps all of its).

        Raises:
            `ValueError`: a sliding-window layer no longer holds rows the cropped context would need (more than
                `block_size` rows cropped since they were appended).
        """
        new = torch.minimum(self.lengths, lengths.to(self.lengths.device))
        for window in self._windows:
            positions = self._positions[window]
            if window is not None:
                held = positions.masked_fill(positions >= new[:, None], _EMPTY).min(dim=1).values
                needed = (new - (window - 1)).clamp_min(0)
                lost = (new > 0) & (held > needed)
                if bool(lost.any()):
                    row = int(lost.nonzero()[0, 0])
                    raise ValueError(f"cannot crop row {row} to {int(new[row])} context rows: its sliding-window "
                                     f"layers keep the last {self._slots[window]} rows and no longer hold row "
                                     f"{int(needed[row])}. Crop at most block_size = {self.block_size} rows after "
                                     "an append.")
            positions.masked_fill_(positions >= new[:, None], _EMPTY)
        self.lengths = new
        self._longest = int(new.max())

    def context_for(self, anchors: torch.Tensor) -> ContextAttention:
        """The context a draft block at sequence index ``anchors[r]`` sees, as a :class:`ContextAttention`."""
        masks = {}
        for window in self._windows:
            used = min(self._longest, self._slots[window])
            masks[window] = draft_context(anchors[:, None], self._positions[window][:, :used], self.block_size,
                                          sliding_window=window)
        return _CachedContext(self, masks)

    def _grow(self, slots: int) -> None:
        old = self._slots[None]
        for i, layer in enumerate(self.drafter.layers):
            if layer.self_attn.sliding_window is None:
                for buffers in (self._keys, self._values):
                    grown = buffers[i].new_zeros(*buffers[i].shape[:2], slots + 1, buffers[i].shape[-1])
                    grown[:, :, :old] = buffers[i][:, :, :old]
                    buffers[i] = grown
        positions = self._positions[None]
        self._positions[None] = positions.new_full((positions.shape[0], slots + 1), _EMPTY)
        self._positions[None][:, :old] = positions[:, :old]
        self._slots[None] = slots


class _CachedContext:
    """A :class:`DFlashContextCache` seen from one draft step's anchors: each layer's cached keys and values, masked
    by :func:`draft_context_mask` (``masks[window]``, ``[b, B, slots]``)."""

    def __init__(self, cache: DFlashContextCache, masks: dict[int | None, torch.Tensor]):
        self.cache, self.masks = cache, masks

    def partials(self, attention: DFlashAttention, query: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        mask = self.masks[attention.sliding_window]
        used = mask.num_context_rows
        key = self.cache._keys[attention.layer_idx][:, :, :used]
        value = self.cache._values[attention.layer_idx][:, :, :used]
        return [attention.attend_context(query, key, value, mask)]


def _decoder_layers(target: PreTrainedModel) -> nn.ModuleList:
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else None
    for candidate in (decoder, getattr(target, "model", None), getattr(getattr(target, "model", None),
                                                                       "language_model", None)):
        layers = getattr(candidate, "layers", None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise ValueError(f"cannot find the decoder layers of {type(target).__name__} (looked for get_decoder().layers, "
                     "model.layers, model.language_model.layers): use init='scratch'.")


def _submodule(module: nn.Module, name: str) -> nn.Module | None:
    try:
        return module.get_submodule(name)
    except AttributeError:
        return None


def _copy_linear(mine: nn.Linear, source: nn.Module | None, name: str) -> list[str]:
    copied = []
    for attr in ("weight", "bias"):
        theirs, ours = getattr(source, attr, None), getattr(mine, attr, None)
        if isinstance(theirs, torch.Tensor) and ours is not None and theirs.shape == ours.shape:
            ours.copy_(theirs)
            copied.append(f"{name}.{attr}")
    return copied


def _norm_scale(norm: nn.Module, width: int) -> torch.Tensor | None:
    """The per-channel scale an RMSNorm-like module applies, read by running it on a constant input: the input's
    RMS (1024, a power of two) leaves the eps negligible and the normalisation exact, so a plain ``x * w`` norm gives
    ``w`` exactly and a Gemma-style ``x * (1 + w)`` gives ``1 + w``."""
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.shape[-1] != width:
        return None
    probe = torch.full((1, width), 1024.0, dtype=weight.dtype, device=weight.device)
    return norm(probe)[0]


__all__ = [
    "BlockConvolution", "CandidateSelector", "ContextAttention", "DFlash2DraftModel", "DFlashContextCache",
    "DFlashDraftModel", "DFlashDraftOutput",
    "DFlashPreTrainedModel", "attend_with_lse", "draft_block_mask", "draft_context_mask",
    "merge_partials", "rotary_factors",
]
