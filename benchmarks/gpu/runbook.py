"""GPU runbook: one command that checks and times hf_bdlm on the NVIDIA GPU(s) of a machine, offline.

    bash benchmarks/gpu/run.sh                 # one GPU: under 8 minutes on one H100 (--budget-minutes 7.25)
    bash benchmarks/gpu/run.sh --dry-run       # CPU, tiny sizes, every section end to end (CI runs it)

Writes ``OUT/runbook.json`` (``--out``, default ``gpu_results``; updated after every section, so a run cut short keeps
what it measured) and ``OUT/summary.txt`` (printed at the end): every figure beside the planner's prediction and an
expected range. Without a visible GPU and without ``--dry-run`` it stops at once (exit code 2). docs/gpu.md has the
install and what each figure means. Sections, in order, each under its share of the time budget:

1. **checks**: every attention backend (``dense``, ``blockwise``, ``flex``, and ``auto``: ``flex`` on CUDA, on the
   one-device layout) in float32 (TF32 off) and bfloat16 against ``dense`` in float64, forward and backward (output,
   dq, dk, dv), at ``L = 4096`` (``2L`` vectorized rows, two packed documents, GQA 8/2 heads, head dim 128, block 64,
   window 96), per layout: the one-device layout, and ``cp``, the paper's CP, ``bp``, ``csbp`` at ``P = 2`` emulated
   on one device (each rank's queries over the key sources that rank holds and receives, run one rank after the
   other, put back in row order: :func:`rank_views`). A failed check makes the exit code 1.
2. **training**: one ~1B-parameter block-diffusion Llama (hidden 2048, 16 layers, 16 heads, 8 KV heads, MLP 8192,
   vocabulary 32000: 1.14B parameters; bf16 weights, gradients and AdamW states; block 64; ``flex``) trained on one
   GPU at 16K, 128K, 64K and 32K tokens (in that order: the ends first): forward + backward time, tokens/s, AdamW time
   and peak allocator memory; activation checkpointing where the planner's peak does not fit the card (and after an
   out-of-memory error). One GPU runs the one-device layout: csbp with ``P = 1`` (csbp's ranks are processes).
3. **decoding**: a small random block-diffusion model (hidden 1024, 8 layers, 0.19B): forwards/s of one denoising
   block step over a KV cache of 1K, 8K and 32K tokens (batch 1 and 8), and ``generate()`` tokens/s (4 tokens per
   forward; ``blockwise``, then ``auto``).
4. **parallel**: with two or more GPUs, ``python -m hf_bdlm.benchmarks.parallel_modes`` over NCCL at ``P`` = number
   of GPUs (single, ``csbp``, ``cp``, ``bp``); with one GPU, skipped with the reason.

On a GPU each section runs in a process of its own, stopped :data:`WORKER_GRACE_S` after its deadline (what it wrote
so far is kept), so the whole run ends within the budget plus that grace. ``--dry-run`` runs the same code on the CPU
at ``L = 256`` with tiny models (``blockwise`` fwd+bwd; ``flex`` forward only, one shape: PyTorch has no CPU backward
for it; the parallel section as a 2-process gloo ``csbp`` run; the decoding section in a process of its own), writing
the same JSON keys and summary.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}
CHECK_ORDER = ("dense", "blockwise", "flex")  # first; then the rest of hf_bdlm.attention.BACKENDS ("auto")
LAYOUTS = ("local", "cp", "cp-paper", "bp", "csbp")  # the one-device layout, then the P = 2 modes
SECTIONS = ("checks", "training", "decoding", "parallel")
BLOCK = 64
# The achievable fractions of the datasheet peaks an expected range spans (the planner assumes matmul 0.55,
# attention 0.40, HBM 1.0: planner/hardware.py): what large bf16 training reaches on Hopper, low end to high end.
GPU_FRACTIONS = dict(matmul=(0.35, 0.75), attention=(0.20, 0.60), hbm=(0.5, 1.0))
# The dry-run measures its CPU rates in a second; its range allows a factor 2 either way (machine noise).
CPU_RATE_FACTORS = (0.5, 2.0)
# Peak memory: the planner counts what autograd saves tensor by tensor; allocator retention, kernel workspaces and
# tensors it does not count (activation_overhead) put the measured peak between these multiples of its activations.
ACTIVATION_OVERHEAD = (0.75, 2.0)
# Decoding: a forward's time is at least its roofline (weights and KV cache read once at the HBM rate, or its
# FLOPs at the achievable rates); eager PyTorch launches tens of kernels per layer, so small forwards are launch
# bound: the range reaches down to a tenth of the roofline's rate.
DECODE_ROOFLINE_FRACTION = (0.1, 1.0)
COMPILE_ALLOWANCE_S = 45.0  # what a new shape's first compiled flex step may take on a GPU (budget checks)


@dataclass(frozen=True)
class Shape:
    """A Llama backbone's sizes."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int


@dataclass(frozen=True)
class Profile:
    """The sizes one run uses: :data:`GPU` or :data:`DRY` (``--dry-run``)."""

    name: str
    device: str
    check_len: int
    check_heads: tuple[int, int, int]  # query heads, K/V heads, head dim
    window: int
    train_shape: Shape
    train_lengths: tuple[int, ...]  # in the order they run
    train_dtype: str
    train_steps: int
    force_checkpointing_at: int | None  # a length trained with checkpointing whatever the planner says (dry-run)
    decode_shape: Shape
    decode_block: int
    decode_prefixes: tuple[int, ...]
    decode_batches: tuple[int, ...]
    decode_backends: tuple[str, ...]  # of the block step (over a cache every pair is allowed: attend runs SDPA)
    generate_runs: tuple[tuple[str, int], ...]  # (backend, batch) of generate(), in order (auto: flex compiles the
    #                                              first step of every block, whose length is new each time)
    generate_tokens: int
    parallel_lengths: tuple[int, ...]
    parallel_layers: int
    parallel_modes: tuple[str, ...]
    parallel_single: bool  # the one-process step of the same model too
    budget_minutes: float
    isolated: tuple[str, ...]  # sections run in a process of their own (a hard time limit, their own memory)


GPU = Profile(
    name="gpu", device="cuda", check_len=4096, check_heads=(8, 2, 128), window=96,
    train_shape=Shape(2048, 16, 16, 8, 8192, 32000), train_lengths=(16384, 131072, 65536, 32768),
    train_dtype="bfloat16", train_steps=2, force_checkpointing_at=None,
    decode_shape=Shape(1024, 8, 16, 8, 4096, 32000), decode_block=64, decode_prefixes=(1024, 8192, 32768),
    decode_batches=(1, 8), decode_backends=("auto",), generate_runs=(("blockwise", 1), ("blockwise", 8), ("auto", 1)),
    generate_tokens=512,
    parallel_lengths=(32768, 131072), parallel_layers=4, parallel_modes=("csbp", "cp", "bp"), parallel_single=True,
    budget_minutes=7.25, isolated=SECTIONS)

DRY = Profile(
    name="dry-run", device="cpu", check_len=256, check_heads=(8, 2, 128), window=96,
    train_shape=Shape(64, 2, 4, 2, 128, 512), train_lengths=(256, 512), train_dtype="float32", train_steps=2,
    force_checkpointing_at=512,
    decode_shape=Shape(64, 2, 4, 2, 128, 512), decode_block=16, decode_prefixes=(64, 256), decode_batches=(1, 4),
    decode_backends=("auto",), generate_runs=(("blockwise", 1), ("blockwise", 4), ("auto", 1)), generate_tokens=64,
    parallel_lengths=(512,), parallel_layers=1, parallel_modes=("csbp",), parallel_single=False, budget_minutes=30.0,
    isolated=("decoding",))


