"""The planner on this machine: CPU rates measured once, and the planner's predictions of
:mod:`hf_bdlm.benchmarks.parallel_modes` records (``hf-bdlm plan --validate``, :func:`run_validate`).

:func:`measure_cpu` times, in single-threaded processes all timing at once: (1) the benchmarked model's matrix
multiplies forward and backward (``F.linear`` at its shapes, 4096 rows), (2) the project's block-sparse attention
forward and backward over the vectorized rows of one sequence (``blockwise`` backend, FLOPs counted from the pairs
its tile plan computes), (3) the elementwise bandwidth: for ``--validate``, on the benchmark model's own step at 1K
tokens (what its matmuls and attention leave; :func:`step_elementwise_rate`), otherwise a plain add, (4) gloo's
all-gather bandwidth between the processes, (5) what one synchronization costs ranks that compute between
synchronizations (:func:`_sync_cost`) and (6) the fixed cost of one attention kernel call, forward and backward
(:func:`_kernel_call_cost`; measured alone and added to a cache entry of an older version that lacks it). Each is
the fastest of several runs, taken from the slowest process.
:func:`cpu_device` turns them into a :class:`~.hardware.DeviceSpec`: compute rates from as many processes as cores
(a rank alone on a core), and, when the records ran more ranks than cores, the oversubscribed efficiency (the
benchmark step's throughput in that many processes over the cores') with which the schedule shares the cores; link
and synchronization figures from as many processes as the records' ranks. Cached per process count in a JSON file
(``--remeasure`` measures again).

:func:`validate` predicts each record's step time and K/V bytes with that device and the benchmark's own
model config (:func:`hf_bdlm.benchmarks.parallel_modes.model_config`); the attention work of each rank, full and
sliding-window layers, is what the ``blockwise`` kernel computes there (:func:`~hf_bdlm.attention.tiles.plan_attention`
over the sources the sharded layout attends to: its pairs, masked ones included, and its kernel calls). Bytes must
equal ``bytes_per_step`` exactly; step times are compared by relative error.

    hf-bdlm plan --validate /tmp/pm.json      # after python -m hf_bdlm.benchmarks.parallel_modes --out /tmp/pm.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.distributed as dist

from . import parallel_modes
from ..attention.backends import attend
from ..attention.kernels import block_sparse_attention
from ..attention.masks import MaskRule
from ..attention.rows import vectorized_rows
from ..attention.tiles import KernelCall, TilePlan, plan_attention
from .processes import child_env
from ..cache import cache_home, update_json
from ..parallel.dims import ParallelDims
from ..planner.cost import Cluster, Recipe, kv_bytes_by_name, layer_windows, mask_rule_of, predict, rank_work
from ..planner.hardware import DeviceSpec
from ..planner.kernel_work import blockwise_work, computed_pairs
from ..planner.model import AttentionShape, ModelSpec, spec_from_config
from ..planner.rank_rate import cores, matmul_workload

RATES_FILE = "cpu_rates.json"


def default_rates_path() -> Path:
    """Where measured CPU rates are cached: ``cpu_rates.json`` in the project's cache (``$HF_BDLM_HOME``)."""
    return cache_home() / RATES_FILE


def benchmark_model(layers: int, window: int | None = None, full_every: int | None = None) -> ModelSpec:
    """The model of :mod:`hf_bdlm.benchmarks.parallel_modes`, read from its own config builder."""
    cfg = parallel_modes.model_config(layers, window, full_every=full_every)
    return spec_from_config(cfg.to_dict(), f"parallel_modes ({layers} layers)")


