"""The block-diffusion decoding techniques, each on its own: what each changes (forwards, rows) and what it may not
(the tokens), batch invariance at batch 1 and 8, and clear errors.

- `fuse_block_commit`, `eos_early_exit`, `compact_batch`: exact (the same tokens), fewer forwards or rows;
- `sub_block_size`: unmasks left to right by sub-blocks; `block_cache`: runs only a sub-block's rows after its first
  step, exact on a one-layer model (whose K/V of a position depend on its own token only), an approximation deeper;
- `min_tokens_per_step`: a lower bound on positions fixed per step.

Tiny random models (float64 where tokens are compared across code paths; the batch-invariance test also in float32,
as served). Run: python -m pytest tests/models/block_diffusion/test_decoding_techniques.py -q
"""

import pytest
import torch
from transformers import LlamaConfig

from hf_bdlm import BlockDiffusionConfig, BlockDiffusionForMaskedLM
from hf_bdlm.models.block_diffusion.generation import BlockDiffusionGenerationConfig, decode_ragged, generate, resolve_settings

VOCAB, MASK, BLOCK = 32, 31, 8
NO_SPECIAL = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
LENGTHS = (1, 3, 8, 6, 9, 12, 17, 5)  # eight ragged prompts: inside a block, a block exactly, across blocks
EXACT = ("fuse_block_commit", "eos_early_exit", "compact_batch")


def bdlm(layers=2, objective="fast_dllm_v2", dtype=torch.float64, seed=0) -> BlockDiffusionForMaskedLM:
    torch.manual_seed(seed)
    backbone = LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=64, **NO_SPECIAL)
    config = BlockDiffusionConfig(backbone_config=backbone, block_size=BLOCK, mask_token_id=MASK, objective=objective)
    return BlockDiffusionForMaskedLM(config).to(dtype).eval()


def prompts(lengths=LENGTHS, seed=1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, MASK - 1, (n,), generator=g) for n in lengths]


class Forwards:
    """Counts the backbone's forwards and the rows they run (every decoding forward goes through it)."""

    def __init__(self, model):
        self.calls, self.rows = 0, 0
        self.handle = model.decoder.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs):
        self.calls += 1
        self.rows += int(kwargs["inputs_embeds"].shape[0] * kwargs["inputs_embeds"].shape[1])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def decode(model, rows, max_new_tokens=16, **settings) -> list[list[int]]:
    config = BlockDiffusionGenerationConfig(max_new_tokens=max_new_tokens, **settings)
    resolved = resolve_settings(model, config, max(p.numel() for p in rows))
    with torch.no_grad():
        return [t.tolist() for t in decode_ragged(model, rows, resolved)]


def counted(model, rows, **settings):
    with Forwards(model) as forwards:
        out = decode(model, rows, **settings)
    return out, forwards


def ending_token(model, rows, **settings) -> int:
    """A token some rows generate and others not (as EOS, it ends some rows early and lets others run on)."""
    free = decode(model, rows, eos_token_id=None, **settings)
    counts = torch.bincount(torch.tensor([t for r in free for t in set(r)]), minlength=VOCAB)
    return int(torch.where((counts > 0) & (counts < len(rows)), counts, 0).argmax())


def off(*names) -> dict:
    return {name: False for name in names}


# --- the exact techniques change no token -------------------------------------------------------------------------


@pytest.mark.parametrize("objective", ["standard", "fast_dllm_v2"])
@pytest.mark.parametrize("threshold", [0.9, 0.05])
def test_each_exact_technique_keeps_every_token(objective, threshold):
    model = bdlm(objective=objective)
    rows = prompts()
    eos = ending_token(model, rows, confidence_threshold=threshold)
    baseline = decode(model, rows, confidence_threshold=threshold, eos_token_id=eos, **off(*EXACT))
    for name in EXACT:
        alone = decode(model, rows, confidence_threshold=threshold, eos_token_id=eos, **{**off(*EXACT), name: True})
        assert alone == baseline, name
    assert decode(model, rows, confidence_threshold=threshold, eos_token_id=eos) == baseline
    assert any(eos in r for r in baseline) and any(eos not in r for r in baseline)  # some rows end early, some not


def test_fused_commit_saves_one_forward_per_block():
    model = bdlm()
    rows = prompts((16,))  # two whole prompt blocks, no tail
    apart, apart_n = counted(model, rows, max_new_tokens=24, steps_per_block=2, confidence_threshold=None,
                             fuse_block_commit=False)
    fused, fused_n = counted(model, rows, max_new_tokens=24, steps_per_block=2, confidence_threshold=None)
    assert fused == apart
    # apart: the prompt's forward, then per block 2 steps and (but the last) its commit; fused: 2 steps per block
    assert (apart_n.calls, fused_n.calls) == (1 + 3 * 2 + 2, 3 * 2)


def test_a_row_stops_at_the_step_its_eos_settles():
    model = bdlm(objective="standard")
    rows = prompts((5,))
    eos = 7
    original = model.lm_logits

    def eos_first(hidden):  # the first masked position (the first candidate) is a sure EOS
        logits = original(hidden)
        logits[0, eos] = 1e4
        return logits

    model.lm_logits = eos_first
    try:
        late, late_n = counted(model, rows, max_new_tokens=BLOCK, confidence_threshold=None, eos_token_id=eos,
                               eos_early_exit=False)
        early, early_n = counted(model, rows, max_new_tokens=BLOCK, confidence_threshold=None, eos_token_id=eos)
    finally:
        model.lm_logits = original
    assert early == late == [[eos]]
    # The prompt's 5 tokens sit in the block; one position per step fills its 3 others, or stops at the first.
    assert (late_n.calls, early_n.calls) == (3, 1)


