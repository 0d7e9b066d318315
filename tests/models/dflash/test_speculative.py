"""Speculative decoding with a DFlash drafter is lossless: both entry points return the target's greedy decoding; the
drafter's context cache drafts what the whole context drafts.

Tiny random float64 targets (Llama, Qwen3) so that tokens compare exactly across code paths, and a random-init
drafter from `from_target`. A random drafter is almost never right, so the tests that need accepted drafts (ragged
acceptance across rows, full blocks) replace its proposals by the target's own greedy continuation, corrupted at
chosen slots or not at all. Run:
python -m pytest tests/models/dflash/test_speculative.py -q
"""

import functools
import math

import fixtures
import pytest
import torch

from hf_bdlm.models.dflash.inference import speculative
from hf_bdlm.models.dflash.modeling import DFlash2DraftModel, DFlashContextCache, DFlashDraftModel
from hf_bdlm.models.dflash.inference.speculative import (
    DFlashCandidateGenerator,
    SpeculativeSession,
    dflash_assisted_decoding,
    draft_block,
    draft_from_cache,
    speculative_generate,
    target_features,
)

VOCAB, MASK, BLOCK = 64, 63, 4
NO_SPECIAL = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
PROMPT_LENGTHS = (2, 5, 7)


# Float64 targets without special tokens (a random model would stop at random places), a 1-layer drafter in eval mode.
tiny_target = functools.partial(fixtures.tiny_target, dtype=torch.float64, **NO_SPECIAL)
tiny_drafter = functools.partial(fixtures.tiny_drafter, training=False, num_hidden_layers=1, block_size=BLOCK,
                                 mask_token_id=MASK)


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
    """Make the loops' drafting (`draft_from_cache`) propose the target's own greedy tokens (row ``r``:
    ``continuations[r]``, prompt + output, no padding), replaced by a wrong token where ``wrong(row, anchor, slot)``;
    returns the list of calls, ``(anchors, anchor_token_ids)`` (a row's anchor is its cached context's length)."""
    calls = []

    def propose(drafter, context_cache, anchor_token_ids, count=None):
        anchors = context_cache.lengths.clone()
        calls.append((anchors, anchor_token_ids.clone()))
        out = torch.zeros(anchors.shape[0], BLOCK - 1, dtype=torch.long)
        for r, a in enumerate(anchors.tolist()):
            for k in range(1, BLOCK):
                truth = continuations[r][a + k] if a + k < continuations[r].numel() else 0
                out[r, k - 1] = (truth + 1) % VOCAB if wrong(r, a, k) else truth
        return out[:, :BLOCK - 1 if count is None else count]

    monkeypatch.setattr(speculative, "draft_from_cache", propose)
    return calls


