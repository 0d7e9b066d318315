"""DiffusionGemma under block parallelism: the rows each rank runs, and its attention (``cp`` / ``bp`` / ``csbp``).

DiffusionGemma trains in two passes over a *frame* (:mod:`hf_bdlm.diffusion_gemma`): the causal encoder over the
``F`` clean rows, then the decoder over the canvas blocks, a subset of the frame's ``F / B`` blocks (the response
blocks). Both passes call the attention interface, and a rank runs both over its own rows only:

- **plan** (:func:`~.plan.make_plan` with ``noisy_blocks`` = the canvas blocks): the clean rows are cut as the mode
  cuts a clean stream (``csbp``: head-tail chunks over the clean ring; ``cp``: the same over the whole group; ``bp``:
  the prefix a rank's blocks need); the canvas blocks are dealt as a sequence of their own (dual-end pairs), so the
  decoder's work and rows balance whatever the prompt length. The frame is padded to ``2P`` blocks and the canvas to
  a multiple of ``2P`` blocks with dummy blocks nobody scores (:func:`frame_padding`);
- **encoder** (per layer): queries = the rank's clean rows, keys = the clean rows of its ring (``cp``: group),
  all-gathered (``csbp``, ``cp``) or held (``bp``);
- **decoder** (per layer): queries = the rank's canvas blocks; keys = the encoder's cached clean K/V of the ring
  gathered again, plus its own canvas K/V, local (``csbp``, ``bp``); ``cp`` gathers the canvas K/V of the whole group
  too, as context parallelism of an encoder-decoder does (only their own block uses them);
- **overlap** (as :mod:`.sharded`): the rank's own rows (its clean rows, and in the decoder its canvas) are a local
  source, computed while the peers' rows are in flight; only the peers' rows are a deferred source (an all-gather
  without the own slot, or the halo's all-to-all), whose gradients travel home in backward while the local ones
  compute;
- **sliding layers** fetch exactly the keys in their queries' reach (all-to-all, :func:`~hf_bdlm.attention.masks.keys_in_window`
  with the key streams): a clean range needs the ``W - 1`` positions before it, a canvas block the ``W - 1`` clean
  positions before its start (``block_start`` convention); no canvas K/V travel on sliding layers in any mode;
- **loss**: each rank scores its canvas blocks and the next-token pairs of the clean rows it counts (each clean block
  counts on one of its holders); normalizers are the whole batch's, so the ranks' losses add up to the single-device
  loss (:meth:`~hf_bdlm.objectives.diffusion_gemma.DiffusionGemmaObjective.loss`).

K/V bytes received per full-attention layer per rank (all-gather transport; ``b`` sequences, ``H_kv`` K/V heads of
dimension ``d``, ``s`` bytes per element, ``Nc`` canvas rows); backward returns the same bytes (reduce-scatter) for the
encoder and the scored decoder pass, and the self-conditioning pass (when a sample of the batch self-conditions) is
one more decoder forward:

| mode | encoder | decoder (each pass) |
|------|---------|---------------------|
| ``cp`` | ``(P-1)/P · 2·F·H_kv·d·s·b`` | ``(P-1)/P · 2·(F + Nc)·H_kv·d·s·b`` |
| ``csbp`` | ``(C-1)/C · 2·F·H_kv·d·s·b`` | ``(C-1)/C · 2·F·H_kv·d·s·b`` |
| ``bp`` | 0 | 0 |

The decoder gathers the clean K/V again instead of keeping the encoder's gathered copy: the encoder runs all its
layers before the decoder starts, so keeping them would hold the full ``F``-row K/V of every layer on every rank, the
memory ``csbp`` exists to avoid; a second all-gather per layer is overlapped with the canvas attention instead.

    torchrun --nproc_per_node 2 tests/distributed/diffusion_gemma_worker.py --out /tmp/dg.json   # the exactness matrix
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..attention.backends import attend, common_dtype
from ..attention.masks import MaskRule
from ..attention.rows import RowMeta
from ..attention.tiles import plan_attention
from ..diffusion_gemma import CanvasFrame, DiffusionGemmaLayout, diffusion_gemma_rule, is_decoder_attention
from .collectives import ExchangedKV, GatheredKV
from .dims import ParallelDims
from .groups import BlockParallelGroups
from .plan import GroupPlan, PlanConfig, noisy_subset_multiple, subset_sequence_multiple, window_exchange
from .ring import ring_attention


def frame_padding(dims: ParallelDims, block_size: int) -> tuple[int | None, int | None]:
    """``(frame length multiple, canvas block count multiple)`` a layout needs (``None, None`` without sharding).

    The frame holds whole head-tail chunks of blocks (``2P`` blocks; ``2C`` for the clean ring, dealt over ``P/C``
    rings), the canvas whole dual-end pairs for every rank (``2P`` blocks; ``P`` with the ``contiguous`` schedule).
    """
    if not dims.is_sharded:
        return None, None
    return subset_sequence_multiple(dims, block_size), noisy_subset_multiple(dims)


def canvas_slots(frame: CanvasFrame, blocks) -> torch.Tensor:
    """Canvas rows (columns of ``frame.canvas_target``) of the given frame blocks, ascending."""
    blocks = torch.as_tensor(blocks, dtype=torch.long)
    slots = torch.searchsorted(frame.canvas_blocks.cpu(), blocks)
    B = frame.block_size
    return (slots[:, None] * B + torch.arange(B)).flatten()


@dataclass
class _Pass:
    """One pass (encoder or decoder) as this rank runs it.

    ``queries``: its query rows; ``keys``: the rows of its key tensor (the encoder: its clean rows; the decoder: its
    cached clean rows, then its canvas); ``unsent``: the key sources it never sends (the decoder's canvas, except in
    ``cp``), for the ring transport; ``member_queries`` / ``member_sent``: per member of the communicator (in its
    rank order), the query rows and the key rows that member contributes; ``me``: this rank's index among them.
    """

    name: str
    queries: RowMeta
    keys: RowMeta
    unsent: list[RowMeta]
    member_queries: list[RowMeta]
    member_sent: list[RowMeta]
    me: int
    cache: dict = field(default_factory=dict)

    @property
    def peer_rows(self) -> RowMeta:
        """The rows gathered from the other members, in their rank order."""
        found = self.cache.get("peer_rows")
        if found is None:
            found = self.cache["peer_rows"] = RowMeta.cat([r for i, r in enumerate(self.member_sent) if i != self.me])
        return found


class ShardedDiffusionGemmaLayout:
    """One rank's rows and attention for one DiffusionGemma batch (see the module docstring).

    The same interface as :class:`~hf_bdlm.diffusion_gemma.DiffusionGemmaLayout`: ``attend`` for every attention call
    of the model, ``clean_index`` / ``canvas_index`` / ``clean_loss_index`` for the rows the step runs and scores.
    Build it with :meth:`build`.
    """

    def __init__(self, plan: GroupPlan, groups: BlockParallelGroups, frame: CanvasFrame, base_rule: MaskRule,
                 backend: str = "blockwise", transport: str | None = None):
        self.plan, self.groups, self.base_rule, self.backend = plan, groups, base_rule, backend
        self.transport = transport or groups.dims.transport
        if self.transport == "ring" and backend != "blockwise":
            raise ValueError(
                f"the ring transport runs the block-sparse kernels of attention_backend='blockwise'; got "
                f"attention_backend={backend!r}. Use 'blockwise' or block_parallel_transport='allgather'."
            )
        if tuple(frame.canvas_blocks.tolist()) != plan.config.noisy_blocks:
            raise ValueError("the plan was made for other canvas blocks than this frame's; build it from the frame.")
        self.mode = plan.config.mode
        me = groups.group_rank
        self.comm = groups.kv_exchange(self.mode)
        members = list(plan.ring_members(me))

        def clean(r: int) -> torch.Tensor:
            return plan.ranks[r].clean_position_index()

        def canvas(r: int) -> torch.Tensor:
            return canvas_slots(frame, plan.ranks[r].noisy_blocks)

        def clean_rows(r: int) -> RowMeta:
            return frame.clean_rows.select(clean(r).to(frame.clean_rows.pos.device))

        def canvas_rows(r: int) -> RowMeta:
            return frame.canvas_rows.select(canvas(r).to(frame.canvas_rows.pos.device))

        device = frame.clean_ids.device
        self.clean_index = clean(me).to(device)
        self.canvas_index = canvas(me).to(device)
        counted = torch.zeros(frame.frame_length, dtype=torch.bool)
        for s, e in plan.ranks[me].loss_clean_positions:
            counted[s:e] = True
        self.clean_loss_index = counted[clean(me)].nonzero().flatten().to(device)
        self.num_clean = int(self.clean_index.numel())
        at = members.index(me)
        clean_of = [clean_rows(m) for m in members]
        self.encoder = _Pass("encoder", clean_of[at], clean_of[at], [], clean_of, clean_of, at)
        decoder_keys = RowMeta.cat([clean_of[at], canvas_rows(me)])  # the decoder's keys: [cache ; canvas]
        if self.mode.sends_noisy_kv:  # every member sends both, in that order
            sent, unsent = [RowMeta.cat([clean_of[i], canvas_rows(m)]) for i, m in enumerate(members)], []
        else:
            sent, unsent = clean_of, [canvas_rows(me)]
        self.decoder = _Pass("decoder", canvas_rows(me), decoder_keys, unsent, [canvas_rows(m) for m in members],
                             sent, at)

    @classmethod
    def build(cls, frame: CanvasFrame, groups: BlockParallelGroups, base_rule: MaskRule, backend: str = "blockwise",
              transport: str | None = None) -> "ShardedDiffusionGemmaLayout":
        """The layout of ``frame`` on this rank: the group's (cached, agreed) plan of its canvas blocks."""
        config = PlanConfig.from_dims(groups.dims, frame.frame_length, frame.block_size,
                                      tuple(frame.canvas_blocks.tolist()))
        return cls(groups.plan(config), groups, frame, base_rule, backend, transport)

    # --- attention -------------------------------------------------------------------------------------------
    def attend(self, module, query, key, value, rule: MaskRule, scale: float) -> torch.Tensor:
        if is_decoder_attention(module):
            p, n = self.decoder, self.num_clean
            if key.shape[2] != n + p.queries.num_rows:
                raise ValueError(
                    f"the decoder got {key.shape[2]} key rows, expected {n} cached clean rows of this rank + "
                    f"{p.queries.num_rows} canvas rows: run the encoder with this layout and a DynamicCache() first."
                )
            sent = (key, value) if self.mode.sends_noisy_kv else (key[:, :, :n], value[:, :, :n])
            return self._attend(p, query, key, value, sent, rule, scale)
        if not getattr(module, "is_causal", True):
            raise ValueError("the DiffusionGemma encoder must be causal for the diffusion_gemma objective.")
        if key.shape[2] != self.num_clean:
            raise ValueError(f"the encoder got {key.shape[2]} key rows for this rank's {self.num_clean} clean rows.")
        return self._attend(self.encoder, query, key, value, (key, value), rule, scale)

    def _attend(self, p: _Pass, query, key, value, sent: tuple, rule: MaskRule, scale: float) -> torch.Tensor:
        """``query`` over this rank's own keys (local) and the peers' rows of ``sent`` (deferred)."""
        if self.comm.size > 1 and rule.sliding_window is None and self.transport == "ring":
            return self._attend_ring(p, query, key, value, sent, rule, scale)
        sources, rows = [(key, value)], [p.keys]
        if self.comm.size > 1 and rule.sliding_window is not None:
            # The peers' rows within the window (the halo) arrive by an all-to-all the kernel overlaps.
            send_index, send_counts, recv_counts, recv_rows = self._window_exchange(p, rule, key.device)
            sources.append(ExchangedKV(*sent, self.comm, send_index, send_counts, recv_counts,
                                       (f"{p.name}_k_window", f"{p.name}_v_window")))
            rows.append(recv_rows)
        elif self.comm.size > 1:
            # The peers' rows arrive by an all-gather the kernel starts first and overlaps with the local source.
            sources.append(GatheredKV(*sent, self.comm, (f"{p.name}_k", f"{p.name}_v"), peers_only=True))
            rows.append(p.peer_rows)
        return attend(self.backend, query, sources, p.queries, rows, rule, scale, p.cache)

    def _window_exchange(self, p: _Pass, rule: MaskRule, device: torch.device):
        """Rows each member needs from each other under a window, as all-to-all send/recv lists (cached per rule; the
        send index on ``device``, where the rows are)."""
        key = ("window_exchange", rule)
        found = p.cache.get(key)
        if found is not None:
            return found
        send_index, send_counts, recv_counts, recv_rows = window_exchange(p.me, p.member_queries, p.member_sent, rule,
                                                                          key_streams=True)
        found = (send_index.to(device), tuple(send_counts), tuple(recv_counts), recv_rows)
        p.cache[key] = found
        return found

    def _attend_ring(self, p: _Pass, query, key, value, sent: tuple, rule: MaskRule, scale: float):
        """The ring transport: every member's sent rows rotate through (the own shard first); the unsent canvas is
        the only local source."""
        unsent = [(key[:, :, self.num_clean :], value[:, :, self.num_clean :])] if p.unsent else []
        same = p.cache.get("ring_same_documents")
        if same is None:  # the rows are fixed for the pass: one check, not one per layer
            rows = [p.queries, *p.unsent, *p.member_sent]
            same = p.cache["ring_same_documents"] = all(bool((r.doc == r.doc[:1]).all()) for r in rows
                                                         if r.doc is not None)
        items = [None] if same else list(range(query.shape[0]))
        outs = []
        for item in items:
            sl = slice(None) if item is None else slice(item, item + 1)
            local_plans, shard_plans = self._ring_plans(p, rule, item or 0)
            q, converted = common_dtype(query[sl], [(k[sl], v[sl]) for k, v in unsent + [sent]])
            outs.append(ring_attention(self.comm, q, converted[-1], converted[:-1], local_plans, shard_plans, scale))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)

    def _ring_plans(self, p: _Pass, rule: MaskRule, item: int):
        key = ("ring_plans", rule, item)
        found = p.cache.get(key)
        if found is None:
            q = p.queries.batch_item(item)
            local = [plan_attention(q, [rows.batch_item(item)], rule) for rows in p.unsent]
            shards = [plan_attention(q, [rows.batch_item(item)], rule) for rows in p.member_sent]
            found = p.cache[key] = (local, shards)
        return found


def diffusion_gemma_layout(frame: CanvasFrame, groups: BlockParallelGroups | None, backend: str = "blockwise",
                           transport: str | None = None):
    """The rows this rank runs for ``frame``: its :class:`ShardedDiffusionGemmaLayout`, or without a block-parallel
    group (``groups`` ``None`` or ``P = 1``) every row (:meth:`DiffusionGemmaLayout.local`)."""
    if groups is None or not groups.dims.is_sharded:
        return DiffusionGemmaLayout.local(frame, backend)
    return ShardedDiffusionGemmaLayout.build(frame, groups, diffusion_gemma_rule(frame.block_size), backend, transport)


__all__ = ["ShardedDiffusionGemmaLayout", "canvas_slots", "diffusion_gemma_layout", "frame_padding"]
