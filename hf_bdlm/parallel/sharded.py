"""Sharded block-diffusion attention: the ``cp``, ``bp`` and ``csbp`` layouts of one rank.

A :class:`ShardedLayout` is what the model's attention function receives (``bdlm_layout``)
when a block-parallel group shares one batch. Each rank runs the backbone over its own rows
(:meth:`ShardedLayout.local_inputs`); per layer the layout moves K/V and calls the ordinary
attention backends of :mod:`hf_bdlm.attention` with several key sources:

- ``cp``: all local K/V are all-gathered over the group (noisy ones too) and attended with
  the rule; gradients are reduce-scattered back.
- ``bp``: no communication; the rank holds its noisy blocks and the clean prefix they need.
- ``csbp``: only the local *clean* K/V are all-gathered over the clean ring; noisy K/V and their
  gradients never travel.

In ``cp`` and ``csbp`` the rank's own rows are a local key source (source 0) and the peers' rows a
deferred one (source 1): the all-gather starts first, the local queries attend to their own rows
meanwhile (csbp: their block's noisy K/V and their own clean chunk; cp: their own zigzag chunks),
then to the peers' rows after the wait; the partial results are merged by log-sum-exp inside the
block-sparse kernel. Backward starts the reduce-scatter of the peers' dK/dV first and computes the
local gradients while it travels.

On sliding-window layers a rank needs only the peers' rows within the window of its queries (the
halo): instead of the all-gather it fetches exactly those rows from their owners (all-to-all),
deferred and overlapped the same way.

The layout does not care where clean K/V come from: a source is a tensor plus its
:class:`~hf_bdlm.attention.rows.RowMeta`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..attention.backends import common_dtype, attend
from ..attention.tiles import plan_attention
from ..attention.masks import MaskRule
from ..attention.rows import RowMeta
from .collectives import ExchangedKV, GatheredKV
from .groups import BlockParallelGroups
from .plan import GroupPlan, PlanConfig, window_exchange
from .ring import ring_attention


@dataclass
class ShardedLayout:
    """One rank's view of a block-parallel layout for one forward pass."""

    plan: GroupPlan
    groups: BlockParallelGroups
    base_rule: MaskRule
    backend: str = "blockwise"
    doc: torch.Tensor | None = None
    transport: str = "allgather"
    cache: dict = field(default_factory=dict)

    def __post_init__(self):
        replace(self.groups.dims, transport=self.transport)  # validates an overriding transport
        if self.transport == "ring" and self.backend != "blockwise":
            raise ValueError(
                f"the ring transport runs the block-sparse kernels of attention_backend='blockwise'; got "
                f"attention_backend={self.backend!r}. Use 'blockwise' or block_parallel_transport='allgather'."
            )
        self.rank_plan = self.plan.ranks[self.groups.group_rank]
        self.mode = self.plan.config.mode
        self.q_rows = self.rank_plan.rows(self.doc)
        self.num_noisy = self.rank_plan.local_noisy_rows
        self.gathered_rows = self.plan.gathered_key_rows(self.groups.group_rank, self.doc)
        self.comm = self.groups.kv_exchange(self.mode)
        self.sent_start = self.plan.sent_row_start(self.groups.group_rank)  # this rank's rows before those it sends

    @classmethod
    def build(cls, config: PlanConfig, groups: BlockParallelGroups, base_rule: MaskRule, backend="blockwise",
              doc=None, transport: str | None = None) -> "ShardedLayout":
        """The layout of one batch: ``config``'s (cached) plan, agreed on by the group (see
        :meth:`BlockParallelGroups.plan <.groups.BlockParallelGroups.plan>`)."""
        return cls(groups.plan(config), groups, base_rule, backend, doc, transport or groups.dims.transport)

    # --- inputs and loss bookkeeping ---------------------------------------------------------
    def local_inputs(self, noisy: torch.Tensor, clean: torch.Tensor, position_ids: torch.Tensor):
        """This rank's rows of the vectorized batch: ``(input_ids [b, R], position_ids [b, R])``."""
        index = self.rank_plan.global_row_index().to(clean.device)
        return torch.cat([noisy, clean], 1)[:, index], torch.cat([position_ids, position_ids], 1)[:, index]

    def loss_row_index(self, corrupted) -> torch.Tensor:
        """Local row predicting each target of ``corrupted``, or -1 where another rank counts it.

        Rows computed on several ranks (the replicated clean prefix of ``bp``, the clean copies of
        hybrid ``csbp``) count on exactly one of them, so the ranks' losses add up to the
        single-device loss.
        """
        index = self.q_rows.index_of(corrupted.target_stream, corrupted.target_row_pos, corrupted.seq_len)
        counted = self.rank_plan.loss_row_mask().to(index.device)
        held = index >= 0
        index[held & ~counted[index.clamp(min=0)]] = -1
        return index

    # --- attention -----------------------------------------------------------------------------
    def attend(self, module, query, key, value, rule: MaskRule, scale: float) -> torch.Tensor:
        if not self.mode.exchanges_kv:
            return attend(self.backend, query, [(key, value)], self.q_rows, [self.q_rows], rule, scale, self.cache)
        n = self.sent_start
        if rule.sliding_window is not None:
            return self._attend_window(query, key, value, rule, scale, n)
        if self.transport == "ring" and self.comm.size > 1:
            return self._attend_ring(query, key, value, rule, scale, n)
        # The rank's own rows (its noisy rows and the rows it sends) are a local source. The peers' rows (csbp: the
        # ring's other clean rows; cp: the group's other rows) arrive by an all-gather that the block-sparse kernel
        # starts first and overlaps with the local source; they are reachable only after its wait. In backward their
        # dK/dV travel home while the local source's gradients compute.
        sources, rows = [(key, value)], [self.q_rows]
        if self.comm.size > 1:
            sources.append(GatheredKV(key[:, :, n:], value[:, :, n:], self.comm, peers_only=True))
            rows.append(self.peer_rows)
        return attend(self.backend, query, sources, self.q_rows, rows, rule, scale, self.cache)

    @property
    def peer_rows(self) -> RowMeta:
        """The rows this rank receives by communication, in the gathered order: the other comm members' sent rows."""
        found = self.cache.get("peer_rows")
        if found is None:
            me = self.groups.group_rank
            found = RowMeta.cat([self.plan.sent_rows(m, self.doc) for m in self.plan.ring_members(me) if m != me])
            self.cache["peer_rows"] = found
        return found

    def _ring_plans(self, rule: MaskRule, n: int, item: int):
        key = ("ring_plans", rule, item)
        found = self.cache.get(key)
        if found is None:
            q_rows = self.q_rows.batch_item(item)
            local = [plan_attention(q_rows, [q_rows.slice(0, n)], rule)] if n else []
            doc = None if self.doc is None else self.doc[item : item + 1]
            shards = [plan_attention(q_rows, [self.plan.sent_rows(m, doc)], rule)
                      for m in self.plan.ring_members(self.groups.group_rank)]
            found = (local, shards)
            self.cache[key] = found
        return found

    def _attend_ring(self, query, key, value, rule, scale, n):
        same_docs = self.doc is None or bool((self.doc == self.doc[:1]).all())
        items = [None] if same_docs else list(range(query.shape[0]))
        outs = []
        for item in items:
            sl = slice(None) if item is None else slice(item, item + 1)
            local_plans, shard_plans = self._ring_plans(rule, n, item or 0)
            q, [(k, v)] = common_dtype(query[sl], [(key[sl], value[sl])])
            local = [(k[:, :, :n], v[:, :, :n])] if n else []
            outs.append(ring_attention(self.comm, q, (k[:, :, n:], v[:, :, n:]), local, local_plans, shard_plans,
                                       scale))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)

    def _window_exchange(self, rule: MaskRule, device: torch.device):
        """Which gathered rows each rank needs under a window, as all-to-all send/recv lists (cached; the send index
        on ``device``, where the rows are)."""
        key = ("window_exchange", rule)  # the whole rule: the window's reach depends on its convention
        found = self.cache.get(key)
        if found is not None:
            return found
        me = self.groups.group_rank
        members = self.plan.ring_members(me)

        send_index, send_counts, recv_counts, doc_rows = window_exchange(
            members.index(me), [self.plan.ranks[m].rows() for m in members], [self.plan.sent_rows(m) for m in members],
            rule)
        if self.doc is not None:
            doc_rows = RowMeta(doc_rows.stream, doc_rows.pos, self.doc[:, doc_rows.pos])
        found = (send_index.to(device), tuple(send_counts), tuple(recv_counts), doc_rows)
        self.cache[key] = found
        return found

    def _attend_window(self, query, key, value, rule, scale, n):
        # As attend(): the rank's own rows are local, the peers' rows within the window (the halo) arrive by an
        # all-to-all the block-sparse kernel overlaps with the local source, forward and backward.
        sources, rows = [(key, value)], [self.q_rows]
        if self.comm.size > 1:
            send_index, send_counts, recv_counts, recv_rows = self._window_exchange(rule, key.device)
            sources.append(ExchangedKV(key[:, :, n:], value[:, :, n:], self.comm, send_index, send_counts,
                                       recv_counts))
            rows.append(recv_rows)
        return attend(self.backend, query, sources, self.q_rows, rows, rule, scale, self.cache)
