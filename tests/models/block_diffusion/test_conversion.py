"""convert_causal_lm: weights kept bit for bit, a mask token added, causal semantics kept on the clean stream.

Tiny random Llama / Qwen2 / Bloom causal LMs and a word-level tokenizer built offline.
Run: python -m pytest tests/models/block_diffusion/test_conversion.py -q
"""

import pytest
import torch
from fixtures import word_tokenizer
from transformers import (
    AutoModel,
    BloomConfig,
    BloomForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import hf_bdlm
from hf_bdlm import BlockDiffusionForMaskedLM, convert_causal_lm
from hf_bdlm.models.block_diffusion.generation import generate

WORDS = ["[UNK]", "[PAD]", "<s>", "</s>", "the", "cat", "sat", "on", "mat", "a", "dog", "ran"]


def tiny_tokenizer(words=WORDS) -> PreTrainedTokenizerFast:
    return word_tokenizer(words, pad_token="[PAD]", bos_token="<s>", eos_token="</s>")


def tiny_config(cls, vocab_size=len(WORDS), tie=False, **kwargs):
    common = dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=tie,
                  bos_token_id=2, eos_token_id=3, pad_token_id=1)
    return cls(**{**common, **kwargs})


def tiny_llama(tie=False, vocab_size=len(WORDS), dtype=torch.float64):
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_config(LlamaConfig, vocab_size, tie)).to(dtype).eval()


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("tie", [False, True])
def test_conversion_keeps_every_weight_and_adds_one_mask_row(tie):
    lm, tok = tiny_llama(tie), tiny_tokenizer()
    before = snapshot(lm)
    bdlm, tok = convert_causal_lm(lm, tok, block_size=4)

    assert tok.mask_token == "<|mask|>" and tok.mask_token_id == len(WORDS)
    assert bdlm.config.mask_token_id == len(WORDS)
    assert bdlm.config.backbone_config.vocab_size == len(WORDS) + 1
    after = bdlm.backbone.state_dict()
    assert after.keys() == before.keys()
    for name, old in before.items():
        new = after[name]
        if new.shape != old.shape:  # only the embedding / head matrices grow, by the mask row
            assert new.shape == (old.shape[0] + 1, *old.shape[1:]), name
            new = new[: old.shape[0]]
        assert new.dtype == old.dtype and torch.equal(new, old), name
    assert (bdlm.get_input_embeddings().weight is bdlm.get_output_embeddings().weight) == tie


def test_conversion_leaves_the_causal_lm_untouched():
    lm, tok = tiny_llama(), tiny_tokenizer()
    before = snapshot(lm)
    convert_causal_lm(lm, tok, block_size=4)
    assert lm.config.vocab_size == len(WORDS)
    assert lm.config._attn_implementation != "bdlm"
    for name, value in lm.state_dict().items():
        assert torch.equal(value, before[name]), name
    lm(torch.tensor([[2, 4, 5]]))  # still runs as a causal LM


def test_existing_mask_token_in_tokenizer_is_reused_without_resizing():
    words = WORDS + ["<|mask|>"]
    lm, tok = tiny_llama(vocab_size=len(words)), tiny_tokenizer(words)
    bdlm, tok = convert_causal_lm(lm, tok, block_size=4)
    assert bdlm.config.mask_token_id == len(words) - 1 == tok.mask_token_id
    assert bdlm.config.backbone_config.vocab_size == len(words)


def test_reserved_mask_token_id_needs_no_tokenizer_and_no_resize():
    lm = tiny_llama()
    bdlm, tok = convert_causal_lm(lm, mask_token_id=0, block_size=4)
    assert tok is None
    assert bdlm.config.mask_token_id == 0
    assert bdlm.get_input_embeddings().weight.shape[0] == len(WORDS)


def test_mask_token_id_at_the_tokenizers_next_free_id_adds_the_mask_token_there():
    lm, tok = tiny_llama(), tiny_tokenizer()  # no spare row: the embeddings gain one
    bdlm, tok = convert_causal_lm(lm, tok, mask_token_id=len(WORDS), block_size=4)
    assert bdlm.config.mask_token_id == len(WORDS) == tok.mask_token_id == tok.convert_tokens_to_ids("<|mask|>")
    assert bdlm.get_input_embeddings().weight.shape[0] == len(WORDS) + 1


