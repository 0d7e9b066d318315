"""Block-wise diffusion decoding: the KV cache changes nothing, a trained model continues its pattern,
stopping rules, the generation config on disk, clear errors.

Tiny random models (float64 where tokens are compared across code paths) and one tiny model trained
for a few seconds. Run: python -m pytest tests/models/block_diffusion/test_generation.py -q
"""

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, Gemma3TextConfig, GenerationConfig, LlamaConfig

import hf_bdlm
from hf_bdlm import BlockDiffusionConfig, BlockDiffusionForMaskedLM
from hf_bdlm.models.block_diffusion.generation import (
    BlockDiffusionGenerationConfig,
    BlockDiffusionGenerationMixin,
    CachedContext,
    generate,
    resolve_settings,
)

VOCAB, MASK = 32, 31
NO_SPECIAL = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


def llama_bdlm(clean_attention="block_causal", block_size=4, seed=0, **kwargs):
    torch.manual_seed(seed)
    backbone = LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=64, **NO_SPECIAL)
    config = BlockDiffusionConfig(backbone_config=backbone, block_size=block_size, mask_token_id=MASK,
                                  clean_attention=clean_attention, **kwargs)
    return BlockDiffusionForMaskedLM(config).double().eval()


def gemma3_bdlm(convention="per_query", clean_attention="causal", window=3):
    torch.manual_seed(0)
    backbone = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=8, intermediate_size=64, sliding_window=window,
                                layer_types=["sliding_attention", "full_attention"], **NO_SPECIAL)
    config = BlockDiffusionConfig(backbone_config=backbone, block_size=4, mask_token_id=MASK,
                                  clean_attention=clean_attention, sliding_window_convention=convention)
    return BlockDiffusionForMaskedLM(config).double().eval()


def prompts(batch, length, seed=1):
    return torch.randint(0, MASK, (batch, length), generator=torch.Generator().manual_seed(seed))


# --- the cache changes nothing -----------------------------------------------------------------


@pytest.mark.parametrize("clean_attention", ["block_causal", "causal"])
@pytest.mark.parametrize("prompt_len", [1, 3, 4, 6, 8])
def test_cached_decoding_equals_uncached_decoding(clean_attention, prompt_len):
    model = llama_bdlm(clean_attention)
    x = prompts(2, prompt_len)
    for threshold in (0.9, 0.1):  # one token per step on a random model / several in parallel
        cached = generate(model, x, max_new_tokens=13, confidence_threshold=threshold)
        uncached = generate(model, x, max_new_tokens=13, confidence_threshold=threshold, use_cache=False)
        assert cached.shape == (2, prompt_len + 13)
        assert torch.equal(cached, uncached)


@pytest.mark.parametrize("convention", ["per_query", "block_start"])
@pytest.mark.parametrize("prompt_len", [2, 4, 7])
def test_cached_decoding_equals_uncached_with_sliding_window_layers(prompt_len, convention):
    # Window 3 < sequence: a cache that dropped keys outside the window would lose keys a block still needs.
    model = gemma3_bdlm(convention)
    x = prompts(1, prompt_len)
    cached = generate(model, x, max_new_tokens=14, confidence_threshold=0.1)
    assert torch.equal(cached, generate(model, x, max_new_tokens=14, confidence_threshold=0.1, use_cache=False))


@pytest.mark.parametrize("objective", ["fast_dllm_v2", "fast_dllm_v2_causal_clean"])
def test_token_shift_decoding_equals_uncached(objective):
    model = llama_bdlm(None, objective=objective)
    assert resolve_settings(model, BlockDiffusionGenerationConfig(), 4).token_shift
    for prompt_len in (4, 5):
        x = prompts(2, prompt_len)
        cached = generate(model, x, max_new_tokens=11, confidence_threshold=0.1)
        assert torch.equal(cached, generate(model, x, max_new_tokens=11, confidence_threshold=0.1, use_cache=False))


