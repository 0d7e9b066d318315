"""The planner on this machine: CPU rates measured once, and predictions of ``benchmarks/parallel_modes.py`` records.

:func:`measure_cpu` times, in as many single-threaded processes as the benchmark ran ranks, all at once (so the
rates are those of ranks sharing the machine's cores, caches and memory bandwidth): (1) the benchmarked model's
matrix multiplies forward and backward (``F.linear`` at its shapes, 4096 rows), (2) the project's block-sparse
attention forward and backward over the vectorized rows of one sequence (``blockwise`` backend, FLOPs counted
from the pairs its tile plan computes), (3) an elementwise add (the bandwidth elementwise work sees) and (4)
gloo's all-gather between the processes; each the fastest of several runs. The rates of the slowest process
become a :class:`~.hardware.DeviceSpec`, cached per process count in a JSON file (``--remeasure`` measures again).

:func:`validate` predicts each record's step time and K/V bytes with that device and the benchmark's own
model config (``benchmarks.parallel_modes.model_config``); the attention work of each rank is what the
``blockwise`` kernel computes there (:func:`~hf_bdlm.attention.tiles.plan_attention` over the sources the sharded
layout attends to). Bytes must equal ``bytes_per_step`` exactly; step times are compared by relative error.

    hf-bdlm plan --validate /tmp/pm.json          # after python -m benchmarks.parallel_modes --out /tmp/pm.json
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from ..parallel.dims import ParallelDims
from .cost import Cluster, Recipe, _members, kv_bytes_by_name, layer_windows, mask_rule_of, predict, rank_work
from .hardware import DeviceSpec
from .model import AttentionShape, ModelSpec, spec_from_config

DEFAULT_CACHE = Path(os.environ.get("HF_BDLM_CACHE", Path.home() / ".cache" / "hf_bdlm")) / "cpu_rates.json"


def benchmark_model(layers: int, window: int | None = None) -> ModelSpec:
    """The model of ``benchmarks/parallel_modes.py``, read from its own config builder."""
    import sys

    root = Path(__file__).resolve().parents[2]  # a source checkout holds benchmarks/ beside hf_bdlm/
    if (root / "benchmarks" / "parallel_modes.py").exists() and str(root) not in sys.path:
        sys.path.append(str(root))
    try:
        from benchmarks.parallel_modes import model_config
    except ImportError as err:
        raise ValueError("--validate needs the repository's benchmarks package on the path (run from the "
                         f"repository root): {err}") from err
    cfg = model_config(layers, window)
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
    import torch
    import torch.nn.functional as F

    a = model.layers[0]
    shapes = [(model.hidden, a.heads * a.head_dim), (model.hidden, 2 * a.kv_heads * a.head_dim),
              (a.heads * a.head_dim, model.hidden), (model.hidden, 2 * model.intermediate),
              (model.intermediate, model.hidden)]
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(rows, i, generator=g, requires_grad=True) for i, _ in shapes]
    ws = [torch.randn(o, i, generator=g, requires_grad=True) for i, o in shapes]

    def run():
        for x, w in zip(xs, ws):
            F.linear(x, w).sum().backward()

    flops = sum(2 * rows * i * o * 3 for i, o in shapes)
    return flops / _best_time(run)


def _attention_rate(model: ModelSpec, seq_len: int = 2048) -> float:
    import torch

    from ..attention.backends import attend
    from ..attention.masks import MaskRule
    from ..attention.rows import vectorized_rows

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

    from ..attention.tiles import plan_attention

    pairs = computed_pairs(plan_attention(rows, [rows], rule))  # what the kernel computes, masked pairs included
    return pairs * 14 * a.heads * a.head_dim / _best_time(run)


def _elementwise_rate(numel: int = 1 << 23) -> float:
    import torch

    x, y = torch.randn(numel), torch.randn(numel)
    out = torch.empty(numel)
    return 3 * numel * 4 / _best_time(lambda: torch.add(x, y, out=out), repeats=9)


def rates_worker(rank: int, world, store: str, out: str, spec_json: str) -> None:
    """One of the ``world`` processes of :func:`measure_cpu`: every process times the kernels at once (as the
    benchmark's ranks compute at once), then the all-gather between them."""
    import torch
    import torch.distributed as dist

    world = int(world)
    torch.set_num_threads(1)
    spec = json.loads(Path(spec_json).read_text())
    model = ModelSpec(**dict(spec, layers=tuple(AttentionShape(**a) for a in spec["layers"]), notes=()))
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        dist.barrier()
    rates = dict(matmul_flops=_matmul_rate(model), attention_flops=_attention_rate(model),
                 hbm_bytes_per_s=_elementwise_rate())
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
        everyone: list = [None] * world
        dist.all_gather_object(everyone, rates)
        dist.destroy_process_group()
        # The group runs at the pace of its slowest rank.
        rates = {k: min(r[k] for r in everyone) for k in rates}
    else:
        rates["intra_node_bytes_per_s"] = float("inf")  # one process moves nothing
    rates["inter_node_bytes_per_s"] = rates["intra_node_bytes_per_s"]
    if rank == 0:
        Path(out).write_text(json.dumps(rates))


def measure_cpu(model: ModelSpec, processes: int = 1) -> dict:
    """This machine's rates at ``model``'s shapes with ``processes`` single-threaded processes timing at once
    (each a fresh interpreter; see the module docstring)."""
    import subprocess
    import sys
    from dataclasses import asdict

    with tempfile.TemporaryDirectory() as tmp:
        out, spec = os.path.join(tmp, "rates.json"), os.path.join(tmp, "spec.json")
        Path(spec).write_text(json.dumps(asdict(model)))
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        code = ("import sys; from hf_bdlm.planner.calibrate import rates_worker; "
                "rates_worker(int(sys.argv[1]), *sys.argv[2:])")
        procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(processes), os.path.join(tmp, "store"),
                                   out, spec], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(processes)]
        errors = [p.communicate(timeout=600)[1] for p in procs]
        if any(p.returncode for p in procs) or not os.path.exists(out):
            raise RuntimeError(f"measuring the CPU rates failed: {next((e for e in errors if e), '')[-2000:]}")
        return json.loads(Path(out).read_text())


