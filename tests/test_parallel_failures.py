"""Failure behaviour of block parallelism: clear errors instead of wrong results or hangs."""

import json

import pytest

from torchrun import run_torchrun

pytestmark = pytest.mark.distributed


def test_ranks_disagreeing_on_the_plan_all_raise_the_same_error(tmp_path):
    out = tmp_path / "f"
    run_torchrun("failure_worker.py", 2, "--case", "disagree", "--out", str(out), timeout=120)
    errors = [json.loads((tmp_path / f"f.{r}").read_text())["error"] for r in (0, 1)]
    assert errors[0] == errors[1]
    assert "disagree on the block-parallel plan" in errors[0]
    assert "rank 0: (64," in errors[0] and "rank 1: (128," in errors[0]


def test_hung_collective_times_out_naming_group_and_step(tmp_path):
    out = tmp_path / "f"
    run_torchrun("failure_worker.py", 2, "--case", "timeout", "--out", str(out), timeout=120)
    error = json.loads((tmp_path / "f.0").read_text())["error"]
    assert error is not None
    assert "clean_ring[0.0]" in error and "step 5" in error and "all_gather(k)" in error
