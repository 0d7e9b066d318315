"""The layout planner (``hf_bdlm.planner``, ``hf-bdlm plan``): counts against brute force, bytes against the design
formulas and the ByteMeter's measurements, memory bookkeeping, layout validity, the recommendation, CLI errors.

No processes are launched: the measured bytes come from a committed ``hf_bdlm.benchmarks.parallel_modes`` run.
"""

import json
from dataclasses import replace

import pytest
import torch

from hf_bdlm.attention.masks import MaskRule, dense_mask
from hf_bdlm.attention.rows import RowMeta, vectorized_rows
from hf_bdlm.cli import main
from hf_bdlm.parallel.dims import ParallelDims
from hf_bdlm.parallel.plan import PlanConfig, make_plan, window_exchange
from hf_bdlm.benchmarks.calibrate import validate
from hf_bdlm.planner.cost import (TIE, Cluster, Recipe, allowed_key_counts, kv_bytes_by_name, layouts, plan_all,
                                  predict, rank_work, recommend)
from hf_bdlm.planner.hardware import DeviceSpec, device_spec
from hf_bdlm.planner.model import AttentionShape, ModelSpec, model_spec, spec_from_config
from paths import DATA

# A 2-rank gloo run, L = 2K, 4K, measured on a loaded machine: its bytes are exact, its times are not for validating.
RECORDS = DATA / "parallel_modes_cpu_2k4k.json"

RULES = [MaskRule(4, clean, window, convention)
         for clean in ("block_causal", "causal")
         for window, convention in ((None, "per_query"), (3, "per_query"), (6, "per_query"), (5, "block_start"),
                                    (9, "block_start"))]
LAYOUTS = [ParallelDims(P, C, mode, schedule) for P, C, mode, schedule in (
    (2, 2, "cp", "dual_end"), (4, 4, "cp", "dual_end"), (2, 1, "bp", "dual_end"), (4, 1, "bp", "contiguous"),
    (2, 2, "csbp", "dual_end"), (4, 4, "csbp", "dual_end"), (4, 2, "csbp", "dual_end"), (4, 1, "csbp", "dual_end"),
    (4, 2, "csbp", "contiguous"))] + [ParallelDims(P, P, "cp", cp_layout="paper") for P in (2, 4)]


def tiny_model(window=None, layers=2, **kw) -> ModelSpec:
    return ModelSpec(name="tiny", hidden=64, vocab=128, layers=(AttentionShape(4, 2, 8, window),) * layers,
                     intermediate=128, block_size=4, **kw)


def rank_rows(rp) -> RowMeta:
    return rp.rows()


@pytest.mark.parametrize("rule", RULES, ids=lambda r: f"{r.clean_attention}-{r.sliding_window}-{r.window_convention}")
def test_allowed_key_counts_equal_the_dense_mask(rule):
    rows = vectorized_rows(48)
    expect = dense_mask(rows, rows, rule)[0].sum(-1)
    assert torch.equal(allowed_key_counts(rows.stream, rows.pos, rule), expect)


@pytest.mark.parametrize("dims", LAYOUTS, ids=lambda d: f"{d.mode}-P{d.block_parallel_size}-C{d.clean_ring_size}-"
                                                        f"{d.schedule}")
@pytest.mark.parametrize("rule", [RULES[0], RULES[5], RULES[2], RULES[9]],
                         ids=lambda r: f"{r.clean_attention}-{r.sliding_window}-{r.window_convention}")
def test_rank_pairs_equal_brute_force_counts(dims, rule):
    L = 64
    plan = make_plan(PlanConfig.from_dims(dims, L, 4))
    work = rank_work(dims, L, rule.with_window(None), (rule.sliding_window,))
    everything = vectorized_rows(L)
    for rp, w in zip(plan.ranks, work):
        mine = rank_rows(rp)
        assert w.pairs[rule.sliding_window] == int(dense_mask(mine, everything, rule).sum())
        own = int(dense_mask(mine, mine, rule).sum())  # the local source: the rank's own rows
        expect_local = w.pairs[rule.sliding_window] if dims.mode == "bp" else own
        if not dims.is_paper_cp:  # the paper's CP baseline computes nothing before its blocking gather
            assert w.local_pairs[rule.sliding_window] == expect_local
        assert (w.noisy_rows, w.clean_rows) == (rp.local_noisy_rows, rp.local_clean_rows)


