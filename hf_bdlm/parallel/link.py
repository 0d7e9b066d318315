"""An emulated link: collectives that take as long as a modelled network would, with real waiting.

On one machine every collective is a memory copy between processes, much faster (relative to compute) than the
NVLink or InfiniBand links of a GPU cluster. A :class:`LinkModel` attached to a rank's communicators
(``BlockParallelGroups.build(..., link=...)``) makes each transfer complete no earlier than

    ready = start' + B / bandwidth + latency,      start' = max(start, the end of the previous transfer's bytes)

after it starts, where ``B`` is the bytes this rank receives (what the byte meter records) and transfers of one
rank share its link in the order they start (the K and V gathers of a layer follow each other). The real
collective runs as before; ``InFlight.wait()`` then sleeps until ``ready``. Overlap stays real: a rank that
computes on its own rows while the transfer is in flight waits only for what is left, and the time it waits is
counted in the communicator's ``wait_seconds`` (the exposed communication).

Named links scaled to this machine are built by :func:`hf_bdlm.planner.link.emulated_link`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class LinkModel:
    """One rank's emulated link (see the module docstring).

    Parameters:
        bytes_per_s (`float`): bandwidth of the rank's receive side.
        latency_s (`float`, defaults to 0): fixed time each transfer takes besides its bytes.
        name (`str`): for tables and records.
    """

    bytes_per_s: float
    latency_s: float = 0.0
    name: str = "custom"
    _free_at: float = field(default=0.0, init=False, repr=False)

    def __post_init__(self):
        if not self.bytes_per_s > 0:
            raise ValueError(f"an emulated link needs bytes_per_s > 0, got {self.bytes_per_s!r}.")
        if not self.latency_s >= 0:
            raise ValueError(f"an emulated link needs latency_s >= 0, got {self.latency_s!r}.")

    def schedule(self, nbytes: int, now: float | None = None) -> float:
        """A transfer of ``nbytes`` starts now (``time.perf_counter()``): the time it may complete at."""
        now = time.perf_counter() if now is None else now
        start = max(now, self._free_at)
        self._free_at = start + nbytes / self.bytes_per_s
        return self._free_at + self.latency_s

    @staticmethod
    def hold(ready_at: float) -> float:
        """Sleep until ``ready_at``; returns the seconds slept."""
        left = ready_at - time.perf_counter()
        if left > 0:
            time.sleep(left)
            return left
        return 0.0

    def describe(self) -> str:
        return f"{self.name}: {self.bytes_per_s / 1e6:.1f} MB/s, latency {self.latency_s * 1e3:.3f} ms"


__all__ = ["LinkModel"]
