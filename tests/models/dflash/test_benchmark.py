"""The drafter study of `hf-bdlm bench` (hf_bdlm/models/dflash/studies/benchmark.py): the benchmark drafter and its inputs, the
launches a run makes, option errors before anything runs, the report on synthetic records, and the quick study end to
end (every layout at P = 2 beside one process: equal losses; every rank's received K/V bytes, projected context rows
and held feature rows equal to what the mask rule and the layout say)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from hf_bdlm import cli
from hf_bdlm.models.dflash.studies import benchmark
from hf_bdlm.models.dflash.studies.benchmark import DrafterStudy

MiB = 2**20


def test_anchors_follow_the_recipes_density_of_2048_per_million_tokens():
    assert benchmark.recipe_anchors(2**20) == 2048
    assert [benchmark.recipe_anchors(L) for L in (2048, 16384, 32768)] == [4, 32, 64]
    assert benchmark.recipe_anchors(100) == 1  # never none


def test_the_benchmark_drafter_is_the_published_dflash2_drafter_scaled_to_hidden_256():
    config = benchmark.benchmark_config(layers=2)
    assert config.is_dflash2 and config.block_size == 8 and config.sliding_window_non_causal
    assert config.target_layer_ids == (6, 20, 34, 48, 62) and config.num_target_layers == 64  # the recipe's
    assert (config.hidden_size, config.feature_width, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim) == (256, 5 * 256, 8, 2, 32)
    assert [config.layer_window(i) for i in range(2)] == [2048, 2048]  # the published window
    assert [benchmark.benchmark_config(window=None).layer_window(0)] == [None]
    drafter = benchmark.benchmark_drafter(layers=1)
    assert drafter.lm_head.weight.shape == (8192, 256) and not drafter.lm_head.weight.requires_grad
    assert not any(name.startswith(("embed", "lm_head")) for name in drafter.state_dict())  # the target's, not saved


def test_a_ranks_feature_rows_are_those_rows_of_the_whole_sequence():
    whole = benchmark.benchmark_features([(0, 1024)], 16)
    for runs in ([(0, 512)], [(256, 768)], [(300, 301)], [(700, 1024)], [(3, 9), (511, 530), (1000, 1024)], []):
        index = torch.cat([torch.arange(a, b) for a, b in runs]) if runs else torch.zeros(0, dtype=torch.long)
        assert torch.equal(benchmark.benchmark_features(runs, 16), whole[:, index])
    assert whole.shape == (1, 1024, 16) and 0.9 < whole.std().item() < 1.1


def test_a_run_launches_every_layout_at_every_group_size_and_length_beside_one_process():
    study = DrafterStudy(lengths=(1024, 2048), nprocs=(2, 4), layouts=("csbp", "cp", "bp", "dp"), layers=1,
                         window=2048, anchors=None, steps=3, timeout=60.0)
    configs = study.configurations()
    assert len(configs) == 2 * (1 + 2 * 4)
    assert configs[:9] == [("single", 1, 1024), ("csbp", 2, 1024), ("cp", 2, 1024), ("bp", 2, 1024), ("dp", 2, 1024),
                           ("csbp", 4, 1024), ("cp", 4, 1024), ("bp", 4, 1024), ("dp", 4, 1024)]
    assert (study.anchors_at(1024), study.anchors_at(2048)) == (2, 4)
    assert dataclasses.replace(study, anchors=7).anchors_at(2048) == 7
    assert [benchmark.ring_size(m, 4) for m in ("csbp", "cp", "bp", "dp", "single")] == [4, 4, 1, 1, 1]
    assert [benchmark.sequences_per_step(m, 4) for m in ("csbp", "cp", "bp", "dp")] == [1, 1, 1, 4]


def test_dp_ranks_train_sequences_of_their_own_and_rank_0_trains_the_single_process_sequence():
    ids0, _ = benchmark.benchmark_tokens(4096)
    ids1, _ = benchmark.benchmark_tokens(4096, sequence=1)
    assert torch.equal(benchmark.benchmark_tokens(4096, sequence=0)[0], ids0) and not torch.equal(ids0, ids1)
    assert not torch.equal(benchmark.benchmark_features([(0, 300)], 8, sequence=1),
                           benchmark.benchmark_features([(0, 300)], 8))
    first = benchmark.benchmark_objective(8).prepare(ids0, torch.ones_like(ids0), step=1)
    other = benchmark.benchmark_objective(8, sequence=1).prepare(ids0, torch.ones_like(ids0), step=1)
    assert not torch.equal(first.anchor_positions, other.anchor_positions)  # its own anchor draw


def test_the_compute_rate_probe_measures_the_matrix_products_flops():
    rate = benchmark.compute_rate(rows=64, repeats=2)
    assert 0.05 < rate < 5000  # GFLOP/s of one thread: far from zero, far below a GPU


@pytest.mark.parametrize("argv, message", [
    (["--steps", "2"], "--steps=2: a timed comparison needs at least 3 timed steps after the warm-up"),
    (["--steps", "1", "--quick"], "--steps=1: a timed comparison needs at least 3 timed steps"),
])
def test_fewer_than_three_timed_steps_are_refused_before_anything_runs(argv, message, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["bench", "--only", "drafter", "--out", str(out), *argv]) == 2
    assert message in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("argv, message", [
    (["--drafter-lengths", "1030", "--drafter-nprocs", "4"],
     "--drafter-lengths 1030: csbp and cp cut the context into P equal shards, so every length must be a multiple "
     "of every --drafter-nprocs (4)"),
    (["--drafter-lengths", "1024", "1030", "1031", "--drafter-nprocs", "2", "4"], "--drafter-lengths 1030 1031:"),
])
def test_lengths_a_group_cannot_cut_are_refused_before_anything_runs(argv, message, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["bench", "--only", "drafter", "--out", str(out), *argv]) == 2
    assert message in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("argv, message", [
    (["--drafter-nprocs", "1"], "argument --drafter-nprocs: '1': group sizes are at least 2"),
    (["--drafter-window", "-1"], "argument --drafter-window: '-1': a window is a positive number of tokens, or 0"),
    (["--drafter-layouts", "ring"], "argument --drafter-layouts: invalid choice: 'ring'"),
    (["--drafter-anchors", "0"], "argument --drafter-anchors: '0': must be a positive integer"),
])
def test_bad_option_values_exit_2_naming_the_value(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--only", "drafter", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def _record(layout, P, L, times, loss=9.0, match=True, rate=10.0, peak=100, cpu=1.0, **extra):
    received = 0 if layout in ("single", "bp", "dp") else MiB
    share = L // 512 // (1 if layout in ("single", "cp", "dp") else P)
    sequences = P if layout == "dp" else 1
    step_s = sorted(times)[len(times) // 2]
    rec = dict(study="drafter", layout=layout, P=P, C=P if layout in ("cp", "csbp") else 1, L=L, layers=1,
               window=2048, anchors=L // 512, anchors_per_rank=[share] * P, steps=len(times),
               step_s=step_s, step_times=list(times), sequences_per_step=sequences,
               seconds_per_sequence=[t / sequences for t in times], compute_s_per_rank=[step_s * cpu] * P,
               cpu_seconds_per_sequence=[t * cpu / sequences for t in times],
               compute_rate_gflops=rate, context_tokens_per_s=sequences * L / step_s,
               supervised_tokens_per_s=7 * (L // 512) * sequences / step_s,
               projected_rows_per_rank=[1000] + [0] * (P - 1), features_bytes_per_rank=[L * 5120 // P] * P,
               peak_mem_bytes=peak * MiB, bytes_per_step=received, bytes_match=match, comm_wait_s=0.25,
               comm_wait_fwd_s=0.1, comm_wait_bwd_s=0.15, losses=[loss])
    rec.update(extra)
    return rec


def test_the_report_compares_csbp_per_sequence_with_every_baseline_ties_where_the_ranges_overlap():
    records = [_record("single", 1, 16384, [4.0, 4.1, 3.9], rate=10.0),
               _record("csbp", 2, 16384, [0.5, 0.52, 0.51], loss=9.0 * (1 + 2e-7), rate=5.0, peak=40),
               _record("cp", 2, 16384, [2.0, 2.1, 1.9], rate=5.0, peak=80),
               _record("bp", 2, 16384, [0.5, 0.6, 0.7], match=False, rate=5.0, peak=50),
               _record("dp", 2, 16384, [1.6, 1.7, 1.8], rate=10.0, peak=100, cpu=0.5),  # 2 sequences: 0.85 s each
               dict(study="drafter", layout="cp", P=4, L=16384, error="Traceback ...\nMemoryError: killed")]
    rows = {(r["layout"], r["P"]): r for r in benchmark.rows(records)}
    assert rows[("dp", 2)]["per_sequence"].values == (0.8, 0.85, 0.9)
    assert rows[("csbp", 2)]["rate_ratio"] == 0.5 and rows[("dp", 2)]["rate_ratio"] == 1.0
    assert rows[("csbp", 2)]["normalised"].median == pytest.approx(0.255)
    assert rows[("csbp", 2)]["loss_diff"] == pytest.approx(2e-7)
    [entry] = benchmark.comparisons(records)
    against = entry["against"]
    assert against["cp"]["comparison"].ratio == pytest.approx(2.0 / 0.51) and not against["cp"]["comparison"].tie
    assert against["bp"]["comparison"].tie  # [0.5, 0.7] overlaps [0.5, 0.52]
    assert against["dp"]["comparison"].ratio == pytest.approx(0.85 / 0.51)
    assert entry["strongest"] == "bp"  # 0.6 s per sequence against dp's 0.85
    assert against["dp"]["normalised"].ratio == pytest.approx(0.85 / (0.51 * 0.5))
    assert against["dp"]["cpu"].ratio == pytest.approx(0.425 / 0.51) and against["dp"]["cpu"].tie is False
    assert against["cp"]["memory_ratio"] == 0.5 and against["dp"]["memory_ratio"] == 0.4
    section = benchmark.report(records)
    assert "cp is the paper's reference CP-only drafter layout" in section and "2.48x" in section
    assert entry["strongest_cpu"] == "dp"  # 0.425 CPU s per sequence against bp's 0.6
    assert ("| P | L | csbp s/sequence | vs cp (paper) | vs bp | vs dp | strongest | vs strongest | vs strongest, one "
            "core per rank | csbp CPU s/sequence | vs cp, CPU s | vs bp, CPU s | vs dp, CPU s | peak memory csbp/cp | "
            "csbp/bp | csbp/dp |") in section
    assert ("| 2 | 16K | 0.510 [0.500-0.520] | 3.92x | tie (1.18x) | 1.67x | bp | tie (1.18x) | tie (1.18x) | "
            "0.510 [0.500-0.520] | 3.92x | tie (1.18x) | 0.83x | 0.50x | 0.80x | 0.40x |") in section
    assert ("- P = 2: csbp vs cp 3.92x; vs bp 1.18x (1 of 1 ties); vs dp 1.67x; vs strongest 1.18x (1 of 1 ties); by "
            "CPU seconds vs cp 3.92x; by CPU seconds vs bp 1.18x (1 of 1 ties); by CPU seconds vs dp 0.83x; by CPU "
            "seconds vs strongest 0.83x; peak memory") in section
    assert "| 2 | 16K | dp | 32 | 0-1000 | 2 | 0.850 [0.800-0.900] | 0.850 | 1.00 | 0.850 [0.800-0.900] |" in section
    assert "| 2 | 16K | bp | 16 | 0-1000 | 1 | 0.600 [0.500-0.700] |" in section and "| 0.00 | NO |" in section
    assert "| 4 | 16K | cp | - |" in section and "ERROR MemoryError: killed |" in section
    # rows by L, then P, then single / csbp / cp / bp / dp
    assert [(r["layout"], r["P"]) for r in benchmark.rows(records)] == [("single", 1), ("csbp", 2), ("cp", 2),
                                                                         ("bp", 2), ("dp", 2)]


def test_report_only_draws_the_drafter_section_from_its_json(tmp_path):
    (tmp_path / "drafter.json").write_text(json.dumps([
        _record("single", 1, 2048, [0.1, 0.1, 0.1]), _record("csbp", 2, 2048, [0.05, 0.05, 0.06]),
        _record("cp", 2, 2048, [0.08, 0.08, 0.08]), _record("bp", 2, 2048, [0.07, 0.07, 0.07]),
        _record("dp", 2, 2048, [0.13, 0.13, 0.13])]))
    assert cli.main(["bench", "--report-only", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "summary.md").read_text()
    assert "**DFlash2 drafter training: csbp against cp (the paper's baseline), bp and dp**" in md
    assert "| 2 | 2K | cp | 4 | 0-1000 | 1 | 0.080 [0.080-0.080] |" in md
    assert "| 2 | 2K | 0.050 [0.050-0.060] | 1.60x | 1.40x | 1.30x | dp | 1.30x |" in md


def _needed_bytes(batch, plan_of, world: int, layer_windows, kv_width: int) -> list[list[int]]:
    """Per rank (forward, backward) K/V bytes from the mask rule itself: forward, the rows outside its shard that a
    query of its blocks may see; backward, the rows of its shard its ring peers saw (their gradients come home)."""
    from hf_bdlm.models.dflash.modeling import draft_context_mask

    length = batch.sequence_length
    everything = torch.arange(length)[None]
    row = 2 * kv_width * 4  # K and V of one row, float32, one sequence

    def seen(rank, window):
        mine, plan = plan_of(rank).select(batch), plan_of(rank)
        mask = draft_context_mask(mine.anchor_positions, everything, batch.block_size,
                                  anchor_document_starts=mine.document_starts, anchor_valid=mine.anchor_valid,
                                  sliding_window=window)
        lo, hi = plan.context_range
        visible = mask.flatten(0, 2).any(0).nonzero().flatten().tolist() if window else range(length)
        return {p for p in visible if not lo <= p < hi}

    out = []
    for rank in range(world):
        lo, hi = plan_of(rank).context_range
        forward = sum(len(seen(rank, w)) for w in layer_windows) * row
        backward = sum(sum(lo <= p < hi for p in seen(peer, w)) for w in layer_windows
                       for peer in range(world) if peer != rank) * row
        out.append([forward, backward])
    return out


def _one_process_loss(sequence: int, step: int, length: int = 2048, anchors: int = 4) -> float:
    """The loss of one step of benchmark sequence ``sequence`` on one process, from the public pieces the study's
    worker uses (a one-rank plan of the sharded forward, fed only the rows it projects)."""
    from hf_bdlm.models.dflash.training.sharded import DFlashShardPlan, sharded_draft_forward

    drafter = benchmark.benchmark_drafter()
    ids, loss_mask = benchmark.benchmark_tokens(length, sequence=sequence)
    objective = benchmark.benchmark_objective(anchors, sequence)
    batch = objective.prepare(ids, loss_mask, step=step)
    plan = DFlashShardPlan.build(batch, mode="bp", world=1, rank=0, layer_windows=[2048])
    features = benchmark.benchmark_features(plan.projected_runs, drafter.config.feature_width, sequence)
    share = plan.select(batch)
    with torch.no_grad():
        out = sharded_draft_forward(drafter, features, ids, share, plan, None)
        return objective.loss_from_hidden(out.hidden_states, drafter.lm_head.weight, share,
                                          selector=drafter.candidate_selector).item()


@pytest.mark.distributed
def test_the_quick_study_measures_every_layout_with_the_single_process_loss_and_the_needed_bytes(tmp_path):
    import statistics

    from hf_bdlm.models.dflash.modeling import draft_context_mask
    from hf_bdlm.models.dflash.training.sharded import DFlashShardPlan

    out = tmp_path / "bench"
    assert cli.main(["bench", "--only", "drafter", "--quick", "--out", str(out)]) == 0
    records = json.loads((out / "drafter.json").read_text())
    assert not [r["error"] for r in records if "error" in r]
    assert {(r["layout"], r["P"], r["L"]) for r in records} == {("single", 1, 2048), ("csbp", 2, 2048),
                                                               ("cp", 2, 2048), ("bp", 2, 2048), ("dp", 2, 2048)}
    by = {r["layout"]: r for r in records}
    single = by["single"]
    config = benchmark.benchmark_config()
    row = config.feature_width * 4
    batches = {(sequence, step): benchmark.benchmark_objective(4, sequence).prepare(
        *benchmark.benchmark_tokens(2048, sequence=sequence), step=step) for sequence in (0, 1) for step in (1, 2, 3)}

    def seen_by(batch, anchors=slice(None)):
        return int(draft_context_mask(batch.anchor_positions[:, anchors], torch.arange(2048)[None], 8,
                                      anchor_document_starts=batch.document_starts[:, anchors],
                                      anchor_valid=batch.anchor_valid[:, anchors],
                                      sliding_window=2048).flatten(0, 2).any(0).sum())

    def median_over_steps(count, sequence=0):  # the record keeps each rank's median over the timed steps
        return statistics.median(count(batches[(sequence, step)]) for step in (1, 2, 3))

    for layout, r in by.items():
        P, sequences = r["P"], 2 if layout == "dp" else 1
        assert r["steps"] == 3 and len(r["step_times"]) == 3 and r["step_s"] == statistics.median(r["step_times"])
        assert r["sequences_per_step"] == sequences
        assert r["seconds_per_sequence"] == [t / sequences for t in r["step_times"]]
        assert r["anchors"] == 4 and r["supervised_tokens"] == 4 * 7
        assert r["context_tokens_per_s"] == pytest.approx(sequences * 2048 / r["step_s"])
        assert len(r["compute_rates_per_rank"]) == P and all(len(x) == 3 and min(x) > 0
                                                              for x in r["compute_rates_per_rank"])
        assert len(r["cpu_times_per_rank"]) == P and all(len(x) == 3 and min(x) > 0 for x in r["cpu_times_per_rank"])
        assert r["cpu_seconds_per_sequence"] == [max(x[i] for x in r["cpu_times_per_rank"]) / sequences
                                                 for i in range(3)]
        assert all(peak > 0 for peak in r["peak_mem_per_rank"]) and len(r["peak_mem_per_rank"]) == P
        assert r["losses"][0] == pytest.approx(single["losses"][0], rel=1e-5)  # the group's loss is one process's
        assert r["bytes_match"]
        if layout in ("single", "dp"):
            assert r["bytes_per_rank"] == [0] * P
            continue
        last = batches[(0, 3)]  # the bytes are the last timed step's

        def plan_of(rank, layout=layout):
            return DFlashShardPlan.build(last, mode=layout, world=2, rank=rank, layer_windows=[2048])

        needed = _needed_bytes(last, plan_of, 2, [2048], config.num_key_value_heads * config.head_dim)
        assert r["bytes_fwd_bwd_per_rank"] == needed, layout
        assert (sum(map(sum, needed)) > 0) == (layout != "bp")
    assert by["cp"]["anchors_per_rank"] == [4, 4] and by["csbp"]["anchors_per_rank"] == [2, 2]
    assert by["dp"]["anchors_per_rank"] == [4, 4]
    # dp: rank 0 trains the single process's sequence (the same arithmetic: the same loss, bit for bit), rank 1 a
    # sequence of its own, whose loss one process computes again here
    assert by["dp"]["losses_per_rank"][0] == single["losses"]
    assert by["dp"]["losses_per_rank"][1][0] == pytest.approx(_one_process_loss(sequence=1, step=1), rel=1e-5)
    assert by["dp"]["losses_per_rank"][1][0] != single["losses"][0]
    # rows projected (every layer slides: only those an anchor of the ring sees), from the mask rule, each rank's
    # median over the timed steps
    assert single["projected_rows_per_rank"] == [median_over_steps(seen_by)]
    assert by["dp"]["projected_rows_per_rank"] == [median_over_steps(seen_by), median_over_steps(seen_by, 1)]

    def split(b, rank):  # one ring of both ranks: its anchors are all anchors, their rows split evenly
        return [seen_by(b) // 2, seen_by(b) - seen_by(b) // 2][rank]

    for layout in ("cp", "csbp"):
        assert by[layout]["projected_rows_per_rank"] == [median_over_steps(lambda b, k=k: split(b, k))
                                                         for k in range(2)]
        # the features held are those rows' (what the trainer reads), the largest step's
        assert by[layout]["features_bytes_per_rank"] == [max(split(batches[(0, t)], k) for t in (1, 2, 3)) * row
                                                         for k in range(2)]
    assert single["features_bytes_per_rank"] == [max(seen_by(batches[(0, t)]) for t in (1, 2, 3)) * row]
    assert by["dp"]["features_bytes_per_rank"] == [max(seen_by(batches[(q, t)]) for t in (1, 2, 3)) * row
                                                   for q in range(2)]

    def bp_rows(rank):
        def count(b):
            plan = DFlashShardPlan.build(b, mode="bp", world=2, rank=rank, layer_windows=[2048])
            return seen_by(b, plan.anchor_index)
        return median_over_steps(count)

    assert by["bp"]["projected_rows_per_rank"] == [bp_rows(0), bp_rows(1)]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["studies"]["drafter"]["failed"] == 0
    md = (out / "summary.md").read_text()
    assert "cp is the paper's reference CP-only drafter layout" in md and "| 2 | 2K | cp | 4 | " in md
    assert "| P | L | csbp s/sequence | vs cp (paper) | vs bp | vs dp | strongest |" in md