@pytest.mark.parametrize("dims", [d for d in LAYOUTS if d.clean_ring_size > 1 and not d.is_paper_cp],
                         ids=lambda d: f"{d.mode}-P"
                         f"{d.block_parallel_size}-C{d.clean_ring_size}-{d.schedule}")
def test_halo_rows_equal_the_layouts_window_exchange(dims):
    L, rule = 96, MaskRule(4, "block_causal", 7, "per_query")
    plan = make_plan(PlanConfig.from_dims(dims, L, 4))
    work = rank_work(dims, L, rule.with_window(None), (7,))
    for me in range(dims.block_parallel_size):
        members = plan.ring_members(me) if dims.mode == "csbp" else tuple(range(dims.block_parallel_size))
        sent = []
        for m in members:
            rows = plan.ranks[m].rows()
            sent.append(rows.slice(plan.ranks[m].local_noisy_rows if dims.mode == "csbp" else 0, rows.num_rows))
        _, send_counts, recv_counts, _ = window_exchange(members.index(me), [plan.ranks[m].rows() for m in members],
                                                         sent, rule)
        assert work[me].halo_recv[7] == sum(recv_counts) and work[me].halo_sent[7] == sum(send_counts)


@pytest.mark.parametrize("mode,P,C,transport", [
    (m, P, C, t)
    for m, P, C in (("cp", 2, 2), ("cp", 4, 4), ("csbp", 4, 4), ("csbp", 4, 2), ("bp", 4, 1), ("csbp", 4, 1))
    for t in ("allgather", "ring") if not (m == "bp" and t == "ring")])  # bp has no transport
def test_kv_bytes_equal_the_design_formulas(mode, P, C, transport):
    L, s, model = 256, 4, tiny_model(layers=3)
    dims = ParallelDims(P, C, mode, transport=transport)
    per_layer = {"cp": (P - 1) / P * 2 * (2 * L), "csbp": (C - 1) / C * 2 * L, "bp": 0}[mode] * 2 * 8 * s
    G = P if mode == "cp" else C
    for w in rank_work(ParallelDims(P, C, mode), L, MaskRule(4), (None,)):
        got = kv_bytes_by_name(model, dims, w, s)
        if transport == "ring" and G > 1:
            assert got["kv.ring_kv"] == got["kv_backward.ring_kv"] == 3 * per_layer  # docs/design.md §3
            assert got["dkv.ring_dkv"] == 3 * per_layer * G / (G - 1)
        else:
            fwd = sum(v for k, v in got.items() if k.endswith("all_gather"))
            bwd = sum(v for k, v in got.items() if k.endswith("reduce_scatter"))
            assert fwd == bwd == 3 * per_layer


def test_predicted_bytes_equal_the_byte_meters_measurements():
    records = json.loads(RECORDS.read_text())
    cpu = DeviceSpec("cpu", 5e10, 5e10, float("inf"), 1e10, 3e8, 3e8)
    rows = validate(records, cpu)
    assert len(rows) == len([r for r in records if "error" not in r]) >= 10
    for r in rows:
        assert r["predicted_bytes"] == r["measured_bytes"], r["label"]
        assert r["predicted_by_name"] == r["measured_by_name"], r["label"]


def test_validation_of_a_linked_record_prices_its_bytes_at_the_links_element_size():
    """A record whose float32 K/V went through a bf16 cluster's link (2 bytes charged per element) takes the time of
    the same bytes through a link of twice the bandwidth charging the bytes moved."""
    record = next(r for r in json.loads(RECORDS.read_text()) if r["mode"] == "csbp" and "error" not in r)
    cpu = DeviceSpec("cpu", 5e10, 5e10, float("inf"), 1e10, 3e8, 3e8)
    bf16 = dict(record, link=dict(name="h200-ib", bytes_per_s=1e6, latency_s=0.01, element_bytes=2))
    moved = dict(record, link=dict(name="h200-ib", bytes_per_s=2e6, latency_s=0.01, element_bytes=None))
    slower = dict(record, link=dict(name="h200-ib", bytes_per_s=1e6, latency_s=0.01))  # an older record: bytes moved
    (a,), (b,), (c,) = validate([bf16], cpu), validate([moved], cpu), validate([slower], cpu)
    assert a["predicted_s"] == pytest.approx(b["predicted_s"]) and a["exposed_comm_s"] > 0
    assert c["exposed_comm_s"] > a["exposed_comm_s"]


