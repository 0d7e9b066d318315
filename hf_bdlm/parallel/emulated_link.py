"""An emulated link: collectives that take as long as a modelled network would, with real waiting.

On one machine every collective is a memory copy between processes, much faster (relative to compute) than the
NVLink or InfiniBand links of a GPU cluster. A :class:`LinkModel` attached to a rank's communicators
(``BlockParallelGroups.build(..., link=...)``) makes each transfer complete no earlier than

    ready = start' + B / bandwidth + latency,      start' = max(start, the end of the previous transfer's bytes)

after it starts, where ``B`` is the bytes the cluster would move for what this rank receives, and transfers of one
rank share its link in the order they start (the K and V gathers of a layer follow each other). ``B`` counts the
elements received at the cluster's element size (``element_bytes``: 2 for a bf16 cluster) however wide they are here
(a CPU run moves float32 K/V): a float32 transfer through a bf16 link is charged half its local bytes
(:meth:`LinkModel.wire_bytes`). The real collective runs as before; ``InFlight.wait()`` then sleeps until ``ready``.
Overlap stays real: a rank that computes on its own rows while the transfer is in flight waits only for what is left,
and the time it waits is counted in the communicator's ``wait_seconds`` (the exposed communication).

Named links scaled to this machine are built by :func:`hf_bdlm.planner.link.emulated_link`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class LinkModel:
    """One rank's emulated link (see the module docstring).

    Parameters:
        bytes_per_s (`float`): bandwidth of the rank's receive side, in the bytes the link charges (``wire_bytes``).
        latency_s (`float`, defaults to 0): fixed time each transfer takes besides its bytes.
        name (`str`): for tables and records.
        element_bytes (`int`, *optional*): bytes per element on the link (the cluster's training dtype: 2 for bf16);
            ``None`` charges the bytes moved here as they are.
        details (`dict`): how the link was derived (a named link, the rates that scaled it); written into records.
    """

    bytes_per_s: float
    latency_s: float = 0.0
    name: str = "custom"
    element_bytes: int | None = None
    details: dict = field(default_factory=dict)
    _free_at: float = field(default=0.0, init=False, repr=False)

    def __post_init__(self):
        if not self.bytes_per_s > 0:
            raise ValueError(f"an emulated link needs bytes_per_s > 0, got {self.bytes_per_s!r}.")
        if not self.latency_s >= 0:
            raise ValueError(f"an emulated link needs latency_s >= 0, got {self.latency_s!r}.")
        if self.element_bytes is not None and self.element_bytes not in (1, 2, 4, 8):
            raise ValueError(f"element_bytes is the size of one element on the link (1, 2, 4 or 8; 2 for bf16), got "
                             f"{self.element_bytes!r}.")

    def wire_bytes(self, nbytes: int, element_size: int) -> int:
        """What the link charges for ``nbytes`` moved here in elements of ``element_size`` bytes: the same elements
        at :attr:`element_bytes` each (``nbytes`` itself when the link has no element size of its own)."""
        if self.element_bytes is None:
            return int(nbytes)
        if nbytes % element_size:
            raise ValueError(f"{nbytes} bytes are not whole elements of {element_size} bytes.")
        return nbytes // element_size * self.element_bytes

    def schedule(self, nbytes: int, now: float | None = None) -> float:
        """A transfer the link charges ``nbytes`` for starts now (``time.perf_counter()``): the time it may
        complete at."""
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
        per = "" if self.element_bytes is None else f" of {self.element_bytes}-byte elements"
        return f"{self.name}: {self.bytes_per_s / 1e6:.3f} MB/s{per}, latency {self.latency_s * 1e3:.3f} ms"

    def as_record(self) -> dict:
        """The link as benchmark records hold it."""
        return dict(name=self.name, bytes_per_s=self.bytes_per_s, latency_s=self.latency_s,
                    element_bytes=self.element_bytes, **self.details)


__all__ = ["LinkModel"]
