"""Specifications of `BlockDiffusionForMaskedLM` over tiny random transformers backbones.

CPU, float64, a few seconds: ``python -m pytest tests/models/block_diffusion/test_model.py -q``.
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers import (
    AlbertConfig,
    AutoModel,
    AutoModelForMaskedLM,
    BloomConfig,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

import hf_bdlm  # noqa: F401 - registers the Auto classes and the "bdlm" attention
import hf_bdlm.attention.interface as attention_interface
from hf_bdlm import BlockDiffusionConfig, BlockDiffusionForMaskedLM

VOCAB, MASK, BLOCK, LENGTH = 64, 63, 4, 16
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    head_dim=8,
)

# Sliding windows are smaller than L, and one lies under the block size, one between B and 2B.
BACKBONES = {
    "llama_gqa": lambda: LlamaConfig(**_COMMON),
    "qwen2": lambda: Qwen2Config(**_COMMON),
    "qwen3": lambda: Qwen3Config(**_COMMON),
    "mistral_sliding": lambda: MistralConfig(**_COMMON, sliding_window=6),
    "gemma3_sliding_full": lambda: Gemma3TextConfig(
        **_COMMON, sliding_window=3, layer_types=["sliding_attention", "full_attention"]
    ),
}
WINDOWS = {"mistral_sliding": {6}, "gemma3_sliding_full": {3, None}}



def _config(backbone: str, **kwargs) -> BlockDiffusionConfig:
    return BlockDiffusionConfig(
        backbone_config=BACKBONES[backbone](), block_size=BLOCK, mask_token_id=MASK, **kwargs
    )


def _model(backbone: str, seed: int = 0, **kwargs) -> BlockDiffusionForMaskedLM:
    torch.manual_seed(seed)
    # Built under dtype=float64 the way from_pretrained builds it (see the reload test).
    return BlockDiffusionForMaskedLM._from_config(_config(backbone, **kwargs), dtype=torch.float64)


def _batch(batch: int = 2, length: int = LENGTH, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(0, MASK, (batch, length), generator=g)
    noisy = clean.masked_fill(torch.rand(batch, length, generator=g) < 0.5, MASK)
    return noisy, clean


def _logits_and_grads(model, noisy, clean, **kwargs):
    model.zero_grad()
    logits = model(input_ids=noisy, clean_input_ids=clean, **kwargs).logits
    # A loss touching every logit with distinct weights, so every parameter gets a gradient.
    weights = torch.linspace(-1, 1, logits.numel(), dtype=logits.dtype).view_as(logits)
    (logits * weights).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel_err(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


# --- blockwise attention equals the dense reference through the whole model -----------------


@pytest.mark.parametrize("kind", ["block_causal", "causal"])
@pytest.mark.parametrize("backbone", list(BACKBONES))
def test_blockwise_logits_and_parameter_gradients_equal_dense(backbone, kind):
    model = _model(backbone, clean_attention=kind)
    noisy, clean = _batch()
    model.config.attention_backend = "dense"
    want_logits, want_grads = _logits_and_grads(model, noisy, clean)
    model.config.attention_backend = "blockwise"
    got_logits, got_grads = _logits_and_grads(model, noisy, clean)
    assert _rel_err(got_logits, want_logits) <= 1e-12
    assert got_grads.keys() == want_grads.keys() == {n for n, _ in model.named_parameters()}
    for name, grad in want_grads.items():
        assert _rel_err(got_grads[name], grad) <= 1e-12, name


@pytest.mark.parametrize("backbone", ["llama_gqa", "gemma3_sliding_full"])
def test_blockwise_equals_dense_with_packed_documents_differing_per_batch_item(backbone):
    model = _model(backbone)
    noisy, clean = _batch(batch=2)
    docs = torch.tensor([[0] * 8 + [1] * 8, [0] * 4 + [1] * 4 + [2] * 8])
    model.config.attention_backend = "dense"
    want_logits, want_grads = _logits_and_grads(model, noisy, clean, document_ids=docs)
    model.config.attention_backend = "blockwise"
    got_logits, got_grads = _logits_and_grads(model, noisy, clean, document_ids=docs)
    assert _rel_err(got_logits, want_logits) <= 1e-12
    for name, grad in want_grads.items():
        assert _rel_err(got_grads[name], grad) <= 1e-12, name


@pytest.mark.parametrize("backbone", list(WINDOWS))
def test_sliding_window_layers_attend_with_the_backbones_window(backbone, monkeypatch):
    seen = []
    attend = attention_interface.attend

    def spy(backend, q, sources, q_rows, k_rows, rule, scale, cache, *args, **kwargs):
        seen.append(rule.sliding_window)
        return attend(backend, q, sources, q_rows, k_rows, rule, scale, cache, *args, **kwargs)

    monkeypatch.setattr(attention_interface, "attend", spy)
    noisy, clean = _batch()
    with torch.no_grad():
        _model(backbone)(input_ids=noisy, clean_input_ids=clean)
    assert set(seen) == WINDOWS[backbone]


# --- save / reload -----------------------------------------------------------------------------


@pytest.mark.parametrize("backbone", list(BACKBONES))
def test_save_pretrained_reloads_with_auto_classes_to_identical_logits(backbone, tmp_path):
    # Both sides are built under dtype=float64 (from_pretrained sets the default dtype while it
    # builds the model). A model built in float32 and then cast with .double() differs from its
    # reload by ~5e-8 on Gemma 3: its non-persistent `embed_scale` buffer (sqrt(hidden)) is
    # created in the default dtype, so the cast copy keeps the float32 rounding of sqrt(32)
    # while the reload computes it in float64. Nothing is lost in the checkpoint.
    model = _model(backbone).eval()
    noisy, clean = _batch()
    with torch.no_grad():
        want = model(input_ids=noisy, clean_input_ids=clean).logits
    model.save_pretrained(tmp_path)
    assert "model.safetensors" in os.listdir(tmp_path)
    for auto_class in (AutoModel, AutoModelForMaskedLM):
        reloaded = auto_class.from_pretrained(tmp_path).eval()
        assert isinstance(reloaded, BlockDiffusionForMaskedLM)
        assert reloaded.dtype == torch.float64
        with torch.no_grad():
            got = reloaded(input_ids=noisy, clean_input_ids=clean).logits
        assert torch.equal(got, want), f"{auto_class.__name__}: max diff {(got - want).abs().max():.2e}"


def test_cast_model_and_reload_differ_only_by_gemma3_embed_scale_rounding(tmp_path):
    # Documents the cause of the float32-built-then-cast discrepancy named above.
    torch.manual_seed(0)
    cast = BlockDiffusionForMaskedLM(_config("gemma3_sliding_full")).double()
    cast.save_pretrained(tmp_path)
    reloaded = AutoModel.from_pretrained(tmp_path)
    scale = lambda m: m.backbone.model.embed_tokens.embed_scale  # noqa: E731
    assert scale(cast).item() == torch.tensor(32**0.5, dtype=torch.float32).item()
    assert scale(reloaded).item() == 32**0.5
    scale(cast).fill_(32**0.5)
    noisy, clean = _batch()
    with torch.no_grad():
        assert torch.equal(
            cast(input_ids=noisy, clean_input_ids=clean).logits, reloaded(input_ids=noisy, clean_input_ids=clean).logits
        )


# --- configuration errors --------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(block_size=0), "block_size must be a positive integer, got 0"),
        (dict(block_size=-8), "block_size must be a positive integer, got -8"),
        (dict(mask_token_id=VOCAB), f"mask_token_id={VOCAB} is outside the backbone vocabulary"),
        (dict(mask_token_id=-1), "mask_token_id=-1 is outside the backbone vocabulary"),
        (dict(objective="ar"), "objective must be one of .* got 'ar'"),
        (dict(attention_backend="sparse"), "attention_backend must be one of .* got 'sparse'"),
        (dict(clean_attention="bidirectional"), "clean_attention must be one of .* got 'bidirectional'"),
    ],
)
def test_config_rejects_invalid_diffusion_fields(kwargs, message):
    fields = dict(block_size=BLOCK, mask_token_id=MASK) | kwargs
    with pytest.raises(ValueError, match=message):
        BlockDiffusionConfig(backbone_config=LlamaConfig(**_COMMON), **fields)


def test_model_without_mask_token_is_a_clear_error():
    config = BlockDiffusionConfig(backbone_config=LlamaConfig(**_COMMON), block_size=BLOCK)
    with pytest.raises(ValueError, match="mask_token_id is None.*convert_causal_lm"):
        BlockDiffusionForMaskedLM(config)


def test_backbone_without_attention_interface_is_rejected_naming_its_model_type():
    bloom = BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=1, n_head=4)
    with pytest.raises(ValueError, match="model_type 'bloom'.*attention interface"):
        BlockDiffusionForMaskedLM(BlockDiffusionConfig(backbone_config=bloom, mask_token_id=MASK))


def test_backbone_without_causal_lm_class_is_rejected_naming_its_model_type():
    albert = AlbertConfig(vocab_size=VOCAB)
    with pytest.raises(ValueError, match="model_type 'albert' has no AutoModelForCausalLM"):
        BlockDiffusionForMaskedLM(BlockDiffusionConfig(backbone_config=albert, mask_token_id=MASK))


# --- input errors ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama():
    return _model("llama_gqa")


def test_length_not_a_multiple_of_the_block_size_points_to_pad_to_block_multiple(llama):
    noisy, clean = _batch(length=LENGTH + 1)
    message = f"length {LENGTH + 1} is not a multiple of block_size={BLOCK}.*pad_to_block_multiple"
    with pytest.raises(ValueError, match=message):
        llama(input_ids=noisy, clean_input_ids=clean)


@pytest.mark.parametrize("bad_id", [VOCAB, VOCAB + 100, -1])
def test_token_ids_outside_the_vocabulary_name_a_tokenizer_model_mismatch(llama, bad_id):
    noisy, clean = _batch()
    clean[1, 3] = bad_id
    with pytest.raises(ValueError, match=f"clean_input_ids holds token ids .*{VOCAB} entries.*tokenizer and the model"):
        llama(input_ids=noisy, clean_input_ids=clean)


def test_empty_batch_is_an_error(llama):
    empty = torch.zeros(0, LENGTH, dtype=torch.long)
    with pytest.raises(ValueError, match=r"non-empty batch .*\(0, 16\)"):
        llama(input_ids=empty, clean_input_ids=empty)


def test_streams_of_different_shapes_are_an_error(llama):
    noisy, clean = _batch()
    with pytest.raises(ValueError, match="same shape"):
        llama(input_ids=noisy[:, :8], clean_input_ids=clean)


def test_documents_not_aligned_to_blocks_are_an_error(llama):
    noisy, clean = _batch()
    docs = torch.tensor([[0] * 6 + [1] * 10, [0] * 16])
    with pytest.raises(ValueError, match="block 1 .*mixes documents.*aligned to block boundaries"):
        llama(input_ids=noisy, clean_input_ids=clean, document_ids=docs)


def test_missing_clean_sequence_is_an_error(llama):
    noisy, _ = _batch()
    with pytest.raises(ValueError, match="needs the clean sequence"):
        llama(input_ids=noisy)