def test_memory_states_shard_over_the_world():
    model, cluster = model_spec("gemma3-27b"), Cluster(16, 8)
    dims = ParallelDims(16, 16, "csbp", world_size=16)
    p = predict(model, dims, 32768, device_spec("h200"), cluster, Recipe(), checkpointing=True)
    m = p.memory
    n = model.total_params()
    assert (m.parameters, m.gradients, m.optimizer) == pytest.approx((2 * n / 16, 2 * n / 16, 8 * n / 16))
    no_ac = predict(model, dims, 32768, device_spec("h200"), cluster, Recipe(), checkpointing=False)
    assert no_ac.memory.activations > 3 * m.activations  # checkpointing keeps one input per layer
    assert no_ac.step_s < p.step_s  # and pays a recomputed forward
    doubled = predict(model, dims, 32768, device_spec("h200"), cluster, Recipe(activation_overhead=2.0), True)
    assert doubled.memory.activations == 2 * m.activations and doubled.memory.optimizer == m.optimizer


def test_csbp_receives_half_the_bytes_of_cp_and_bp_replicates_the_clean_prefix():
    model, dev, cluster = tiny_model(), device_spec("h100"), Cluster(4, 4)
    cp = predict(model, ParallelDims(4, 4, "cp"), 1024, dev, cluster)
    cs = predict(model, ParallelDims(4, 4, "csbp"), 1024, dev, cluster)
    bp = predict(model, ParallelDims(4, 1, "bp"), 1024, dev, cluster)
    assert cs.bytes_per_step * 2 == cp.bytes_per_step and bp.bytes_per_step == 0
    work = rank_work(ParallelDims(4, 1, "bp"), 1024, MaskRule(4), (None,))
    assert max(w.clean_rows for w in work) == 1024  # the owner of the last block computes the whole clean stream


def test_model_spec_counts_the_parameters_of_the_transformers_model():
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

    for cfg in (LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2),
                Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                               num_experts=8, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, decoder_sparse_step=1, mlp_only_layers=[])):
        spec = spec_from_config(cfg.to_dict())
        real = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
        assert abs(spec.total_params() - real) / real < 0.01, (spec.total_params(), real)  # norms are estimated


def test_model_spec_reads_diffusion_gemma_configs():
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    cfg = DiffusionGemmaConfig(text_config=dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=256, sliding_window=32, enable_moe_block=True, num_experts=4, top_k_experts=2,
        moe_intermediate_size=32))
    spec = spec_from_config(json.loads(json.dumps(cfg.to_dict())))  # as read back from config.json
    real = sum(p.numel() for n, p in DiffusionGemmaForBlockDiffusion(cfg).named_parameters() if "vision" not in n)
    assert abs(spec.total_params() - real) / real < 0.01, (spec.total_params(), real)
    assert [a.window for a in spec.layers] == [32] * 5 + [None] and spec.layers[5].head_dim == 512
    assert (spec.num_experts, spec.top_k, spec.moe_intermediate, spec.intermediate) == (4, 2, 32, 128)
    assert (spec.clean_attention, spec.window_convention, spec.block_size) == ("causal", "block_start", 256)


def test_presets_have_their_stated_sizes():
    dense, moe = model_spec("gemma3-27b"), model_spec("diffusiongemma-26b-a4b")
    assert 26.5e9 < dense.total_params() < 27.5e9
    assert 24e9 < moe.total_params() < 27e9 and 3.5e9 < moe.active_params() < 4.5e9
    assert sum(a.window is None for a in dense.layers) == 10 and moe.layers[5].head_dim == 512


def test_layouts_are_every_combination_parallel_dims_accepts():
    found = layouts(8, 4096, 32)
    for d in found:
        assert d == ParallelDims(d.block_parallel_size, d.clean_ring_size, d.mode, d.schedule, d.transport, 8)
    keys = {(d.mode, d.block_parallel_size, d.clean_ring_size, d.transport) for d in found}
    assert ("csbp", 8, 2, "allgather") in keys and ("csbp", 8, 4, "ring") in keys and ("cp", 4, 4, "ring") in keys
    assert not any(d.mode == "csbp" and d.block_parallel_size % d.clean_ring_size for d in found)
    with pytest.raises(ValueError, match="does not divide group_size=4"):
        predict(tiny_model(), ParallelDims(4, 3, "csbp"), 1024, device_spec("h100"), Cluster(4, 4))
    # 8 blocks: P = 8 leaves whole dual-end pairs to no one; only cp and the contiguous schedule remain (the plan says).
    short = {(d.mode, d.schedule, d.transport) for d in layouts(8, 8 * 32, 32) if d.block_parallel_size == 8}
    assert short == {("cp", "dual_end", "allgather"), ("cp", "dual_end", "ring"), ("bp", "contiguous", "allgather")}


