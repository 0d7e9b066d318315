"""Specifications of the training objectives (hf_bdlm/objectives): noise, corruption, targets, loss.

Tiny Llama BDLM on CPU, a few seconds: ``python -m pytest tests/objectives/test_objectives.py -q``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from hf_bdlm import BlockDiffusionConfig, BlockDiffusionForMaskedLM
from hf_bdlm.attention.masks import CLEAN, NOISY
from hf_bdlm.attention.rows import vectorized_rows
from hf_bdlm.models.block_diffusion.training.objectives import (
    FastDLLMv2CausalCleanObjective,
    FastDLLMv2Objective,
    StandardObjective,
)
from hf_bdlm.objectives import get_objective, hash_uniform, supervised_mask, target_rows_in

B, MASK, VOCAB = 4, 63, 64
OBJECTIVES = ("standard", "fast_dllm_v2", "fast_dllm_v2_causal_clean")
SHIFTED = ("fast_dllm_v2", "fast_dllm_v2_causal_clean")


@pytest.fixture(autouse=True, scope="module")
def _few_threads():
    # Everything here is tiny: extra intra-op threads only add overhead.
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    backbone = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64,
    )
    return BlockDiffusionForMaskedLM(BlockDiffusionConfig(backbone_config=backbone, block_size=B, mask_token_id=MASK))


def _objective(name, **kwargs):
    return get_objective(name, dict(block_size=B, mask_token_id=MASK, **kwargs))


def _sft_batch(b=3, length=16, seed=0):
    """Rows with a prompt of 1 + row tokens (mid-block for some) and row*3 pad tokens at the end."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, MASK, (b, length), generator=g)
    completion = torch.zeros(b, length, dtype=torch.long)
    attention = torch.ones(b, length, dtype=torch.long)
    for r in range(b):
        end = length - 3 * r
        completion[r, 1 + r : end] = 1
        attention[r, end:] = 0
        ids[r, end:] = 0  # pad id
    return {"input_ids": ids, "completion_mask": completion, "attention_mask": attention,
            "sample_ids": torch.arange(100, 100 + b)}