@pytest.mark.parametrize("clean_attention", ["block_causal", "causal"])
def test_block_over_cache_equals_training_form(clean_attention):
    # The noisy rows of block k over the cached clean blocks 0..k-1 see exactly what the training form shows them.
    model = llama_bdlm(clean_attention)
    B, k = 4, 2
    x = prompts(2, (k + 1) * B)
    x_t = x.clone()
    x_t[:, k * B + 1 :] = MASK
    x_t[:, :B] = MASK  # earlier noisy blocks must not matter
    with torch.no_grad():
        reference = model(input_ids=x_t, clean_input_ids=x).hidden_states[:, k * B : (k + 1) * B]
        settings = resolve_settings(model, BlockDiffusionGenerationConfig(), k * B)
        context = CachedContext(model, settings, x.device)
        context.append(x[:, :B])
        context.append(x[:, B : k * B])
        hidden, _ = context.block_hidden(x_t[:, k * B :], k * B)
        assert context.cache.get_seq_length() == k * B  # noisy K/V were cropped away
    torch.testing.assert_close(hidden, reference, rtol=0, atol=1e-12)


@pytest.mark.parametrize("clean_attention", ["block_causal", "causal"])
@pytest.mark.parametrize("convention", ["per_query", "block_start"])
def test_block_over_a_sliding_window_cache_equals_training_form(convention, clean_attention):
    # Gemma 3 with window 6 > B = 4: a canvas block's window reaches into the previous clean blocks, where the two
    # conventions differ (per_query: from p - 5 for query p; block_start: from s_b - 5 for the whole block).
    B, k = 4, 3
    x = prompts(2, (k + 1) * B)
    x_t = x.clone()
    x_t[:, k * B + 1 :] = MASK
    hidden = {}
    for conv in ("per_query", "block_start"):
        model = gemma3_bdlm(conv, clean_attention, window=6)
        assert model.mask_rule().window_convention == conv
        with torch.no_grad():
            reference = model(input_ids=x_t, clean_input_ids=x).hidden_states[:, k * B : (k + 1) * B]
            settings = resolve_settings(model, BlockDiffusionGenerationConfig(), k * B)
            assert settings.rule == model.mask_rule()  # generate runs the training rule
            context = CachedContext(model, settings, x.device)
            for b in range(k):
                context.append(x[:, b * B : (b + 1) * B])
            hidden[conv], _ = context.block_hidden(x_t[:, k * B :], k * B)
        torch.testing.assert_close(hidden[conv], reference, rtol=0, atol=1e-12)
    assert (hidden["per_query"] - hidden["block_start"]).abs().max() > 1e-3  # the conventions are different models


# --- a trained model reproduces its pattern ----------------------------------------------------


def pattern(first: torch.Tensor, length: int) -> torch.Tensor:
    return (first[:, None] + 3 * torch.arange(length)) % 12