def test_recommendation_is_the_fastest_layout_that_fits():
    model, cluster = model_spec("gemma3-27b"), Cluster(16, 8)
    tight = device_spec("h200", memory_bytes=60 * 2 ** 30)
    preds = plan_all(model, 65536, tight, cluster, ring_transport=False)
    best = recommend(preds)
    fitting = [p for p in preds if p.fits]
    assert 0 < len(fitting) < len(preds) and best.fits
    top = max(p.tokens_per_s for p in fitting)
    tied = [p for p in fitting if p.tokens_per_s >= top * (1 - TIE)]
    assert best in tied and best.memory.total == min(p.memory.total for p in tied)
    assert recommend(plan_all(model, 65536, device_spec("h200", memory_bytes=2 ** 30), cluster,
                              ring_transport=False)) is None


def test_groups_span_nodes_as_the_mesh_places_them():
    cluster = Cluster(24, 8)
    assert [g for g in (1, 2, 3, 4, 6, 8, 12, 24) if cluster.spans_nodes(g)] == [3, 6, 12, 24]


def test_inter_node_groups_expose_more_communication():
    model, dev = model_spec("gemma3-27b"), device_spec("h200")
    one_node = predict(model, ParallelDims(8, 8, "cp"), 65536, dev, Cluster(8, 8))
    two_nodes = predict(model, ParallelDims(8, 8, "cp"), 65536, dev, Cluster(8, 4))
    assert max(r.comm_s for r in two_nodes.ranks) > 5 * max(r.comm_s for r in one_node.ranks)


@pytest.mark.parametrize("argv,message", [
    (["--gpu", "h900"], "unknown gpu 'h900'"),
    (["--context", "1000"], "--context 1000 is not a multiple of the block size 32"),
    (["--gpus", "12"], "--gpus 12 is not a multiple of --gpus-per-node 8"),
    (["--model", "no/such/config.json"], "neither a known preset"),
    (["--matmul-efficiency", "1.5"], "--matmul-efficiency must be in (0, 1]"),
])
def test_cli_errors_name_the_value_and_the_fix(argv, message, capsys):
    base = {"--model": "gemma3-27b", "--context": "65536", "--gpus": "16", "--gpu": "h200"}
    for flag, value in zip(argv[::2], argv[1::2]):
        base[flag] = value
    assert main(["plan", *[x for kv in base.items() for x in kv]]) == 2
    assert message in capsys.readouterr().err


def test_cli_plans_a_config_file_and_recommends(tmp_path, capsys):
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2)
    cfg.save_pretrained(tmp_path)
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", str(tmp_path), "--context", "4096", "--gpus", "4", "--gpus-per-node", "4",
                 "--gpu", "a100", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "recommended: " in text and "csbp P=4 C=2 D=1" in text
    saved = json.loads(out.read_text())
    table = [line for line in text.splitlines() if line[:4].replace("*", " ").strip().isdigit()]
    assert len(saved) == len(table) and all(r["fits"] for r in saved)


def test_computed_pairs_of_block_tiles_are_the_allowed_pairs_and_grouped_tiles_compute_more():
    from hf_bdlm.attention.tiles import plan_attention
    from hf_bdlm.planner.kernel_work import blockwise_work, computed_pairs

    rule, rows = MaskRule(4), vectorized_rows(256)
    allowed = int(dense_mask(rows, rows, rule).sum())
    assert computed_pairs(plan_attention(rows, [rows], rule, group_rows=0)) == allowed  # block-causal: whole tiles
    assert computed_pairs(plan_attention(rows, [rows], rule)) > allowed  # dense masked group tiles
    for dims in (ParallelDims(4, 4, "csbp"), ParallelDims(4, 2, "csbp", transport="ring"), ParallelDims(4, 1, "bp")):
        exact = rank_work(dims, 256, rule, (None,))
        for e, t in zip(exact, blockwise_work(dims, 256, rule, exact)):
            assert t.pairs[None] >= e.pairs[None] and t.local_pairs[None] >= e.local_pairs[None]
            assert (t.pairs[None] == t.local_pairs[None]) == (dims.mode == "bp")