def _target_set(c, views=1):
    """Targets keyed by (sample id, view, stream, row position) -> (token, weight)."""
    per_view = c.noisy_ids.shape[0] // views
    out = {}
    for s, st, p, tok, w in zip(c.target_sample.tolist(), c.target_stream.tolist(), c.target_row_pos.tolist(),
                                c.target_token.tolist(), c.target_weight.tolist()):
        out[(int(c.sample_ids[s]), s // per_view, st, p)] = (tok, w)
    return out


def _masked_ce(logits, tokens):
    logits = logits.clone()
    logits[..., MASK] = float("-inf")
    return F.cross_entropy(logits, tokens, reduction="none")


# --- noise -------------------------------------------------------------------------------------
def test_hash_uniform_of_a_slice_equals_the_slice_of_values():
    sample, pos = torch.arange(50)[:, None], torch.arange(300)[None, :]
    full = hash_uniform(7, 3, sample, pos, salt=11)
    assert full.dtype == torch.float64 and full.shape == (50, 300)
    assert torch.equal(hash_uniform(7, 3, sample[20:23], pos[:, 100:140], salt=11), full[20:23, 100:140])
    assert torch.equal(hash_uniform(7, 3, torch.tensor([42]), torch.tensor([5]), salt=11), full[42:43, 5])


def test_hash_uniform_is_roughly_uniform_and_depends_on_every_argument():
    u = hash_uniform(0, 0, torch.arange(400)[:, None], torch.arange(500)[None, :], salt=1).flatten()
    assert ((u >= 0) & (u < 1)).all()
    assert abs(u.mean().item() - 0.5) < 3e-3
    counts = torch.histc(u.float(), bins=20, min=0, max=1)
    expected = u.numel() / 20
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 50  # 19 degrees of freedom: P(chi2 > 50) < 1e-4
    base = hash_uniform(0, 0, torch.arange(8), torch.arange(8), salt=1)
    for args in ((1, 0, 1), (0, 1, 1), (0, 0, 2)):
        seed, step, salt = args
        assert not torch.equal(hash_uniform(seed, step, torch.arange(8), torch.arange(8), salt=salt), base)
    # Huge and negative inputs stay exact (no int64 overflow) and in range.
    big = hash_uniform(-3, 2**40, torch.tensor([2**62, -1]), torch.tensor([2**33, 0]), salt=2**70)
    assert ((big >= 0) & (big < 1)).all()


# --- masking rates -----------------------------------------------------------------------------
def test_masked_fraction_tracks_block_t():
    obj = StandardObjective(block_size=B, mask_token_id=MASK)
    ids = torch.zeros(4096, 64, dtype=torch.long)
    c = obj.corrupt({"input_ids": ids}, seed=1, step=5)
    t = c.block_t.flatten()
    frac = c.masked.reshape(4096, -1, B).double().mean(-1).flatten()
    edges = torch.linspace(0, 1, 11, dtype=torch.float64)
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = (t >= lo) & (t < hi)
        n = int(sel.sum())
        assert n > 1000
        mean_t = t[sel].mean().item()
        sigma = (mean_t * (1 - mean_t) / (B * n)) ** 0.5
        assert abs(frac[sel].mean().item() - mean_t) < 5 * sigma + 1e-9


def test_block_t_lies_in_eps_range():
    obj = StandardObjective(block_size=B, mask_token_id=MASK, noise_eps_min=0.3, noise_eps_max=0.6)
    c = obj.corrupt({"input_ids": torch.zeros(256, 64, dtype=torch.long)}, seed=0, step=0)
    assert c.block_t.min() >= 0.3 and c.block_t.max() <= 0.6
    assert c.block_t.max() - c.block_t.min() > 0.25  # and the whole range is used
    assert (c.target_weight <= 1 / 0.3 + 1e-5).all() and (c.target_weight >= 1 / 0.6 - 1e-5).all()


def test_block_t_is_stratified_over_each_sequence_blocks():
    lo, hi = 0.1, 0.9
    obj = StandardObjective(block_size=B, mask_token_id=MASK, noise_eps_min=lo, noise_eps_max=hi)
    attention = torch.ones(8, 64, dtype=torch.long)
    attention[1, 10:] = 0  # a sample of 10 tokens has 3 blocks: stratified over those 3
    c = obj.corrupt({"input_ids": torch.zeros(8, 64, dtype=torch.long), "attention_mask": attention},
                    seed=4, step=2)
    for row, n in [(0, 16), (1, 3), (5, 16)]:
        stratum = ((c.block_t[row, :n] - lo) / (hi - lo) * n).floor().long()
        assert torch.equal(stratum.sort().values, torch.arange(n)), (row, stratum)  # each stratum exactly once
        # Block j takes stratum (j + s) mod n, s drawn per sample; the position inside the stratum is free.
        assert torch.equal((stratum - torch.arange(n)) % n, torch.full((n,), int(stratum[0]))), (row, stratum)


def test_fast_dllm_v2_block_t_are_independent_draws():
    obj = _objective("fast_dllm_v2")
    attention = torch.ones(4, 64, dtype=torch.long)
    attention[1, 10:] = 0
    c = obj.corrupt({"input_ids": torch.ones(4, 64, dtype=torch.long), "attention_mask": attention}, seed=4, step=2)
    t = c.block_t[:4]
    expected = 1e-3 + (1 - 1e-3) * hash_uniform(4, 2, torch.arange(4)[:, None], torch.arange(16)[None, :],
                                                 salt=0x5EED_0001)
    assert torch.equal(t, expected)
    assert torch.equal(c.block_t[4:], t)  # both views share the rates


# --- corruption and targets --------------------------------------------------------------------
@pytest.mark.parametrize("name", OBJECTIVES)
def test_prompt_and_pad_tokens_are_never_corrupted_nor_supervised(name):
    batch = _sft_batch(b=4, length=32)
    obj = _objective(name, noise_eps_min=0.99, noise_eps_max=1.0)  # mask nearly everything allowed
    c = obj.corrupt(batch, seed=0, step=0)
    views = c.noisy_ids.shape[0] // 4
    supervised = supervised_mask(batch).repeat(views, 1)
    assert not (c.masked & ~supervised).any()
    assert torch.equal(c.noisy_ids[~c.masked], c.clean_ids[~c.masked])
    assert (c.noisy_ids[c.masked] == MASK).all()
    # Targets are exactly the masked tokens: (row, position) of the predicted token.
    shift = 1 if name in SHIFTED else 0
    target_pos = c.target_row_pos + shift
    assert supervised[c.target_sample, target_pos].all()
    assert torch.equal(c.masked.nonzero(), torch.stack([c.target_sample, target_pos], 1))
    assert c.normalizer == float(supervised_mask(batch).sum())  # position 0 is prompt here


def test_standard_targets_are_masked_tokens_at_their_own_noisy_row():
    c = _objective("standard").corrupt(_sft_batch(), seed=3, step=1)
    assert (c.target_stream == NOISY).all()
    assert torch.equal(c.target_token, c.clean_ids[c.target_sample, c.target_row_pos])
    assert c.normalizer == float(supervised_mask(_sft_batch()).sum())


def test_weights_are_inverse_t_or_unit():
    batch = _sft_batch()
    inv = _objective("standard", loss_weighting="inverse_t").corrupt(batch, seed=0, step=0)
    unit = _objective("standard", loss_weighting="unit").corrupt(batch, seed=0, step=0)
    assert torch.equal(inv.masked, unit.masked)
    t = inv.block_t[inv.target_sample, inv.target_row_pos // B]
    assert torch.equal(inv.target_weight, 1 / t)  # float64, exact
    assert (unit.target_weight == 1).all()
    fast = _objective("fast_dllm_v2").corrupt(batch, seed=0, step=0)
    assert (fast.target_weight == 1).all()
    with pytest.raises(ValueError, match="unit weights"):
        _objective("fast_dllm_v2", loss_weighting="inverse_t")


@pytest.mark.parametrize("name", SHIFTED)
def test_fast_dllm_v2_masks_every_supervised_token_in_exactly_one_view(name):
    batch = _sft_batch(b=5, length=32)
    batch["completion_mask"][0, 0] = 1  # position 0 is corrupted like any supervised token, never scored
    c = _objective(name).corrupt(batch, seed=2, step=7)
    assert c.noisy_ids.shape == (10, 32)
    view0, view1 = c.masked[:5], c.masked[5:]
    expected = supervised_mask(batch)
    assert not (view0 & view1).any()
    assert torch.equal(view0 | view1, expected)
    assert c.normalizer == float(expected[:, 1:].sum())  # position 0 has no predecessor
    assert not (c.target_row_pos == -1).any()
    assert torch.equal(c.clean_ids[:5], c.clean_ids[5:]) and torch.equal(c.sample_ids[:5], c.sample_ids[5:])


def test_fast_dllm_v2_shifts_targets_to_the_noisy_row_before_even_at_block_starts():
    c = _objective("fast_dllm_v2").corrupt(_sft_batch(b=4, length=32), seed=0, step=0)
    pos = c.target_row_pos + 1
    assert torch.equal(c.target_token, c.clean_ids[c.target_sample, pos])
    assert (pos % B == 0).any() and (pos % B != 0).any()
    assert (c.target_stream == NOISY).all()  # the reference's labels shifted by one over the noisy half
    assert (c.target_row_pos >= 0).all()


def test_causal_clean_variant_scores_block_starts_from_the_clean_row():
    c = _objective("fast_dllm_v2_causal_clean").corrupt(_sft_batch(b=4, length=32), seed=0, step=0)
    pos = c.target_row_pos + 1
    assert torch.equal(c.target_token, c.clean_ids[c.target_sample, pos])
    block_start = pos % B == 0
    assert block_start.any() and (~block_start).any()
    assert (c.target_stream[block_start] == CLEAN).all()
    assert (c.target_stream[~block_start] == NOISY).all()
    reference = _objective("fast_dllm_v2").corrupt(_sft_batch(b=4, length=32), seed=0, step=0)
    assert torch.equal(c.masked, reference.masked)  # the same noise: only the block-start rows differ


@pytest.mark.parametrize("name", SHIFTED)
def test_fast_dllm_v2_never_scores_a_document_first_token(name):
    ids = torch.randint(0, MASK, (1, 16))
    docs = torch.tensor([[0] * 8 + [1] * 8])
    c = _objective(name).corrupt({"input_ids": ids, "document_ids": docs}, seed=0, step=0)
    assert torch.equal(c.masked[:, [0, 8]].sum(0), torch.tensor([1, 1]))  # corrupted in exactly one view
    assert not ((c.target_row_pos + 1)[:, None] == torch.tensor([0, 8])).any()
    assert c.normalizer == 14.0 and c.num_targets == 14
    assert torch.equal(c.position_ids[0], torch.tensor(list(range(8)) * 2))


@pytest.mark.parametrize("name", OBJECTIVES)
def test_corruption_is_invariant_under_sub_batching_and_order(name):
    obj = _objective(name)
    batch = _sft_batch(b=6, length=24)
    full = obj.corrupt(batch, seed=9, step=4)
    rows = [4, 1, 3]
    sub = {k: v[rows] for k, v in batch.items()}
    part = obj.corrupt(sub, seed=9, step=4)
    views = full.noisy_ids.shape[0] // 6
    full_rows = [r + 6 * v for v in range(views) for r in rows]
    assert torch.equal(part.noisy_ids, full.noisy_ids[full_rows])
    assert torch.equal(part.masked, full.masked[full_rows])
    assert torch.equal(part.block_t, full.block_t[full_rows])
    mine = {k: v for k, v in _target_set(full, views).items() if k[0] in part.sample_ids.tolist()}
    assert _target_set(part, views) == mine
    assert not torch.equal(obj.corrupt(batch, seed=9, step=5).masked, full.masked)  # the step matters


def test_padding_to_a_longer_batch_does_not_change_a_sample_noise():
    obj = _objective("standard")
    short = _sft_batch(b=1, length=16)
    long = {k: (F.pad(v, (0, 16)) if v.dim() == 2 else v) for k, v in short.items()}  # 16 more pad tokens
    a, b = obj.corrupt(short, seed=0, step=0), obj.corrupt(long, seed=0, step=0)
    assert torch.equal(b.noisy_ids[:, :16], a.noisy_ids)
    assert torch.equal(b.block_t[:, :4], a.block_t)
    assert _target_set(a) == _target_set(b)


# --- loss --------------------------------------------------------------------------------------
def test_standard_loss_equals_hand_computed_reference(model):
    batch = _sft_batch()
    obj = _objective("standard")
    c = obj.corrupt(batch, seed=0, step=0)
    assert c.num_targets > 3
    with torch.no_grad():
        loss, metrics = obj.loss(model, c)
        logits = model(input_ids=c.noisy_ids, clean_input_ids=c.clean_ids).logits
    ref = 0.0
    for s, i in c.masked.nonzero().tolist():
        t = c.block_t[s, i // B].item()
        ref += _masked_ce(logits[s, i], c.clean_ids[s, i]).item() / t
    ref /= supervised_mask(batch).sum().item()
    assert loss.item() == pytest.approx(ref, rel=1e-5)
    assert metrics["count"] == c.num_targets
    assert metrics["loss_sum"].item() == pytest.approx(ref * c.normalizer, rel=1e-5)
    hits = (logits[c.masked].index_fill(-1, torch.tensor([MASK]), -1e9).argmax(-1) == c.clean_ids[c.masked]).sum()
    assert metrics["correct"] == hits


@pytest.mark.parametrize("name", SHIFTED)
def test_fast_dllm_v2_loss_equals_hand_computed_reference(model, name):
    obj = _objective(name)
    c = obj.corrupt(_sft_batch(), seed=1, step=0)
    with torch.no_grad():
        loss, _ = obj.loss(model, c)
        out = model(input_ids=c.noisy_ids, clean_input_ids=c.clean_ids, return_logits=False)
        logits = model.lm_logits(out.hidden_states)  # [2b, 2L, V], rows: noisy 0..L-1 then clean
    length = c.seq_len
    ref = 0.0
    for r, i in c.masked.nonzero().tolist():
        clean_row = name == "fast_dllm_v2_causal_clean" and i % B == 0
        row = length + i - 1 if clean_row else i - 1
        ref += F.cross_entropy(logits[r, row], c.clean_ids[r, i]).item()  # the whole vocabulary, [MASK] included
    assert loss.item() == pytest.approx(ref / c.normalizer, rel=1e-5)


def test_mask_logit_is_excluded_from_the_softmax_of_standard_only(model, monkeypatch):
    for name, excluded in (("standard", True), ("fast_dllm_v2", False)):
        obj = _objective(name)
        c = obj.corrupt(_sft_batch(), seed=0, step=0)
        with torch.no_grad():
            before, m_before = obj.loss(model, c)
            head = model.lm_logits
            monkeypatch.setattr(model, "lm_logits", lambda h: head(h) + 1e4 * F.one_hot(torch.tensor(MASK), VOCAB))
            after, m_after = obj.loss(model, c)
            monkeypatch.undo()
        if excluded:  # BD3-LM's SUBS parameterization
            assert after.item() == pytest.approx(before.item(), rel=1e-6)
        else:  # Fast-dLLM v2's causal-LM loss over the whole vocabulary
            assert after.item() > before.item() + 1e3
        assert m_after["correct"] == m_before["correct"]  # the accuracy never counts a [MASK] prediction


@pytest.mark.parametrize("name", OBJECTIVES)
def test_losses_of_a_partition_of_the_rows_add_up(model, name):
    obj = _objective(name)
    c = obj.corrupt(_sft_batch(), seed=0, step=0)
    with torch.no_grad():
        full, m_full = obj.loss(model, c)
        hidden = model(input_ids=c.noisy_ids, clean_input_ids=c.clean_ids, return_logits=False).hidden_states
    rows = vectorized_rows(c.seq_len)
    index = target_rows_in(rows, c)
    # Two "ranks": one holds the first 10 rows, the other the rest (each indexes its own local rows).
    split = 10
    first = torch.where(index < split, index, -1)
    second = torch.where(index >= split, index - split, -1)
    with torch.no_grad():
        l1, m1 = obj.loss_from_hidden(model, hidden[:, :split], c, first)
        l2, m2 = obj.loss_from_hidden(model, hidden[:, split:], c, second)
    assert (l1 + l2).item() == pytest.approx(full.item(), rel=1e-5)
    assert m1["count"] + m2["count"] == m_full["count"] == c.num_targets


def test_chunked_loss_equals_unchunked_loss_and_gradients(model):
    c = _objective("standard").corrupt(_sft_batch(), seed=0, step=0)
    grads = []
    for chunk in (8192, 3):
        model.zero_grad()
        loss, _ = _objective("standard", loss_chunk_size=chunk).loss(model, c)
        loss.backward()
        grads.append((loss.item(), model.get_output_embeddings().weight.grad.clone()))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-6)
    assert torch.allclose(grads[0][1], grads[1][1], atol=1e-7)
    model.zero_grad()


@pytest.mark.parametrize("name", OBJECTIVES)
def test_loss_gradients_reach_every_parameter(model, name):
    obj = _objective(name)
    c = obj.corrupt(_sft_batch(), seed=0, step=0)
    model.zero_grad()
    loss, _ = obj.loss(model, c)
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
        assert p.grad.abs().sum() > 0, pname
    model.zero_grad()


def test_batch_with_supervision_but_no_masked_token_gives_a_zero_loss_that_backpropagates(model):
    obj = _objective("standard", noise_eps_min=1e-3, noise_eps_max=1e-3)
    batch = {"input_ids": torch.randint(0, MASK, (1, 8)), "completion_mask": torch.tensor([[0] * 6 + [1] * 2])}
    c = obj.corrupt(batch, seed=0, step=0)
    assert c.num_targets == 0 and c.normalizer == 2.0
    loss, metrics = obj.loss(model, c)
    loss.backward()
    assert loss.item() == 0.0 and metrics["count"] == 0
    model.zero_grad()


@pytest.mark.parametrize("name", OBJECTIVES)
def test_empty_supervision_raises_a_clear_error(name):
    batch = _sft_batch()
    batch["completion_mask"] = batch["completion_mask"] * (1 - batch["attention_mask"])  # only pad "supervised"
    with pytest.raises(ValueError, match="no supervised token"):
        _objective(name).corrupt(batch, seed=0, step=0)


def test_supervised_mask_token_in_the_input_raises():
    batch = _sft_batch()
    batch["input_ids"][0, 5] = MASK
    with pytest.raises(ValueError, match="mask token id 63"):
        _objective("standard").corrupt(batch, seed=0, step=0)


def test_sequence_length_must_be_a_block_multiple():
    with pytest.raises(ValueError, match="multiple of block_size=4"):
        _objective("standard").corrupt({"input_ids": torch.zeros(1, 10, dtype=torch.long)}, seed=0, step=0)


# --- registry ----------------------------------------------------------------------------------
def test_get_objective_builds_from_config_and_rejects_unknown_names(model):
    assert isinstance(get_objective("standard", model.config), StandardObjective)
    fast = get_objective("fast_dllm_v2", model.config)  # the config's inverse_t belongs to `standard`
    assert isinstance(fast, FastDLLMv2Objective) and fast.loss_weighting == "unit"
    assert fast.block_size == B and fast.mask_token_id == MASK
    variant = get_objective("fast_dllm_v2_causal_clean", model.config)
    assert isinstance(variant, FastDLLMv2CausalCleanObjective) and variant.loss_weighting == "unit"
    valid = r"valid names: \['dflash', 'diffusion_gemma', 'fast_dllm_v2', 'fast_dllm_v2_causal_clean', 'standard'\]"
    with pytest.raises(ValueError, match=valid):
        get_objective("bd3lm", model.config)
    dflash = get_objective("dflash", model.config)  # a drafter's objective, from any config's block size and mask id
    assert (dflash.block_size, dflash.mask_token_id) == (B, MASK)
    with pytest.raises(ValueError, match="mask_token_id"):
        get_objective("standard", {"block_size": 4})


def test_objective_and_model_must_agree_on_the_mask_token(model):
    obj = get_objective("standard", dict(block_size=B, mask_token_id=62))
    batch = _sft_batch()
    batch["input_ids"] %= 62  # keep token 62 out of the text: it is this objective's [MASK]
    c = obj.corrupt(batch, seed=0, step=0)
    with pytest.raises(ValueError, match="mask_token_id=62 but the model"):
        obj.loss(model, c)


# --- the certainty-forcing term ------------------------------------------------------------------------------------
def _right_prediction_entropy(model, c, name):
    """Σ entropy at the targets predicted right, computed apart from the objective: [MASK]'s column sliced out of
    the logits (the standard objective) or kept (Fast-dLLM v2), torch.distributions' entropy."""
    hidden = model(input_ids=c.noisy_ids, clean_input_ids=c.clean_ids, return_logits=False).hidden_states
    index = target_rows_in(vectorized_rows(c.seq_len), c)
    logits = model.lm_logits(hidden[c.target_sample, index])
    without = torch.cat([logits[:, :MASK], logits[:, MASK + 1:]], dim=-1)  # MASK is the last id: ids below keep theirs
    hits = without.argmax(-1) == c.target_token
    kept = without if name == "standard" else logits
    return torch.distributions.Categorical(logits=kept[hits]).entropy().sum(), int(hits.sum())


def _half_right(model, c):
    """``c`` with every other target replaced by the model's own prediction: an untrained model then predicts about
    half its targets right (else it would hit few of 64 ids, and the term would have nothing to act on)."""
    with torch.no_grad():
        hidden = model(input_ids=c.noisy_ids, clean_input_ids=c.clean_ids, return_logits=False).hidden_states
        logits = model.lm_logits(hidden[c.target_sample, target_rows_in(vectorized_rows(c.seq_len), c)])
    own = logits.index_fill(-1, torch.tensor([MASK]), float("-inf")).argmax(-1)
    tokens = c.target_token.clone()
    tokens[::2] = own[::2]
    return dataclasses.replace(c, target_token=tokens)


@pytest.mark.parametrize("name", OBJECTIVES)
def test_certainty_term_adds_the_entropy_of_the_right_predictions(model, name):
    plain, forced = _objective(name), _objective(name, certainty_weight=0.5)
    c = _half_right(model, plain.corrupt(_sft_batch(), seed=0, step=0))
    base, _ = plain.loss(model, c)
    loss, metrics = forced.loss(model, c)
    entropy, hits = _right_prediction_entropy(model, c, name)
    assert hits >= 3 and metrics["correct"] == hits
    assert metrics["certainty_sum"].item() == pytest.approx(entropy.item(), rel=1e-5)
    assert loss.item() == pytest.approx(base.item() + 0.5 * entropy.item() / c.normalizer, rel=1e-5)
    # The gradient of the term (the [MASK] column at the dtype's lowest value, not -inf) is the reference's.
    grads = []
    for total in (loss - base, 0.5 * entropy / c.normalizer):
        model.zero_grad()
        total.backward(retain_graph=True)
        grads.append(model.get_output_embeddings().weight.grad.clone())
    model.zero_grad()
    assert torch.isfinite(grads[0]).all() and grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-7)


def test_certainty_term_leaves_evaluation_and_a_zero_weight_unchanged(model):
    c = _objective("standard").corrupt(_sft_batch(), seed=0, step=0)
    with torch.no_grad():  # evaluation scores the cross-entropy alone
        base, m_base = _objective("standard").loss(model, c)
        forced, m_forced = _objective("standard", certainty_weight=2.0).loss(model, c)
    assert torch.equal(base, forced) and "certainty_sum" not in m_forced
    off, m_off = _objective("standard", certainty_weight=0.0).loss(model, c)
    on, _ = _objective("standard").loss(model, c)
    assert torch.equal(off, on) and "certainty_sum" not in m_off
    assert _objective("standard").card_settings() == {}
    assert _objective("standard", certainty_weight=0.5).card_settings() == {"certainty_weight": 0.5}


@pytest.mark.parametrize("name", OBJECTIVES)
def test_certainty_losses_of_a_partition_of_the_rows_add_up(model, name):
    obj = _objective(name, certainty_weight=1.0)
    c = _half_right(model, obj.corrupt(_sft_batch(), seed=0, step=0))
    full, m_full = obj.loss(model, c)
    hidden = model(input_ids=c.noisy_ids, clean_input_ids=c.clean_ids, return_logits=False).hidden_states
    index = target_rows_in(vectorized_rows(c.seq_len), c)
    split = 10  # two "ranks", as in the partition test above, each with its own targets' certainty
    l1, m1 = obj.loss_from_hidden(model, hidden[:, :split], c, torch.where(index < split, index, -1))
    l2, m2 = obj.loss_from_hidden(model, hidden[:, split:], c, torch.where(index >= split, index - split, -1))
    assert (l1 + l2).item() == pytest.approx(full.item(), rel=1e-5)
    assert m_full["certainty_sum"] > 0 and m1["correct"] > 0 and m2["correct"] > 0  # both "ranks" hold right ones
    assert (m1["certainty_sum"] + m2["certainty_sum"]).item() == pytest.approx(m_full["certainty_sum"].item(), rel=1e-5)
    model.zero_grad()


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), True, "1"])
def test_a_bad_certainty_weight_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=r"certainty_weight must be a finite number >= 0 .* got "):
        _objective("standard", certainty_weight=bad)
