"""The planning study of ``hf-bdlm bench --only planning``: host time and memory of a fresh layout's attention plan.

Everything the host does before the first attention call of a new shape, per context length ``L``:

- **one device** (``layout = "one-device"``): :func:`~hf_bdlm.attention.rows.vectorized_rows` and the FlexAttention
  block mask of the ``2L`` rows over themselves (:func:`~hf_bdlm.attention.block_mask.build_block_mask`);
- **csbp at P = 8** (``"csbp-P8"``): ``make_plan`` of the group, then for each rank its rows, its sources as
  :class:`~hf_bdlm.parallel.exchange.ExchangePass` attends them (the local key tensor = the rank's own rows; the peers'
  source = the other ring members' sent rows, or under a window the rows the window exchange fetches) and one block
  mask per source. Every rank is planned in turn (one rank's masks alive at a time); a record gives the slowest rank.

Variants: full attention, a sliding window of 1024 (a sliding layer has a mask of its own), and on one device packed
documents (8 of equal length); block sizes 32 and 64. The CPU path's planner (``tiles.plan_attention``, the plans of
the ``blockwise`` backend: the "before") is measured on the same layouts at block size 32 up to ``--old-max-length``.

How (the machine this runs on pays a large cost the first time a process touches fresh memory):

- every (layout, variant, B, L, planner) runs in **fresh processes** forked from a server that imported torch and
  ``hf_bdlm`` once and did nothing else (``--serve``; importing ``hf_bdlm`` takes seconds), one torch thread;
- in each process a **first build**, then **warm builds** of the same shape (the first one's arrays freed);
  ``first_s`` / ``warm_s`` are the **minimum** over processes (up to 3 where a process takes under 5 s, 2 under 20 s,
  else 1) and warm builds (up to 3, fewer past 3 s of them), because another job may load the machine;
- **memory**: the process's peak RSS (``VmHWM``) through the first build minus the same of a baseline process of the
  same kind (forked from the same server, planning 1K-token layouts of every kind: the code's own pages), beside the
  bytes of the block masks' eight index arrays (``kv_num_blocks``, ``kv_indices``, ``full_kv_*``, ``q_*``,
  ``full_q_*``);
- **first touch**: for a record whose RSS grew by 128 MB or more, a fresh process times ``numpy.ones`` of that many
  bytes (then again after freeing them), so a reader sees what part of a first build is the machine's page faults;
- **a cached step plans nothing**: in a fresh process, two identical steps of the single-device layout
  (``LocalLayout.vectorized`` then its ``attend``, float64 on CPU under ``no_grad``), with ``build_block_mask`` (flex)
  and ``plan_attention`` (blockwise) counted and timed; also with packed documents.

Records: ``planning.json`` (a list: ``"plan"`` records, each with its ``first_touch`` probe where one ran, the
``"baseline"``, the ``"cached_step"`` and one ``"run"`` record), ``planning.png`` (log-log plan time and memory against ``L``), and the ``summary.md`` section
(:func:`report`) with the issue's targets marked: a fresh plan under 0.2 s at 128K and under 5 s at 1M, its memory no
more than the masks' index arrays.

    hf-bdlm bench --only planning --out benchmarks/results/planning
    python -m hf_bdlm.benchmarks.planning_study --lengths 8192 16384 --out /tmp/planning
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib
import json
import os
import pathlib
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

from .processes import child_env, module_command
from .report import pyplot

LENGTHS = (8192, 16384, 32768, 65536, 131072, 262144, 524288, 1048576)
QUICK_LENGTHS = (8192, 16384)
BLOCK_SIZES = (32, 64)
OLD_BLOCK_SIZE = 32  # the measurement
OLD_MAX_LENGTH = 262144
OLD_REPEAT_MAX_LENGTH = 131072  # the CPU path's planner is run once (no warm build) above this
GROUP = 8  # csbp's P
WINDOW = 1024
DOCUMENTS = 8
BASELINE_LENGTH = 1024
TOUCH_MIN_BYTES = 128 * 2**20
MEMORY_NOISE_MB = 16  # RSS of equal processes varies by a few MB
TARGETS = ((131072, 0.2), (1048576, 5.0))  # (L, seconds): the targets for a fresh plan
LAYOUTS = {"one-device": ("full", "sliding", "packed"), f"csbp-P{GROUP}": ("full", "sliding")}
PRELOAD = ["numpy", "torch", "torch.nn.attention.flex_attention", "hf_bdlm.attention.block_mask",
           "hf_bdlm.attention.tiles", "hf_bdlm.attention.interface", "hf_bdlm.parallel.plan",
           "hf_bdlm.benchmarks.planning_study"]
MiB = 2**20


# --- options ------------------------------------------------------------------------------------------------------
def add_arguments(group) -> None:
    """The study's ``hf-bdlm bench`` options (``None`` defaults: the preset fills them; the per-measurement limit is
    the suite's ``--timeout``)."""
    group.add_argument("--planning-lengths", type=int, nargs="+", default=None, metavar="L",
                       help=f"context lengths, multiples of {2 * GROUP * max(BLOCK_SIZES)} (default: 8K to 1M; "
                            f"--quick: {' '.join(map(str, QUICK_LENGTHS))})")
    group.add_argument("--planning-block-sizes", type=int, nargs="+", default=None, metavar="B",
                       help=f"diffusion block sizes (default: {' '.join(map(str, BLOCK_SIZES))}; --quick: 32)")
    group.add_argument("--planning-old-max-length", type=int, default=None, metavar="L",
                       help=f"longest L the CPU path's planner (tiles.plan_attention) is measured at (default: "
                            f"{OLD_MAX_LENGTH}; 0: not measured)")
    group.add_argument("--planning-processes", type=int, default=None, metavar="N",
                       help="fresh processes per measurement at most (default: 3; --quick: 1)")