def test_mask_token_id_beyond_the_tokenizer_is_refused_naming_it_and_the_tokenizer_size():
    torch.manual_seed(0)
    lm = Qwen2ForCausalLM(tiny_config(Qwen2Config, vocab_size=16)).double()  # rows 12..15 spare, not in the tokenizer
    with pytest.raises(ValueError, match=rf"mask_token_id=14 is not in the tokenizer, which has {len(WORDS)} tokens"):
        convert_causal_lm(lm, tiny_tokenizer(), mask_token_id=14, block_size=4)


def test_padded_embedding_uses_a_spare_row_for_the_added_token():
    # Qwen-style: the embedding has more rows than the tokenizer has tokens.
    torch.manual_seed(0)
    lm = Qwen2ForCausalLM(tiny_config(Qwen2Config, vocab_size=16)).double()
    before = snapshot(lm)
    bdlm, tok = convert_causal_lm(lm, tiny_tokenizer(), block_size=4)
    assert bdlm.config.mask_token_id == len(WORDS) == tok.mask_token_id
    assert bdlm.get_input_embeddings().weight.shape[0] == 16
    for name, value in bdlm.backbone.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_a_qwen3_checkpoint_gets_its_mask_at_151669_without_a_resize():
    # Qwen3's real layout: 151669 tokens (the last special one, </think>, is 151668) and 151936 embedding rows. SGLang
    # and LMDeploy serve SDAR models with [MASK] = 151669: conversion must land exactly there.
    from tiny_qwen3 import ROWS, qwen3_layout_tokenizer, tiny_qwen3

    lm = tiny_qwen3(tie=True)
    before = snapshot(lm)
    bdlm, tok = convert_causal_lm(lm, qwen3_layout_tokenizer(), block_size=4, objective="standard")
    assert bdlm.config.mask_token_id == tok.mask_token_id == 151669 and tok.mask_token == "<|mask|>"
    assert bdlm.config.objective == "standard" and bdlm.config.clean_attention == "block_causal"
    assert bdlm.config.backbone_config.vocab_size == ROWS == bdlm.get_input_embeddings().weight.shape[0]
    for name, value in bdlm.backbone.state_dict().items():
        assert torch.equal(value, before[name]), name  # no row added: the [MASK] row is the unused row 151669


@pytest.mark.parametrize("causal_cls,config_cls", [(LlamaForCausalLM, LlamaConfig), (Qwen2ForCausalLM, Qwen2Config)])
def test_causal_clean_variant_reproduces_the_causal_lm_on_its_clean_stream(causal_cls, config_cls):
    torch.manual_seed(0)
    lm = causal_cls(tiny_config(config_cls)).double().eval()
    bdlm, _ = convert_causal_lm(lm, tiny_tokenizer(), block_size=4, objective="fast_dllm_v2_causal_clean")
    assert bdlm.config.clean_attention == "causal"
    x = torch.randint(0, len(WORDS), (2, 12))
    x_t = x.masked_fill(torch.rand(2, 12) < 0.5, bdlm.config.mask_token_id)
    with torch.no_grad():
        reference = lm.model(input_ids=x).last_hidden_state
        hidden = bdlm(input_ids=x_t, clean_input_ids=x).hidden_states
    clean = hidden[:, 12:]  # training form: noisy rows first, then the clean rows
    torch.testing.assert_close(clean, reference, rtol=0, atol=1e-12)


def test_default_conversion_is_fast_dllm_v2_with_a_block_causal_clean_stream():
    bdlm, _ = convert_causal_lm(tiny_llama(), tiny_tokenizer(), block_size=4)
    assert (bdlm.config.objective, bdlm.config.clean_attention) == ("fast_dllm_v2", "block_causal")
    with pytest.raises(ValueError, match="fast_dllm_v2_causal_clean"):
        convert_causal_lm(tiny_llama(), tiny_tokenizer(), block_size=4, clean_attention="causal")


