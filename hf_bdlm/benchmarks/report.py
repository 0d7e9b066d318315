"""Tables, markdown, power-law fits and plots of the bench records (``hf-bdlm bench``); pure functions of the JSON.

Records are those of :mod:`.parallel_modes` (one dict per (mode, transport, schedule, P, L)), the growth
and max-context studies of :mod:`.suite` and the attention records of :mod:`.attention`.
Plots are PNG files drawn with matplotlib (the ``bench`` extra).

    python -c "from hf_bdlm.benchmarks.report import fit_power_law as f; print(f([1024, 2048], [1, 4]))"  # (2.0, ...)
"""

from __future__ import annotations

import math
from pathlib import Path

from .attention import spread
from .parallel_modes import spread_of
from .spread import compare

MiB = 2**20
MODE_ORDER = {"single": 0, "cp": 1, "bp": 2, "csbp": 3}
# One colour per mode, a line style per transport / schedule: the panels stay readable with six variants.
COLORS = {"single": "black", "cp": "tab:blue", "bp": "tab:orange", "csbp": "tab:green"}
STYLES = {None: "-", "allgather": "-", "dual_end": "-", "ring": "--", "contiguous": "--"}


def variant(rec: dict) -> str:
    """``"csbp ring"``, ``"bp contiguous"``, ``"single"``: the mode and what distinguishes its runs."""
    if rec["mode"] == "single":
        return "single"
    if rec.get("cp_layout") == "paper":
        return "cp-paper"
    return f"{rec['mode']} {rec['schedule'] if rec['mode'] == 'bp' else rec['transport']}"


def _variant_style(rec: dict) -> dict:
    second = rec["schedule"] if rec["mode"] == "bp" else rec.get("transport")
    return dict(color=COLORS.get(rec["mode"], "gray"), linestyle=STYLES.get(second, ":"), marker="o", markersize=4)


def _sort_key(rec: dict):
    return (rec["P"], MODE_ORDER.get(rec["mode"], 9), variant(rec), rec["L"])


def ok_records(records: list[dict]) -> list[dict]:
    return sorted((r for r in records if "error" not in r), key=_sort_key)


def fit_power_law(lengths, values) -> tuple[float, float]:
    """Least squares of ``log(value)`` on ``log(L)``: returns ``(exponent, prefactor)`` with ``value ~ prefactor *
    L ** exponent``. Needs two distinct lengths and positive values."""
    points = [(float(x), float(y)) for x, y in zip(lengths, values, strict=True)]
    if len({x for x, _ in points}) < 2:
        raise ValueError(f"a power-law fit needs at least two distinct lengths, got {sorted(x for x, _ in points)}")
    bad = [(x, y) for x, y in points if x <= 0 or y <= 0 or not math.isfinite(y)]
    if bad:
        raise ValueError(f"a power-law fit needs positive finite lengths and values, got {bad}")
    xs, ys = [math.log(x) for x, _ in points], [math.log(y) for _, y in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, math.exp(my - slope * mx)


def growth_fits(records: list[dict]) -> list[dict]:
    """One power-law fit of step time against L per (variant, P), over the lengths that ran."""
    series: dict = {}
    for r in ok_records(records):
        series.setdefault((r["P"], variant(r)), []).append(r)
    fits = []
    for (P, name), recs in series.items():
        entry = dict(variant=name, mode=recs[0]["mode"], P=P, lengths=[r["L"] for r in recs],
                     step_s=[r["step_s"] for r in recs])
        if len({r["L"] for r in recs}) >= 2:
            entry["exponent"], entry["prefactor"] = fit_power_law(entry["lengths"], entry["step_s"])
        else:
            entry["exponent"] = entry["prefactor"] = None
        fits.append(entry)
    return sorted(fits, key=lambda f: (f["P"], MODE_ORDER.get(f["mode"], 9), f["variant"]))


# ----------------------------------------------------------------------------------------------
# tables: plain text for the terminal, markdown for the README
# ----------------------------------------------------------------------------------------------
def _mib(n) -> str:
    return "-" if n is None else f"{n / MiB:.1f}"


def rows_table(head: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(head)]

    def fmt(row):
        return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))

    return "\n".join([fmt(head), "-" * len(fmt(head)), *(fmt(row) for row in rows)])


