"""Which ranks are gone: a heartbeat per rank in the launcher's store, read when a collective fails.

A collective whose peer died fails without saying which peer: gloo reports a closed connection ("Connection reset by
peer [10.0.0.2]:41235"), NCCL waits for the process-group timeout. On one node the launcher names the dead rank
(torchrun's and ``accelerate launch``'s agent sees its worker die and stops the others); across nodes, the ranks of
the other nodes are on their own. So every rank of a block-parallel run beats: a background thread adds 1 to the
rank's counter ``hf_bdlm/heartbeat/<rank>`` in the launcher's key-value store (the TCPStore at ``MASTER_ADDR``:
``MASTER_PORT`` that torchrun's agent hosts) every :data:`BEAT_S` seconds. When a step fails on a distributed error,
:meth:`Heartbeat.lost_ranks` reads every counter twice, :data:`LOOK_S` apart: a rank whose counter did not move has
stopped (its process died, or is frozen), and the error says so by rank number.

    torchrun --nproc_per_node 2 -m hf_bdlm.parallel.liveness     # each rank beats; prints the ranks it sees alive
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from datetime import timedelta

import torch.distributed as dist

logger = logging.getLogger(__name__)

BEAT_S = 1.0  # one store write per rank and second
LOOK_S = 3.0  # three beats: a live rank's counter moves even if one beat is late
_PREFIX = "hf_bdlm/heartbeat/"
_CONNECT = timedelta(seconds=10)


def _store(host: str, port: int) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=False, timeout=_CONNECT, wait_for_workers=False)


class Heartbeat:
    """This process's heartbeat (rank ``rank`` of ``world``) in the store at ``host:port``; a daemon thread beats
    until :meth:`stop` or the end of the process. A store that cannot be reached stops the beating silently: the
    heartbeat is a diagnosis, never a cause of failure."""

    def __init__(self, rank: int, world: int, host: str, port: int):
        self.rank, self.world, self.host, self.port = rank, world, host, port
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="hf-bdlm-heartbeat", daemon=True)
        self._thread.start()
        # At exit the thread ends and drops its store client before the interpreter finalizes, rather than being
        # frozen inside a store call during teardown (a C++ client torn down then may abort a finished process).
        atexit.register(self.stop, join_s=2 * BEAT_S)

    @classmethod
    def from_env(cls, rank: int, world: int) -> "Heartbeat | None":
        """The heartbeat of a process started by torchrun / ``accelerate launch`` (``MASTER_ADDR``, ``MASTER_PORT``);
        ``None`` without them (another init method: no store to beat in)."""
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not host or not port or not port.isdigit():
            return None
        return cls(rank, world, host, int(port))

    def _beat(self) -> None:
        store = None
        try:
            store = _store(self.host, self.port)
            while not self._stop.is_set():
                store.add(f"{_PREFIX}{self.rank}", 1)
                self._stop.wait(BEAT_S)
        except Exception as err:  # noqa: BLE001 - the store is gone (its host ended): nothing to beat in
            logger.debug("heartbeat of rank %d stopped: %s", self.rank, err)
        finally:
            del store  # the client is closed here, in this thread, not at interpreter teardown

    def stop(self, join_s: float | None = None) -> None:
        """Stop beating; with ``join_s``, wait up to that long for the thread to end (it does within a store call)."""
        self._stop.set()
        if join_s is not None and self._thread is not threading.current_thread():
            self._thread.join(join_s)

    @property
    def beating(self) -> bool:
        return self._thread.is_alive()

    def counters(self, ranks: list[int]) -> list[int]:
        store = _store(self.host, self.port)
        # add(key, 0) reads a counter without waiting for it to exist (a rank that never beat reads 0).
        return [store.add(f"{_PREFIX}{r}", 0) for r in ranks]

    def lost_ranks(self, ranks: list[int] | None = None, look_s: float = LOOK_S) -> list[int] | None:
        """The ranks among ``ranks`` (default: all others) whose heartbeat did not advance in ``look_s`` seconds;
        ``None`` when the store cannot be reached (the launcher that hosts it is gone)."""
        ranks = [r for r in (ranks if ranks is not None else range(self.world)) if r != self.rank]
        try:
            before = self.counters(ranks)
            time.sleep(look_s)
            after = self.counters(ranks)
        except Exception:  # noqa: BLE001
            return None
        return [r for r, a, b in zip(ranks, before, after) if b == a]

    def diagnosis(self, look_s: float = LOOK_S) -> str:
        """One sentence on the world's ranks, for an error message."""
        lost = self.lost_ranks(look_s=look_s)
        if lost is None:
            return (f"the rendezvous store at {self.host}:{self.port} cannot be reached: what hosts it (torchrun's or "
                    "accelerate's agent on the first node; rank 0 without them) is gone, with its ranks.")
        if lost:
            names = ", ".join(str(r) for r in lost)
            return (f"rank{'s' if len(lost) > 1 else ''} {names} stopped (no heartbeat for {look_s:.0f} s): "
                    "the process died (out-of-memory kill, lost node, preemption) or is frozen.")
        return ("every other rank is alive (heartbeats advancing): a rank is stuck in another collective or runs a "
                "different layout; see the other ranks' logs.")


_HEARTBEAT: Heartbeat | None = None


def start_heartbeat() -> Heartbeat | None:
    """This process's heartbeat in the default process group's world, started once (later calls return it)."""
    global _HEARTBEAT
    if _HEARTBEAT is None and dist.is_initialized() and dist.get_world_size() > 1:
        _HEARTBEAT = Heartbeat.from_env(dist.get_rank(), dist.get_world_size())
    return _HEARTBEAT


def is_distributed_failure(err: BaseException) -> bool:
    """Whether ``err`` is a failed or timed-out collective (a peer lost, hung or disagreeing), not a local error."""
    if isinstance(err, dist.DistError):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and any(
        mark in text for mark in ("gloo", "NCCL", "Connection reset", "Connection closed", "timed out after"))


def _demo() -> None:  # pragma: no cover - a manual check under torchrun
    dist.init_process_group("gloo")
    beat = start_heartbeat()
    time.sleep(2)
    print(f"rank {dist.get_rank()}: lost {beat.lost_ranks(look_s=2.0) if beat else 'no store'}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _demo()