def cpu_device(model: ModelSpec, cache: str | os.PathLike = DEFAULT_CACHE, remeasure: bool = False,
               processes: int = 1) -> DeviceSpec:
    """The CPU running ``processes`` ranks as a :class:`DeviceSpec`: rates from ``cache`` (one entry per process
    count), measured and written there when absent or with ``remeasure``."""
    path = Path(cache)
    cached = json.loads(path.read_text()) if path.exists() else {}
    key = str(processes)
    if remeasure or key not in cached.get("processes", {}):
        rates = dict(measure_cpu(model, processes), measured_at=time.strftime("%Y-%m-%d %H:%M:%S"))
        cached.setdefault("processes", {})[key] = rates
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cached, indent=1))
    rates = cached["processes"][key]
    return DeviceSpec(name=f"cpu ({processes} process{'es' if processes > 1 else ''}, 1 thread each)",
                      matmul_flops=rates["matmul_flops"], attention_flops=rates["attention_flops"],
                      memory_bytes=float("inf"), hbm_bytes_per_s=rates["hbm_bytes_per_s"],
                      intra_node_bytes_per_s=rates["intra_node_bytes_per_s"],
                      inter_node_bytes_per_s=rates["inter_node_bytes_per_s"],
                      source=f"measured {rates.get('measured_at', '')} ({path})")


def record_dims(rec: dict) -> ParallelDims:
    """The layout a benchmark record ran (``single``: one process)."""
    if rec["mode"] == "single":
        return ParallelDims(1, 1, "bp", "dual_end", "allgather", 1)
    return ParallelDims(rec["P"], rec["C"], rec["mode"], rec.get("schedule") or "dual_end",
                        rec.get("transport") or "allgather", rec["P"])