@pytest.mark.parametrize("dims", [ParallelDims(2, 2, "csbp"), ParallelDims(2, 2, "cp"), ParallelDims(2, 1, "bp"),
                                  ParallelDims(2, 2, "cp", cp_layout="paper")], ids=str)
def test_sliding_layers_are_priced_at_the_pairs_and_calls_of_the_kernels_tile_plans(dims):
    # A sliding layer's kernel runs the tile plan of the rank's rows over its own rows and the halo the all-to-all
    # brings (the paper's CP: every member's noisy rows, then every member's clean rows): window-edge group tiles
    # compute masked pairs too.
    from hf_bdlm.attention.tiles import plan_attention
    from hf_bdlm.planner.kernel_work import blockwise_work, computed_pairs

    L, window = 512, 48
    rule = MaskRule(4)
    rule_w = rule.with_window(window)
    exact = rank_work(dims, L, rule, (None, window))
    works = blockwise_work(dims, L, rule, exact)
    plan = make_plan(PlanConfig.from_dims(dims, L, 4))
    members = plan.exchange_members(0)
    q = plan.ranks[0].rows()
    if len(members) == 1:
        sources = [q]
    elif dims.is_paper_cp:
        rows = [plan.sent_rows(m) for m in members]
        sources = [RowMeta.cat([r.select(torch.nonzero(r.stream == stream).flatten()) for r in rows])
                   for stream in (1, 0)]  # noisy, clean
    else:
        sources = [q, window_exchange(0, [plan.ranks[m].rows() for m in members],
                                      [plan.sent_rows(m) for m in members], rule_w)[3]]
    tiles = plan_attention(q, sources, rule_w)
    assert works[0].pairs[window] == computed_pairs(tiles) >= exact[0].pairs[window]
    assert works[0].kernel_calls[window] == len(tiles.calls) > 0
    if dims.is_paper_cp:  # what it computes while its clean rows travel: the block-diagonal part, over the noisy rows
        assert works[0].local_pairs[window] == works[0].noisy_pairs[window] == computed_pairs(tiles, 0) > 0
    for e, w in zip(exact, works):
        assert w.pairs[window] >= e.pairs[window] and w.kernel_calls[None] > 0
        assert w.local_pairs[window] >= e.local_pairs[window] if not dims.is_paper_cp else \
            w.noisy_pairs[window] >= e.noisy_pairs[window]


def test_each_kernel_call_adds_its_fixed_cost_to_a_lone_ranks_step():
    from hf_bdlm.benchmarks.calibrate import benchmark_recipe, record_dims
    from hf_bdlm.planner.kernel_work import blockwise_work

    model = tiny_model(layers=3)
    dims, L = record_dims({"mode": "single"}), 256
    rule = MaskRule(4)
    work = blockwise_work(dims, L, rule, rank_work(dims, L, rule, (None,)))
    free = DeviceSpec("cpu", 1e10, 1e10, float("inf"), 1e9, float("inf"), float("inf"))
    priced = replace(free, kernel_call_fwd_s=2e-4, kernel_call_bwd_s=3e-4)
    step = [predict(model, dims, L, d, Cluster(1, 1), benchmark_recipe({}), work=work) for d in (free, priced)]
    # One forward and one backward per layer, each of the plan's calls at its fixed cost; counted as attention.
    added = len(model.layers) * work[0].kernel_calls[None] * (2e-4 + 3e-4)
    assert step[1].step_s - step[0].step_s == pytest.approx(added, rel=1e-9)
    assert step[1].ranks[0].attention_s - step[0].ranks[0].attention_s == pytest.approx(added, rel=1e-9)


