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

The exchange itself is :mod:`hf_bdlm.parallel.exchange`'s (:class:`~.exchange.ExchangePass`): the
rank's rows are both its queries and its keys, and it sends those from
:meth:`~.plan.GroupPlan.sent_row_start` on (``cp``: all of them; ``csbp``: its clean rows). In
``cp`` and ``csbp`` the rank's own rows are a local key source (source 0) and the peers' rows a
deferred one (source 1): the all-gather starts first, the local queries attend to their own rows
meanwhile (csbp: their block's noisy K/V and their own clean chunk; cp: their own zigzag chunks),
then to the peers' rows after the wait; the partial results are merged by log-sum-exp inside the
block-sparse kernel. Backward starts the reduce-scatter of the peers' dK/dV first and computes the
local gradients while it travels. With ``block_parallel_transport="ring"`` the sent rows rotate
through the ring instead, and the noisy rows (``csbp``) are the local source.

The paper's CP baseline (``cp_layout="paper"``, :class:`~.dims.CPLayout`) holds a contiguous clean shard and a token
slice of every noisy block, and moves K/V as its reference does, on every layer: the noisy rows gathered first, the
clean rows' gather overlapped with the block-diagonal part only (:class:`~.exchange.ExchangePass` with ``blocking``).

On sliding-window layers a rank needs only the peers' rows within the window of its queries (the
halo): instead of the all-gather it fetches exactly those rows from their owners (all-to-all),
deferred and overlapped the same way; each query's reach is cut per key stream, so a clean query fetches no noisy
row (``cp``) and a noisy block only the clean window before it.

The layout does not care where clean K/V come from: a source is a tensor plus its
:class:`~hf_bdlm.attention.rows.RowMeta`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..attention.masks import MaskRule
from .exchange import ExchangePass, check_transport
from .groups import BlockParallelGroups
from .plan import GroupPlan, PlanConfig


@dataclass
class ShardedLayout:
    """One rank's view of a block-parallel layout for one forward pass."""

    plan: GroupPlan
    groups: BlockParallelGroups
    base_rule: MaskRule
    backend: str = "auto"
    doc: torch.Tensor | None = None
    transport: str = "allgather"
    cache: dict = field(default_factory=dict)

    def __post_init__(self):
        replace(self.groups.dims, transport=self.transport)  # validates an overriding transport
        check_transport(self.transport, self.backend)
        me = self.groups.group_rank
        self.rank_plan = self.plan.ranks[me]
        self.mode = self.plan.config.mode
        self.q_rows = self.rank_plan.rows(self.doc)
        self.num_noisy = self.rank_plan.local_noisy_rows
        self.gathered_rows = self.plan.gathered_key_rows(me, self.doc)
        self.comm = self.groups.kv_exchange(self.mode)
        # Keys = queries = this rank's rows; it sends those from sent_row_start on (csbp: after its noisy rows). Under
        # bp the ring is the rank alone and nothing travels.
        members = self.plan.ring_members(me)
        self.exchange = ExchangePass(
            self.comm, self.transport, self.backend, self.q_rows, self.q_rows,
            slice(self.plan.sent_row_start(me), self.q_rows.num_rows),
            [self.plan.ranks[m].rows(self.doc) for m in members], [self.plan.sent_rows(m, self.doc) for m in members],
            members.index(me), blocking=self.plan.config.dims.is_paper_cp, cache=self.cache)

    @classmethod
    def build(cls, config: PlanConfig, groups: BlockParallelGroups, base_rule: MaskRule, backend="auto",
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
        """One layer's attention of this rank's rows over its own K/V and its peers' (:meth:`ExchangePass.attend`)."""
        return self.exchange.attend(query, key, value, rule, scale)
