"""GPU runbook: one script that checks and times hf_bdlm on the NVIDIA GPUs of a machine.

    python -m benchmarks.gpu.runbook --out gpu_results          # < 8 min on one H200

It needs an environment with CUDA torch and this package installed (``pip install -e '.[dev]'``, and
``'.[flash]'`` for flash-attn); without a visible GPU it stops at once with a message (exit code 2).
Three parts, one JSON file (``--out``/``runbook.json``) and a short table on stdout:

1. **Exactness**: every GPU backend (``blockwise``, ``flex``, ``flash`` when flash-attn is installed)
   against the ``dense`` reference computed in float64 on the same device, forward and backward (output,
   dq, dk, dv), for the block-causal and causal clean streams, with and without a sliding window, on a
   packed batch of two documents. float32 (TF32 off) must agree to ``1e-4`` relative, bfloat16 to ``3e-2``
   (flash-attn runs bf16 only). A failed check makes the exit code 1.
2. **Attention timings** (bf16, batch 1, 8 query / 2 KV heads, head dim 128, block 64, the ``2L``
   vectorized rows): forward + backward time (median of 3 after a warm-up) and peak allocator memory per
   backend and length. ``dense`` builds the ``2L x 2L`` mask and is timed up to ``--dense-max-len``;
   ``flex`` runs eagerly (not under ``torch.compile``) and is timed up to the same length.
3. **Parallel modes**: :mod:`hf_bdlm.benchmarks.parallel_modes` with ``--device cuda --dtype bfloat16`` (NCCL, one
   rank per GPU) over all visible GPUs: the single-GPU step, then ``cp``/``csbp`` with both transports and
   ``bp`` with both schedules at P = number of GPUs, at each ``--lengths``. With one GPU only the
   single-GPU step runs (the parallel modes need at least two) and the JSON says so.

``--budget-minutes`` bounds parts 2 and 3: what would start after the budget is skipped and listed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import platform
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}
CHECK_BACKENDS = ("blockwise", "flex", "flash")


def environment() -> dict:
    import torch

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda, gpus=gpus,
                flash_attn=importlib.util.find_spec("flash_attn") is not None,
                nccl=".".join(map(str, torch.cuda.nccl.version())) if gpus else None)


def _rel_err(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300))


def _inputs(L: int, block: int, heads: int, kv_heads: int, dim: int, device: str, seed: int = 0):
    import torch

    from hf_bdlm.attention import vectorized_rows

    g = torch.Generator().manual_seed(seed)
    half = L // block // 2
    doc = torch.cat([torch.zeros(half * block, dtype=torch.long), torch.ones(L - half * block, dtype=torch.long)])
    rows = vectorized_rows(L, doc[None].to(device))
    q = torch.randn(1, heads, 2 * L, dim, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, kv_heads, 2 * L, dim, generator=g, dtype=torch.float64) for _ in "kv")
    grad = torch.randn(1, heads, 2 * L, dim, generator=g, dtype=torch.float64)
    return rows, [t.to(device) for t in (q, k, v, grad)]


def _fwd_bwd(backend, q, k, v, grad, rows, rule, dtype):
    from hf_bdlm.attention import attend

    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out = attend(backend, q, [(k, v)], rows, [rows], rule, q.shape[-1] ** -0.5, {})
    out.backward(grad.to(dtype))
    return [out.detach(), q.grad, k.grad, v.grad]


def check_backend(backend: str, dtype_name: str, kind: str, window: int | None, device: str = "cuda",
                  L: int = 1024, block: int = 64) -> dict:
    """Max relative error of a backend against float64 dense attention (output and the three gradients)."""
    import torch

    from hf_bdlm.attention import MaskRule

    rule = MaskRule(block, kind, window)
    rows, (q, k, v, grad) = _inputs(L, block, 4, 2, 64, device)
    want = _fwd_bwd("dense", q, k, v, grad, rows, rule, torch.float64)
    got = _fwd_bwd(backend, q, k, v, grad, rows, rule, getattr(torch, dtype_name))
    errors = {name: _rel_err(a, b) for name, a, b in zip(("out", "dq", "dk", "dv"), got, want)}
    worst = max(errors.values())
    return dict(backend=backend, dtype=dtype_name, kind=kind, window=window, L=L, errors=errors, max_err=worst,
                tolerance=TOLERANCE[dtype_name], ok=worst <= TOLERANCE[dtype_name])


def run_checks(device: str = "cuda", backends=CHECK_BACKENDS, L: int = 1024) -> list[dict]:
    import torch

    results = []
    for backend in backends:
        for dtype_name in ("float32", "bfloat16"):
            for kind in ("block_causal", "causal"):
                for window in (None, 96):
                    case = dict(backend=backend, dtype=dtype_name, kind=kind, window=window, L=L)
                    if backend == "flash" and dtype_name == "float32":
                        continue  # flash-attn has no float32 kernels (the backend says so)
                    if backend == "flash" and importlib.util.find_spec("flash_attn") is None:
                        results.append(dict(case, skipped="flash-attn is not installed (pip install 'hf-bdlm[flash]')"))
                        continue
                    try:
                        results.append(check_backend(backend, dtype_name, kind, window, device, L))
                    except Exception as exc:  # reported, and the run is marked failed
                        results.append(dict(case, ok=False, error=f"{type(exc).__name__}: {exc}"[:500]))
                    if device == "cuda":
                        torch.cuda.empty_cache()
    return results


def time_backend(backend: str, L: int, repeats: int = 3, block: int = 64) -> dict:
    import torch

    from hf_bdlm.attention import MaskRule

    rule = MaskRule(block, "block_causal")
    rows, (q, k, v, grad) = _inputs(L, block, 8, 2, 128, "cuda")
    q, k, v, grad = (t.bfloat16() for t in (q, k, v, grad))
    times = []
    for i in range(1 + repeats):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        _fwd_bwd(backend, q, k, v, grad, rows, rule, torch.bfloat16)
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    return dict(backend=backend, L=L, fwd_bwd_s=statistics.median(times),
                peak_mem_bytes=torch.cuda.max_memory_allocated() - base)


def run_timings(lengths, dense_max_len: int, deadline: float) -> list[dict]:
    import torch

    results = []
    backends = ["dense", "blockwise", "flex"] + (["flash"] if importlib.util.find_spec("flash_attn") else [])
    for L in lengths:
        for backend in backends:
            case = dict(backend=backend, L=L)
            if backend in ("dense", "flex") and L > dense_max_len:
                results.append(dict(case, skipped=f"L > --dense-max-len {dense_max_len} (materializes 2L x 2L)"))
            elif time.time() > deadline:
                results.append(dict(case, skipped="time budget spent"))
            else:
                try:
                    results.append(time_backend(backend, L))
                except Exception as exc:
                    results.append(dict(case, error=f"{type(exc).__name__}: {exc}"[:500]))
            torch.cuda.empty_cache()
    return results


def run_parallel(lengths, layers: int, steps: int, backend: str, deadline: float, timeout: float) -> dict:
    import torch

    from hf_bdlm.benchmarks import parallel_modes

    gpus = torch.cuda.device_count()
    args = parallel_modes.launch_args(layers, steps, timeout, "cuda", "bfloat16", backend)
    nprocs = (gpus,) if gpus >= 2 else ()
    configs = [(m, P, L, t, s) for L in lengths
               for m, P, t, s in parallel_modes.configurations(("cp", "bp", "csbp"), nprocs)]
    records, skipped = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for mode, P, L, transport, schedule in configs:
            if time.time() > deadline:
                skipped.append(dict(mode=mode, P=P, L=L, transport=transport, schedule=schedule))
                continue
            rec = parallel_modes.launch(mode, P, L, args, pathlib.Path(tmp), transport, schedule)
            print("  " + parallel_modes.table([rec]).splitlines()[-1], flush=True)
            records.append(rec)
    note = None if gpus >= 2 else f"{gpus} GPU visible: the parallel modes need at least 2; single-GPU steps only"
    return dict(gpus=gpus, attention_backend=backend, layers=layers, records=records, skipped_for_time=skipped,
                note=note)


def table(report: dict) -> str:
    lines = ["exactness (max relative error vs float64 dense, output and gradients):"]
    for c in report["checks"]:
        name = f"  {c['backend']:9} {c['dtype']:8} {c['kind']:12} w={str(c['window']):4}"
        if "skipped" in c:
            lines.append(f"{name} skipped: {c['skipped']}")
        elif "error" in c:
            lines.append(f"{name} FAILED: {c['error'][:100]}")
        else:
            lines.append(f"{name} {c['max_err']:.2e} (tol {c['tolerance']:.0e}) {'ok' if c['ok'] else 'FAILED'}")
    lines.append("attention fwd+bwd, bf16, H=8/2, d=128:")
    for t in report["timings"]:
        name = f"  {t['backend']:9} L={t['L']:>7}"
        if "fwd_bwd_s" in t:
            lines.append(f"{name} {t['fwd_bwd_s'] * 1e3:9.2f} ms  peak {t['peak_mem_bytes'] / 2**30:7.2f} GiB")
        else:
            lines.append(f"{name} {t.get('skipped') or t.get('error')}")
    from hf_bdlm.benchmarks import parallel_modes

    par = report["parallel"]
    lines.append(f"parallel modes (NCCL, bf16, {par['gpus']} GPUs, {par['attention_backend']}):")
    lines += ["  " + line for line in parallel_modes.table(par["records"]).splitlines()]
    if par["note"]:
        lines.append(f"  note: {par['note']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_results", help="folder for runbook.json")
    parser.add_argument("--check-len", type=int, default=1024, help="sequence length of the exactness checks")
    parser.add_argument("--attention-lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--dense-max-len", type=int, default=16384)
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072], help="parallel-mode lengths")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--budget-minutes", type=float, default=7.0)
    parser.add_argument("--timeout", type=float, default=240, help="seconds per parallel-mode configuration")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("benchmarks/gpu/runbook.py: no CUDA device is visible (torch.cuda.is_available() is False); run it on "
              "a machine with NVIDIA GPUs and a CUDA build of torch.", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    start = time.time()
    deadline = start + 60 * args.budget_minutes
    report = dict(environment=environment())
    print(f"environment: {report['environment']}", flush=True)
    report["checks"] = run_checks("cuda", L=args.check_len)
    print(f"checks done ({time.time() - start:.0f} s)", flush=True)
    report["timings"] = run_timings(args.attention_lengths, args.dense_max_len, deadline)
    print(f"timings done ({time.time() - start:.0f} s)", flush=True)
    backend = "flash" if report["environment"]["flash_attn"] else "blockwise"
    report["parallel"] = run_parallel(args.lengths, args.layers, args.steps, backend, deadline, args.timeout)
    report["wall_s"] = time.time() - start
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "runbook.json").write_text(json.dumps(report, indent=1))
    print(table(report))
    print(f"wrote {out / 'runbook.json'} ({report['wall_s']:.0f} s)")
    failed = [c for c in report["checks"] if c.get("ok") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
