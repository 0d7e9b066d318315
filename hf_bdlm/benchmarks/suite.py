"""The ``hf-bdlm bench`` suite: parallel modes, attention, cost growth, longest context; JSON, PNG and tables.

Studies (``--only`` picks some; all by default), each measured in fresh processes, one thread per rank:

- ``modes``: :mod:`.parallel_modes` for cp and csbp with both transports (allgather, ring), bp with both
  noisy-block schedules (dual_end, contiguous) and the single process, at every (P, L). Records, unchanged, in
  ``parallel_modes.json`` (a JSON list); plots ``modes_*.png``.
- ``attention``: :mod:`.attention` (backends, AR vs BDLM step) into ``attention.json``, ``attention.png``.
- ``growth``: per-rank step time against L for the single process, cp (allgather), bp (dual_end), csbp (allgather)
  at each P, with the least-squares exponent of log time on log L. Lengths the modes study measured with the same
  model are reused; the others run. ``growth.json``, ``growth.png``.
- ``max-context``: the longest L under ``--mem-cap`` per rank for P = 1 and csbp / cp / bp at each P, by real steps
  (:mod:`.max_context`). ``max_context.json``, ``max_context.png``.
- ``baselines``: csbp against this project's balanced cp, the paper's CP baseline (``cp-paper``) and bp, for a dense
  model and one in Gemma 3's 5:1 sliding-window pattern, with exposed waits and per-rank attention work
  (:mod:`.baselines`). ``baselines.json`` (``baselines_<link>.json`` with ``--link``; several links, ``none``
  among them, run the study once per link in one command).

Studies with a module of their own (:data:`STUDY_MODULES`) are declared and run through three functions of that
module: ``add_arguments(group)`` (its options, in their own group of ``hf-bdlm bench``), ``run(cfg, args, path)`` (the
records, written to ``<study>.json`` as they come) and ``report(records)`` (its markdown section), and optionally
``check_arguments(cfg, args)`` (a ``ValueError`` naming the option on a bad combination, raised before any study runs)
and ``plot(records, path)``. They follow the core studies:

- ``decoding``: :mod:`.decoding_study`, every family's decoding variants against greedy AR at batch 1 and 8 (tokens per
  forward, tokens/s, CPU time per token, exact match, agreement, the forward cost by rows). ``decoding.json``,
  ``decoding.png``.
- ``planning``: :mod:`.planning_study`, the host's plan of a fresh layout (block masks for one device and csbp at
  P = 8, the CPU path's planner beside) against L: time of a first and a warm build, RSS, the masks' index arrays, and that a
  cached step plans nothing. ``planning.json``, ``planning.png``.
- the families' own studies (the ``STUDIES`` tables of their ``commands.py``, :func:`hf_bdlm.models.family_studies`:
  a study name -> its module), in the registry's order.

``summary.json`` holds the machine and, per study, the command, wall time and load average (1-minute, at its start and
end; a study run again into the same folder replaces its entry), and the plots; ``summary.md`` the
markdown tables (``--markdown`` prints them). ``--report-only`` re-draws everything from the JSON in ``--out``.
The command's arguments are declared in :mod:`.bench_command`.

    hf-bdlm bench --quick --out /tmp/bench
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from ..protocols.registry import family_studies
from . import max_context, parallel_modes, report
from .processes import child_env, module_command
from .spread import MIN_TIMED_STEPS, check_timed_steps

CORE_STUDIES = ("modes", "attention", "growth", "max-context", "baselines")
# Studies run through a module of their own (the interface of the family studies below): this package's decoding
# study (every family's decoding, each family reached through the registry) and host planning study, then the
# families' own.
STUDY_MODULES = {"decoding": "hf_bdlm.benchmarks.decoding_study", "planning": "hf_bdlm.benchmarks.planning_study",
                 **{name: study.module for name, study in family_studies().items()}}
STUDIES = CORE_STUDIES + tuple(STUDY_MODULES)


def family_study(name: str):
    """The module of the study ``name`` that runs through a module of its own (imported on first use)."""
    return importlib.import_module(STUDY_MODULES[name])


def family_study_path(out: pathlib.Path, name: str) -> pathlib.Path:
    """Where the family study ``name`` keeps its records: ``<out>/<name>.json``."""
    return out / f"{name}.json"


# The presets fill every option left unset. Quick: < 5 min on 2 idle cores (the launches' imports dominate).
FULL = dict(lengths=(2048, 4096, 8192, 16384), nprocs=(2, 4), modes=("cp", "bp", "csbp"),
            transports=("allgather", "ring"), layers=2, steps=MIN_TIMED_STEPS, min_time=5.0, calibrate=True,
            growth_lengths=(2048, 4096, 8192, 16384, 32768), growth_nprocs=(2, 4), mem_cap=256 * 2**20,
            max_context_nprocs=(2, 4), max_context_modes=("csbp", "cp", "bp"), max_context_layers=1,
            max_context_limit=65536, baseline_lengths=(8192, 16384, 32768), baseline_nprocs=(2, 4),
            baseline_models=("dense", "sliding"),
            attention=["--lengths", "1024", "2048", "4096", "8192", "16384", "--step-lengths", "1024", "2048", "4096",
                       "8192"])
QUICK = dict(lengths=(1024, 2048), nprocs=(2,), modes=("cp", "bp", "csbp"), transports=("allgather", "ring"),
             layers=1, steps=MIN_TIMED_STEPS, min_time=0.0, calibrate=False,
             growth_lengths=(1024, 2048), growth_nprocs=(2,), mem_cap=128 * 2**20,
             max_context_nprocs=(2,), max_context_modes=("csbp",), max_context_layers=1, max_context_limit=8192,
             baseline_lengths=(2048,), baseline_nprocs=(2,), baseline_models=("dense", "sliding"),
             attention=["--quick", "--lengths", "1024", "2048", "--step-lengths", "1024", "--backends", "blockwise",
                        "dense", "--repeats", str(MIN_TIMED_STEPS)])


@dataclass
class BenchConfig:
    """One bench run: the options, after the preset filled those left unset and every value was checked."""

    out: pathlib.Path
    studies: tuple[str, ...]
    quick: bool
    lengths: tuple[int, ...]
    nprocs: tuple[int, ...]
    modes: tuple[str, ...]
    transports: tuple[str, ...]
    layers: int
    steps: int
    min_time: float
    calibrate: bool
    timeout: float
    growth_lengths: tuple[int, ...]
    growth_nprocs: tuple[int, ...]
    mem_cap: int
    max_context_nprocs: tuple[int, ...]
    max_context_modes: tuple[str, ...]
    max_context_layers: int
    max_context_limit: int
    attention: tuple[str, ...]
    baseline_lengths: tuple[int, ...] = ()
    baseline_nprocs: tuple[int, ...] = ()
    baseline_models: tuple[str, ...] = ()
    baseline_layouts: tuple[str, ...] = ("csbp", "cp", "cp-paper", "bp")
    # Named cluster links (hf_bdlm.planner.link; None: no link) the baselines study runs through, one pass each;
    # the modes study takes one.
    links: tuple[str | None, ...] = (None,)

    @property
    def link(self) -> str | None:
        """The one link of the modes study."""
        return self.links[0]


def _check_lengths(option: str, lengths, nprocs) -> None:
    multiple = max_context.grid(nprocs)
    bad = [L for L in lengths if L % multiple]
    if bad:
        raise ValueError(
            f"{option} {' '.join(map(str, bad))}: every length must be a multiple of {multiple} (2 * max P * block "
            f"size {parallel_modes.BLOCK}), which every layout at P = {max(nprocs, default=1)} accepts; "
            f"e.g. {' '.join(str(max(multiple, round(L / multiple) * multiple)) for L in bad)}")


def _check_nprocs(option: str, nprocs) -> None:
    bad = [P for P in nprocs if P < 2]
    if bad:
        raise ValueError(f"{option} {' '.join(map(str, bad))}: group sizes are at least 2 (the single process, "
                         f"P = 1, always runs as the baseline)")


def resolve(args: argparse.Namespace) -> BenchConfig:
    """The run's configuration from the parsed arguments (``ValueError`` naming the option on a bad value)."""
    preset = QUICK if args.quick else FULL

    def pick(name):
        value = getattr(args, name)
        value = preset[name] if value is None else value
        return tuple(value) if isinstance(value, (list, tuple)) else value

    cfg = BenchConfig(
        out=pathlib.Path(args.out), studies=tuple(args.only or STUDIES), quick=args.quick,
        lengths=pick("lengths"), nprocs=pick("nprocs"), modes=pick("modes"), transports=pick("transports"),
        layers=pick("layers"),
        steps=pick("steps"), min_time=pick("min_time"), calibrate=preset["calibrate"] and not args.no_calibrate,
        timeout=args.timeout, growth_lengths=pick("growth_lengths"),
        growth_nprocs=pick("growth_nprocs"), mem_cap=pick("mem_cap"), max_context_nprocs=pick("max_context_nprocs"),
        max_context_modes=pick("max_context_modes"),
        max_context_layers=pick("max_context_layers"), max_context_limit=pick("max_context_limit"),
        attention=tuple(preset["attention"]), baseline_lengths=pick("baseline_lengths"),
        baseline_nprocs=pick("baseline_nprocs"), baseline_models=pick("baseline_models"),
        baseline_layouts=tuple(getattr(args, "baseline_layouts", None) or ("csbp", "cp", "cp-paper", "bp")),
        links=tuple(None if name == "none" else name for name in (getattr(args, "link", None) or ["none"])))
    from hf_bdlm.planner.link import LINKS  # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)

    bad = [name for name in cfg.links if name is not None and name not in LINKS]
    if bad:
        raise ValueError(f"--link {' '.join(bad)}: unknown link; the named links are {', '.join(LINKS)} (none: no "
                         f"link)")
    if len(set(cfg.links)) != len(cfg.links):
        raise ValueError(f"--link {' '.join(getattr(args, 'link', None) or [])}: a link is named twice")
    if len(cfg.links) > 1 and {"modes", "growth"} & set(cfg.studies):
        raise ValueError(f"--link {' '.join(getattr(args, 'link', None) or [])}: several links run the baselines "
                         f"study once per link; the modes and growth studies take one link (add --only baselines, or "
                         f"give one link)")
    check_timed_steps(cfg.steps)
    if cfg.min_time < 0:
        raise ValueError(f"--min-time {cfg.min_time}: must be 0 (a fixed --steps) or a positive number of seconds")
    if args.timeout <= 0:
        raise ValueError(f"--timeout {args.timeout}: must be a positive number of seconds")
    _check_nprocs("--nprocs", cfg.nprocs)
    _check_nprocs("--growth-nprocs", cfg.growth_nprocs)
    _check_nprocs("--max-context-nprocs", cfg.max_context_nprocs)
    _check_lengths("--lengths", cfg.lengths, cfg.nprocs)
    _check_lengths("--growth-lengths", cfg.growth_lengths, cfg.growth_nprocs)
    _check_nprocs("--baseline-nprocs", cfg.baseline_nprocs)
    _check_lengths("--baseline-lengths", cfg.baseline_lengths, cfg.baseline_nprocs)
    grid = max_context.grid(cfg.max_context_nprocs)
    if cfg.max_context_limit < grid:
        raise ValueError(f"--max-context-limit {cfg.max_context_limit}: must be at least the search grid {grid} "
                         f"(2 * max P * block size)")
    if "growth" in cfg.studies and len(set(cfg.growth_lengths)) < 2:
        raise ValueError(f"--growth-lengths {' '.join(map(str, cfg.growth_lengths))}: the exponent fit needs at "
                         f"least two distinct lengths")
    for name in STUDY_MODULES:
        check = getattr(family_study(name), "check_arguments", None)
        if name in cfg.studies and check is not None:
            check(cfg, args)
    return cfg


