"""The schedule of one step's segment across a group's ranks: compute, messages and waits, on shared or own processors.

A rank's *program* is a list of operations (:class:`Compute`, :class:`Send`, :class:`Wait`) in the order its code
issues them; :func:`simulate` runs the programs of all ranks together and returns when each finishes, how long it
computed and how long it sat blocked. Two things a per-rank sum cannot see come out of it:

- **Dependencies between ranks.** A wait on a peer's message ends when that peer has reached its send (its own
  compute before it included) and the message has travelled. The ring transport's backward chains every rank to
  its predecessor rotation by rotation, so per-rotation imbalance adds up where per-rank totals are balanced.
- **Processors shared by more ranks than they have** (a CPU: ``cores`` cores, ``P > cores`` single-threaded ranks).
  Runnable ranks share the cores equally (processor sharing); a rank blocked in a wait frees its share. With
  ``n > cores`` runnable ranks each runs at ``efficiency · cores / n`` of its own-core speed, ``efficiency``
  being the measured throughput lost to contention (caches, memory bandwidth, switching). On GPUs every rank
  has its own device (``cores=0``).

Compute is in seconds at the rank's own-processor rate; a message is available ``delay`` seconds after it is
posted (transfer plus latency; the transfer is assumed to need no processor time). Each wait also costs
``wait_cost`` once its messages are there: what one synchronization point costs ranks beyond the messages (on a
CPU whose cores the ranks share, the scheduler's time slices, measured).

    python -c "from hf_bdlm.planner.schedule import *; \\
print(simulate([[Compute(1.0)], [Compute(3.0)], [Compute(1.0)], [Compute(3.0)]], cores=2))"
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence


@dataclass(frozen=True)
class Compute:
    """``seconds`` of work at the rank's own-processor rate."""

    seconds: float


@dataclass(frozen=True)
class Send:
    """Post message ``key``; it is available to its waiters ``delay`` seconds later. Never blocks."""

    key: Hashable
    delay: float


@dataclass(frozen=True)
class Wait:
    """Block until every message of ``keys`` is available."""

    keys: tuple


@dataclass(frozen=True)
class RankSchedule:
    finish: float  # when the rank's last operation ends
    busy: float  # wall time it spent computing (longer than its work when it shared a processor)
    waited: float  # wall time it spent blocked in waits


def _speed(runnable: int, cores: int, efficiency: float) -> float:
    if cores <= 0 or runnable <= cores:
        return 1.0
    return efficiency * cores / runnable


def simulate(programs: Sequence[Sequence], cores: int = 0, efficiency: float = 1.0,
             wait_cost: float = 0.0) -> list[RankSchedule]:
    """Run the ranks' ``programs`` from time 0 (all ranks start together) and return each rank's schedule.

    ``cores``: processors the ranks share (0: one per rank). Raises ``ValueError`` when a rank waits on a message
    nobody will send (a malformed program).
    """
    R = len(programs)
    pc = [0] * R
    left: list[float | None] = [None] * R  # work left in the current Compute
    resume: list[float | None] = [None] * R  # when the current Wait ends, once its messages are there
    available: dict = {}  # message key -> time it becomes available
    busy, waited, finish = [0.0] * R, [0.0] * R, [None] * R
    t = 0.0
    while True:
        # Issue sends and satisfied waits at time t, until every rank sits in a Compute, a blocked Wait or its end.
        blocked = []
        for r in range(R):
            prog = programs[r]
            while pc[r] < len(prog):
                op = prog[pc[r]]
                if isinstance(op, Compute):
                    if left[r] is None:
                        left[r] = op.seconds
                    if left[r] > 1e-12:
                        break
                    left[r] = None
                elif isinstance(op, Send):
                    if op.key in available:
                        raise ValueError(f"message {op.key!r} is sent twice")
                    available[op.key] = t + op.delay
                else:
                    if resume[r] is None and all(k in available and available[k] <= t for k in op.keys):
                        resume[r] = t + wait_cost
                    if resume[r] is None or resume[r] > t + 1e-12:
                        blocked.append(r)
                        break
                    resume[r] = None
                pc[r] += 1
            if pc[r] == len(prog) and finish[r] is None:
                finish[r] = t
        running = [r for r in range(R) if pc[r] < len(programs[r]) and isinstance(programs[r][pc[r]], Compute)]
        if not running and not blocked:
            return [RankSchedule(finish[r], busy[r], waited[r]) for r in range(R)]
        speed = _speed(len(running), cores, efficiency)
        steps = [left[r] / speed for r in running]
        # A blocked rank resumes when the last of its messages arrives; one whose sender has not posted yet waits on.
        for r in blocked:
            keys = programs[r][pc[r]].keys
            if resume[r] is not None:
                steps.append(resume[r] - t)
            elif all(k in available for k in keys):
                steps.append(max(available[k] for k in keys) - t)
        if not steps:
            missing = {r: [k for k in programs[r][pc[r]].keys if k not in available] for r in blocked}
            raise ValueError(f"deadlock: ranks wait on messages nobody sends: {missing}")
        dt = max(0.0, min(steps))
        for r in running:
            left[r] -= dt * speed
            busy[r] += dt
        for r in blocked:
            waited[r] += dt
        t += dt


__all__ = ["Compute", "Send", "Wait", "RankSchedule", "simulate"]
