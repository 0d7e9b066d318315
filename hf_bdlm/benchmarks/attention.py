"""CPU benchmark of block-diffusion attention backends and of a BDLM vs an AR training step.

Two tables:

1. attention alone (block 64, batch 1, 8 query heads, 2 KV heads, head dim 64, float32, the
   ``2L`` vectorized rows): forward + backward time and peak memory of ``dense`` and
   ``blockwise`` (``flex``: forward only, PyTorch has no CPU backward for it);
2. one training step (forward + backward, no optimizer) of a small Llama (2 layers, hidden
   512, 8 heads, 2 KV heads, vocab 32000): ``LlamaForCausalLM`` with SDPA causal attention and
   a loss over ``L`` tokens (AR) vs ``BlockDiffusionForMaskedLM`` with ``blockwise`` attention
   and ``clean_attention="causal"`` over ``2L`` rows, loss on the ``L`` noisy-stream logits; and the same
  pair without the LM head (a loss on the last hidden states), where the BDLM does twice the rows' work.

Every measurement runs in a fresh subprocess, so its peak RSS (``ru_maxrss``) is its own:
the reported peak is the high-water mark of the first (cold) run minus the RSS after the
inputs were allocated. The time is the median of ``--repeats`` (at least 3) timed runs after
that one (which reuse plans and masks, as every layer after the first does in a model); every
timed run is recorded (``times``), and the summary's ratios are of medians, a tie where the two
ranges overlap (:func:`.spread.compare`).
Children run with ``OMP_WAIT_POLICY=PASSIVE`` (see ``--omp-wait-policy``): on a machine shared
with other jobs, OpenMP's spin-waiting otherwise dominates every small parallel op.
A measurement whose estimated memory exceeds ``--max-gb``, or whose runs (the cold one and the
timed ones) extrapolated from the previous length exceed ``--max-seconds`` together, is skipped
and says why.

    python -m hf_bdlm.benchmarks.attention --quick                       # < 3 min, L <= 2K
    python -m hf_bdlm.benchmarks.attention --lengths 1024 2048 4096 8192 16384 --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import subprocess
import tempfile
import time
import warnings

from ..protocols.registry import family_named
from .processes import child_env, module_command
from .spread import MIN_TIMED_STEPS, Spread, check_timed_steps, compare

BLOCK, HEADS, KV_HEADS, HEAD_DIM = 64, 8, 2, 64
MODEL = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
)


# --- child side: one measurement per process -------------------------------------------------


def _max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _timed(fn, repeats: int):
    """(first run seconds, peak bytes of the first run above the current RSS, the ``repeats`` timed runs after it)."""
    base = _max_rss_bytes()
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    peak = _max_rss_bytes() - base
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return first, peak, times


def _timed_record(first: float, peak: int, times: list[float]) -> dict:
    return dict(first_s=first, time_s=Spread(times).median, times=times, peak_mb=peak / 2**20)


def _attention_child(spec: dict) -> dict:
    # lazy: a child process's import: the parent, which only launches children, loads no torch (4 s measured)
    import torch

    # lazy: a child process's import: the parent, which only launches children, loads no torch (4 s measured)
    from hf_bdlm.attention import MaskRule, attend, vectorized_rows
    from hf_bdlm.attention.kernels import block_sparse_attention
    from hf_bdlm.attention.tiles import plan_attention

    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    backend, length = spec["backend"], spec["length"]
    rule = MaskRule(BLOCK, spec["clean_attention"])
    train = backend != "flex"

    def inputs(n):
        rows = vectorized_rows(n)
        q = torch.randn(1, HEADS, 2 * n, HEAD_DIM, requires_grad=train)
        k, v = (torch.randn(1, KV_HEADS, 2 * n, HEAD_DIM, requires_grad=train) for _ in "kv")
        return rows, q, k, v

    def run(rows, q, k, v, cache):
        if spec.get("group_rows") is not None:  # the blockwise backend with another planner granularity
            if "plan" not in cache:
                cache["plan"] = plan_attention(rows, [rows], rule, spec["group_rows"])
            out = block_sparse_attention(cache["plan"], q, [(k, v)], HEAD_DIM**-0.5)[0]
            out.backward(torch.ones_like(out))
            q.grad = k.grad = v.grad = None
            return
        if not train:
            with torch.no_grad():
                attend(backend, q, [(k, v)], rows, [rows], rule, HEAD_DIM**-0.5, cache)
            return
        out = attend(backend, q, [(k, v)], rows, [rows], rule, HEAD_DIM**-0.5, cache)
        out.backward(torch.ones_like(out))
        q.grad = k.grad = v.grad = None

    run(*inputs(2 * BLOCK), {})  # loads kernels and thread pools before the baseline
    rows, q, k, v = inputs(length)
    cache: dict = {}
    return _timed_record(*_timed(lambda: run(rows, q, k, v, cache), spec["repeats"]))


def _step_child(spec: dict) -> dict:
    # lazy: a child process's import: the parent, which only launches children, loads no torch (4 s measured)
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    length = spec["length"]
    torch.manual_seed(0)
    backbone = LlamaConfig(**MODEL, max_position_embeddings=max(length, 2048))
    if spec["model"] == "ar":
        model = LlamaForCausalLM._from_config(backbone, attn_implementation="sdpa")

        def step(ids):
            if spec.get("head", True):
                model(input_ids=ids, labels=ids).loss.backward()
            else:
                model.model(input_ids=ids).last_hidden_state.float().square().mean().backward()
    else:
        mask_id = MODEL["vocab_size"] - 1
        family = family_named("block_diffusion")  # a converted causal LM
        config = family.new_config(
            backbone_config=backbone, block_size=BLOCK, mask_token_id=mask_id, clean_attention="causal",
            attention_backend="blockwise",
        )  # fmt: skip
        model = family.new_model(config)

        def step(ids):
            noisy = ids.masked_fill(torch.rand(ids.shape) < 0.5, mask_id)
            if spec.get("head", True):
                logits = model(input_ids=noisy, clean_input_ids=ids).logits
                F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
            else:
                out = model(input_ids=noisy, clean_input_ids=ids, return_logits=False)
                out.hidden_states.float().square().mean().backward()

    model.train()
    step(torch.randint(0, MODEL["vocab_size"] - 1, (1, 2 * BLOCK)))  # warm-up before the baseline
    model.zero_grad(set_to_none=True)
    ids = torch.randint(0, MODEL["vocab_size"] - 1, (1, length))

    def run():
        step(ids)
        model.zero_grad(set_to_none=True)

    return _timed_record(*_timed(run, spec["repeats"]))


def child_main(spec: dict) -> None:
    # lazy: a child process's import: the parent, which only launches children, loads no torch (4 s measured)
    import torch

    torch.set_num_threads(spec["threads"])
    result = _attention_child(spec) if spec["bench"] == "attention" else _step_child(spec)
    print(json.dumps(result))


# --- parent side -------------------------------------------------------------------------------


def estimate_gb(backend: str, length: int) -> float:
    """Memory the backend needs beyond its linear buffers, from its quadratic objects."""
    rows = 2 * length
    if backend == "dense":
        # The boolean mask (cached for the forward) and the float mask SDPA's CPU kernel makes from it.
        return rows * rows * (1 + 4) / 1e9
    if backend == "flex":
        # Eager FlexAttention materialises the float32 scores per head, ~3.5 copies measured.
        return 4 * HEADS * rows * rows * 4 / 1e9
    return 0.0


def run_child(spec: dict, timeout: float, omp_wait_policy: str) -> dict:
    cmd = [*module_command("attention"), "--child", json.dumps(spec)]
    env = child_env(**({"OMP_WAIT_POLICY": omp_wait_policy} if omp_wait_policy else {}))
    try:
        with tempfile.TemporaryDirectory() as cwd:
            proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(skipped=f"timed out after {timeout:.0f} s")
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        return dict(skipped=f"failed: {tail[0][:200]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def spread(rec: dict) -> Spread:
    """A record's timed runs (records of an older version hold only their best time)."""
    return Spread(rec.get("times") or [rec["time_s"]])