# ----------------------------------------------------------------------------------------------
# studies
# ----------------------------------------------------------------------------------------------
def _progress(text: str) -> None:
    print(text, flush=True)


def _line(rec: dict) -> str:
    name = f"{report.variant(rec):15} P={rec['P']} L={rec['L']:>6}"
    if "error" in rec:
        return f"{name}: ERROR {(rec['error'].strip().splitlines() or ['?'])[-1][:100]}"
    return (f"{name}: step {rec['step_s']:7.3f} s  {rec['tokens_per_s']:8.0f} tok/s  peak "
            f"{rec['peak_mem_bytes'] / 2**20:7.1f} MiB/rank  {rec['bytes_per_step'] / 2**20:6.1f} MiB/step  "
            f"wait {rec['comm_wait_s']:.3f} s  (run {rec.get('wall_s', 0):.0f} s)")


def _run_configs(configs, cfg: BenchConfig, layers: int, label: str, sink: list, path: pathlib.Path | None,
                 link=None) -> None:
    args = parallel_modes.launch_args(layers, cfg.steps, cfg.timeout, min_time=cfg.min_time, link=link)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for i, (mode, P, L, transport, schedule) in enumerate(configs, 1):
            rec = parallel_modes.launch(mode, P, L, args, pathlib.Path(tmp), transport, schedule)
            rec.setdefault("layers", layers)
            sink.append(rec)
            _progress(f"  [{label} {i}/{len(configs)}, {time.perf_counter() - started:5.0f} s] {_line(rec)}")
            if path is not None:  # written as it goes: an interrupted run keeps its measurements
                path.write_text(json.dumps(sink, indent=1))


