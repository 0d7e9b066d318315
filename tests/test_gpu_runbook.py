"""The GPU runbook (benchmarks/gpu/runbook.py): its exactness check runs on CPU here for the
backends that train on CPU, catches a wrong backend, and the script stops clearly without a GPU.
On a GPU machine the whole runbook is run by hand (see its docstring)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gpu import runbook


def test_check_of_blockwise_against_float64_dense_passes_on_cpu():
    results = runbook.run_checks("cpu", backends=("blockwise",), L=256)
    assert len(results) == 8  # 2 dtypes x 2 clean-stream kinds x (no window, window)
    assert all(r["ok"] for r in results), results
    fp32 = max(r["max_err"] for r in results if r["dtype"] == "float32")
    bf16 = max(r["max_err"] for r in results if r["dtype"] == "bfloat16")
    assert fp32 <= 3e-6, fp32  # measured 6.3e-7
    assert 1e-4 < bf16 <= 3e-2, bf16  # measured 6.7e-3 .. 1.1e-2: bf16 rounding, within the tolerance


def test_check_fails_a_backend_that_ignores_the_window(monkeypatch):
    from hf_bdlm.attention import backends

    blockwise = backends._DISPATCH["blockwise"]

    def windowless(q, sources, q_rows, k_rows, rule, scale, cache):
        return blockwise(q, sources, q_rows, k_rows, rule.with_window(None), scale, cache)

    monkeypatch.setitem(backends._DISPATCH, "blockwise", windowless)
    result = runbook.check_backend("blockwise", "float32", "block_causal", 96, device="cpu", L=256)
    assert not result["ok"] and result["max_err"] > 1e-2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_runbook_without_gpu_exits_2_with_a_message(capsys):
    assert runbook.main(["--out", "unused"]) == 2
    assert "no CUDA device is visible" in capsys.readouterr().err
