"""`hf-bdlm bench`: the benchmark suite as one command that writes JSON, plots and tables.

    hf-bdlm bench --quick --out bench_quick                       # < 5 min on 2 idle CPU cores
    hf-bdlm bench --out benchmarks/results/bench                  # everything docs/benchmarks.md shows
    hf-bdlm bench --only max-context --mem-cap 256MiB --out mc    # one study
    hf-bdlm bench --report-only --out benchmarks/results/bench --markdown   # re-draw plots and tables from the JSON

The studies (:mod:`.suite`) run the package's own benchmarks (:mod:`.parallel_modes`, :mod:`.attention`) with fresh
processes per measurement, so the installed wheel runs them from any folder. This module declares the command's
arguments; torch loads only when a study runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys

from . import suite

MODES = ("cp", "bp", "csbp")
_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_size(text: str) -> int:
    """``"256MiB"`` -> bytes. Accepts plain bytes or a number with B, KiB, MiB, GiB, kB, MB, GB (any case)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; write bytes or a number with a unit KiB, MiB, GiB (or kB, MB, GB), e.g. 256MiB")
    value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the size must be positive, e.g. 256MiB")
    return value


def positive_int(text: str) -> int:
    """An argparse ``type``: a positive integer, else a usage error naming the text."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a positive integer")
    return value


def configure_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``hf-bdlm bench`` arguments. ``None`` defaults are filled from the quick or the full preset
    (:data:`.suite.QUICK`, :data:`.suite.FULL`), so an explicit value always wins."""
    p.add_argument("--out", default="bench_results",
                   help="folder for the JSON, PNG and markdown (default: %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help="small preset (< 5 min on 2 idle cores): modes at L=1K,2K and P=2, 1 layer, 3 steps; attention "
                        "at L<=2K; growth from those records; max-context under a 128 MiB cap for the single process "
                        "and csbp at P=2; each family study at its own quick preset")
    p.add_argument("--only", nargs="+", choices=suite.STUDIES, default=None, metavar="STUDY",
                   help=f"run these studies only (of {', '.join(suite.STUDIES)}; default: all)")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: re-draw the plots and tables from the JSON already in --out")
    p.add_argument("--markdown", action="store_true", help="also print the markdown tables (written to summary.md)")
    modes = p.add_argument_group("parallel modes (cp, bp, csbp; both transports and bp schedules)")
    modes.add_argument("--lengths", type=positive_int, nargs="+", default=None, metavar="L",
                       help="context lengths (multiples of 2 * max(P) * 64)")
    modes.add_argument("--nprocs", type=positive_int, nargs="+", default=None, metavar="P", help="group sizes")
    modes.add_argument("--modes", nargs="+", choices=MODES, default=None, help="modes (default: cp bp csbp)")
    modes.add_argument("--transports", nargs="+", choices=("allgather", "ring"), default=None,
                       help="K/V transports of cp and csbp (default: both)")
    modes.add_argument("--layers", type=positive_int, default=None, help="decoder layers of the benchmark model")
    modes.add_argument("--steps", type=positive_int, default=None,
                       help="timed steps after one warm-up, at least 3 (default: 3); every step is recorded and "
                            "tables give the median and the range")
    modes.add_argument("--min-time", type=float, default=None, metavar="SECONDS",
                       help="time more steps when they are short, enough to fill SECONDS (at most 10), and launch a "
                            "configuration whose step is under SECONDS / 2 three times, keeping the median launch "
                            "(full preset: 5, quick: 0)")
    modes.add_argument("--no-calibrate", action="store_true",
                       help="do not measure the planner's CPU figures (cpu_rates.json beside the records, which "
                            "hf-bdlm plan --validate reads; about 80 s; the full preset measures them before the "
                            "modes and baselines studies, --quick not)")
    modes.add_argument("--link", nargs="+", default=None, metavar="NAME",
                       help="run the modes and baselines studies through an emulated cluster link (h100-nvlink, "
                            "h100-ib, h200-nvlink, h200-ib; none: no link): K/V charged at the cluster's bf16 element "
                            "size, the link stretched by the compute rate each launch's ranks measure at its start, "
                            "all at once, so that a step's communication : compute ratio is the cluster's "
                            "(docs/benchmarks.md). Several (e.g. none h200-ib): the baselines study once per link")
    modes.add_argument("--timeout", type=float, default=1800.0, help="seconds per measurement (default: %(default)s)")
    growth = p.add_argument_group("cost growth (per-rank step time vs L, fitted exponent)")
    growth.add_argument("--growth-lengths", type=positive_int, nargs="+", default=None, metavar="L")
    growth.add_argument("--growth-nprocs", type=positive_int, nargs="+", default=None, metavar="P")
    base = p.add_argument_group("csbp against both CP baselines (this project's balanced cp, the paper's cp) and bp")
    base.add_argument("--baseline-lengths", type=positive_int, nargs="+", default=None, metavar="L",
                      help="lengths (default: 8192 16384 32768; --quick: 2048)")
    base.add_argument("--baseline-nprocs", type=positive_int, nargs="+", default=None, metavar="P",
                      help="group sizes (default: 2 4; --quick: 2)")
    base.add_argument("--baseline-models", nargs="+", choices=("dense", "sliding"), default=None,
                      help="dense: 2 full-attention layers; sliding: 6 layers in Gemma 3's 5:1 pattern (default: both)")
    base.add_argument("--baseline-layouts", nargs="+", choices=("csbp", "cp", "cp-paper", "bp"), default=None,
                      help="layouts to run (default: all four); records of others already in the output are kept")
    cap = p.add_argument_group("longest trainable context under a per-rank memory cap")
    cap.add_argument("--mem-cap", type=parse_size, default=None, metavar="SIZE",
                     help="per-rank cap on the step's peak memory above the built model and batch, e.g. 256MiB")
    cap.add_argument("--max-context-nprocs", type=positive_int, nargs="+", default=None, metavar="P",
                     help="group sizes searched besides P = 1")
    cap.add_argument("--max-context-modes", nargs="+", choices=MODES, default=None,
                     help="modes searched at each P (default: csbp cp bp; --quick: csbp)")
    cap.add_argument("--max-context-layers", type=positive_int, default=None)
    cap.add_argument("--max-context-limit", type=positive_int, default=None, metavar="L",
                     help="longest L probed (the search stops there)")
    for name in suite.STUDY_MODULES:  # each study with a module of its own declares its options (decoding, families')
        module = suite.family_study(name)
        summary = (module.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ").replace("``", "")
        module.add_arguments(p.add_argument_group(f"the {name} study", summary))
    return p


def add_bench_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", help="run the benchmarks: JSON, plots and tables",
        description="Parallel modes (cp / bp / csbp, P = 2 and 4), attention backends, cost growth with context "
                    "length and the longest trainable context under a memory cap, on this machine (gloo on CPU).")
    configure_parser(p)
    p.set_defaults(func=run_bench)


def run_bench(args) -> int:
    if importlib.util.find_spec("matplotlib") is None:
        print("error: hf-bdlm bench draws its plots with matplotlib, which is not installed: "
              "pip install \"hf-bdlm[bench]\"", file=sys.stderr)
        return 2
    return suite.run(args)