def _emulated_link(link: str | None) -> str | None:
    """The named link the launches run through: each launch's ranks measure, at its start and all at once, the
    compute rate that stretches it (the records carry it)."""
    if link is not None:
        _progress(f"  emulated link {link}: K/V charged at the cluster's bf16 element size; bandwidth and latency "
                  "stretched by the matmul rate each launch's ranks measure at its start, all at once "
                  "(docs/benchmarks.md; every record's 'link' holds them)")
    return link


def measure_planner_figures(out: pathlib.Path, layers: int, process_counts) -> None:
    """The planner's CPU figures for ``process_counts`` ranks, measured now into ``out``/cpu_rates.json: in the
    machine state the records beside them are made in (``hf-bdlm plan --validate`` reads them from there; figures
    measured hours later, on a host whose pace drifts, miss by as much as the drift)."""
    # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)
    from hf_bdlm.benchmarks.calibrate import RATES_FILE, benchmark_model, cpu_devices

    t0 = time.perf_counter()
    devices = cpu_devices(benchmark_model(layers), set(process_counts), out / RATES_FILE, remeasure=True,
                          benchmark_layers=layers)
    _progress(f"  planner CPU figures for {', '.join(map(str, devices))} process(es) -> {out / RATES_FILE} "
              f"({time.perf_counter() - t0:.0f} s)")


