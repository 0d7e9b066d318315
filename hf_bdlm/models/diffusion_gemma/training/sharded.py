"""DiffusionGemma under block parallelism: the rows each rank runs, and its attention (``cp`` / ``bp`` / ``csbp``).

DiffusionGemma trains in two passes over a *frame* (:mod:`.modeling`): the causal encoder over the ``F`` clean
rows, then the decoder over the canvas blocks, a subset of the frame's ``F / B`` blocks (the response
blocks). Both passes call the attention interface, and a rank runs both over its own rows only:

- **plan** (:func:`~hf_bdlm.parallel.plan.make_plan` with ``noisy_blocks`` = the canvas blocks): the clean rows are
  cut as the mode cuts a clean stream (``csbp``: head-tail chunks over the clean ring; ``cp``: the same over the whole
  group; ``bp``: the prefix a rank's blocks need); the canvas blocks are dealt as a sequence of their own (dual-end
  pairs), so the decoder's work and rows balance whatever the prompt length. The frame is padded to ``2P`` blocks
  and the canvas to a multiple of ``2P`` blocks with dummy blocks nobody scores (:func:`frame_padding`);
- **encoder** (per layer): queries = the rank's clean rows, keys = the clean rows of its ring (``cp``: group),
  all-gathered (``csbp``, ``cp``) or held (``bp``);
- **decoder** (per layer): queries = the rank's canvas blocks; keys = the encoder's cached clean K/V of the ring
  gathered again, plus its own canvas K/V, local (``csbp``, ``bp``); ``cp`` gathers the canvas K/V of the whole group
  too, as context parallelism of an encoder-decoder does (only their own block uses them). ``cp``'s rows are thus
  ``csbp``'s with ``C = P`` and the gathered canvas keys are all masked: the two compute the same losses bitwise and
  differ in bytes and memory only. The paper's CP baseline (``cp_layout="paper"``) computes differently: contiguous
  clean shards, a token slice of every canvas block, its transfers as :class:`~hf_bdlm.parallel.exchange.ExchangePass`
  runs them with ``blocking``;
- **exchange**: each pass is an :class:`~hf_bdlm.parallel.exchange.ExchangePass`, and the K/V exchange is
  :mod:`hf_bdlm.parallel.exchange`'s, as for :class:`~hf_bdlm.parallel.sharded.ShardedLayout`. The pass's key tensor is
  ``[clean ; canvas]`` (the encoder: clean only); a rank sends its clean head (``cp``: all of it). Its own rows are a
  local source, computed while the peers' rows are in flight; only the peers' rows are a deferred source (an
  all-gather without the own slot, or the halo's all-to-all), whose gradients travel home in backward while the
  local ones compute. With the ring transport every member's sent rows rotate through the ring instead and the
  unsent canvas is the local source;
- **sliding layers** fetch exactly the keys in their queries' reach (all-to-all,
  :func:`~hf_bdlm.attention.masks.keys_in_window` with the key streams): a clean range needs the ``W - 1`` positions
  before it, a canvas block the ``W - 1`` clean positions before its start (``block_start`` convention); no canvas
  K/V travel on sliding layers in any mode;
- **loss**: each rank scores its canvas blocks and the next-token pairs of the clean rows it counts (each clean block
  counts on one of its holders); normalizers are the whole batch's, so the ranks' losses add up to the single-device
  loss (:meth:`~.objectives.DiffusionGemmaObjective.loss`).

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

import torch

from ....attention.masks import MaskRule
from ....attention.rows import RowMeta
from ..modeling import CanvasFrame, DiffusionGemmaLayout, diffusion_gemma_rule, is_decoder_attention
from ....parallel.dims import ParallelDims
from ....parallel.exchange import ExchangePass, check_transport
from ....parallel.groups import BlockParallelGroups
from ....parallel.plan import GroupPlan, PlanConfig, noisy_subset_multiple, subset_sequence_multiple


def frame_padding(dims: ParallelDims, block_size: int) -> tuple[int | None, int | None]:
    """``(frame length multiple, canvas block count multiple)`` a layout needs (``None, None`` without sharding).

    The frame holds whole head-tail chunks of blocks (``2P`` blocks; ``2C`` for the clean ring, dealt over ``P/C``
    rings), the canvas whole dual-end pairs for every rank (``2P`` blocks; ``P`` with the ``contiguous`` schedule).
    """
    if not dims.is_sharded:
        return None, None
    return subset_sequence_multiple(dims, block_size), noisy_subset_multiple(dims)


def canvas_slots(frame: CanvasFrame, blocks, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """Canvas rows (columns of ``frame.canvas_target``) of the given frame blocks, ascending; ``offsets``: only these
    token offsets of each block (the paper's CP baseline holds a slice of every block), default all."""
    blocks = torch.as_tensor(blocks, dtype=torch.long)
    slots = torch.searchsorted(frame.canvas_blocks.cpu(), blocks)
    B = frame.block_size
    return (slots[:, None] * B + (torch.arange(B) if offsets is None else offsets)).flatten()


class ShardedDiffusionGemmaLayout:
    """One rank's rows and attention for one DiffusionGemma batch (see the module docstring).

    The same interface as :class:`~.modeling.DiffusionGemmaLayout`: ``attend`` for every attention call
    of the model, ``clean_index`` / ``canvas_index`` / ``clean_loss_index`` for the rows the step runs and scores.
    Build it with :meth:`build`.
    """

    def __init__(self, plan: GroupPlan, groups: BlockParallelGroups, frame: CanvasFrame, base_rule: MaskRule,
                 backend: str = "auto", transport: str | None = None):
        self.plan, self.groups, self.base_rule, self.backend = plan, groups, base_rule, backend
        self.transport = transport or groups.dims.transport
        check_transport(self.transport, backend)
        if tuple(frame.canvas_blocks.tolist()) != plan.config.noisy_blocks:
            raise ValueError("the plan was made for other canvas blocks than this frame's; build it from the frame.")
        self.mode = plan.config.mode
        me = groups.group_rank
        self.comm = groups.kv_exchange(self.mode)
        members = list(plan.ring_members(me))

        def clean(r: int) -> torch.Tensor:
            return plan.ranks[r].clean_position_index()

        def canvas(r: int) -> torch.Tensor:
            return canvas_slots(frame, plan.ranks[r].noisy_blocks, plan.ranks[r].noisy_offset_index())

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
        canvas_of = [canvas_rows(m) for m in members]

        def exchange(name, queries, keys, sent, member_queries, member_sent) -> ExchangePass:
            # Collectives named after the pass (the window lists cut each reach per key stream: a canvas block
            # reaches no canvas key of another block).
            return ExchangePass(self.comm, self.transport, backend, queries, keys, sent, member_queries, member_sent,
                                at, name, blocking=plan.config.dims.is_paper_cp)

        self.encoder = exchange("encoder", clean_of[at], clean_of[at], slice(0, self.num_clean), clean_of, clean_of)
        decoder_keys = RowMeta.cat([clean_of[at], canvas_of[at]])  # the decoder's keys: [cache ; canvas]
        if self.mode.sends_noisy_kv:  # every member sends both, in that order
            sent, sent_keys = [RowMeta.cat([c, n]) for c, n in zip(clean_of, canvas_of)], decoder_keys.num_rows
        else:  # the cache only: the canvas is local
            sent, sent_keys = clean_of, self.num_clean
        self.decoder = exchange("decoder", canvas_of[at], decoder_keys, slice(0, sent_keys), canvas_of, sent)

    @classmethod
    def build(cls, frame: CanvasFrame, groups: BlockParallelGroups, base_rule: MaskRule, backend: str = "auto",
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
            return p.attend(query, key, value, rule, scale)
        if not getattr(module, "is_causal", True):
            raise ValueError("the DiffusionGemma encoder must be causal for the diffusion_gemma objective.")
        if key.shape[2] != self.num_clean:
            raise ValueError(f"the encoder got {key.shape[2]} key rows for this rank's {self.num_clean} clean rows.")
        return self.encoder.attend(query, key, value, rule, scale)


def diffusion_gemma_layout(frame: CanvasFrame, groups: BlockParallelGroups | None, backend: str = "auto",
                           transport: str | None = None):
    """The rows this rank runs for ``frame``: its :class:`ShardedDiffusionGemmaLayout`, or without a block-parallel
    group (``groups`` ``None`` or ``P = 1``) every row (:meth:`DiffusionGemmaLayout.local`)."""
    if groups is None or not groups.dims.is_sharded:
        return DiffusionGemmaLayout.local(frame, backend)
    return ShardedDiffusionGemmaLayout.build(frame, groups, diffusion_gemma_rule(frame.block_size), backend, transport)


__all__ = ["ShardedDiffusionGemmaLayout", "canvas_slots", "diffusion_gemma_layout", "frame_padding"]
