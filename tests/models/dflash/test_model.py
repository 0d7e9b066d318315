"""DFlash / DFlash2 drafters: the forward equals the paper's implementation (``dllm_parallel``, the oracle) on the same
weights, features and anchors; the context mask rule; the serving contract of the saved folder; the identity of the
DFlash2 convolutions at initialisation; construction from Llama / Qwen3 / Gemma 3 targets; clear errors.

The oracle's production attention is CUDA-only (FA4): on CPU it runs with ``dense_reference_attention``
(tests/dflash_oracle.py), a dense softmax over ``[context keys ; block keys]`` whose context mask is the oracle's own
predicate (``dflash_fa4._torch_interval_mask_mod``) and whose in-block mask is ``same block`` (and ``q >= k`` when
the oracle asks for a causal block). Everything else (projections, norms, RoPE, the DFlash2 convolutions, anchors,
document starts, sliding-window compaction) is the oracle's code. Tiny models, float64 for the comparisons.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig

from hf_bdlm.attention.rows import document_starts
from hf_bdlm.models.dflash.configuration import DFlashConfig, default_target_layer_ids
from hf_bdlm.models.dflash.studies.projection import PUBLISHED_DFLASH2
from hf_bdlm.models.dflash.modeling import (
    CandidateSelector,
    DFlash2DraftModel,
    DFlashContextCache,
    DFlashDraftModel,
    attend_with_lse,
    draft_context_mask,
    merge_partials,
)

dflash_model = pytest.importorskip("dllm_parallel.core.models.backbones.dflash.model")
from dflash_oracle import (  # noqa: E402
    BLOCK,
    HEAD_DIM,
    HEADS,
    VOCAB,
    WIDTH,
    drafter,
    drafter_config,
    features_for,
    gemma3_target,
    llama_target,
    qwen3_target,
    randomize,
    reference_of,
)
from dllm_parallel.core.attention.dflash_fa4 import _torch_interval_mask_mod  # noqa: E402
from dllm_parallel.core.attention.masks import DFlashGlobalContextMask  # noqa: E402
from dllm_parallel.core.models.backbones.dflash import dflash2 as ref_dflash2  # noqa: E402
from dllm_parallel.core.models.backbones.dflash.executor import (  # noqa: E402
    _expected_dflash2_serving_shapes,
    normalize_sglang_dflash2_config,
)
from dllm_parallel.core.objectives.dflash import DFlashObjectiveRuntime  # noqa: E402
from dllm_parallel.serving.vllm_dflash import validate_vllm_dflash2_export  # noqa: E402

def packed_batch(length: int = 24, batch: int = 2, anchors: int = 6, seed: int = 0):
    """Two packed documents per row (the second row's boundary elsewhere), positions restarting per document, anchors
    sampled by the oracle's objective (some padding anchors: more slots than valid anchors in row 1)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB - 1, (batch, length), generator=g)
    docs = torch.zeros(batch, length, dtype=torch.long)
    docs[0, 10:], docs[1, 15:] = 1, 1
    loss = torch.ones(batch, length, dtype=torch.long)
    loss[1, 3:] = 0
    loss[1, 16:19] = 1
    starts = document_starts(docs)
    positions = torch.arange(length).expand(batch, -1) - starts
    runtime = DFlashObjectiveRuntime(block_size=BLOCK, max_anchors=anchors, mask_token_id=VOCAB - 1, decay_gamma=7.0,
                                     sample_from_anchor=False, device=torch.device("cpu"), seed=seed)
    objective = runtime.prepare(ids, loss, docs)
    return ids, docs, positions, objective


ORACLE_CASES = {
    "dflash2_full": dict(dflash2=True),
    "dflash2_sliding_and_full": dict(dflash2=True, layer_types=["sliding_attention", "full_attention"],
                                     sliding_window=5),
    "dflash2_all_sliding_noncausal": dict(dflash2=True, layer_types=["sliding_attention"] * 2, sliding_window=6,
                                          is_causal=False),
    "dflash_full": dict(dflash2=False),
    "dflash_all_sliding": dict(dflash2=False, layer_types=["sliding_attention"] * 2, sliding_window=3),
}


@pytest.mark.parametrize("case", list(ORACLE_CASES))
def test_forward_and_gradients_equal_the_reference(case, tmp_path):
    target = qwen3_target().double()
    config = drafter_config(**ORACLE_CASES[case])
    model = drafter(config, target)
    ref = reference_of(model, target, tmp_path)
    ids, docs, positions, objective = packed_batch()
    assert not bool(objective.anchor_valid.all()) and bool(objective.anchor_valid.any())
    features = features_for(config, *ids.shape)

    ours = model(features, ids, objective.anchor_positions, anchor_valid=objective.anchor_valid,
                 position_ids=positions, document_ids=docs)
    theirs = ref(target_hidden_states=features, teacher_hidden_states=None, input_ids=ids, position_ids=positions,
                 objective=objective, compute_teacher=False)
    their_logits = theirs.hidden_states @ ref.lm_head.weight.T
    hidden_diff = (ours.hidden_states - theirs.hidden_states).abs().max().item()
    logit_diff = (ours.logits - their_logits).abs().max().item()
    print(f"{case}: max |hidden diff| {hidden_diff:.2e}, max |logit diff| {logit_diff:.2e}")
    assert ours.hidden_states.shape == (2, objective.anchor_positions.shape[1] * BLOCK, WIDTH)
    assert hidden_diff < 1e-10 and logit_diff < 1e-10

    # Backward: the same gradients for every trainable tensor (the oracle packs q/k/v and gate/up).
    weight = torch.randn(ours.logits.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    (ours.logits * weight).sum().backward()
    (their_logits * weight).sum().backward()
    ours_grads = {name: p.grad for name, p in model.named_parameters()}
    worst = 0.0
    for name, p in ref.named_parameters():
        if not p.requires_grad:
            continue
        prefix = name.rsplit(".", 1)[0] + "."
        if name.endswith("self_attn.packed_weight"):
            mine = torch.cat([ours_grads[prefix + f"{x}_proj.weight"] for x in "qkv"])
        elif name.endswith("mlp.packed_weight"):
            mine = torch.cat([ours_grads[prefix + f"{x}_proj.weight"] for x in ("gate", "up")])
        else:
            mine = ours_grads[name]
        if name.startswith("candidate_selector."):
            assert mine is None and p.grad is None  # the selector is trained by its own loss, not through logits
            continue
        assert torch.isfinite(mine).all(), name  # padding anchors and document starts see no context at all
        worst = max(worst, (mine - p.grad).abs().max().item() / max(1.0, p.grad.abs().max().item()))
    print(f"{case}: max relative |grad diff| {worst:.2e}")
    assert worst < 1e-10


def test_context_mask_equals_the_reference_predicate():
    g = torch.Generator().manual_seed(0)
    b, length, anchors = 3, 40, 7
    docs = torch.randint(0, 3, (b, length), generator=g).sort(dim=1).values
    docs[2, 25:] = 0  # an id reused by a later, separate run: a third document
    anchor_positions = torch.randint(0, length, (b, anchors), generator=g).sort(dim=1).values
    valid = torch.rand(b, anchors, generator=g) < 0.8
    starts = document_starts(docs).gather(1, anchor_positions)
    for window in (None, 1, 3, 9):
        ours = draft_context_mask(anchor_positions, torch.arange(length).expand(b, -1), BLOCK,
                                  anchor_document_starts=starts, anchor_valid=valid, sliding_window=window)
        mask = DFlashGlobalContextMask(
            context_starts=torch.where(valid, starts, length).to(torch.int32),
            context_stops=torch.where(valid, anchor_positions, length).to(torch.int32),
            anchor_valid=valid, block_size=BLOCK, global_anchor_count=anchors, sliding_window=window)
        predicate = _torch_interval_mask_mod(mask, key_positions=torch.arange(length, dtype=torch.int32))
        q, k = torch.arange(anchors * BLOCK), torch.arange(length)
        theirs = predicate(torch.arange(b)[:, None, None], None, q[None, :, None], k[None, None, :])
        assert torch.equal(ours.flatten(1, 2), theirs.expand(b, -1, -1)), window


def test_context_shards_merge_exactly():
    # What a context-parallel rank does: attend over its own context shard, merge by log-sum-exp. One shard is fully
    # masked for some queries (lse = -inf), the block part never is.
    g = torch.Generator().manual_seed(0)
    b, heads, n, t, d = 2, 3, 8, 10, 4
    q, k, v = (torch.randn(b, heads, m, d, generator=g, dtype=torch.float64) for m in (n, t + n, t + n))
    mask = torch.rand(b, 1, n, t + n, generator=g) < 0.5
    mask[..., t:] = True
    mask[:, :, :3, :4] = False
    pieces = [(slice(0, 4), mask[..., :4]), (slice(4, t), mask[..., 4:t]), (slice(t, t + n), None)]
    merged = merge_partials([attend_with_lse(q, k[:, :, s], v[:, :, s], m, 0.5) for s, m in pieces])
    whole = torch.softmax((q @ k.transpose(-1, -2) * 0.5).masked_fill(~mask, float("-inf")), dim=-1) @ v
    assert torch.allclose(merged, whole, atol=1e-14, rtol=0)


def test_gradient_checkpointing_gives_the_same_gradients():
    target = qwen3_target().double()
    ids, docs, positions, objective = packed_batch()
    grads = []
    for checkpointing in (False, True):
        model = drafter(drafter_config(), target).train()
        if checkpointing:
            model.activation_checkpointing_enable()
        features = features_for(model.config, *ids.shape)
        out = model(features, ids, objective.anchor_positions, anchor_valid=objective.anchor_valid,
                    position_ids=positions, document_ids=docs)
        out.logits.square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert grads[0].numel() == grads[1].numel() and torch.allclose(grads[0], grads[1], atol=1e-12, rtol=0)


# --- the mask rule, by perturbing features -------------------------------------------------------------------------
def _perturbed(features: torch.Tensor, rows, batch: int = 0) -> torch.Tensor:
    out = features.clone()
    out[batch, rows] += 1.0
    return out


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("case", sorted(ORACLE_CASES))
def test_the_fused_path_drafts_what_the_explicit_softmax_drafts(case, monkeypatch):
    """CUDA runs the drafter's attention as FlexAttention over interval block masks (no [queries x context] mask);
    forced here on the CPU (eager FlexAttention, forward only), it drafts what the CPU path drafts, packed documents,
    padding anchors, windows and decoding from the cache included."""
    import hf_bdlm.models.dflash.modeling as modeling

    target = qwen3_target().double()
    config = drafter_config(**ORACLE_CASES[case])
    model = drafter(config, target)
    ids, docs, positions, objective = packed_batch()
    features = features_for(config, *ids.shape)
    cache = DFlashContextCache(model, 2)
    cache.append(features[:, :13])
    anchor_ids = ids[:, 13]
    outs = {}
    for fused in (False, True):
        monkeypatch.setattr(modeling, "fused_attention", lambda query, fused=fused: fused)
        with torch.no_grad():
            outs[fused] = (model(features, ids, objective.anchor_positions, anchor_valid=objective.anchor_valid,
                                 position_ids=positions, document_ids=docs).hidden_states,
                           model.draft_from_cache(cache, anchor_ids).hidden_states)
    for explicit, fused in zip(outs[False], outs[True]):
        assert (explicit - fused).abs().max() <= 1e-10


def test_a_block_never_sees_context_at_or_after_its_anchor():
    target = qwen3_target()
    model = drafter(drafter_config(), target)
    ids = torch.randint(1, VOCAB - 1, (1, 20), generator=torch.Generator().manual_seed(0))
    anchors = torch.tensor([[9]])
    features = features_for(model.config, 1, 20)
    base = model(features, ids, anchors).hidden_states
    assert torch.equal(model(_perturbed(features, slice(9, 20)), ids, anchors).hidden_states, base)
    assert not torch.allclose(model(_perturbed(features, [8]), ids, anchors).hidden_states, base)
    # A shorter capture (features of the first 9 tokens only) drafts the same block (up to the summation order of a
    # matmul over fewer keys).
    assert torch.allclose(model(features[:, :9], ids, anchors).hidden_states, base, atol=1e-12, rtol=0)


def test_a_block_never_sees_other_documents():
    target = qwen3_target()
    model = drafter(drafter_config(), target)
    ids = torch.randint(1, VOCAB - 1, (1, 20), generator=torch.Generator().manual_seed(0))
    docs = torch.tensor([[0] * 8 + [1] * 6 + [0] * 6])  # three documents: [0, 8), [8, 14), [14, 20)
    anchors = torch.tensor([[12, 18]])
    features = features_for(model.config, 1, 20)

    def blocks(feats):
        return model(feats, ids, anchors, document_ids=docs).hidden_states.view(2, BLOCK, -1)

    base = blocks(features)
    assert torch.equal(blocks(_perturbed(features, slice(0, 8))), base)  # the later documents never see the first
    middle = blocks(_perturbed(features, [9]))
    assert not torch.allclose(middle[0], base[0]) and torch.equal(middle[1], base[1])
    last = blocks(_perturbed(features, [15]))
    assert torch.equal(last[0], base[0]) and not torch.allclose(last[1], base[1])


def test_a_sliding_layer_sees_only_its_window():
    # One sliding layer of window 3, block-causal: the query at anchor s + k sees context p >= s + k - 2. A DFlash
    # drafter (no convolutions mixing rows), so each row's change is its own.
    target = qwen3_target()
    config = drafter_config(dflash2=False, num_hidden_layers=1, layer_types=["sliding_attention"], sliding_window=3)
    model = drafter(config, target)
    ids = torch.randint(1, VOCAB - 1, (1, 20), generator=torch.Generator().manual_seed(0))
    anchors = torch.tensor([[10]])
    features = features_for(config, 1, 20)
    base = model(features, ids, anchors).hidden_states[0]
    assert torch.equal(model(_perturbed(features, slice(0, 8)), ids, anchors).hidden_states[0], base)
    row0_only = model(_perturbed(features, [8]), ids, anchors).hidden_states[0]    # s - 2: row 0 only
    assert not torch.allclose(row0_only[0], base[0]) and torch.equal(row0_only[1:], base[1:])
    rows01 = model(_perturbed(features, [9]), ids, anchors).hidden_states[0]       # s - 1: rows 0 and 1
    assert not torch.allclose(rows01[:2], base[:2]) and torch.equal(rows01[2:], base[2:])


def test_padding_anchors_see_no_context():
    target = qwen3_target()
    model = drafter(drafter_config(), target)
    ids = torch.randint(1, VOCAB - 1, (1, 20), generator=torch.Generator().manual_seed(0))
    anchors, valid = torch.tensor([[6, 15]]), torch.tensor([[True, False]])
    features = features_for(model.config, 1, 20)
    base = model(features, ids, anchors, anchor_valid=valid).hidden_states.view(2, BLOCK, -1)
    moved = model(features + 1.0, ids, anchors, anchor_valid=valid).hidden_states.view(2, BLOCK, -1)
    assert torch.equal(moved[1], base[1]) and not torch.allclose(moved[0], base[0])


# --- decoding from the context cache -------------------------------------------------------------------------------
# (that it drafts what the whole context drafts, step after step and for ragged batches: in
# tests/models/dflash/test_speculative.py)
def sliding_and_full_drafter():
    config = drafter_config(layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    return drafter(config, qwen3_target())


def test_cropping_the_cache_equals_never_appending_the_cropped_rows():
    """Appending a whole block and cropping back to what each row kept leaves the cache drafting exactly what a
    cache that appended only the kept rows drafts."""
    model = sliding_and_full_drafter()
    features = features_for(model.config, 2, 30)
    ids = torch.randint(1, VOCAB - 1, (2, 31), generator=torch.Generator().manual_seed(0))
    cropped, counted = DFlashContextCache(model, 2), DFlashContextCache(model, 2)
    for cache in (cropped, counted):
        cache.append(features[:, :9])
    for keep in ([1, 4], [3, 2], [4, 1], [2, 2]):
        keep = torch.tensor(keep)
        block = features.gather(1, (cropped.lengths[:, None] + torch.arange(BLOCK))[..., None].expand(
            -1, -1, features.shape[-1]))
        cropped.append(block)
        cropped.crop(counted.lengths + keep)
        counted.append(block, counts=keep)
        assert torch.equal(cropped.lengths, counted.lengths)
        anchor_ids = ids[torch.arange(2), counted.lengths]
        assert torch.equal(model.draft_from_cache(cropped, anchor_ids).hidden_states,
                           model.draft_from_cache(counted, anchor_ids).hidden_states)


def test_a_crop_within_a_block_of_an_append_stays_exact_and_a_deeper_one_is_refused():
    """A sliding layer keeps window - 1 + B rows: cropping up to B rows drafts as a cache that never held them;
    cropping more is an error that says why (the rows the window needs are gone)."""
    model = sliding_and_full_drafter()                       # window 3, B = 4: the sliding ring holds 6 rows
    features = features_for(model.config, 1, 12)
    ids = torch.randint(1, VOCAB - 1, (1, 12), generator=torch.Generator().manual_seed(0))
    cache = DFlashContextCache(model, 1)
    cache.append(features[:, :10])                            # the ring holds rows 4 .. 9
    cache.crop(torch.tensor([6]))
    fresh = DFlashContextCache(model, 1)
    fresh.append(features[:, :6])
    out, expected = model.draft_from_cache(cache, ids[:, 6]), model.draft_from_cache(fresh, ids[:, 6])
    assert torch.allclose(out.hidden_states, expected.hidden_states, atol=1e-12, rtol=0)
    cache = DFlashContextCache(model, 1)
    cache.append(features[:, :10])
    with pytest.raises(ValueError, match="cannot crop row 0 to 5 context rows.*no longer hold row 3"):
        cache.crop(torch.tensor([5]))


def test_a_long_append_to_an_all_sliding_cache_projects_only_the_rows_its_windows_keep():
    """Every layer slides (window 3, B = 4: rings of 6 rows): of a 20-row prompt, only the rows a ring keeps go
    through `fc`, and the blocks drafted after it are those of the whole context."""
    config = drafter_config(layer_types=["sliding_attention"] * 2, sliding_window=3)
    model = drafter(config, qwen3_target())
    features = features_for(config, 2, 20)
    ids = torch.randint(1, VOCAB - 1, (2, 21), generator=torch.Generator().manual_seed(0))
    projected = []
    model.fc.register_forward_hook(lambda module, args, out: projected.append(tuple(args[0].shape[:2])))
    cache = DFlashContextCache(model, 2)
    counts = torch.tensor([20, 15])
    cache.append(features, counts=counts)
    assert projected == [(2, 20 - (15 - 6))]                 # rows before the shorter row's last 6 are skipped
    out = model.draft_from_cache(cache, ids[torch.arange(2), counts])
    expected = model(features, ids, counts[:, None])
    assert torch.allclose(out.hidden_states, expected.hidden_states[:, 1:], atol=1e-12, rtol=0)


def test_an_empty_cache_drafts_like_an_anchor_without_context():
    model = sliding_and_full_drafter()
    features = features_for(model.config, 2, 1)
    ids = torch.randint(1, VOCAB - 1, (2, 1), generator=torch.Generator().manual_seed(0))
    cache = DFlashContextCache(model, 2)
    out = model.draft_from_cache(cache, ids[:, 0])
    expected = model(features, ids, torch.zeros(2, 1, dtype=torch.long))   # anchor 0 sees no context
    assert torch.allclose(out.logits, expected.logits[:, 1:], atol=1e-12, rtol=0)


def test_context_cache_misuse_is_refused():
    model = sliding_and_full_drafter()
    other = drafter(drafter_config(), qwen3_target())
    cache = DFlashContextCache(model, 2)
    with pytest.raises(ValueError, match=r"features must be \[batch=2, n, feature_width\], got \(3, 4, 96\)"):
        cache.append(features_for(model.config, 3, 4))
    with pytest.raises(ValueError, match=r"counts must be an integer tensor \[batch=2\]"):
        cache.append(features_for(model.config, 2, 4), counts=torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="built for another drafter"):
        other.draft_from_cache(cache, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"anchor_token_ids must be an integer tensor \[batch=2\]"):
        model.draft_from_cache(cache, torch.tensor([[1, 2]]))


# --- saving: the serving contract ----------------------------------------------------------------------------------
def test_save_and_load_round_trip_and_the_serving_inventory(tmp_path):
    target = qwen3_target()
    model = drafter(drafter_config(layer_types=["sliding_attention", "full_attention"], sliding_window=5), target)
    model.float().save_pretrained(tmp_path)
    config_json = json.loads((tmp_path / "config.json").read_text())
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        saved = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    # Exactly the tensors (names and shapes) the serving engines load: no embedding, no head.
    assert saved == _expected_dflash2_serving_shapes(config_json)
    assert config_json["model_type"] == "qwen3" and config_json["architectures"] == ["DFlash2DraftModel"]
    assert config_json["dflash_config"]["target_layer_ids"] == [1, 3, 5]  # serving convention: canonical - 1
    normalize_sglang_dflash2_config(config_json, expected_block_size=BLOCK)  # SGLang's reader accepts it
    # The oracle's whole vLLM export check (inventory, model_type, block size), given the provenance file it wants.
    weights = tmp_path / "model.safetensors"
    (tmp_path / "training_export.json").write_text(json.dumps({
        "format": "dllm_parallel.dflash2_training_export.v1",
        "weights": {"sha256": hashlib.sha256(weights.read_bytes()).hexdigest(), "tensor_count": len(saved)}}))
    assert validate_vllm_dflash2_export(tmp_path, expected_block_size=BLOCK)["num_speculative_tokens"] == BLOCK - 1

    parsed = dflash_model.DFlashModelConfig.from_mapping(config_json)
    cfg = model.config
    assert parsed.target_layer_ids == cfg.target_layer_ids == (2, 4, 6)
    assert (parsed.block_size, parsed.mask_token_id, parsed.hidden_size, parsed.head_dim, parsed.layer_types,
            parsed.sliding_window, parsed.rope_theta, parsed.target_hidden_size, parsed.conv_kernel_size,
            parsed.conv_group_size, parsed.selector_rank, parsed.selector_top_k) == (
        BLOCK, VOCAB - 1, WIDTH, HEAD_DIM, ("sliding_attention", "full_attention"), 5, 50.0, WIDTH, 3, 8, 6, 5)
    assert parsed.sliding_window_non_causal is False

    loaded = DFlash2DraftModel.from_pretrained(tmp_path).double().bind_target(target)
    assert loaded.config.to_dict()["dflash_config"] == model.config.to_dict()["dflash_config"]
    ids = torch.randint(1, VOCAB - 1, (1, 16), generator=torch.Generator().manual_seed(0))
    features = features_for(cfg, 1, 16)
    anchors = torch.tensor([[3, 9]])
    assert torch.equal(loaded(features, ids, anchors).logits, model.double()(features, ids, anchors).logits)


def test_serving_fields_are_written_even_at_qwen3_defaults():
    # A drafter of Qwen3's default sizes: transformers would leave those values out of config.json.
    config = DFlashConfig(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=1,
                          num_attention_heads=32, num_key_value_heads=32, head_dim=128, block_size=16,
                          mask_token_id=151669, target_layer_ids=[2, 18, 34])
    mapping = json.loads(config.to_json_string())
    parsed = dflash_model.DFlashModelConfig.from_mapping(mapping)
    assert parsed.verifier_vocab_size == 151936
    assert (parsed.hidden_size, parsed.intermediate_size, parsed.head_dim, parsed.num_key_value_heads) == (
        4096, 22016, 128, 32)
    assert parsed.architecture == "DFlashDraftModel" and parsed.conv_kernel_size is None


def test_the_published_dflash2_config_reads_as_the_reference_reads_it(tmp_path):
    published = PUBLISHED_DFLASH2  # z-lab/Qwen3.8-27B-DFlash2 config.json
    config = DFlashConfig.from_dict(published)
    recipe = Path(dflash_model.__file__).parents[4] / "recipes" / "runs" / "dflash2-qwen3-8-27b-1m.yaml"
    assert f"target_layer_ids: {list(config.target_layer_ids)}" in recipe.read_text()  # [6, 20, 34, 48, 62]
    assert config.is_dflash2 and config.sliding_window_non_causal and config.block_size == 8
    config.save_pretrained(tmp_path)
    ours = dflash_model.DFlashModelConfig.from_mapping(json.loads((tmp_path / "config.json").read_text()))
    assert ours == dflash_model.DFlashModelConfig.from_mapping(published)


def test_default_target_layers_follow_the_published_drafters():
    # z-lab/Qwen3-8B-DFlash-b16 (5 layers over Qwen3-8B's 36): dflash_config.target_layer_ids [1, 9, 17, 25, 33].
    assert default_target_layer_ids(36, 5) == (2, 10, 18, 26, 34)
    assert default_target_layer_ids(28, 1) == (15,)  # one layer: the middle decoder layer (14)'s output
    with pytest.raises(ValueError, match="pass target_layer_ids explicitly"):
        default_target_layer_ids(4, 2)


# --- DFlash2 at initialisation -------------------------------------------------------------------------------------
def test_dflash2_convolutions_are_identity_at_init():
    target = qwen3_target()
    v2 = drafter(drafter_config(), target, conv_identity=True)
    v1_config = drafter_config(dflash2=False)
    v1 = DFlashDraftModel(v1_config).double()
    missing, unexpected = v1.load_state_dict(v2.state_dict(), strict=False)
    assert not missing and all("_conv." in k or k.startswith("candidate_selector.") for k in unexpected)
    v1.bind_target(target)
    ids, docs, positions, objective = packed_batch()
    features = features_for(v1_config, *ids.shape)
    args = (features, ids, objective.anchor_positions)
    kwargs = dict(anchor_valid=objective.anchor_valid, position_ids=positions, document_ids=docs)
    assert torch.equal(v2(*args, **kwargs).logits, v1(*args, **kwargs).logits)
    fresh = DFlash2DraftModel(drafter_config())
    assert not fresh.candidate_selector.successor_codebook.any()  # the selector starts at the unary scores


def test_candidate_selector_equals_the_reference():
    ours = CandidateSelector(hidden_size=WIDTH, vocab_size=VOCAB, rank=6, top_k=5).double()
    theirs = ref_dflash2.CandidateSelector(hidden_size=WIDTH, vocab_size=VOCAB, state_rank=6, top_k=5,
                                           initializer_range=0.02).double()
    randomize(ours)
    theirs.load_state_dict(ours.state_dict())
    g = torch.Generator().manual_seed(0)
    candidates = torch.randint(0, VOCAB, (3, BLOCK - 1, 5), generator=g)
    unary = torch.randn(3, BLOCK - 1, 5, generator=g, dtype=torch.float64)
    hidden = torch.randn(3, BLOCK - 1, WIDTH, generator=g, dtype=torch.float64)
    previous = torch.randint(0, VOCAB, (3, BLOCK - 1), generator=g)
    kw = dict(candidate_ids=candidates, unary_logits=unary, hidden_states=hidden)
    assert torch.allclose(ours.score_candidates(**kw, predecessor_ids=previous),
                          theirs.score_candidates(**kw, predecessor_ids=previous), atol=1e-12, rtol=0)
    anchors = torch.randint(0, VOCAB, (3,), generator=g)
    assert torch.equal(ours.greedy_path(**kw, anchor_token_ids=anchors),
                       theirs.greedy_path(**kw, anchor_token_ids=anchors))


# --- building a drafter for a target -------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("init", ["scratch", "target_layers"])
def test_from_target_builds_a_bound_drafter_with_the_serving_inventory(family, init, tmp_path):
    target = {"llama": llama_target, "qwen3": qwen3_target, "gemma3": gemma3_target}[family]()
    model = DFlash2DraftModel.from_target(target, init=init, num_hidden_layers=2, selector_rank=4, selector_top_k=3)
    config = model.config
    assert config.target_layer_ids == (2, 4)  # the default spread over 6 target layers: decoder layers 1, 3
    assert model.embed_tokens is target.get_input_embeddings() and model.lm_head is target.get_output_embeddings()
    assert not model.embed_tokens.weight.requires_grad and not model.lm_head.weight.requires_grad
    own = {id(p) for p in model.parameters()}
    assert id(model.embed_tokens.weight) not in own and id(model.lm_head.weight) not in own
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert shapes == _expected_dflash2_serving_shapes(json.loads(config.to_json_string()))

    source = target.model.layers[-2:]
    for mine, theirs in zip(model.layers, source):
        copied = torch.equal(mine.self_attn.q_proj.weight, theirs.self_attn.q_proj.weight)
        assert copied == (init == "target_layers")
        if init == "target_layers":
            assert torch.equal(mine.mlp.down_proj.weight, theirs.mlp.down_proj.weight)
            if family == "llama":  # no q/k norms in Llama: they stay at one
                assert torch.equal(mine.self_attn.q_norm.weight, torch.ones(HEAD_DIM))
            elif family == "qwen3":
                assert torch.equal(mine.self_attn.k_norm.weight, theirs.self_attn.k_norm.weight)
                assert torch.equal(mine.post_attention_layernorm.weight, theirs.post_attention_layernorm.weight)
            else:  # Gemma: x * (1 + w) norms, the pre-MLP norm is pre_feedforward_layernorm
                assert torch.allclose(mine.post_attention_layernorm.weight,
                                      1 + theirs.pre_feedforward_layernorm.weight, atol=1e-6)
        assert torch.equal(mine.attention_conv.base_kernel[:, 0], torch.ones(2, WIDTH))

    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        states = target(ids, output_hidden_states=True).hidden_states
    features = torch.cat([states[i] for i in config.target_layer_ids], dim=-1)
    out = model(features, ids, torch.tensor([[2, 7], [4, 8]]))
    assert out.logits.shape == (2, 2 * config.block_size, VOCAB) and torch.isfinite(out.logits).all()

    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert not any(k.startswith(("embed_tokens", "lm_head")) for k in f.keys())


def test_mask_token_defaults_to_pad_then_eos():
    assert DFlashConfig.for_target(qwen3_target().config).mask_token_id == 0
    assert DFlashConfig.for_target(llama_target().config).mask_token_id == 2
    bare = LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=4, num_attention_heads=HEADS,
                       pad_token_id=None, eos_token_id=None, bos_token_id=None)
    with pytest.raises(ValueError, match="pass mask_token_id="):
        DFlashConfig.for_target(bare)


# --- clear errors --------------------------------------------------------------------------------------------------
def test_wrong_feature_width_is_refused():
    target = qwen3_target()
    model = drafter(drafter_config(), target)
    ids = torch.randint(1, VOCAB, (1, 12))
    with pytest.raises(ValueError, match=r"has 64 features per token.*3 target layers \[2, 4, 6\].*= 96"):
        model(torch.randn(1, 12, 64, dtype=torch.float64), ids, torch.tensor([[3]]))


def test_anchor_out_of_range_is_refused():
    target = qwen3_target()
    model = drafter(drafter_config(), target)
    ids = torch.randint(1, VOCAB, (1, 12))
    features = features_for(model.config, 1, 12)
    with pytest.raises(ValueError, match=r"0 <= anchor < L = 12\), got values in \[3, 12\]"):
        model(features, ids, torch.tensor([[3, 12]]))
    with pytest.raises(ValueError, match="context_positions must be"):
        model(features, ids, torch.tensor([[3]]), context_positions=torch.arange(5)[None])


def test_a_drafter_without_a_target_says_to_bind_one():
    model = DFlash2DraftModel(drafter_config())
    with pytest.raises(RuntimeError, match=r"bind_target\(target\)"):
        model(torch.randn(1, 8, 96), torch.randint(1, VOCAB, (1, 8)), torch.tensor([[2]]))


@pytest.mark.parametrize("overrides, message", [
    (dict(block_size=1), r"block_size must be an integer >= 2.*got 1"),
    (dict(mask_token_id=VOCAB), r"mask_token_id must be a token id in \[0, 64\).*got 64"),
    (dict(target_layer_ids=[0, 2]), r"canonical ids >= 1.*got canonical ids \[0, 2\]"),
    (dict(target_layer_ids=[2, 9]), r"exceed the target's 6 decoder layers"),
    (dict(target_layer_ids=[2, 2]), r"must be distinct"),
    (dict(conv_group_size=7), r"conv_group_size \(7\) must divide hidden_size \(32\)"),
    (dict(conv_kernel_size=5), r"conv_kernel_size \(5\) must not exceed block_size \(4\)"),
    (dict(selector_top_k=65), r"selector_top_k \(65\) must not exceed vocab_size \(64\)"),
    (dict(is_causal=True), r"is_causal=True is ambiguous"),
    (dict(hidden_act="gelu"), r"hidden_act must be 'silu', got 'gelu'"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}), r"rope_type must be 'default'"),
    (dict(layer_types=["sliding_attention"]), r"layer_types has 1 entries, num_hidden_layers is 2"),
    (dict(num_attention_heads=3, head_dim=8), r"num_attention_heads \(3\) must be a multiple of num_key_value_heads"),
])
def test_bad_config_values_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        drafter_config(**overrides)


def test_partial_dflash2_fields_and_mismatched_classes_are_refused():
    with pytest.raises(ValueError, match=r"needs all of .*but not \['selector_rank', 'selector_top_k'\]"):
        DFlashConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                     num_hidden_layers=1, head_dim=HEAD_DIM, block_size=4, mask_token_id=1, target_layer_ids=[1],
                     conv_kernel_size=2, conv_group_size=8)
    with pytest.raises(ValueError, match="build DFlashDraftModel instead of DFlash2DraftModel"):
        DFlash2DraftModel(drafter_config(dflash2=False))
    with pytest.raises(ValueError, match="architectures says DFlashDraftModel"):
        drafter_config(architectures=["DFlashDraftModel"])


def test_layer_ids_given_twice_differently_are_refused():
    with pytest.raises(ValueError, match=r"target_layer_ids=\[2, 3\] \(canonical ids\) disagrees with "
                                         r"dflash_config.target_layer_ids=\[1\]"):
        DFlashConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                     num_hidden_layers=1, head_dim=HEAD_DIM, block_size=4, mask_token_id=1, target_layer_ids=[2, 3],
                     dflash_config={"target_layer_ids": [1]})