def run_baselines(cfg: BenchConfig) -> list[dict]:
    from . import baselines  # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)

    if cfg.calibrate:  # figures for the first model's layers: what hf-bdlm plan --validate reads them for
        measure_planner_figures(cfg.out, baselines.MODELS[cfg.baseline_models[0]]["layers"], cfg.baseline_nprocs)
    records = []
    for link in cfg.links:
        records += baselines.run_study(cfg.baseline_models, cfg.baseline_nprocs, cfg.baseline_lengths, cfg.steps,
                                       cfg.timeout, _emulated_link(link), cfg.out / baselines.out_name(link),
                                       log=_progress, layouts=cfg.baseline_layouts)
    return records


def run_modes(cfg: BenchConfig) -> list[dict]:
    configs = [(m, P, L, t, s) for L in cfg.lengths
               for (m, P, t, s) in parallel_modes.configurations(cfg.modes, cfg.nprocs, cfg.transports)]
    _progress(f"modes: {len(configs)} runs (L {', '.join(map(str, cfg.lengths))}; P {', '.join(map(str, cfg.nprocs))}; "
              f"{cfg.layers} layer(s), {cfg.steps} timed step(s) after a warm-up"
              + (f", more to fill {cfg.min_time:g} s; steps under {cfg.min_time / 2:g} s launched "
                 f"{parallel_modes.SHORT_LAUNCHES} times, the median kept" if cfg.min_time else "") + ")")
    if cfg.calibrate:
        measure_planner_figures(cfg.out, cfg.layers, {1, *cfg.nprocs})
    link = _emulated_link(cfg.link)
    records: list[dict] = []
    _run_configs(configs, cfg, cfg.layers, "modes", records, cfg.out / "parallel_modes.json", link)
    return records