def _best_time(fn, repeats: int = 5) -> float:
    """The fastest of ``repeats`` runs after a warm-up: the machine's rate when nothing else competes for it (other
    processes on a shared machine only ever slow a run down)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _matmul_rate(model: ModelSpec, rows: int = 4096) -> float:
    run, flops = matmul_workload(model, rows)
    return flops / _best_time(run, repeats=5)


def _attention_rate(model: ModelSpec, seq_len: int = 2048) -> float:
    a = model.layers[0]
    rule = MaskRule(model.block_size, model.clean_attention, None, model.window_convention)
    rows = vectorized_rows(seq_len)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, a.heads, 2 * seq_len, a.head_dim, generator=g, requires_grad=True)
    k = torch.randn(1, a.kv_heads, 2 * seq_len, a.head_dim, generator=g, requires_grad=True)
    v = torch.randn(1, a.kv_heads, 2 * seq_len, a.head_dim, generator=g, requires_grad=True)
    cache: dict = {}

    def run():
        attend("blockwise", q, [(k, v)], rows, [rows], rule, a.head_dim ** -0.5, cache).sum().backward()

    pairs = computed_pairs(plan_attention(rows, [rows], rule))  # what the kernel computes, masked pairs included
    return pairs * 14 * a.heads * a.head_dim / _best_time(run, repeats=4)


def _kernel_call_cost(model: ModelSpec, calls: int = 512, rows: int = 8) -> tuple[float, float]:
    """Fixed seconds of one attention kernel call, forward and backward: a plan of ``calls`` calls of ``rows``
    queries over as many keys each (their pairs cost under 3 % of the time) through the project's block-sparse
    attention: row selection, the fused kernel's setup, the LSE merge; backward the gradient scatter."""
    a = model.layers[0]
    n = calls * rows
    plan = TilePlan(tuple(KernelCall((i * rows, (i + 1) * rows), 0, (i * rows, (i + 1) * rows)) for i in range(calls)),
                    n, (n,))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, a.heads, n, a.head_dim, generator=g, requires_grad=True)
    k = torch.randn(1, a.kv_heads, n, a.head_dim, generator=g, requires_grad=True)
    v = torch.randn(1, a.kv_heads, n, a.head_dim, generator=g, requires_grad=True)

    def forward():
        return block_sparse_attention(plan, q, [(k, v)], a.head_dim ** -0.5)[0]

    fwd = _best_time(forward, repeats=7)
    bwd = []
    for _ in range(7):
        loss = forward().sum()
        t0 = time.perf_counter()
        loss.backward()
        bwd.append(time.perf_counter() - t0)
    return fwd / calls, min(bwd) / calls


STEP_TOKENS = 1024  # the benchmark step the calibration times
CALIBRATION_ROUNDS = 3


def _benchmark_step_time(layers: int, seq_len: int = STEP_TOKENS) -> float:
    """One-sequence forward and backward of the benchmark's own model (:mod:`hf_bdlm.benchmarks.parallel_modes`)."""
    net, objective, corrupted = parallel_modes.build(seq_len, layers)

    def step():
        net.zero_grad(set_to_none=True)
        objective.loss(net, corrupted)[0].backward()

    return _best_time(step, repeats=3)


def step_elementwise_rate(model: ModelSpec, rates: dict, seq_len: int = STEP_TOKENS) -> float:
    """The bandwidth the benchmarked step's elementwise work gets: the benchmark step's measured time
    (``rates["benchmark_step_s"]``) minus what its matmuls and attention take at ``rates``, against the elementwise
    bytes the cost model counts for it. Norms, rotary, activations, residuals, the objective's masking and the loss
    run as many small kernels, slower than a plain add; this measures them on the step itself instead of guessing a
    factor."""
    dims = record_dims({"mode": "single"})
    rule = mask_rule_of(model)
    work = blockwise_work(dims, seq_len, rule, rank_work(dims, seq_len, rule, layer_windows(model)))
    device = DeviceSpec("cpu", rates["matmul_flops"], rates["attention_flops"], float("inf"), float("inf"), 1.0, 1.0,
                        kernel_call_fwd_s=rates.get("kernel_call_fwd_s", 0.0),
                        kernel_call_bwd_s=rates.get("kernel_call_bwd_s", 0.0))
    recipe = benchmark_recipe({"dtype": "float32"})
    cluster = Cluster(1, 1)
    rest = predict(model, dims, seq_len, device, cluster, recipe, work=work).step_s
    elementwise_bytes = predict(model, dims, seq_len, replace(device, hbm_bytes_per_s=1.0), cluster, recipe,
                                work=work).step_s - rest
    measured = rates["benchmark_step_s"]
    if measured <= rest:
        raise ValueError(f"the benchmark step took {measured:.3f} s, less than its matmuls and attention alone at the "
                         f"measured rates ({rest:.3f} s): the machine was disturbed while measuring; run --remeasure "
                         "on a quiet machine.")
    return elementwise_bytes / (measured - rest)


