"""Autograd-aware collectives over ``torch.distributed`` and the byte meter that counts them.

All K/V travel along the sequence axis of ``[b, H_kv, T, d]`` tensors. To gather along ``T``
with ``all_gather_single`` (which concatenates along dim 0) the local shard is laid out
``[T, b, H, d]`` once; the gathered buffer ``[C*T, b, H, d]`` is then handed to attention as
a strided ``[b, H, C*T, d]`` view, with no copy after the collective.

- :func:`gather_rows`: async all-gather; backward reduce-scatters the gradient back to the
  owners (summed). The returned ``Pending`` is waited on by attention right before it first
  reads the gathered rows, so local work overlaps the transfer.
- :func:`exchange_rows`: all-to-all of selected rows (uneven splits); backward sends the
  gradients back and adds them into the owners' rows. Used when a rank needs only some rows of
  its peers (sliding-window layers).
- :class:`ByteMeter`: bytes *received* by this rank per collective and per step.

A collective that does not complete within the group's timeout raises
:class:`CollectiveTimeout` naming the group, the collective and the step.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist


class CollectiveTimeout(RuntimeError):
    """A collective did not complete in time (a peer died, hangs or disagrees on the layout)."""


@dataclass
class ByteMeter:
    """Counts the bytes each collective delivered to this rank, per training step."""

    step: int = 0
    records: list[tuple[int, str, int]] = field(default_factory=list)

    def record(self, name: str, nbytes: int) -> None:
        self.records.append((self.step, name, int(nbytes)))

    def next_step(self) -> None:
        self.step += 1

    def total(self, step: int | None = None) -> int:
        step = self.step if step is None else step
        return sum(n for s, _, n in self.records if s == step)

    def by_name(self, step: int | None = None) -> dict[str, int]:
        step = self.step if step is None else step
        out: dict[str, int] = defaultdict(int)
        for s, name, n in self.records:
            if s == step:
                out[name] += n
        return dict(out)


@dataclass
class CommContext:
    """A process group with a name, a timeout, the byte meter and the wait-time counter."""

    group: dist.ProcessGroup | None
    name: str
    meter: ByteMeter
    timeout: timedelta = timedelta(seconds=300)
    wait_seconds: float = 0.0

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def wait(self, work, what: str) -> None:
        import time

        start = time.perf_counter()
        try:
            ok = work.wait(self.timeout)
        except RuntimeError as err:
            raise CollectiveTimeout(
                f"{what} on process group '{self.name}' failed or timed out after {self.timeout} at step "
                f"{self.meter.step}: {err}. A peer may have died or be running a different layout."
            ) from err
        if ok is False:
            raise CollectiveTimeout(
                f"{what} on process group '{self.name}' timed out after {self.timeout} at step {self.meter.step}."
            )
        self.wait_seconds += time.perf_counter() - start


class Pending:
    """An in-flight collective; ``wait()`` is idempotent."""

    def __init__(self, comm: CommContext, work, what: str):
        self.comm, self.work, self.what = comm, work, what

    def wait(self) -> None:
        if self.work is not None:
            self.comm.wait(self.work, self.what)
            self.work = None


# torch 2.13 renamed the flat-tensor collectives (the old names warn on every call); same arguments and layout.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm: CommContext, name: str, box: list):
        world = comm.size
        shard = x.permute(2, 0, 1, 3).contiguous()  # [T, b, H, d]
        out = shard.new_empty((world * shard.shape[0], *shard.shape[1:]))
        work = _all_gather_single(out, shard, group=comm.group, async_op=True)
        comm.meter.record(f"{name}.all_gather", (world - 1) * shard.numel() * shard.element_size())
        box.append(Pending(comm, work, f"all_gather({name})"))
        ctx.comm, ctx.name = comm, name
        return out

    @staticmethod
    def backward(ctx, grad):
        comm = ctx.comm
        world = comm.size
        full = grad.contiguous()  # [C*T, b, H, d]
        shard = full.new_empty((full.shape[0] // world, *full.shape[1:]))
        work = _reduce_scatter_single(shard, full, op=dist.ReduceOp.SUM, group=comm.group, async_op=True)
        comm.meter.record(f"{ctx.name}.reduce_scatter", (world - 1) * shard.numel() * shard.element_size())
        comm.wait(work, f"reduce_scatter({ctx.name})")
        return shard.permute(1, 2, 0, 3), None, None, None


def gather_rows(x: torch.Tensor, comm: CommContext, name: str) -> tuple[torch.Tensor, Pending]:
    """All-gather ``x [b, H, T, d]`` along ``T`` over ``comm.group`` (rank order), asynchronously.

    Returns the gathered ``[b, H, world*T, d]`` (valid after ``pending.wait()``) and the pending
    handle. Backward reduce-scatters the gradient (sum) to the owners.
    """
    box: list[Pending] = []
    out = _GatherRows.apply(x, comm, name, box)
    # The view is taken outside the autograd function: the collective writes its output in place.
    return out.permute(1, 2, 0, 3), box[0]


class _ExchangeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm: CommContext, name: str, send_index, send_counts, recv_counts):
        rows = x.index_select(2, send_index).permute(2, 0, 1, 3).contiguous()  # [S, b, H, d]
        out = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
        work = dist.all_to_all_single(out, rows, recv_counts, send_counts, group=comm.group, async_op=True)
        comm.wait(work, f"all_to_all({name})")
        per_row = rows[0].numel() * rows.element_size() if rows.shape[0] else 0
        comm.meter.record(f"{name}.all_to_all", (sum(recv_counts) - recv_counts[comm.rank]) * per_row)
        ctx.comm, ctx.name = comm, name
        ctx.send_index, ctx.send_counts, ctx.recv_counts, ctx.x_rows = send_index, send_counts, recv_counts, x.shape[2]
        return out.permute(1, 2, 0, 3)

    @staticmethod
    def backward(ctx, grad):
        comm = ctx.comm
        g = grad.permute(2, 0, 1, 3).contiguous()
        back = g.new_empty((sum(ctx.send_counts), *g.shape[1:]))
        work = dist.all_to_all_single(back, g, ctx.send_counts, ctx.recv_counts, group=comm.group, async_op=True)
        comm.wait(work, f"all_to_all_backward({ctx.name})")
        per_row = g[0].numel() * g.element_size() if g.shape[0] else 0
        comm.meter.record(f"{ctx.name}.all_to_all_backward", (sum(ctx.send_counts) - ctx.send_counts[comm.rank]) * per_row)
        b, h, _, d = grad.shape
        dx = grad.new_zeros((b, h, ctx.x_rows, d))
        dx.index_add_(2, ctx.send_index, back.permute(1, 2, 0, 3))
        return dx, None, None, None, None, None


def exchange_rows(x, comm: CommContext, name: str, send_index, send_counts, recv_counts) -> torch.Tensor:
    """All-to-all of rows of ``x [b, H, T, d]``: ``send_index`` lists the rows sent to peer 0, then
    peer 1, ... (``send_counts`` each); the result holds ``recv_counts[p]`` rows from each peer
    ``p``, in peer order. Backward returns the gradients to the senders (summed per row).
    """
    return _ExchangeRows.apply(x, comm, name, send_index, list(send_counts), list(recv_counts))