def check_arguments(cfg, args: argparse.Namespace) -> None:
    o = _options(cfg, args)
    _check(o["lengths"], o["block_sizes"], "--planning-lengths")
    if o["processes"] < 1:
        raise ValueError(f"--planning-processes {o['processes']}: must be at least 1")
    if o["old_max_length"] < 0:
        raise ValueError(f"--planning-old-max-length {o['old_max_length']}: must be 0 (not measured) or a length")


def _options(cfg, args) -> dict:
    quick = bool(getattr(cfg, "quick", False))
    pick = lambda name, default: default if getattr(args, name, None) is None else getattr(args, name)  # noqa: E731
    return dict(lengths=tuple(pick("planning_lengths", QUICK_LENGTHS if quick else LENGTHS)),
                block_sizes=tuple(pick("planning_block_sizes", (32,) if quick else BLOCK_SIZES)),
                old_max_length=pick("planning_old_max_length", OLD_MAX_LENGTH),
                processes=pick("planning_processes", 1 if quick else 3))


def _check(lengths, block_sizes, option: str) -> None:
    for B in block_sizes:
        if B <= 0:
            raise ValueError(f"--block-sizes {B}: must be a positive integer")
        multiple = max(2 * GROUP * B, DOCUMENTS * B)
        bad = [L for L in lengths if L <= 0 or L % multiple]
        if bad:
            raise ValueError(f"{option} {' '.join(map(str, bad))}: every length must be a multiple of {multiple} "
                             f"(csbp at P = {GROUP} with block size {B}: 2 * P blocks)")