def record_appends(monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Record every `DFlashContextCache.append`: ``(lengths before, features, counts)``."""
    appends = []
    original = DFlashContextCache.append

    def append(self, features, counts=None):
        n = torch.full_like(self.lengths, features.shape[1]) if counts is None else counts.clone()
        appends.append((self.lengths.clone(), features.clone(), n))
        return original(self, features, counts)

    monkeypatch.setattr(DFlashContextCache, "append", append)
    return appends


def appended_rows(appends, row: int) -> torch.Tensor:
    """Row ``row``'s context features in the order they were appended (each append continues where it stood)."""
    parts = []
    for lengths, features, counts in appends:
        assert int(lengths[row]) == sum(p.shape[0] for p in parts)
        parts.append(features[row, :int(counts[row])])
    return torch.cat(parts)


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
    # The prefill yields 1 token, each verification the tokens it commits (its acceptance length).
    steps = stats.target_forwards - 1
    assert stats.mean_acceptance_length * steps == pytest.approx(12)
    assert stats.generated_tokens == 13 and 1 <= stats.draft_forwards <= steps and stats.wall_time_s > 0


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_generate_with_custom_generate_equals_greedy_generate(family):
    target = tiny_target(family)
    drafter = tiny_drafter(target)
    ids = prompts()[2][None]
    out = target.generate(ids, custom_generate=dflash_assisted_decoding, drafter=drafter, max_new_tokens=13)
    assert torch.equal(out, greedy(target, ids, max_new_tokens=13))


def test_candidate_generator_keeps_the_features_of_a_full_target_forward(monkeypatch):
    """Through generate, the features appended to the drafter's context cache (prefill + the accepted slots of each
    verification) are those of one plain forward over the committed tokens, and each block drafts right after them."""
    target = tiny_target()
    drafter = tiny_drafter(target)
    ids = prompts()[2][None]
    reference = greedy(target, ids, max_new_tokens=30)
    calls = oracle_proposals(monkeypatch, [reference[0]], wrong=lambda r, a, k: (a + k) % 3 == 0)
    appends = record_appends(monkeypatch)
    generator = spy_generator(monkeypatch)
    out = target.generate(ids, custom_generate=dflash_assisted_decoding, drafter=drafter, max_new_tokens=14)
    assert torch.equal(out, reference[:, :ids.shape[1] + 14])
    assert 1 < max(generator["it"].acceptance_lengths) < BLOCK + 1
    collected = appended_rows(appends, 0)
    assert int(generator["it"].context_cache.lengths[0]) == collected.shape[0] >= ids.shape[1] + 8
    for anchors, anchor_tokens in calls:  # the anchor is the token right after the cached context
        assert torch.equal(anchor_tokens, out[:, int(anchors[0])])
    full = target(out[:, :collected.shape[0]], output_hidden_states=True).hidden_states
    worst = (collected - target_features(full, drafter.config.target_layer_ids)[0]).abs().max().item()
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
    """The features the loop appends to the drafter's context cache from prefill and verification forwards (with
    cache holes) are those of one plain forward over each row's committed tokens, and a block's context is exactly
    the tokens before its anchor."""
    target = tiny_target()
    rows = prompts()
    ids, mask = left_pad(rows)
    reference = greedy(target, ids, mask, max_new_tokens=30)
    continuations = [torch.cat([row, reference[r, ids.shape[1]:]]) for r, row in enumerate(rows)]
    calls = oracle_proposals(monkeypatch, continuations, wrong=lambda r, a, k: (a + k) % (r + 2) == 0)
    appends = record_appends(monkeypatch)
    drafter = tiny_drafter(target)
    speculative_generate(target, drafter, ids, mask, max_new_tokens=16)
    worst = 0.0
    for r in range(len(rows)):
        for anchors, anchor_tokens in calls:
            assert int(anchor_tokens[r]) == int(continuations[r][int(anchors[r])])
        collected = appended_rows(appends, r)
        assert collected.shape[0] >= int(calls[-1][0][r]) > rows[r].numel()
        full = target(continuations[r][None, :collected.shape[0]], output_hidden_states=True).hidden_states
        expected = target_features(full, drafter.config.target_layer_ids)[0]
        worst = max(worst, (collected - expected).abs().max().item())
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


def test_acceptance_counts_only_the_tokens_a_row_returns(monkeypatch):
    """A perfect drafter's block that crosses the row's EOS counts the tokens up to the EOS, not the whole block (the
    server's and the trainer's eval's rule, `AcceptanceCounts`)."""
    target = tiny_target()
    ids = prompts()[1][None]
    free = greedy(target, ids, max_new_tokens=1 + 2 * BLOCK)[0, ids.shape[1]:].tolist()
    # EOS: a token first written among the second verification's proposals (generated positions B + 1 .. 2B - 1; the
    # prefill wrote position 0, the first verification 1 .. B), so that a block of B is cut to position - B tokens.
    position = next(p for p in range(BLOCK + 1, 2 * BLOCK) if free[p] not in free[:p])
    oracle_proposals(monkeypatch, [torch.cat([ids[0], torch.tensor(free)])])
    out, stats = speculative_generate(target, tiny_drafter(target), ids, max_new_tokens=1 + 2 * BLOCK,
                                      eos_token_id=free[position], pad_token_id=0)
    assert out[0, ids.shape[1]:].tolist() == free[:position + 1]
    # The prefill's token, a whole block (B), then the block cut after its EOS (position - B): position tokens in 2.
    assert stats.target_forwards == 3 and stats.mean_acceptance_length == position / 2


@pytest.mark.parametrize("count", [1, 2])
@pytest.mark.parametrize("entry", ["ours", "transformers"])
def test_fewer_proposals_per_step_verify_only_those(monkeypatch, entry, count):
    """num_speculative_tokens = k < B - 1: each target forward runs the anchor and k proposals, so a perfect drafter
    yields k + 1 tokens per forward; the output is still the target's greedy decoding (a ragged batch for ours)."""
    target = tiny_target()
    n = 1 + 3 * (count + 1)
    verified = []
    target.register_forward_pre_hook(lambda module, args, kwargs: verified.append(kwargs["input_ids"].shape[1]),
                                     with_kwargs=True)
    if entry == "transformers":
        ids = prompts()[1][None]
        reference = greedy(target, ids, max_new_tokens=n + BLOCK)
        oracle_proposals(monkeypatch, [reference[0]])
        generator = spy_generator(monkeypatch)
        verified.clear()
        out = target.generate(ids, custom_generate=dflash_assisted_decoding, drafter=tiny_drafter(target),
                              num_speculative_tokens=count, max_new_tokens=n)
        assert generator["it"].acceptance_lengths == [count + 1] * 3
        assert torch.equal(out, reference[:, :ids.shape[1] + n])
    else:
        ids, mask = left_pad(prompts())
        reference = greedy(target, ids, mask, max_new_tokens=n + BLOCK)
        continuations = [torch.cat([row, reference[r, ids.shape[1]:]]) for r, row in enumerate(prompts())]
        oracle_proposals(monkeypatch, continuations)
        verified.clear()
        out, stats = speculative_generate(target, tiny_drafter(target), ids, mask, max_new_tokens=n,
                                          num_speculative_tokens=count)
        assert stats.mean_acceptance_length == count + 1
        assert stats.target_forwards == 4 and stats.draft_forwards == 3
        assert torch.equal(out, reference[:, :ids.shape[1] + n])
    assert verified[1:] == [count + 1] * 3  # after the prefill, every verification runs k + 1 tokens


def test_fewer_proposals_are_the_first_of_the_whole_blocks_proposals():
    """The candidate selector picks each position given the ones before it, so the first k proposals do not
    depend on k."""
    target = tiny_target()
    drafter = random_drafter(target)
    tokens, features = sequence_features(target, drafter)
    anchors = torch.tensor([5, 9, 12])
    cache = DFlashContextCache(drafter, 3)
    cache.append(features[:, :12], counts=anchors)
    whole = draft_from_cache(drafter, cache, tokens[torch.arange(3), anchors])
    assert whole.shape == (3, BLOCK - 1)
    for count in range(1, BLOCK - 1):
        assert torch.equal(draft_from_cache(drafter, cache, tokens[torch.arange(3), anchors], count),
                           whole[:, :count])


def test_a_bad_number_of_speculative_tokens_is_refused():
    target = tiny_target()
    drafter = tiny_drafter(target)
    ids = prompts()[0][None]
    for bad in (0, BLOCK, -1, True, 1.5):
        with pytest.raises(ValueError, match=rf"num_speculative_tokens must be an integer in \[1, {BLOCK - 1}\].*"
                                             rf"got {bad!r}"):
            speculative_generate(target, drafter, ids, max_new_tokens=4, num_speculative_tokens=bad)
    with pytest.raises(ValueError, match=rf"in \[1, {BLOCK - 1}\].*got {BLOCK}"):
        target.generate(ids, custom_generate=dflash_assisted_decoding, drafter=drafter, num_speculative_tokens=BLOCK,
                        max_new_tokens=4)


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


# --- the drafter's context cache ------------------------------------------------------------------------------------

CACHE_CASES = {
    "dflash2_full": dict(dflash2=True),
    "dflash2_sliding": dict(dflash2=True, layer_types=["sliding_attention"] * 2, sliding_window=3),
    "dflash_full": dict(dflash2=False),
    "dflash_sliding_and_full": dict(dflash2=False, layer_types=["sliding_attention", "full_attention"],
                                    sliding_window=3),
}


def random_drafter(target, dflash2: bool = True, **kwargs):
    """A 2-layer drafter whose every parameter is random (convolutions and selector included: nothing is identity)."""
    torch.manual_seed(1)
    cls = DFlash2DraftModel if dflash2 else DFlashDraftModel
    model = cls.from_target(target, init="scratch", num_hidden_layers=2, target_layer_ids=(1, 3), block_size=BLOCK,
                            mask_token_id=MASK, **kwargs).double().eval()
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
            p.copy_(1.0 + 0.2 * noise if name.endswith("norm.weight") else 0.3 * noise)
    return model


def sequence_features(target, drafter, batch: int = 3, length: int = 26, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, MASK, (batch, length), generator=g)
    hidden = target(tokens, output_hidden_states=True).hidden_states
    return tokens, target_features(hidden, drafter.config.target_layer_ids)


@pytest.mark.parametrize("case", list(CACHE_CASES))
@torch.no_grad()
def test_drafting_from_the_cache_equals_drafting_from_the_whole_context(case):
    """A ragged batch whose rows commit 0 to B context rows per step (as the batched loop appends them): at every
    step, drafting from the cache proposes what `draft_block` proposes from all the features, with the same states
    (full layers, sliding layers whose window of 3 is much shorter than the context, DFlash and DFlash2)."""
    target = tiny_target()
    drafter = random_drafter(target, **CACHE_CASES[case])
    tokens, features = sequence_features(target, drafter)
    batch = tokens.shape[0]
    rows = torch.arange(batch)
    cache = DFlashContextCache(drafter, batch, capacity=4)  # smaller than the context: the buffers grow
    lengths = torch.zeros(batch, dtype=torch.long)
    worst = 0.0
    for counts in ([2, 5, 7], [4, 1, 0], [0, 3, 4], [3, 4, 1], [4, 2, 3], [1, 4, 4]):
        counts = torch.tensor(counts)
        columns = lengths[:, None] + torch.arange(int(counts.max()))
        cache.append(features.gather(1, columns[..., None].expand(-1, -1, features.shape[-1])), counts=counts)
        lengths = lengths + counts
        assert torch.equal(cache.lengths, lengths)
        anchor_tokens = tokens[rows, lengths]
        proposals = draft_from_cache(drafter, cache, anchor_tokens)
        assert torch.equal(proposals, draft_block(drafter, features, tokens, lengths))
        cached = drafter.draft_from_cache(cache, anchor_tokens)
        full = drafter(features, tokens, lengths[:, None])
        worst = max(worst, (cached.hidden_states - full.hidden_states[:, 1:]).abs().max().item(),
                    (cached.logits - full.logits[:, 1:]).abs().max().item())
    assert int(lengths.min()) > 6  # a sliding ring (window - 1 + B = 6 rows) has wrapped in every row
    print(f"max abs difference, cache vs whole context ({case}): {worst:.3e}")
    assert worst < 1e-12, worst


@pytest.mark.parametrize("dflash2", [True, False])
def test_the_batched_loop_drafts_what_the_whole_context_drafts(monkeypatch, dflash2):
    """Inside `speculative_generate` on a left-padded batch, every draft from the cache equals `draft_block` over
    the features appended so far, and the output is still the target's greedy decoding."""
    target = tiny_target()
    drafter = random_drafter(target, dflash2, layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    appends = record_appends(monkeypatch)
    checked = []

    def checked_draft(drafter, context_cache, anchor_token_ids, count=None):
        proposals = draft_from_cache(drafter, context_cache, anchor_token_ids, count)
        anchors = context_cache.lengths
        features = torch.zeros(anchors.shape[0], int(anchors.max()), drafter.config.feature_width,
                               dtype=torch.float64)
        tokens = torch.zeros(anchors.shape[0], int(anchors.max()) + 1, dtype=torch.long)
        for r in range(anchors.shape[0]):
            context = appended_rows(appends, r)
            features[r, :context.shape[0]] = context
            tokens[r, int(anchors[r])] = anchor_token_ids[r]
        assert torch.equal(proposals, draft_block(drafter, features, tokens, anchors)[:, :proposals.shape[1]])
        checked.append(anchors.clone())
        return proposals

    monkeypatch.setattr(speculative, "draft_from_cache", checked_draft)
    ids, mask = left_pad(prompts())
    sequences, stats = speculative_generate(target, drafter, ids, mask, max_new_tokens=10)
    assert torch.equal(sequences, greedy(target, ids, mask, max_new_tokens=10))
    assert len(checked) == stats.draft_forwards >= 3 and int(checked[-1].min()) > 6


def test_a_draft_step_projects_only_the_newly_committed_rows():
    """`fc` (and with it every layer's context K/V) runs once per appended row; drafting from the cache runs none."""
    target = tiny_target()
    drafter = random_drafter(target)
    tokens, features = sequence_features(target, drafter)
    projected = []
    drafter.fc.register_forward_hook(lambda module, args, out: projected.append(args[0].shape[:-1].numel()))
    cache = DFlashContextCache(drafter, tokens.shape[0])
    cache.append(features[:, :9])
    assert projected == [3 * 9]
    for step in range(3):
        draft_from_cache(drafter, cache, tokens[:, 9 + 2 * step])
        assert len(projected) == 1 + step
        cache.append(features[:, 9 + 2 * step:11 + 2 * step])
        assert projected[-1] == 3 * 2


def test_the_head_reads_out_only_the_drafted_rows(monkeypatch):
    """The target's LM head runs over the B - 1 drafted rows of a block, never over the anchor's row."""
    target = tiny_target()
    drafter = random_drafter(target)
    tokens, features = sequence_features(target, drafter)
    rows = []
    original = drafter.compute_logits
    monkeypatch.setattr(drafter, "compute_logits", lambda hidden: rows.append(hidden.shape[1]) or original(hidden))
    anchors = torch.tensor([5, 9, 12])
    draft_block(drafter, features, tokens, anchors)
    cache = DFlashContextCache(drafter, 3)
    cache.append(features[:, :12], counts=anchors)
    out = drafter.draft_from_cache(cache, tokens[torch.arange(3), anchors])
    draft_from_cache(drafter, cache, tokens[torch.arange(3), anchors])
    assert rows == [BLOCK - 1] * 3
    draft_from_cache(drafter, cache, tokens[torch.arange(3), anchors], 1)  # fewer proposals: fewer head rows
    assert rows[-1] == 1
    assert out.logits.shape == (3, BLOCK - 1, VOCAB) and out.hidden_states.shape[1] == BLOCK - 1


def test_the_session_passes_the_target_views_of_one_mask_buffer(monkeypatch):
    """Each verification's attention mask is a view of one preallocated buffer (no concatenation per step), and the
    buffer's columns say which cache slots each row kept."""
    target = tiny_target()
    ids, mask = left_pad(prompts())
    reference = greedy(target, ids, mask, max_new_tokens=30)
    continuations = [torch.cat([row, reference[r, ids.shape[1]:]]) for r, row in enumerate(prompts())]
    oracle_proposals(monkeypatch, continuations, wrong=lambda r, a, k: (a + k) % (r + 2) == 0)
    session = SpeculativeSession(target, tiny_drafter(target), ids, mask, max_new_tokens=12)
    buffer = session.kv_mask
    while not session.done:
        session.step()
        assert session.kv_mask.data_ptr() == buffer.data_ptr()
    # Each row's real slots: its prompt, then one per committed token but the last (the last anchor never ran).
    real = session.kv_mask[:, :session.kv_used].sum(-1)
    assert torch.equal(real, mask.sum(-1) + session.generated - 1)
    assert torch.equal(session.result()[0], reference[:, :ids.shape[1] + 12])


# --- clear errors ----------------------------------------------------------------------------------------------------


def test_drafter_layer_ids_beyond_target_depth_are_refused():
    deep = tiny_target(num_hidden_layers=6)
    drafter = tiny_drafter(deep, target_layer_ids=(2, 6))
    shallow = tiny_target(num_hidden_layers=3)
    ids = prompts()[0][None]
    with pytest.raises(ValueError, match=r"target_layer_ids \[2, 6\] include \[6\].*0\.\.3"):
        speculative_generate(shallow, drafter, ids, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"include \[6\]"):
        shallow.generate(ids, custom_generate=dflash_assisted_decoding, drafter=drafter, max_new_tokens=4)


def test_drafter_built_for_another_depth_is_refused():
    drafter = tiny_drafter(tiny_target(num_hidden_layers=6), target_layer_ids=(2, 3))
    with pytest.raises(ValueError, match="built for a target with 6 decoder layers; this target has 3"):
        speculative_generate(tiny_target(num_hidden_layers=3), drafter, prompts()[0][None], max_new_tokens=4)


def test_vocabulary_mismatch_is_refused():
    drafter = tiny_drafter(tiny_target(vocab_size=VOCAB))
    other = tiny_target(vocab_size=80)
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
    target = tiny_target("qwen3", num_hidden_layers=2, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    with pytest.raises(ValueError, match="sliding-window attention"):
        speculative_generate(target, tiny_drafter(target), prompts()[0][None], max_new_tokens=4)
