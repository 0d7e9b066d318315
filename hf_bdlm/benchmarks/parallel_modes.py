"""CPU (gloo) benchmark of the block-parallel modes of docs/design.md §3: ``cp``, ``bp``, ``csbp``.

One training step (forward + backward, no optimizer) of a small Llama-style BDLM (hidden 256,
8 heads, 2 KV heads, head dim 32, intermediate 512, vocab 1024, ``--layers`` layers, block 64,
``blockwise`` attention, float32) on one sequence of length ``L``, all tokens supervised,
objective ``standard``. For every (mode, P, L) the driver launches a fresh ``torchrun`` (so each
configuration's peak RSS is its own) running this same module with ``--worker``
(``-m hf_bdlm.benchmarks.parallel_modes``); the single-process baseline (``single``: plain ``objective.loss``) runs
in a fresh process too. One thread per rank.

Per configuration: step time (median over ``--steps``, at least 3, or as many as fill ``--min-time`` seconds up to
10, after one warm-up; the group's step time is the slowest rank's; every timed step is kept in ``step_times`` and
``step_spread`` gives median and range; with ``--min-time``, steps under half of it are launched 3 times and the
median launch kept), tokens/s (``L`` / step time), peak memory (``ru_maxrss`` high-water mark minus
the RSS once model and batch are built, max over ranks; the absolute high-water mark is kept as
``peak_rss_bytes``), bytes received per step from the ByteMeter (max over ranks, and per
collective name; ``wire_bytes_*``: as an emulated link charged them) and the exposed communication: time blocked in waits on collectives (``wait_s``,
max over ranks), split into forward (``fwd``, up to the loss) and backward (``bwd``). ``cp`` and
``csbp`` run with both transports (``--transports allgather ring``); ``bp`` has no communication
and runs with both noisy-block schedules (``--bp-schedules``): the ratios compare against the faster
one at each length. ``--window W`` makes every layer a sliding-window layer (a Qwen3 backbone of the
same sizes), whose halo rows travel by all-to-all; with ``--full-every K`` every ``K``-th layer stays full attention
(Gemma 3's pattern is ``K = 6``: five sliding layers, then a full one). The mode ``cp-paper`` is ``cp`` in the paper's
baseline layout (``block_parallel_cp_layout="paper"``; its records say ``mode: "cp"``, ``cp_layout: "paper"``). ``--device cuda`` runs one rank per GPU with NCCL (peak
memory from the CUDA allocator, times after a device synchronize; ``wait_s`` then counts host-side waits
only, which NCCL's stream-ordered collectives make near zero), ``--dtype bfloat16`` the step under bf16
autocast, ``--attention-backend`` another backend (the repository's ``benchmarks/gpu/`` runbook uses these).
``--link NAME`` runs every K/V transfer through an emulated cluster link (:mod:`hf_bdlm.planner.link`): at the start
of each launch its ranks measure their matmul rate all at once (the launch's processes per core) and stretch the
named link by it; each record's ``link`` holds the rate, how it was measured and the link's figures.

    python -m hf_bdlm.benchmarks.parallel_modes --quick --out /tmp/pm.json          # < 3 min
    python -m hf_bdlm.benchmarks.parallel_modes --lengths 4096 8192 16384 --nprocs 2 4 --out results.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING

from ..planner.model import spec_from_config
from ..protocols.registry import family_named
from .processes import child_env, module_command, module_name
from .spread import MIN_TIMED_STEPS, Spread, check_timed_steps, compare

if TYPE_CHECKING:
    from ..parallel.emulated_link import LinkModel

BLOCK, MASK, PAD = 64, 1023, 0
MEASURED_FAMILY = "block_diffusion"  # the model measured: a converted causal LM, found through the registry
PAPER_CP = "cp-paper"  # the driver's name of cp in the paper's baseline layout


# ----------------------------------------------------------------------------------------------
# worker
# ----------------------------------------------------------------------------------------------
def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def model_config(layers: int, window: int | None = None, backend: str = "blockwise", full_every: int | None = None):
    """The benchmarked model's ``BlockDiffusionConfig`` (also what ``hf-bdlm plan --validate`` predicts): with
    ``window``, sliding-window layers, every ``full_every``-th one full attention when given."""
    # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)
    from transformers import LlamaConfig, Qwen3Config

    dims = dict(vocab_size=1024, hidden_size=256, num_hidden_layers=layers, num_attention_heads=8,
                num_key_value_heads=2, head_dim=32, intermediate_size=512, pad_token_id=PAD)
    if window and full_every:  # e.g. Gemma 3's 5:1 pattern with full_every=6
        types = ["full_attention" if (i + 1) % full_every == 0 else "sliding_attention" for i in range(layers)]
        backbone = Qwen3Config(**dims, use_sliding_window=True, sliding_window=window, layer_types=types)
    elif window:  # every layer a sliding-window layer (Qwen3 with max_window_layers=0)
        backbone = Qwen3Config(**dims, use_sliding_window=True, sliding_window=window, max_window_layers=0)
    else:
        backbone = LlamaConfig(**dims)
    return family_named(MEASURED_FAMILY).new_config(backbone_config=backbone, block_size=BLOCK, mask_token_id=MASK,
                                                    attention_backend=backend)


def build(L: int, layers: int, window: int | None = None, device: str = "cpu", backend: str = "blockwise",
          full_every: int | None = None):
    import torch  # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)

    from ..objectives import get_objective  # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)
    # Same seed on every rank: identical weights and batch, as the group shares one batch.
    torch.manual_seed(0)
    cfg = model_config(layers, window, backend, full_every)
    model = family_named(MEASURED_FAMILY).new_model(cfg).float().to(device)
    objective = get_objective("standard", cfg)
    g = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(2, MASK, (1, L), generator=g),
             "completion_mask": torch.ones(1, L, dtype=torch.long),
             "attention_mask": torch.ones(1, L, dtype=torch.long),
             "sample_ids": torch.arange(1)}
    corrupted = objective.corrupt(batch, seed=7, step=0)
    moved = {f.name: getattr(corrupted, f.name) for f in dataclasses.fields(corrupted)}
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()}
    return model, objective, dataclasses.replace(corrupted, **moved)


class _Device:
    """Where a worker runs: the CPU (gloo, RSS high-water marks) or one CUDA device per rank (NCCL, allocator peaks).

    On CUDA every timestamp is taken after a device synchronize, and the step runs under bf16 autocast with
    ``--dtype bfloat16`` (float32 weights, as the trainer's ``bf16=True``)."""

    def __init__(self, kind: str, dtype: str):
        import torch  # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)

        self.kind, self.torch = kind, torch
        if kind == "cuda":
            if not torch.cuda.is_available():
                raise SystemExit("--device cuda: no CUDA device is visible; run on a GPU machine or use --device cpu.")
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            self.name = f"cuda:{torch.cuda.current_device()}"
        else:
            self.name = "cpu"
        self.dtype = getattr(torch, dtype)

    @property
    def backend(self) -> str:
        return "nccl" if self.kind == "cuda" else "gloo"

    def now(self) -> float:
        if self.kind == "cuda":
            self.torch.cuda.synchronize()
        return time.perf_counter()

    def autocast(self):
        if self.dtype == self.torch.float32:
            return contextlib.nullcontext()
        return self.torch.autocast(self.kind, dtype=self.dtype)

    def mark(self) -> int:
        """The memory in use once model and batch are built; peaks are measured above it."""
        if self.kind == "cuda":
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()
            return self.torch.cuda.memory_allocated()
        return current_rss()

    def peak(self) -> int:
        if self.kind == "cuda":
            return self.torch.cuda.max_memory_allocated()
        return peak_rss()


MAX_TIMED_STEPS = 10


def timed_steps(steps: int, min_time: float, warmup_s: float) -> int:
    """Timed steps after a warm-up of ``warmup_s`` seconds: ``steps``, or enough to fill ``min_time`` seconds (at
    most :data:`MAX_TIMED_STEPS`), so short steps get the repeats their larger relative noise needs."""
    if min_time <= 0 or warmup_s <= 0:
        return steps
    return max(steps, min(MAX_TIMED_STEPS, math.ceil(min_time / warmup_s)))


def worker(args) -> None:
    """One configuration's process (``--worker``): builds the model and batch, runs one warm-up step and the timed
    steps, and writes the record to ``args.out``. ``single`` runs the plain loss in this process; the other modes run
    one rank of a ``torchrun`` group, whose rank 0 writes the group's record."""
    import torch  # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)

    torch.set_num_threads(1)
    L = args.lengths[0]
    dev = _Device(args.device, args.dtype)
    model, objective, corrupted = build(L, args.layers, args.window, dev.name, args.attention_backend,
                                        args.full_every)
    base_rss = dev.mark()
    if args.mode == "single":
        times = _single_steps(args, dev, model, objective, corrupted)
        peak, peak_abs = dev.peak() - base_rss, dev.peak()
        pathlib.Path(args.out).write_text(json.dumps(_single_record(args, L, times, peak, peak_abs)))
        return
    _rank_worker(args, L, dev, model, objective, corrupted, base_rss)


def _single_steps(args, dev: _Device, model, objective, corrupted) -> list[float]:
    """Step times of the single process (plain ``objective.loss``), after one warm-up step."""
    # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)
    from hf_bdlm.attention.interface import forget_kept_layouts

    times: list[float] = []
    timed, step = args.steps, 0
    while step <= timed:
        model.zero_grad(set_to_none=True)
        if args.replan_every_step:
            forget_kept_layouts()  # the single-device layouts kept across steps, with their plans
        t0 = dev.now()
        with dev.autocast():
            loss, _ = objective.loss(model, corrupted)
        loss.backward()
        dt = dev.now() - t0
        if step:  # step 0 is the warm-up
            times.append(dt)
        else:
            timed = timed_steps(args.steps, args.min_time, dt)
        step += 1
    return times


def _single_record(args, L: int, times: list[float], peak: int, peak_abs: int) -> dict:
    """The record of the single-process baseline: no communication."""
    return dict(mode="single", device=args.device, dtype=args.dtype, transport=None, schedule=None, P=1, C=1, L=L,
                attention_backend=args.attention_backend, replan_every_step=bool(args.replan_every_step),
                layers=args.layers, window=args.window, full_every=args.full_every, steps=len(times),
                step_s=statistics.median(times), step_times=times, step_spread=Spread(times).as_record(),
                tokens_per_s=L / statistics.median(times),
                peak_mem_bytes=peak, peak_rss_bytes=peak_abs, bytes_per_step=0, bytes_by_name={},
                wire_bytes_per_step=0, wire_bytes_by_name={}, comm_wait_s=0.0, comm_wait_fwd_s=0.0,
                comm_wait_bwd_s=0.0)


def _rank_worker(args, L: int, dev: _Device, model, objective, corrupted, base_rss: int) -> None:
    """One rank of a ``cp``/``bp``/``csbp`` group: joins the process group, runs the steps, gathers every rank's
    measurements on rank 0, which writes the group's record."""
    import torch.distributed as dist  # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)

    # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)
    from hf_bdlm.parallel.collectives import ByteMeter
    from hf_bdlm.parallel.dims import ParallelDims
    from hf_bdlm.parallel.groups import BlockParallelGroups
    from hf_bdlm.parallel.plan import PlanConfig

    dist.init_process_group(dev.backend)
    P, rank = dist.get_world_size(), dist.get_rank()
    meter = ByteMeter()
    dims = ParallelDims(P, None, args.mode, args.schedule, cp_layout=args.cp_layout)
    link = _link(args)  # a named link: every rank measures its compute rate now, all at once
    groups = BlockParallelGroups.build(dims, args.device, meter, link=link)
    plan_cfg = PlanConfig.from_dims(groups.dims, L, BLOCK)
    C = groups.dims.clean_ring_size
    mine = _rank_steps(args, dev, model, objective, corrupted, meter, groups, plan_cfg)
    peak, peak_abs = dev.peak() - base_rss, dev.peak()
    mine.update(peak=peak, peak_abs=peak_abs)
    everyone: list = [None] * P
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        rec = _group_record(args, L, P, C, len(mine["times"]), everyone, link)
        pathlib.Path(args.out).write_text(json.dumps(rec))
    dist.barrier()
    dist.destroy_process_group()


def _rank_steps(args, dev: _Device, model, objective, corrupted, meter, groups, plan_cfg) -> dict:
    """This rank's timed steps after one warm-up: step times, bytes received by collective name, and the time blocked
    in waits (in all and up to the loss), one entry per timed step."""
    import torch  # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)
    import torch.distributed as dist

    # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)
    from hf_bdlm.parallel.sharded import ShardedLayout

    times, bytes_steps, wire_steps, waits, fwd_waits = [], [], [], [], []
    # ``cp`` talks on the group, ``csbp`` on the ring (same ranks when C = P, but distinct
    # CommContexts): sum both wait counters so the mode does not matter here.
    comms = (groups.group, groups.ring)
    timed, step, layout = args.steps, 0, None
    while step <= timed:
        meter.next_step()
        model.zero_grad(set_to_none=True)
        wait0 = sum(c.wait_seconds for c in comms)
        dist.barrier()  # start together, so the slowest rank's time is the group's step time
        t0 = dev.now()
        # Built once and kept, as the trainer keeps a layout for a batch of the same shape and documents (its plans
        # and block masks are built by the first forward); --replan-every-step builds it anew every step.
        if layout is None or args.replan_every_step:
            layout = ShardedLayout.build(plan_cfg, groups, model.mask_rule(), args.attention_backend,
                                         corrupted.document_ids, transport=args.transport)
        with dev.autocast():
            loss, _ = objective.loss(model, corrupted, layout)  # the trainer's step, on this rank's rows
        wait_fwd = sum(c.wait_seconds for c in comms) - wait0
        loss.backward()
        dt = dev.now() - t0
        if step:
            times.append(dt)
            bytes_steps.append(meter.by_name())
            wire_steps.append(meter.by_name(wire=True))
            waits.append(sum(c.wait_seconds for c in comms) - wait0)
            fwd_waits.append(wait_fwd)
        else:
            # Every rank must run the same number of steps: they agree on the slowest rank's warm-up.
            slowest = torch.tensor([dt], dtype=torch.float64, device=dev.name)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            timed = timed_steps(args.steps, args.min_time, float(slowest))
        step += 1
        del loss
    return dict(times=times, bytes=bytes_steps, wire=wire_steps, waits=waits, fwd_waits=fwd_waits)


def _group_record(args, L: int, P: int, C: int, steps: int, everyone: list[dict], link: LinkModel | None) -> dict:
    """The group's record from every rank's measurements: per step the slowest rank's time, bytes and waits as the
    max over ranks; bytes as moved here and as the link charged them (``wire_*``: the cluster's element size)."""
    # The group advances at the pace of its slowest rank, step by step.
    step_times = [max(r["times"][i] for r in everyone) for i in range(steps)]
    step_s = statistics.median(step_times)
    by_name: dict[str, int] = {}
    for name in sorted({n for r in everyone for n in r["bytes"][-1]}):
        by_name[name] = max(r["bytes"][-1].get(name, 0) for r in everyone)
    per_rank_bytes = [sum(r["bytes"][-1].values()) for r in everyone]
    wire_by_name = {name: max(r["wire"][-1].get(name, 0) for r in everyone) for name in by_name}
    per_rank_wire = [sum(r["wire"][-1].values()) for r in everyone]
    # Exposed communication: time blocked in waits, max over ranks (median over steps), split at the loss.
    fwd = max(statistics.median(r["fwd_waits"]) for r in everyone)
    bwd = max(statistics.median([w - f for w, f in zip(r["waits"], r["fwd_waits"])]) for r in everyone)
    return dict(mode=args.mode, device=args.device, dtype=args.dtype, transport=args.transport,
                attention_backend=args.attention_backend, replan_every_step=bool(args.replan_every_step),
                schedule=args.schedule, P=P, C=C, L=L, layers=args.layers, cp_layout=args.cp_layout,
                window=args.window, full_every=args.full_every, steps=steps, comm_wait_fwd_s=fwd, comm_wait_bwd_s=bwd,
                step_s=step_s, step_times=step_times, step_spread=Spread(step_times).as_record(),
                tokens_per_s=L / step_s,
                step_s_per_rank=[statistics.median(r["times"]) for r in everyone],
                peak_mem_bytes=max(r["peak"] for r in everyone),
                peak_mem_per_rank=[r["peak"] for r in everyone],
                peak_rss_bytes=max(r["peak_abs"] for r in everyone),
                bytes_per_step=max(per_rank_bytes), bytes_per_rank=per_rank_bytes, bytes_by_name=by_name,
                wire_bytes_per_step=max(per_rank_wire), wire_bytes_by_name=wire_by_name,
                comm_wait_s=max(statistics.median(r["waits"]) for r in everyone),
                comm_wait_per_rank=[statistics.median(r["waits"]) for r in everyone],
                link=None if link is None else link.as_record())


# ----------------------------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------------------------
def configurations(modes, nprocs, transports=("allgather", "ring"), bp_schedules=("dual_end", "contiguous"),
                   single: bool = True) -> list[tuple[str, int, str, str]]:
    """The (mode, P, transport, schedule) runs at one length: the single process, then at each P every mode, cp and
    csbp with each transport, bp with each noisy-block schedule."""
    configs = [("single", 1, "allgather", "dual_end")] if single else []
    for P in nprocs:
        for m in modes:
            if m == "bp":
                configs += [(m, P, "allgather", s) for s in bp_schedules]
            elif m == PAPER_CP:  # blocking all-gathers only
                configs.append((m, P, "allgather", "dual_end"))
            else:
                configs += [(m, P, t, "dual_end") for t in transports]
    return configs


def launch_args(layers: int, steps: int, timeout: float, device: str = "cpu", dtype: str = "float32",
                attention_backend: str = "blockwise", window: int | None = None,
                min_time: float = 0.0, link: LinkModel | str | None = None,
                full_every: int | None = None) -> argparse.Namespace:
    """The arguments :func:`launch` reads, for callers other than this file's driver. ``link``: a named cluster link
    (:data:`hf_bdlm.planner.link.LINKS`; each launch's ranks measure the compute rate that scales it) or a
    :class:`~hf_bdlm.parallel.emulated_link.LinkModel` of fixed figures."""
    named = link if isinstance(link, str) else None
    fixed = None if isinstance(link, str) else link
    return argparse.Namespace(steps=steps, layers=layers, window=window, full_every=full_every, timeout=timeout,
                              device=device, dtype=dtype,
                              attention_backend=attention_backend, min_time=min_time, link=named,
                              link_bytes_per_s=fixed and fixed.bytes_per_s, link_latency_s=fixed and fixed.latency_s,
                              link_name=fixed and fixed.name, link_element_bytes=fixed and fixed.element_bytes,
                              link_record=fixed.as_record() if fixed is not None and fixed.details else None)


def _link(args) -> LinkModel | None:
    """The emulated link the ranks' collectives go through, or ``None``: a named link (``--link``) stretched by the
    compute rate the launch's ranks measure now, all at once (a collective call), or fixed figures
    (``--link-bytes-per-s``)."""
    if getattr(args, "link_file", None):
        return link_from_record(json.loads(pathlib.Path(args.link_file).read_text()))
    if getattr(args, "link", None):
        # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)
        from ..planner.link import link_for_this_machine

        model = spec_from_config(model_config(args.layers, args.window, full_every=args.full_every).to_dict())
        return link_for_this_machine(args.link, model, args.dtype)
    if not getattr(args, "link_bytes_per_s", None):
        return None
    # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)
    from ..parallel.emulated_link import LinkModel

    return LinkModel(args.link_bytes_per_s, args.link_latency_s or 0.0, args.link_name or "custom",
                     getattr(args, "link_element_bytes", None) or None)


def link_from_record(rec: dict) -> LinkModel:
    """The :class:`~hf_bdlm.parallel.emulated_link.LinkModel` a record's ``link`` holds
    (:meth:`LinkModel.as_record`), with how it was derived kept in its details."""
    # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)
    from ..parallel.emulated_link import LinkModel

    known = ("name", "bytes_per_s", "latency_s", "element_bytes")
    return LinkModel(rec["bytes_per_s"], rec["latency_s"], rec["name"], rec["element_bytes"],
                     {k: v for k, v in rec.items() if k not in known})


def measure_row_link(name: str, P: int, layers: int, tmp: pathlib.Path, timeout: float, window: int | None = None,
                     full_every: int | None = None, dtype: str = "float32") -> LinkModel:
    """The named link stretched by the compute rate ``P`` ranks measure together in a launch of their own (the rate
    :func:`_link` measures at the start of every launch): measured once, it is the link of every layout of a row, so
    the layouts compared in a row go through the same link."""
    tmp = pathlib.Path(tmp).resolve()
    out = tmp / f"link_{name}_P{P}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(P), "-m",
           module_name("parallel_modes"), "--measure-link", "--link", name, "--layers", str(layers),
           "--dtype", dtype, "--out", str(out)]
    if window:
        cmd += ["--window", str(window)]
    if full_every:
        cmd += ["--full-every", str(full_every)]
    proc = subprocess.run(cmd, env=child_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"), cwd=tmp,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode or not out.exists():
        raise RuntimeError(f"measuring the {name} link's rate at P = {P} failed:\n{(proc.stderr or proc.stdout)[-3000:]}")
    rec = json.loads(out.read_text())
    rec["measured"] = "once per row"
    return link_from_record(rec)


def _measure_link_worker(args) -> None:
    """``--measure-link``: one rank of the launch :func:`measure_row_link` starts; rank 0 writes the link."""
    import torch  # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    link = _link(args)
    if dist.get_rank() == 0:
        pathlib.Path(args.out).write_text(json.dumps(link.as_record()))
    dist.barrier()
    dist.destroy_process_group()


SHORT_LAUNCHES = 3


def launch(mode: str, P: int, L: int, args, tmp: pathlib.Path, transport: str = "allgather",
            schedule: str = "dual_end") -> dict:
    """One configuration's record (a launch that crashed runs once more, its error kept in ``retried_after_error``).
    With ``--min-time``, a configuration whose step is under half of it is launched
    :data:`SHORT_LAUNCHES` times and the launch with the median step time is kept (all launches' step times in
    ``launch_step_s``): short steps vary more from one fresh launch to the next (where the scheduler places the
    ranks) than within a launch."""
    rec = _launch_once(mode, P, L, args, tmp, transport, schedule)
    if "error" in rec and not rec["error"].startswith("timed out"):
        # A launch that crashed (e.g. gloo's connection teardown racing the exit, seen about once in a few hundred
        # launches) runs once more; the first failure stays in the record.
        first = rec["error"]
        rec = dict(_launch_once(mode, P, L, args, tmp, transport, schedule), retried_after_error=first[-1500:])
    if not args.min_time or "error" in rec or rec["step_s"] >= args.min_time / 2:
        return rec
    runs = [rec] + [_launch_once(mode, P, L, args, tmp, transport, schedule) for _ in range(SHORT_LAUNCHES - 1)]
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    runs.sort(key=lambda r: r["step_s"])
    return dict(runs[len(runs) // 2], launch_step_s=[r["step_s"] for r in runs])


def _launch_once(mode: str, P: int, L: int, args, tmp: pathlib.Path, transport: str = "allgather",
                 schedule: str = "dual_end") -> dict:
    tmp = pathlib.Path(tmp).resolve()  # the processes' working directory: the paths they get are absolute
    out = tmp / f"{mode}_{transport}_{schedule}_P{P}_L{L}.json"
    mode, cp_layout = split_mode(mode)
    common = ["--worker", "--mode", mode, "--cp-layout", cp_layout, "--transport", transport, "--schedule", schedule,
              "--lengths", str(L), "--steps", str(args.steps), "--min-time", str(args.min_time),
              "--layers", str(args.layers), "--out", str(out),
              "--device", args.device, "--dtype", args.dtype, "--attention-backend", args.attention_backend]
    if getattr(args, "replan_every_step", False):
        common += ["--replan-every-step"]
    if args.window:
        common += ["--window", str(args.window)]
    if getattr(args, "full_every", None):
        common += ["--full-every", str(args.full_every)]
    if getattr(args, "link_record", None) and mode != "single":
        link_file = tmp / f"link_{mode}_{cp_layout}_P{P}_L{L}.json"
        link_file.write_text(json.dumps(args.link_record))
        common += ["--link-file", str(link_file)]
    elif getattr(args, "link", None) and mode != "single":
        common += ["--link", args.link]
    elif getattr(args, "link_bytes_per_s", None) and mode != "single":
        common += ["--link-bytes-per-s", repr(args.link_bytes_per_s), "--link-latency-s",
                   repr(args.link_latency_s or 0.0), "--link-name", args.link_name or "custom"]
        if getattr(args, "link_element_bytes", None):
            common += ["--link-element-bytes", str(args.link_element_bytes)]
    if mode == "single":
        cmd = [*module_command("parallel_modes"), *common]
    else:
        # --standalone picks a free rendezvous port: other jobs on the machine cannot collide.
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(P), "-m",
               module_name("parallel_modes"), *common]
    env = child_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    base = dict(mode=mode, transport=None if mode == "single" else transport, schedule=schedule, P=P,
                C=1 if mode in ("bp", "single") else P, L=L, cp_layout=cp_layout)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return dict(base, error=f"timed out after {args.timeout}s")
    if proc.returncode or not out.exists():
        return dict(base, error=(proc.stderr or proc.stdout)[-3000:])
    rec = json.loads(out.read_text())
    rec["wall_s"] = time.perf_counter() - t0
    return rec


def split_mode(name: str) -> tuple[str, str]:
    """``(mode, cp_layout)`` of a driver mode name (``cp-paper`` is ``cp`` in the paper's layout)."""
    return ("cp", "paper") if name == PAPER_CP else (name, "balanced")


def mode_name(rec: dict) -> str:
    """A record's mode as the driver names it: ``cp-paper`` for cp in the paper's baseline layout."""
    return PAPER_CP if rec.get("cp_layout") == "paper" else rec["mode"]


def _fmt_bytes(n) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}MiB"


def table(records) -> str:
    head = (f"{'mode':8} {'transport':9} {'schedule':10} {'P':>2} {'C':>2} {'L':>6} {'step_s':>8} {'tok/s':>9} "
            f"{'peakMem':>11} {'bytes/step':>11} {'wait_s':>7} {'fwd':>6} {'bwd':>6}")
    lines = [head, "-" * len(head)]
    for r in records:
        name = f"{mode_name(r):8} {str(r['transport']):9} {str(r.get('schedule')):10} {r['P']:>2} {r['C']:>2} {r['L']:>6}"
        if "error" in r:
            lines.append(f"{name}  ERROR: {r['error'].strip().splitlines()[-1][:80]}")
            continue
        lines.append(f"{name} {r['step_s']:8.3f} {r['tokens_per_s']:9.1f} {_fmt_bytes(r['peak_mem_bytes']):>11} "
                     f"{_fmt_bytes(r['bytes_per_step']):>11} {r['comm_wait_s']:7.3f} {r.get('comm_wait_fwd_s', 0):6.3f} "
                     f"{r.get('comm_wait_bwd_s', 0):6.3f}")
    return "\n".join(lines)


def spread_of(rec: dict) -> Spread:
    """A record's timed steps (the slowest rank's time per step) as a :class:`~.spread.Spread`."""
    return Spread(rec.get("step_times") or [rec["step_s"]])


def _ratios(records, lengths, nprocs) -> list[str]:
    # Ratios compare the all-gather transport (the ring is reported in the table beside it) and, for bp, whichever
    # noisy-block schedule was faster at that length (both are in the table): the fairest bp baseline. Speed ratios
    # are of median step times, and a tie where the two ranges of timed steps overlap (spread.compare).
    ok: dict = {}
    for r in records:
        if "error" in r or r.get("transport") not in (None, "allgather"):
            continue
        key = (mode_name(r), r["P"], r["L"])
        if key not in ok or r["step_s"] < ok[key]["step_s"]:
            ok[key] = r

    def ratio(a, b, key):
        if a is None or b is None or not b.get(key):
            return "n/a"
        return f"{a[key] / b[key]:.2f}"

    def speed(baseline, candidate):
        return "n/a" if baseline is None or candidate is None else \
            compare(spread_of(baseline), spread_of(candidate)).describe()

    lines = []
    for L in lengths:
        single = ok.get(("single", 1, L))
        for P in nprocs:
            cs, cp, bp = ok.get(("csbp", P, L)), ok.get(("cp", P, L)), ok.get(("bp", P, L))
            paper = ok.get((PAPER_CP, P, L))
            parts = [f"L={L} P={P}:" + (f" (bp {bp['schedule']})" if bp else ""),
                     f"CSBP/CP bytes {ratio(cs, cp, 'bytes_per_step')} (expect 0.50)",
                     f"CSBP speed vs BP {speed(bp, cs)}",
                     f"vs CP {speed(cp, cs)}",
                     f"vs paper-CP {speed(paper, cs)}",
                     f"CSBP/CP mem {ratio(cs, cp, 'peak_mem_bytes')}",
                     f"CSBP/BP mem {ratio(cs, bp, 'peak_mem_bytes')}"]
            if single is not None and cs is not None:
                parts.append(f"CSBP scaling eff vs single {cs['tokens_per_s'] / (P * single['tokens_per_s']):.2f}")
            lines.append("  ".join(parts))
    return lines


def _link_names() -> list[str]:
    from ..planner.link import LINKS  # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)

    return list(LINKS)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="parallel_modes.json", help="JSON records (driver) / one record (worker)")
    parser.add_argument("--quick", action="store_true", help=f"L=2048, P=2, {MIN_TIMED_STEPS} steps (< 3 min)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--nprocs", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--modes", nargs="+", default=["cp", "bp", "csbp"], choices=["cp", "bp", "csbp", PAPER_CP],
                        help=f"{PAPER_CP}: cp in the paper's baseline layout (blocking, contiguous clean shards)")
    parser.add_argument("--steps", type=int, default=MIN_TIMED_STEPS,
                        help=f"timed steps after one warm-up (at least {MIN_TIMED_STEPS}: every figure carries its "
                             "range)")
    parser.add_argument("--min-time", type=float, default=0.0,
                        help=f"time more steps when they are short: enough to fill this many seconds (at most "
                             f"{MAX_TIMED_STEPS}), judged by the warm-up step; a configuration whose step is under "
                             f"half of it runs {SHORT_LAUNCHES} fresh launches, the median one kept")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--no-single", action="store_true", help="skip the single-process baseline")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per configuration")
    parser.add_argument("--transports", nargs="+", default=["allgather", "ring"], choices=["allgather", "ring"])
    parser.add_argument("--bp-schedules", nargs="+", default=["dual_end", "contiguous"],
                        choices=["dual_end", "contiguous"], help="noisy-block schedules bp runs with (the faster one "
                        "is bp in the ratios)")
    parser.add_argument("--window", type=int, default=None,
                        help="make every layer a sliding-window layer of this width (Qwen3 backbone, same sizes)")
    parser.add_argument("--full-every", type=int, default=None,
                        help="with --window: every K-th layer is full attention (Gemma 3: 6, i.e. 5 sliding : 1 full)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: one GPU per rank, NCCL, peaks from the CUDA allocator")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="bfloat16: the step under bf16 autocast over float32 weights")
    parser.add_argument("--attention-backend", default="blockwise", choices=["auto", "blockwise", "flex", "dense"])
    parser.add_argument("--replan-every-step", action="store_true",
                        help="build the layout (and its plans) anew every step, as the trainer did before it kept "
                             "layouts across steps: the before of the plan cache")
    parser.add_argument("--link", default=None, choices=_link_names(), metavar="NAME",
                        help="emulated cluster link (h100-nvlink, h100-ib, h200-nvlink, h200-ib): every K/V transfer "
                             "is charged at the cluster's bf16 element size and takes latency + bytes / bandwidth of "
                             "the named link stretched by the compute rate the launch's ranks measure at its start, "
                             "all at once (docs/benchmarks.md)")
    parser.add_argument("--link-bytes-per-s", type=float, default=None,
                        help="emulated link of fixed figures: every collective of a rank takes at least latency + "
                             "bytes / this (hf_bdlm.parallel.emulated_link)")
    parser.add_argument("--link-latency-s", type=float, default=0.0, help="emulated link: latency per transfer")
    parser.add_argument("--link-name", default=None, help="emulated link: its name in the records")
    parser.add_argument("--link-element-bytes", type=int, default=None,
                        help="emulated link of fixed figures: bytes it charges per element (2: a bf16 cluster); "
                             "default: the bytes moved here")
    parser.add_argument("--link-file", default=None, help=argparse.SUPPRESS)  # a link record (measure_row_link)
    parser.add_argument("--measure-link", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--transport", default="allgather", help=argparse.SUPPRESS)
    parser.add_argument("--schedule", default="dual_end", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="csbp", help=argparse.SUPPRESS)
    parser.add_argument("--cp-layout", default="balanced", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure_link:
        _measure_link_worker(args)
        return
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.lengths, args.nprocs, args.steps = [2048], [2], MIN_TIMED_STEPS
    try:
        check_timed_steps(args.steps)
    except ValueError as err:
        parser.error(str(err))
    if args.link and args.link_bytes_per_s:
        parser.error("--link NAME and --link-bytes-per-s: give a named link or fixed figures, not both.")
    if args.link and args.device == "cuda":
        parser.error("--link NAME stretches this machine's CPU compute to a cluster's; on GPUs the real links run. "
                     "Drop --link, or give fixed figures with --link-bytes-per-s.")
    if args.device == "cuda":
        import torch  # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)

        gpus = torch.cuda.device_count()
        if not gpus:
            parser.error("--device cuda: no GPU is visible; run on a GPU machine or use --device cpu.")
        if max(args.nprocs) > gpus:
            parser.error(f"--device cuda runs one rank per GPU: --nprocs {max(args.nprocs)} needs "
                         f"{max(args.nprocs)} GPUs, {gpus} visible; pass --nprocs values up to {gpus}.")
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for L in args.lengths:
            configs = configurations(args.modes, args.nprocs, args.transports, args.bp_schedules, not args.no_single)
            for mode, P, transport, schedule in configs:
                rec = launch(mode, P, L, args, pathlib.Path(tmp), transport, schedule)
                records.append(rec)
                print(table([rec]).splitlines()[-1], flush=True)
                # Write as we go: a long run interrupted still leaves its measurements.
                pathlib.Path(args.out).write_text(json.dumps(records, indent=1))
    print()
    print(table(records))
    print()
    for line in _ratios(records, args.lengths, args.nprocs):
        print(line)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