# --- what a measuring process runs ------------------------------------------------------------------------------------
def _status(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process, bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def index_bytes(mask) -> int:
    """Bytes of a BlockMask's eight index arrays."""
    arrays = (mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices, mask.q_num_blocks,
              mask.q_indices, mask.full_q_num_blocks, mask.full_q_indices)
    return sum(t.numel() * t.element_size() for t in arrays if t is not None)


def _rule(B: int, variant: str):
    # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)
    from hf_bdlm.attention.masks import MaskRule

    return MaskRule(B, sliding_window=WINDOW if variant == "sliding" else None)


def _documents(L: int):
    import torch  # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)

    return (torch.arange(L) * DOCUMENTS // L)[None]


def _csbp_sources(L: int, B: int, rule, rank: int):
    """A csbp rank's query rows and key sources, as :class:`~hf_bdlm.parallel.exchange.ExchangePass` attends them: its
    own rows (the local key tensor), then the peers' (their sent rows; under a window, those the exchange fetches)."""
    # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)
    from hf_bdlm.attention.rows import RowMeta
    from hf_bdlm.parallel.dims import ParallelDims
    from hf_bdlm.parallel.plan import PlanConfig, make_plan, window_exchange

    plan = make_plan(PlanConfig(ParallelDims(GROUP, mode="csbp"), seq_len=L, block_size=B))
    members = plan.ring_members(rank)
    me = members.index(rank)
    rows = plan.ranks[rank].rows()
    sent = [plan.sent_rows(m) for m in members]
    if rule.sliding_window is None:
        peers = RowMeta.cat([s for i, s in enumerate(sent) if i != me])
    else:
        peers = window_exchange(me, [plan.ranks[m].rows() for m in members], sent, rule)[3]
    return rows, [rows, peers]


def _build(layout: str, variant: str, L: int, B: int, planner: str, rank: int = 0, doc=None):
    """All host work of a fresh layout: ``(plans, summary)``; ``plans`` holds what was built (to be freed)."""
    # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)
    from hf_bdlm.attention.block_mask import build_block_mask
    from hf_bdlm.attention.rows import vectorized_rows
    from hf_bdlm.attention.tiles import plan_attention

    rule = _rule(B, variant)
    if layout == "one-device":
        rows = vectorized_rows(L, doc)
        q_rows, sources = rows, [rows]
    else:
        q_rows, sources = _csbp_sources(L, B, rule, rank)
    if planner == "tiles":
        plan = plan_attention(q_rows, sources, rule)
        return plan, dict(kernel_calls=len(plan.calls))
    masks = [build_block_mask(q_rows, k, rule) for k in sources]
    return masks, dict(index_bytes=sum(index_bytes(m) for m in masks),
                       kv_partial=sum(int(m.kv_num_blocks.sum()) for m in masks),
                       kv_full=sum(int(m.full_kv_num_blocks.sum()) for m in masks),
                       key_rows=[k.num_rows for k in sources], query_rows=q_rows.num_rows)


def _timed_pass(spec: dict, doc) -> tuple[float, list[float], dict]:
    """Plans every rank of the layout once (one rank's plans alive at a time): the slowest, each, the heaviest's
    summary."""
    ranks = range(GROUP) if spec["layout"] != "one-device" else range(1)
    times, summary = [], None
    for rank in ranks:
        t0 = time.perf_counter()
        built, info = _build(spec["layout"], spec["variant"], spec["L"], spec["B"], spec["planner"], rank, doc)
        times.append(time.perf_counter() - t0)
        del built
        gc.collect()
        if summary is None or info.get("index_bytes", 0) > summary.get("index_bytes", 0):
            summary = info
    return max(times), times, summary


def measure_plan(spec: dict) -> dict:
    """One measuring process: a first build, then up to ``spec["warm"]`` warm builds (fewer past 3 s of them)."""
    started = time.perf_counter()
    doc = _documents(spec["L"]) if spec["variant"] == "packed" else None
    gc.collect()
    rss_start = _status("VmRSS")
    first, first_by_rank, summary = _timed_pass(spec, doc)
    hwm_first = _status("VmHWM")
    warm, spent = [], 0.0
    while len(warm) < spec["warm"] and (not warm or spent < 3.0):
        t, by_rank, _ = _timed_pass(spec, doc)
        warm.append(t)
        spent += sum(by_rank)
    out = dict(first_s=first, warm_s=warm, hwm_first_bytes=hwm_first, hwm_bytes=_status("VmHWM"),
               rss_start_bytes=rss_start, wall_s=time.perf_counter() - started, **summary)
    if len(first_by_rank) > 1:
        out["first_by_rank_s"] = first_by_rank
    return out


def measure_baseline(spec: dict) -> dict:
    """The baseline process: forked from the same server, it runs the same code on 1K-token layouts of every kind, so
    that the pages of code and libraries a plan touches count in the baseline, not in the plan."""
    rss_start = _status("VmRSS")
    for layout, variants in LAYOUTS.items():
        for variant in variants:
            doc = _documents(BASELINE_LENGTH) if variant == "packed" else None
            for planner in ("block_mask", "tiles"):
                _timed_pass(dict(layout=layout, variant=variant, L=BASELINE_LENGTH, B=64, planner=planner), doc)
    return dict(hwm_bytes=_status("VmHWM"), rss_start_bytes=rss_start)


def measure_touch(spec: dict) -> dict:
    """``numpy.ones`` of ``spec["bytes"]`` in a fresh process, then again after freeing them."""
    import numpy  # lazy: keeps hf-bdlm --help light: numpy's import measured 0.06 s on the parsers' 0.08 s

    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        a = numpy.ones(spec["bytes"], dtype=numpy.uint8)
        times.append(time.perf_counter() - t0)
        del a
    return dict(first_s=times[0], again_s=times[1])


def measure_cached_step(spec: dict) -> dict:
    """Two identical single-device steps of the ``flex`` and ``blockwise`` backends (a fresh layout cache): block
    masks and tile plans built, and their time, per step."""
    import torch  # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)

    import hf_bdlm.attention.flex as flex  # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)
    import hf_bdlm.attention.tiles as tiles
    from hf_bdlm.attention.interface import LocalLayout

    counted = {"build_block_mask": [flex, flex.build_block_mask], "plan_attention": [tiles, tiles.plan_attention]}
    calls: dict[str, list[float]] = {name: [] for name in counted}

    def wrap(name, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                calls[name].append(time.perf_counter() - t0)
        return timed

    for name, (module, fn) in counted.items():
        setattr(module, name, wrap(name, fn))
    L, B, heads, dim = spec["L"], spec["B"], 2, 16
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, heads, 2 * L, dim, dtype=torch.float64) for _ in range(3))
    rule = _rule(B, "full")
    out = []
    try:
        for backend in ("flex", "blockwise"):
            for packed in (False, True):
                doc = _documents(L) if packed else None
                for step in (1, 2):
                    before = {name: len(c) for name, c in calls.items()}
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        layout = LocalLayout.vectorized(L, rule, backend, None if doc is None else doc.clone())
                        t_layout = time.perf_counter() - t0
                        layout.attend(None, q, k, v, rule, dim ** -0.5)
                    step_s = time.perf_counter() - t0
                    new = {name: c[before[name]:] for name, c in calls.items()}
                    out.append(dict(backend=backend, packed=packed, step=step, L=L, B=B,
                                    builds=sum(len(c) for c in new.values()), build_s=sum(sum(c) for c in new.values()),
                                    built={name: len(c) for name, c in new.items()}, layout_s=t_layout, step_s=step_s,
                                    layout_id=id(layout)))
    finally:
        for name, (module, fn) in counted.items():
            setattr(module, name, fn)
    return dict(steps=out)


_KINDS = {"plan": measure_plan, "baseline": measure_baseline, "first_touch": measure_touch,
          "cached_step": measure_cached_step}


def _child(spec: dict) -> dict:
    try:
        import torch  # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)

        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        torch.set_num_threads(1)
        return _KINDS[spec["kind"]](spec)
    except BaseException:  # noqa: BLE001 - the parent records it
        return dict(error=traceback.format_exc())


def _die_with_parent() -> None:
    """Linux: this process is killed when the server ends (a killed study leaves no measurement running)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass


def serve() -> None:
    """The fork server (``--serve``): imports torch and ``hf_bdlm`` once, then per line of stdin (a spec, JSON) forks
    a fresh process that measures it and answers one JSON line on stdout (its own output goes to stderr)."""
    for name in PRELOAD:
        importlib.import_module(name)
    # The imports' objects move to the collector's permanent generation: a measuring process's collections then visit
    # only its own objects (not millions of imported ones, whose headers they would write, copying their pages).
    gc.collect()
    gc.freeze()
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what a measuring process prints goes to stderr, never into the answers
    for line in sys.stdin:
        spec = json.loads(line)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the measuring process
            os.close(read)
            _die_with_parent()
            data = json.dumps(_child(spec)).encode()
            while data:
                data = data[os.write(write, data):]
            os._exit(0)
        os.close(write)
        chunks, deadline, timed_out = [], time.monotonic() + spec.get("timeout", 1800.0), False
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([read], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                timed_out = True
                break
            chunk = os.read(read, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
        os.close(read)
        _, status = os.waitpid(pid, 0)
        if timed_out:
            answer = dict(error=f"timed out after {spec.get('timeout', 1800.0):g} s")
        elif not chunks:
            answer = dict(error=f"the measuring process ended with status {status} before reporting (killed for "
                                f"memory?)")
        else:
            answer = json.loads(b"".join(chunks))
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


# --- the parent -------------------------------------------------------------------------------------------------------
class Processes:
    """Fresh measuring processes, each forked from one server (``python -m hf_bdlm.benchmarks.planning_study
    --serve``) that imported torch and ``hf_bdlm`` (:data:`PRELOAD`) and nothing else: no tensor of its own, no thread
    pool started."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._cwd = tempfile.TemporaryDirectory()
        self.server = subprocess.Popen([*module_command("planning_study"), "--serve"], cwd=self._cwd.name,
                                       env=child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self, spec: dict) -> dict:
        if self.server.poll() is not None:
            raise RuntimeError(f"the planning fork server exited with {self.server.returncode} (its output is above)")
        self.server.stdin.write(json.dumps(dict(spec, timeout=self.timeout)) + "\n")
        self.server.stdin.flush()
        line = self.server.stdout.readline()
        if not line:
            raise RuntimeError(f"the planning fork server exited with {self.server.wait()} (its output is above)")
        return json.loads(line)

    def close(self) -> None:
        if self.server.poll() is None:
            self.server.stdin.close()
            self.server.wait()
        self._cwd.cleanup()


def _processes_for(wall_s: float, limit: int) -> int:
    """Processes for a measurement whose first process took ``wall_s`` (every rank, first and warm builds)."""
    return min(limit, 3 if wall_s < 5.0 else 2 if wall_s < 20.0 else 1)


def measure(runner: Processes, layout: str, variant: str, L: int, B: int, planner: str, processes: int,
            warm: int) -> dict:
    """One record: up to ``processes`` fresh processes (fewer for a slow plan), the minimum of each time."""
    spec = dict(kind="plan", layout=layout, variant=variant, L=L, B=B, planner=planner, warm=warm)
    runs = [runner.run(spec)]
    if "error" not in runs[0]:
        for _ in range(_processes_for(runs[0]["wall_s"], processes) - 1):
            runs.append(runner.run(spec))
    ok = [r for r in runs if "error" not in r]
    rec = dict(kind="plan", layout=layout, variant=variant, L=L, B=B, planner=planner, processes=len(runs))
    if not ok:
        rec["error"] = runs[0]["error"]
        return rec
    warm_all = [t for r in ok for t in r["warm_s"]]
    rec.update(first_s=min(r["first_s"] for r in ok), first_runs_s=[r["first_s"] for r in ok],
               warm_s=min(warm_all) if warm_all else None, warm_runs_s=warm_all,
               hwm_first_bytes=max(r["hwm_first_bytes"] for r in ok), hwm_bytes=max(r["hwm_bytes"] for r in ok),
               rss_start_bytes=min(r["rss_start_bytes"] for r in ok))
    for key in ("index_bytes", "kv_partial", "kv_full", "key_rows", "query_rows", "kernel_calls"):
        if key in ok[0]:
            rec[key] = ok[0][key]
    if "first_by_rank_s" in ok[0]:
        rec["first_by_rank_s"] = min((r["first_by_rank_s"] for r in ok), key=max)
    return rec


def _log_line(rec: dict) -> str:
    name = f"{rec['layout']:10} {rec['variant']:7} B={rec['B']:<3} L={rec['L']:>8} {rec['planner']:10}"
    if "error" in rec:
        return f"{name}: ERROR {(rec['error'].strip().splitlines() or ['?'])[-1][:120]}"
    warm = "-" if rec["warm_s"] is None else f"{rec['warm_s']:.3f}"
    extra = f"  index {rec['index_bytes'] / MiB:8.1f} MB" if "index_bytes" in rec else ""
    return (f"{name}: first {rec['first_s']:7.3f} s  warm {warm:>7} s  RSS +{rec.get('rss_over_baseline_mb', 0):8.1f} "
            f"MB{extra}  ({rec['processes']} process(es))")


def study(lengths, block_sizes, out: pathlib.Path, old_max_length: int = OLD_MAX_LENGTH, processes: int = 3,
          timeout: float = 1800.0, log=print) -> list[dict]:
    """Runs the study, writing ``out`` (``planning.json``) as records come; returns the records."""
    _check(lengths, block_sizes, "--lengths")
    started = time.perf_counter()
    load_start = os.getloadavg()[0]
    runner = Processes(timeout)
    try:
        return _study(runner, lengths, block_sizes, out, old_max_length, processes, log, started, load_start)
    finally:
        runner.close()


def _study(runner, lengths, block_sizes, out, old_max_length, processes, log, started, load_start) -> list[dict]:
    records: list[dict] = []

    def keep(rec):
        records.append(rec)
        out.write_text(json.dumps(records, indent=1))

    layouts = "; ".join(f"{k} ({', '.join(v)})" for k, v in LAYOUTS.items())
    log(f"planning: L {' '.join(map(str, lengths))}; B {' '.join(map(str, block_sizes))}; layouts "
        f"{layouts}; the CPU path's planner at B = "
        f"{OLD_BLOCK_SIZE} up to L = {old_max_length}; load average {load_start:.2f}")
    t0 = time.perf_counter()
    bases = [runner.run(dict(kind="baseline")) for _ in range(2)]
    good = [b for b in bases if "error" not in b]
    if not good:
        raise RuntimeError(f"the baseline process failed:\n{bases[0]['error']}")
    baseline = min(b["hwm_bytes"] for b in good)
    keep(dict(kind="baseline", hwm_bytes=baseline, runs=[b.get("hwm_bytes") for b in bases],
              rss_start_bytes=min(b["rss_start_bytes"] for b in good), seconds=time.perf_counter() - t0))
    log(f"  baseline process: peak RSS {baseline / MiB:.0f} MB (forked from the server that imported torch and "
        f"hf_bdlm; {BASELINE_LENGTH}-token layouts of every kind planned); server start "
        f"{time.perf_counter() - t0:.1f} s")
    touched: dict[int, dict] = {}
    for L in lengths:
        for layout, variants in LAYOUTS.items():
            for variant in variants:
                for B in block_sizes:
                    planners = ["block_mask"]
                    if B == OLD_BLOCK_SIZE and L <= old_max_length:
                        planners.append("tiles")
                    for planner in planners:
                        once = planner == "tiles" and L > OLD_REPEAT_MAX_LENGTH
                        rec = measure(runner, layout, variant, L, B, planner, 1 if once else processes,
                                      0 if once else (1 if planner == "tiles" else 3))
                        if "error" not in rec:
                            rec["rss_over_baseline_mb"] = (rec["hwm_first_bytes"] - baseline) / MiB
                            grown = rec["hwm_first_bytes"] - baseline
                            if grown >= TOUCH_MIN_BYTES:
                                bucket = round(grown / (64 * MiB))
                                if bucket not in touched:
                                    probe = runner.run(dict(kind="first_touch", bytes=int(grown)))
                                    touched[bucket] = dict(probe, bytes=int(grown))
                                rec["first_touch"] = touched[bucket]
                        keep(rec)
                        log(f"  [{time.perf_counter() - started:5.0f} s] {_log_line(rec)}")
    cached = runner.run(dict(kind="cached_step", L=256, B=32))
    keep(dict(kind="cached_step", **cached))
    if "error" in cached:
        log(f"  cached step: ERROR {cached['error'].strip().splitlines()[-1]}")
    else:
        for s in cached["steps"]:
            log(f"  cached step: {s['backend']:9} packed={s['packed']!s:5} step {s['step']}: {s['builds']} plan(s) "
                f"built ({s['build_s'] * 1e3:.2f} ms), layout lookup {s['layout_s'] * 1e3:.3f} ms")
    keep(dict(kind="run", wall_s=time.perf_counter() - started, load_average_start=round(load_start, 2),
              load_average_end=round(os.getloadavg()[0], 2), threads=1, cpus=os.cpu_count(), lengths=list(lengths),
              block_sizes=list(block_sizes), old_max_length=old_max_length, processes=processes))
    log(f"planning: {time.perf_counter() - started:.0f} s")
    return records


def run(cfg, args: argparse.Namespace, out: pathlib.Path, log=print) -> list[dict]:
    """The suite's entry: the study with the preset's or the given options, records in ``out``."""
    o = _options(cfg, args)
    return study(o["lengths"], o["block_sizes"], out, o["old_max_length"], o["processes"],
                 getattr(cfg, "timeout", 1800.0), log)


# --- report -----------------------------------------------------------------------------------------------------------
def _plans(records, planner="block_mask"):
    return [r for r in records if r.get("kind") == "plan" and r["planner"] == planner and "error" not in r]


def _length(L: int) -> str:
    return f"{L // 1048576}M" if L % 1048576 == 0 else f"{L // 1024}K" if L % 1024 == 0 else str(L)


def _s(x) -> str:
    return "-" if x is None else f"{x:.3f}" if x < 10 else f"{x:.1f}"


def _order(r: dict) -> tuple[int, int]:
    """Layouts and variants in :data:`LAYOUTS`' order."""
    return list(LAYOUTS).index(r["layout"]), LAYOUTS[r["layout"]].index(r["variant"])


def _targets(records) -> list[tuple]:
    """(layout, variant, B, L, limit, first, warm) for every target length measured."""
    rows = []
    for L, limit in TARGETS:
        for r in sorted(_plans(records), key=lambda r: (*_order(r), r["B"])):
            if r["L"] == L:
                rows.append((r["layout"], r["variant"], r["B"], L, limit, r["first_s"], r["warm_s"]))
    return rows


def _met(x, limit) -> str:
    return "-" if x is None else ("met" if x < limit else "**not met**")


def table(records: list[dict]) -> str:
    old = {(r["layout"], r["variant"], r["L"]): r for r in _plans(records, "tiles")}
    head = ("| L | layout | variant | B | first s | warm s | RSS MB over baseline | index-array MB | kv tiles listed "
            "(partial / full) | first touch s (numpy.ones of that RSS, fresh / again) | old planner first s | old "
            "warm s | old RSS MB |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in sorted(_plans(records), key=lambda r: (r["L"], *_order(r), r["B"])):
        o = old.get((r["layout"], r["variant"], r["L"])) if r["B"] == OLD_BLOCK_SIZE else None
        touch = r.get("first_touch")
        touch_s = "-" if not touch or "error" in touch else f"{touch['first_s']:.2f} / {touch['again_s']:.2f}"
        old_rss = f"{o['rss_over_baseline_mb']:.0f}" if o else "-"
        lines.append(
            f"| {_length(r['L'])} | {r['layout']} | {r['variant']} | {r['B']} | {_s(r['first_s'])} | {_s(r['warm_s'])} "
            f"| {r['rss_over_baseline_mb']:.0f} | {r['index_bytes'] / MiB:.0f} | {r['kv_partial']} / {r['kv_full']} "
            f"| {touch_s} | {_s(o['first_s']) if o else '-'} | {_s(o['warm_s']) if o else '-'} "
            f"| {old_rss} |")
    for r in records:
        if r.get("kind") == "plan" and "error" in r:
            lines.append(f"| {_length(r['L'])} | {r['layout']} | {r['variant']} | {r['B']} | error: "
                         f"{(r['error'].strip().splitlines() or ['?'])[-1][:80]} |")
    return "\n".join(lines)


def targets_table(records: list[dict]) -> str:
    lines = ["| target | layout | variant | B | first s | first | warm s | warm |", "|---|---|---|---|---|---|---|---|"]
    for layout, variant, B, L, limit, first, warm in _targets(records):
        lines.append(f"| < {limit:g} s at {_length(L)} | {layout} | {variant} | {B} | {_s(first)} | "
                     f"{_met(first, limit)} | {_s(warm)} | {_met(warm, limit)} |")
    return "\n".join(lines)


def _memory_met(r: dict) -> bool:
    return r["rss_over_baseline_mb"] <= r["index_bytes"] / MiB + MEMORY_NOISE_MB


def memory_table(records: list[dict]) -> str:
    """Per layout, variant and B: the lengths where the first build's RSS stayed within the index arrays, and those
    where it did not (RSS over the baseline / the arrays' MB)."""
    lines = ["| layout | variant | B | met at | not met at (RSS MB / index-array MB) |", "|---|---|---|---|---|"]
    groups: dict[tuple, list[dict]] = {}
    for r in sorted(_plans(records), key=lambda r: r["L"]):
        groups.setdefault((r["layout"], r["variant"], r["B"]), []).append(r)
    for (layout, variant, B), rs in sorted(groups.items(), key=lambda kv: (*_order(kv[1][0]), kv[0][2])):
        met = ", ".join(_length(r["L"]) for r in rs if _memory_met(r)) or "-"
        over = ", ".join(f"{_length(r['L'])} ({r['rss_over_baseline_mb']:.0f} / {r['index_bytes'] / MiB:.0f})"
                         for r in rs if not _memory_met(r)) or "-"
        lines.append(f"| {layout} | {variant} | {B} | {met} | {over} |")
    return "\n".join(lines)


def cached_text(records: list[dict]) -> str:
    found = [r for r in records if r.get("kind") == "cached_step"]
    if not found:
        return "A cached step: not measured."
    if "error" in found[-1]:
        return f"A cached step: error {found[-1]['error'].strip().splitlines()[-1]}"
    parts = []
    for s in found[-1]["steps"]:
        parts.append(f"{s['backend']}{' packed' if s['packed'] else ''} step {s['step']}: {s['builds']} built "
                     f"({s['build_s'] * 1e3:.2f} ms)")
    second = [s for s in found[-1]["steps"] if s["step"] == 2]
    verdict = "plans nothing" if all(s["builds"] == 0 for s in second) else "**plans again**"
    return (f"A cached step {verdict} (two identical steps of `LocalLayout.vectorized` + `attend` at L = "
            f"{second[0]['L'] if second else '?'}, fresh process; plans counted: `build_block_mask` for flex, "
            f"`plan_attention` for blockwise): " + "; ".join(parts) + ".")


def report(records: list[dict]) -> str:
    """The study's section of ``summary.md``."""
    run_rec = next((r for r in records if r.get("kind") == "run"), {})
    base = next((r for r in records if r.get("kind") == "baseline"), {})
    title = (f"**Host planning of a fresh layout** (one device: `vectorized_rows` + `build_block_mask`; csbp P = "
             f"{GROUP}: `make_plan`, the rank's rows and sources, one mask per source, the slowest of the {GROUP} "
             f"ranks; fresh processes forked from a server that imported torch, one thread; seconds are the minimum "
             f"over processes (first build) and over warm builds of the same shape in the same process; RSS: peak "
             f"through the first build over a baseline process of the same kind "
             f"({base.get('hwm_bytes', 0) / MiB:.0f} MB); old planner: `tiles.plan_attention`, the blockwise path, "
             f"at B = {OLD_BLOCK_SIZE}, once above {_length(OLD_REPEAT_MAX_LENGTH)}; run "
             f"{run_rec.get('wall_s', 0):.0f} s, load average {run_rec.get('load_average_start', '?')} -> "
             f"{run_rec.get('load_average_end', '?')})")
    memory = (f"**Memory against the masks' own index arrays** (peak RSS over the baseline through the first build "
              f"within the index arrays' bytes + {MEMORY_NOISE_MB} MB, what equal processes' RSS varies by)")
    return "\n\n".join([title, table(records), "**Targets** (issue 42: a fresh plan under 0.2 s at 128K, under 5 s at "
                        "1M)", targets_table(records), memory, memory_table(records), cached_text(records)])


def plot(records: list[dict], path: pathlib.Path) -> pathlib.Path | None:
    """Log-log: first-build time, warm-build time and RSS against L; a colour per layout and variant, solid B = 32,
    dashed B = 64, dash-dotted with crosses the CPU path's planner (B = 32), dotted the masks' index arrays."""
    plans = _plans(records)
    if not plans:
        return None
    from matplotlib.lines import Line2D  # lazy: optional dependency (matplotlib)

    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(18, 6))
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    kinds = sorted({(r["layout"], r["variant"]) for r in plans}, key=lambda k: _order(dict(layout=k[0], variant=k[1])))
    colors = {k: palette[i % len(palette)] for i, k in enumerate(kinds)}
    styles = {32: "-", 64: "--"}
    keys = ("first_s", "warm_s", "rss_over_baseline_mb")

    def series(rs, key):  # RSS at or under the baseline (small L) has no place on a log axis
        rs = sorted((r for r in rs if r.get(key) is not None and r[key] > 0), key=lambda r: r["L"])
        return [r["L"] for r in rs], [r[key] for r in rs]

    for (layout, variant), color in colors.items():
        for B in sorted({r["B"] for r in plans}):
            rs = [r for r in plans if (r["layout"], r["variant"], r["B"]) == (layout, variant, B)]
            for ax, key in zip(axes, keys):
                ax.plot(*series(rs, key), styles.get(B, ":"), color=color, marker="o", ms=3)
            if B == min(r["B"] for r in plans):
                axes[2].plot(*series([dict(r, index_mb=r["index_bytes"] / MiB) for r in rs], "index_mb"), ":",
                             color=color, lw=1.2)
        old = [r for r in _plans(records, "tiles") if (r["layout"], r["variant"]) == (layout, variant)]
        for ax, key in zip(axes, keys):
            ax.plot(*series(old, key), "-.", color=color, marker="x", ms=5, lw=1.2, alpha=0.7)
    for ax in axes[:2]:
        for L, limit in TARGETS:
            ax.plot([L], [limit], "r*", ms=14, zorder=5)
            ax.annotate(f"target {limit:g} s", (L, limit), textcoords="offset points", xytext=(-60, 8), color="r",
                        fontsize=8)
    titles = ("first build in a fresh process (s)", "warm build, same process (s)",
              "peak RSS over baseline through the first build (MB)")
    for ax, title in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_formatter(lambda x, _pos: _length(int(x)) if x >= 1024 else f"{x:g}")
        ax.set_xlabel("L (tokens)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    handles = [Line2D([], [], color=c, lw=2, label=f"{layout} {variant}") for (layout, variant), c in colors.items()]
    handles += [Line2D([], [], color="k", ls="-", marker="o", ms=3, label="block masks, B = 32"),
                Line2D([], [], color="k", ls="--", marker="o", ms=3, label="block masks, B = 64"),
                Line2D([], [], color="k", ls="-.", marker="x", label=f"old planner (tiles.plan_attention), B = "
                                                                         f"{OLD_BLOCK_SIZE}"),
                Line2D([], [], color="k", ls=":", label="the masks' index arrays (RSS panel)"),
                Line2D([], [], color="r", ls="", marker="*", ms=10, label="issue 42's targets")]
    fig.legend(handles=handles, loc="lower center", ncol=5, fontsize=8)
    fig.suptitle("host planning of a fresh layout against L (min over fresh processes / warm builds; one thread)")
    fig.tight_layout(rect=(0, 0.1, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --- the command ------------------------------------------------------------------------------------------------------
def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    p.add_argument("--block-sizes", type=int, nargs="+", default=list(BLOCK_SIZES))
    p.add_argument("--old-max-length", type=int, default=OLD_MAX_LENGTH,
                   help="longest L the CPU path's planner is measured at (0: not measured)")
    p.add_argument("--processes", type=int, default=3, help="fresh processes per measurement at most")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per measuring process")
    p.add_argument("--out", help="folder for planning.json, planning.png and summary.md")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the fork server (Processes)
    return p


def main(argv=None) -> list[dict]:
    args = make_parser().parse_args(argv)
    if args.serve:
        serve()
        return [{}]
    if not args.out:
        make_parser().error("--out is required")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = study(tuple(args.lengths), tuple(args.block_sizes), out / "planning.json", args.old_max_length,
                    args.processes, args.timeout, log=lambda s: print(s, flush=True))
    plot(records, out / "planning.png")
    text = report(records)
    (out / "summary.md").write_text(text + "\n")
    print(text)
    return records


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