# ----------------------------------------------------------------------------------------------
# shared
# ----------------------------------------------------------------------------------------------
def environment() -> dict:
    import torch
    import transformers

    import hf_bdlm
    from hf_bdlm.attention import BACKENDS

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
                triton=triton_version, transformers=transformers.__version__,
                hf_bdlm=getattr(hf_bdlm, "__version__", None), commit=commit, gpus=gpus,
                gpu_memory_bytes=[torch.cuda.get_device_properties(i).total_memory for i in range(len(gpus))],
                nccl=".".join(map(str, torch.cuda.nccl.version())) if gpus else None,
                backends=list(BACKENDS), cpu_cores=os.cpu_count())


class Clock:
    """Deadlines of the sections (epoch seconds), from one start; a section worker gets the driver's."""

    def __init__(self, start: float, deadlines: dict[str, float]):
        self.start, self.deadlines = start, dict(deadlines)

    @classmethod
    def shares(cls, budget_s: float, shares: dict[str, float]) -> "Clock":
        start = time.time()
        return cls(start, {name: start + share * budget_s for name, share in shares.items()})

    def elapsed(self) -> float:
        return time.time() - self.start

    def left(self, section: str) -> float:
        return self.deadlines[section] - time.time()


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _rel_err(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300))


def _range_check(value, low, high) -> bool | None:
    if value is None or low is None or high is None:
        return None
    return bool(low <= value <= high)