def benchmark_recipe(rec: dict) -> Recipe:
    """The benchmark's step: forward and backward, no optimizer, no gradient synchronization."""
    elem = 2 if rec.get("dtype") in ("bfloat16", "bf16") else 4
    return Recipe(param_bytes=elem, grad_bytes=elem, optimizer_bytes=0, activation_bytes=elem, fsdp=False,
                  gradient_sync=False)


def computed_pairs(plan, source: int | None = None) -> int:
    """Query-key pairs a tile plan's kernel calls compute (masked-out pairs of a dense masked call included), over
    every source or one."""
    total = 0
    for c in plan.calls:
        if source is not None and c.source != source:
            continue
        n, q = (1, c.q_rows[1] - c.q_rows[0]) if isinstance(c.q_rows, tuple) else (
            (1, c.q_rows.numel()) if c.q_rows.dim() == 1 else tuple(c.q_rows.shape))
        k = c.k_rows[1] - c.k_rows[0] if isinstance(c.k_rows, tuple) else c.k_rows.shape[-1]
        total += n * q * k
    return total


def blockwise_work(dims: ParallelDims, seq_len: int, rule, works) -> list:
    """``works`` (from :func:`~.cost.rank_work`) with the pairs the ``blockwise`` kernel computes on each rank:
    the tile plans of the sources the sharded layout attends to (own rows; the peers' gathered rows, or each ring
    shard), full-attention layers only."""
    from dataclasses import replace

    from ..attention.tiles import plan_attention
    from ..parallel.plan import PlanConfig, make_plan

    plan = make_plan(PlanConfig.from_dims(dims, seq_len, rule.block_size))
    out = []
    for r, (rp, w) in enumerate(zip(plan.ranks, works)):
        q = rp.rows()
        gathered = dims.mode != "bp" and dims.block_parallel_size > 1 and w.sent_rows > 0
        members = _members(plan, r)

        def sent(m):
            rows = plan.ranks[m].rows()
            return rows.slice(plan.ranks[m].local_noisy_rows if dims.mode == "csbp" else 0, rows.num_rows)

        if gathered and dims.transport == "ring":
            n = rp.local_noisy_rows if dims.mode == "csbp" else 0
            local = computed_pairs(plan_attention(q, [q.slice(0, n)], rule)) if n else 0
            shards = {m: computed_pairs(plan_attention(q, [sent(m)], rule)) for m in members}
            total, local = local + sum(shards.values()), local + shards[r]
        elif gathered:
            from ..attention.rows import RowMeta

            tiles = plan_attention(q, [q, RowMeta.cat([sent(m) for m in members if m != r])], rule)
            total, local = computed_pairs(tiles), computed_pairs(tiles, 0)
        else:
            total = local = computed_pairs(plan_attention(q, [q], rule))
        out.append(replace(w, pairs={**w.pairs, None: total}, local_pairs={**w.local_pairs, None: local}))
    return out


def validate(records: list[dict], device) -> list[dict]:
    """Predicted against measured step time and bytes of each successful record. ``device`` is a
    :class:`DeviceSpec`, or a function of the record's process count returning one."""
    rows = []
    for rec in records:
        if "error" in rec or "step_s" not in rec:
            continue
        model = benchmark_model(rec["layers"], rec.get("window"))
        dims = record_dims(rec)
        recipe = benchmark_recipe(rec)
        work = rank_work(dims, rec["L"], mask_rule_of(model), layer_windows(model))
        if all(a.window is None for a in model.layers):
            work = blockwise_work(dims, rec["L"], mask_rule_of(model), work)  # the CPU kernel's own tiles
        dev = device(dims.world_size) if callable(device) else device
        pred = predict(model, dims, rec["L"], dev, Cluster(dims.world_size, dims.world_size), recipe, work=work)
        by_name = [kv_bytes_by_name(model, dims, w, recipe.activation_bytes) for w in work]
        rows.append(dict(label=pred.label if rec["mode"] != "single" else "single", L=rec["L"],
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
             f"({d.source})" for d in devices]
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


__all__ = ["measure_cpu", "cpu_device", "validate", "format_validation", "benchmark_model", "record_dims"]
