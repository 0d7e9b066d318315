"""The K/V exchange of a block-parallel layout: one rank's attention over its own keys and its peers' sent rows.

A layout (:class:`~.sharded.ShardedLayout`; a model family's own layout under ``hf_bdlm/models/``, e.g. one pass for
an encoder and one for its decoder) describes each attention pass of a rank as an :class:`ExchangePass`: its query
rows, the rows of its key tensor, which contiguous part of the key tensor it sends to the other members of its
communicator (a head or a tail; the rest never travels), and the query rows and sent rows of every member, in the
communicator's rank order. :meth:`ExchangePass.attend` then runs the attention of one layer:

- **all-gather** (full-attention layers, ``transport="allgather"``): the rank's whole key tensor is a local source;
  the other members' sent rows are one deferred source, an all-gather without the own slot
  (:class:`~.collectives.GatheredKV` with ``peers_only``). The block-sparse kernel starts the gather, attends to the
  local source while it travels and merges the two partial results by log-sum-exp; in backward the peers' dK/dV
  travel home (reduce-scatter) while the local gradients compute.
- **window exchange** (sliding-window layers, either transport): only the other members' sent rows within the window
  of this rank's queries (the halo) are fetched, by an all-to-all (:class:`~.collectives.ExchangedKV`, lists from
  :func:`~.plan.window_exchange`), deferred and overlapped the same way.
- **ring** (full-attention layers, ``transport="ring"``): every member's sent rows rotate through the ring, this
  rank's first (:func:`~.ring.ring_attention`, plans from :func:`~hf_bdlm.attention.tiles.plan_attention`, one set per
  batch item when the items' documents differ); the unsent part of the key tensor is the only local source. The ring
  runs the block-sparse kernels, so it needs ``attention_backend="blockwise"`` (or ``"auto"``, under which the ring's
  layers run them on CUDA too).

- **blocking** (``blocking=True``, the paper's CP baseline, :class:`~.dims.CPLayout`), as the reference code runs a
  layer (``turbo-dllm`` 0.1.6: ``_GatherPureCPActiveKV``, then ``_PureContextShardedActiveAttentionImpl``): the
  members' sent *noisy* rows are all-gathered first, complete before anything else; then the gather of their sent
  *clean* rows starts (own slot included), the rank's queries attend to the gathered noisy K/V meanwhile (each noisy
  query to its own block: the block-diagonal part) and to all clean K/V after the wait. Backward computes every
  gradient, then reduce-scatters the clean rows' dK/dV, then the noisy rows'. Sliding layers run the same way: the
  whole sequence travels, not the halo.

With a communicator of one rank nothing travels: the key tensor is the only source. The result of an asynchronous
collective is reachable only after its wait: the deferred sources hand their rows over through the handles of
:mod:`.collectives`, so computing on the local source while they travel never reads a half-written buffer.

Rows carry their document ids (``RowMeta.doc``) where the batch is packed; the window lists depend on positions and
streams only, and the received rows keep the ids of their senders' rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..attention.backends import attend, common_dtype
from ..attention.masks import NOISY, MaskRule
from ..attention.rows import RowMeta
from ..attention.tiles import plan_attention
from .collectives import CommContext, ExchangedKV, GatheredKV, gather_rows
from .plan import window_exchange
from .ring import ring_attention


def check_transport(transport: str, backend: str) -> None:
    """Refuse the ring transport with an attention backend other than the block-sparse kernels it runs (``auto``
    runs them there on every device: the ring merges its shards' partial results itself)."""
    if transport == "ring" and backend not in ("auto", "blockwise"):
        raise ValueError(
            f"the ring transport runs the block-sparse kernels of attention_backend='blockwise'; got "
            f"attention_backend={backend!r}. Use 'blockwise' or block_parallel_transport='allgather'."
        )


@dataclass
class ExchangePass:
    """One attention pass of a rank: its rows, what it sends, and the rows of its communicator's members.

    ``queries``: the query rows; ``keys``: the rows of the local key tensor (every row the rank holds keys for);
    ``sent``: the part of the key tensor the rank sends, ``slice(0, n)`` (a head) or ``slice(n, keys.num_rows)`` (a
    tail); the rest is unsent and stays a local source. ``member_queries`` / ``member_sent``: per member of ``comm`` (in
    its rank order) the query rows it runs and the rows it sends; ``me``: this rank's index among them. ``name``:
    prefix of the collectives' names in the byte meter (``{name}_k``, ``{name}_k_window``, ...; ``None``: the
    collectives' own names). ``blocking``: move K/V as the paper's CP baseline does (module docstring; every member
    then sends as many noisy rows as the others, and as many clean ones, each stream one contiguous run).
    ``cache`` holds what depends only on the rows and the rule (plans, window lists).
    """

    comm: CommContext
    transport: str
    backend: str
    queries: RowMeta
    keys: RowMeta
    sent: slice
    member_queries: list[RowMeta]
    member_sent: list[RowMeta]
    me: int
    name: str | None = None
    blocking: bool = False
    cache: dict = field(default_factory=dict)

    def __post_init__(self):
        check_transport(self.transport, self.backend)
        if self.blocking and self.transport != "allgather":
            raise ValueError(f"blocking K/V transfers are all-gathers; got transport={self.transport!r}.")
        start, stop, total = self.sent.start or 0, self.sent.stop, self.keys.num_rows
        stop = total if stop is None else stop
        if not (0 <= start <= stop <= total and (start == 0 or stop == total)) or self.sent.step not in (None, 1):
            raise ValueError(f"the sent rows must be a head or a tail of the {total} key rows, got {self.sent}.")
        self.sent = slice(start, stop)
        self.unsent = slice(stop, total) if start == 0 else slice(0, start)
        if self.blocking:
            counts = {_stream_runs(rows)[2:] for rows in self.member_sent}
            if len(counts) != 1:
                raise ValueError(f"blocking gathers need equal noisy and clean row counts on every member; the members "
                                 f"send (noisy, clean) = {sorted(counts)}.")
            self.own_runs = _stream_runs(self.member_sent[self.me])[:2]

    @property
    def peer_rows(self) -> RowMeta:
        """The rows gathered from the other members, in their rank order."""
        found = self.cache.get("peer_rows")
        if found is None:
            found = self.cache["peer_rows"] = RowMeta.cat([r for i, r in enumerate(self.member_sent) if i != self.me])
        return found

    def attend(self, query, key, value, rule: MaskRule, scale: float) -> torch.Tensor:
        """``query [b, H, queries, d]`` over the key tensor ``[b, H_kv, keys, d]`` (local) and the peers' rows."""
        if self.comm.size == 1:
            return attend(self.backend, query, [(key, value)], self.queries, [self.keys], rule, scale, self.cache)
        if self.blocking:
            return self._attend_blocking(query, key, value, rule, scale)
        if rule.sliding_window is None and self.transport == "ring":
            return self._attend_ring(query, key, value, rule, scale)
        sent = _rows(key, self.sent), _rows(value, self.sent)
        if rule.sliding_window is not None:
            send_index, send_counts, recv_counts, peer_rows = self._window_exchange(rule, key.device)
            peers = ExchangedKV(*sent, self.comm, send_index, send_counts, recv_counts, **self._names("_window"))
        else:
            peers, peer_rows = GatheredKV(*sent, self.comm, peers_only=True, **self._names()), self.peer_rows
        return attend(self.backend, query, [(key, value), peers], self.queries, [self.keys, peer_rows], rule, scale,
                      self.cache)

    def _attend_blocking(self, query, key, value, rule: MaskRule, scale: float) -> torch.Tensor:
        """The paper's CP baseline (module docstring): the noisy rows gathered before the attention, the clean rows'
        gather overlapped with the block-diagonal part, every gradient computed before either returns."""
        noisy, clean = self.own_runs
        k_sent, v_sent = _rows(key, self.sent), _rows(value, self.sent)
        k_name, v_name = self._names().get("names", ("k", "v"))
        sources, rows = ([(key[:, :, self.unsent], value[:, :, self.unsent])], self._unsent_rows()) \
            if self._has_unsent else ([], [])
        noisy_rows, clean_rows = self._rows_by_stream()
        if noisy.stop > noisy.start:  # complete on return, as the reference gathers its active K/V first
            sources.append((gather_rows(k_sent[:, :, noisy], self.comm, k_name),
                            gather_rows(v_sent[:, :, noisy], self.comm, v_name)))
            rows.append(noisy_rows)
        if clean.stop > clean.start:
            sources.append(GatheredKV(k_sent[:, :, clean], v_sent[:, :, clean], self.comm, (k_name, v_name),
                                      overlap_backward=False))
            rows.append(clean_rows)
        return attend(self.backend, query, sources, self.queries, rows, rule, scale, self.cache)

    def _rows_by_stream(self) -> tuple[RowMeta, RowMeta]:
        """Every member's sent noisy rows, then every member's sent clean rows, each in member order."""
        found = self.cache.get("rows_by_stream")
        if found is None:
            parts = [_stream_runs(rows) for rows in self.member_sent]
            found = self.cache["rows_by_stream"] = tuple(
                RowMeta.cat([rows.slice(p[i].start, p[i].stop) for rows, p in zip(self.member_sent, parts)])
                for i in (0, 1))
        return found

    def _names(self, suffix: str = "") -> dict:
        return {} if self.name is None else {"names": (f"{self.name}_k{suffix}", f"{self.name}_v{suffix}")}

    def _window_exchange(self, rule: MaskRule, device: torch.device):
        """Rows each member needs from each other under a window, as all-to-all send/recv lists (cached per rule: the
        window's reach depends on its convention; the send index on ``device``, where the rows are)."""
        key = ("window_exchange", rule)
        found = self.cache.get(key)
        if found is None:
            send_index, send_counts, recv_counts, recv_rows = window_exchange(
                self.me, self.member_queries, self.member_sent, rule)
            found = self.cache[key] = (send_index.to(device), tuple(send_counts), tuple(recv_counts), recv_rows)
        return found

    def _attend_ring(self, query, key, value, rule: MaskRule, scale: float) -> torch.Tensor:
        """The ring transport: every member's sent rows rotate through (the own ones first); the unsent rows are the
        only local source."""
        unsent = [(key[:, :, self.unsent], value[:, :, self.unsent])] if self._has_unsent else []
        sent = _rows(key, self.sent), _rows(value, self.sent)
        items = [None] if self._same_documents() else list(range(query.shape[0]))
        outs = []
        for item in items:
            sl = slice(None) if item is None else slice(item, item + 1)
            local_plans, shard_plans = self._ring_plans(rule, item or 0)
            q, converted = common_dtype(query[sl], [(k[sl], v[sl]) for k, v in unsent + [sent]])
            outs.append(ring_attention(self.comm, q, converted[-1], converted[:-1], local_plans, shard_plans, scale))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)

    @property
    def _has_unsent(self) -> bool:
        return self.unsent.stop > self.unsent.start

    def _same_documents(self) -> bool:
        """Whether every batch item has the documents of the first on the pass's rows (one set of ring plans for the
        batch); the rows are fixed for the pass, so this is checked once, not once per layer."""
        same = self.cache.get("ring_same_documents")
        if same is None:
            rows = [self.queries, *self._unsent_rows(), *self.member_sent]
            same = self.cache["ring_same_documents"] = all(bool((r.doc == r.doc[:1]).all()) for r in rows
                                                           if r.doc is not None)
        return same

    def _unsent_rows(self) -> list[RowMeta]:
        return [self.keys.slice(self.unsent.start, self.unsent.stop)] if self._has_unsent else []

    def _ring_plans(self, rule: MaskRule, item: int):
        key = ("ring_plans", rule, item)
        found = self.cache.get(key)
        if found is None:
            q = self.queries.batch_item(item)
            local = [plan_attention(q, [rows.batch_item(item)], rule) for rows in self._unsent_rows()]
            shards = [plan_attention(q, [rows.batch_item(item)], rule) for rows in self.member_sent]
            found = self.cache[key] = (local, shards)
        return found


def _stream_runs(rows: RowMeta) -> tuple[slice, slice, int, int]:
    """``(noisy, clean, noisy count, clean count)``: the two contiguous runs of ``rows`` by stream (either first)."""
    noisy = (rows.stream == NOISY).nonzero().flatten()  # ascending, distinct
    n, total = int(noisy.numel()), rows.num_rows
    if n == 0 or int(noisy[-1]) == n - 1:  # the head (or none)
        run = slice(0, n)
    elif int(noisy[0]) == total - n:  # the tail
        run = slice(total - n, total)
    else:
        raise ValueError("a member's sent rows must hold each stream in one contiguous run (noisy then clean, or "
                         "clean then noisy).")
    clean = slice(n, total) if run.start == 0 else slice(0, total - n)
    return run, clean, n, total - n


def _rows(x: torch.Tensor, rows: slice) -> torch.Tensor:
    """Rows ``rows`` of ``x [b, H, T, d]``: ``x`` itself when they are all of them."""
    return x if rows.start == 0 and rows.stop == x.shape[2] else x[:, :, rows]


__all__ = ["ExchangePass", "check_transport"]
