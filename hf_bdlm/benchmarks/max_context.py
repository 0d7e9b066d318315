"""Longest trainable context under a per-rank memory cap, found by real training steps (``hf-bdlm bench``).

A probe of length ``L`` is one fresh :mod:`.parallel_modes` run (a warm-up step and one timed step,
forward + backward) whose peak memory per rank is the step's RSS high-water mark above the RSS once model and batch
are built, max over ranks (the worker's ``peak_mem_bytes``; Python, torch and the model itself are not counted).
``L`` fits when that peak is at most the cap. The search works on a grid of lengths (multiples of ``2 * P * B``, which
every layout accepts) and returns the exact boundary on it: the longest ``L`` that fits, with ``L + grid`` measured
not to fit. Memory grows about linearly in ``L``, so the next probe is where the line through the two nearest
measurements meets the cap (clamped inside the bracket, one grid step at least); a step that does not halve the
bracket is followed by a bisection, so the number of probes stays logarithmic whatever the memory curve.

    hf-bdlm bench --only max-context --mem-cap 128MiB --max-context-nprocs 2 --max-context-modes csbp --out /tmp/mc
"""

from __future__ import annotations

import pathlib
import tempfile
from dataclasses import dataclass, field
from typing import Callable

from . import parallel_modes, report

MiB = 2**20


@dataclass
class Search:
    """Outcome of :func:`search_max_context`: ``longest`` fits, ``first_over`` (``longest + grid``) does not, or is
    ``None`` when the search reached ``limit`` with every probe fitting. ``probes``: ``(L, peak bytes)`` in order."""

    longest: int
    first_over: int | None
    probes: list[tuple[int, int]] = field(default_factory=list)

    def peak(self, length: int) -> int:
        return dict(self.probes)[length]


def _floor(x: float, grid: int) -> int:
    return int(x // grid) * grid


def _estimate(points: dict[int, int], lo: int, hi: int | None, cap: int) -> float | None:
    """Where memory meets the cap on the line through the two measured points nearest the bracket."""
    if hi is not None:
        (x1, y1), (x2, y2) = (lo, points[lo]), (hi, points[hi])
    else:
        below = [x for x in points if x < lo]
        (x1, y1) = (max(below), points[max(below)]) if below else (0, 0)
        (x2, y2) = (lo, points[lo])
    if y2 <= y1:
        return None
    return x2 + (cap - y2) * (x2 - x1) / (y2 - y1)


def search_max_context(probe: Callable[[int], int], cap: int, grid: int, start: int, limit: int,
                       max_growth: float = 4.0) -> Search:
    """The longest ``L`` on the grid (multiples of ``grid`` from ``start`` to ``limit``) with ``probe(L) <= cap``.

    Args:
        probe: ``L`` -> peak bytes per rank of one real step (raises when the run fails).
        cap: bytes per rank.
        grid: the length step; ``start`` and ``limit`` must be multiples of it.
        start: the first (smallest) length probed. Raises ``ValueError`` when even it does not fit.
        limit: the longest length probed; the result then has ``first_over=None``.
        max_growth: before any probe fails, the next length is at most this many times the last fitting one (a bad
            extrapolation must not launch one huge, slow probe).

    Memory must not decrease with ``L`` for the boundary to be unique; measured curves that wobble give a boundary
    where ``longest`` fits and ``longest + grid`` does not.
    """
    if grid <= 0 or start <= 0 or start % grid or limit % grid:
        raise ValueError(f"start={start} and limit={limit} must be positive multiples of grid={grid}")
    if limit < start:
        raise ValueError(f"limit={limit} is below start={start}: raise the limit (--max-context-limit)")
    points: dict[int, int] = {}
    result = Search(longest=start, first_over=None)

    def fits(length: int) -> bool:
        points[length] = int(probe(length))
        result.probes.append((length, points[length]))
        return points[length] <= cap

    if not fits(start):
        raise ValueError(
            f"even the shortest length probed, L={start}, needs {points[start] / MiB:.1f} MiB per rank, above the "
            f"cap of {cap / MiB:.1f} MiB: raise --mem-cap or use a smaller model (--max-context-layers)")
    lo, hi, bisect_next = start, None, False
    while not (hi is not None and hi - lo <= grid) and not (hi is None and lo >= limit):
        top = hi - grid if hi is not None else min(limit, max(lo + grid, _floor(lo * max_growth, grid)))
        if bisect_next and hi is not None:
            length = _floor((lo + hi) // 2, grid)
        else:
            guess = _estimate(points, lo, hi, cap)
            length = 2 * lo if guess is None else _floor(guess, grid)
        length = min(top, max(lo + grid, length))
        width = (hi - lo) if hi is not None else None
        if fits(length):
            lo = length
        else:
            hi = length
        # A step that left more than half of the bracket (regula falsi stalling on a curved memory) bisects next.
        bisect_next = width is not None and (hi - lo) * 2 > width
    result.longest, result.first_over = lo, hi
    return result


# ----------------------------------------------------------------------------------------------
# the real probe: one fresh parallel_modes run
# ----------------------------------------------------------------------------------------------
def configurations(nprocs, modes=("csbp", "cp", "bp")) -> list[tuple[str, int, str, str]]:
    """(mode, P, transport, schedule) searched: the single process, then each mode at each P (cp and csbp with the
    all-gather transport, bp with the dual_end schedule)."""
    return parallel_modes.configurations(modes, nprocs, ("allgather",), ("dual_end",))


def grid(nprocs) -> int:
    """The lengths searched are multiples of this: every P must split the blocks evenly (dual-end pairs)."""
    return 2 * max([1, *nprocs]) * parallel_modes.BLOCK


def run_study(nprocs, modes, cap: int, layers: int, limit: int, timeout: float, log=print) -> dict:
    """Search every configuration; returns the ``max_context.json`` payload."""
    step = grid(nprocs)
    limit = _floor(limit, step)
    args = parallel_modes.launch_args(layers, steps=1, timeout=timeout)
    results, records = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for mode, P, transport, schedule in configurations(nprocs, modes):
            name = report.variant(dict(mode=mode, transport=transport, schedule=schedule))

            def probe(length: int) -> int:
                rec = parallel_modes.launch(mode, P, length, args, pathlib.Path(tmp), transport, schedule)
                records.append(rec)
                if "error" in rec:
                    raise RuntimeError(f"{name} P={P} L={length} failed: {rec['error'].strip()[-600:]}")
                fit = "fits" if rec["peak_mem_bytes"] <= cap else "over"
                log(f"  max-context {name:15} P={P} L={length:>6}: peak {rec['peak_mem_bytes'] / MiB:7.1f} MiB/rank "
                    f"({fit} {cap / MiB:.0f} MiB), step {rec['step_s']:.2f} s, run {rec.get('wall_s', 0):.0f} s")
                return rec["peak_mem_bytes"]

            entry = dict(variant=name, mode=mode, P=P, transport=None if mode == "single" else transport,
                         schedule=None if mode == "single" else schedule)
            try:
                found = search_max_context(probe, cap, step, start=step, limit=limit)
            except (ValueError, RuntimeError) as err:
                entry["error"] = str(err)
                log(f"  max-context {name} P={P}: {err}")
            else:
                entry.update(longest=found.longest, first_over=found.first_over, probes=found.probes,
                             peak_at_longest=found.peak(found.longest))
            results.append(entry)
    return dict(cap_bytes=cap, grid=step, layers=layers, limit=limit, block_size=parallel_modes.BLOCK,
                memory="peak RSS of a training step above the RSS once model and batch are built, max over ranks",
                results=results, records=records)