def _fmt(rec: dict) -> str:
    if "skipped" in rec:
        return rec["skipped"]
    return f"{spread(rec).describe('.3f'):>24} s  {rec['peak_mb']:8.0f} MB  (first run {rec['first_s']:.2f} s)"


def measure(args, bench: str, name: str, lengths, extra: dict, records: list) -> None:
    previous = None
    for length in lengths:
        # Attention cost grows ~4x per doubling of L; a training step at these sizes ~2-3x.
        growth = 4.0 if bench == "attention" else 3.0
        predicted = None if previous is None else previous * growth * (1 + args.repeats)  # the cold run too
        spec = dict(bench=bench, length=length, threads=args.threads, repeats=args.repeats, **extra)
        rec = dict(spec, name=name, omp_wait_policy=args.omp_wait_policy, loadavg=round(os.getloadavg()[0], 2))
        need = estimate_gb(extra.get("backend", ""), length)
        if need > args.max_gb:
            rec["skipped"] = f"skipped (needs {need:.1f} GB)"
        elif predicted is not None and predicted > args.max_seconds:
            rec["skipped"] = f"skipped (predicted {predicted:.0f} s)"
        else:
            rec.update(run_child(spec, args.max_seconds * 2, args.omp_wait_policy))
        previous = rec.get("time_s")
        records.append(rec)
        print(f"  {name:<10} L={length:>6}  {_fmt(rec)}", flush=True)