def test_tiny_trained_model_continues_the_pattern():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only add overhead
    try:
        torch.manual_seed(0)
        V, B, L, mask = 16, 4, 24, 15
        backbone = LlamaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=64, **NO_SPECIAL)
        model = BlockDiffusionForMaskedLM(BlockDiffusionConfig(backbone_config=backbone, block_size=B,
                                                               mask_token_id=mask, attention_backend="dense"))
        steps = 400
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=steps, pct_start=0.1)
        for _ in range(steps):
            x = pattern(torch.randint(0, 12, (32,)), L)
            t = torch.rand(32, L // B).clamp(min=0.1).repeat_interleave(B, dim=1)  # one rate per block
            masked = torch.rand(32, L) < t
            logits = model(input_ids=x.masked_fill(masked, mask), clean_input_ids=x).logits
            logits[..., mask] = float("-inf")
            loss = F.cross_entropy(logits[masked], x[masked])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        model.eval()
        expected = pattern(torch.arange(12), 20)
        for prompt_len in (4, 6):  # block-aligned prompt; prompt ending mid-block
            out = generate(model, expected[:, :prompt_len], max_new_tokens=20 - prompt_len, confidence_threshold=0.9)
            assert torch.equal(out, expected)
    finally:
        torch.set_num_threads(threads)


# --- stopping rules and decoding knobs ----------------------------------------------------------


def test_max_new_tokens_is_exact_and_shorter_runs_are_prefixes():
    model = llama_bdlm()
    x = prompts(2, 6)
    longest = generate(model, x, max_new_tokens=11)
    for n in (1, 2, 5, 7):
        out = generate(model, x, max_new_tokens=n)
        assert out.shape == (2, 6 + n)
        assert torch.equal(out, longest[:, : 6 + n])


def test_eos_stops_after_its_block_and_pads_finished_rows():
    model = llama_bdlm()
    x = prompts(2, 4)
    free = generate(model, x, max_new_tokens=12)
    eos = int(free[0, 4 + 5])  # a token row 0 generates in its second block
    pad = 30
    out = generate(model, x, max_new_tokens=12, eos_token_id=eos, pad_token_id=pad)
    for row in range(2):
        generated = free[row, 4:]
        hits = (generated == eos).nonzero()
        end = int(hits[0]) + 1 if len(hits) else generated.shape[0]
        assert torch.equal(out[row, : 4 + end], free[row, : 4 + end])
        assert (out[row, 4 + end :] == pad).all()
    longest_row = max(
        int((free[r, 4:] == eos).nonzero()[0]) + 1 if (free[r, 4:] == eos).any() else 12 for r in range(2)
    )
    assert out.shape[1] == 4 + longest_row
    single = generate(model, x[:1], max_new_tokens=12, eos_token_id=eos)
    assert single[0, -1] == eos and single.shape[1] <= 4 + 6


@pytest.mark.parametrize("fused", [False, True])
def test_steps_per_block_bounds_the_denoising_steps(fused):
    model = llama_bdlm()
    calls = []
    handle = model.register_forward_hook(lambda module, args, kwargs_out: calls.append(1))
    try:
        generate(model, prompts(1, 4), max_new_tokens=8, steps_per_block=2, confidence_threshold=None,
                 fuse_block_commit=fused)
    finally:
        handle.remove()
    # Apart: prefill + (2 steps + 1 append) for the first block + 2 steps for the last block. Fused: the prompt's block
    # runs in the first block's first step, and the first block's clean rows in the second block's first step.
    assert len(calls) == (2 + 2 if fused else 1 + 3 + 2)


def test_mask_token_is_never_generated():
    model = llama_bdlm()
    head = model.lm_logits
    model.lm_logits = lambda hidden: head(hidden).index_fill(-1, torch.tensor([MASK]), 1e4)
    for sample in (False, True):
        out = generate(model, prompts(2, 3), max_new_tokens=9, do_sample=sample, temperature=5.0)
        assert not (out[:, 3:] == MASK).any()


def test_sampling_is_reproducible_with_a_generator():
    model = llama_bdlm()
    x = prompts(2, 5)

    def sample(seed):
        g = torch.Generator().manual_seed(seed)
        return generate(model, x, max_new_tokens=9, do_sample=True, temperature=2.0, top_k=10, top_p=0.9, generator=g)

    assert torch.equal(sample(0), sample(0))
    assert not torch.equal(sample(0), sample(1))


def test_left_padded_batch_decodes_each_row_as_alone():
    model = llama_bdlm()
    a, b = prompts(1, 6, seed=1), prompts(1, 3, seed=2)
    pad = 0
    batch = torch.cat([a, torch.cat([torch.full((1, 3), pad), b], dim=1)])
    attention_mask = torch.tensor([[1] * 6, [0] * 3 + [1] * 3])
    out = generate(model, batch, attention_mask=attention_mask, max_new_tokens=7)
    assert torch.equal(out[:, :6], batch)
    assert torch.equal(out[0, 6:], generate(model, a, max_new_tokens=7)[0, 6:])
    assert torch.equal(out[1, 6:], generate(model, b, max_new_tokens=7)[0, 3:])


def test_plain_generation_config_and_kwargs_are_accepted():
    model = llama_bdlm()
    x = prompts(1, 4)
    out = generate(model, x, generation_config=GenerationConfig(max_new_tokens=5))
    assert out.shape == (1, 9)
    assert torch.equal(model.generate(x, max_new_tokens=5), out)


# --- the generation config on disk --------------------------------------------------------------


if issubclass(BlockDiffusionForMaskedLM, BlockDiffusionGenerationMixin):
    GeneratingBDLM = BlockDiffusionForMaskedLM
else:  # the model class with the generation hooks, until modeling.py mixes them in

    class GeneratingBDLM(BlockDiffusionGenerationMixin, BlockDiffusionForMaskedLM):
        pass


def test_generation_config_round_trips_through_save_and_load(tmp_path):
    torch.manual_seed(0)
    model = GeneratingBDLM(llama_bdlm().config)
    assert isinstance(model.generation_config, BlockDiffusionGenerationConfig)
    assert model.generation_config.mask_token_id == MASK
    model.generation_config.update(steps_per_block=3, confidence_threshold=0.75, max_new_tokens=17, eos_token_id=5)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "generation_config.json").read_text())
    assert saved["steps_per_block"] == 3 and saved["confidence_threshold"] == 0.75
    reloaded = GeneratingBDLM.from_pretrained(tmp_path)
    config = reloaded.generation_config
    assert isinstance(config, BlockDiffusionGenerationConfig)
    assert (config.steps_per_block, config.confidence_threshold, config.max_new_tokens, config.eos_token_id) == (
        3, 0.75, 17, 5
    )
    assert config.block_size is None and config.mask_token_id == MASK


