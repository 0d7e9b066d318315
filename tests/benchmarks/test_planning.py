"""`hf-bdlm bench --only planning` (hf_bdlm.benchmarks.planning_study): a tiny real run through the command (two lengths,
every layout and variant, each measured in a process forked from the study's server) carries real numbers for every
layout into planning.json and summary.md, draws planning.png, and shows that a cached step builds no block mask; the
targets are marked from the records."""

import json
import math

from hf_bdlm import cli
from hf_bdlm.benchmarks import planning_study as planning

LENGTHS = (2048, 4096)


def test_the_planning_study_records_every_layout_and_a_cached_step_plans_nothing(tmp_path):
    args = ["bench", "--only", "planning", "--out", str(tmp_path), "--planning-lengths", *map(str, LENGTHS),
            "--planning-block-sizes", "32", "--planning-processes", "1", "--planning-old-max-length", "2048"]
    assert cli.main(args) == 0
    records = json.loads((tmp_path / "planning.json").read_text())
    plans = {(r["layout"], r["variant"], r["L"], r["planner"]): r for r in records if r["kind"] == "plan"}
    for layout, variants in planning.LAYOUTS.items():
        for variant in variants:
            for L in LENGTHS:
                rec = plans[(layout, variant, L, "block_mask")]
                assert "error" not in rec, rec.get("error")
                assert 0 < rec["first_s"] < 60 and 0 < rec["warm_s"] < 60
                assert rec["index_bytes"] > 0 and rec["kv_partial"] + rec["kv_full"] > 0
                assert math.isfinite(rec["rss_over_baseline_mb"]) and rec["B"] == 32
            old = plans[(layout, variant, 2048, "tiles")]  # the CPU path's planner, beside it up to its limit
            assert "error" not in old and old["first_s"] > 0 and old["kernel_calls"] > 0
            assert (layout, variant, 4096, "tiles") not in plans
    csbp = plans[(f"csbp-P{planning.GROUP}", "full", 4096, "block_mask")]
    assert len(csbp["first_by_rank_s"]) == planning.GROUP and len(csbp["key_rows"]) == 2  # own rows, then the peers'
    cached = next(r for r in records if r["kind"] == "cached_step")
    assert "error" not in cached, cached.get("error")
    for backend in ("flex", "blockwise"):
        for packed in (False, True):
            steps = {s["step"]: s for s in cached["steps"] if (s["backend"], s["packed"]) == (backend, packed)}
            assert steps[1]["builds"] == 1 and steps[2]["builds"] == 0 and steps[2]["build_s"] == 0
            assert steps[1]["layout_id"] == steps[2]["layout_id"]  # the step reused the kept layout
    summary = (tmp_path / "summary.md").read_text()
    assert "Host planning of a fresh layout" in summary and "A cached step plans nothing" in summary
    for layout, variants in planning.LAYOUTS.items():
        for variant in variants:
            for L in ("2K", "4K"):
                row = next(line for line in summary.splitlines()
                           if line.startswith(f"| {L} | {layout} | {variant} | 32 |"))
                first, warm = (float(x) for x in row.split("|")[5:7])
                assert first > 0 and warm > 0
    assert (tmp_path / "planning.png").stat().st_size > 10_000


def _plan(L, first, warm, rss_mb=1.0, index_mb=2.0, layout="one-device", variant="full", B=32):
    return dict(kind="plan", layout=layout, variant=variant, L=L, B=B, planner="block_mask", processes=1,
                first_s=first, warm_s=warm, rss_over_baseline_mb=rss_mb, index_bytes=int(index_mb * 2**20),
                kv_partial=1, kv_full=1)


def test_targets_are_marked_met_or_not_from_the_records():
    records = [_plan(131072, 0.25, 0.15), _plan(1048576, 4.0, 3.0, rss_mb=5000, index_mb=4096)]
    text = planning.targets_table(records)
    row_128k = next(line for line in text.splitlines() if "at 128K" in line)
    row_1m = next(line for line in text.splitlines() if "at 1M" in line)
    assert "**not met** | 0.150 | met" in row_128k  # first over 0.2 s, warm under
    assert row_1m.count("| met") == 2
    assert "| one-device | full | 32 | 128K | 1M (5000 / 4096) |" in planning.memory_table(records)