def _growth_key(mode, P, L, transport, schedule, layers):
    return (mode, P, L, None if mode == "single" else transport, None if mode == "single" else schedule, layers)


def run_growth(cfg: BenchConfig, modes_records: list[dict]) -> dict:
    configs = []
    for L in cfg.growth_lengths:
        configs.append(("single", 1, L, "allgather", "dual_end"))
        for P in cfg.growth_nprocs:
            configs += [("cp", P, L, "allgather", "dual_end"), ("bp", P, L, "allgather", "dual_end"),
                        ("csbp", P, L, "allgather", "dual_end")]
    have = {_growth_key(r["mode"], r["P"], r["L"], r.get("transport"), r.get("schedule"), r["layers"]): r
            for r in modes_records if "error" not in r}
    reused = [have[k] for c in configs if (k := _growth_key(*c, cfg.layers)) in have]
    missing = [c for c in configs if _growth_key(*c, cfg.layers) not in have]
    _progress(f"growth: {len(configs)} points (L {', '.join(map(str, cfg.growth_lengths))}), {len(reused)} from the "
              f"modes study, {len(missing)} to run")
    ran: list[dict] = []
    _run_configs(missing, cfg, cfg.layers, "growth", ran, None)
    records = reused + ran
    failed = [r for r in records if "error" in r]
    return dict(layers=cfg.layers, steps=cfg.steps, records=records, fits=report.growth_fits(records),
                failed=len(failed), time="step_s: wall time of a step, slowest rank, median of the timed steps")


