"""Failure behaviour of block parallelism: clear errors instead of wrong results or hangs.

One launch of tests/distributed/failure_worker.py runs the cases (a disagreement, the groups' timeouts, then a hung
collective)."""

import json

import pytest

from torchrun import run_torchrun

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    out = tmp_path_factory.mktemp("failures") / "f"
    run_torchrun("failure_worker.py", 2, "--out", str(out), timeout=120)
    return out


def _error(out, case: str, rank: int):
    return json.loads(out.with_name(f"{out.name}.{case}.{rank}").read_text())["error"]


def test_ranks_disagreeing_on_the_plan_all_raise_the_same_error(out):
    errors = [_error(out, "disagree", r) for r in (0, 1)]
    assert errors[0] == errors[1]
    assert "disagree on the block-parallel plan" in errors[0]
    assert "rank 0: (64," in errors[0] and "rank 1: (128," in errors[0]


def test_hung_collective_times_out_naming_group_and_step(out):
    error = _error(out, "timeout", 0)
    assert error is not None
    assert "clean_ring[0.0]" in error and "step 5" in error and "all_gather(k)" in error


def test_every_group_of_the_mesh_has_the_run_timeout(out):
    """The run's timeout (the trainer's ddp_timeout) reaches every group smaller than the world; a dim spanning the world
    is the default group, whose timeout Accelerate sets to the same ddp_timeout."""
    for rank in (0, 1):
        found = json.loads(out.with_name(f"{out.name}.mesh_timeouts.{rank}").read_text())
        for name, group in found["dims"].items():
            if group["size"] < 2:
                assert group["timeout_s"] == 7.0 and not group["is_default_group"], (name, group)
            else:
                assert group["is_default_group"] and group["timeout_s"] == found["default_group_timeout_s"], (name, group)