def summarize(records: list) -> list[str]:
    def get(name, length):
        for r in records:
            if r["name"] == name and r["length"] == length and "time_s" in r:
                return r
        return None

    header = (f"  {'L':>6}  {'blockwise/dense time':>21}  {'groups/block tiles':>21}  {'blockwise MB per 1K tok':>24}"
              f"  {'BDLM/AR step':>13}"
              f"  {'BDLM/AR backbone':>17}")  # fmt: skip
    def cost(a, b):
        """``a``'s time over ``b``'s: the ratio of medians, or a tie where the ranges of timed runs overlap."""
        if not (a and b):
            return "-"
        c = compare(spread(a), spread(b))  # the baseline's median over the candidate's: here a / b
        return f"tie ({c.ratio:.2f})" if c.tie else f"{c.ratio:.2f}"

    lines = ["", "Summary (time ratios of medians; tie: the ranges of timed runs overlap)", header]
    for length in sorted({r["length"] for r in records}):
        b, d = get("blockwise", length), get("dense", length)
        ratio = cost(b, d)
        per_k = f"{b['peak_mb'] / (length / 1024):.1f}" if b else "-"
        step = cost(get("bdlm_step", length), get("ar_step", length))
        grouped = cost(b, get("block_tiles", length))
        body = cost(get("bdlm_body", length), get("ar_body", length))
        lines.append(f"  {length:>6}  {ratio:>21}  {grouped:>21}  {per_k:>24}  {step:>13}  {body:>17}")
    lines.append("  targets: blockwise <= 0.35x dense at L=8K; blockwise MB per 1K tokens ~constant; BDLM <= 2.2x AR")
    return lines


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--step-lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--backends", nargs="+", default=["blockwise", "dense", "flex"])
    p.add_argument("--clean-attention", default="block_causal", choices=["block_causal", "causal"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=MIN_TIMED_STEPS,
                   help=f"timed runs after the first (cold) run, at least {MIN_TIMED_STEPS}")
    p.add_argument("--max-gb", type=float, default=16.0, help="skip a measurement estimated to need more")
    p.add_argument("--max-seconds", type=float, default=300.0, help="skip a measurement predicted to take longer")
    # OpenMP's default spin-waiting makes every parallel op stall for a scheduler time slice
    # when the machine has more runnable threads than cores: measured 6x slower blockwise
    # attention at 2 threads on a loaded 2-core machine. PASSIVE sleeps instead of spinning.
    p.add_argument("--omp-wait-policy", default="PASSIVE", help="OMP_WAIT_POLICY of the children ('' = inherit)")
    p.add_argument("--compare-block-tiles", action="store_true",
                   help="also time blockwise with block-sized tiles only (planner group_rows=0)")
    p.add_argument("--quick", action="store_true", help="L up to 2K, steps up to 1K")
    p.add_argument("--out", default="results.json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> None:
    args = make_parser().parse_args(argv)
    if args.child:
        child_main(json.loads(args.child))
        return
    check_timed_steps(args.repeats, "--repeats")
    if args.quick:
        args.lengths = [n for n in args.lengths if n <= 2048]
        args.step_lengths = [n for n in args.step_lengths if n <= 1024]
        args.max_seconds = min(args.max_seconds, 60.0)
    started = time.perf_counter()
    print(
        f"threads={args.threads}  OMP_WAIT_POLICY={args.omp_wait_policy or 'inherited'}  "
        f"load average at start={os.getloadavg()[0]:.2f}  cpus={os.cpu_count()}"
    )
    records: list = []
    print(f"Attention forward+backward (flex: forward only), B={BLOCK}, H={HEADS}, H_kv={KV_HEADS}, d={HEAD_DIM}, "
          f"float32, clean_attention={args.clean_attention}")  # fmt: skip
    for backend in args.backends:
        extra = dict(backend=backend, clean_attention=args.clean_attention)
        measure(args, "attention", backend, args.lengths, extra, records)
        if backend == "blockwise" and args.compare_block_tiles:
            extra = dict(extra, group_rows=0)
            measure(args, "attention", "block_tiles", args.lengths, extra, records)
    print("Training step (forward+backward), Llama 2x512, vocab 32000")
    measure(args, "step", "ar_step", args.step_lengths, dict(model="ar"), records)
    measure(args, "step", "bdlm_step", args.step_lengths, dict(model="bdlm"), records)
    if not args.quick:
        # The LM head and its loss run on L rows in both models (the BDLM's logits are the noisy stream's only),
        # so the whole-step ratio sits below the 2x of the backbone; this pair measures the backbone alone.
        measure(args, "step", "ar_body", args.step_lengths, dict(model="ar", head=False), records)
        measure(args, "step", "bdlm_body", args.step_lengths, dict(model="bdlm", head=False), records)
    for line in summarize(records):
        print(line)
    print(f"total {time.perf_counter() - started:.0f} s")
    pathlib.Path(args.out).write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