def run_attention(cfg: BenchConfig) -> list[dict]:
    path = (cfg.out / "attention.json").resolve()  # the script runs in a temporary folder
    cmd = [*module_command("attention"), *cfg.attention, "--out", str(path)]
    _progress(f"attention: {' '.join(cmd[2:])}")
    with tempfile.TemporaryDirectory() as cwd, subprocess.Popen(
            cmd, cwd=cwd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            _progress("  " + line.rstrip())
    if proc.returncode:
        raise RuntimeError(f"{cmd[2]} exited with {proc.returncode} (its output is above)")
    return json.loads(path.read_text())


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------
def _read(path: pathlib.Path):
    return json.loads(path.read_text()) if path.exists() else None


def write_report(out: pathlib.Path, markdown: bool = False) -> list[pathlib.Path]:
    """Plots, plain tables (printed) and ``summary.md`` from whatever study JSON is in ``out``."""
    modes, attention = _read(out / "parallel_modes.json"), _read(out / "attention.json")
    growth, mc = _read(out / "growth.json"), _read(out / "max_context.json")
    base = [r for path in sorted(out.glob("baselines*.json")) for r in _read(path)]
    families = {name: records for name in STUDY_MODULES
                if (records := _read(family_study_path(out, name))) is not None}
    if not any(x is not None for x in (modes, attention, growth, mc)) and not base and not families:
        raise FileNotFoundError(f"{out} holds none of parallel_modes.json, attention.json, growth.json, "
                                f"max_context.json, baselines*.json"
                                + "".join(f", {family_study_path(out, n).name}" for n in STUDY_MODULES)
                                + f": run hf-bdlm bench --out {out} first")
    summary = _read(out / "summary.json") or {}
    plots, sections = [], []
    machine = summary.get("machine")
    if machine:
        runs = "; ".join(f"{name}: `{s['command']}`, {s['wall_s']:.0f} s, load average {s['load_average_start']} -> "
                         f"{s['load_average_end']}" for name, s in summary.get("studies", {}).items())
        sections.append(f"Machine: {machine['cpus']} CPU cores, {machine['platform']}, torch {machine['torch']}, "
                        f"gloo, one thread per rank. Runs: {runs}.")
    if modes is not None:
        if report.ok_records(modes):
            plots += report.plot_modes(modes, out)
        sections.append(("Parallel modes (step = forward + backward of one sequence, median [range] of the timed "
                         "steps; peak memory per rank above model and batch; MiB received per step per rank)",
                         report.modes_table(modes, True), report.modes_table(modes)))
        sections.append(("CSBP's speed-up over each mode (ratio of median step times; a tie where the ranges "
                         "overlap)", report.modes_comparison_table(modes, True), report.modes_comparison_table(modes)))
        if any(r.get("link") for r in modes):
            sections.append(("Emulated links of the modes records", report.link_table(modes, True),
                             report.link_table(modes)))
    if growth is not None:
        if growth["fits"]:
            plots.append(report.plot_growth(growth["records"], growth["fits"], out))
        sections.append((f"Cost growth: step time (s) per L and the fitted exponent ({growth['layers']} layer(s))",
                         report.growth_table(growth["fits"], True), report.growth_table(growth["fits"])))
    if mc is not None:
        if any(not r.get("error") for r in mc["results"]):
            plots.append(report.plot_max_context(mc["results"], mc["cap_bytes"], out))
        sections.append((f"Longest trainable context under {mc['cap_bytes'] / 2**20:.0f} MiB per rank "
                         f"({mc['layers']} layer(s); grid {mc['grid']} tokens; {mc['memory']})",
                         report.max_context_table(mc["results"], True), report.max_context_table(mc["results"])))
    if base:
        from . import baselines  # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)

        sections.append(("CSBP against both CP baselines and BP (step seconds, median [range] of the timed steps; "
                         "CSBP's speed-up, the ratio of medians, a tie where the ranges overlap; exposed waits; "
                         "slowest rank's attention pairs over the mean)", baselines.table(base, True),
                         baselines.table(base)))
        if any(r.get("link") for r in base):
            sections.append(("Emulated links of the baselines records (the compute rate each launch measured, the "
                             "link it gave)", report.link_table(base, True), report.link_table(base)))
    for name, records in families.items():
        drawn = getattr(family_study(name), "plot", None)
        if drawn is not None and (path := drawn(records, family_study_path(out, name).with_suffix(".png"))):
            plots.append(path)
        sections.append(family_study(name).report(records))
    if attention is not None:
        if any("time_s" in r for r in attention):
            plots.append(report.plot_attention(attention, out))
        sections.append(("Attention backends and training step (hf_bdlm.benchmarks.attention)",
                         report.attention_table(attention, True), report.attention_table(attention)))
    md = []
    for s in sections:
        if isinstance(s, str):
            md.append(s)
            print(s)
        else:
            title, table_md, table = s
            md.append(f"**{title}**\n\n{table_md}")
            print(f"\n{title}\n{table}")
    (out / "summary.md").write_text("\n\n".join(md) + "\n")
    if markdown:
        print("\n--- summary.md ---\n" + "\n\n".join(md))
    print(f"\nplots: {', '.join(p.name for p in plots)}; tables: {out / 'summary.md'}")
    return plots


def _machine() -> dict:
    import torch  # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)

    return dict(cpus=os.cpu_count(), platform=platform.platform(), python=platform.python_version(),
                torch=torch.__version__, processor=platform.processor() or platform.machine())


def _run_study(study: str, cfg: BenchConfig, out: pathlib.Path, modes_records: list[dict],
               args: argparse.Namespace) -> int:
    """Run one study, write its JSON; returns how many of its measurements failed. ``modes_records`` is extended
    with the modes study's records (the growth study reuses them); ``args`` carry the family studies' options."""
    if study in STUDY_MODULES:
        records = family_study(study).run(cfg, args, family_study_path(out, study))
        return sum("error" in r for r in records)
    if study == "modes":
        modes_records[:] = run_modes(cfg)
        return sum("error" in r for r in modes_records)
    if study == "baselines":
        return sum("error" in r for r in run_baselines(cfg))
    if study == "attention":
        # "skipped (needs / predicted ...)" is the script's own size limit; failures and timeouts count.
        return sum(r.get("skipped", "").startswith(("failed", "timed out")) for r in run_attention(cfg))
    if study == "growth":
        growth = run_growth(cfg, modes_records)
        (out / "growth.json").write_text(json.dumps(growth, indent=1))
        return growth["failed"]
    mc = max_context.run_study(cfg.max_context_nprocs, cfg.max_context_modes, cfg.mem_cap, cfg.max_context_layers,
                               cfg.max_context_limit, cfg.timeout, log=_progress)
    (out / "max_context.json").write_text(json.dumps(mc, indent=1))
    return sum(bool(r.get("error")) for r in mc["results"])


def run(args: argparse.Namespace) -> int:
    out = pathlib.Path(args.out)
    if args.report_only:
        write_report(out, args.markdown)
        return 0
    cfg = resolve(args)
    report.pyplot()  # fail now, not after an hour of measurements, when matplotlib is missing
    out.mkdir(parents=True, exist_ok=True)
    started, load_start = time.perf_counter(), round(os.getloadavg()[0], 2)
    command = "hf-bdlm bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:])
    config = {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in asdict(cfg).items()}
    # One summary per folder: a study run again replaces its entry, the others keep theirs (and their command).
    summary = _read(out / "summary.json") or {}
    summary.update(machine=_machine(), studies=summary.get("studies", {}))
    _progress(f"hf-bdlm bench -> {out}  ({'quick' if cfg.quick else 'full'}; studies {', '.join(cfg.studies)}; "
              f"{summary['machine']['cpus']} CPUs, load average {load_start})")
    # Growth reuses the modes records: this run's, or those already in --out when the modes study is not run.
    modes_records: list[dict] = [] if "modes" in cfg.studies else (_read(out / "parallel_modes.json") or [])
    for study in STUDIES:
        if study not in cfg.studies:
            continue
        t0, load_study, error = time.perf_counter(), os.getloadavg()[0], None
        try:
            failed = _run_study(study, cfg, out, modes_records, args)
        except RuntimeError as err:  # a study that cannot finish (e.g. its script crashed): the others still run
            failed, error = 1, str(err)
            _progress(f"{study}: FAILED: {err}")
        wall = time.perf_counter() - t0
        summary["studies"][study] = dict(command=command, quick=cfg.quick, wall_s=round(wall, 1), failed=failed,
                                         load_average_start=round(load_study, 2),
                                         load_average_end=round(os.getloadavg()[0], 2), config=config)
        if error:
            summary["studies"][study]["error"] = error
        _progress(f"{study}: done in {wall:.0f} s" + (f", {failed} failed or skipped" if failed else ""))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    summary["plots"] = [p.name for p in write_report(out, args.markdown)]
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    _progress(f"total {time.perf_counter() - started:.0f} s; load average {load_start} at the start, "
              f"{os.getloadavg()[0]:.2f} at the end")
    failed = {name: summary["studies"][name]["failed"] for name in cfg.studies if summary["studies"][name]["failed"]}
    if failed:
        print(f"error: some measurements failed ({failed}); their records carry the error", file=sys.stderr)
        return 1
    return 0