def modes_table(records: list[dict], markdown: bool = False) -> str:
    """Step time (median [range] of the timed steps), tokens/s (at the median), peak memory per rank, bytes per step and
    exposed communication of every record."""
    head = ["variant", "P", "L", "step s", "tokens/s", "peak MiB/rank", "MiB/step/rank", "comm-wait s (fwd/bwd)"]
    rows = []
    for r in sorted(records, key=_sort_key):
        if "error" in r:
            last = (r["error"].strip().splitlines() or ["?"])[-1][:60]
            rows.append([variant(r) if r.get("schedule") or r["mode"] == "single" else r["mode"], str(r["P"]),
                         str(r["L"]), "error", last, "", "", ""])
            continue
        wait = f"{r['comm_wait_s']:.3f} ({r.get('comm_wait_fwd_s', 0):.3f}/{r.get('comm_wait_bwd_s', 0):.3f})"
        rows.append([variant(r), str(r["P"]), str(r["L"]), spread_of(r).describe(".3f"), f"{r['tokens_per_s']:.0f}",
                     _mib(r["peak_mem_bytes"]), _mib(r["bytes_per_step"]), wait])
    return rows_table(head, rows, markdown)


def modes_comparison_table(records: list[dict], markdown: bool = False) -> str:
    """CSBP (all-gather) against each baseline at every (P, L): the ratio of median step times, or a tie where the
    ranges of timed steps overlap (:func:`.spread.compare`). Baselines: cp (all-gather), the paper's CP where it ran,
    bp with the faster of its schedules, and the single process (its time over P ranks' is the speed-up)."""
    best: dict = {}
    for r in ok_records(records):
        if r.get("transport") not in (None, "allgather"):
            continue
        key = (variant(r).split(" ")[0], r["P"], r["L"])
        if key not in best or r["step_s"] < best[key]["step_s"]:
            best[key] = r
    head = ["P", "L", "csbp s", "vs cp", "vs cp-paper", "vs bp (faster schedule)", "vs single"]
    rows = []
    for (name, P, L), cs in sorted(best.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        if name != "csbp":
            continue

        def vs(other):
            return "-" if other is None else compare(spread_of(other), spread_of(cs)).describe()

        rows.append([str(P), length_label(L), spread_of(cs).describe(".3f"), vs(best.get(("cp", P, L))),
                     vs(best.get(("cp-paper", P, L))), vs(best.get(("bp", P, L))), vs(best.get(("single", 1, L)))])
    return rows_table(head, rows, markdown)


def link_table(records: list[dict], markdown: bool = False) -> str:
    """Every emulated-link record's link: the compute rate its launch measured (and under how many processes per
    core), the emulated bandwidth and latency that rate gave, and the bytes received per step as moved here and as the
    link charged them (the cluster's element size), and the regime: the step's time on the cluster's GPU (the median
    step here over the link's scale), to hold beside the seconds a step of the paper's takes."""
    head = ["link", "layout", "P", "L", "rate GFLOP/s/rank", "procs/core", "scale", "emulated MB/s", "latency ms",
            "MiB/step here", "MiB/step charged", "GPU-equivalent step ms", "rate measured"]
    rows = []
    for r in sorted((r for r in records if r.get("link") and "error" not in r),
                    key=lambda r: (r["link"]["name"], r.get("model", ""), r["P"], r["L"], variant(r))):
        link, rate = r["link"], r["link"].get("compute_rate") or {}
        rows.append([link["name"] + (f" ({r['model']})" if r.get("model") else ""), variant(r), str(r["P"]),
                     length_label(r["L"]),
                     f"{rate['flops_per_s'] / 1e9:.1f}" if "flops_per_s" in rate else "-",
                     f"{rate['processes_per_core']:g}" if "processes_per_core" in rate else "-",
                     f"{link['scale']:.0f}" if "scale" in link else "-", f"{link['bytes_per_s'] / 1e6:.2f}",
                     f"{link['latency_s'] * 1e3:.1f}", _mib(r.get("bytes_per_step")),
                     _mib(r.get("wire_bytes_per_step", r.get("bytes_per_step"))),
                     f"{r['step_s'] / link['scale'] * 1e3:.2f}" if link.get("scale") and "step_s" in r else "-",
                     link.get("measured", "per launch")])
    return rows_table(head, rows, markdown)


def growth_table(fits: list[dict], markdown: bool = False) -> str:
    """Step time per L (columns) of every variant, and its fitted exponent."""
    lengths = sorted({L for f in fits for L in f["lengths"]})
    head = ["variant", "P", *(length_label(L) for L in lengths), "exponent"]
    rows = []
    for f in fits:
        by_len = dict(zip(f["lengths"], f["step_s"]))
        cells = [f"{by_len[L]:.3g}" if L in by_len else "-" for L in lengths]
        exponent = "-" if f["exponent"] is None else f"{f['exponent']:.2f}"
        rows.append([f["variant"], str(f["P"]), *cells, exponent])
    return rows_table(head, rows, markdown)


def max_context_table(results: list[dict], markdown: bool = False) -> str:
    """Longest L under the cap per (variant, P), its peak memory, and its ratio to the single process."""
    single = next((r["longest"] for r in results if r["mode"] == "single" and r.get("longest")), None)
    head = ["variant", "P", "longest L", "peak MiB/rank at it", "first L over cap", "x single", "probes"]
    rows = []
    for r in results:
        if r.get("error"):
            rows.append([r["variant"], str(r["P"]), "error", r["error"].splitlines()[-1][:60], "", "", ""])
            continue
        ratio = f"{r['longest'] / single:.2f}" if single else "-"
        over = str(r["first_over"]) if r["first_over"] else f"> {r['longest']} (limit)"
        rows.append([r["variant"], str(r["P"]), str(r["longest"]), _mib(r["peak_at_longest"]), over, ratio,
                     str(len(r["probes"]))])
    return rows_table(head, rows, markdown)


def attention_table(records: list[dict], markdown: bool = False) -> str:
    """Time (median [range] of the timed runs) and peak memory of each attention backend / training step
    (:mod:`.attention` records)."""
    head = ["measurement", "L", "time s", "peak MiB"]
    rows = []
    for r in records:
        if "skipped" in r:
            rows.append([r["name"], str(r["length"]), r["skipped"], ""])
        else:
            rows.append([r["name"], str(r["length"]), spread(r).describe(".3f"), f"{r['peak_mb']:.0f}"])
    return rows_table(head, rows, markdown)


# ----------------------------------------------------------------------------------------------
# plots
# ----------------------------------------------------------------------------------------------
def pyplot():
    """matplotlib's pyplot on the file-only Agg backend; a clear error naming the extra when it is missing."""
    try:
        import matplotlib  # lazy: optional dependency (matplotlib; the error names the bench extra)
    except ImportError:
        raise ImportError("hf-bdlm bench draws its plots with matplotlib, which is not installed: "
                          "pip install \"hf-bdlm[bench]\"") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: after matplotlib.use picks the backend pyplot starts with

    return plt


def length_label(x: float, _pos=None) -> str:
    return f"{x / 1024:g}K" if x >= 1024 else f"{x:g}"


def _log2_x(ax, lengths) -> None:
    from matplotlib.ticker import FuncFormatter, NullFormatter  # lazy: optional dependency (matplotlib)

    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(set(lengths)))
    ax.xaxis.set_major_formatter(FuncFormatter(length_label))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("context length L (tokens)")
    ax.grid(True, which="both", alpha=0.3)