def test_rate_entries_without_the_kernel_call_cost_get_it_measured_and_keep_their_rates(tmp_path, monkeypatch):
    from hf_bdlm.benchmarks import calibrate

    rates = tmp_path / "rates.json"
    old = dict(matmul_flops=5e10, attention_flops=4e10, hbm_bytes_per_s=1e10, intra_node_bytes_per_s=3e8,
               inter_node_bytes_per_s=3e8, sync_cost_s=1e-3, benchmark_layers=0)
    rates.write_text(json.dumps({"processes": {"1": old}}))
    monkeypatch.setattr(calibrate, "_kernel_call_cost", lambda model: (2e-4, 5e-5))
    d = calibrate.cpu_device(calibrate.benchmark_model(2), rates, processes=1, num_cores=1)
    assert (d.kernel_call_fwd_s, d.kernel_call_bwd_s, d.matmul_flops) == (2e-4, 5e-5, 5e10)
    assert json.loads(rates.read_text())["processes"]["1"] == dict(old, kernel_call_fwd_s=2e-4,
                                                                   kernel_call_bwd_s=5e-5)


def test_gpu_spec_file_and_flags_replace_the_datasheet(tmp_path):
    spec = tmp_path / "measured.json"
    spec.write_text(json.dumps({"matmul_flops": 6.1e14, "inter_node_bytes_per_s": 4.4e10}))
    d = device_spec("h100", str(spec), {"attention": 0.5}, memory_bytes=70e9)
    assert (d.matmul_flops, d.inter_node_bytes_per_s, d.memory_bytes) == (6.1e14, 4.4e10, 70e9)
    assert d.attention_flops == 989e12 * 0.5 and "measured" in d.source
    spec.write_text(json.dumps({"matmul_tflops": 600}))
    with pytest.raises(ValueError, match="unknown field"):
        device_spec("h100", str(spec))


def test_validate_from_cached_rates_prints_equal_bytes(tmp_path, capsys):
    rates = tmp_path / "rates.json"
    one = dict(matmul_flops=5e10, attention_flops=4e10, hbm_bytes_per_s=1e10, intra_node_bytes_per_s=3e8,
               inter_node_bytes_per_s=3e8, sync_cost_s=1e-3, benchmark_layers=2, benchmark_step_s=2.0,
               kernel_call_fwd_s=1e-4, kernel_call_bwd_s=1e-4)
    rates.write_text(json.dumps({"processes": {"1": one, "2": dict(one, matmul_flops=4e10)}}))
    assert main(["plan", "--validate", str(RECORDS), "--rates-cache", str(rates), "--cores", "2"]) == 0
    out = capsys.readouterr().out
    n = len([r for r in json.loads(RECORDS.read_text()) if "error" not in r])
    assert f"bytes equal for {n}/{n}" in out and "DIFFER" not in out
    assert "cpu (2 processes on 2 cores, 1 thread each): matmul 40.0 GFLOP/s" in out and "1.00 ms per sync" in out
    # The cache is read as it is: nothing was measured again.
    assert json.loads(rates.read_text())["processes"]["2"]["matmul_flops"] == 4e10


def test_validate_on_one_core_shares_it_with_oversubscribed_efficiency(tmp_path):
    from hf_bdlm.benchmarks.calibrate import benchmark_model, cpu_device

    rates = tmp_path / "rates.json"
    one = dict(matmul_flops=5e10, attention_flops=4e10, hbm_bytes_per_s=1e10, intra_node_bytes_per_s=3e8,
               inter_node_bytes_per_s=3e8, sync_cost_s=1e-3, benchmark_layers=2, benchmark_step_s=2.0,
               kernel_call_fwd_s=1e-4, kernel_call_bwd_s=1e-4)
    rates.write_text(json.dumps({"processes": {"1": dict(one, intra_node_bytes_per_s=float("inf")),
                                               "2": dict(one, benchmark_step_s=5.0, sync_cost_s=4e-3)}}))
    d = cpu_device(benchmark_model(2), rates, processes=2, num_cores=1, benchmark_layers=2)
    # One rank alone on the core computes at the 1-process rates; two share it, at 2 * 2.0 / 5.0 = 0.8 of its
    # throughput together; link and synchronization are the 2-process measurements.
    assert (d.shared_cores, d.matmul_flops, d.sync_cost_s, d.intra_node_bytes_per_s) == (1, 5e10, 4e-3, 3e8)
    assert d.oversubscribed_efficiency == pytest.approx(0.8)
    assert main(["plan", "--validate", str(RECORDS), "--rates-cache", str(rates), "--cores", "0"]) == 2


