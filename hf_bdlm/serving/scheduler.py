"""Batching scheduler: a bounded queue of generation jobs and one worker thread that decodes them in batches.

Requests arrive on the asyncio event loop and become :class:`Job` objects; the worker thread takes the oldest job,
waits a few milliseconds for companions, and decodes every waiting job with the same batch key (the model family's
decoder decides which jobs may share a batch) together. Text flows back to the event loop block by block. A full
queue refuses new jobs (the server answers 429); a cancelled job (its client went away) leaves the queue, or its
batch at the next block boundary.

    scheduler = BatchScheduler(engine.run_batch, max_batch_size=8, max_queue=32)
    scheduler.start(); scheduler.submit(job); ...; scheduler.stop()
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..protocols.decoding import AcceptanceCounts

logger = logging.getLogger(__name__)


class QueueFull(Exception):
    """The scheduler's queue holds `max_queue` waiting jobs already."""


class ShuttingDown(Exception):
    """The server is stopping and sheds its work: a new job is refused."""


class TextStream:
    """Incremental detokenization with stop strings: `add(ids)` returns the new text that is safe to send.

    Text that could still become the start of a stop string, or an incomplete UTF-8 character, is held back until
    the next block decides it.
    """

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.hold = max((len(s) for s in stops), default=1) - 1

    def add(self, ids: list[int]) -> tuple[str, bool]:
        """Append generated ids; returns (new text to send, whether a stop string ended the text)."""
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.text = text[: min(hits)]
            return self.flush(), True
        self.text = text
        safe = len(text) - self.hold
        while safe > self.sent and text[safe - 1] == "\ufffd":
            safe -= 1
        if safe <= self.sent:
            return "", False
        delta, self.sent = text[self.sent : safe], safe
        return delta, False

    def flush(self) -> str:
        """The text not sent yet (at the end of the job)."""
        delta, self.sent = self.text[self.sent :], len(self.text)
        return delta


@dataclass(eq=False)
class Job:
    """One generation request (one prompt) as the worker sees it.

    `batch_key` groups jobs that may share a batch (``ServingDecoder.batch_key``).
    Events for the client go to `events` on `loop`: `("text", str)`, `("done", finish_reason)`, `("error", str)`,
    `("unavailable", str)` (the server stopped before the job's end). `acceptance` counts the verification steps of a
    speculative decoder (``ServingDecoder.speculative``), block by block.
    """

    prompt_ids: list[int]
    max_tokens: int
    settings: Any  # what the model family's ServingDecoder.settings returned
    stream: TextStream
    batch_key: Any
    seed: int | None = None
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    completion_tokens: int = 0
    acceptance: AcceptanceCounts = field(default_factory=AcceptanceCounts)
    finish_reason: str | None = None
    submitted: float = field(default_factory=time.perf_counter)

    def emit(self, kind: str, payload: Any) -> None:
        if self.loop is None or self.events is None:
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is gone (server shutting down)
            pass

    def finish(self, reason: str) -> None:
        if self.finish_reason is not None:
            return
        self.finish_reason = reason
        rest = self.stream.flush()
        if rest:
            self.emit("text", rest)
        self.emit("done", reason)

    def fail(self, message: str) -> None:
        if self.finish_reason is None:
            self.finish_reason = "error"
            self.emit("error", message)

    def shed(self, message: str) -> None:
        """End an unfinished job because the server stops; it leaves its batch at the next block."""
        if self.finish_reason is None:
            self.finish_reason = "error"
            self.cancelled.set()
            self.emit("unavailable", message)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SchedulerStats:
    """Counters for `/health` and benchmarks."""

    batches: int = 0
    jobs: int = 0
    largest_batch: int = 0
    cancelled: int = 0
    rejected: int = 0
    failed_batches: int = 0
    recent_batch_s: float = 0.0  # moving average of a batch's duration: what a 429's Retry-After is computed from

    @property
    def mean_batch(self) -> float:
        return self.jobs / self.batches if self.batches else 0.0