def _panels_per_p(records: list[dict], key, ylabel: str, title: str, path: Path, logy: bool = False) -> Path:
    plt = pyplot()
    recs = ok_records(records)
    ps = sorted({r["P"] for r in recs if r["P"] > 1}) or [1]
    fig, axes = plt.subplots(1, len(ps), figsize=(max(7.0, 5.5 * len(ps)), 4.4), squeeze=False, sharey=True)
    for ax, P in zip(axes[0], ps):
        series: dict = {}
        for r in recs:
            if r["P"] in (P, 1):
                series.setdefault(variant(r), []).append(r)
        for name, rs in sorted(series.items(), key=lambda kv: (MODE_ORDER.get(kv[1][0]["mode"], 9), kv[0])):
            style = _variant_style(rs[0])
            if name == "single":
                style.update(linestyle=":", label="single process (P=1)")
            ax.plot([r["L"] for r in rs], [key(r) for r in rs], label=style.pop("label", name), **style)
        _log2_x(ax, [r["L"] for r in recs])
        if logy:
            ax.set_yscale("log")
        ax.set_title(f"P = {P}")
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel(ylabel)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_modes(records: list[dict], out_dir: Path) -> list[Path]:
    """Four PNGs of the parallel-mode records: tokens/s, peak memory per rank, bytes per step, exposed comm time."""
    out_dir = Path(out_dir)
    if not ok_records(records):
        raise ValueError("no successful parallel-mode record to plot (every configuration failed or none ran)")
    return [
        _panels_per_p(records, lambda r: r["tokens_per_s"], "tokens / s (slowest rank)",
                      "Training throughput (forward + backward)", out_dir / "modes_tokens_per_s.png"),
        _panels_per_p(records, lambda r: r["peak_mem_bytes"] / MiB, "peak memory per rank (MiB, above model+batch)",
                      "Peak memory per rank", out_dir / "modes_peak_memory.png"),
        _panels_per_p([r for r in records if r["mode"] != "single"], lambda r: r["bytes_per_step"] / MiB,
                      "MiB received per step per rank (max over ranks)", "Attention communication volume",
                      out_dir / "modes_bytes_per_step.png"),
        _panels_per_p([r for r in records if r["mode"] != "single"], lambda r: r["comm_wait_s"],
                      "seconds blocked in collective waits per step", "Exposed communication (comm-wait)",
                      out_dir / "modes_comm_wait.png"),
    ]