def test_the_step_elementwise_rate_is_what_matmuls_and_attention_leave_of_the_step():
    from hf_bdlm.benchmarks.calibrate import benchmark_model, step_elementwise_rate

    model = benchmark_model(2)
    rates = dict(matmul_flops=1e11, attention_flops=8e10, benchmark_step_s=1.0)
    slow, fast = step_elementwise_rate(model, rates), step_elementwise_rate(model, dict(rates, benchmark_step_s=0.8))
    assert slow < fast  # the same elementwise bytes in more of the step
    # rate = E / (step - R) for fixed bytes E and matmul + attention time R: two steps give E and R, a third follows.
    E = 0.2 / (1 / slow - 1 / fast)
    R = 1.0 - E / slow
    assert 0 < R < 0.8
    assert step_elementwise_rate(model, dict(rates, benchmark_step_s=1.5)) == pytest.approx(E / (1.5 - R), rel=1e-9)
    with pytest.raises(ValueError, match="less than its matmuls and attention alone"):
        step_elementwise_rate(model, dict(rates, benchmark_step_s=0.01))


def test_paper_comparison_takes_the_fastest_fitting_of_each_side():
    from hf_bdlm.planner.plan_command import compare_modes

    preds = plan_all(tiny_model(), 4096, device_spec("h100"), Cluster(8, 4), ring_transport=False)
    for group in (None, 8):
        c = compare_modes(preds, group)
        pool = [p for p in preds if group in (None, p.dims.block_parallel_size)]
        assert c["csbp"].tokens_per_s == max(p.tokens_per_s for p in pool if p.dims.mode == "csbp"
                                             and p.dims.clean_ring_size > 1)
        assert c["baseline"].tokens_per_s == max(p.tokens_per_s for p in pool if p.dims.mode in ("cp", "bp")
                                                 and p.dims.block_parallel_size > 1)


@pytest.mark.parametrize("dims", [ParallelDims(P, C, mode, transport="ring") for P, C, mode in (
    (2, 2, "cp"), (4, 4, "cp"), (4, 4, "csbp"), (4, 2, "csbp"), (2, 2, "csbp"))], ids=str)
def test_ring_shard_pairs_split_the_ranks_pairs(dims):
    # What the ring computes shard by shard (and csbp on its local noisy rows) adds up to the rank's pairs; its own
    # shard (and local source) are the rank's own rows. Counted, and as the blockwise kernel's tiles compute them.
    from hf_bdlm.planner.kernel_work import blockwise_work

    rule = MaskRule(4)
    exact = rank_work(dims, 256, rule, (None,))
    for works in (exact, blockwise_work(dims, 256, rule, exact)):
        for r, w in enumerate(works):
            assert len(w.shard_pairs) == len(w.members) == (dims.clean_ring_size if dims.mode == "csbp" else 4 if
                                                             dims.block_parallel_size == 4 else 2)
            assert w.source_pairs + sum(w.shard_pairs) == w.pairs[None]
            assert w.source_pairs + w.shard_pairs[w.members.index(r)] == w.local_pairs[None]
            assert (w.source_pairs > 0) == (dims.mode == "csbp")


def test_validate_reads_the_figures_bench_measured_beside_the_records(tmp_path, capsys):
    records = tmp_path / "parallel_modes.json"
    records.write_text(RECORDS.read_text())
    one = dict(matmul_flops=7e10, attention_flops=4e10, hbm_bytes_per_s=1e10, intra_node_bytes_per_s=3e8,
               inter_node_bytes_per_s=3e8, sync_cost_s=1e-3, benchmark_layers=2, benchmark_step_s=2.0,
               kernel_call_fwd_s=1e-4, kernel_call_bwd_s=1e-4)
    (tmp_path / "cpu_rates.json").write_text(json.dumps({"processes": {"1": one, "2": one}}))
    assert main(["plan", "--validate", str(records), "--cores", "2"]) == 0
    out = capsys.readouterr().out
    assert f"CPU figures: {tmp_path / 'cpu_rates.json'}\n" in out and "matmul 70.0 GFLOP/s" in out


