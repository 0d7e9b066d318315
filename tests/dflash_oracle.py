"""The tiny DFlash / DFlash2 drafters of the oracle comparisons and the oracle built from them.

The paper's implementation (``dllm_parallel``, a dev dependency) is the oracle: its production attention is CUDA-only
(FA4), so on CPU it runs with :func:`dense_reference_attention`, a dense softmax over ``[context keys ; block keys]``
whose context mask is the oracle's own predicate (``dflash_fa4._torch_interval_mask_mod``) and whose in-block mask is
``same block`` (and ``q >= k`` when the oracle asks for a causal block). Shared by tests/models/dflash/test_model.py
(the forward) and tests/models/dflash/test_reference_loss.py (a training step); importing it skips the importing
test module when the oracle is absent.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import fixtures
import pytest
import torch

from hf_bdlm.models.dflash.configuration import DFlashConfig
from hf_bdlm.models.dflash.modeling import DFlash2DraftModel, DFlashDraftModel

dflash_model = pytest.importorskip("dllm_parallel.core.models.backbones.dflash.model",
                                   reason="the oracle dllm_parallel is absent")
from dllm_parallel.core.attention.dflash_fa4 import _packed_key_positions, _torch_interval_mask_mod  # noqa: E402
from dllm_parallel.core.models.backbones.dflash import dflash2 as ref_dflash2  # noqa: E402

VOCAB, WIDTH, HEADS, KV_HEADS, HEAD_DIM = 64, 32, 4, 2, 8
BLOCK = 4


# The targets: 6 random layers of width 32 over a vocabulary of 64 (Llama without a pad token, Gemma 3 sliding 4).
qwen3_target = functools.partial(fixtures.tiny_target, "qwen3", intermediate_size=48, num_hidden_layers=6,
                                 pad_token_id=0)
llama_target = functools.partial(fixtures.tiny_target, "llama", intermediate_size=48, num_hidden_layers=6,
                                 eos_token_id=2, pad_token_id=None)
gemma3_target = functools.partial(fixtures.tiny_target, "gemma3", intermediate_size=48, num_hidden_layers=6,
                                  sliding_window=4, pad_token_id=0)


def drafter_config(dflash2: bool = True, **overrides) -> DFlashConfig:
    values = dict(num_hidden_layers=2, target_layer_ids=[2, 4, 6], block_size=BLOCK, mask_token_id=VOCAB - 1,
                  dflash2=dflash2, intermediate_size=40, rope_parameters={"rope_type": "default", "rope_theta": 50.0})
    if dflash2:
        values.update(conv_kernel_size=3, conv_group_size=8, selector_rank=6, selector_top_k=5)
    values.update(overrides)
    return DFlashConfig.for_target(qwen3_target().config, **values)


def randomize(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """Every parameter random (norms around one), so no identity or zero initialisation hides a difference."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
            p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.3 * noise)
    return model


def drafter(config: DFlashConfig, target, seed: int = 1, conv_identity: bool = False):
    cls = DFlash2DraftModel if config.is_dflash2 else DFlashDraftModel
    model = randomize(cls(config), seed)
    if conv_identity:
        fresh = cls(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "_conv." in name:
                    p.copy_(fresh.get_parameter(name))
    return model.double().bind_target(target)


def dense_reference_attention(*, query, local_key, local_value, global_key, global_value, local_attn_mask,
                              global_attn_mask, scale, global_seq_len, global_intervals=None, **_):
    """The oracle's attention on CPU: one dense softmax over [context keys ; block keys]."""
    b, n, heads, _ = query.shape
    key_positions = _packed_key_positions(tuple(global_intervals or ((0, int(global_seq_len)),)),
                                          padded_length=global_key.shape[1], device=query.device)
    mask_mod = _torch_interval_mask_mod(global_attn_mask, key_positions=key_positions)
    q_index, k_index = torch.arange(n), torch.arange(global_key.shape[1])
    context = mask_mod(torch.arange(b)[:, None, None], None, q_index[None, :, None], k_index[None, None, :])
    local = (q_index[:, None] // local_attn_mask.block_size) == (q_index[None, :] // local_attn_mask.block_size)
    if local_attn_mask.causal:
        local &= q_index[:, None] >= q_index[None, :]
    mask = torch.cat([context.expand(b, n, -1), local.expand(b, n, n)], dim=-1)[:, None]
    keys, values = torch.cat([global_key, local_key], 1), torch.cat([global_value, local_value], 1)
    groups = heads // keys.shape[2]
    keys, values = keys.repeat_interleave(groups, dim=2), values.repeat_interleave(groups, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", query, keys) * scale
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, values)


def reference_of(model, target, tmp_path: Path):
    """The oracle model built from our saved config.json, loaded with our weights and the target's embedding/head."""
    model.save_pretrained(tmp_path)
    mapping = json.loads((tmp_path / "config.json").read_text())
    config = dflash_model.DFlashModelConfig.from_mapping(mapping)
    cls = ref_dflash2.DFlash2Model if config.architecture == "DFlash2DraftModel" else dflash_model.DFlashModel
    ref = cls(config, attention_op=dense_reference_attention)
    missing, unexpected = ref.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected
    assert set(missing) == {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
    ref.embed_tokens.weight.data.copy_(target.get_input_embeddings().weight)
    ref.lm_head.weight.data.copy_(target.get_output_embeddings().weight)
    return ref.double()


def features_for(config: DFlashConfig, batch: int, length: int, seed: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, length, config.feature_width, generator=g, dtype=torch.float64)