def _elementwise_rate(numel: int = 1 << 23) -> float:
    x, y = torch.randn(numel), torch.randn(numel)
    out = torch.empty(numel)
    return 3 * numel * 4 / _best_time(lambda: torch.add(x, y, out=out), repeats=9)


def _sync_cost(world: int, chunk_s: float = 0.02, rounds: int = 15) -> float:
    """What one synchronization costs ranks that compute between them, as the benchmark's do: the wall time of
    ``rounds`` of (``chunk_s`` of matmuls, then an all-gather of a few bytes) minus that of the same matmuls alone,
    per round; the slowest rank's matmuls alone set the reference. It holds gloo's latency and, with more ranks than
    cores, the cost of the scheduler's time slices (a rank that has finished its share waits for the slices of the
    ranks that have not, and a woken rank for a core)."""
    a = torch.randn(256, 256)
    t0 = time.perf_counter()
    for _ in range(20):
        a @ a
    reps = max(1, round(chunk_s / ((time.perf_counter() - t0) / 20)))
    tiny, buf = torch.ones(2), torch.empty(2 * world)
    times = {}
    for synced in (False, True):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(rounds):
            for _ in range(reps):
                a @ a
            if synced:
                dist.all_gather_into_tensor(buf, tiny)
        times[synced] = time.perf_counter() - t0
    plain = [None] * world
    dist.all_gather_object(plain, times[False])
    return max(0.0, (times[True] - max(plain)) / rounds)


