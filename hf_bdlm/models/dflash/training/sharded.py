"""The DFlash drafter's training forward sharded over the ``P`` ranks of a block-parallel group (``cp``, ``bp``,
``csbp``), equal to one process's.

A drafter step has two kinds of work: the *context* (the target features of all ``L`` tokens, projected once by
``hidden_norm(fc(.))``, then to keys and values by every layer) and the *draft blocks* (one per anchor, whose
queries attend to the context before their anchor). The modes split them differently; the context is cut over a
*ring* of ``C`` ranks (the group's clean rings of :class:`~hf_bdlm.parallel.ParallelDims`: ``C = P`` under ``cp``,
``C | P`` under ``csbp``, ``C = 1`` under ``bp``), rank ``r`` holding shard ``c = r mod C``:

| mode | context rows a rank holds and projects | anchors a rank drafts | what travels (in its ring) |
|------|----------------------------------------|-----------------------|----------------------------|
| ``cp`` | ``[c L/C, (c+1) L/C)``, ``C = P`` (*) | all active anchors (replicated) | context K/V |
| ``bp`` | all ``L`` (*) | a cost-balanced share of ``P`` | nothing |
| ``csbp`` | ``[c L/C, (c+1) L/C)`` (*) | a cost-balanced share of ``P`` | context K/V |

(*) When every layer slides, only the rows some anchor can see, in ranges balanced by those rows (*compact
context*, below).

**Plan** (:class:`DFlashShardPlan`, pure): the contiguous context range of every rank and the rows of it the rank
projects (all of them, or only those in reach when every layer slides: *compact context*, below), the anchor slots
each rank drafts (``deal_anchors`` of the anchors' attention costs summed over the drafter's layers: heaviest with
lightest; ``cp``: every active slot on every rank), and for each sliding window the context rows each rank must
receive from its ring.

**Forward** (:func:`sharded_draft_forward`): every layer's context K/V are projected from the SAME projected
features (not from the previous layer's output), so a rank computes its rows' K/V of each layer locally and the
layer's queries then read its ring peers' rows: on a full-attention layer all of them (an all-gather of the other
ring ranks' rows), on a sliding-window layer of window ``W`` exactly the rows in reach of this rank's anchors (an
all-to-all of the rows ``[max(document start, anchor - W + 1), anchor)`` of its anchors that a peer holds). The
attention over the rank's own rows runs while the peers' rows are in flight, and the two partial results merge by
log-sum-exp (:func:`~.modeling.merge_partials`). In backward the peers' rows' dK/dV travel home to their owners
(reduce-scatter; the all-to-all's reverse), so ``fc``, ``hidden_norm`` and each layer's ``k_proj`` / ``v_proj`` /
``k_norm`` receive, on the owner of each row in each ring, the gradient of every use of it by the ring's anchors;
summed over the group (what DDP does) they hold every anchor's. A full-attention layer gathers all the peers' rows,
the ones after a rank's last anchor included (masked, not skipped: equal shares keep it one all-gather).

**Compact context** (every layer of the drafter slides, widest window ``W``): the block of anchor ``a`` sees no
context row outside ``[max(document start, a - W + 1), a)``, and a row's projection and K/V are computed row by row,
so a row no anchor sees changes no output and no gradient (the features are detached inputs). A ring then needs only the rows
its members' anchors can see (the union over the batch's samples; ``cp`` and ``P = 1``: every active anchor;
``bp``: the rank's own; ``csbp``: its ring members'), and it cuts ``[0, L)`` into its ``C`` contiguous ranges where
each range holds as many of those rows as any other (:func:`balanced_bounds`, within one row), not as many rows:
anchors cluster (the locality sampler draws them near each other), and equal shards would leave the seen rows, the
projection and the window exchange's sends on one rank. Each rank projects (``fc``, ``hidden_norm``, every layer's
``k_proj`` / ``v_proj`` / ``k_norm``) only the seen rows of its range: the plan's
:attr:`~DFlashShardPlan.projected_ranges`. The own-range attention and the window exchange use those rows; the
exchange sends only rows in reach. At ``L = 16384``, ``W = 512``, 64 locality anchors on 8 ranks, ``csbp`` projects
126 or 127 rows per rank (1015 of 16384), ``bp`` 903 to 1015 rows per rank instead of 16384; at ``L = 2^20``,
``W = 2048``, 2048 locality anchors (blocks of 8), ``csbp`` projects about 18423 / 8 rows per rank instead of 131072.
The ranges depend on the step's anchors, so a trainer reads a rank's feature rows after drawing them: only these,
``torch.cat([store.features(i, a, b) for a, b in plan.projected_runs], dim=1)``
(:meth:`~.capture.FeatureStore.features` reads only the rows asked). With any full-attention layer (or
``compact_context=False``) ranges are equal shards ``[c L/C, (c+1) L/C)`` and every row of the range is projected.

**Loss** (:attr:`DFlashShardPlan.loss_scale`): the group's rank losses, each ``loss(own anchors) * loss_scale``, add
up to the single-process loss of the batch and their gradients to its gradient: ``bp``, ``csbp`` score disjoint
anchor shares against the batch's global normaliser (``loss_scale = 1``; D-PACE sums its totals over the group,
:meth:`DFlashShardPlan.global_sum`); ``cp`` drafts every anchor on every rank, so it counts each rank's loss once in
``P`` (``loss_scale = 1 / P``; no global sum). Under DDP, which averages gradients over the ``D x P`` ranks of the
data world, the trainer backpropagates ``loss * loss_scale * P`` (the mean over replicas of each replica's batch), or
``loss * loss_scale * D * P`` with normalisers of the whole step, as the other families do.

**Bytes** this rank receives per step (``b`` sequences, ``H_kv`` K/V heads of dimension ``d``, ``s`` bytes per
element of the drafter's dtype; :func:`context_bytes` computes them, the group's :class:`~hf_bdlm.parallel.ByteMeter`
records them):

- ``bp``: 0.
- ``cp``, ``csbp``, per full-attention layer: forward ``2 (C - 1) (L / C) b H_kv d s`` (all-gather of the ring
  peers' K and V rows), backward the same (their dK/dV, reduce-scatter).
- ``cp``, ``csbp``, per sliding layer of window ``W``: forward ``2 R_W b H_kv d s`` with ``R_W`` the ring peers' rows
  in reach of this rank's anchors (``len(plan.window_rows[W][rank])``; ``cp``: of every anchor), backward
  ``2 S_W b H_kv d s`` with ``S_W`` the rows of this rank its ring peers received (their gradients come back).

With gradient checkpointing a recomputed layer exchanges its rows again (its forward bytes twice). Tiny example (two
processes: ``torchrun --nproc_per_node 2 tests/distributed/dflash_worker.py --out /tmp/dflash.json``)::

    plan = DFlashShardPlan.build(batch, mode="csbp", world=2, rank=groups.group_rank, ring_size=2,
                                 layer_windows=[drafter.config.layer_window(i) for i in range(len(drafter.layers))])
    mine = plan.select(batch)                                     # this rank's anchors
    start, stop = plan.context_range                              # this rank's feature rows
    out = sharded_draft_forward(drafter, features[:, start:stop], input_ids, mine, plan, groups.ring)
    # or only the rows it projects: features[:, plan.projected_rows]
    loss = objective.loss_from_hidden(out.hidden_states, drafter.lm_head.weight, mine,
                                      global_sum=plan.global_sum(groups.group)) * plan.loss_scale
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ....parallel.collectives import CommContext, ExchangedKV, GatheredKV
from ....parallel.dims import Mode
from ..modeling import DFlashAttention, DFlashDraftModel, DFlashDraftOutput, DraftContext, draft_context
from .objectives import DFlashBatch, active_anchor_slots, anchor_costs, deal_anchors, select_anchors

# Names of the collectives in the byte meter (the all-gather / reduce-scatter and the window's all-to-all).
FULL_NAMES = ("dflash_context_k", "dflash_context_v")
WINDOW_NAMES = ("dflash_context_k_window", "dflash_context_v_window")


def _mode(mode) -> Mode:
    try:
        return Mode(mode)
    except ValueError:
        raise ValueError(f"mode must be one of {tuple(m.value for m in Mode)}, got {mode!r}.") from None


@dataclass(frozen=True)
class DFlashShardPlan:
    """Who holds which context rows and drafts which anchors of one batch, in a group of ``world`` ranks.

    Build it with :meth:`build`; every rank of a group builds the same plan from the same batch (anchors are a
    function of ``(seed, step)`` and the batch), only ``rank`` differs.

    Parameters:
        mode (`Mode`): ``"cp"``, ``"bp"`` or ``"csbp"``.
        world (`int`): ranks ``P`` of the group. rank (`int`): this rank, in ``[0, P)``.
        ring_size (`int`): ranks ``C`` sharing one copy of the context (ranks ``[C i, C (i + 1))`` form ring ``i``).
        sequence_length (`int`): ``L``.
        context_ranges (`tuple[tuple[int, int], ...]`): per rank, the contiguous sequence range ``[start, stop)`` of
            the rows it owns (``bp``: ``(0, L)`` everywhere; a ring's ranges cut ``[0, L)``: equal shards, or
            balanced by seen rows when the context is compacted).
        anchor_slots (`tuple[tuple[int, ...], ...]`): per rank, the anchor slots of the batch it drafts, ascending.
        window_rows (`dict[int, tuple[tuple[int, ...], ...]]`): per sliding window ``W`` of the drafter, per rank,
            the context rows (sequence indices, ascending) held by its ring peers that its anchors can see on a layer
            of window ``W`` (empty under ``bp``).
        projected_ranges (`tuple[tuple[tuple[int, int], ...], ...]`, *optional*): per rank, the rows of its context
            range it projects, as ascending disjoint runs ``[start, stop)`` of sequence indices. Defaults to the whole
            range (what :meth:`build` gives unless the context is compacted).
        compact_window (`int`, *optional*): the widest window when the context is compacted (every layer slides:
            a rank projects only the rows its ring's anchors can see), else `None`.
    """

    mode: Mode
    world: int
    rank: int
    ring_size: int
    sequence_length: int
    context_ranges: tuple[tuple[int, int], ...]
    anchor_slots: tuple[tuple[int, ...], ...]
    window_rows: dict[int, tuple[tuple[int, ...], ...]] = field(default_factory=dict)
    projected_ranges: tuple[tuple[tuple[int, int], ...], ...] | None = None
    compact_window: int | None = None

    def __post_init__(self):
        if self.projected_ranges is None:
            whole = tuple(((start, stop),) if stop > start else () for start, stop in self.context_ranges)
            object.__setattr__(self, "projected_ranges", whole)

    @classmethod
    def build(
        cls,
        batch: DFlashBatch,
        *,
        mode: str,
        world: int,
        rank: int,
        layer_windows: Sequence[int | None] = (None,),
        ring_size: int | None = None,
        compact_context: bool = True,
    ) -> "DFlashShardPlan":
        """The plan of ``batch`` for rank ``rank`` of ``world``.

        Args:
            batch ([`DFlashBatch`]): the whole batch (every anchor slot), from `DFlashObjective.prepare`.
            mode (`str`): ``"cp"`` (context rows sharded, every active anchor on every rank), ``"bp"`` (every rank
                holds all rows, anchors dealt) or ``"csbp"`` (both sharded).
            world (`int`): ranks ``P`` of the group.
            rank (`int`): this rank.
            layer_windows (`Sequence[int | None]`): the drafter's layer windows, one per layer (``None``: full
                attention), e.g. ``[config.layer_window(i) for i in range(config.num_hidden_layers)]``; they weigh
                the anchors' costs and say which windows need an exchange plan.
            ring_size (`int`, *optional*): ranks ``C`` a context copy is sharded over (``dims.clean_ring_size``):
                ``P`` under ``cp``, a divisor of ``P`` under ``csbp`` (default ``P``), 1 under ``bp``. ``cp`` and
                ``csbp`` need ``L % C == 0``.
            compact_context (`bool`, defaults to `True`): when every layer slides, each rank projects only the rows
                of its range that its ring's anchors can see through the widest window (`projected_ranges`); with
                any full-attention layer, or `False`, the whole range.
        """
        mode = _mode(mode)
        if not isinstance(world, int) or isinstance(world, bool) or world < 1:
            raise ValueError(f"world must be an int >= 1 (ranks of the group), got {world!r}.")
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world:
            raise ValueError(f"rank must be an int in [0, world={world}), got {rank!r}.")
        default_ring = 1 if mode is Mode.BP else world
        ring = default_ring if ring_size is None else ring_size
        if not isinstance(ring, int) or isinstance(ring, bool) or ring < 1 or world % ring:
            raise ValueError(f"ring_size must be an int dividing world={world}, got {ring_size!r}.")
        if mode is not Mode.CSBP and ring != default_ring:
            raise ValueError(f"mode={mode.value!r} has ring_size={default_ring} (cp shards the context over the whole "
                             f"group, bp over no one), got {ring}; use mode='csbp' for rings of {ring} ranks.")
        layer_windows = tuple(layer_windows)
        if not layer_windows:
            raise ValueError("layer_windows must list the drafter's layers' windows (None for full attention).")
        for window in layer_windows:
            if window is not None and (not isinstance(window, int) or window < 1):
                raise ValueError(f"a layer window must be None or an int >= 1, got {window!r}.")
        length = batch.sequence_length
        shards_context = ring > 1
        if shards_context and length % ring:
            raise ValueError(f"mode={mode.value!r} cuts the context into ring_size={ring} equal contiguous shards, "
                             f"but the sequence length is {length}, not a multiple of {ring}: pad the sequences to a "
                             f"multiple of {ring} tokens (or use mode='bp').")
        active = active_anchor_slots(batch).cpu()
        if mode is Mode.CP or world == 1:
            slots = (tuple(active.tolist()),) * world
        else:
            costs = torch.zeros(batch.num_anchors, dtype=torch.int64)
            for window in layer_windows:
                costs += anchor_costs(batch, sliding_window=window).cpu()
            slots = tuple(tuple(active[part].tolist()) for part in deal_anchors(costs[active], world))

        widest = max(layer_windows) if compact_context and all(w is not None for w in layer_windows) else None
        seen_by_ring = {}  # compact context: the rows each ring's anchors can see through the widest window
        if widest is not None:
            for first in range(0, world, ring):
                ring_slots = sorted({s for member in range(first, first + ring) for s in slots[member]})
                seen_by_ring[first] = _reachable_runs(batch, ring_slots, widest)
        ranges = []
        for r in range(world):
            first = r - r % ring
            if not shards_context:
                bounds = (0, length)
            elif widest is not None:  # as many seen rows on each ring rank, not as many rows
                bounds = balanced_bounds(seen_by_ring[first], length, ring)
            else:
                bounds = tuple(length * c // ring for c in range(ring + 1))
            ranges.append((bounds[r % ring], bounds[r % ring + 1]))
        ranges = tuple(ranges)

        windows: dict[int, tuple[tuple[int, ...], ...]] = {}
        for window in sorted({w for w in layer_windows if w is not None}):
            if not shards_context:
                windows[window] = ((),) * world
                continue
            outside = []
            for r in range(world):
                seen = _reachable_runs(batch, slots[r], window)
                lo, hi = ranges[r]
                outside.append(tuple(_positions(_cut(seen, 0, lo) + _cut(seen, hi, length)).tolist()))
            windows[window] = tuple(outside)

        projected = None
        if widest is not None:
            projected = tuple(_cut(seen_by_ring[r - r % ring], *ranges[r]) for r in range(world))
        return cls(mode, world, rank, ring, length, ranges, slots, windows, projected, widest)

    # --- this rank ---------------------------------------------------------------------------------------------------
    @property
    def context_range(self) -> tuple[int, int]:
        """``(start, stop)``: the feature rows this rank holds (``features[:, start:stop]``)."""
        return self.context_ranges[self.rank]

    @property
    def compacts_context(self) -> bool:
        """Whether this rank projects only the rows of its range that its ring's anchors can see (every layer
        slides), not the whole range."""
        return self.compact_window is not None

    @property
    def projected_runs(self) -> tuple[tuple[int, int], ...]:
        """The runs ``[start, stop)`` of sequence indices this rank projects, ascending (within `context_range`):
        the feature rows it needs, e.g. ``torch.cat([store.features(i, a, b) for a, b in plan.projected_runs])``."""
        return self.projected_ranges[self.rank]

    @property
    def projected_rows(self) -> torch.Tensor:
        """The sequence indices of the rows this rank projects (`torch.LongTensor`, ascending)."""
        return _positions(self.projected_runs)

    @property
    def num_projected(self) -> int:
        """How many context rows this rank projects (``len(plan.projected_rows)``)."""
        return sum(stop - start for start, stop in self.projected_runs)

    @property
    def anchor_index(self) -> torch.Tensor:
        """This rank's anchor slots (`torch.LongTensor`), for :func:`~.objectives.select_anchors`."""
        return torch.tensor(self.anchor_slots[self.rank], dtype=torch.int64)

    @property
    def ring_members(self) -> tuple[int, ...]:
        """The group ranks of this rank's ring, in ring-rank order (they shard one copy of the context)."""
        first = self.rank - self.rank % self.ring_size
        return tuple(range(first, first + self.ring_size))

    @property
    def exchanges_context(self) -> bool:
        """Whether the ranks exchange context K/V (``cp``, ``csbp`` with ``C > 1``)."""
        return self.ring_size > 1

    @property
    def splits_anchors(self) -> bool:
        """Whether the ranks draft disjoint anchor shares (``bp``, ``csbp`` with ``P > 1``)."""
        return self.mode is not Mode.CP and self.world > 1

    @property
    def loss_scale(self) -> float:
        """What this rank's loss is multiplied by so that the group's losses add up to the single-process loss:
        ``1 / P`` under ``cp`` (every rank computes the whole loss), else 1."""
        return 1.0 / self.world if self.mode is Mode.CP else 1.0

    def select(self, batch: DFlashBatch) -> DFlashBatch:
        """This rank's anchors of ``batch`` (the batch the plan was built from)."""
        if batch.sequence_length != self.sequence_length:
            raise ValueError(f"the plan was built for sequences of {self.sequence_length} tokens, the batch has "
                             f"{batch.sequence_length}: build the plan from this batch.")
        return select_anchors(batch, self.anchor_index.to(batch.anchor_positions.device))

    def global_sum(self, comm: CommContext | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The ``global_sum`` of the D-PACE loss (`DFlashObjective.loss_from_hidden`): a sum over the group
        (``comm``: the group's, ``groups.group``) when the ranks hold disjoint anchor shares, ``None`` under ``cp``
        (each rank holds every anchor) or ``P = 1``."""
        if not self.splits_anchors:
            return None
        if comm is None:
            raise ValueError(f"mode={self.mode.value!r} with world={self.world} splits the anchors: pass the group's "
                             "CommContext to sum the D-PACE totals over it.")
        group = comm.group

        def total(value: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(value, group=group)
            return value

        return total

    def window_exchange(self, window: int) -> tuple[torch.Tensor, list[int], list[int], torch.Tensor]:
        """This rank's all-to-all of a sliding layer of window ``window``: ``(send_index, send_counts, recv_counts,
        recv_positions)``: the rows it sends to each ring peer (ring order; indices into its projected rows,
        `projected_rows`), how many to and from each ring rank (this one: 0), and the sequence indices of the rows
        it receives (ring order, which is ascending)."""
        if window not in self.window_rows:
            raise ValueError(f"the plan has no exchange for sliding window {window}; it knows windows "
                             f"{sorted(self.window_rows)}: build it with the drafter's layer_windows.")
        rows, me = self.window_rows[window], self.rank
        start, stop = self.context_range
        local, received = self.projected_rows, _index(rows[me])
        send, send_counts, recv_counts = [], [], []
        for peer in self.ring_members:
            if peer == me:
                send_counts.append(0)
                recv_counts.append(0)
                continue
            wanted = _index(rows[peer])
            held = wanted[(wanted >= start) & (wanted < stop)]
            index = torch.searchsorted(local, held)
            if bool((index >= len(local)).any()) or not torch.equal(local[index.clamp_max(len(local) - 1)], held):
                raise RuntimeError(f"rank {peer} needs rows of rank {me} that rank {me} does not project: the plan "
                                   "is inconsistent (build it with DFlashShardPlan.build).")
            send.append(index)
            send_counts.append(len(index))
            lo, hi = self.context_ranges[peer]
            recv_counts.append(int(((received >= lo) & (received < hi)).sum()))
        send_index = torch.cat(send) if send else torch.zeros(0, dtype=torch.int64)
        return send_index, send_counts, recv_counts, received


def _reachable_runs(batch: DFlashBatch, slots: Sequence[int], window: int) -> tuple[tuple[int, int], ...]:
    """The context rows the blocks of anchor ``slots`` may see on a layer of window ``W``, as maximal ascending runs
    ``[start, stop)`` of sequence indices: the union over samples and valid anchors ``a`` of
    ``[max(document start, a - W + 1), a)`` (the query at offset 0 reaches furthest back; see
    :func:`~.modeling.draft_context_mask`). Sorting the anchors' intervals costs ``O(A log A)``, not ``O(L)``."""
    index = torch.tensor(list(slots), dtype=torch.int64, device=batch.anchor_positions.device)
    stops = batch.context_stops.index_select(1, index).clamp(0, batch.sequence_length)
    starts = torch.maximum(batch.document_starts.index_select(1, index), stops - (window - 1)).clamp_min(0)
    valid = batch.anchor_valid.index_select(1, index) & (stops > starts)
    runs: list[list[int]] = []
    for start, stop in sorted(zip(starts[valid].tolist(), stops[valid].tolist())):
        if runs and start <= runs[-1][1]:  # overlapping or touching: one run
            runs[-1][1] = max(runs[-1][1], stop)
        else:
            runs.append([start, stop])
    return tuple((start, stop) for start, stop in runs)


def balanced_bounds(runs: Sequence[tuple[int, int]], length: int, parts: int) -> tuple[int, ...]:
    """``parts + 1`` cut points ``0 = b_0 <= b_1 <= ... <= b_parts = length`` of ``[0, length)`` such that range
    ``[b_c, b_{c+1})`` holds ``N (c+1) // parts - N c // parts`` of the ``N`` rows of ``runs`` (ascending disjoint
    ``[start, stop)``): the compact context's ring ranges, each rank projecting as many seen rows as any other.
    Without rows, equal shards ``length c // parts``."""
    total = sum(stop - start for start, stop in runs)
    if total == 0:
        return tuple(length * c // parts for c in range(parts + 1))
    bounds, before, run = [0], 0, 0
    for c in range(1, parts):
        target = total * c // parts  # range c starts at the target-th seen row (0-based)
        while before + runs[run][1] - runs[run][0] <= target:
            before += runs[run][1] - runs[run][0]
            run += 1
        bounds.append(runs[run][0] + target - before)
    return tuple(bounds + [length])


def _cut(runs: Sequence[tuple[int, int]], start: int, stop: int) -> tuple[tuple[int, int], ...]:
    """``runs`` cut to ``[start, stop)``."""
    return tuple((max(a, start), min(b, stop)) for a, b in runs if min(b, stop) > max(a, start))


def _positions(runs: Sequence[tuple[int, int]]) -> torch.Tensor:
    if not runs:
        return torch.zeros(0, dtype=torch.int64)
    return torch.cat([torch.arange(start, stop, dtype=torch.int64) for start, stop in runs])


def _index(rows: Sequence[int]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)


def context_bytes(plan: DFlashShardPlan, layer_windows: Sequence[int | None], *, batch_size: int,
                  kv_width: int, element_size: int) -> tuple[int, int]:
    """``(forward, backward)`` bytes of context K/V this rank receives in one step (the module docstring's formula).

    Args:
        plan ([`DFlashShardPlan`]): the step's plan.
        layer_windows (`Sequence[int | None]`): the drafter's layer windows, one per layer.
        batch_size (`int`): sequences ``b``. kv_width (`int`): ``H_kv * d``. element_size (`int`): bytes ``s``.
    """
    if not plan.exchanges_context:
        return 0, 0
    row = 2 * batch_size * kv_width * element_size  # K and V of one context row of every sequence
    start, stop = plan.context_range
    forward = backward = 0
    for window in layer_windows:
        if window is None:
            peers = (plan.ring_size - 1) * (plan.sequence_length // plan.ring_size)
            forward, backward = forward + peers * row, backward + peers * row
            continue
        rows = plan.window_rows[window]
        received = len(rows[plan.rank])
        sent = sum(int(((wanted >= start) & (wanted < stop)).sum())
                   for wanted in (_index(rows[peer]) for peer in plan.ring_members if peer != plan.rank))
        forward, backward = forward + received * row, backward + sent * row
    return forward, backward


# --- the forward ------------------------------------------------------------------------------------------------------
class _PeerRows(torch.autograd.Function):
    """The peers' K/V rows of a started exchange: forward waits for them, backward sends their gradients home (to
    ``key`` / ``value``, this rank's rows, on their owners)."""

    @staticmethod
    def forward(ctx, key, value, source, in_flight):
        ctx.source = source
        return in_flight.wait()

    @staticmethod
    def backward(ctx, grad_key, grad_value):
        grad_key, grad_value = ctx.source.start_backward(grad_key.contiguous(), grad_value.contiguous()).wait()
        return grad_key, grad_value, None, None


class ShardedContext:
    """This rank's context for one sharded forward, as each layer's attention reads it
    (:class:`~.modeling.ContextAttention`): its own projected rows (``plan.projected_rows``, ``projected`` holding
    them in that order), and the peers' K/V rows the plan says it needs.

    Built by :func:`sharded_draft_forward`; a layer's :meth:`partials` computes the layer's K/V of the own rows,
    starts their exchange, attends to the own rows meanwhile, then to the peers' rows once they arrived.
    """

    def __init__(self, plan: DFlashShardPlan, comm: CommContext | None, projected: torch.Tensor, rotary,
                 anchors: torch.Tensor, anchor_valid: torch.Tensor, document_starts: torch.Tensor, block_size: int):
        self.plan, self.comm, self.projected, self.rotary = plan, comm, projected, rotary
        self.anchors, self.anchor_valid, self.document_starts = anchors, anchor_valid, document_starts
        self.block_size = block_size
        b, device = projected.shape[0], projected.device
        self.own_positions = plan.projected_rows.to(device).expand(b, -1)
        peers = [torch.arange(*plan.context_ranges[r], device=device) for r in plan.ring_members if r != plan.rank]
        self.peer_positions = torch.cat(peers).expand(b, -1) if peers else self.own_positions[:, :0]
        self.exchanges = {}  # per sliding window: (send_index, send_counts, recv_counts, received positions [b, R])
        if plan.exchanges_context:
            for window in plan.window_rows:
                send_index, send_counts, recv_counts, received = plan.window_exchange(window)
                self.exchanges[window] = (send_index.to(device), tuple(send_counts), tuple(recv_counts),
                                          received.to(device).expand(b, -1))
        self._masks: dict = {}

    def _mask(self, window: int | None, positions: torch.Tensor, which: str) -> DraftContext:
        key = (window, which)
        if key not in self._masks:
            self._masks[key] = draft_context(
                self.anchors, positions, self.block_size, anchor_document_starts=self.document_starts,
                anchor_valid=self.anchor_valid, sliding_window=window)
        return self._masks[key]

    def partials(self, attention: DFlashAttention, query: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        window = attention.sliding_window
        key, value = attention.key_value(self.projected, self.rotary)
        own_mask = self._mask(window, self.own_positions, "own")
        if not self.plan.exchanges_context:
            return [attention.attend_context(query, key, value, own_mask)]
        if window is None:
            source = GatheredKV(key, value, self.comm, FULL_NAMES, peers_only=True)
            peer_positions = self.peer_positions
        else:
            send_index, send_counts, recv_counts, peer_positions = self.exchanges[window]
            source = ExchangedKV(key, value, self.comm, send_index, send_counts, recv_counts, WINDOW_NAMES)
        in_flight = source.start_forward(key, value)
        own = attention.attend_context(query, key, value, own_mask)  # while the peers' rows travel
        peer_key, peer_value = _PeerRows.apply(key, value, source, in_flight)
        peer_mask = self._mask(window, peer_positions, "peers")
        return [own, attention.attend_context(query, peer_key, peer_value, peer_mask)]


def sharded_draft_forward(
    drafter: DFlashDraftModel,
    target_hidden_states: torch.Tensor,
    input_ids: torch.LongTensor,
    batch: DFlashBatch,
    plan: DFlashShardPlan,
    comm: CommContext | None,
    *,
    position_ids: torch.LongTensor | None = None,
    return_logits: bool = False,
) -> DFlashDraftOutput:
    r"""
    This rank's part of the drafter's forward under ``plan``: the blocks of its anchors, attending to the whole
    context through its own feature rows and the rows its peers send (see the module docstring). Every rank of the
    group must call it (collectives), also a rank without anchors. Runs as ``fn(model, ...)``, so a trainer can pass
    it through a `TrainingStep` (DDP sees the step).

    Args:
        drafter ([`DFlashDraftModel`]): the drafter, its target bound.
        target_hidden_states (`torch.FloatTensor` of shape `[b, stop - start, feature_width]`): this rank's feature
            rows, ``plan.context_range`` of the sequence; or only the rows it projects (``[b, plan.num_projected,
            feature_width]``, the features at ``plan.projected_rows``), when the plan compacts the context.
        input_ids (`torch.LongTensor` of shape `[b, L]`): the whole token sequence.
        batch ([`DFlashBatch`]): this rank's anchors, ``plan.select(whole_batch)`` (their document starts come from
            it, so no document ids are needed).
        plan ([`DFlashShardPlan`]): the batch's plan for this rank.
        comm ([`~hf_bdlm.parallel.CommContext`], *optional*): this rank's ring (``groups.ring`` of
            `BlockParallelGroups`, the whole group under ``cp``), over which the context K/V travel; its byte meter
            records them. `None` only when nothing is exchanged (``bp``, or ``C = 1``).
        position_ids (`torch.LongTensor` of shape `[b, L]`, *optional*): RoPE positions, default ``arange(L)``.
        return_logits (`bool`, defaults to `False`): also apply the target's head (training uses
            `DFlashObjective.loss_from_hidden` on the hidden states instead).

    Returns:
        [`DFlashDraftOutput`]: ``hidden_states`` ``[b, A_rank * block_size, hidden_size]``, block after block in the
        order of ``batch``'s anchors.
    """
    b, length = input_ids.shape
    start, stop = plan.context_range
    projected = plan.num_projected
    if length != plan.sequence_length:
        raise ValueError(f"input_ids has {length} tokens, the plan was built for {plan.sequence_length}.")
    if target_hidden_states.dim() != 3 or target_hidden_states.shape[0] != b or \
            target_hidden_states.shape[1] not in (stop - start, projected):
        compact = f" or only the {projected} rows it projects (plan.projected_rows)" if projected != stop - start \
            else ""
        raise ValueError(f"target_hidden_states must be this rank's feature rows [{start}, {stop}) of the batch: "
                         f"shape [b={b}, {stop - start}, features]{compact}, got {tuple(target_hidden_states.shape)}. "
                         "Pass features[:, start:stop] with (start, stop) = plan.context_range.")
    if target_hidden_states.shape[-1] != drafter.config.feature_width:
        raise ValueError(f"target_hidden_states has {target_hidden_states.shape[-1]} features per token, the drafter "
                         f"reads {drafter.config.feature_width} (its target_layer_ids x target_hidden_size).")
    if batch.num_anchors != len(plan.anchor_slots[plan.rank]):
        raise ValueError(f"batch has {batch.num_anchors} anchor slots, this rank's plan "
                         f"{len(plan.anchor_slots[plan.rank])}: pass plan.select(batch) of the batch the plan was "
                         "built from.")
    layer_windows = [layer.self_attn.sliding_window for layer in drafter.layers]
    if missing := set(layer_windows) - {None} - set(plan.window_rows):
        raise ValueError(f"the drafter has sliding windows {sorted(missing)} the plan was not built for: build it with "
                         "layer_windows=[config.layer_window(i) for i in range(config.num_hidden_layers)].")
    if plan.compacts_context and (None in layer_windows or max(layer_windows) > plan.compact_window):
        raise ValueError(f"the plan projects only the context rows within window {plan.compact_window} of the "
                         f"anchors, but the drafter's layers have windows {layer_windows} (None: full attention): "
                         "build the plan with layer_windows=[config.layer_window(i) for i in "
                         "range(config.num_hidden_layers)].")
    if plan.exchanges_context:
        ring_rank = plan.rank % plan.ring_size
        if comm is None:
            raise ValueError(f"mode={plan.mode.value!r} with ring_size={plan.ring_size} exchanges context K/V: pass "
                             "the CommContext of this rank's ring (groups.ring).")
        if (comm.size, comm.rank) != (plan.ring_size, ring_rank):
            raise ValueError(f"the plan's ring is rank {ring_rank} of {plan.ring_size}, the CommContext '{comm.name}' "
                             f"is rank {comm.rank} of {comm.size}: pass groups.ring, and build the plan with the "
                             "group's size, rank and clean_ring_size.")
    device = input_ids.device
    if position_ids is None:
        position_ids = torch.arange(length, device=device).expand(b, length)
    elif tuple(position_ids.shape) != (b, length):
        raise ValueError(f"position_ids must have input_ids' shape {(b, length)}, got {tuple(position_ids.shape)}.")
    own = plan.projected_rows.to(device)
    if target_hidden_states.shape[1] != projected:  # the whole range was passed: keep the projected rows
        target_hidden_states = target_hidden_states.index_select(1, own - start)
    own = own.expand(b, -1)
    context = ShardedContext(plan, comm, drafter.project_context(target_hidden_states),
                             drafter.rotary(position_ids.gather(1, own)), batch.anchor_positions, batch.anchor_valid,
                             batch.document_starts, drafter.config.block_size)
    hidden_states, draft_rotary = drafter.draft_blocks(input_ids, batch.anchor_positions, position_ids)
    for layer in drafter.layers:
        hidden_states = layer(hidden_states, context, draft_rotary=draft_rotary)
    hidden_states = drafter.norm(hidden_states)
    logits = drafter.compute_logits(hidden_states) if return_logits else None
    return DFlashDraftOutput(hidden_states=hidden_states, logits=logits)


__all__ = ["DFlashShardPlan", "ShardedContext", "balanced_bounds", "context_bytes", "sharded_draft_forward"]
