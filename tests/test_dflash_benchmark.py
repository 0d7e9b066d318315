"""The drafter study of `hf-bdlm bench` (hf_bdlm/models/dflash/benchmark.py): the benchmark drafter and its inputs, the
launches a run makes, option errors before anything runs, the report on synthetic records, and the quick study end to
end (every layout at P = 2 beside one process: equal losses; every rank's received K/V bytes, projected context rows
and held feature rows equal to what the mask rule and the layout say)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from hf_bdlm import cli
from hf_bdlm.models.dflash import benchmark
from hf_bdlm.models.dflash.benchmark import DrafterStudy

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
    study = DrafterStudy(lengths=(1024, 2048), nprocs=(2, 4), layouts=("csbp", "cp", "bp"), layers=1, window=2048,
                         anchors=None, steps=1, timeout=60.0)
    configs = study.configurations()
    assert len(configs) == 2 * (1 + 2 * 3)
    assert configs[:7] == [("single", 1, 1024), ("csbp", 2, 1024), ("cp", 2, 1024), ("bp", 2, 1024),
                           ("csbp", 4, 1024), ("cp", 4, 1024), ("bp", 4, 1024)]
    assert (study.anchors_at(1024), study.anchors_at(2048)) == (2, 4)
    assert dataclasses.replace(study, anchors=7).anchors_at(2048) == 7


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


def _record(layout, P, L, step_s, loss=9.0, match=True, **extra):
    received = 0 if layout in ("single", "bp") else MiB
    share = L // 512 // (1 if layout in ("single", "cp") else P)
    rec = dict(study="drafter", layout=layout, P=P, C=1 if layout in ("single", "bp") else P, L=L, layers=1,
               window=2048, anchors=L // 512, anchors_per_rank=[share] * P,
               step_s=step_s, context_tokens_per_s=L / step_s, supervised_tokens_per_s=7 * (L // 512) / step_s,
               projected_rows_per_rank=[1000] + [0] * (P - 1), features_bytes_per_rank=[L * 5120 // P] * P,
               peak_mem_bytes=100 * MiB // P, bytes_per_step=received, bytes_match=match, comm_wait_s=0.25,
               comm_wait_fwd_s=0.1, comm_wait_bwd_s=0.15, losses=[loss])
    rec.update(extra)
    return rec


def test_the_report_gives_every_row_csbps_speedup_over_cp_and_bp_and_the_byte_check():
    records = [_record("single", 1, 16384, 4.0), _record("csbp", 2, 16384, 0.5, loss=9.0 * (1 + 2e-7)),
               _record("cp", 2, 16384, 2.0), _record("bp", 2, 16384, 1.0, match=False),
               dict(study="drafter", layout="cp", P=4, L=16384, error="Traceback ...\nMemoryError: killed")]
    rows = {(r["layout"], r["P"]): r for r in benchmark.rows(records)}
    assert rows[("cp", 2)]["csbp_speedup"] == 4.0 and rows[("bp", 2)]["csbp_speedup"] == 2.0
    assert rows[("csbp", 2)]["csbp_speedup"] is None and rows[("single", 1)]["csbp_speedup"] is None
    assert rows[("csbp", 2)]["loss_diff"] == pytest.approx(2e-7)
    section = benchmark.report(records)
    assert "cp is the paper's reference CP-only drafter layout" in section and "2.48x" in section
    assert ("| P | L | layout | anchors/rank | rows projected/rank | step s | context tok/s | supervised tok/s | "
            "features MiB/rank | peak MiB/rank | K/V MiB/rank | = context_bytes | wait s (fwd/bwd) | loss vs P=1 | "
            "CSBP speed-up |") in section
    assert ("| 2 | 16K | cp | 32 | 0-1000 | 2.000 | 8192 | 112.0 | 40.0 | 50.0 | 1.00 | yes | 0.250 (0.100/0.150) | "
            "0e+00 | 4.00x |") in section
    assert "| 1 | 16K | single | 32 | 1000 | 4.000 | 4096 | 56.0 | 80.0 | 100.0 | 0.00 | yes |" in section
    assert "| 2 | 16K | bp | 16 | 0-1000 | 1.000 | 16384 | 224.0 | 40.0 | 50.0 | 0.00 | NO |" in section
    assert "| 4 | 16K | cp | - |" in section and "ERROR MemoryError: killed |" in section
    # rows by L, then P, then single / csbp / cp / bp
    assert [(r["layout"], r["P"]) for r in benchmark.rows(records)] == [("single", 1), ("csbp", 2), ("cp", 2),
                                                                         ("bp", 2)]


def test_report_only_draws_the_drafter_section_from_its_json(tmp_path):
    (tmp_path / "drafter.json").write_text(json.dumps([_record("single", 1, 2048, 0.1), _record("csbp", 2, 2048, 0.05),
                                                       _record("cp", 2, 2048, 0.08), _record("bp", 2, 2048, 0.07)]))
    assert cli.main(["bench", "--report-only", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "summary.md").read_text()
    assert "**DFlash2 drafter training: csbp, cp and bp**" in md and "| 2 | 2K | cp | 4 | 0-1000 | 0.080 |" in md


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


@pytest.mark.distributed
def test_the_quick_study_measures_every_layout_with_the_single_process_loss_and_the_needed_bytes(tmp_path):
    from hf_bdlm.models.dflash.sharded import DFlashShardPlan

    out = tmp_path / "bench"
    assert cli.main(["bench", "--only", "drafter", "--quick", "--out", str(out)]) == 0
    records = json.loads((out / "drafter.json").read_text())
    assert not [r["error"] for r in records if "error" in r]
    assert {(r["layout"], r["P"], r["L"]) for r in records} == {("single", 1, 2048), ("csbp", 2, 2048),
                                                               ("cp", 2, 2048), ("bp", 2, 2048)}
    by = {r["layout"]: r for r in records}
    single = by["single"]
    config = benchmark.benchmark_config()
    ids, loss_mask = benchmark.benchmark_tokens(2048)
    # --quick: the suite's 3 timed steps, each drawing its own anchors. A record's bytes and anchors are its last
    # step's, its projected rows the median over the steps, its feature bytes the largest step's.
    batches = [benchmark.benchmark_objective(4).prepare(ids, loss_mask, step=step) for step in (1, 2, 3)]
    batch = batches[-1]
    for layout, r in by.items():
        assert r["steps"] == 3 and r["step_s"] > 0 and r["anchors"] == 4 and r["supervised_tokens"] == 4 * 7
        assert r["context_tokens_per_s"] == pytest.approx(2048 / r["step_s"])
        assert all(peak > 0 for peak in r["peak_mem_per_rank"]) and len(r["peak_mem_per_rank"]) == r["P"]
        assert r["losses"][0] == pytest.approx(single["losses"][0], rel=1e-5)  # the group's loss is one process's
        assert r["bytes_match"]
        if layout == "single":
            continue

        def plan_of(rank, layout=layout):
            return DFlashShardPlan.build(batch, mode=layout, world=2, rank=rank, layer_windows=[2048])

        needed = _needed_bytes(batch, plan_of, 2, [2048], config.num_key_value_heads * config.head_dim)
        assert r["bytes_fwd_bwd_per_rank"] == needed, layout
        assert (sum(map(sum, needed)) > 0) == (layout != "bp")
    assert by["cp"]["anchors_per_rank"] == [4, 4] and by["csbp"]["anchors_per_rank"] == [2, 2]
    # rows projected (every layer slides: only those an anchor of the ring sees), from the mask rule; the features held
    # are those rows' (what the trainer reads)
    from hf_bdlm.models.dflash.modeling import draft_context_mask

    def seen_by(step_batch, anchors):
        return int(draft_context_mask(step_batch.anchor_positions[:, anchors], torch.arange(2048)[None], 8,
                                      anchor_document_starts=step_batch.document_starts[:, anchors],
                                      anchor_valid=step_batch.anchor_valid[:, anchors],
                                      sliding_window=2048).flatten(0, 2).any(0).sum())

    def per_step(rows_of):  # rows_of(step batch) -> rows per rank, for each timed step
        return [rows_of(b) for b in batches]

    def median(steps):  # per rank, the median over the steps
        return [sorted(rank_rows)[1] for rank_rows in zip(*steps)]

    row = config.feature_width * 4
    seen = per_step(lambda b: [seen_by(b, slice(None))])
    assert single["projected_rows_per_rank"] == median(seen) and all(0 < s[0] < 2048 for s in seen)
    assert single["features_bytes_per_rank"] == [max(s[0] for s in seen) * row]
    for layout in ("cp", "csbp"):  # one ring of both ranks: its anchors are all anchors, their rows split evenly
        split = per_step(lambda b: [seen_by(b, slice(None)) // 2, -(-seen_by(b, slice(None)) // 2)])
        assert sorted(by[layout]["projected_rows_per_rank"]) == median(split)
    bp = per_step(lambda b: [seen_by(b, DFlashShardPlan.build(b, mode="bp", world=2, rank=r,
                                                               layer_windows=[2048]).anchor_index) for r in range(2)])
    assert by["bp"]["projected_rows_per_rank"] == median(bp)
    assert by["bp"]["features_bytes_per_rank"] == [max(rows) * row for rows in zip(*bp)]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["studies"]["drafter"]["failed"] == 0
    md = (out / "summary.md").read_text()
    assert "cp is the paper's reference CP-only drafter layout" in md and "| 2 | 2K | cp | 4 | " in md