def rates_worker(rank: int, world, store: str, out: str, spec_json: str, benchmark_layers: str = "0") -> None:
    """One of the ``world`` processes of :func:`measure_cpu`: every process times the kernels at once (as the
    benchmark's ranks compute at once), then the all-gather between them."""
    world = int(world)
    torch.set_num_threads(1)
    spec = json.loads(Path(spec_json).read_text())
    model = ModelSpec(**dict(spec, layers=tuple(AttentionShape(**a) for a in spec["layers"]), notes=()))
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)

    def together(measure):
        # Every process times the same thing at the same time (the phases take different times per process).
        if world > 1:
            dist.barrier()
        return measure()

    # Rounds spread each measurement over time: a slow spell of the machine (a shared host) spoils one round, not
    # the best of them.
    rates: dict = {}
    for _ in range(CALIBRATION_ROUNDS):
        for key, measure in (("matmul_flops", lambda: _matmul_rate(model)),
                             ("attention_flops", lambda: _attention_rate(model)),
                             ("hbm_bytes_per_s", _elementwise_rate)):
            rates[key] = max(rates.get(key, 0.0), together(measure))
        fwd, bwd = together(lambda: _kernel_call_cost(model))
        rates["kernel_call_fwd_s"] = min(rates.get("kernel_call_fwd_s", float("inf")), fwd)
        rates["kernel_call_bwd_s"] = min(rates.get("kernel_call_bwd_s", float("inf")), bwd)
        if int(benchmark_layers):
            step = together(lambda: _benchmark_step_time(int(benchmark_layers)))
            rates["benchmark_step_s"] = min(rates.get("benchmark_step_s", float("inf")), step)
    if world > 1:
        dist.barrier()
        shard = torch.ones((32 << 20) // 4 // world)  # float32; a 32 MiB gathered buffer
        buf = torch.empty(world * shard.numel())
        dist.all_gather_into_tensor(buf, shard)
        times = []
        for _ in range(5):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_gather_into_tensor(buf, shard)
            times.append(time.perf_counter() - t0)
        rates["intra_node_bytes_per_s"] = (world - 1) * shard.numel() * 4 / min(times)
        rates["sync_cost_s"] = _sync_cost(world)
        everyone: list = [None] * world
        dist.all_gather_object(everyone, rates)
        dist.destroy_process_group()
        # The group runs at the pace of its slowest rank.
        rates = {k: min(r[k] for r in everyone) for k in rates}
        rates["sync_cost_s"] = max(r["sync_cost_s"] for r in everyone)
        for key in ("kernel_call_fwd_s", "kernel_call_bwd_s"):  # costs: the slowest rank's
            rates[key] = max(r[key] for r in everyone)
        if "benchmark_step_s" in rates:
            rates["benchmark_step_s"] = max(r["benchmark_step_s"] for r in everyone)
    else:
        rates["intra_node_bytes_per_s"] = float("inf")  # one process moves nothing
        rates["sync_cost_s"] = 0.0
    rates["inter_node_bytes_per_s"] = rates["intra_node_bytes_per_s"]
    if rank == 0:
        Path(out).write_text(json.dumps(rates))


def measure_cpu(model: ModelSpec, processes: int = 1, benchmark_layers: int = 0) -> dict:
    """This machine's rates at ``model``'s shapes with ``processes`` single-threaded processes timing at once
    (each a fresh interpreter; see the module docstring). With ``benchmark_layers``, ``model`` is the benchmark's
    model of that many layers and the elementwise bandwidth is measured on its step."""
    with tempfile.TemporaryDirectory() as tmp:
        out, spec = os.path.join(tmp, "rates.json"), os.path.join(tmp, "spec.json")
        Path(spec).write_text(json.dumps(asdict(model)))
        env = child_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # the same hf_bdlm as this process
        code = ("import sys; from hf_bdlm.benchmarks.calibrate import rates_worker; "
                "rates_worker(int(sys.argv[1]), *sys.argv[2:])")
        procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(processes), os.path.join(tmp, "store"),
                                   out, spec, str(benchmark_layers)],
                                  env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(processes)]
        errors = [p.communicate(timeout=600)[1] for p in procs]
        if any(p.returncode for p in procs) or not os.path.exists(out):
            # The process that failed first, not a peer that lost its connection to it.
            failed = [e for p, e in zip(procs, errors) if p.returncode] or [e for e in errors if e] or [""]
            cause = next((e for e in failed if "closed by peer" not in e), failed[0])
            raise RuntimeError(f"measuring the CPU rates failed: {cause[-2000:]}")
        return json.loads(Path(out).read_text())