# --- the paper's CP baseline, model parallelism, hf-bdlm plan --paper ------------------------------------------------
def test_paper_cp_is_priced_unbalanced_blocking_and_gathering_sliding_layers_whole():
    from hf_bdlm.planner.cost import CommStyle

    model = tiny_model(layers=2)
    sliding = ModelSpec(name="sliding", hidden=64, vocab=128, intermediate=128, block_size=4,
                        layers=(AttentionShape(4, 2, 8, 16), AttentionShape(4, 2, 8, None)))
    # A slow link: communication dominates, so blocking shows as exposed time.
    slow = DeviceSpec("slow", 1e12, 1e12, 1e12, 1e12, 1e7, 1e7, link_latency_s=1e-4)
    L = 512
    paper, cp = (ParallelDims(4, 4, "cp", world_size=4, cp_layout=c) for c in ("paper", "balanced"))
    pp, pc = (predict(model, d, L, slow, Cluster(4, 4), Recipe(gradient_sync=False)) for d in (paper, cp))
    attention = [r.attention_s for r in pp.ranks]  # contiguous clean shards: the last rank's longer prefixes
    assert max(attention) / (sum(attention) / 4) > 1.3 and pp.imbalance > 1.1
    assert pc.imbalance == pytest.approx(1.0, abs=0.01)
    assert pp.bytes_per_step == pc.bytes_per_step  # the same rows travel
    for rank in pp.ranks:  # blocking: only the clean gather hides, behind the block-diagonal part (~B/L of the work)
        assert rank.exposed_comm_s >= rank.comm_s * 0.99
    assert max(r.exposed_comm_s for r in pc.ranks) < min(r.exposed_comm_s for r in pp.ranks)
    # Sliding layers: the balanced cp fetches halos, the paper's gathers the whole sequence like a full layer.
    work = rank_work(paper, L, MaskRule(4), (None, 16))
    names = kv_bytes_by_name(sliding, paper, work[0], 2)
    assert not any("window" in n for n in names)
    assert names["k.all_gather"] == 2 * 3 * work[0].sent_rows * 2 * 8 * 2  # both layers, (P-1) shards each
    halo = kv_bytes_by_name(sliding, cp, rank_work(cp, L, MaskRule(4), (None, 16))[0], 2)
    assert halo["k.all_gather"] == names["k.all_gather"] / 2 and halo["k_window.all_to_all"] > 0
    # A style prices a hypothetical layout: the balanced rows moved the paper's way cost more than balanced cp.
    hybrid = predict(model, cp, L, slow, Cluster(4, 4), Recipe(gradient_sync=False),
                     style=CommStyle(blocking=True, whole_sliding=True))
    assert pc.step_s < hybrid.step_s < pp.step_s


def test_model_parallel_shares_a_ranks_work_and_adds_its_own_traffic():
    model = tiny_model(layers=2)
    dev = device_spec("h100")
    dims = ParallelDims(2, 1, "bp", world_size=2)
    one = predict(model, dims, 4096, dev, Cluster(2, 2), Recipe(gradient_sync=False))
    two = predict(model, dims, 4096, dev, Cluster(2, 2), Recipe(gradient_sync=False, model_parallel=2))
    assert max(r.compute_s for r in two.ranks) == pytest.approx(max(r.compute_s for r in one.ranks) / 2, rel=1e-9)
    tp = Recipe(model_parallel=2).model_parallel_seconds(model, 1000, 1, dev.intra_node_bytes_per_s)
    assert tp == pytest.approx(2 * 2 * 0.5 * 1000 * 64 * 2 / dev.intra_node_bytes_per_s)
    assert max(r.exposed_comm_s for r in two.ranks) > 0 == max(r.exposed_comm_s for r in one.ranks)
    assert two.memory.total == pytest.approx(one.memory.total / 2)
    assert Recipe(model_parallel=2, model_parallel_kind="ep").model_parallel_seconds(model, 1000, 1, 1e9) == 0  # dense
    with pytest.raises(ValueError, match="model_parallel_kind must be 'tp' or 'ep'"):
        Recipe(model_parallel=2, model_parallel_kind="pp")


def test_paper_topology_breakdown_adds_up_to_the_difference():
    from hf_bdlm.planner.plan_command import paper_topology

    model = model_spec("gemma3-27b")
    r = paper_topology(model, 65536, device_spec("h200"), Recipe(model_parallel=2))
    assert sum(r["breakdown"].values()) == pytest.approx(r["paper"].step_s - r["csbp"].step_s, rel=1e-9)
    assert r["paper"].dims.is_paper_cp and r["cp"].dims.cp_layout == "balanced"
    assert r["breakdown"]["imbalance (contiguous clean shards)"] > 0  # the last rank's longer clean prefix
    assert r["breakdown"]["sliding-layer traffic (whole gathers, not halos)"] > 0  # Gemma 3's 5:1 layers
