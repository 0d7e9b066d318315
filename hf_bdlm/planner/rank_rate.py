"""The matmul rate a rank of this run gets, measured in the run's own processes, all computing at once.

An emulated cluster link (:mod:`.link`) is stretched by ``F_gpu / F_cpu``; ``F_cpu`` must be what each rank of the run
that uses the link computes at. With more single-threaded ranks than cores (P = 4 on 2 cores) every rank gets a share
of a core, and a rate measured by one process alone would leave the link twice too fast. So every rank of the
launch times the same matmuls at the same time, under the launch's own processes per core, threads and dtype, and
the rate is the slowest rank's (the group runs at its pace).

Each rank warms up (which also times one run), then every rank runs the same number of forward and backward
passes of ``F.linear`` at the model's projection shapes (``rows`` rows), enough for about ``window_s`` seconds, all
starting after one barrier. The rate is the FLOPs of those runs over the time the slowest rank took: the pace of a
group that meets at a collective after equal work. On shared cores that is the group's throughput per rank (a rank
the scheduler left behind gets the cores the finished ones free); the slowest rank's median run, the rule this
replaced, once put the rate 1.8x below the pace the same four ranks then kept over equal work on two cores, and a
link stretched by it is that much too slow. Nothing is cached: a rate belongs to the machine's state when it was
measured, and the records carry it (:meth:`RankRate.as_record`).

    python -c "from hf_bdlm.benchmarks.calibrate import benchmark_model as m; from hf_bdlm.planner.rank_rate import \
measure_rank_rate as r; print(r(m(2)).describe())"
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .model import ModelSpec

DEFAULT_WINDOW_S = 3.0
DEFAULT_ROWS = 1024


def matmul_workload(model: ModelSpec, rows: int, dtype=None) -> tuple[Callable[[], None], float]:
    """``(run, flops)``: forward and backward of ``F.linear`` at ``model``'s projection shapes (Q, K+V, O, the gated
    MLP's up and down) on ``rows`` rows of ``dtype`` (default float32), and the FLOPs one ``run()`` does."""
    dtype = dtype or torch.float32
    a = model.layers[0]
    intermediate = model.intermediate or model.moe_intermediate or 4 * model.hidden
    shapes = [(model.hidden, a.heads * a.head_dim), (model.hidden, 2 * a.kv_heads * a.head_dim),
              (a.heads * a.head_dim, model.hidden), (model.hidden, 2 * intermediate), (intermediate, model.hidden)]
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(rows, i, generator=g).to(dtype).requires_grad_() for i, _ in shapes]
    ws = [torch.randn(o, i, generator=g).to(dtype).requires_grad_() for i, o in shapes]

    def run():
        for x, w in zip(xs, ws):
            F.linear(x, w).sum().backward()

    return run, float(sum(2 * rows * i * o * 3 for i, o in shapes))


@dataclass(frozen=True)
class RankRate:
    """A matmul rate measured in the ranks of a run (see the module docstring).

    Parameters:
        flops_per_s (`float`): the slowest rank's rate: what the link is scaled by.
        per_rank (`tuple[float, ...]`): every rank's rate.
        dtype (`str`): the dtype the matmuls ran in (the run's compute dtype).
        processes (`int`): processes computing at once on this machine (the launch's local world size).
        cores (`int`): cores they may run on (their affinity).
        threads (`int`): torch threads per process.
        window_s (`float`): seconds the runs were sized to last.
        runs (`int`): timed runs, the same on every rank.
        rows (`int`): rows of each matmul.
        measured_at (`str`): local time of the measurement.
    """

    flops_per_s: float
    per_rank: tuple[float, ...]
    dtype: str
    processes: int
    cores: int
    threads: int
    window_s: float
    runs: int
    rows: int
    measured_at: str

    @property
    def processes_per_core(self) -> float:
        return self.processes * self.threads / self.cores

    def describe(self) -> str:
        return (f"{self.flops_per_s / 1e9:.1f} GFLOP/s per rank ({self.dtype} matmuls; {self.processes} process(es) "
                f"x {self.threads} thread(s) on {self.cores} core(s), measured together for {self.window_s:g} s)")

    def as_record(self) -> dict:
        return dict(asdict(self), per_rank=list(self.per_rank), processes_per_core=self.processes_per_core,
                    method="F.linear forward + backward at the model's projection shapes, the same runs on every "
                           "rank of the launch after a barrier; their FLOPs over the slowest rank's time")


def cores() -> int:
    """The cores this process may run on (its affinity, not the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def measure_rank_rate(model: ModelSpec, dtype: str = "float32", window_s: float = DEFAULT_WINDOW_S,
                      rows: int = DEFAULT_ROWS, together: bool = True) -> RankRate:
    """The matmul rate every rank of this launch gets while all compute (a collective call: every rank of the default
    process group, when there is one, must call it). ``model``: whose projection shapes are timed (the run's model).
    ``together=False``: this process alone, no collective (what a rank gets while the others wait)."""
    if not window_s > 0:
        raise ValueError(f"window_s must be positive seconds, got {window_s!r}.")
    run, flops = matmul_workload(model, rows, getattr(torch, dtype))
    run()  # warm-up: allocations, the kernels' first calls
    t0 = time.perf_counter()
    run()
    runs = max(2, math.ceil(window_s / (time.perf_counter() - t0)))
    grouped = together and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if grouped:  # every rank does the same work: the most runs any rank asks for
        asked = [None] * dist.get_world_size()
        dist.all_gather_object(asked, runs)
        runs = max(asked)
        dist.barrier()
    t0 = time.perf_counter()
    for _ in range(runs):
        run()
    mine = runs * flops / (time.perf_counter() - t0)
    everyone = [mine]
    if grouped:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    world = len(everyone)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if grouped else 1
    return RankRate(flops_per_s=min(everyone), per_rank=tuple(everyone), dtype=dtype, processes=local,
                    cores=cores(), threads=torch.get_num_threads(), window_s=window_s, runs=runs, rows=rows,
                    measured_at=time.strftime("%Y-%m-%d %H:%M:%S"))


__all__ = ["DEFAULT_WINDOW_S", "RankRate", "cores", "matmul_workload", "measure_rank_rate"]