# ----------------------------------------------------------------------------------------------
# 1. exactness
# ----------------------------------------------------------------------------------------------
def _inputs(L: int, heads: int, kv_heads: int, dim: int, device: str, seed: int = 0):
    """Two packed documents (block-aligned), ``q, k, v`` and an output gradient in float64, on ``device``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    half = L // BLOCK // 2
    doc = torch.cat([torch.zeros(half * BLOCK, dtype=torch.long), torch.ones(L - half * BLOCK, dtype=torch.long)])
    q = torch.randn(1, heads, 2 * L, dim, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, kv_heads, 2 * L, dim, generator=g, dtype=torch.float64) for _ in "kv")
    grad = torch.randn(1, heads, 2 * L, dim, generator=g, dtype=torch.float64)
    return doc[None].to(device), [t.to(device) for t in (q, k, v, grad)]


def global_index(rows, L: int):
    """Index of each row into the ``2L`` vectorized rows (noisy ``0..L-1``, then clean)."""
    from hf_bdlm.attention import CLEAN

    return rows.pos + L * (rows.stream == CLEAN).long()


def rank_views(layout: str, L: int, rule, doc):
    """Each rank's ``(query rows, key sources' rows, counted query rows)`` under ``layout`` with ``P = 2``, as
    :class:`hf_bdlm.parallel.exchange.ExchangePass` attends: ``bp`` its own rows; ``cp`` / ``csbp`` its own rows, then
    the peer's sent rows (all-gather; on a sliding layer the halo only, :func:`~hf_bdlm.parallel.plan.window_exchange`);
    the paper's CP every member's sent noisy rows, then every member's clean rows (blocking gathers). ``local`` is
    the one-device layout. A row computed on several ranks (``bp``'s clean prefix) counts on the rank that counts
    its loss."""
    import torch

    from hf_bdlm.attention import NOISY, RowMeta, vectorized_rows
    from hf_bdlm.benchmarks.parallel_modes import split_mode
    from hf_bdlm.parallel.plan import ParallelDims, PlanConfig, make_plan, window_exchange

    if layout == "local":
        rows = vectorized_rows(L, doc, device=doc.device)
        return [(rows, [rows], torch.ones(2 * L, dtype=torch.bool, device=doc.device))]
    mode, cp_layout = split_mode(layout)
    dims = ParallelDims(2, None, mode, "dual_end", cp_layout=cp_layout)
    plan = make_plan(PlanConfig(dims, L, rule.block_size))
    doc_cpu = doc.cpu()
    views = []
    for r, rp in enumerate(plan.ranks):
        q_rows = rp.rows(doc_cpu)
        members = plan.exchange_members(r)
        sent = [plan.sent_rows(m, doc_cpu) for m in members]
        if not dims.mode.exchanges_kv:
            sources = [q_rows]
        elif dims.is_paper_cp:
            by_stream = [RowMeta.cat([s.select((s.stream == NOISY).nonzero().flatten()) for s in sent]),
                         RowMeta.cat([s.select((s.stream != NOISY).nonzero().flatten()) for s in sent])]
            sources = [s for s in by_stream if s.num_rows]
        elif rule.sliding_window is not None:
            me = members.index(r)
            queries = [plan.ranks[m].rows(doc_cpu) for m in members]
            halo = window_exchange(me, queries, sent, rule)[3]
            sources = [q_rows] + ([halo] if halo.num_rows else [])
        else:
            sources = [q_rows, RowMeta.cat([s for m, s in zip(members, sent) if m != r])]
        views.append((q_rows, sources, rp.loss_row_mask()))
    device = doc.device
    return [(q.to(device), [s.to(device) for s in srcs], counted.to(device)) for q, srcs, counted in views]


def run_layout(backend: str, layout: str, q, k, v, rule, doc, L: int):
    """Output ``[1, H, 2L, d]`` of ``layout``'s ranks, one after the other, put back in vectorized row order."""
    import torch

    from hf_bdlm.attention import attend

    outs, index = [], []
    for q_rows, sources, counted in rank_views(layout, L, rule, doc):
        gq = global_index(q_rows, L)
        kv = [(k[:, :, global_index(s, L)], v[:, :, global_index(s, L)]) for s in sources]
        out = attend(backend, q[:, :, gq], kv, q_rows, sources, rule, q.shape[-1] ** -0.5, {})
        outs.append(out[:, :, counted])
        index.append(gq[counted])
    index = torch.cat(index)
    if not torch.equal(index.sort().values, torch.arange(2 * L, device=index.device)):
        raise AssertionError(f"layout {layout}: the ranks' counted rows do not cover the 2L rows once each")
    return torch.cat(outs, dim=2)[:, :, index.argsort()]


def _fwd_bwd(backend, layout, q, k, v, grad, rule, doc, dtype, backward: bool):
    import torch

    L = q.shape[2] // 2
    if not backward:
        with torch.no_grad():
            return [run_layout(backend, layout, *(t.to(dtype) for t in (q, k, v)), rule, doc, L)]
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out = run_layout(backend, layout, q, k, v, rule, doc, L)
    out.backward(grad.to(dtype))
    return [out.detach(), q.grad, k.grad, v.grad]


_REFERENCES: dict = {}


def check_backend(backend: str, dtype_name: str, kind: str, window: int | None, device: str = "cuda",
                  L: int = 4096, layout: str = "local", backward: bool = True,
                  heads: tuple[int, int, int] = (8, 2, 128)) -> dict:
    """Max relative error (``max |got - want| / max |want|``) of a backend under a layout against ``dense`` attention
    in float64 over the one-device rows: output, and with ``backward`` dq, dk, dv."""
    import torch

    from hf_bdlm.attention import MaskRule

    rule = MaskRule(BLOCK, kind, window)
    key = (device, L, heads, kind, window)
    if key not in _REFERENCES:
        _REFERENCES.clear()  # one reference alive at a time (at 4K its float64 gradients are hundreds of MB)
        doc, (q, k, v, grad) = _inputs(L, *heads, device)
        _REFERENCES[key] = (doc, q, k, v, grad), _fwd_bwd("dense", "local", q, k, v, grad, rule, doc,
                                                            torch.float64, True)
    (doc, q, k, v, grad), want = _REFERENCES[key]
    got = _fwd_bwd(backend, layout, q, k, v, grad, rule, doc, getattr(torch, dtype_name), backward)
    errors = {name: _rel_err(a, b) for name, a, b in zip(("out", "dq", "dk", "dv"), got, want)}
    worst = max(errors.values())
    return dict(backend=backend, layout=layout, dtype=dtype_name, kind=kind, window=window, L=L, backward=backward,
                errors=errors, max_err=worst, tolerance=TOLERANCE[dtype_name], ok=worst <= TOLERANCE[dtype_name])


def check_cases(profile: Profile, backends) -> list[dict]:
    """The checks in the order they run (most telling first, so a spent budget skips the least): the one-device
    layout's block-causal rule in both dtypes; each P = 2 layout in bf16; the other rules; the P = 2 layouts' window
    in bf16; the P = 2 layouts in float32. ``flex`` on the CPU runs forward only, one case."""
    cases = []
    rules = [("block_causal", None), ("causal", None), ("block_causal", profile.window), ("causal", profile.window)]
    parallel = [lay for lay in LAYOUTS if lay != "local"]
    tiers = [[("local", rules[0], d) for d in ("float32", "bfloat16")],
             [(lay, rules[0], "bfloat16") for lay in parallel],
             [("local", r, d) for r in rules[1:] for d in ("float32", "bfloat16")],
             [(lay, rules[2], "bfloat16") for lay in parallel],
             [(lay, r, "float32") for lay in parallel for r in (rules[0], rules[2])]]
    for tier in tiers:
        for layout, (kind, window), dtype in tier:
            for backend in backends:
                if backend not in ("blockwise", "flex") and layout != "local":
                    continue  # dense: the reference's own code; auto: a name for one of the two (run there)
                case = dict(backend=backend, layout=layout, dtype=dtype, kind=kind, window=window, backward=True)
                if backend == "flex" and profile.device == "cpu":
                    if (layout, kind, window, dtype) != ("local", "block_causal", None, "float32"):
                        continue
                    case["backward"] = False  # no CPU backward in PyTorch: the forward, one compiled shape
                cases.append(case)
    return cases


def run_checks(profile: Profile, device=None, gpu: bool = False, clock: Clock | None = None, save=None,
               backends=None) -> dict:
    """Every case of :func:`check_cases` for every name of ``hf_bdlm.attention.BACKENDS``, until the section's
    deadline (the rest is listed as skipped)."""
    import torch

    from hf_bdlm.attention import BACKENDS

    if backends is None:
        backends = CHECK_ORDER + tuple(b for b in BACKENDS if b not in CHECK_ORDER)
    out = dict(L=profile.check_len, heads=profile.check_heads, block=BLOCK, window=profile.window,
               tf32=False, cases=[])
    for case in check_cases(profile, backends):
        if clock is not None and clock.left("checks") <= 0:
            out["cases"].append(dict(case, skipped="time budget of the checks spent"))
            continue
        t0 = time.time()
        try:
            rec = check_backend(case["backend"], case["dtype"], case["kind"], case["window"], profile.device,
                                profile.check_len, case["layout"], case["backward"], profile.check_heads)
        except Exception as exc:  # reported, and the run is marked failed
            rec = dict(case, ok=False, error=f"{type(exc).__name__}: {exc}"[:500])
        rec["seconds"] = time.time() - t0
        out["cases"].append(rec)
        print(f"  check {_check_name(rec)}: {_check_result(rec)} ({rec['seconds']:.1f} s)", flush=True)
        if save:
            save(out)
        if profile.device == "cuda":
            torch.cuda.empty_cache()
    _REFERENCES.clear()
    return out


def _check_name(c: dict) -> str:
    return (f"{c['backend']:9} {c['layout']:8} {c['dtype']:8} {c['kind']:12} w={str(c['window']):4} "
            f"{'fwd+bwd' if c.get('backward', True) else 'fwd'}")


def _check_result(c: dict) -> str:
    if "skipped" in c:
        return f"skipped: {c['skipped']}"
    if "error" in c:
        return f"FAILED: {c['error'][:120]}"
    return f"{c['max_err']:.2e} (tol {c['tolerance']:.0e}) {'ok' if c['ok'] else 'FAILED'}"


# ----------------------------------------------------------------------------------------------
# the planner's device, and expected ranges
# ----------------------------------------------------------------------------------------------
GPU_NAMES = (("H200", "h200"), ("H100", "h100"), ("A100", "a100"), ("B200", "b200"))


def gpu_device(name: str, total_memory: int):
    """The planner's datasheet device for a CUDA device name (the SXM figures; an unknown card is priced as an
    H100, said in the record), with its memory as this card reports it (90 % usable, as the planner assumes)."""
    from hf_bdlm.planner.hardware import DEFAULT_EFFICIENCY, device_spec

    key = next((k for pattern, k in GPU_NAMES if pattern in name.upper()), None)
    note = None if key else f"{name!r} is not in the planner's table; priced as an H100"
    spec = device_spec(key or "h100")
    spec = replace(spec, memory_bytes=total_memory * DEFAULT_EFFICIENCY["memory"])
    return spec, note


def _best_time(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def quick_cpu_device(spec):
    """The dry-run's device: this CPU's matmul, attention and elementwise rates at the tiny shapes, measured in about
    a second (the planner's full CPU calibration, ``hf_bdlm.benchmarks.calibrate``, takes minutes)."""
    import torch

    from hf_bdlm.attention import MaskRule, attend, vectorized_rows
    from hf_bdlm.attention.tiles import plan_attention
    from hf_bdlm.planner.hardware import DeviceSpec
    from hf_bdlm.planner.kernel_work import computed_pairs
    from hf_bdlm.planner.rank_rate import matmul_workload

    run, flops = matmul_workload(spec, 256)
    matmul = flops / _best_time(run)
    a, L = spec.layers[0], 256
    rule = MaskRule(spec.block_size, spec.clean_attention)
    rows = vectorized_rows(L)
    q = torch.randn(1, a.heads, 2 * L, a.head_dim, requires_grad=True)
    k, v = (torch.randn(1, a.kv_heads, 2 * L, a.head_dim, requires_grad=True) for _ in "kv")
    cache: dict = {}

    def attention():
        attend("blockwise", q, [(k, v)], rows, [rows], rule, a.head_dim ** -0.5, cache).sum().backward()

    pairs = computed_pairs(plan_attention(rows, [rows], rule))
    attention_rate = pairs * 14 * a.heads * a.head_dim / _best_time(attention)
    x, y = torch.randn(1 << 20), torch.randn(1 << 20)
    hbm = 3 * x.numel() * 4 / _best_time(lambda: x + y)
    return DeviceSpec(name=f"cpu ({os.cpu_count()} cores; rates measured at the dry-run's shapes)",
                      matmul_flops=matmul, attention_flops=attention_rate, memory_bytes=float("inf"),
                      hbm_bytes_per_s=hbm, intra_node_bytes_per_s=1e9, inter_node_bytes_per_s=1e9,
                      source="benchmarks/gpu/runbook.py quick_cpu_device")


def rate_bounds(device, gpu: bool):
    """``(slow, fast)``: the device at the low and the high end of its achievable rates (:data:`GPU_FRACTIONS`
    against the planner's assumed fractions; on the CPU :data:`CPU_RATE_FACTORS` of the measured rates)."""
    from hf_bdlm.planner.hardware import DEFAULT_EFFICIENCY

    def scaled(i):
        if gpu:
            m = GPU_FRACTIONS["matmul"][i] / DEFAULT_EFFICIENCY["matmul"]
            a = GPU_FRACTIONS["attention"][i] / DEFAULT_EFFICIENCY["attention"]
            h = GPU_FRACTIONS["hbm"][i]
        else:
            m = a = h = CPU_RATE_FACTORS[i]
        return replace(device, matmul_flops=device.matmul_flops * m, attention_flops=device.attention_flops * a,
                       hbm_bytes_per_s=device.hbm_bytes_per_s * h)

    return scaled(0), scaled(1)


# ----------------------------------------------------------------------------------------------
# 2. training on one device
# ----------------------------------------------------------------------------------------------
def model_config(shape: Shape, block: int, backend: str, max_len: int):
    from transformers import LlamaConfig

    from hf_bdlm.protocols.registry import family_named

    backbone = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                           num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                           intermediate_size=shape.intermediate, max_position_embeddings=max_len, pad_token_id=0,
                           bos_token_id=1, eos_token_id=2)
    return family_named("block_diffusion").new_config(backbone_config=backbone, block_size=block,
                                                      mask_token_id=shape.vocab - 1, attention_backend=backend)


def training_backend(device: str) -> str:
    """What ``attention_backend="auto"`` picks: compiled FlexAttention on CUDA, the block-sparse kernels elsewhere."""
    return "flex" if device == "cuda" else "blockwise"


def training_recipe(dtype: str, activation_overhead: float = 1.0):
    """The runbook's step: weights, gradients and AdamW states in the training dtype, no FSDP (one device)."""
    from hf_bdlm.planner.workload import Recipe

    elem = 2 if dtype == "bfloat16" else 4
    return Recipe(param_bytes=elem, grad_bytes=elem, optimizer_bytes=2 * elem, activation_bytes=elem, fsdp=False,
                  gradient_sync=False, activation_overhead=activation_overhead)


def training_prediction(spec, L: int, device, gpu: bool, dtype: str, checkpointing: bool) -> dict:
    from hf_bdlm.parallel.dims import ParallelDims
    from hf_bdlm.planner.cost import predict
    from hf_bdlm.planner.workload import Cluster

    dims = ParallelDims(1, None, "csbp", world_size=1)
    cluster = Cluster(1, 1)

    def run(dev, overhead=1.0):
        return predict(spec, dims, L, dev, cluster, training_recipe(dtype, overhead), checkpointing)

    pred = run(device)
    slow, fast = rate_bounds(device, gpu)
    lo_mem, hi_mem = (run(device, o).memory.total for o in ACTIVATION_OVERHEAD)
    step_range = (run(fast).step_s, run(slow).step_s)
    return dict(step_s=pred.step_s, tokens_per_s=pred.tokens_per_s, peak_mem_bytes=pred.memory.total,
                memory_parts=pred.memory.parts(), fits=pred.fits, device=device.name,
                range_step_s=step_range, range_tokens_per_s=(L / step_range[1], L / step_range[0]),
                range_peak_mem_bytes=(lo_mem, hi_mem),
                attention_s=max(r.attention_s for r in pred.ranks), linear_s=max(r.linear_s for r in pred.ranks))


def _batch(objective, L: int, vocab: int, device: str, seed: int = 1):
    import dataclasses

    import torch

    g = torch.Generator().manual_seed(seed)
    batch = {"input_ids": torch.randint(3, vocab - 1, (1, L), generator=g),
             "completion_mask": torch.ones(1, L, dtype=torch.long),
             "attention_mask": torch.ones(1, L, dtype=torch.long), "sample_ids": torch.arange(1)}
    corrupted = objective.corrupt(batch, seed=7, step=0)
    moved = {f.name: getattr(corrupted, f.name) for f in dataclasses.fields(corrupted)}
    return dataclasses.replace(corrupted, **{k: v.to(device) for k, v in moved.items() if isinstance(v, torch.Tensor)})


def _peak_start(device: str) -> int:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return 0
    from hf_bdlm.benchmarks.parallel_modes import current_rss

    return current_rss()


def _peak(device: str, base: int) -> tuple[int, str]:
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated(), "CUDA allocator peak (torch.cuda.max_memory_allocated)"
    from hf_bdlm.benchmarks.parallel_modes import peak_rss

    return max(0, peak_rss() - base), "RSS high-water mark above the RSS before the step (CPU; not comparable)"


def train_one(profile: Profile, cfg, L: int, checkpointing: bool, steps: int) -> dict:
    """A warm-up step, then ``steps`` timed steps at length ``L``: forward + backward (timed), then AdamW (timed
    apart); the peak over the timed steps (the optimizer's states exist by then)."""
    import torch

    from hf_bdlm.objectives import get_objective
    from hf_bdlm.protocols.registry import family_named

    dev, dtype = profile.device, getattr(torch, profile.train_dtype)
    torch.manual_seed(0)
    with torch.device(dev):
        model = family_named("block_diffusion").new_model(cfg)
    model = model.to(dtype).train()
    if checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers' current name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=dev == "cuda")
    objective = get_objective("standard", cfg)
    corrupted = _batch(objective, L, cfg.backbone_config.vocab_size, dev)
    fwd_bwd, optim, losses = [], [], []
    base = warmup_s = 0
    try:
        for step in range(1 + steps):
            if step == 1:
                base = _peak_start(dev)  # after the warm-up: the optimizer's states exist from here on
            _sync(dev)
            t0 = time.perf_counter()
            loss, _ = objective.loss(model, corrupted)
            loss.backward()
            _sync(dev)
            t1 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(dev)
            t2 = time.perf_counter()
            losses.append(loss.detach().item())
            del loss
            if step:
                fwd_bwd.append(t1 - t0)
                optim.append(t2 - t1)
            else:
                warmup_s = t2 - t0
        peak, peak_source = _peak(dev, base)
    finally:
        del model, opt, corrupted
        if dev == "cuda":
            torch.cuda.empty_cache()
    step_s = statistics.median(fwd_bwd)
    return dict(params=params, checkpointing=checkpointing, warmup_s=warmup_s, steps=steps, step_s=step_s,
                step_times=fwd_bwd, optimizer_s=statistics.median(optim), tokens_per_s=L / step_s,
                peak_mem_bytes=peak, peak_mem_source=peak_source, losses=losses,
                finite_loss=all(math.isfinite(x) for x in losses))


def _out_of_memory(exc: Exception) -> bool:
    return "out of memory" in str(exc).lower()


def run_training(profile: Profile, device, gpu: bool, clock: Clock | None = None, save=None) -> dict:
    """The one-device training figures at each length. "csbp training on one GPU" is the one-device layout
    (``LocalLayout.vectorized``: csbp with ``P = 1``): csbp's ranks are processes, one per GPU, so ``P >= 2`` needs
    as many GPUs (:func:`run_parallel`). Checkpointing is off where the planner's peak fits the device (on an
    out-of-memory error the length is run again with it); a length whose warm-up and steps would not finish in the
    section's time at the slow end of the predicted range runs one timed step, or is skipped and listed."""
    import torch

    from hf_bdlm.planner.model import spec_from_config

    backend = training_backend(profile.device)
    cfg = model_config(profile.train_shape, BLOCK, backend, max(profile.train_lengths))
    spec = spec_from_config(cfg.to_dict(), "runbook training model")
    out = dict(model=asdict(profile.train_shape), params=spec.total_params(), block=BLOCK, backend=backend,
               dtype=profile.train_dtype, optimizer="AdamW (states in the training dtype)",
               layout="one device (LocalLayout.vectorized: csbp with P = 1)", device=device.name, records=[])
    for L in profile.train_lengths:
        plain = training_prediction(spec, L, device, gpu, profile.train_dtype, False)
        checkpointing = not plain["fits"] or L == profile.force_checkpointing_at
        pred = training_prediction(spec, L, device, gpu, profile.train_dtype, True) if checkpointing else plain
        rec = _train_length(profile, cfg, L, checkpointing, pred, device, gpu, clock, backend)
        if rec.pop("retry", False) and not checkpointing:  # out of memory without checkpointing: again with it
            out.setdefault("out_of_memory", []).append(dict(L=L, checkpointing=False, error=rec["error"],
                                                            predicted_peak_mem_bytes=pred["peak_mem_bytes"]))
            pred = training_prediction(spec, L, device, gpu, profile.train_dtype, True)
            rec = _train_length(profile, cfg, L, True, pred, device, gpu, clock, backend)
            rec.pop("retry", None)
        out["records"].append(rec)
        print(f"  train L={L}: " + (f"{rec['step_s']:.3f} s/step (planner {pred['step_s']:.3f}), "
                                     f"{rec['peak_mem_bytes'] / 2**30:.2f} GiB (planner "
                                     f"{pred['peak_mem_bytes'] / 2**30:.2f})" if "step_s" in rec
                                     else rec.get("skipped") or rec.get("error")), flush=True)
        if save:
            save(out)
        if gpu:
            torch.cuda.empty_cache()
    out["records"].sort(key=lambda r: r["L"])
    return out


def _train_length(profile, cfg, L, checkpointing, pred, device, gpu, clock, backend) -> dict:
    base = dict(L=L, backend=backend, dtype=profile.train_dtype, checkpointing=checkpointing, predicted=pred)
    if not pred["fits"]:
        return dict(base, skipped=f"the planner's peak {pred['peak_mem_bytes'] / 2**30:.1f} GiB exceeds the "
                                  f"device's {device.memory_bytes / 2**30:.1f} GiB even with checkpointing")
    # Warm-up and timed steps at the slow end of the range, plus a compile of the new shapes.
    compile_s = COMPILE_ALLOWANCE_S if gpu else 0.0
    steps = profile.train_steps
    if clock is not None:
        left = clock.left("training")
        while steps > 1 and left < (1 + steps) * pred["range_step_s"][1] + compile_s:
            steps -= 1
        needed = (1 + steps) * pred["range_step_s"][1] + compile_s
        if left < needed:
            return dict(base, skipped=f"time budget: a warm-up and {steps} step(s) take about {needed:.0f} s at the "
                                      f"slow end of the planner's range, {max(0.0, left):.0f} s left")
    try:
        rec = dict(base, **train_one(profile, cfg, L, checkpointing, steps))
    except Exception as exc:
        return dict(base, error=f"{type(exc).__name__}: {exc}"[:500], retry=_out_of_memory(exc))
    rec["in_range"] = dict(
        step_s=_range_check(rec["step_s"], *pred["range_step_s"]),
        peak_mem_bytes=_range_check(rec["peak_mem_bytes"], *pred["range_peak_mem_bytes"]) if gpu else None)
    return rec


# ----------------------------------------------------------------------------------------------
# 3. decoding
# ----------------------------------------------------------------------------------------------
def forward_roofline(model, spec, device, batch: int, rows: int, prefix: int, elem: int) -> float:
    """Seconds of one forward of ``rows`` rows per sequence over a cache of ``prefix`` clean rows: the weights (not
    the embedding tables) and the cache's K/V read once at the HBM rate, or the matmuls at the achievable matmul rate
    and the attention at the attention rate, whichever is slower (as ``hf_bdlm.benchmarks.decoding_study.gpu_seconds``
    projects a forward, plus the cache and the attention)."""
    from hf_bdlm.benchmarks.decoding_study import parameter_bytes

    weight_bytes, macs = parameter_bytes(model, elem)
    kv_bytes = sum(2 * a.kv_heads * a.head_dim * elem for a in spec.layers) * prefix * batch
    attention_flops = sum(4 * a.heads * a.head_dim for a in spec.layers) * rows * (prefix + rows) * batch
    compute = 2 * macs * rows * batch / device.matmul_flops + attention_flops / device.attention_flops
    return max((weight_bytes + kv_bytes) / device.hbm_bytes_per_s, compute)


def _rate_prediction(seconds: float, slow_seconds: float, fast_seconds: float, count: float = 1.0) -> dict:
    """A rate (``count`` per ``seconds``) predicted from the roofline, and its range (:data:`DECODE_ROOFLINE_FRACTION`
    of the roofline rates of the slow and the fast device)."""
    lo, hi = DECODE_ROOFLINE_FRACTION
    return dict(value=count / seconds, range=(lo * count / slow_seconds, hi * count / fast_seconds))


def block_step_rate(model, backend: str, batch: int, prefix: int, block: int, device: str, repeats: int) -> dict:
    """Forwards/s of one denoising step of a fully masked block over a cached prefix (the LM head on the block
    included), as ``generate`` runs it (:class:`~hf_bdlm.models.block_diffusion.generation.CachedContext`)."""
    import torch

    from hf_bdlm.models.block_diffusion.generation import (BlockDiffusionGenerationConfig, CachedContext, StepWindow,
                                                           resolve_settings)

    # The prefix runs into the cache with the block-sparse kernels (a masked call: compiled flex would compile every
    # prefix length); the timed step, one block over the cache, may see every key and runs one SDPA call.
    model.config.attention_backend = "blockwise"
    settings = resolve_settings(model, BlockDiffusionGenerationConfig(max_new_tokens=block, block_size=block), prefix)
    g = torch.Generator().manual_seed(prefix + batch)
    vocab = model.config.backbone_config.vocab_size
    ids = torch.randint(3, vocab - 1, (batch, prefix), generator=g).to(device)
    masked = torch.full((batch, block), model.config.mask_token_id, device=device)
    window = StepWindow.whole(batch, block, masked.device)
    with torch.no_grad():
        context = CachedContext(model, settings, masked.device)
        context.append(ids)
        context.block_hidden(masked, prefix)  # runs the prefix into the cache
        context.settings = replace(settings, backend=backend)

        def step():
            hidden, _ = context.step(masked, prefix, None, window)
            model.lm_logits(hidden)

        step()
        _sync(device)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            step()
            _sync(device)
            times.append(time.perf_counter() - t0)
    return dict(backend=backend, batch=batch, prefix=prefix, block=block, step_s=statistics.median(times),
                forwards_per_s=1 / statistics.median(times), step_times=times)


def generate_rate(model, backend: str, batch: int, prompt: int, tokens: int, block: int, device: str) -> dict:
    """``generate()`` tokens/s: ``tokens`` new tokens per sequence after a ``prompt``-token prompt, ``block / 4``
    denoising steps per block (4 tokens per forward, whatever the random model's confidences)."""
    import torch

    from hf_bdlm.models.block_diffusion.generation import generate

    model.config.attention_backend = backend
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, model.config.backbone_config.vocab_size - 1, (batch, prompt), generator=g).to(device)
    kwargs = dict(max_new_tokens=tokens, block_size=block, steps_per_block=block // 4, confidence_threshold=None)
    with torch.no_grad():
        generate(model, ids, max_new_tokens=block, block_size=block, steps_per_block=block // 4,
                 confidence_threshold=None)  # warm-up
        _sync(device)
        t0 = time.perf_counter()
        out = generate(model, ids, **kwargs)
        _sync(device)
        seconds = time.perf_counter() - t0
    new = (out.shape[1] - prompt) * batch
    return dict(backend=backend, batch=batch, prompt=prompt, new_tokens=new, seconds=seconds,
                tokens_per_s=new / seconds, forwards=tokens // block * (block // 4), tokens_per_forward=4)


def run_decoding(profile: Profile, device, gpu: bool, clock: Clock | None = None, save=None) -> dict:
    """Block steps with ``profile.decode_backends`` (over a cache every pair is allowed, so ``attend`` runs one SDPA
    call whatever the backend), then ``generate()`` runs of ``profile.generate_runs`` in order: ``blockwise`` first;
    ``auto`` (``flex`` on CUDA) compiles the first step of every block, whose length is new each time."""
    import torch

    from hf_bdlm.planner.model import spec_from_config
    from hf_bdlm.protocols.registry import family_named

    dev = profile.device
    dtype = torch.bfloat16 if gpu else torch.float32
    elem = 2 if gpu else 4
    B = profile.decode_block
    cfg = model_config(profile.decode_shape, B, "blockwise",
                       max(profile.decode_prefixes) + profile.generate_tokens + 2 * B)
    spec = spec_from_config(cfg.to_dict(), "runbook decoding model")
    torch.manual_seed(0)
    with torch.device(dev):
        model = family_named("block_diffusion").new_model(cfg)
    model = model.to(dtype).eval()
    model.generation_config.eos_token_id = None  # a random model would stop anywhere: always the whole budget
    slow, fast = rate_bounds(device, gpu)
    out = dict(model=asdict(profile.decode_shape), params=spec.total_params(), block=B,
               dtype=str(dtype).replace("torch.", ""), device=device.name, block_steps=[], generate=[])
    steps, gens = out["block_steps"], out["generate"]
    for backend in profile.decode_backends:
        for batch in profile.decode_batches:
            for prefix in profile.decode_prefixes:
                case = dict(backend=backend, batch=batch, prefix=prefix, block=B)
                args = (model, spec)
                rows = dict(batch=batch, rows=B, prefix=prefix, elem=elem)
                pred = _rate_prediction(forward_roofline(*args, device, **rows), forward_roofline(*args, slow, **rows),
                                        forward_roofline(*args, fast, **rows))
                case["predicted"] = dict(forwards_per_s=pred["value"], range_forwards_per_s=pred["range"],
                                         basis="roofline: weights + KV cache at the HBM rate, or FLOPs at the "
                                               "achievable rates")
                if clock is not None and clock.left("decoding") <= 0:
                    steps.append(dict(case, skipped="time budget of the decoding section spent"))
                    continue
                try:
                    rec = dict(case, **block_step_rate(model, backend, batch, prefix, B, dev, 5 if gpu else 3))
                    rec["in_range"] = _range_check(rec["forwards_per_s"], *pred["range"])
                except Exception as exc:
                    rec = dict(case, error=f"{type(exc).__name__}: {exc}"[:500])
                steps.append(rec)
                if save:
                    save(out)
                print(f"  block step {backend} batch {batch} prefix {prefix}: "
                      + (f"{rec['forwards_per_s']:.1f} forwards/s (roofline {pred['value']:.1f})"
                         if "forwards_per_s" in rec else rec.get("error", "")), flush=True)
    for backend, batch in profile.generate_runs:
        prompt, tokens = profile.decode_prefixes[0], profile.generate_tokens
        case = dict(backend=backend, batch=batch, prompt=prompt, max_new_tokens=tokens, block=B)
        per_forward = lambda dev_: sum(  # noqa: E731  (forwards over a growing cache)
            forward_roofline(model, spec, dev_, batch, B, prompt + i * B, elem) for i in range(tokens // B)
        ) * (B // 4)
        pred = _rate_prediction(per_forward(device), per_forward(slow), per_forward(fast), tokens * batch)
        case["predicted"] = dict(tokens_per_s=pred["value"], range_tokens_per_s=pred["range"])
        if clock is not None and clock.left("decoding") <= 0:
            gens.append(dict(case, skipped="time budget of the decoding section spent"))
            continue
        try:
            rec = dict(case, **generate_rate(model, backend, batch, prompt, tokens, B, dev))
            rec["in_range"] = _range_check(rec["tokens_per_s"], *pred["range"])
        except Exception as exc:
            rec = dict(case, error=f"{type(exc).__name__}: {exc}"[:500])
        gens.append(rec)
        if save:
            save(out)
        print(f"  generate {backend} batch {batch}: "
              + (f"{rec['tokens_per_s']:.1f} tokens/s (roofline {pred['value']:.1f})" if "tokens_per_s" in rec
                 else rec.get("error", "")), flush=True)
    del model
    if dev == "cuda":
        torch.cuda.empty_cache()
    return out


# ----------------------------------------------------------------------------------------------
# 4. the parallel modes (two or more GPUs; the dry-run: two CPU processes)
# ----------------------------------------------------------------------------------------------
def run_parallel(profile: Profile, device, gpu: bool, clock: Clock | None = None, save=None,
                 timeout: float = 240) -> dict:
    """``hf_bdlm.benchmarks.parallel_modes`` (a fresh ``torchrun`` per configuration) at ``P`` = number of GPUs, each
    record beside the planner's prediction (its benchmark model, ``benchmark_recipe``)."""
    import torch

    from hf_bdlm.benchmarks import calibrate, parallel_modes
    from hf_bdlm.planner.cost import predict
    from hf_bdlm.planner.workload import Cluster

    procs = torch.cuda.device_count() if gpu else 2
    backend = training_backend(profile.device)
    out = dict(processes=procs, backend=backend, layers=profile.parallel_layers, records=[], skipped=[],
               device=device.name, note=None)
    if procs < 2:
        out["note"] = (f"{procs} GPU visible: csbp needs P >= 2 processes (one per GPU); the one-GPU training "
                       "section is the one-device layout (csbp with P = 1)")
        return out
    dtype = "bfloat16" if gpu else "float32"
    args = parallel_modes.launch_args(profile.parallel_layers, 3, timeout, profile.device, dtype, backend)
    configs = [(m, P, L, t, s) for L in profile.parallel_lengths
               for m, P, t, s in parallel_modes.configurations(profile.parallel_modes, (procs,),
                                                              transports=("allgather",),
                                                              bp_schedules=("dual_end",),
                                                              single=profile.parallel_single)]
    model = calibrate.benchmark_model(profile.parallel_layers)
    slow, fast = rate_bounds(device, gpu)
    with tempfile.TemporaryDirectory() as tmp:
        for mode, P, L, transport, schedule in configs:
            case = dict(mode=mode, P=P, L=L, transport=transport, schedule=schedule)
            if clock is not None and clock.left("parallel") <= 0:
                out["skipped"].append(dict(case, skipped="time budget of the parallel section spent"))
                continue
            rec = parallel_modes.launch(mode, P, L, args, pathlib.Path(tmp), transport, schedule)
            dims = calibrate.record_dims(dict(rec, dtype=dtype))
            recipe = calibrate.benchmark_recipe(dict(dtype=dtype))
            cluster = Cluster(dims.world_size, dims.world_size)
            preds = [predict(model, dims, L, d, cluster, recipe) for d in (device, fast, slow)]
            rec["predicted"] = dict(step_s=preds[0].step_s, range_step_s=(preds[1].step_s, preds[2].step_s),
                                    bytes_per_step=preds[0].bytes_per_step)
            if "step_s" in rec:
                rec["in_range"] = dict(step_s=_range_check(rec["step_s"], *rec["predicted"]["range_step_s"]),
                                       bytes_per_step=rec.get("bytes_per_step") == preds[0].bytes_per_step)
            print(f"  {mode} P={P} L={L}: " + (f"{rec['step_s']:.3f} s/step (planner {preds[0].step_s:.3f})"
                                                if "step_s" in rec else rec.get("error", "")[-300:]), flush=True)
            out["records"].append(rec)
            if save:
                save(out)
    return out


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------
def _verdict(flag) -> str:
    return {True: "in range", False: "OUT OF RANGE", None: "-"}[flag]


def _span(lo, hi, fmt=".3f") -> str:
    return f"{lo:{fmt}}-{hi:{fmt}}"


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f}"


def _not_run(rec: dict) -> str:
    return f"skipped: {rec['skipped']}" if "skipped" in rec else f"FAILED: {rec.get('error', '?')[:160]}"


def _section_notes(result: dict) -> list[str]:
    notes = []
    if result.get("error"):
        notes.append(f"  SECTION FAILED: {result['error'][:300]}")
    if result.get("ended_early"):
        notes.append(f"  section ended early: {result['ended_early'][:300]}")
    return notes


def summary(report: dict) -> str:
    """The figures of a report, each beside the planner's prediction and its expected range."""
    env, lines = report["environment"], []
    lines.append(f"hf_bdlm GPU runbook ({report['profile']}) on {', '.join(env['gpus']) or 'CPU'}; torch "
                 f"{env['torch']}, CUDA {env['cuda']}, commit {(env['commit'] or '?')[:12]}; "
                 f"{report.get('wall_s', 0):.0f} s")
    if report.get("device_note"):
        lines.append(f"note: {report['device_note']}")
    lines.append(f"planner device: {report['planner_device']['name']}")
    checks = report.get("checks")
    if checks is not None:
        cases = checks.get("cases", [])
        run = [c for c in cases if "skipped" not in c]
        failed = [c for c in cases if c.get("ok") is False]
        lines.append(f"\n1. exactness: max |got - float64 dense| / max |float64 dense| over out, dq, dk, dv; "
                     f"L={checks.get('L')}, range [0, tolerance] ({len(run)} run, {len(failed)} failed, "
                     f"{len(cases) - len(run)} skipped)")
        lines += _section_notes(checks)
        lines += [f"  {_check_name(c)}  {_check_result(c)}" for c in cases]
    tr = report.get("training")
    if tr is not None:
        lines.append("\n2. training on one device (csbp with P = 1: the one-device layout)")
        lines += _section_notes(tr)
        if "records" in tr:
            lines.append(f"  {_count(tr['params'])} parameters ({tr['model']['layers']} layers, hidden "
                         f"{tr['model']['hidden']}), {tr['dtype']}, {tr['backend']}, block {tr['block']}")
            lines.append(f"  {'L':>7} {'ckpt':>4} | {'step s':>8} {'planner':>8} {'range':>15} | {'tokens/s':>9} "
                         f"{'planner':>9} | {'peak MiB':>8} {'planner':>8} {'range':>13} | verdict")
        for r in tr.get("records", []):
            p = r["predicted"]
            head = f"  {r['L']:>7} {'yes' if r['checkpointing'] else 'no':>4} |"
            if "step_s" not in r:
                lines.append(f"{head} {_not_run(r)}")
                continue
            verdict = ", ".join(f"{k} {_verdict(v)}" for k, v in r["in_range"].items() if v is not None) or "-"
            lines.append(f"{head} {r['step_s']:8.3f} {p['step_s']:8.3f} {_span(*p['range_step_s']):>15} | "
                         f"{r['tokens_per_s']:9.0f} {p['tokens_per_s']:9.0f} | {_mib(r['peak_mem_bytes']):>8} "
                         f"{_mib(p['peak_mem_bytes']):>8} {'-'.join(map(_mib, p['range_peak_mem_bytes'])):>13} | "
                         f"{verdict}")
        for r in tr.get("out_of_memory", []):
            lines.append(f"  L={r['L']} without checkpointing ran out of memory (planner: "
                         f"{r['predicted_peak_mem_bytes'] / 2**30:.1f} GiB); run again with it")
    dec = report.get("decoding")
    if dec is not None:
        lines.append("\n3. decoding (prediction: the roofline of each forward, range 0.1-1x of its rate)")
        lines += _section_notes(dec)
        if "block_steps" in dec:
            lines.append(f"  {_count(dec['params'])} parameters ({dec['model']['layers']} layers, hidden "
                         f"{dec['model']['hidden']}), {dec['dtype']}, block {dec['block']}")
            lines.append(f"  block step   {'backend':9} {'batch':>5} {'prefix':>7} | {'fwd/s':>9} {'roofline':>9} "
                         f"{'range':>19} | verdict")
        for r in dec.get("block_steps", []):
            p = r["predicted"]
            head = f"  block step   {r['backend']:9} {r['batch']:>5} {r['prefix']:>7} |"
            if "forwards_per_s" not in r:
                lines.append(f"{head} {_not_run(r)}")
                continue
            lines.append(f"{head} {r['forwards_per_s']:9.1f} {p['forwards_per_s']:9.1f} "
                         f"{_span(*p['range_forwards_per_s'], fmt='.1f'):>19} | {_verdict(r['in_range'])}")
        for r in dec.get("generate", []):
            p = r["predicted"]
            head = f"  generate()   {r['backend']:9} {r['batch']:>5} {r['prompt']:>7} |"
            if "tokens_per_s" not in r:
                lines.append(f"{head} {_not_run(r)}")
                continue
            lines.append(f"{head} {r['tokens_per_s']:9.1f} {p['tokens_per_s']:9.1f} "
                         f"{_span(*p['range_tokens_per_s'], fmt='.1f'):>19} | {_verdict(r['in_range'])} "
                         f"(tokens/s, {r['tokens_per_forward']} per forward)")
    par = report.get("parallel")
    if par is not None:
        lines.append("\n4. parallel modes (hf_bdlm.benchmarks.parallel_modes, one process per GPU)")
        lines += _section_notes(par)
        if "processes" in par:
            lines.append(f"  {par['processes']} processes, {par['backend']}, the benchmark model with "
                         f"{par['layers']} layer(s)")
        if par.get("note"):
            lines.append(f"  {par['note']}")
        for r in par.get("records", []):
            head = f"  {r['mode']:8} P={r['P']} L={r['L']:>7} |"
            if "step_s" not in r:
                lines.append(f"{head} FAILED: {r.get('error', '')[-200:]}")
                continue
            p, ok = r["predicted"], r["in_range"]
            lines.append(f"{head} {r['step_s']:8.3f} s/step, planner {p['step_s']:.3f} "
                         f"({_span(*p['range_step_s'])}) {_verdict(ok['step_s'])} | K/V bytes "
                         f"{r.get('bytes_per_step', 0)}, planner {p['bytes_per_step']:.0f} "
                         f"{'equal' if ok['bytes_per_step'] else 'DIFFER'} | peak "
                         f"{r.get('peak_mem_bytes', 0) / 2**30:.2f} GiB")
        for r in par.get("skipped", []):
            lines.append(f"  {r['mode']:8} P={r['P']} L={r['L']:>7} | skipped: {r['skipped']}")
    if report.get("skipped_sections"):
        lines.append("\nsections not run: " + "; ".join(f"{k} ({v})" for k, v in report["skipped_sections"].items()))
    if report.get("section_s"):
        lines.append("section seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in report["section_s"].items()))
    return "\n".join(lines)


def write(report: dict, out: pathlib.Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "runbook.json").write_text(json.dumps(report, indent=1, default=str))


# Cumulative deadlines of the sections, as fractions of the budget (one GPU: no parallel section, so training and
# decoding take its share).
SHARES = {1: dict(checks=0.30, training=0.82, decoding=1.0, parallel=1.0),
          2: dict(checks=0.22, training=0.60, decoding=0.72, parallel=1.0)}
WORKER_GRACE_S = 20.0  # a section's process is stopped this long after its deadline (it checks the deadline itself)
RECOMPILE_LIMIT = 64  # dynamo's, raised on a GPU: every flex check compiles (the default 8 falls back to eager)
RUNS = dict(checks=run_checks, training=run_training, decoding=run_decoding, parallel=run_parallel)


def _setup(gpu: bool) -> None:
    import torch

    if gpu:  # float32 means float32 in the checks (the bf16 sections do not use TF32 either way)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        # Compiled flex compiles once per shape; past dynamo's recompile limit (8) it would fall back to eager
        # FlexAttention silently, and the checks' later shapes would not test the compiled kernels.
        import torch._dynamo

        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    else:  # the dry-run: one thread (on 2 shared, loaded cores two OpenMP threads made it 1.7x slower)
        torch.set_num_threads(1)


def _profile_from(record: dict) -> Profile:
    fields = dict(record)
    for name in ("train_shape", "decode_shape"):
        fields[name] = Shape(**fields[name])
    return Profile(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


def worker(section: str, state_path: str) -> int:
    """One section in this process (``--worker``), as the driver's :func:`run_section` asked: its result is written to
    ``state["out"]`` after every record, ``done`` once finished."""
    from hf_bdlm.planner.hardware import DeviceSpec

    state = json.loads(pathlib.Path(state_path).read_text())
    profile, gpu = _profile_from(state["profile"]), state["gpu"]
    _setup(gpu)
    clock = Clock(state["start"], state["deadlines"])
    target = pathlib.Path(state["out"])

    def save(result, done=False):
        tmp = target.with_suffix(".tmp")
        tmp.write_text(json.dumps(dict(result=result, done=done), default=str))
        tmp.replace(target)

    save(RUNS[section](profile, DeviceSpec(**state["device"]), gpu, clock, save), done=True)
    return 0


def run_section(name: str, profile: Profile, device, gpu: bool, clock: Clock, tmp: pathlib.Path) -> dict:
    """A section's result: in this process, or (``profile.isolated``) in a process of its own that is stopped
    :data:`WORKER_GRACE_S` after the section's deadline, keeping what it had written."""
    if name not in profile.isolated:
        return RUNS[name](profile, device, gpu, clock)
    state = dict(profile=asdict(profile), gpu=gpu, device=asdict(device), start=clock.start,
                 deadlines=clock.deadlines, out=str(tmp / f"{name}.json"))
    state_path = tmp / f"{name}.state.json"
    state_path.write_text(json.dumps(state))
    cmd = [sys.executable, "-m", "benchmarks.gpu.runbook", "--worker", name, "--state", str(state_path)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True, start_new_session=True)
    limit = max(10.0, clock.left(name)) + WORKER_GRACE_S
    try:
        _, err = proc.communicate(timeout=limit)
        ended = None if proc.returncode == 0 else f"exit code {proc.returncode}: {err[-1500:]}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the section's process and what it started (torchrun)
        _, err = proc.communicate()
        ended = f"stopped at the section's time limit ({limit:.0f} s)"
    found = tmp / f"{name}.json"
    data = json.loads(found.read_text()) if found.exists() else dict(result={}, done=False)
    result = data["result"]
    if ended or not data["done"]:
        result["ended_early"] = ended or "the section's process ended before finishing"
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_results", help="folder for runbook.json and summary.txt")
    parser.add_argument("--dry-run", action="store_true",
                        help="run every section on the CPU at tiny sizes (what CI runs); no GPU needed")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--budget-minutes", type=float, default=None,
                        help=f"time budget of all sections (default {GPU.budget_minutes})")
    parser.add_argument("--check-len", type=int, default=None, help=f"length of the checks (default {GPU.check_len})")
    parser.add_argument("--train-lengths", type=int, nargs="+", default=None,
                        help="training lengths, in the order they run (default "
                             f"{' '.join(map(str, GPU.train_lengths))})")
    parser.add_argument("--train-layers", type=int, default=None, help="fewer layers of the ~1B shape")
    parser.add_argument("--worker", choices=SECTIONS, help=argparse.SUPPRESS)
    parser.add_argument("--state", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.state)

    import torch

    profile = DRY if args.dry_run else GPU
    if not args.dry_run and not torch.cuda.is_available():
        print("benchmarks/gpu/runbook.py: no CUDA device is visible (torch.cuda.is_available() is False); run it on "
              "a machine with an NVIDIA GPU and a CUDA build of torch (docs/gpu.md), or pass --dry-run to exercise "
              "it on the CPU.", file=sys.stderr)
        return 2
    if args.check_len:
        profile = replace(profile, check_len=args.check_len)
    if args.train_lengths:
        profile = replace(profile, train_lengths=tuple(args.train_lengths))
    if args.train_layers:
        profile = replace(profile, train_shape=replace(profile.train_shape, layers=args.train_layers))
    if args.budget_minutes:
        profile = replace(profile, budget_minutes=args.budget_minutes)
    gpu = profile.device == "cuda"
    _setup(gpu)
    gpus = torch.cuda.device_count() if gpu else 0
    clock = Clock.shares(60 * profile.budget_minutes, SHARES[2 if gpus >= 2 or not gpu else 1])
    out = pathlib.Path(args.out)
    report = dict(profile=profile.name, environment=environment(), config=asdict(profile),
                  tolerance=TOLERANCE, ranges=dict(gpu_fractions=GPU_FRACTIONS, cpu_rate_factors=CPU_RATE_FACTORS,
                                                   activation_overhead=ACTIVATION_OVERHEAD,
                                                   decode_roofline_fraction=DECODE_ROOFLINE_FRACTION),
                  skipped_sections={}, section_s={})
    print(f"environment: {report['environment']}", flush=True)
    if gpu:
        device, report["device_note"] = gpu_device(torch.cuda.get_device_name(0),
                                                   torch.cuda.get_device_properties(0).total_memory)
    else:
        from hf_bdlm.planner.model import spec_from_config

        spec = spec_from_config(model_config(profile.train_shape, BLOCK, "blockwise", 1024).to_dict())
        device = quick_cpu_device(spec)
        report["device_note"] = ("dry-run: the planner prices this CPU at rates measured in a second; the figures "
                                 "and verdicts exercise the code, they are not GPU figures")
    report["planner_device"] = asdict(device)
    with tempfile.TemporaryDirectory() as tmp:
        for name in SECTIONS:
            if name not in args.sections:
                report["skipped_sections"][name] = "not in --sections"
                continue
            if clock.left(name) <= 0:
                report["skipped_sections"][name] = "time budget spent"
                continue
            print(f"{name} ({clock.elapsed():.0f} s)", flush=True)
            t0 = time.time()
            try:
                report[name] = run_section(name, profile, device, gpu, clock, pathlib.Path(tmp))
            except Exception as exc:  # the other sections still run
                report[name] = dict(error=f"{type(exc).__name__}: {exc}"[:1000])
            report["section_s"][name] = time.time() - t0
            report["wall_s"] = clock.elapsed()
            write(report, out)
    report["wall_s"] = clock.elapsed()
    report["failed_checks"] = sum(c.get("ok") is False for c in report.get("checks", {}).get("cases", []))
    text = summary(report)
    write(report, out)
    (out / "summary.txt").write_text(text + "\n")
    print(text)
    print(f"wrote {out / 'runbook.json'} and {out / 'summary.txt'} ({report['wall_s']:.0f} s)")
    return 1 if report["failed_checks"] else 0


if __name__ == "__main__":
    sys.exit(main())
