"""Collectives over ``torch.distributed`` whose results exist only after their wait, and the byte meter.

An asynchronous collective writes its output buffer while this rank goes on computing. Reading,
converting or viewing that buffer before the transfer completes yields garbage (bf16 training
once read half-written K/V this way). So no function here returns an in-flight buffer: starting
a collective returns an :class:`InFlight` handle, and :meth:`InFlight.wait` is the only way to
its result. Overlap comes from starting early and waiting late, never from early access.

- :func:`start_gather` / :func:`start_reduce_scatter`: async all-gather of rows of ``[b, H, T, d]``
  tensors along ``T`` (rank order) and its adjoint, the reduce-scatter (sum) back to the owners.
- :class:`GatheredKV`: the K/V rows of every rank of a group, as one attention *key source*. The
  block-sparse kernel (:mod:`hf_bdlm.attention.kernels`) starts the gather itself, computes on its
  local sources meanwhile, and takes the gathered rows from the handle; its backward starts the
  reduce-scatter of dK/dV and finishes the local gradients before waiting. Other backends call
  :meth:`GatheredKV.materialize`, a synchronous autograd gather.
- :class:`ExchangedKV`: selected rows of the other ranks (all-to-all, uneven splits) as a deferred key
  source, overlapped like :class:`GatheredKV` (sliding-window halos); :func:`exchange_rows` is its
  synchronous autograd form: backward sends the gradients back and adds them into the owners' rows.
- :class:`ByteMeter`: bytes *received* by this rank per collective and per step (and what an emulated link
  charged for them: the cluster's element size).

To gather along ``T`` with ``all_gather_single`` (which concatenates along dim 0) the local shard
is laid out ``[T, b, H, d]``; the gathered ``[C*T, b, H, d]`` is handed over as a strided
``[b, H, C*T, d]`` view after the wait, with no copy.

A collective that does not complete within the group's timeout raises
:class:`CollectiveTimeout` naming the group, the collective and the step.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from .emulated_link import LinkModel


class CollectiveTimeout(RuntimeError):
    """A collective did not complete in time (a peer died, hangs or disagrees on the layout)."""


@dataclass
class ByteMeter:
    """Counts the bytes each collective delivered to this rank, per training step: as moved here, and as the rank's
    emulated link charged them (``wire``: the cluster's element size; the bytes moved here without a link)."""

    step: int = 0
    records: list[tuple[int, str, int, int]] = field(default_factory=list)

    def record(self, name: str, nbytes: int, wire_nbytes: int | None = None) -> None:
        self.records.append((self.step, name, int(nbytes), int(nbytes if wire_nbytes is None else wire_nbytes)))

    def next_step(self) -> None:
        self.step += 1

    def total(self, step: int | None = None, wire: bool = False) -> int:
        """Bytes received in ``step`` (default: the current one); ``wire``: as the link charged them."""
        return sum(self.by_name(step, wire).values())

    def by_name(self, step: int | None = None, wire: bool = False) -> dict[str, int]:
        """Bytes received in ``step`` per collective name; ``wire``: as the link charged them."""
        step = self.step if step is None else step
        out: dict[str, int] = defaultdict(int)
        for s, name, n, w in self.records:
            if s == step:
                out[name] += w if wire else n
        return dict(out)


@dataclass
class CommContext:
    """A process group with a name, a timeout, the byte meter, the wait-time counter and an optional emulated link
    (:class:`~.emulated_link.LinkModel`: every transfer then takes at least its modelled time)."""

    group: dist.ProcessGroup | None
    name: str
    meter: ByteMeter
    timeout: timedelta = timedelta(seconds=300)
    wait_seconds: float = 0.0
    link: LinkModel | None = None

    def started(self, label: str, nbytes: int, element_size: int) -> float | None:
        """Record a transfer that delivers ``nbytes`` (elements of ``element_size`` bytes) to this rank; the time its
        emulated link lets it complete at (``None`` without a link), charging the link's own element size."""
        if self.link is None:
            self.meter.record(label, nbytes)
            return None
        wire = self.link.wire_bytes(nbytes, element_size)
        self.meter.record(label, nbytes, wire)
        return self.link.schedule(wire)

    def hold(self, ready_at: float | None) -> None:
        """Wait for an emulated transfer to complete (counted as waiting)."""
        if ready_at is not None:
            self.wait_seconds += LinkModel.hold(ready_at)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def wait(self, work, what: str) -> None:
        start = time.perf_counter()
        try:
            ok = work.wait(self.timeout)
        except RuntimeError as err:
            raise CollectiveTimeout(
                f"{what} on process group '{self.name}' (ranks {self.members}) failed after "
                f"{time.perf_counter() - start:.1f} s (timeout {self.timeout}) at step {self.meter.step}: {err}. A peer "
                "died, hangs or runs a different layout."
            ) from err
        if ok is False:
            raise CollectiveTimeout(
                f"{what} on process group '{self.name}' (ranks {self.members}) timed out after {self.timeout} at step "
                f"{self.meter.step}: a peer hangs or runs a different layout."
            )
        self.wait_seconds += time.perf_counter() - start

    @property
    def members(self) -> str:
        """The global ranks of the group, for messages."""
        try:
            return ", ".join(str(r) for r in dist.get_process_group_ranks(self.group or dist.group.WORLD))
        except (RuntimeError, ValueError):
            return "?"


class InFlight:
    """A started collective. Its result is reachable only through :meth:`wait`, which blocks first.

    ``works`` are the ``torch.distributed`` work objects; ``finish`` builds the result from the
    completed buffers (a view, a list); ``keep`` holds buffers the transfer still reads (the send
    side) until it completes; ``ready_at``: when an emulated link lets the transfer complete (``wait`` sleeps
    until then). ``wait()`` is idempotent and returns the same result every time.
    """

    __slots__ = ("_comm", "_works", "_what", "_finish", "_keep", "_ready_at", "_result", "_done")

    def __init__(self, comm: CommContext, works: list, what: str, finish: Callable[[], Any], keep: tuple = (),
                 ready_at: float | None = None):
        self._comm, self._works, self._what = comm, list(works), what
        self._finish, self._keep, self._ready_at = finish, keep, ready_at
        self._result, self._done = None, False

    def wait(self) -> Any:
        if not self._done:
            for work in self._works:
                self._comm.wait(work, self._what)
            self._comm.hold(self._ready_at)
            self._result = self._finish()
            self._works, self._finish, self._keep, self._done = [], None, (), True
        return self._result


# torch 2.13 renamed the flat-tensor collectives (the old names warn on every call); same arguments and layout.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _without_own_slot(rows: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """``rows [world*T, ...]`` (rank order) without this rank's ``T`` rows: a view for the first and last rank."""
    t = rows.shape[0] // world
    if rank == 0 or rank == world - 1:
        return rows[t:] if rank == 0 else rows[: (world - 1) * t]
    return torch.cat([rows[: rank * t], rows[(rank + 1) * t :]])


def start_gather(x: torch.Tensor, comm: CommContext, name: str, peers_only: bool = False) -> InFlight:
    """Start an all-gather of ``x [b, H, T, d]`` along ``T`` over ``comm`` (rank order).

    ``wait()`` returns ``[b, H, world*T, d]``, or with ``peers_only`` the ``(world-1)*T`` rows of the other
    ranks (this rank holds its own). Records ``(world-1)/world`` of the gathered bytes (what this rank receives).
    """
    world, rank = comm.size, comm.rank
    shard = x.detach().permute(2, 0, 1, 3).contiguous()  # [T, b, H, d]
    buffer = shard.new_empty((world * shard.shape[0], *shard.shape[1:]))
    work = _all_gather_single(buffer, shard, group=comm.group, async_op=True)
    ready_at = comm.started(f"{name}.all_gather", (world - 1) * shard.numel() * shard.element_size(),
                           shard.element_size())

    def finish():
        rows = _without_own_slot(buffer, rank, world) if peers_only else buffer
        return rows.permute(1, 2, 0, 3)

    return InFlight(comm, [work], f"all_gather({name})", finish, keep=(shard,), ready_at=ready_at)


def start_reduce_scatter(full: torch.Tensor, comm: CommContext, name: str, peers_only: bool = False) -> InFlight:
    """Start the adjoint of :func:`start_gather`: sum ``full [b, H, world*T, d]`` over ``comm`` and keep
    this rank's ``T`` rows. ``wait()`` returns ``[b, H, T, d]``. With ``peers_only``, ``full`` holds the
    ``(world-1)*T`` rows of the other ranks (this rank contributes nothing to its own rows here)."""
    world = comm.size
    if peers_only:
        b, h, r, d = full.shape
        t, rank = r // (world - 1), comm.rank
        rows = full.new_zeros((world * t, b, h, d))
        rows[: rank * t] = full[:, :, : rank * t].permute(2, 0, 1, 3)
        rows[(rank + 1) * t :] = full[:, :, rank * t :].permute(2, 0, 1, 3)
    else:
        rows = full.detach().permute(2, 0, 1, 3).contiguous()  # [C*T, b, H, d]
    shard = rows.new_empty((rows.shape[0] // world, *rows.shape[1:]))
    work = _reduce_scatter_single(shard, rows, op=dist.ReduceOp.SUM, group=comm.group, async_op=True)
    ready_at = comm.started(f"{name}.reduce_scatter", (world - 1) * shard.numel() * shard.element_size(),
                           shard.element_size())
    return InFlight(comm, [work], f"reduce_scatter({name})", lambda: shard.permute(1, 2, 0, 3), keep=(rows,),
                    ready_at=ready_at)


class _GatherRows(torch.autograd.Function):
    """Synchronous all-gather with a reduce-scatter backward (for backends that cannot overlap)."""

    @staticmethod
    def forward(ctx, x, comm: CommContext, name: str):
        ctx.comm, ctx.name = comm, name
        return start_gather(x, comm, name).wait()

    @staticmethod
    def backward(ctx, grad):
        return start_reduce_scatter(grad, ctx.comm, ctx.name).wait(), None, None


def gather_rows(x: torch.Tensor, comm: CommContext, name: str) -> torch.Tensor:
    """All-gather ``x [b, H, T, d]`` along ``T`` over ``comm``; returns after the transfer completed.

    Backward reduce-scatters the gradient (sum) to the owners.
    """
    return _GatherRows.apply(x, comm, name)


@dataclass(frozen=True)
class GatheredKV:
    """Key source: the K/V rows of every rank of ``comm``, this rank contributing ``k``/``v`` (``[b, H_kv, T, d]``).

    With ``peers_only`` the source is the other ranks' rows only, in rank order: the caller attends to its
    own rows as a local source, computed while the peers' rows are in flight (and their gradients, in backward,
    while the peers' gradients travel back). The bytes that travel are the same. With ``overlap_backward=False`` the
    gradients' reduce-scatter starts only at the backward handle's wait, which the kernel reaches after its local
    gradients: nothing overlaps it (the paper's CP baseline returns its clean gradients so).

    The block-sparse kernel starts :meth:`start_forward` itself and reads the result after its
    wait; gradients of the gathered rows go back through :meth:`start_backward`.
    """

    k: torch.Tensor
    v: torch.Tensor
    comm: CommContext
    names: tuple[str, str] = ("k", "v")
    peers_only: bool = False
    overlap_backward: bool = True

    @property
    def num_rows(self) -> int:
        return self.k.shape[2] * (self.comm.size - self.peers_only)

    def with_kv(self, k: torch.Tensor, v: torch.Tensor) -> "GatheredKV":
        return replace(self, k=k, v=v)

    def start_forward(self, k: torch.Tensor, v: torch.Tensor) -> InFlight:
        """Gather ``k`` and ``v``; ``wait()`` returns ``(k_all, v_all)``."""
        pk = start_gather(k, self.comm, self.names[0], self.peers_only)
        pv = start_gather(v, self.comm, self.names[1], self.peers_only)
        return InFlight(self.comm, [], "gathered_kv", lambda: (pk.wait(), pv.wait()))

    def start_backward(self, dk_all: torch.Tensor, dv_all: torch.Tensor) -> InFlight:
        """Return gathered-row gradients to their owners; ``wait()`` returns this rank's ``(dk, dv)`` (without
        ``overlap_backward``, the transfer starts there)."""

        def start():
            return (start_reduce_scatter(dk_all, self.comm, self.names[0], self.peers_only),
                    start_reduce_scatter(dv_all, self.comm, self.names[1], self.peers_only))

        if not self.overlap_backward:
            return InFlight(self.comm, [], "gathered_kv_grad", lambda: tuple(h.wait() for h in start()))
        pk, pv = start()
        return InFlight(self.comm, [], "gathered_kv_grad", lambda: (pk.wait(), pv.wait()))

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Synchronous autograd gather: ``(k_all, v_all)``, complete on return."""
        k_all, v_all = gather_rows(self.k, self.comm, self.names[0]), gather_rows(self.v, self.comm, self.names[1])
        if self.peers_only:
            rank, world = self.comm.rank, self.comm.size
            k_all, v_all = (_without_own_slot(t.transpose(0, 2), rank, world).transpose(0, 2) for t in (k_all, v_all))
        return k_all, v_all


@dataclass(frozen=True)
class ExchangedKV:
    """Key source: selected K/V rows of the other ranks of ``comm`` (all-to-all), e.g. a sliding window's halo.

    This rank sends the rows ``send_index`` of ``k``/``v`` (``send_counts[p]`` of them to peer ``p``, in peer order)
    and receives ``recv_counts[p]`` rows from each peer ``p``; the source is the received rows, in peer order.
    Deferred like :class:`GatheredKV`: the block-sparse kernel starts the exchange, computes its local sources
    meanwhile and reads the rows after the wait; in backward the gradients travel back while the local ones compute.
    """

    k: torch.Tensor
    v: torch.Tensor
    comm: CommContext
    send_index: torch.Tensor
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    names: tuple[str, str] = ("k_window", "v_window")

    @property
    def num_rows(self) -> int:
        return sum(self.recv_counts)

    def with_kv(self, k: torch.Tensor, v: torch.Tensor) -> "ExchangedKV":
        return replace(self, k=k, v=v)

    def _send(self, x: torch.Tensor, name: str) -> InFlight:
        rows = x.detach().index_select(2, self.send_index).permute(2, 0, 1, 3).contiguous()  # [S, b, H, d]
        return _start_all_to_all(rows, self.comm, f"{name}.all_to_all", list(self.recv_counts), list(self.send_counts))

    def _return(self, grad: torch.Tensor, x: torch.Tensor, name: str) -> InFlight:
        g = grad.permute(2, 0, 1, 3).contiguous()
        back = _start_all_to_all(g, self.comm, f"{name}.all_to_all_backward", list(self.send_counts),
                                 list(self.recv_counts))
        b, h, _, d = grad.shape

        def finish():
            dx = grad.new_zeros((b, h, x.shape[2], d))
            return dx.index_add_(2, self.send_index, back.wait())

        return InFlight(self.comm, [], f"all_to_all_backward({name})", finish)

    def start_forward(self, k: torch.Tensor, v: torch.Tensor) -> InFlight:
        """Send ``k``/``v``'s selected rows; ``wait()`` returns the received ``(k_rows, v_rows)``."""
        pk, pv = self._send(k, self.names[0]), self._send(v, self.names[1])
        return InFlight(self.comm, [], "exchanged_kv", lambda: (pk.wait(), pv.wait()))

    def start_backward(self, dk: torch.Tensor, dv: torch.Tensor) -> InFlight:
        """Return the received rows' gradients to their senders; ``wait()`` returns this rank's ``(dk, dv)``."""
        pk, pv = self._return(dk, self.k, self.names[0]), self._return(dv, self.v, self.names[1])
        return InFlight(self.comm, [], "exchanged_kv_grad", lambda: (pk.wait(), pv.wait()))

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Synchronous autograd exchange: the received ``(k_rows, v_rows)``, complete on return."""
        return tuple(exchange_rows(x, self.comm, name, self.send_index, self.send_counts, self.recv_counts)
                     for x, name in ((self.k, self.names[0]), (self.v, self.names[1])))


class _ExchangeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm: CommContext, name: str, send_index, send_counts, recv_counts):
        ctx.comm, ctx.name = comm, name
        ctx.send_index, ctx.send_counts, ctx.recv_counts, ctx.x_rows = send_index, send_counts, recv_counts, x.shape[2]
        rows = x.index_select(2, send_index).permute(2, 0, 1, 3).contiguous()  # [S, b, H, d]
        return _start_all_to_all(rows, comm, f"{name}.all_to_all", recv_counts, send_counts).wait()

    @staticmethod
    def backward(ctx, grad):
        g = grad.permute(2, 0, 1, 3).contiguous()
        back = _start_all_to_all(g, ctx.comm, f"{ctx.name}.all_to_all_backward", ctx.send_counts, ctx.recv_counts)
        b, h, _, d = grad.shape
        dx = grad.new_zeros((b, h, ctx.x_rows, d))
        dx.index_add_(2, ctx.send_index, back.wait())
        return dx, None, None, None, None, None


def _start_all_to_all(rows: torch.Tensor, comm: CommContext, label: str, recv_counts, send_counts) -> InFlight:
    """All-to-all of ``rows [S, b, H, d]`` (``send_counts`` per peer); ``wait()`` returns ``[b, H, R, d]``."""
    out = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
    work = dist.all_to_all_single(out, rows, recv_counts, send_counts, group=comm.group, async_op=True)
    per_row = math.prod(rows.shape[1:]) * rows.element_size()
    ready_at = comm.started(label, (sum(recv_counts) - recv_counts[comm.rank]) * per_row, rows.element_size())
    return InFlight(comm, [work], label, lambda: out.permute(1, 2, 0, 3), keep=(rows,), ready_at=ready_at)


def exchange_rows(x, comm: CommContext, name: str, send_index, send_counts, recv_counts) -> torch.Tensor:
    """All-to-all of rows of ``x [b, H, T, d]``: ``send_index`` lists the rows sent to peer 0, then
    peer 1, ... (``send_counts`` each); the result holds ``recv_counts[p]`` rows from each peer
    ``p``, in peer order, and is complete on return. Backward returns the gradients to the senders
    (summed per row).
    """
    return _ExchangeRows.apply(x, comm, name, send_index, list(send_counts), list(recv_counts))