def _kernel_call_cost_alone(model: ModelSpec) -> tuple[float, float]:
    """:func:`_kernel_call_cost` in this process, on one thread as the benchmark's ranks run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = [_kernel_call_cost(model) for _ in range(CALIBRATION_ROUNDS)]
        return min(f for f, _ in runs), min(b for _, b in runs)
    finally:
        torch.set_num_threads(threads)


def _rates(model: ModelSpec, cache: Path, remeasure: bool, processes: int, benchmark_layers: int = 0) -> dict:
    key = str(processes)

    def measure_if_stale(cached: dict) -> dict | None:
        # Under the cache file's lock: processes asking at once measure once, and never on top of each other.
        entry = cached.get("processes", {}).get(key)
        # An entry of an older version lacks the synchronization cost; one of another benchmark model its step's rate.
        if not remeasure and entry is not None and "sync_cost_s" in entry and \
                entry.get("benchmark_layers", 0) == benchmark_layers:
            if "kernel_call_fwd_s" in entry:
                return None
            # An entry of an older version lacks the per-call cost: measure it alone, keeping the rates measured
            # with the records it belongs to.
            entry.update(zip(("kernel_call_fwd_s", "kernel_call_bwd_s"), _kernel_call_cost_alone(model)))
            return cached
        entry = dict(measure_cpu(model, processes, benchmark_layers), benchmark_layers=benchmark_layers,
                     measured_at=time.strftime("%Y-%m-%d %H:%M:%S"))
        cached.setdefault("processes", {})[key] = entry
        return cached

    return update_json(cache, measure_if_stale)["processes"][key]


def cpu_device(model: ModelSpec, cache: str | os.PathLike | None = None, remeasure: bool = False,
               processes: int = 1, num_cores: int | None = None, benchmark_layers: int = 0) -> DeviceSpec:
    """The CPU running ``processes`` single-threaded ranks on ``num_cores`` cores (default: :func:`cores`) as a
    :class:`DeviceSpec`, from rates cached in ``cache`` per process count (measured and written there when absent
    or with ``remeasure``).

    The compute rates are those of ``min(processes, num_cores)`` processes timing at once: a rank alone on a
    core. With more ranks than cores, ``oversubscribed_efficiency`` is what ``processes`` processes timing at once
    get together over what the cores got (the benchmark's step where measured, else matmul and attention averaged),
    and the schedule shares the cores among the ranks computing at each moment. Link bandwidth and the cost of a
    synchronization are the ``processes``-process measurements.
    """
    path = Path(cache) if cache is not None else default_rates_path()
    n_cores = num_cores or cores()
    own = _rates(model, path, remeasure, min(processes, n_cores), benchmark_layers)
    group = _rates(model, path, remeasure, processes, benchmark_layers) if processes > n_cores else own
    efficiency = 1.0
    if processes > n_cores and "benchmark_step_s" in own and "benchmark_step_s" in group:
        # The benchmark's own step, timed in every process at once: throughput of P processes over the cores'.
        efficiency = processes * own["benchmark_step_s"] / (n_cores * group["benchmark_step_s"])
    elif processes > n_cores:
        efficiency = sum(group[k] * processes / (own[k] * n_cores) for k in ("matmul_flops", "attention_flops")) / 2
    # Sharing the cores can only lose throughput; a ratio above 1 is the measurements' own noise.
    efficiency = min(1.0, efficiency)
    # The elementwise bandwidth of the benchmark's own step where it was timed, else a plain add's.
    hbm = step_elementwise_rate(model, own) if "benchmark_step_s" in own else own["hbm_bytes_per_s"]
    name = f"cpu ({processes} process{'es' if processes > 1 else ''} on {n_cores} cores, 1 thread each)"
    return DeviceSpec(name=name,
                      matmul_flops=own["matmul_flops"], attention_flops=own["attention_flops"],
                      memory_bytes=float("inf"), hbm_bytes_per_s=hbm,
                      intra_node_bytes_per_s=group["intra_node_bytes_per_s"],
                      inter_node_bytes_per_s=group["inter_node_bytes_per_s"],
                      sync_cost_s=group["sync_cost_s"], shared_cores=n_cores,
                      oversubscribed_efficiency=efficiency,
                      kernel_call_fwd_s=own.get("kernel_call_fwd_s", 0.0),
                      kernel_call_bwd_s=own.get("kernel_call_bwd_s", 0.0),
                      source=f"measured {group.get('measured_at', '')} ({path})")


def cpu_devices(model: ModelSpec, process_counts, cache: str | os.PathLike | None = None, remeasure: bool = False,
                num_cores: int | None = None, benchmark_layers: int = 0) -> dict[int, DeviceSpec]:
    """:func:`cpu_device` for each of ``process_counts``; with ``remeasure`` each measurement they share runs once."""
    n_cores = num_cores or cores()
    cache = Path(cache) if cache is not None else default_rates_path()
    if remeasure:
        for key in sorted({min(p, n_cores) for p in process_counts} | {p for p in process_counts if p > n_cores}):
            _rates(model, cache, True, key, benchmark_layers)
    return {p: cpu_device(model, cache, False, p, n_cores, benchmark_layers) for p in sorted(set(process_counts))}


def record_dims(rec: dict) -> ParallelDims:
    """The layout a benchmark record ran (``single``: one process)."""
    if rec["mode"] == "single":
        return ParallelDims(1, 1, "bp", "dual_end", "allgather", 1)
    return ParallelDims(rec["P"], rec["C"], rec["mode"], rec.get("schedule") or "dual_end",
                        rec.get("transport") or "allgather", rec["P"], rec.get("cp_layout") or "balanced")


def benchmark_recipe(rec: dict) -> Recipe:
    """The benchmark's step: forward and backward, no optimizer, no gradient synchronization."""
    elem = 2 if rec.get("dtype") in ("bfloat16", "bf16") else 4
    return Recipe(param_bytes=elem, grad_bytes=elem, optimizer_bytes=0, activation_bytes=elem, fsdp=False,
                  gradient_sync=False)


def validate(records: list[dict], device) -> list[dict]:
    """Predicted against measured step time and bytes of each successful record. ``device`` is a
    :class:`DeviceSpec`, or a function of the record's process count returning one."""
    rows = []
    for rec in records:
        if "error" in rec or "step_s" not in rec:
            continue
        model = benchmark_model(rec["layers"], rec.get("window"), rec.get("full_every"))
        dims = record_dims(rec)
        recipe = benchmark_recipe(rec)
        work = rank_work(dims, rec["L"], mask_rule_of(model), layer_windows(model))
        work = blockwise_work(dims, rec["L"], mask_rule_of(model), work)  # the CPU kernel's own tiles
        dev = device(dims.world_size) if callable(device) else device
        link = rec.get("link")
        if link and dims.block_parallel_size > 1:  # the record's collectives went through an emulated link
            # The link charges its own element size (the cluster's dtype); the cost model counts the bytes moved
            # here, so the same transfer time is those bytes at the bandwidth scaled by local / wire element size.
            per_wire = recipe.activation_bytes / (link.get("element_bytes") or recipe.activation_bytes)
            bandwidth = link["bytes_per_s"] * per_wire
            dev = replace(dev, intra_node_bytes_per_s=bandwidth, inter_node_bytes_per_s=bandwidth,
                          link_latency_s=link["latency_s"])
        pred = predict(model, dims, rec["L"], dev, Cluster(dims.world_size, dims.world_size), recipe, work=work)
        by_name = [kv_bytes_by_name(model, dims, w, recipe.activation_bytes) for w in work]
        rows.append(dict(label=(pred.label if rec["mode"] != "single" else "single")
                         + (f" [{link['name']}]" if link and dims.block_parallel_size > 1 else ""), L=rec["L"],
                         predicted_s=pred.step_s, measured_s=rec["step_s"],
                         rel_err=(pred.step_s - rec["step_s"]) / rec["step_s"],
                         predicted_bytes=pred.bytes_per_step, measured_bytes=rec.get("bytes_per_step", 0),
                         predicted_by_name={k: max(b.get(k, 0) for b in by_name) for k in set().union(*by_name)},
                         measured_by_name=rec.get("bytes_by_name", {}),
                         attention_s=max(r.attention_s for r in pred.ranks),
                         linear_s=max(r.linear_s for r in pred.ranks),
                         exposed_comm_s=max(r.exposed_comm_s for r in pred.ranks),
                         measured_wait_s=rec.get("comm_wait_s"),
                         # The benchmark's peak is the RSS high-water mark above the RSS once the model is built.
                         predicted_mem=pred.memory.total - pred.memory.parameters,
                         measured_mem=rec.get("peak_mem_bytes")))
    return rows


def format_validation(rows: list[dict], devices: list[DeviceSpec]) -> str:
    head = (f"{'layout':34} {'L':>6} {'pred_s':>8} {'meas_s':>8} {'err':>7} {'attn_s':>7} {'mat_s':>7} {'comm_s':>7} "
            f"{'wait_s':>7} {'pred_bytes':>11} {'meas_bytes':>11} bytes {'pred_MiB':>8} {'meas_MiB':>8}")
    lines = [f"{d.name}: matmul {d.matmul_flops / 1e9:.1f} GFLOP/s, attention {d.attention_flops / 1e9:.1f} GFLOP/s, "
             f"elementwise {d.hbm_bytes_per_s / 1e9:.1f} GB/s, gloo {d.intra_node_bytes_per_s / 1e9:.2f} GB/s "
             f"+ {d.sync_cost_s * 1e3:.2f} ms per synchronization, oversubscribed efficiency "
             f"{d.oversubscribed_efficiency:.2f}, {d.kernel_call_fwd_s * 1e3:.3f} + {d.kernel_call_bwd_s * 1e3:.3f} ms "
             f"per attention kernel call (fwd + bwd) ({d.source})" for d in devices]
    lines += [head, "-" * len(head)]
    for r in rows:
        same = r["predicted_bytes"] == r["measured_bytes"] and all(
            r["predicted_by_name"].get(k, 0) == v for k, v in r["measured_by_name"].items())
        lines.append(f"{r['label']:34} {r['L']:>6} {r['predicted_s']:8.3f} {r['measured_s']:8.3f} {r['rel_err']:+7.1%} "
                     f"{r['attention_s']:7.3f} {r['linear_s']:7.3f} {r['exposed_comm_s']:7.3f} "
                     f"{(r['measured_wait_s'] or 0):7.3f} {r['predicted_bytes']:>11} {r['measured_bytes']:>11} "
                     f"{'equal' if same else 'DIFFER':5} {r['predicted_mem'] / 2**20:8.1f} "
                     f"{(r['measured_mem'] or 0) / 2**20:8.1f}")
    if rows:
        worst = max(abs(r["rel_err"]) for r in rows)
        within = sum(abs(r["rel_err"]) <= 0.2 for r in rows)
        lines.append(f"{within}/{len(rows)} within 20 %, worst {worst:.1%}; bytes equal for "
                     f"{sum(r['predicted_bytes'] == r['measured_bytes'] for r in rows)}/{len(rows)}")
    return "\n".join(lines)


def run_validate(args) -> int:
    """``hf-bdlm plan --validate RECORDS_JSON``: the planner's predictions of benchmark records, on this machine's
    measured CPU figures (``--rates-cache``, ``--remeasure``, ``--cores``, ``--json``: see ``hf-bdlm plan --help``)."""
    with open(args.validate) as f:
        records = json.load(f)
    if not isinstance(records, list):
        raise ValueError(f"{args.validate} must hold a JSON list of hf_bdlm.benchmarks.parallel_modes records.")
    ok = [r for r in records if "error" not in r and "step_s" in r]
    if not ok:
        raise ValueError(f"{args.validate} has no successful record (each needs mode, P, C, L, layers, step_s).")
    model = benchmark_model(ok[0]["layers"], ok[0].get("window"))
    if args.cores is not None and args.cores <= 0:
        raise ValueError(f"--cores must be a positive number of cores, got {args.cores}.")
    counts = {1 if r["mode"] == "single" else r["P"] for r in ok}
    beside = Path(args.validate).parent / RATES_FILE
    # The figures measured with the records, unless asked to measure this machine now.
    cache = args.rates_cache or (beside if beside.exists() and not args.remeasure else default_rates_path())
    print(f"CPU figures: {cache}{' (measured now)' if args.remeasure else ''}")
    devices = cpu_devices(model, counts, cache, args.remeasure, args.cores,
                          benchmark_layers=ok[0]["layers"])
    rows = validate(ok, devices.__getitem__)
    print(format_validation(rows, list(devices.values())))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


__all__ = ["measure_cpu", "cpu_device", "cpu_devices", "cores", "validate", "format_validation", "benchmark_model",
           "record_dims", "run_validate", "step_elementwise_rate"]
