"""Speculative decoding with a DFlash drafter is lossless: both entry points return the target's greedy decoding.

Tiny random float64 targets (Llama, Qwen3) so that tokens compare exactly across code paths, and a random-init
drafter from `from_target`. A random drafter is almost never right, so the tests that need accepted drafts (ragged
acceptance across rows, full blocks) replace its proposals by the target's own greedy continuation, corrupted at
chosen slots or not at all. Run:
python -m pytest tests/test_dflash_speculative.py -q
"""

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from hf_bdlm.models.dflash import speculative
from hf_bdlm.models.dflash.modeling import DFlash2DraftModel, DFlashDraftModel
from hf_bdlm.models.dflash.speculative import (
    DFlashCandidateGenerator,
    dflash_assisted_decoding,
    draft_block,
    speculative_generate,
    target_features,
)

VOCAB, MASK, BLOCK = 64, 63, 4
NO_SPECIAL = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
PROMPT_LENGTHS = (2, 5, 7)


def tiny_target(family: str = "llama", vocab: int = VOCAB, layers: int = 3):
    torch.manual_seed(0)
    common = dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=64, **NO_SPECIAL)
    model = (Qwen3ForCausalLM(Qwen3Config(**common, head_dim=8)) if family == "qwen3"
             else LlamaForCausalLM(LlamaConfig(**common)))
    return model.double().eval()


def tiny_drafter(target, dflash2: bool = True, **kwargs):
    torch.manual_seed(1)
    cls = DFlash2DraftModel if dflash2 else DFlashDraftModel
    return cls.from_target(target, init="scratch", num_hidden_layers=1, block_size=BLOCK, mask_token_id=MASK,
                           **kwargs).double().eval()


def prompts(lengths=PROMPT_LENGTHS, seed=2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, MASK, (n,), generator=g) for n in lengths]


