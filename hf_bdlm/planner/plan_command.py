"""``hf-bdlm plan``: predict every layout's memory and step time, recommend the fastest that fits.

    hf-bdlm plan --model gemma3-27b --context 262144 --gpus 16 --gpus-per-node 8 --gpu h200
    hf-bdlm plan --model path/to/config.json --context 131072 --gpus 8 --gpu-spec measured_h100.json
    hf-bdlm plan --paper                         # the paper's settings next to its published ratios
    hf-bdlm plan --validate /tmp/pm.json         # predict hf_bdlm.benchmarks.parallel_modes records on this CPU

``--validate`` runs :func:`hf_bdlm.benchmarks.calibrate.run_validate` (the benchmarks import the planner, never the
reverse). The parser needs only the light modules (:mod:`.hardware`, :mod:`.model`); the pricing (:mod:`.cost`,
:mod:`.workload`: torch and the parallel plan) is imported by the functions that run it.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import TYPE_CHECKING

from ..progress import progress_bar, write
from ..protocols.registry import REGISTRY, family_named
from .hardware import DEFAULT_EFFICIENCY, GPUS, device_spec
from .model import model_spec, preset_names

if TYPE_CHECKING:
    from .cost import Prediction
    from .workload import Recipe

GIB = 2 ** 30

# The paper's settings and published figures (docs/design.md, docs/benchmarks.md: "Block Parallelism For Efficient
# Distributed Long-Context Diffusion Language Model Training"), printed next to the planner's predictions, never fitted
# to: (setting, preset, L, published, model parallelism inside a GPU pair). The conversion's are here; a model family
# adds its own (its planning role's `paper_settings`).
CONVERSION_SETTINGS = (
    ("AR->BDLM conversion", "gemma3-27b", 262144, "CSBP / best baseline throughput 1.27-1.33x, equal or lower memory",
     "tp"),
    ("AR->BDLM conversion", "gemma3-27b", 524288, "1.61x full-model speedup at 512K", "tp"),
)
# The paper's topology: 16 GPUs in 2 nodes of 8; tensor or expert parallelism of 2 inside a node (the setting's last
# field), and the CP/BP group of 8 ranks (each a pair of GPUs) across both nodes.
PAPER_GROUP, PAPER_PAIR = 8, 2
SENSITIVITY = (0.25, 0.5, 1.0, 2.0, 4.0)  # InfiniBand bandwidth, times the datasheet figure


def paper_settings() -> tuple[tuple[str, str, int, str, str], ...]:
    """The conversion's settings, then every model family's (the registry's order)."""
    families = [family_named(e.name) for e in REGISTRY]
    return CONVERSION_SETTINGS + tuple(s for f in families if f.has_role("planning")
                                       for s in f.role("planning").paper_settings())


def add_plan_parser(subparsers):
    """Add ``hf-bdlm plan`` to ``subparsers``; returns its parser (the command sets what runs it: :func:`run_plan`, or
    with ``--validate`` the benchmarks' :func:`hf_bdlm.benchmarks.calibrate.run_validate`)."""
    p = subparsers.add_parser(
        "plan", help="predict memory and step time of every parallel layout; recommend one",
        description="For every layout of --gpus GPUs (data parallel x cp / bp / csbp with each clean ring C | P, "
                    "FSDP2 over the world, with and without activation checkpointing) predict per-rank peak memory "
                    "and step time from counted FLOPs, the K/V byte formulas and the device's rates; mark what does "
                    "not fit and recommend the fastest layout that does. The model is in docs/design.md §6.")
    p.add_argument("--model", help=f"a preset ({', '.join(preset_names())}), a config.json, or a folder holding one")
    p.add_argument("--context", type=int, help="sequence length L (tokens)")
    p.add_argument("--gpus", type=int, default=16)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu", default="h200", help=f"one of {', '.join(GPUS)} (datasheet figures)")
    p.add_argument("--gpu-spec", default=None, help="JSON object of measured DeviceSpec fields replacing the GPU's")
    for name, value in DEFAULT_EFFICIENCY.items():
        p.add_argument(f"--{name}-efficiency", type=float, default=None,
                       help=f"achievable fraction of the datasheet {name} figure (default {value})")
    p.add_argument("--memory-gib", type=float, default=None, help="usable device memory (GiB), replaces the GPU's")
    p.add_argument("--block-size", type=int, default=None, help="diffusion block size (default: the config's, or 32)")
    p.add_argument("--no-fsdp", action="store_true", help="replicated parameters (DDP) instead of FSDP2")
    p.add_argument("--activation-overhead", type=float, default=1.0,
                   help="multiply the activation estimate by this measured ratio (allocator retention, workspaces)")
    p.add_argument("--no-ring", action="store_true", help="leave out the ring K/V transport")
    p.add_argument("--top", type=int, default=None, help="print only the N fastest layouts")
    p.add_argument("--json", default=None, help="also write every prediction to this JSON file")
    p.add_argument("--paper", action="store_true", help="the paper's settings on 16 H200 (2 nodes of 8)")
    p.add_argument("--validate", metavar="RECORDS_JSON", default=None,
                   help="predict the step times and bytes of parallel-mode records (hf-bdlm bench, "
                        "python -m hf_bdlm.benchmarks.parallel_modes) on this machine")
    p.add_argument("--rates-cache", default=None,
                   help="CPU figures for --validate (default: the cpu_rates.json hf-bdlm bench wrote beside the "
                        "records, measured with them; else cpu_rates.json in $HF_BDLM_HOME (default ~/.cache/hf_bdlm), "
                        "measured when absent)")
    p.add_argument("--remeasure", action="store_true", help="measure the CPU rates again for --validate")
    p.add_argument("--cores", type=int, default=None,
                   help="cores the benchmark's ranks shared, for --validate (default: this process's CPU affinity)")
    return p


def _device(args):
    eff = {k: getattr(args, f"{k}_efficiency") for k in DEFAULT_EFFICIENCY
           if getattr(args, f"{k}_efficiency") is not None}
    for k, v in eff.items():
        if not 0 < v <= 1:
            raise ValueError(f"--{k}-efficiency must be in (0, 1], got {v}.")
    memory = None if args.memory_gib is None else args.memory_gib * GIB
    return device_spec(args.gpu, args.gpu_spec, eff, memory_bytes=memory)


def _recipe(args) -> Recipe:
    # lazy: the cost model imports torch; hf-bdlm plan --help stays free of it (tests/package/test_cli_help.py)
    from .workload import Recipe

    if not args.activation_overhead >= 1:
        raise ValueError(f"--activation-overhead must be at least 1 (a measured ratio of real to estimated "
                         f"activation memory), got {args.activation_overhead}.")
    return Recipe(fsdp=not args.no_fsdp, activation_overhead=args.activation_overhead)


def _row(i: int, p: Prediction, best: Prediction | None) -> str:
    m = p.memory
    states = m.parameters + m.gradients + m.optimizer + m.fsdp_transient
    mark = "*" if p is best else " "
    return (f"{mark}{i:>3} {p.label:34} {'on' if p.checkpointing else 'off':3} {p.step_s:9.3g} {p.tokens_per_s:10.0f} "
            f"{m.total / GIB:8.1f} {states / GIB:7.1f} {m.activations / GIB:8.1f} {m.gathered_kv / GIB:6.1f} "
            f"{'yes' if p.fits else 'NO':>4} {p.bytes_per_step / GIB:8.2f} "
            f"{max(r.exposed_comm_s for r in p.ranks):7.2f} "
            f"{p.imbalance:5.2f}")


def format_table(preds: list[Prediction], best: Prediction | None, device, top: int | None = None) -> str:
    head = (f" {'#':>3} {'layout':34} {'AC':3} {'step_s':>9} {'tok/s':>10} {'peakGiB':>8} {'states':>7} {'acts':>8} "
            f"{'kv':>6} {'fits':>4} {'KV GiB':>8} {'exp_s':>7} {'imbal':>5}")
    lines = [head, "-" * len(head)]
    for i, p in enumerate(preds[:top] if top else preds, 1):
        lines.append(_row(i, p, best))
    lines.append(f"(memory limit {device.memory_bytes / GIB:.1f} GiB per device; states = parameters + gradients + "
                 "AdamW + gathered FSDP units; KV GiB = K/V bytes received per rank per step; exp_s = exposed "
                 "communication of the slowest rank; imbal = slowest rank's compute / mean)")
    for mode in ("csbp", "cp", "bp"):
        fastest = max((p for p in preds if p.fits and p.dims.mode == mode), key=lambda p: p.tokens_per_s, default=None)
        if fastest is not None:
            lines.append(f"fastest fitting {mode}: {fastest.label}, AC {'on' if fastest.checkpointing else 'off'}, "
                         f"{fastest.tokens_per_s:.0f} tokens/s, {fastest.memory.total / GIB:.1f} GiB")
    if best is None:
        lines.append("no layout fits the device memory")
    else:
        lines.append(f"recommended: {best.label}, activation checkpointing {'on' if best.checkpointing else 'off'}: "
                     f"{best.step_s:.3g} s/step, {best.tokens_per_s:.0f} tokens/s, {best.memory.total / GIB:.1f} GiB "
                     "peak per device")
    return "\n".join(lines)


def _to_json(p: Prediction) -> dict:
    d = p.dims
    return dict(mode=d.mode, P=d.block_parallel_size, C=d.clean_ring_size, D=d.data_parallel_size,
                schedule=d.schedule, transport=d.transport, checkpointing=p.checkpointing, seq_len=p.seq_len,
                step_s=p.step_s, tokens_per_s=p.tokens_per_s, fits=p.fits, bytes_per_step=p.bytes_per_step,
                memory=p.memory.parts(), peak_bytes=p.memory.total, imbalance=p.imbalance)


def compare_modes(preds: list[Prediction], group: int | None = None) -> dict:
    """The fastest fitting CSBP prediction against the fastest fitting baseline (``cp`` or ``bp``), over every
    layout or over those with block-parallel groups of ``group`` ranks."""
    fit = [p for p in preds if p.fits and group in (None, p.dims.block_parallel_size)]
    csbp = max((p for p in fit if p.dims.mode == "csbp" and p.dims.clean_ring_size > 1), default=None,
               key=lambda p: p.tokens_per_s)
    base = max((p for p in fit if p.dims.mode in ("cp", "bp") and p.dims.block_parallel_size > 1), default=None,
               key=lambda p: p.tokens_per_s)
    return dict(csbp=csbp, baseline=base)


def paper_topology(model, L: int, device, recipe: Recipe, checkpointing: bool = True) -> dict:
    """The paper's topology (:data:`PAPER_GROUP` ranks of :data:`PAPER_PAIR` GPUs): CSBP (its fastest clean ring), this project's balanced cp,
    the paper's CP baseline and bp (its faster schedule) on a group of 8 ranks across two nodes, each rank a pair of
    GPUs, and the breakdown of the paper-CP / CSBP difference, by pricing the layouts between them (the balanced cp
    with the paper's blocking transfers and whole-sequence sliding gathers, then overlapped, then with halos)."""
    # lazy: the cost model imports torch; hf-bdlm plan --help stays free of it (tests/package/test_cli_help.py)
    from .cost import CommStyle, predict
    from .workload import Cluster
    from ..parallel.dims import ParallelDims, divisors

    cluster = Cluster(PAPER_GROUP, PAPER_GROUP // 2)  # 4 ranks (pairs) per node
    P = PAPER_GROUP

    def run(mode, C=None, schedule="dual_end", cp_layout="balanced", style=None):
        dims = ParallelDims(P, C, mode, schedule, "allgather", P, cp_layout)
        return predict(model, dims, L, device, cluster, recipe, checkpointing, style=style)

    csbp = {C: run("csbp", C) for C in divisors(P) if C > 1}
    best_c = min(csbp, key=lambda C: csbp[C].step_s)
    out = dict(csbp=csbp[best_c], csbp_full_ring=csbp[P], cp=run("cp"), paper=run("cp", cp_layout="paper"),
               bp=min((run("bp", 1, s) for s in ("dual_end", "contiguous")), key=lambda p: p.step_s))
    blocking_whole = run("cp", style=CommStyle(blocking=True, whole_sliding=True)).step_s
    overlapped_whole = run("cp", style=CommStyle(blocking=False, whole_sliding=True)).step_s
    out["breakdown"] = {
        "imbalance (contiguous clean shards)": out["paper"].step_s - blocking_whole,
        "exposed communication (blocking transfers)": blocking_whole - overlapped_whole,
        "sliding-layer traffic (whole gathers, not halos)": overlapped_whole - out["cp"].step_s,
        "noisy K/V traffic (cp, not csbp)": out["cp"].step_s - csbp[P].step_s,
        "clean ring smaller than the group": csbp[P].step_s - out["csbp"].step_s,
    }
    return out


def _heading(intro: str, head: str) -> None:
    write(intro + "\n")
    write(head)
    write("-" * len(head))


def run_paper_topology(args, device, bar=None) -> None:
    """The section of the paper's topology; ``bar`` (a progress bar) moves by one per configuration priced (each
    setting, then each setting at each bandwidth of :data:`SENSITIVITY`)."""
    _heading(f"The paper's topology: 16 {device.name.upper()} in 2 nodes of 8; tensor parallelism 2 (27B conversion) "
             "or expert parallelism 2 (26B-A4B) inside a node; one CP/BP group of 8 ranks (pairs of GPUs) across both "
             "nodes; FSDP2; activation checkpointing on (the paper's recipes).",
             f"{'setting':20} {'context':>7} {'CSBP layout':24} {'CSBP s':>7} {'cp-paper s':>10} {'cp s':>6} "
             f"{'bp s':>6} {'vs cp-paper':>11} {'vs cp':>6} {'vs bp':>6}  published")
    results = []
    for setting, preset, L, published, model_parallel in paper_settings():
        model = model_spec(preset, args.block_size)
        recipe = replace(_recipe(args), model_parallel=PAPER_PAIR, model_parallel_kind=model_parallel)
        r = paper_topology(model, L, device, recipe)
        if bar is not None:
            bar.update(1)
        results.append((setting, preset, L, model, recipe, r))
        cs = r["csbp"]
        write(f"{setting:20} {L // 1024:>6}K {cs.label.split(' D=')[0]:24} {cs.step_s:7.2f} {r['paper'].step_s:10.2f} "
              f"{r['cp'].step_s:6.2f} {r['bp'].step_s:6.2f} {r['paper'].step_s / cs.step_s:10.2f}x "
              f"{r['cp'].step_s / cs.step_s:5.2f}x {r['bp'].step_s / cs.step_s:5.2f}x  {published}")
    write("\nWhere the paper-CP / CSBP difference comes from (seconds per step; each line is the step-time difference "
          "between two neighbouring layouts, so the lines add up to cp-paper - CSBP):")
    for setting, preset, L, _, _, r in results:
        total = r["paper"].step_s - r["csbp"].step_s
        parts = "; ".join(f"{k} {v:+.2f} s ({v / total:.0%})" for k, v in r["breakdown"].items())
        write(f"  {setting} {L // 1024}K: {total:.2f} s = {parts}")
    write("\nSensitivity to the inter-node bandwidth (CSBP's speed-up over cp-paper / over this project's cp):")
    write(f"  {'setting':20} {'context':>7} " + " ".join(f"{f'IB x{f:g}':>13}" for f in SENSITIVITY))
    for setting, preset, L, model, recipe, _ in results:
        cells = []
        for f in SENSITIVITY:
            scaled = replace(device, inter_node_bytes_per_s=device.inter_node_bytes_per_s * f)
            r = paper_topology(model, L, scaled, recipe)
            if bar is not None:
                bar.update(1)
            cells.append(f"{r['paper'].step_s / r['csbp'].step_s:.2f}/{r['cp'].step_s / r['csbp'].step_s:.2f}")
        write(f"  {setting:20} {L // 1024:>6}K " + " ".join(f"{c:>13}" for c in cells))
    write()


def run_paper(args) -> int:
    """``hf-bdlm plan --paper``, with a progress bar over the configurations it prices (standard error, on a
    terminal: :mod:`hf_bdlm.progress`; the tables go to standard output through the bar)."""
    # lazy: the cost model imports torch; hf-bdlm plan --help stays free of it (tests/package/test_cli_help.py)
    from .cost import plan_all
    from .workload import Cluster

    device = _device(args)
    settings = paper_settings()
    with progress_bar(total=len(settings) * (2 + len(SENSITIVITY)) + len(REGISTRY), desc="plan --paper",
                      unit="configuration") as bar:
        run_paper_topology(args, device, bar)
        cluster = Cluster(16, 8)
        _heading(f"Every layout of the paper's 16 {device.name.upper()} (2 nodes of 8), FSDP2 over the world; device "
                 f"{device.matmul_flops / 1e12:.0f} TFLOP/s matmul, {device.attention_flops / 1e12:.0f} TFLOP/s "
                 f"attention, {device.memory_bytes / GIB:.0f} GiB usable; baselines cp (balanced) and bp. A "
                 "comparison, not a fit: nothing here is tuned to the published figures.",
                 f"{'setting':20} {'context':>7} {'groups':6} {'CSBP (fastest fitting)':36} "
                 f"{'best baseline (fastest fitting)':36} {'tok/s':>6} {'mem':>5}  published")
        for setting, preset, L, published, _ in settings:
            model = model_spec(preset, args.block_size)
            preds = plan_all(model, L, device, cluster, _recipe(args), ring_transport=not args.no_ring)
            bar.update(1)
            for group in (None, cluster.gpus):
                c = compare_modes(preds, group)
                cs, base = c["csbp"], c["baseline"]

                def name(p):
                    return "none fits" if p is None else p.name

                ratio = f"{cs.tokens_per_s / base.tokens_per_s:.2f}x" if cs and base else "n/a"
                mem = f"{cs.memory.total / base.memory.total:.2f}" if cs and base else "n/a"
                write(f"{setting:20} {L // 1024:>6}K {'any' if group is None else f'P={group}':6} {name(cs):36} "
                      f"{name(base):36} {ratio:>6} {mem:>5}  {published if group is None else ''}")
        write("\n(tok/s = CSBP / baseline throughput; mem = CSBP peak / baseline peak per device; baselines are cp and "
              "bp with either transport or schedule, with or without activation checkpointing; groups: any group size, "
              "or one group over the whole cluster)")
        # Settings a family prices itself (the drafters' training on 8 H100).
        efficiency = {k: getattr(args, f"{k}_efficiency") for k in DEFAULT_EFFICIENCY
                      if getattr(args, f"{k}_efficiency") is not None}
        for entry in REGISTRY:
            family = family_named(entry.name)
            section = family.role("planning").paper_projection(efficiency) if family.has_role("planning") else None
            bar.update(1)
            if section:
                write("\n" + section + "\n")
    return 0


def run_plan(args) -> int:
    if args.validate:
        raise ValueError("--validate predicts benchmark records measured on this machine: run it as hf-bdlm plan "
                         "--validate (hf_bdlm.benchmarks.calibrate.run_validate).")
    if args.paper:
        return run_paper(args)
    if args.model is None or args.context is None:
        raise ValueError("hf-bdlm plan needs --model and --context (or --paper, or --validate RECORDS_JSON).")
    if args.context <= 0:
        raise ValueError(f"--context must be a positive number of tokens, got {args.context}.")
    # lazy: the cost model imports torch; hf-bdlm plan --help stays free of it (tests/package/test_cli_help.py)
    from .cost import plan_all
    from .workload import Cluster, recommend

    cluster = Cluster(args.gpus, args.gpus_per_node)
    device = _device(args)
    model = model_spec(args.model, args.block_size)
    preds = plan_all(model, args.context, device, cluster, _recipe(args),
                     ring_transport=not args.no_ring)
    best = recommend(preds)
    preds = sorted(preds, key=lambda p: (not p.fits, -p.tokens_per_s))  # what fits first, fastest first
    print(f"model {model.name}: {model.total_params() / 1e9:.2f}B parameters ({model.active_params() / 1e9:.2f}B "
          f"active), {len(model.layers)} layers, block {model.block_size}; context {args.context}; {args.gpus} x "
          f"{device.name} ({args.gpus_per_node} per node)")
    print(format_table(preds, best, device, args.top))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([_to_json(p) for p in preds], f, indent=1)
    return 0
