"""Sharded sliding-window attention under both window conventions equals the single process.

A sliding-window layer fetches only the clean keys its rank's windows reach (``masks.keys_in_window``); for each
convention (``per_query``, ``block_start``), clean stream (block-causal, token-causal) and mode (``cp``, ``csbp``) the
loss and gradients of a 2-rank group must equal the single-process reference. The worker
(tests/distributed/window_convention_worker.py) runs in the shared 2-process launch (tests/torchrun.py):
``python -m pytest tests/parallel/test_window_conventions.py -q``.
"""

import json

import pytest

from torchrun import SharedJob

pytestmark = pytest.mark.distributed

# The model is float64 but transformers' RMSNorm rounds through float32: measured loss errors <= 2.2e-16 and gradient
# errors <= 3.2e-7 (relative to the largest element); a key missing from a window moves the loss itself.
LOSS_TOL, GRAD_TOL = 1e-12, 2e-6
SHARED_JOBS = [SharedJob("window_conventions", "window_convention_worker.py", 2, ("--out", "{out}/windows.json"))]


def test_sharded_windows_equal_single_process_under_both_conventions(shared_launch):
    cases = json.loads((shared_launch.folder("window_conventions", 2) / "windows.json").read_text())
    assert {(c["convention"], c["clean"], c["mode"]) for c in cases} == {
        (conv, clean, mode) for conv in ("per_query", "block_start")
        for clean in ("block_causal", "causal") for mode in ("cp", "csbp")
    }
    bad = [c for c in cases if c["loss_err"] > LOSS_TOL or c["grad_err"] > GRAD_TOL]
    assert not bad, bad