def left_pad(rows: list[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(r.numel() for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - r.numel():] = r
        mask[i, width - r.numel():] = 1
    return ids, mask


def greedy(target, ids, mask=None, **kwargs) -> torch.Tensor:
    return target.generate(ids, attention_mask=mask, do_sample=False, **kwargs)


def oracle_proposals(monkeypatch, continuations: list[torch.Tensor], wrong=lambda row, anchor, slot: False):
    """Make `draft_block` propose the target's own greedy tokens (row ``r``: ``continuations[r]``, prompt + output,
    no padding), replaced by a wrong token where ``wrong(row, anchor, slot)``; returns the list of calls."""
    calls = []

    def propose(drafter, features, tokens, anchors):
        calls.append((features.clone(), tokens.clone(), anchors.clone()))
        out = torch.zeros(tokens.shape[0], BLOCK - 1, dtype=torch.long)
        for r, a in enumerate(anchors.tolist()):
            for k in range(1, BLOCK):
                truth = continuations[r][a + k] if a + k < continuations[r].numel() else 0
                out[r, k - 1] = (truth + 1) % VOCAB if wrong(r, a, k) else truth
        return out

    monkeypatch.setattr(speculative, "draft_block", propose)
    return calls


def spy_generator(monkeypatch) -> dict:
    """Keep the `DFlashCandidateGenerator` that the next `generate` call builds (under ``["it"]``)."""
    seen = {}
    original = DFlashCandidateGenerator.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        seen["it"] = self

    monkeypatch.setattr(DFlashCandidateGenerator, "__init__", init)
    return seen


def count_forwards(model) -> list[int]:
    counter = [0]
    model.register_forward_pre_hook(lambda module, args: counter.__setitem__(0, counter[0] + 1))
    return counter


# --- token for token the target's greedy decoding -------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_speculative_generate_alone_equals_greedy_generate(family):
    target = tiny_target(family)
    drafter = tiny_drafter(target)
    ids = prompts()[1][None]
    sequences, stats = speculative_generate(target, drafter, ids, max_new_tokens=13)
    assert torch.equal(sequences, greedy(target, ids, max_new_tokens=13))
    assert 1.0 <= stats.mean_acceptance_length <= BLOCK
    # The prefill yields 1 token, each verification its acceptance length (the last one possibly cut by the budget).
    steps = stats.target_forwards - 1
    assert 12 <= stats.mean_acceptance_length * steps < 12 + BLOCK
    assert stats.generated_tokens == 13 and 1 <= stats.draft_forwards <= steps and stats.wall_time_s > 0


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_generate_with_custom_generate_equals_greedy_generate(family):
    target = tiny_target(family)
    drafter = tiny_drafter(target)
    ids = prompts()[2][None]
    out = target.generate(ids, custom_generate=dflash_assisted_decoding, drafter=drafter, max_new_tokens=13)
    assert torch.equal(out, greedy(target, ids, max_new_tokens=13))


def test_candidate_generator_keeps_the_features_of_a_full_target_forward(monkeypatch):
    """Through generate, the features the drafter reads (prefill + the accepted slots of each verification) are
    those of one plain forward over the committed tokens."""
    target = tiny_target()
    drafter = tiny_drafter(target)
    ids = prompts()[2][None]
    reference = greedy(target, ids, max_new_tokens=30)
    oracle_proposals(monkeypatch, [reference[0]], wrong=lambda r, a, k: (a + k) % 3 == 0)
    generator = spy_generator(monkeypatch)
    out = target.generate(ids, custom_generate=dflash_assisted_decoding, drafter=drafter, max_new_tokens=14)
    assert torch.equal(out, reference[:, :ids.shape[1] + 14])
    assert 1 < max(generator["it"].acceptance_lengths) < BLOCK + 1
    collected = generator["it"].features
    full = target(out[:, :collected.shape[1]], output_hidden_states=True).hidden_states
    assert collected.shape[1] >= ids.shape[1] + 8
    worst = (collected - target_features(full, drafter.config.target_layer_ids)).abs().max().item()
    print(f"max abs feature difference (generate): {worst:.3e}")
    assert worst < 1e-10, worst


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_ragged_batch_equals_greedy_generate_batched_and_alone(family):
    target = tiny_target(family)
    drafter = tiny_drafter(target, dflash2=family == "llama")
    rows = prompts()
    ids, mask = left_pad(rows)
    sequences, stats = speculative_generate(target, drafter, ids, mask, max_new_tokens=11)
    assert torch.equal(sequences, greedy(target, ids, mask, max_new_tokens=11))
    for r, row in enumerate(rows):
        assert torch.equal(sequences[r, ids.shape[1]:], greedy(target, row[None], max_new_tokens=11)[0, row.numel():])
    assert 1.0 <= stats.mean_acceptance_length <= BLOCK


def test_rows_accepting_different_lengths_stay_exact(monkeypatch):
    """Rows keep 1..B tokens per step, differently (holes in the shared cache): still the target's tokens."""
    target = tiny_target()
    rows = prompts()
    ids, mask = left_pad(rows)
    reference = greedy(target, ids, mask, max_new_tokens=30)
    continuations = [torch.cat([row, reference[r, ids.shape[1]:]]) for r, row in enumerate(rows)]
    # Row r's proposal at slot k is wrong when (anchor + k) % (r + 2) == 0: rows accept at different rates.
    calls = oracle_proposals(monkeypatch, continuations, wrong=lambda r, a, k: (a + k) % (r + 2) == 0)
    sequences, stats = speculative_generate(target, tiny_drafter(target), ids, mask, max_new_tokens=22)
    assert torch.equal(sequences, reference[:, :ids.shape[1] + 22])
    assert 1.0 < stats.mean_acceptance_length < BLOCK
    assert stats.draft_forwards == len(calls)


def test_drafter_reads_the_features_of_a_full_target_forward(monkeypatch):
    """The features the loop collects from prefill and verification forwards (with cache holes) are those of one
    plain forward over each row's committed tokens, and a block sees no feature at or after its anchor."""
    target = tiny_target()
    rows = prompts()
    ids, mask = left_pad(rows)
    reference = greedy(target, ids, mask, max_new_tokens=30)
    continuations = [torch.cat([row, reference[r, ids.shape[1]:]]) for r, row in enumerate(rows)]
    calls = oracle_proposals(monkeypatch, continuations, wrong=lambda r, a, k: (a + k) % (r + 2) == 0)
    drafter = tiny_drafter(target)
    speculative_generate(target, drafter, ids, mask, max_new_tokens=16)
    worst = 0.0
    for features, tokens, anchors in calls[-3:]:
        for r, a in enumerate(anchors.tolist()):
            assert torch.equal(tokens[r, :a + 1], continuations[r][:a + 1])
            full = target(continuations[r][None, :a], output_hidden_states=True).hidden_states
            expected = target_features(full, drafter.config.target_layer_ids)[0]
            worst = max(worst, (features[r, :a] - expected).abs().max().item())
    print(f"max abs feature difference (batched loop): {worst:.3e}")
    assert worst < 1e-10, worst


@pytest.mark.parametrize("entry", ["ours", "transformers"])
def test_eos_in_range_stops_like_generate(entry):
    target = tiny_target()
    drafter = tiny_drafter(target)
    rows = prompts()
    free = greedy(target, rows[0][None], max_new_tokens=12)[0, rows[0].numel():]
    eos = int(free[5])  # the first row meets it at its 6th new token at the latest
    if entry == "transformers":
        ids, mask = rows[0][None], None
        out = target.generate(ids, custom_generate=dflash_assisted_decoding, drafter=drafter, max_new_tokens=12,
                              eos_token_id=eos)
    else:
        ids, mask = left_pad(rows)
        out, _ = speculative_generate(target, drafter, ids, mask, max_new_tokens=12, eos_token_id=eos, pad_token_id=0)
    expected = greedy(target, ids, mask, max_new_tokens=12, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out, expected)
    assert int((expected[0, ids.shape[1]:] == eos).nonzero()[0, 0]) <= 5  # EOS came well inside the budget of 12


def test_eos_inside_an_accepted_block_ends_the_row_there(monkeypatch):
    target = tiny_target()
    rows = prompts()
    ids, mask = left_pad(rows)
    free = greedy(target, ids, mask, max_new_tokens=20)
    continuations = [torch.cat([row, free[r, ids.shape[1]:]]) for r, row in enumerate(rows)]
    oracle_proposals(monkeypatch, continuations)  # every proposal right: EOS arrives mid-block
    eos = int(free[1, ids.shape[1] + 6])
    out, _ = speculative_generate(target, tiny_drafter(target), ids, mask, max_new_tokens=20, eos_token_id=eos,
                                  pad_token_id=0)
    assert torch.equal(out, greedy(target, ids, mask, max_new_tokens=20, eos_token_id=eos, pad_token_id=0))


def test_row_ending_at_its_first_token_and_a_one_token_budget():
    target = tiny_target()
    drafter = tiny_drafter(target)
    rows = prompts()
    ids, mask = left_pad(rows)
    eos = int(greedy(target, ids, mask, max_new_tokens=1)[1, -1])  # the second row's first new token
    out, stats = speculative_generate(target, drafter, ids, mask, max_new_tokens=9, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out, greedy(target, ids, mask, max_new_tokens=9, eos_token_id=eos, pad_token_id=0))
    assert out[1, ids.shape[1]] == eos and (out[1, ids.shape[1] + 1:] == 0).all()
    out, stats = speculative_generate(target, drafter, ids, mask, max_new_tokens=1)
    assert torch.equal(out, greedy(target, ids, mask, max_new_tokens=1))
    assert (stats.target_forwards, stats.draft_forwards, stats.mean_acceptance_length) == (1, 0, 0.0)


def test_generate_default_eos_is_the_targets_own():
    target = tiny_target()
    rows = prompts()
    free = greedy(target, rows[1][None], max_new_tokens=10)[0, rows[1].numel():]
    target.generation_config.eos_token_id = int(free[3])
    target.generation_config.pad_token_id = 0
    ids, mask = left_pad(rows)
    out, _ = speculative_generate(target, tiny_drafter(target), ids, mask, max_new_tokens=10)
    assert torch.equal(out, greedy(target, ids, mask, max_new_tokens=10))


# --- acceptance ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", ["ours", "transformers"])
def test_perfect_drafter_accepts_whole_blocks(monkeypatch, entry):
    """With the target's own continuation as proposals, each verification keeps B tokens: 1 + ceil((N - 1) / B)
    target forwards for N tokens (the prefill yields the first)."""
    target = tiny_target()
    drafter = tiny_drafter(target)
    ids = prompts()[1][None]
    n = 1 + 3 * BLOCK
    reference = greedy(target, ids, max_new_tokens=n + BLOCK)
    calls = oracle_proposals(monkeypatch, [reference[0]])
    forwards = count_forwards(target)
    if entry == "transformers":
        generator = spy_generator(monkeypatch)
        out = target.generate(ids, custom_generate=dflash_assisted_decoding, drafter=drafter, max_new_tokens=n)
        assert generator["it"].acceptance_lengths == [BLOCK] * 3
    else:
        out, stats = speculative_generate(target, drafter, ids, max_new_tokens=n)
        assert stats.mean_acceptance_length == BLOCK
        assert stats.target_forwards == 1 + math.ceil((n - 1) / BLOCK) == 4
        assert stats.draft_forwards == 3
    assert torch.equal(out, reference[:, :ids.shape[1] + n])
    assert forwards[0] == 1 + math.ceil((n - 1) / BLOCK)
    assert len(calls) == 3


def test_budget_caps_the_last_block(monkeypatch):
    """max_new_tokens not a whole number of blocks: the last verification drafts only what the budget needs."""
    target = tiny_target()
    ids = prompts()[1][None]
    n = 1 + BLOCK + 2
    reference = greedy(target, ids, max_new_tokens=n + BLOCK)
    oracle_proposals(monkeypatch, [reference[0]])
    out, stats = speculative_generate(target, tiny_drafter(target), ids, max_new_tokens=n)
    assert torch.equal(out, reference[:, :ids.shape[1] + n])
    assert stats.target_forwards == 3 and stats.generated_tokens == n
    assert stats.mean_acceptance_length == (BLOCK + 2) / 2


def test_sampling_through_generate_with_top_k_1_is_greedy():
    """do_sample=True runs through transformers' verification by sampling; top_k=1 makes its samples greedy."""
    target = tiny_target()
    ids = prompts()[0][None]
    torch.manual_seed(3)
    out = target.generate(ids, custom_generate=dflash_assisted_decoding, drafter=tiny_drafter(target),
                          max_new_tokens=9, do_sample=True, top_k=1)
    assert torch.equal(out, greedy(target, ids, max_new_tokens=9))


# --- the DFlash2 candidate selector ---------------------------------------------------------------------------------


def test_selector_greedy_path_equals_the_reference():
    """draft_block's DFlash2 path picks the tokens the reference CandidateSelector.greedy_path picks."""
    from dllm_parallel.core.models.backbones.dflash.dflash2 import CandidateSelector

    target = tiny_target()
    drafter = tiny_drafter(target)
    ours = drafter.candidate_selector
    torch.manual_seed(4)
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0, 1.0)
    reference = CandidateSelector(hidden_size=drafter.config.hidden_size, vocab_size=VOCAB,
                                  state_rank=ours.predecessor_codebook.shape[1], top_k=ours.top_k,
                                  initializer_range=0.02).double()
    reference.load_state_dict(ours.state_dict())
    rows = prompts()
    ids, mask = left_pad(rows)
    full = target(ids, attention_mask=mask, output_hidden_states=True).hidden_states
    features = target_features(full, drafter.config.target_layer_ids)
    anchors = torch.full((ids.shape[0],), ids.shape[1] - 1)
    picked = draft_block(drafter, features[:, :-1], ids, anchors)
    out = drafter(target_hidden_states=features[:, :-1], input_ids=ids, anchor_positions=anchors[:, None])
    logits, hidden = out.logits[:, 1:], out.hidden_states[:, 1:]
    top = logits.topk(ours.top_k, dim=-1)
    expected = reference.greedy_path(candidate_ids=top.indices, unary_logits=top.values, hidden_states=hidden,
                                     anchor_token_ids=ids[:, -1])
    assert torch.equal(picked, expected)
    assert not torch.equal(picked, logits.argmax(-1))  # the selector changed some pick: the test can tell


def test_dflash_drafter_without_selector_proposes_argmax():
    target = tiny_target()
    drafter = tiny_drafter(target, dflash2=False)
    ids = prompts()[2][None]
    full = target(ids, output_hidden_states=True).hidden_states
    features = target_features(full, drafter.config.target_layer_ids)
    anchors = torch.tensor([ids.shape[1] - 1])
    out = drafter(target_hidden_states=features[:, :-1], input_ids=ids, anchor_positions=anchors[:, None])
    assert torch.equal(draft_block(drafter, features[:, :-1], ids, anchors), out.logits[:, 1:].argmax(-1))


# --- clear errors ----------------------------------------------------------------------------------------------------


def test_drafter_layer_ids_beyond_target_depth_are_refused():
    deep = tiny_target(layers=6)
    drafter = tiny_drafter(deep, target_layer_ids=(2, 6))
    shallow = tiny_target(layers=3)
    ids = prompts()[0][None]
    with pytest.raises(ValueError, match=r"target_layer_ids \[2, 6\] include \[6\].*0\.\.3"):
        speculative_generate(shallow, drafter, ids, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"include \[6\]"):
        shallow.generate(ids, custom_generate=dflash_assisted_decoding, drafter=drafter, max_new_tokens=4)


def test_drafter_built_for_another_depth_is_refused():
    drafter = tiny_drafter(tiny_target(layers=6), target_layer_ids=(2, 3))
    with pytest.raises(ValueError, match="built for a target with 6 decoder layers; this target has 3"):
        speculative_generate(tiny_target(layers=3), drafter, prompts()[0][None], max_new_tokens=4)


def test_vocabulary_mismatch_is_refused():
    drafter = tiny_drafter(tiny_target(vocab=VOCAB))
    other = tiny_target(vocab=80)
    with pytest.raises(ValueError, match="drafter vocab_size 64 != target vocab_size 80"):
        speculative_generate(other, drafter, prompts()[0][None], max_new_tokens=4)


def test_bad_inputs_are_refused():
    target = tiny_target()
    drafter = tiny_drafter(target)
    ids, mask = left_pad(prompts())
    with pytest.raises(ValueError, match="not left padded"):
        speculative_generate(target, drafter, ids, mask.flip(1), max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1, got 0"):
        speculative_generate(target, drafter, ids, mask, max_new_tokens=0)
    with pytest.raises(ValueError, match="batch of 3.*speculative_generate"):
        target.generate(ids, attention_mask=mask, custom_generate=dflash_assisted_decoding, drafter=drafter,
                        max_new_tokens=4)
    with pytest.raises(ValueError, match="drafter=drafter"):
        target.generate(ids[:1], custom_generate=dflash_assisted_decoding, max_new_tokens=4)


def test_sliding_window_target_is_refused_by_the_batched_loop():
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, intermediate_size=64, use_sliding_window=True,
                         sliding_window=4, max_window_layers=0, **NO_SPECIAL)
    target = Qwen3ForCausalLM(config).double().eval()
    with pytest.raises(ValueError, match="sliding-window attention"):
        speculative_generate(target, tiny_drafter(target), prompts()[0][None], max_new_tokens=4)