@pytest.mark.skipif(
    not issubclass(BlockDiffusionForMaskedLM, BlockDiffusionGenerationMixin),
    reason="modeling.py does not mix BlockDiffusionGenerationMixin into BlockDiffusionForMaskedLM yet",
)
def test_generation_config_round_trips_through_auto_model(tmp_path):
    model = llama_bdlm()
    model.generation_config.update(steps_per_block=2, max_new_tokens=6)
    model.save_pretrained(tmp_path)
    reloaded = AutoModel.from_pretrained(tmp_path)
    assert isinstance(reloaded.generation_config, BlockDiffusionGenerationConfig)
    assert reloaded.generation_config.steps_per_block == 2
    assert reloaded.generate(prompts(1, 4)).shape == (1, 10)


def test_generation_config_is_exported_and_validated():
    assert hf_bdlm.BlockDiffusionGenerationConfig is BlockDiffusionGenerationConfig
    with pytest.raises(ValueError, match="confidence_threshold"):
        BlockDiffusionGenerationConfig(confidence_threshold=1.5)
    with pytest.raises(ValueError, match="steps_per_block"):
        BlockDiffusionGenerationConfig(steps_per_block=0)


# --- bad input ---------------------------------------------------------------------------------


def test_empty_batch_is_rejected():
    with pytest.raises(ValueError, match="empty batch"):
        generate(llama_bdlm(), torch.zeros((0, 4), dtype=torch.long))


def test_empty_prompt_is_rejected():
    with pytest.raises(ValueError, match="at least one prompt token"):
        generate(llama_bdlm(), torch.zeros((2, 0), dtype=torch.long))


def test_one_dimensional_prompt_is_rejected_with_a_hint():
    with pytest.raises(ValueError, match=r"input_ids\[None\]"):
        generate(llama_bdlm(), torch.tensor([1, 2, 3]))


def test_missing_mask_token_id_is_rejected():
    model = llama_bdlm()
    model.config.mask_token_id = None
    with pytest.raises(ValueError, match="mask token"):
        generate(model, prompts(1, 4), mask_token_id=None)


def test_right_padding_is_rejected():
    with pytest.raises(ValueError, match="left padding"):
        generate(llama_bdlm(), prompts(2, 4), attention_mask=torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]))


def test_unknown_argument_is_rejected():
    with pytest.raises(TypeError, match="tempreature"):
        generate(llama_bdlm(), prompts(1, 4), tempreature=0.5)