def plot_growth(records: list[dict], fits: list[dict], out_dir: Path) -> Path:
    """Log-log step time vs L, one panel per P (the single process on each), fitted exponents in the legend."""
    plt = pyplot()
    ps = sorted({f["P"] for f in fits if f["P"] > 1}) or [1]
    fig, axes = plt.subplots(1, len(ps), figsize=(max(7.0, 5.5 * len(ps)), 4.4), squeeze=False, sharey=True)
    first = {variant(r) + f"@{r['P']}": r for r in ok_records(records)}
    for ax, P in zip(axes[0], ps):
        for f in fits:
            if f["P"] not in (P, 1):
                continue
            style = _variant_style(first[f"{f['variant']}@{f['P']}"])
            name = "single process (P=1)" if f["mode"] == "single" else f["variant"]
            label = name if f["exponent"] is None else f"{name}: L^{f['exponent']:.2f}"
            ax.plot(f["lengths"], f["step_s"], label=label, **style)
        _log2_x(ax, [L for f in fits for L in f["lengths"]])
        ax.set_yscale("log")
        ax.set_title(f"P = {P}")
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("step time per rank (s)")
    fig.suptitle("Cost growth: step time vs L (legend: least-squares exponent)")
    fig.tight_layout()
    path = Path(out_dir) / "growth.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_max_context(results: list[dict], cap_bytes: int, out_dir: Path) -> Path:
    """Bars: the longest trainable L per (variant, P) under the cap, with P x the single process's as a marker."""
    plt = pyplot()
    ok = [r for r in results if not r.get("error")]
    single = next((r["longest"] for r in ok if r["mode"] == "single"), None)
    fig, ax = plt.subplots(figsize=(max(6.5, 1.1 * len(ok) + 2.5), 4.4))
    labels = [f"{r['variant']}\nP={r['P']}" for r in ok]
    ax.bar(labels, [r["longest"] for r in ok], color=[COLORS.get(r["mode"], "gray") for r in ok])
    if single:
        ax.scatter(labels, [single * r["P"] for r in ok], marker="_", s=600, color="red", zorder=3,
                   label="P x single process")
        ax.legend(fontsize=8)
    ax.set_ylabel("longest trainable L (tokens)")
    ax.set_title(f"Longest trainable L under {cap_bytes / MiB:.0f} MiB per rank\n(step's peak above model + batch)",
                 fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    path = Path(out_dir) / "max_context.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_attention(records: list[dict], out_dir: Path) -> Path:
    """Attention backends and AR vs BDLM training step (a panel each, when measured): time vs L."""
    plt = pyplot()
    panels = [(bench, title) for bench, title in (("attention", "Attention forward + backward (flex: forward only)"),
                                                  ("step", "Training step, Llama 2 x 512"))
              if any(r.get("bench") == bench and "time_s" in r for r in records)]
    if not panels:
        raise ValueError("no attention measurement to plot (every one was skipped or failed)")
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, (bench, title) in zip(axes[0], panels):
        for name in sorted({r["name"] for r in records if r.get("bench") == bench}):
            rs = sorted((r for r in records if r["name"] == name and "time_s" in r), key=lambda r: r["length"])
            if rs:
                ax.plot([r["length"] for r in rs], [r["time_s"] for r in rs], marker="o", markersize=4, label=name)
        _log2_x(ax, [r["length"] for r in records if r.get("bench") == bench])
        ax.set_yscale("log")
        ax.set_ylabel("seconds")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(out_dir) / "attention.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