def test_compact_batch_runs_only_the_rows_still_decoding():
    model = bdlm()
    rows = prompts()
    full, full_n = counted(model, rows, confidence_threshold=0.3, compact_batch=False)
    compact, compact_n = counted(model, rows, confidence_threshold=0.3)
    assert compact == full
    assert compact_n.calls == full_n.calls and compact_n.rows < full_n.rows


# --- batch invariance ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("settings", [
    dict(),                                                                  # the defaults (every exact technique)
    dict(**off(*EXACT)),                                                     # none of them
    dict(sub_block_size=4, block_cache=True, min_tokens_per_step=2),        # the approximate ones
])
def test_rows_decode_the_same_at_batch_1_and_8(dtype, settings):
    model = bdlm(dtype=dtype)
    rows = prompts()
    eos = ending_token(model, rows, confidence_threshold=0.5)
    batch = decode(model, rows, confidence_threshold=0.5, eos_token_id=eos, **settings)
    alone = [decode(model, [p], confidence_threshold=0.5, eos_token_id=eos, **settings)[0] for p in rows]
    assert batch == alone


def test_left_padded_generate_equals_each_prompt_alone_with_every_technique():
    model = bdlm()
    rows = prompts()
    width = max(p.numel() for p in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(rows):
        ids[i, width - p.numel():], mask[i, width - p.numel():] = p, 1
    knobs = dict(max_new_tokens=12, confidence_threshold=0.5, sub_block_size=4, block_cache=True)
    out = generate(model, ids, attention_mask=mask, **knobs)
    for i, p in enumerate(rows):
        assert torch.equal(out[i, width:], generate(model, p[None], **knobs)[0, p.numel():])


# --- sub-blocks and the block cache ---------------------------------------------------------------------------------


def test_sub_blocks_unmask_left_to_right():
    model = bdlm(objective="standard")
    rows = prompts((BLOCK,))
    # Everything is confident enough: the whole block in one step, or one step per sub-block.
    whole, whole_n = counted(model, rows, max_new_tokens=BLOCK, confidence_threshold=1e-9)
    subs, subs_n = counted(model, rows, max_new_tokens=BLOCK, confidence_threshold=1e-9, sub_block_size=2)
    assert whole_n.calls == 1 and subs_n.calls == BLOCK // 2
    # Left to right: at each step the earliest masked sub-block is the one decoded; its first position is fixed by it.
    steps = []
    original = model.lm_logits
    model.lm_logits = lambda hidden: steps.append(hidden.shape[0]) or original(hidden)
    try:
        decode(model, rows, max_new_tokens=BLOCK, confidence_threshold=None, sub_block_size=2)
    finally:
        model.lm_logits = original
    assert steps == [2, 1] * (BLOCK // 2)  # candidates per step: the sub-block's masked positions only


@pytest.mark.parametrize("objective", ["standard", "fast_dllm_v2"])
def test_block_cache_is_exact_on_one_layer_and_runs_only_the_sub_block(objective):
    # One layer: a position's K/V depend on its own token only, so the kept K/V of the block's other rows are what a
    # full forward would compute; deeper models see a difference (the approximation), one layer must not.
    model = bdlm(layers=1, objective=objective)
    rows = prompts((BLOCK, 3))
    knobs = dict(max_new_tokens=2 * BLOCK, confidence_threshold=None, sub_block_size=4)
    full, full_n = counted(model, rows, **knobs)
    cached, cached_n = counted(model, rows, block_cache=True, **knobs)
    assert cached == full
    assert cached_n.calls == full_n.calls and cached_n.rows < full_n.rows
    # Deeper: the same mechanism, not the same tokens necessarily, but the same number of steps and fewer rows.
    deep = bdlm(layers=2, objective=objective)
    _, deep_full = counted(deep, rows, **knobs)
    _, deep_cached = counted(deep, rows, block_cache=True, **knobs)
    assert deep_cached.calls == deep_full.calls and deep_cached.rows < deep_full.rows


def test_min_tokens_per_step_bounds_the_steps():
    model = bdlm()
    rows = prompts((BLOCK,))
    one, one_n = counted(model, rows, max_new_tokens=2 * BLOCK, confidence_threshold=None)
    four, four_n = counted(model, rows, max_new_tokens=2 * BLOCK, confidence_threshold=None, min_tokens_per_step=4)
    # token shift: a block's first token comes with the step before; one per step needs B - 1 more steps per block.
    assert one_n.calls == 2 * BLOCK and four_n.calls == 2 * 2


# --- errors ---------------------------------------------------------------------------------------------------------


def test_settings_the_decoder_cannot_honour_are_refused():
    model = bdlm()
    x = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="sub_block_size=3 does not divide the block size 8"):
        model.generate(x, sub_block_size=3)
    with pytest.raises(ValueError, match="block_cache=True .* needs a sub_block_size smaller than the block"):
        model.generate(x, block_cache=True)
    with pytest.raises(ValueError, match="steps_per_block=2 fixes the steps of a whole block"):
        model.generate(x, sub_block_size=4, steps_per_block=2)
    with pytest.raises(ValueError, match="min_tokens_per_step must be an integer >= 1, got 0"):
        model.generate(x, min_tokens_per_step=0)
    with pytest.raises(ValueError, match="block_cache=True keeps K/V across the steps of a block; it needs use_cache"):
        generate(model, x, use_cache=False, sub_block_size=4, block_cache=True)
    standard = bdlm(objective="standard")
    with pytest.raises(ValueError, match="decodes as the engine serves, which has no sub_block_size"):
        standard.generate(x, unmasking="sglang_low_confidence", sub_block_size=4)
