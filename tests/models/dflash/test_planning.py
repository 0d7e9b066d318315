"""The drafter training projection (``hf_bdlm.models.dflash.studies.planning``: the drafter's workload of the planner;
``.projection``: the paper's setting): its FLOPs equal a brute-force count of a tiny drafter's matmuls and the paper's
own FLOP counter (``dllm_parallel``, the oracle); its attention pairs and projected context rows equal the mask rule;
its K/V bytes and feature memory equal their formulas; CP-only replicates the draft work P times and csbp shares it;
the printed projection carries both contexts and the published speed-ups. Pure functions and tiny models: no
processes."""

from __future__ import annotations

import functools

import pytest
import torch
from fixtures import tiny_target
from torch.utils.flop_counter import FlopCounterMode

from hf_bdlm.models.dflash.configuration import DFlashConfig
from hf_bdlm.models.dflash.modeling import DFlash2DraftModel, draft_context_mask
from hf_bdlm.models.dflash.training.objectives import DFlashObjective, anchor_costs
from hf_bdlm.models.dflash.studies.planning import (
    RING_TILE_ROWS,
    DrafterSetting,
    DrafterSpec,
    DrafterStep,
    anchor_shares,
    draw_batches,
    drafter_layouts,
    drafter_memory,
    drafter_work,
    forward_matmul_flops,
    kv_bytes,
    predict_drafter,
    reachable_rows,
    step_flops,
)
from hf_bdlm.models.dflash.studies.projection import (
    PUBLISHED_DFLASH2,
    REFERENCE_STEPS,
    format_projection,
    format_reference_readings,
    project_drafter_training,
    reference_readings,
)
from hf_bdlm.parallel.dims import ParallelDims
from hf_bdlm.planner.hardware import device_spec
from hf_bdlm.planner.workload import Cluster, Recipe, Workload, price_step

VOCAB, WIDTH, BLOCK = 64, 32, 4


target = functools.partial(tiny_target, "qwen3", intermediate_size=48, num_hidden_layers=6, pad_token_id=0,
                           training=True)


def tiny_config(layer_types=("sliding_attention", "full_attention"), window=6, **overrides) -> DFlashConfig:
    values = dict(num_hidden_layers=len(layer_types), layer_types=list(layer_types), sliding_window=window,
                  target_layer_ids=[2, 4, 6], block_size=BLOCK, mask_token_id=VOCAB - 1, intermediate_size=40,
                  conv_kernel_size=3, conv_group_size=8, selector_rank=6, selector_top_k=5)
    values.update(overrides)
    return DFlashConfig.for_target(target().config, **values)