class BatchScheduler:
    """A bounded job queue drained by one worker thread, which decodes compatible jobs together.

    Args:
        run_batch: decodes a list of jobs (they share `batch_key`), emitting their events; an exception fails the
            batch's jobs and the worker goes on.
        max_batch_size: most jobs decoded together.
        max_queue: most jobs waiting (not counting the batch running); `submit` raises `QueueFull` beyond.
        batch_wait_s: how long the worker waits after the first job for companions to arrive.
    """

    def __init__(self, run_batch: Callable[[list[Job]], None], max_batch_size: int = 8, max_queue: int = 32,
                 batch_wait_s: float = 0.01):
        if max_batch_size < 1 or max_queue < 1:
            raise ValueError(f"max_batch_size and max_queue must be >= 1, got {max_batch_size} and {max_queue}.")
        self.run_batch = run_batch
        self.max_batch_size, self.max_queue, self.batch_wait_s = max_batch_size, max_queue, batch_wait_s
        self.stats = SchedulerStats()
        self._pending: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._shedding = False
        self._batch: list[Job] = []
        self._thread: threading.Thread | None = None
        self.running = 0

    def start(self) -> None:
        self._stopping = False
        self._thread = threading.Thread(target=self._work, name="hf-bdlm-batcher", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stopping = True
            for job in self._pending:
                job.fail("the server is shutting down")
            self._pending.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def shed(self, message: str) -> int:
        """Refuse new jobs and end every unfinished one, queued or decoding, with ``message`` (the server stops);
        returns how many were ended."""
        with self._cond:
            self._shedding = True
            jobs = [job for job in [*self._pending, *self._batch] if not job.finished]
            self._pending.clear()
        for job in jobs:
            job.shed(message)
        return len(jobs)

    def submit(self, jobs: list[Job]) -> None:
        """Queue jobs together (all or none)."""
        with self._cond:
            if self._shedding:
                raise ShuttingDown("the server is shutting down")
            if len(self._pending) + len(jobs) > self.max_queue:
                self.stats.rejected += len(jobs)
                raise QueueFull(f"{len(self._pending)} requests are waiting (limit {self.max_queue})")
            self._pending.extend(jobs)
            self._cond.notify()

    @property
    def queued(self) -> int:
        return len(self._pending)

    def expected_wait_s(self) -> float:
        """Seconds before a request queued now would start decoding: the batches ahead of it (the running one and the
        queue's) at the recent batch duration."""
        ahead = (1 if self.running else 0) + len(self._pending) / self.max_batch_size
        return ahead * self.stats.recent_batch_s

    def _take_first(self) -> Job | None:
        with self._cond:
            while True:
                while not self._pending and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return None
                job = self._pending.popleft()
                if not job.cancelled.is_set():
                    return job
                self.stats.cancelled += 1

    def _take_companions(self, first: Job) -> list[Job]:
        batch = [first]
        with self._cond:
            keep = collections.deque()
            for job in self._pending:
                if job.cancelled.is_set():
                    self.stats.cancelled += 1
                elif len(batch) < self.max_batch_size and job.batch_key == first.batch_key:
                    batch.append(job)
                else:
                    keep.append(job)
            self._pending = keep
        return batch

    def _work(self) -> None:
        while True:
            first = self._take_first()
            if first is None:
                return
            if self.max_batch_size > 1 and self.batch_wait_s > 0:
                time.sleep(self.batch_wait_s)  # let requests sent at the same moment join this batch
            batch = self._take_companions(first)
            self.stats.batches += 1
            self.stats.jobs += len(batch)
            self.stats.largest_batch = max(self.stats.largest_batch, len(batch))
            self.running, self._batch = len(batch), batch
            started = time.perf_counter()
            try:
                self.run_batch(batch)
            except Exception as err:  # a failed batch must not kill the worker: its clients get a 500
                logger.exception("generation failed for a batch of %d requests", len(batch))
                self.stats.failed_batches += 1
                for job in batch:
                    job.fail(f"generation failed: {type(err).__name__}: {err}")
            finally:
                seconds = time.perf_counter() - started
                recent = self.stats.recent_batch_s
                self.stats.recent_batch_s = seconds if recent == 0 else 0.8 * recent + 0.2 * seconds
                self.stats.cancelled += sum(job.cancelled.is_set() for job in batch)
                self.running, self._batch = 0, []