def test_block_size_one_with_token_shift_decodes_like_the_causal_lm():
    # With B = 1 and the fast_dllm_v2 token shift, every block is one [MASK] predicted by the clean stream's last
    # row, i.e. the causal LM's next-token prediction: conversion + generation reproduce greedy decoding.
    lm, tok = tiny_llama(), tiny_tokenizer()
    prompt = torch.tensor([[2, 4, 5, 6, 7]])
    reference = lm.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=1)
    bdlm, _ = convert_causal_lm(lm, tok, block_size=1)
    assert bdlm.config.objective == "fast_dllm_v2"
    out = generate(bdlm, prompt, max_new_tokens=8, eos_token_id=None)
    assert torch.equal(out, reference)


def test_conversion_from_a_local_checkpoint_saves_and_reloads(tmp_path):
    lm, tok = tiny_llama(tie=True), tiny_tokenizer()
    lm.save_pretrained(tmp_path / "causal")
    tok.save_pretrained(tmp_path / "causal")
    bdlm, tok = convert_causal_lm(tmp_path / "causal", block_size=4)
    assert tok.mask_token_id == bdlm.config.mask_token_id == len(WORDS)
    assert bdlm.dtype == torch.float64
    bdlm.save_pretrained(tmp_path / "bdlm")
    reloaded = AutoModel.from_pretrained(tmp_path / "bdlm")
    assert isinstance(reloaded, BlockDiffusionForMaskedLM)
    assert reloaded.config.mask_token_id == len(WORDS) and reloaded.config.block_size == 4
    assert reloaded.get_input_embeddings().weight is reloaded.get_output_embeddings().weight
    for name, value in bdlm.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], value), name


def test_backbone_without_attention_interface_is_rejected_by_name():
    lm = BloomForCausalLM(BloomConfig(vocab_size=len(WORDS), hidden_size=16, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match="'bloom'"):
        convert_causal_lm(lm, tiny_tokenizer(), block_size=4)


def test_tokenizer_larger_than_embedding_is_a_mismatch():
    lm = tiny_llama(vocab_size=8)
    with pytest.raises(ValueError, match=rf"{len(WORDS)} tokens.*only 8 rows"):
        convert_causal_lm(lm, tiny_tokenizer(), block_size=4)


@pytest.mark.parametrize("bad_id", [-1, len(WORDS), 10**6])
def test_mask_token_id_out_of_range_is_rejected(bad_id):
    with pytest.raises(ValueError, match=rf"mask_token_id={bad_id}.*0\.\.{len(WORDS) - 1}"):
        convert_causal_lm(tiny_llama(), mask_token_id=bad_id, block_size=4)


def test_model_object_without_tokenizer_says_how_to_fix():
    with pytest.raises(ValueError, match="tokenizer=.*mask_token_id="):
        convert_causal_lm(tiny_llama(), block_size=4)


def test_model_without_lm_head_is_rejected():
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="ForCausalLM"):
        convert_causal_lm(LlamaModel(tiny_config(LlamaConfig)), tiny_tokenizer(), block_size=4)


def test_convert_causal_lm_is_exported():
    assert hf_bdlm.convert_causal_lm is convert_causal_lm


def test_added_mask_row_depends_on_the_seed_only():
    """The new [MASK] row is drawn from its own seeded generator state: a process that drew random numbers before
    (e.g. the rank that exported the embedded model) converts to the same weights as one that did not. (More rows than
    dimensions: transformers then draws the row, around the others' mean, instead of using the mean itself.)"""
    torch.manual_seed(0)
    lm = LlamaForCausalLM(tiny_config(LlamaConfig, hidden_size=8, num_attention_heads=2, num_key_value_heads=1,
                                      intermediate_size=16)).double()
    torch.manual_seed(1)
    first, _ = convert_causal_lm(lm, tiny_tokenizer(), block_size=4)
    torch.manual_seed(2)
    torch.rand(100)
    state = torch.random.get_rng_state()
    second, _ = convert_causal_lm(lm, tiny_tokenizer(), block_size=4)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's generator is left as it was
    other, _ = convert_causal_lm(lm, tiny_tokenizer(), block_size=4, seed=1)
    mask = first.config.mask_token_id
    rows = [m.get_input_embeddings().weight[mask] for m in (first, second, other)]
    assert torch.equal(rows[0], rows[1])
    assert not torch.equal(rows[0], rows[2])
    assert torch.equal(first.get_input_embeddings().weight[:mask], lm.get_input_embeddings().weight)