def tiny_batch(length=64, anchors=6, documents=True, step=0):
    objective = DFlashObjective(mask_token_id=VOCAB - 1, block_size=BLOCK, max_anchors=anchors,
                                anchor_sampling="uniform", loss="ce")
    ids = torch.randint(0, VOCAB - 1, (1, length), generator=torch.Generator().manual_seed(step))
    docs = (torch.arange(length) >= length // 3).long()[None] if documents else None
    return objective.prepare(ids, torch.ones_like(ids), docs, step=step)


# --- FLOPs ---------------------------------------------------------------------------------------------------------
def test_forward_matmul_flops_equal_a_brute_force_count_of_the_drafters_matmuls():
    config = tiny_config()
    model = DFlash2DraftModel(config).bind_target(target())
    T, anchors = 20, torch.tensor([[5, 11, 17]])
    features = torch.randn(1, T, config.feature_width)
    with FlopCounterMode(display=False) as counter:
        model(features, torch.randint(0, VOCAB - 1, (1, T)), anchors)
    ops = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    linear = sum(n for op, n in ops.items() if op.startswith(("aten.mm", "aten.addmm")))
    spec = DrafterSpec.from_config(config)
    assert linear == forward_matmul_flops(spec, context_rows=T, draft_rows=3 * BLOCK, head_rows=3 * BLOCK) > 0


def test_parameter_counts_equal_the_instantiated_drafter():
    config = tiny_config()
    spec = DrafterSpec.from_config(config)
    model = DFlash2DraftModel(config)
    assert spec.trainable_params() == sum(p.numel() for p in model.parameters())
    assert spec.frozen_params() == 2 * VOCAB * WIDTH  # the target's embedding and head, bound, not owned


def test_published_drafter_sizes():
    spec = DrafterSpec.from_config(PUBLISHED_DFLASH2)
    assert spec.feature_width == 5 * 5120 and spec.block_size == 8 and spec.num_layers == 5
    assert spec.context_window() == 2048 and not any(spec.block_causal)  # every layer slides, non-causal blocks
    assert (spec.conv_width, spec.selector_rank, spec.selector_top_k) == (2 * 2 * 5120 // 16, 256, 16)


def test_step_flops_equal_the_papers_counter():
    perf = pytest.importorskip("dllm_parallel.core.profiling.perf")
    spec = DrafterSpec.from_config(PUBLISHED_DFLASH2)
    ctx, draft, sup, pairs = 18_432, 2048 * 8, 2048 * 7, (33_000_000,) * 5
    ours = step_flops(spec, ctx, draft, sup, pairs)
    counter = perf.DFlashTransformerFlops(
        num_layers=5, hidden_size=5120, intermediate_size=17408, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, target_hidden_size=5120, target_feature_width=5 * 5120, draft_vocab_size=248320,
        dflash2_conv_kernel_size=2, dflash2_conv_group_size=16, dflash2_selector_rank=256, dflash2_selector_top_k=16)
    ref = counter.executed_gemm_flops_breakdown_per_step(context_token_rows=ctx, draft_token_rows=draft,
                                                         attention_pairs=sum(pairs), supervised_token_rows=sup,
                                                         loss_kind="dpace")
    assert ours["context projection"] == ref["target_projection"]
    matrices = ours["context K/V"] + ours["draft layers"] + ours["head and loss"]
    assert matrices == pytest.approx(ref["attention_projection"] + ref["mlp"] + ref["dflash2"] + ref["output"]
                                     + ref["output_recompute"], rel=1e-12)
    # Attention: the paper counts 4 + 8 FLOPs per pair and head dim, the planner 4 + 10 (FlashAttention's backward
    # recomputes the scores); the pairs are the same.
    assert ours["attention"] * 12 == pytest.approx(ref["attention_core"] * 14, rel=1e-12)


# --- what each rank computes, holds and receives -------------------------------------------------------------------
@pytest.mark.parametrize("dims", [ParallelDims(2, 2, "cp"), ParallelDims(4, 2, "csbp"), ParallelDims(3, 1, "bp"),
                                  ParallelDims(4, 4, "csbp", transport="ring")], ids=str)
def test_attention_pairs_equal_the_mask_rule(dims):
    config = tiny_config(window=6)
    spec = DrafterSpec.from_config(config)
    batch = tiny_batch()
    works = drafter_work(spec, dims, batch)
    shares = anchor_shares(spec, dims, batch)
    positions, starts = batch.anchor_positions, batch.document_starts
    L = batch.sequence_length
    for i, window in enumerate(config.layer_window(i) for i in range(2)):
        for r, (w, mine) in enumerate(zip(works, shares)):
            mask = draft_context_mask(positions[:, mine], torch.arange(L)[None], BLOCK,
                                      anchor_document_starts=starts[:, mine], sliding_window=window)
            a, b = w.shard
            assert w.own_pairs[i] == int(mask[..., a:b].sum())
            assert w.own_pairs[i] + w.peer_pairs[i] == int(mask.sum())
            assert w.block_pairs[i] == len(mine) * (BLOCK * (BLOCK + 1) // 2 if config.layer_block_causal(i)
                                                    else BLOCK * BLOCK)
        if dims.mode != "cp":  # every anchor runs exactly once: the ranks' pairs add up to the anchors' costs
            total = sum(w.own_pairs[i] + w.peer_pairs[i] for w in works)
            assert total == int(anchor_costs(batch, sliding_window=window).sum())


@pytest.mark.parametrize("dims", [ParallelDims(2, 2, "cp"), ParallelDims(4, 2, "csbp"), ParallelDims(2, 1, "bp")],
                         ids=str)
def test_projected_rows_are_the_rows_some_query_of_the_ring_can_see(dims):
    config = tiny_config(layer_types=("sliding_attention", "sliding_attention"), window=5)
    spec = DrafterSpec.from_config(config)
    batch = tiny_batch(length=96, anchors=5)
    works = drafter_work(spec, dims, batch)
    shares = anchor_shares(spec, dims, batch)
    C = dims.clean_ring_size
    for r, w in enumerate(works):
        ring = torch.cat([shares[m] for m in range(r // C * C, r // C * C + C)])
        seen = draft_context_mask(batch.anchor_positions[:, ring], torch.arange(96)[None], BLOCK,
                                  anchor_document_starts=batch.document_starts[:, ring], sliding_window=5)
        a, b = w.shard
        assert w.projected_rows == int(seen.any(dim=2).any(dim=1)[0, a:b].sum())
    # With a full-attention layer every query may see the whole prefix, and without compaction: whole shards.
    for whole in (drafter_work(DrafterSpec.from_config(tiny_config()), dims, batch),
                  drafter_work(spec, dims, batch, compact_context=False)):
        assert [w.projected_rows for w in whole] == [w.shard_rows for w in whole]


def _seen(batch, slots, window, length=96):
    """Which sequence rows some query of the anchor slots ``slots`` may attend to (the mask rule)."""
    mask = draft_context_mask(batch.anchor_positions[:, slots], torch.arange(length)[None], BLOCK,
                              anchor_document_starts=batch.document_starts[:, slots], sliding_window=window)
    return mask.any(dim=2).any(dim=1)[0]


@pytest.mark.parametrize("dims", [ParallelDims(4, 4, "cp", transport="ring"), ParallelDims(4, 4, "cp"),
                                  ParallelDims(4, 2, "csbp"), ParallelDims(4, 2, "csbp", transport="ring"),
                                  ParallelDims(4, 1, "bp")], ids=str)
def test_kv_rows_and_bytes_equal_the_formulas(dims):
    config = tiny_config(layer_types=("sliding_attention", "full_attention"), window=5)
    spec = DrafterSpec.from_config(config)
    batch = tiny_batch(length=96, anchors=5)
    works = drafter_work(spec, dims, batch)
    shares = anchor_shares(spec, dims, batch)
    C = dims.clean_ring_size
    kv_row = 2 * 2 * 8 * 2  # K and V, 2 heads x 8 dims, bf16
    for r, w in enumerate(works):
        ring = range(r // C * C, r // C * C + C)
        for i, window in enumerate(config.layer_window(i) for i in range(2)):
            if C == 1:
                expected = (0, 0)
            elif dims.transport == "ring":  # padded shares visit every rank, then come back with their gradients
                share = max(RING_TILE_ROWS, -(-max(works[q].projected_rows for q in ring) // RING_TILE_ROWS)
                            * RING_TILE_ROWS)
                expected = ((C - 1) * share, (2 * C - 1) * share)
            elif window is None:  # all-gather of the peers' shards; reduce-scatter of their gradients
                expected = ((C - 1) * 96 // C, (C - 1) * 96 // C)
            else:  # the peers' rows my anchors see; my rows the peers' anchors see
                got = sum(int(_seen(batch, shares[r], window)[slice(*works[q].shard)].sum()) for q in ring if q != r)
                gave = sum(int(_seen(batch, shares[q], window)[slice(*w.shard)].sum()) for q in ring if q != r)
                expected = (got, gave)
            assert (w.recv_rows[i], w.recv_grad_rows[i]) == expected
        assert kv_bytes(spec, w) == kv_row * sum(w.recv_rows) + kv_row * sum(w.recv_grad_rows)


def test_feature_memory_is_the_held_shard_and_replicated_features_do_not_fit_at_1m():
    spec = DrafterSpec.from_config(PUBLISHED_DFLASH2)
    device, cluster = device_spec("h100"), Cluster(8, 8)
    setting = DrafterSetting(1 << 20, draws=1)
    whole = DrafterSetting(1 << 20, draws=1, compact_context=False)
    recipe = Recipe(loss_chunk_rows=4096)
    feature_bytes = 5 * 5120 * 2
    cp = predict_drafter(spec, ParallelDims(8, 8, "cp", transport="ring", world_size=8), setting, device, cluster,
                         recipe)
    bp = predict_drafter(spec, ParallelDims(8, 1, "bp", world_size=8), whole, device, cluster, recipe)
    assert cp.memory.features == 2 * (1 << 20) // 8 * feature_bytes and cp.fits  # the paper's code reads its shard
    assert bp.memory.features == 2 * (1 << 20) * feature_bytes > device.memory_bytes and not bp.fits
    # Compacted, the sharded forward reads only the rows a rank projects: balanced over a ring, all its own under bp.
    batch = draw_batches(spec, setting)[0]  # the draw predict_drafter prices (seed 0, step 0)
    for dims in (ParallelDims(8, 8, "csbp", world_size=8), ParallelDims(8, 1, "bp", world_size=8)):
        works = drafter_work(spec, dims, batch)
        assert all(w.feature_rows == w.projected_rows for w in works)
        if dims.mode == "csbp":
            rows = [w.projected_rows for w in works]
            assert max(rows) - min(rows) <= 1 and sum(rows) == reachable_rows(
                batch.anchor_positions[0], batch.document_starts[0], spec.context_window(), (0, 1 << 20))
        memory = predict_drafter(spec, dims, setting, device, cluster, recipe).memory
        assert memory.features in {2 * w.feature_rows * feature_bytes for w in works}
        assert memory.features < (bp.memory.features if dims.mode == "bp" else cp.memory.features) / 8
    work = drafter_work(spec, ParallelDims(8, 8, "cp"), DFlashObjective(mask_token_id=0).prepare(
        torch.zeros(1, 4096, dtype=torch.long), torch.ones(1, 4096), step=0))[0]
    one, many = (drafter_memory(spec, ParallelDims(8, 8, "cp", world_size=w), work, recipe, False, 1)
                 for w in (8, 64))
    assert one.states > many.states and one.features == many.features  # states shard over the world, features not


# --- one pricing ---------------------------------------------------------------------------------------------------
def test_the_drafters_step_is_a_workload_the_planner_prices():
    spec = DrafterSpec.from_config(tiny_config())
    device, cluster, recipe = device_spec("h100"), Cluster(4, 4), Recipe(loss_chunk_rows=4096)
    dims = ParallelDims(4, 2, "csbp", world_size=4)
    setting = DrafterSetting(64, max_anchors=6, anchor_sampling="uniform", features="resident", draws=1)
    works = drafter_work(spec, dims, draw_batches(spec, setting)[0])
    step = DrafterStep(spec, dims, works)
    assert isinstance(step, Workload)
    priced = price_step(step, device, cluster, recipe, False)
    # the planner's records hold the drafter's own counts
    assert priced.memory == tuple(drafter_memory(spec, dims, w, recipe, False, 1) for w in works)
    assert priced.bytes_per_step == max(kv_bytes(spec, w) for w in works) > 0
    # FSDP2 over the 4 GPUs moves the drafter's trainable parameters: bf16 gathered twice, bf16 gradients once
    n = spec.trainable_params()
    fsdp_bytes = (2 * n * 2 + n * 2) * 3 / 4
    assert priced.times.fsdp_comm_s == pytest.approx(fsdp_bytes / device.link_bytes_per_s(False), rel=1e-12)
    pred = predict_drafter(spec, dims, setting, device, cluster, recipe)
    assert pred.memory == priced.peak and pred.kv_bytes == priced.bytes_per_step and pred.fits == priced.fits
    assert pred.parts["FSDP2 exposed"] == priced.times.fsdp_exposed_s


# --- how the layouts compare ---------------------------------------------------------------------------------------
def _setting(length, anchors):
    return DrafterSetting(length, max_anchors=anchors, anchor_sampling="uniform", features="resident", draws=2)


def test_cp_replicates_the_draft_work_p_times_and_csbp_deals_it_once():
    spec = DrafterSpec.from_config(tiny_config(layer_types=("sliding_attention",) * 2, window=5))
    device, cluster = device_spec("h100"), Cluster(8, 8)
    per_anchor = None
    for P in (2, 4, 8):
        for anchors in (16, 32):
            setting = _setting(512, anchors)
            batch = tiny_batch(length=512, anchors=anchors)
            cp = drafter_work(spec, ParallelDims(P, P, "cp"), batch)
            cs = drafter_work(spec, ParallelDims(P, P, "csbp"), batch)
            assert [w.anchors for w in cp] == [anchors] * P and sum(w.anchors for w in cs) == anchors
            # The CP group's draft-layer GPU seconds per sequence are P x anchors x one anchor's.
            pred = predict_drafter(spec, ParallelDims(P, P, "cp", world_size=8), setting, device, cluster)
            group = pred.parts["draft layers"] * P
            per_anchor = per_anchor or group / (P * anchors)
            assert group == pytest.approx(P * anchors * per_anchor, rel=1e-9)
            cs_pred = predict_drafter(spec, ParallelDims(P, P, "csbp", world_size=8), setting, device, cluster)
            assert cs_pred.parts["draft layers"] == pytest.approx(pred.parts["draft layers"] / P, rel=1e-9)


def test_csbp_gain_over_cp_grows_with_the_replicated_draft_work_and_stays_below_p():
    # Published sizes with full-attention layers: a block's attention then spans the whole prefix.
    spec = DrafterSpec.from_config(dict(PUBLISHED_DFLASH2, layer_types=["full_attention"] * 5))
    device, cluster, P = device_spec("h100"), Cluster(4, 4), 4

    def gain(anchors):
        setting = _setting(32768, anchors)
        cp, cs = (predict_drafter(spec, ParallelDims(P, P, mode, world_size=P), setting, device, cluster)
                  for mode in ("cp", "csbp"))
        return cs.tokens_per_s / cp.tokens_per_s

    assert 1 < gain(64) < gain(512) < P


def test_with_sliding_layers_and_locality_anchors_the_gain_is_the_same_at_256k_and_1m_resident_or_from_host():
    spec = DrafterSpec.from_config(PUBLISHED_DFLASH2)
    device, cluster = device_spec("h100"), Cluster(8, 8)
    cp_dims = ParallelDims(8, 8, "cp", transport="ring", world_size=8)
    cs_dims = ParallelDims(8, 8, "csbp", world_size=8)

    def run(length, features):
        setting = DrafterSetting(length, features=features, draws=1)
        return [predict_drafter(spec, d, setting, device, cluster) for d in (cp_dims, cs_dims)]

    short, long = run(1 << 18, "resident"), run(1 << 20, "resident")
    gains = [cs.tokens_per_s / cp.tokens_per_s for cp, cs in (short, long)]
    assert 4 < gains[0] < 8 and gains[1] == pytest.approx(gains[0], rel=0.02)
    # The context work is the union of the anchors' windows: the same rows whatever the context.
    assert long[0].parts["context projection"] == pytest.approx(short[0].parts["context projection"], rel=0.05)
    # From the host, csbp reads only the rows it projects (a few thousand a GPU, not L / 8), so its reads hide behind
    # the previous step at 1M as they do resident; the CP-only baseline reads its whole shard (L / 8 rows, 51 GB/s),
    # also hidden behind its longer step.
    cp, cs = run(1 << 20, "host")
    assert cs.parts["feature reads exposed"] == 0 and cs.load_s < cs.step_s / 10
    assert cs.step_s == pytest.approx(long[1].step_s, rel=0.02)
    assert cp.parts["feature reads exposed"] == 0 and cp.load_s > 10 * cs.load_s


def test_layouts_cover_every_group_and_clean_ring():
    labels = {(str(d.mode), d.block_parallel_size, d.clean_ring_size, str(d.transport)) for d in drafter_layouts(8)}
    assert {("cp", 8, 8, "ring"), ("csbp", 2, 2, "allgather"), ("bp", 8, 1, "allgather")} <= labels
    assert all(P % C == 0 and 8 % P == 0 for _, P, C, _ in labels)


@pytest.fixture(scope="module")
def projection():
    return project_drafter_training(draws=1)


def test_the_projection_prints_both_contexts_next_to_the_published_speedups(projection):
    rows = projection
    assert [r["context"] for r in rows] == [524288, 1048576] and [r["published"] for r in rows] == [2.48, 7.59]
    for r in rows:
        assert r["host"]["baseline"]["label"].startswith("cp P=8 C=8 D=1 ring")
        parts = r["host"]["breakdown"]
        assert sum(parts.values()) == pytest.approx(r["host"]["difference_s"])
        assert parts["draft layers"] > 0 and parts["head and loss"] > 0  # replicated under CP-only
        # plain data parallelism replicates nothing and, the context compacted, one sequence fits on one GPU: it
        # trains as fast as the fastest csbp (the strongest baseline)
        assert r["host"]["data_parallel"]["label"].startswith("bp P=1 C=1 D=8")
        assert r["host"]["ratio_over_data_parallel"] == pytest.approx(1.0, abs=0.02)
    text = format_projection(rows)
    summary = [line for line in text.splitlines() if line.split()[:2] in (["512K", "host"], ["1M", "host"])]
    assert len(summary) == 2 and summary[0].endswith("2.48x") and summary[1].endswith("7.59x")
    assert "cp P=8 C=8 D=1 ring" in text and "Where the CP-only" in text and "vs dp" in text


def test_the_reference_recipes_constants_switched_in_one_by_one(projection):
    readings = reference_readings(projection, draws=1)
    assert len(readings) == 1 + len(REFERENCE_STEPS)
    limit = projection[0]["memory_limit_bytes"]
    first, layout, transport, optimizer, checkpointing, baseline, anchors = readings
    for row in projection:  # the first row is the projection's own picks
        c = first[str(row["context"])]
        assert c["ratio"] == pytest.approx(row["host"]["ratio"]) and c["baseline"] == row["host"]["baseline"]["label"]
    half, whole = "524288", "1048576"
    for L in (half, whole):
        assert layout[L]["csbp"].startswith("csbp P=2 C=2 D=4 allgather")  # the recipe's cp 2 x bp 2
        assert transport[L]["csbp"].startswith("csbp P=2 C=2 D=4 ring")
        assert checkpointing[L]["csbp"].endswith("AC off") and baseline[L]["baseline"].endswith("AC off")
    # whole 512K-row shards of 25600 bf16 features, two on the GPU (the reference prefetches the next step's): the
    # recipe's own layout does not fit at 1M, and reading a shard from the host takes longer than the step
    assert not transport[whole]["csbp_fits"] and transport[whole]["csbp_peak_bytes"] > max(limit, 2 * 2**19 * 25600 * 2)
    assert transport[whole]["ratio"] < 0.6 * layout[whole]["ratio"]
    # every GPU keeping all optimizer states (fused AdamW, no FSDP) costs memory: at 512K the recipe's layout with
    # activation checkpointing off no longer fits either
    assert optimizer[half]["csbp_peak_bytes"] <= limit and not checkpointing[half]["csbp_fits"]
    # the fastest CP-only group that fits under those constants: 4 GPUs at 512K, all 8 at 1M
    assert baseline[half]["baseline"].startswith("cp P=4 C=4 D=2 ring") and baseline[half]["baseline_fits"]
    assert baseline[whole]["baseline"].startswith("cp P=8 C=8 D=1 ring")
    assert 0.45 < baseline[half]["ratio"] / checkpointing[half]["ratio"] < 0.55  # half the replicated draft work
    # the recipe's density (2048 anchors per 1M tokens): 1024 at 512K
    assert (anchors[half]["anchors"], anchors[whole]["anchors"]) == (1024, 2048)
    text = format_reference_readings(readings, projection)
    assert "runs/dflash2-qwen3-8-27b-1m.yaml" in text and "512K (published 2.48x" in text
    assert "1M (published 7.59x" in text and text.count("closest to the published") == 2
    assert "(NO: " in text


# --- errors --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [(dict(features="disk"), "features must be one of"),
                                             (dict(seq_len=0), "seq_len must be a positive integer, got 0"),
                                             (dict(draws=0), "draws must be a positive integer")])
def test_bad_settings_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DrafterSetting(**{"seq_len": 64, **kwargs})


def test_bad_inputs_name_the_value_and_the_fix():
    spec = DrafterSpec.from_config(tiny_config())
    device, cluster = device_spec("h100"), Cluster(2, 2)
    with pytest.raises(ValueError, match="shorter than two blocks"):
        predict_drafter(spec, ParallelDims(2, 2, "cp"), DrafterSetting(6), device, cluster)
    with pytest.raises(ValueError, match="model_parallel=2"):
        predict_drafter(spec, ParallelDims(2, 2, "cp"), DrafterSetting(64), device, cluster, Recipe(model_parallel=2))
    with pytest.raises(ValueError, match="blocks of 8 tokens, the drafter 4"):
        drafter_work(spec, ParallelDims(2, 2, "cp"), DFlashObjective(mask_token_id=0, block_size=8).prepare(
            torch.zeros(1, 64, dtype=torch.long), torch.ones(1, 64), step=0))
    with pytest.raises(TypeError, match="takes a DFlashConfig"):
        DrafterSpec.from_config("config.json")
