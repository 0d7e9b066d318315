"""The GPU runbook (benchmarks/gpu/run.sh, benchmarks/gpu/runbook.py): its dry-run exercises every section on the CPU
end to end, its exactness check catches a wrong backend and a wrong layout, and without a GPU it stops clearly.
What only a GPU shows is in docs/gpu.md."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch

from benchmarks.gpu import runbook
from hf_bdlm.attention import BACKENDS
from paths import ROOT



def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runbook")
    proc = subprocess.run(["bash", "benchmarks/gpu/run.sh", "--dry-run", "--out", str(out)], cwd=ROOT,
                          env=dict(os.environ, PYTHON=sys.executable), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "runbook.json").read_text()), (out / "summary.txt").read_text(), proc.stdout


def test_dry_run_checks_every_backend_and_layout_against_float64_dense(dry_run):
    report, _, _ = dry_run
    assert report["profile"] == "dry-run" and report["failed_checks"] == 0
    assert not report["skipped_sections"] and set(runbook.SECTIONS) <= set(report)
    run = report["checks"]["cases"]
    assert not [c for c in run if "skipped" in c]  # nothing skipped for lack of time
    assert all(c["ok"] and _number(c["max_err"]) for c in run), [c for c in run if not c.get("ok")]
    assert {c["backend"] for c in run} == set(BACKENDS)
    fwd_bwd = {(c["backend"], c["layout"]) for c in run if c["backward"]}
    assert {("blockwise", layout) for layout in runbook.LAYOUTS} | {("dense", "local")} <= fwd_bwd
    assert [c["backward"] for c in run if c["backend"] == "flex"] == [False]  # CPU: one forward, no backward
    fp32 = max(c["max_err"] for c in run if c["dtype"] == "float32")
    bf16 = max(c["max_err"] for c in run if c["dtype"] == "bfloat16")
    assert fp32 <= 3e-6, fp32  # measured up to 1.4e-6
    assert 1e-4 < bf16 <= 3e-2, bf16  # measured 5.5e-3 .. 1.1e-2: bf16 rounding, within the tolerance


def test_dry_run_measures_training_decoding_and_csbp_beside_the_planner(dry_run):
    report, summary, stdout = dry_run
    train = report["training"]["records"]
    assert [r["L"] for r in train] == sorted(runbook.DRY.train_lengths)
    assert any(r["checkpointing"] for r in train) and not all(r["checkpointing"] for r in train)
    for r in train:
        p = r["predicted"]
        assert all(_number(r[k]) and r[k] > 0 for k in ("step_s", "tokens_per_s", "optimizer_s")), r
        assert _number(r["peak_mem_bytes"]) and r["finite_loss"]
        assert p["range_step_s"][0] <= p["step_s"] <= p["range_step_s"][1]
        assert p["range_peak_mem_bytes"][0] <= p["peak_mem_bytes"] <= p["range_peak_mem_bytes"][1]
    dec = report["decoding"]
    assert "ended_early" not in dec  # it ran in a process of its own, as every section does on a GPU
    assert len(dec["block_steps"]) == len(runbook.DRY.decode_batches) * len(runbook.DRY.decode_prefixes)
    for r in dec["block_steps"] + dec["generate"]:
        rate = r.get("forwards_per_s", r.get("tokens_per_s"))
        assert _number(rate) and rate > 0, r
        lo, hi = r["predicted"].get("range_forwards_per_s") or r["predicted"]["range_tokens_per_s"]
        assert 0 < lo < hi
    assert {r["batch"] for r in dec["generate"]} == set(runbook.DRY.decode_batches)
    [csbp] = report["parallel"]["records"]
    assert (csbp["mode"], csbp["P"]) == ("csbp", 2) and _number(csbp["step_s"])
    assert csbp["in_range"]["bytes_per_step"], (csbp["bytes_per_step"], csbp["predicted"])  # the planner's bytes
    for heading in ("1. exactness", "2. training", "3. decoding", "4. parallel"):
        assert heading in summary and heading in stdout


def test_check_fails_a_backend_that_ignores_the_window(monkeypatch):
    from hf_bdlm.attention import backends

    blockwise = backends._DISPATCH["blockwise"]

    def windowless(q, sources, q_rows, k_rows, rule, scale, cache):
        return blockwise(q, sources, q_rows, k_rows, rule.with_window(None), scale, cache)

    monkeypatch.setitem(backends._DISPATCH, "blockwise", windowless)
    result = runbook.check_backend("blockwise", "float32", "block_causal", 96, device="cpu", L=256)
    assert not result["ok"] and result["max_err"] > 1e-2


def test_check_of_a_p2_layout_fails_when_a_rank_misses_its_peers_rows(monkeypatch):
    """The emulated ranks attend to what they would receive: drop the received source and csbp's check fails."""
    from hf_bdlm.attention import backends

    blockwise = backends._DISPATCH["blockwise"]

    def own_rows_only(q, sources, q_rows, k_rows, rule, scale, cache):
        return blockwise(q, sources[:1], q_rows, k_rows[:1], rule, scale, cache)

    assert runbook.check_backend("blockwise", "float32", "block_causal", None, device="cpu", L=256,
                                 layout="csbp")["ok"]
    monkeypatch.setitem(backends._DISPATCH, "blockwise", own_rows_only)
    result = runbook.check_backend("blockwise", "float32", "block_causal", None, device="cpu", L=256, layout="csbp")
    assert not result["ok"] and result["max_err"] > 1e-2


def test_past_a_sections_deadline_nothing_starts_and_the_planner_still_prices_the_1b_model():
    """What the budget skips is listed (the dry-run's budget is never reached); on an H100 the planner runs 16K
    without checkpointing and 32K with it (docs/gpu.md)."""
    spent = runbook.Clock(time.time(), {name: time.time() - 1 for name in runbook.SECTIONS})
    checks = runbook.run_checks(runbook.DRY, clock=spent, backends=("blockwise",))
    assert checks["cases"] and all("time budget" in c["skipped"] for c in checks["cases"])
    h100, note = runbook.gpu_device("NVIDIA H100 80GB HBM3", 85_520_809_984)
    assert note is None and h100.name == "h100"
    train = runbook.run_training(replace(runbook.GPU, train_lengths=(16384, 32768)), h100, True, spent)
    assert train["params"] == 1_137_836_032
    assert [(r["L"], r["checkpointing"]) for r in train["records"]] == [(16384, False), (32768, True)]
    assert all("time budget" in r["skipped"] for r in train["records"])
    assert all(r["predicted"]["fits"] and r["predicted"]["step_s"] > 0 for r in train["records"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_runbook_without_gpu_exits_2_with_a_message(capsys):
    assert runbook.main(["--out", "unused"]) == 2
    assert "no CUDA device is visible" in capsys.readouterr().err
