"""Ragged batches: prompts of different lengths decode together and each row gets what it gets alone.

Tiny random float64 models (so tokens compare exactly across code paths). Run:
python -m pytest tests/models/block_diffusion/test_batched_generation.py -q
"""

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig

from hf_bdlm import BlockDiffusionConfig, BlockDiffusionForMaskedLM
from hf_bdlm.models.block_diffusion.generation import BlockDiffusionGenerationConfig, decode_ragged, generate, resolve_settings

VOCAB, MASK = 32, 31
NO_SPECIAL = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
LENGTHS = (1, 3, 4, 6, 9)  # shorter than a block, a block exactly, across several blocks


def bdlm(backbone: str = "llama", clean_attention: str = "block_causal", **kwargs) -> BlockDiffusionForMaskedLM:
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=64, **NO_SPECIAL)
    if backbone == "gemma3":
        config = Gemma3TextConfig(**common, head_dim=8, sliding_window=3,
                                  layer_types=["sliding_attention", "full_attention"])
    else:
        config = LlamaConfig(**common)
    cfg = BlockDiffusionConfig(backbone_config=config, block_size=4, mask_token_id=MASK,
                               clean_attention=clean_attention, **kwargs)
    return BlockDiffusionForMaskedLM(cfg).double().eval()


def ragged_prompts(lengths=LENGTHS, seed=1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, MASK, (n,), generator=g) for n in lengths]


def alone(model, prompt, **kwargs) -> torch.Tensor:
    return generate(model, prompt[None], **kwargs)[0, prompt.numel():]


def ragged(model, prompts, use_cache=True, max_new_tokens=8, on_block=None, **kwargs) -> list[torch.Tensor]:
    """`decode_ragged` with one budget for all rows (an int) or one per row (a list)."""
    per_row = max_new_tokens if isinstance(max_new_tokens, list) else None
    config = BlockDiffusionGenerationConfig(max_new_tokens=max(per_row or [max_new_tokens]), **kwargs)
    settings = resolve_settings(model, config, max(p.numel() for p in prompts))
    with torch.no_grad():
        return decode_ragged(model, prompts, settings, use_cache, max_new_tokens=per_row, on_block=on_block)


@pytest.mark.parametrize("backbone, clean_attention, objective", [
    ("llama", "block_causal", "standard"),
    ("llama", "block_causal", "fast_dllm_v2"),  # token shift: a block's first token comes from the clean stream
    ("llama", "causal", "standard"),
    ("gemma3", "causal", "standard"),     # sliding-window layers: distances are what the row sees alone
])
def test_ragged_batch_rows_equal_rows_decoded_alone(backbone, clean_attention, objective):
    model = bdlm(backbone, clean_attention, objective=objective)
    prompts = ragged_prompts()
    for threshold in (0.9, 0.1):
        rows = ragged(model, prompts, max_new_tokens=10, confidence_threshold=threshold)
        for prompt, row in zip(prompts, rows):
            assert torch.equal(row, alone(model, prompt, max_new_tokens=10, confidence_threshold=threshold))


def test_ragged_batch_without_cache_equals_with_cache():
    model = bdlm("llama", "block_causal", objective="fast_dllm_v2")
    prompts = ragged_prompts()
    cached = ragged(model, prompts, max_new_tokens=9, confidence_threshold=0.1)
    recomputed = ragged(model, prompts, use_cache=False, max_new_tokens=9, confidence_threshold=0.1)
    assert all(torch.equal(a, b) for a, b in zip(cached, recomputed))


def test_each_row_keeps_its_own_budget_and_fixed_steps():
    model = bdlm()
    prompts = ragged_prompts((2, 5, 7))
    budgets = [3, 11, 6]
    rows = ragged(model, prompts, max_new_tokens=budgets, steps_per_block=2, confidence_threshold=None)
    for prompt, row, n in zip(prompts, rows, budgets):
        assert row.numel() == n
        assert torch.equal(row, alone(model, prompt, max_new_tokens=n, steps_per_block=2, confidence_threshold=None))


def test_rows_stop_at_their_first_eos():
    model = bdlm()
    prompts = ragged_prompts((3, 6))
    free = ragged(model, prompts, max_new_tokens=12)
    eos = int(free[1][4])
    rows = ragged(model, prompts, max_new_tokens=12, eos_token_id=eos)
    for row, reference in zip(rows, free):
        hits = (reference == eos).nonzero()
        end = int(hits[0]) + 1 if len(hits) else reference.numel()
        assert torch.equal(row, reference[:end])


def test_on_block_streams_every_block_and_can_stop_a_row():
    model = bdlm()
    prompts = ragged_prompts((2, 6))
    seen = {0: [], 1: []}

    def on_block(new):
        for row, tokens in new.items():
            seen[row].append(tokens)
        return {0} if len(seen[0]) == 2 else None  # stop row 0 after its second block

    rows = ragged(model, prompts, max_new_tokens=13, on_block=on_block)
    assert len(seen[0]) == 2 and rows[0].numel() == 2 + 4  # its prompt tail filled half of the first block
    assert torch.equal(torch.cat(seen[1]), rows[1]) and rows[1].numel() == 13
    assert torch.equal(rows[1], alone(model, prompts[1], max_new_tokens=13))


def test_left_padded_generate_batches_the_rows():
    model = bdlm()
    prompts = ragged_prompts((6, 3, 5))
    width = 6
    batch = torch.stack([torch.cat([torch.zeros(width - p.numel(), dtype=torch.long), p]) for p in prompts])
    mask = torch.stack([torch.arange(width) >= width - p.numel() for p in prompts]).long()
    calls = []
    handle = model.register_forward_hook(lambda module, args, out: calls.append(1))
    try:
        out = generate(model, batch, attention_mask=mask, max_new_tokens=8)
    finally:
        handle.remove()
    for i, p in enumerate(prompts):
        assert torch.equal(out[i, width:], alone(model, p, max_new_tokens=8))
    steps_alone = len(calls)
    calls.clear()
    handle = model.register_forward_hook(lambda module, args, out: calls.append(1))
    try:
        alone(model, prompts[0], max_new_tokens=8)
    finally:
        handle.remove()
    assert steps_alone < 3 * len(calls)  # one batched run, not one run per row
