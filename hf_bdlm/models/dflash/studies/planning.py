"""Projected DFlash drafter training on a cluster: every layout's step time, peak memory and fit, from counted work.

The drafter's step is a workload of the planner (:class:`DrafterStep`, a :class:`hf_bdlm.planner.workload.Workload`):
this module counts what the step puts on each rank (anchors, context pairs, reachable rows, FLOPs, K/V rows, memory
terms); the planner prices it as it prices a backbone's (:func:`~hf_bdlm.planner.workload.price_step`: the segments
scheduled across the group, FSDP2's traffic, the peak against the device) and picks among the layouts
(:func:`~hf_bdlm.planner.workload.recommend`).

A drafter trains on one sequence of ``L`` tokens per group and step: the target's features at its ``target_layer_ids``
(captured offline, ``F = len(ids) x H_target`` wide), ``A`` anchors and their blocks of ``B`` tokens. The layouts are
the project's :class:`~hf_bdlm.parallel.dims.ParallelDims` over the ``P`` ranks of a group (``D = W / P`` groups train
on different sequences): ``cp`` shards the context over the group and runs every anchor on every rank (the CP-only
drafter layout the paper compares against; its K/V rotate in a ring); ``bp`` replicates the context and deals the
anchors (:func:`~.objectives.deal_anchors`, heaviest with lightest); ``csbp`` shards the context over clean rings of
``C`` ranks and deals the anchors over the group. Per rank and step (:func:`drafter_work` counts it from the
objective's own anchor draw, :func:`~.objectives.DFlashObjective.prepare`):

- features: the rank's context shard (``L / C`` rows; where :mod:`.sharded` compacts the context, only the rows it
  projects) read from host memory over PCIe while the previous step computes (two buffers on the device: the step's
  and the next), or kept resident (``features="resident"``, one buffer);
- context: ``fc`` + ``hidden_norm`` and every layer's ``k_proj`` / ``v_proj`` over the rows of its shard that some query
  of its clean ring can see (the whole shard unless every layer slides: then the union of the anchors' windows, as
  the paper's code and :mod:`.sharded` compact them, :mod:`.sharded` with shards cut to hold as many seen rows each;
  ``compact_context=False``: the whole shard);
  ``fc`` has no input gradient (the features are detached);
- draft: its anchors' ``A_r x B`` rows through every layer (attention and MLP matrices, DFlash2's kernel projections),
  their attention over the block (``B^2`` pairs, ``B(B+1)/2`` causal) and over the context each query sees
  (:func:`~.modeling.draft_context_mask`: ``[start, a)``, cut to ``a + k - (W-1)`` on a sliding layer);
- head: the target's frozen head on the supervised rows, three matmuls (forward, its recomputation in backward, the
  input gradient), and the candidate selector;
- K/V: per layer each rank receives context K/V rows of its clean-ring peers (``R`` rows forward, ``R'`` backward;
  :func:`kv_bytes`: ``sum over layers of (R + R') x 2 x kv_heads x head_dim x 2`` bytes). ``ring`` (the paper's
  code): every share, padded to the ring's largest projected share in 256-row tiles (``S``), visits every rank:
  ``R = (C-1) S``, ``R' = (C-1) S + C S`` (the K/V again, then dK/dV). ``allgather`` (this project's sharded forward,
  :mod:`.sharded`): a full-attention layer all-gathers the peers' shards, ``R = R' = (C-1) L / C``; a sliding layer
  exchanges exactly the peers' rows in reach of the rank's anchors (``R``) and gets back the gradients of its own
  rows the peers received (``R'``);
- FSDP2 over the world, as the planner prices it for every workload (:func:`~hf_bdlm.planner.workload.schedule_step`).

Time uses the planner's figures and conventions throughout (:mod:`hf_bdlm.planner`: :func:`device_spec`'s achievable
rates, 2 FLOPs per multiply-add, 4 / 10 attention FLOPs per pair and head dim forward / backward, the link model and
:func:`~hf_bdlm.planner.schedule.simulate`: each layer's transfer overlaps the local attention and the draft matrices);
memory its :class:`~hf_bdlm.planner.workload.Recipe` (bf16 states, AdamW's fp32 moments, FSDP2 over the world, the
loss's ``chunk_rows x vocabulary`` logits). The paper's setting priced with it, beside the published speed-ups, is
:mod:`.projection`.

    python -c "from hf_bdlm.models.dflash.studies.planning import *; from hf_bdlm.models.dflash.studies.projection import \\
PUBLISHED_DFLASH2; from hf_bdlm.planner import Cluster, device_spec; from hf_bdlm.parallel.dims import ParallelDims; \\
print(predict_drafter(DrafterSpec.from_config(PUBLISHED_DFLASH2), ParallelDims(8, 8, 'csbp'), DrafterSetting(1 << 20, \\
draws=1), device_spec('h100'), Cluster(8, 8)).step_s)"
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Sequence

import torch

from ....parallel.dims import ParallelDims, divisors
from ....planner.hardware import DEFAULT_EFFICIENCY, DeviceSpec
from ....planner.model import AttentionShape, ModelSpec
from ....planner.schedule import Compute, Send, Wait
from ....planner.workload import (BWD_ATTN_FLOPS_PER_PAIR_HEAD_DIM, FWD_ATTN_FLOPS_PER_PAIR_HEAD_DIM, Cluster,
                                 LayoutPrediction, MemoryParts, PricedStep, Recipe, StepTerms, price_step, recommend)
from ..configuration import DFlashConfig
from ..training.objectives import DFlashBatch, DFlashObjective, active_anchor_slots, anchor_costs, deal_anchors
from ..training.sharded import balanced_bounds

# The paper's recipe draws 2048 anchors per sequence: a DrafterSetting's default.
PAPER_ANCHORS = 2048
# Host -> device feature reads: PCIe Gen5 x16 per GPU ("NVIDIA H100 Tensor Core GPU Datasheet", SXM: 128 GB/s, both
# directions together), one direction, at the planner's achievable link fraction. Host memory and storage behind it
# are assumed not to be the bottleneck.
HOST_LINK_BYTES_PER_S = 64e9 * DEFAULT_EFFICIENCY["link"]
# The ring transport pads every share to a whole number of 256-row attention tiles (at least one).
RING_TILE_ROWS = 256
FEATURES = ("host", "resident")
PARTS = ("draft layers", "attention", "context projection", "head and loss", "exposed communication",
         "waiting for peers", "FSDP2 exposed", "feature reads exposed")


# ----------------------------------------------------------------------------------------------
# the drafter's sizes
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DrafterSpec:
    """What the cost model needs of a drafter: its layers as the planner's :class:`ModelSpec` (attention shapes and
    windows, MLP width, the target's vocabulary; its untied "embeddings" are the target's frozen embedding and head),
    the feature width ``fc`` reads, and DFlash2's extras.

    Parameters:
        model (`ModelSpec`): the drafter's layers; ``block_size`` is the draft block.
        feature_width (`int`): ``len(target_layer_ids) x target_hidden_size``.
        block_causal (`tuple[bool, ...]`): per layer, whether a block attends to itself causally.
        conv_taps (`int`), conv_width (`int`): DFlash2's convolution taps and each kernel projection's outputs
            (``2 x taps x hidden / group_size``); 0 for DFlash.
        selector_rank (`int`), selector_top_k (`int`): DFlash2's candidate selector (0 for DFlash).
    """

    model: ModelSpec
    feature_width: int
    block_causal: tuple[bool, ...]
    conv_taps: int = 0
    conv_width: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0

    @classmethod
    def from_config(cls, config: DFlashConfig | dict, name: str | None = None) -> "DrafterSpec":
        """The spec of a :class:`DFlashConfig` or its ``config.json`` dict."""
        if isinstance(config, dict):
            config = DFlashConfig.from_dict(config)
        if not isinstance(config, DFlashConfig):
            raise TypeError(f"DrafterSpec.from_config takes a DFlashConfig or its config.json dict, got "
                            f"{type(config).__name__}.")
        n = config.num_hidden_layers
        layers = tuple(AttentionShape(config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                                      config.layer_window(i)) for i in range(n))
        model = ModelSpec(name=name or config.architecture, hidden=config.hidden_size, vocab=config.vocab_size,
                          layers=layers, intermediate=config.intermediate_size, tie_embeddings=False,
                          block_size=config.block_size)
        method = config.dflash_config
        taps = method.get("conv_kernel_size") or 0
        width = 2 * taps * (config.hidden_size // method["conv_group_size"]) if taps else 0
        return cls(model, config.feature_width, tuple(config.layer_block_causal(i) for i in range(n)), taps, width,
                   method.get("selector_rank") or 0, method.get("selector_top_k") or 0)

    @property
    def block_size(self) -> int:
        return self.model.block_size

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def context_window(self) -> int | None:
        """The widest window when every layer slides (the context rows any query can see lie within it of its
        anchor), else ``None`` (a full-attention layer sees the whole context before its anchor)."""
        windows = [a.window for a in self.model.layers]
        return None if any(w is None for w in windows) else max(windows)

    def layer_matrix_params(self, i: int) -> int:
        """Matrix weights a draft row runs through in layer ``i``: q, k, v, o, the MLP, both kernel projections."""
        return self.model.layer_active_params(i) + 2 * self.model.hidden * self.conv_width

    def layer_params(self, i: int) -> int:
        """Layer ``i``'s weights: attention, MLP, the four norms, both convolutions (projection, base kernel)."""
        h, a = self.model.hidden, self.model.layers[i]
        convs = 2 * (h * self.conv_width + 2 * self.conv_taps * h)
        return self.model.attention_params(i) + self.model.mlp_params() + 2 * h + 2 * a.head_dim + convs

    def root_params(self) -> int:
        """Trainable weights outside the layers: ``fc``, the norms, the candidate selector."""
        h, rank = self.model.hidden, self.selector_rank
        return self.feature_width * h + 2 * h + 2 * self.model.vocab * rank + rank * h

    def trainable_params(self) -> int:
        return sum(self.layer_params(i) for i in range(self.num_layers)) + self.root_params()

    def frozen_params(self) -> int:
        """The target's input embedding and LM head (bound, frozen, replicated on every rank)."""
        return self.model.embedding_params()

    def kv_row_bytes(self, i: int, elem_bytes: int) -> int:
        """One context row's K and V in layer ``i``."""
        a = self.model.layers[i]
        return 2 * a.kv_heads * a.head_dim * elem_bytes

    def activation_elements_per_row(self, i: int) -> int:
        """What a draft row keeps for backward in layer ``i``: the planner's decoder-layer estimate, plus the two
        convolutions' inputs and dynamic kernels."""
        return self.model.activation_elements_per_row(i) + (2 * (self.model.hidden + self.conv_width)
                                                            if self.conv_width else 0)


# ----------------------------------------------------------------------------------------------
# FLOPs (2 per multiply-add; one forward pass unless said otherwise)
# ----------------------------------------------------------------------------------------------
def draft_layer_flops(spec: DrafterSpec, i: int, rows: int) -> int:
    """Forward matmul FLOPs of ``rows`` draft rows through layer ``i`` (attention scores excluded)."""
    return 2 * rows * spec.layer_matrix_params(i)


def context_projection_flops(spec: DrafterSpec, rows: int) -> int:
    """Forward FLOPs of ``fc`` over ``rows`` context rows."""
    return 2 * rows * spec.feature_width * spec.model.hidden


def context_kv_flops(spec: DrafterSpec, i: int, rows: int) -> int:
    """Forward FLOPs of layer ``i``'s context ``k_proj`` and ``v_proj`` over ``rows`` projected context rows."""
    a = spec.model.layers[i]
    return 2 * rows * spec.model.hidden * 2 * a.kv_heads * a.head_dim


def head_flops(spec: DrafterSpec, rows: int) -> int:
    """Forward FLOPs of the frozen LM head over ``rows`` rows."""
    return rows * spec.model.head_flops_per_row()


def selector_flops(spec: DrafterSpec, rows: int) -> int:
    """Forward FLOPs of the candidate selector over ``rows`` supervised rows (the hidden projection, the scores of
    ``top_k`` candidates)."""
    return 2 * rows * spec.selector_rank * (spec.model.hidden + spec.selector_top_k)


def forward_matmul_flops(spec: DrafterSpec, context_rows: int, draft_rows: int, head_rows: int) -> int:
    """Matmul FLOPs of one drafter forward: ``fc`` and every layer's context K/V over ``context_rows``, the layers over
    ``draft_rows``, the head over ``head_rows`` (attention scores and the selector excluded)."""
    layers = range(spec.num_layers)
    return (context_projection_flops(spec, context_rows) + head_flops(spec, head_rows)
            + sum(context_kv_flops(spec, i, context_rows) + draft_layer_flops(spec, i, draft_rows) for i in layers))


def step_flops(spec: DrafterSpec, context_rows: int, draft_rows: int, supervised_rows: int,
               pairs: Sequence[int], checkpointing: bool = False) -> dict[str, float]:
    """FLOPs one training step executes, by part: forward and backward (``fc``: no input gradient; the head: no
    weight gradient, its logits recomputed in backward), with ``checkpointing`` the layers' forward twice.
    ``pairs[i]``: layer ``i``'s attention pairs (block and context)."""
    passes = 4 if checkpointing else 3  # forward (twice with checkpointing), input gradient, weight gradient
    layers = range(spec.num_layers)
    attention = sum(p * spec.model.layers[i].heads * spec.model.layers[i].head_dim for i, p in zip(layers, pairs))
    fwd_attn = FWD_ATTN_FLOPS_PER_PAIR_HEAD_DIM * (2 if checkpointing else 1)
    return {
        "context projection": 2 * context_projection_flops(spec, context_rows),
        "context K/V": passes * sum(context_kv_flops(spec, i, context_rows) for i in layers),
        "draft layers": passes * sum(draft_layer_flops(spec, i, draft_rows) for i in layers),
        "attention": attention * (fwd_attn + BWD_ATTN_FLOPS_PER_PAIR_HEAD_DIM),
        "head and loss": 3 * (head_flops(spec, supervised_rows) + selector_flops(spec, supervised_rows)),
    }


# ----------------------------------------------------------------------------------------------
# what each rank of a group computes, holds and receives
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DrafterRankWork:
    """One rank's share of a step (one sequence per group).

    ``shard`` the context rows ``[start, stop)`` it owns; ``projected_rows`` those it projects (``fc``, every layer's
    K/V); ``feature_rows`` those whose features it reads and holds (the shard, or only the projected rows where the
    sharded forward compacts the context); ``ring`` its clean ring's size. Per layer: ``block_pairs`` among its blocks'
    own tokens, ``own_pairs`` / ``peer_pairs`` its queries' context pairs against its shard / the peers' shards;
    ``recv_rows`` / ``recv_grad_rows`` the context K/V rows it receives forward / backward (the module docstring);
    ``held_rows`` the peers' rows it keeps for backward.
    """

    anchors: int
    supervised_rows: int
    shard: tuple[int, int]
    projected_rows: int
    ring: int
    feature_rows: int
    block_pairs: tuple[int, ...]
    own_pairs: tuple[int, ...]
    peer_pairs: tuple[int, ...]
    recv_rows: tuple[int, ...]
    recv_grad_rows: tuple[int, ...]
    held_rows: tuple[int, ...]

    @property
    def shard_rows(self) -> int:
        return self.shard[1] - self.shard[0]


def anchor_shares(spec: DrafterSpec, dims: ParallelDims, batch: DFlashBatch) -> list[torch.Tensor]:
    """The anchor slots each rank of a group runs: all active ones on every rank (``cp``), else dealt by
    :func:`~.objectives.deal_anchors` on their attention cost summed over the layers
    (:func:`~.objectives.anchor_costs`)."""
    active = active_anchor_slots(batch)
    P = dims.block_parallel_size
    if dims.mode == "cp":
        return [active] * P
    costs = sum(anchor_costs(batch, sliding_window=a.window) for a in spec.model.layers)
    return [active[mine] for mine in deal_anchors(costs[active], P)]


def _context_pairs(anchors: torch.Tensor, starts: torch.Tensor, block: int, window: int | None,
                   shard: tuple[int, int]) -> tuple[int, int]:
    """Context pairs of the blocks of ``anchors`` (all, and against ``shard``): query ``k`` of anchor ``a`` sees
    ``[start, a)``, cut to ``[a + k - (W - 1), a)`` on a sliding layer."""
    k = torch.arange(block)
    hi = anchors[:, None].expand(-1, block)
    lo = starts[:, None].expand(-1, block)
    if window is not None:
        lo = torch.maximum(lo, anchors[:, None] + k - (window - 1))
    total = (hi - lo).clamp_min(0).sum()
    own = (hi.clamp_max(shard[1]) - lo.clamp_min(shard[0])).clamp_min(0).sum()
    return int(total), int(own)


def reachable_runs(anchors: torch.Tensor, starts: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows some query of ``anchors`` can see when every layer slides (widest window ``window``), as maximal
    ascending runs ``[lo, hi)`` (two tensors): the union of ``[max(start, a - (W - 1)), a)``, merged."""
    if anchors.numel() == 0:
        return anchors.new_zeros(0), anchors.new_zeros(0)
    lo, order = torch.maximum(starts, anchors - (window - 1)).sort()
    hi = anchors[order]
    reach = hi.cummax(0).values
    # An interval opens a new run where it starts past everything before it; a run ends at its running maximum.
    opens = torch.ones_like(lo, dtype=torch.bool)
    opens[1:] = lo[1:] > reach[:-1]
    first = opens.nonzero().flatten()
    last = torch.cat([first[1:] - 1, torch.tensor([lo.numel() - 1])])
    run_lo, run_hi = lo[first], reach[last]
    keep = run_hi > run_lo
    return run_lo[keep], run_hi[keep]


def reachable_rows(anchors: torch.Tensor, starts: torch.Tensor, window: int, shard: tuple[int, int]) -> int:
    """Rows of ``shard`` that some query of ``anchors`` can see when every layer slides (widest window ``window``):
    :func:`reachable_runs` cut to the shard."""
    run_lo, run_hi = reachable_runs(anchors, starts, window)
    return int((run_hi.clamp_max(shard[1]) - run_lo.clamp_min(shard[0])).clamp_min(0).sum())


def drafter_work(spec: DrafterSpec, dims: ParallelDims, batch: DFlashBatch,
                 compact_context: bool = True) -> tuple[DrafterRankWork, ...]:
    """Every rank's share of a group's step on ``batch`` (its first sample; :meth:`DFlashObjective.prepare`'s draw).

    Rank ``r`` belongs to clean ring ``r // C`` and holds context shard ``r % C`` (``[L s / C, L (s+1) / C)``, the
    mesh's layout); a ring projects the rows of its shards that its members' anchors can see (``compact_context``
    and every layer sliding), else whole shards. Compacted under the ``allgather`` transport (:mod:`.sharded`), a
    ring's shards are cut to hold as many seen rows each (:func:`~.sharded.balanced_bounds`) and a rank reads only
    the features of the rows it projects; the ``ring`` transport (the paper's code) keeps equal shards and reads them
    whole.
    """
    P, C, B, L = dims.block_parallel_size, dims.clean_ring_size, spec.block_size, batch.sequence_length
    if batch.block_size != B:
        raise ValueError(f"the batch has blocks of {batch.block_size} tokens, the drafter {B}; prepare it with "
                         f"block_size={B}.")
    shares = anchor_shares(spec, dims, batch)
    positions, starts = batch.anchor_positions[0], batch.document_starts[0]
    supervised = batch.supervised_mask[0].view(-1, B).sum(dim=1)
    window = spec.context_window() if compact_context else None
    balanced = window is not None and dims.transport != "ring"
    bounds, projected = {}, []  # bounds per ring (its first rank)
    for r in range(P):
        first = r // C * C
        if first not in bounds:
            ring_anchors = torch.cat([shares[m] for m in range(first, first + C)])
            if balanced:
                runs = list(zip(*(t.tolist() for t in reachable_runs(positions[ring_anchors], starts[ring_anchors],
                                                                     window))))
                bounds[first] = balanced_bounds(runs, L, C)
            else:
                bounds[first] = tuple(L * s // C for s in range(C + 1))
        shard = (bounds[first][r % C], bounds[first][r % C + 1])
        if window is None:
            projected.append(shard[1] - shard[0])
            continue
        ring_anchors = torch.cat([shares[m] for m in range(first, first + C)])
        projected.append(reachable_rows(positions[ring_anchors], starts[ring_anchors], window, shard))
    out = []
    windows = {a.window for a in spec.model.layers}
    for r, mine in enumerate(shares):
        ring_bounds = bounds[r // C * C]
        shard = (ring_bounds[r % C], ring_bounds[r % C + 1])
        ring = range(r // C * C, r // C * C + C)
        peers = [q for q in ring if q != r]
        shard_of = {q: (ring_bounds[q % C], ring_bounds[q % C + 1]) for q in ring}
        context = {w: _context_pairs(positions[mine], starts[mine], B, w, shard) for w in windows}

        def moved(window):  # rows received forward, backward, and kept, per layer of this window
            if not peers:
                return 0, 0, 0
            if dims.transport == "ring":  # every share, padded to the largest in whole tiles, visits every rank
                largest = max(projected[q] for q in ring)
                share = max(RING_TILE_ROWS, math.ceil(largest / RING_TILE_ROWS) * RING_TILE_ROWS)
                return (C - 1) * share, (2 * C - 1) * share, share
            if window is None:  # the all-gather of whole (equal-size) shards, and its reduce-scatter
                share = max(stop - start for start, stop in shard_of.values())
                return (C - 1) * share, (C - 1) * share, C * share
            # The window's all-to-all: the peers' rows in reach of my anchors; back, the gradients of my rows they took.
            got = sum(reachable_rows(positions[mine], starts[mine], window, shard_of[q]) for q in peers)
            gave = sum(reachable_rows(positions[shares[q]], starts[shares[q]], window, shard) for q in peers)
            return got, gave, got

        exchange = {w: moved(w) for w in windows}
        recv, grads, held = zip(*(exchange[a.window] for a in spec.model.layers))
        n = int(mine.numel())
        out.append(DrafterRankWork(
            anchors=n, supervised_rows=int(supervised[mine].sum()), shard=shard, projected_rows=projected[r], ring=C,
            feature_rows=projected[r] if balanced else shard[1] - shard[0],
            block_pairs=tuple(n * (B * (B + 1) // 2 if causal else B * B) for causal in spec.block_causal),
            own_pairs=tuple(context[a.window][1] for a in spec.model.layers),
            peer_pairs=tuple(context[a.window][0] - context[a.window][1] for a in spec.model.layers),
            recv_rows=recv, recv_grad_rows=grads, held_rows=held))
    return tuple(out)


def kv_bytes_by_name(spec: DrafterSpec, work: DrafterRankWork, elem_bytes: int = 2) -> dict[str, int]:
    """Context K/V bytes a rank receives per step, every layer: forward (``context_kv``) and backward
    (``context_kv_backward``: the K/V again on the ring, the gradients of its rows elsewhere)."""
    layers = range(spec.num_layers)
    return {"context_kv": sum(work.recv_rows[i] * spec.kv_row_bytes(i, elem_bytes) for i in layers),
            "context_kv_backward": sum(work.recv_grad_rows[i] * spec.kv_row_bytes(i, elem_bytes) for i in layers)}


def kv_bytes(spec: DrafterSpec, work: DrafterRankWork, elem_bytes: int = 2) -> int:
    """K/V bytes a rank receives per step, forward and backward, every layer (the module docstring's formula)."""
    return sum(kv_bytes_by_name(spec, work, elem_bytes).values())


# ----------------------------------------------------------------------------------------------
# memory
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DrafterMemory(MemoryParts):
    """Peak bytes of one rank, by part (their sum is :attr:`total`)."""

    states: float  # trainable parameters, gradients and AdamW moments (sharded by FSDP2), gathered FSDP units
    frozen: float  # the target's embedding and head
    features: float  # the context shard's features, each buffer
    activations: float  # the draft rows' saved activations
    context: float  # the projected context rows and every layer's context K/V
    gathered_kv: float  # the peers' K/V
    logits: float  # one loss chunk's fp32 logits and their gradient


def drafter_memory(spec: DrafterSpec, dims: ParallelDims, work: DrafterRankWork, recipe: Recipe,
                   checkpointing: bool, feature_buffers: int) -> DrafterMemory:
    """A rank's peak memory, with the planner's :class:`Recipe` (element sizes, FSDP2, the loss chunk)."""
    s = recipe.activation_bytes
    W = dims.world_size or dims.block_parallel_size
    n = spec.trainable_params()
    states = n * (recipe.param_bytes + recipe.grad_bytes + recipe.optimizer_bytes) / (W if recipe.fsdp else 1)
    if recipe.fsdp and W > 1:
        biggest = max(spec.layer_params(i) for i in range(spec.num_layers))
        states += (recipe.fsdp_prefetch_layers * biggest * recipe.param_bytes + biggest * recipe.grad_bytes
                   + spec.root_params() * (recipe.param_bytes + recipe.grad_bytes))
    rows = work.anchors * spec.block_size
    per_layer = [spec.activation_elements_per_row(i) * s for i in range(spec.num_layers)]
    kv = [spec.kv_row_bytes(i, s) for i in range(spec.num_layers)]
    gathered = [rows_ * row for rows_, row in zip(work.held_rows, kv)]
    if checkpointing:  # each layer's input kept, one layer's activations, context K/V and gathered K/V at a time
        acts = rows * spec.model.hidden * s * spec.num_layers + rows * max(per_layer)
        context_kv, peer_kv = max(kv) * work.projected_rows, max(gathered)
    else:
        acts = rows * sum(per_layer)
        context_kv, peer_kv = sum(kv) * work.projected_rows, sum(gathered)
    return DrafterMemory(
        states=states, frozen=spec.frozen_params() * recipe.param_bytes,
        features=feature_buffers * work.feature_rows * spec.feature_width * s,
        activations=acts * recipe.activation_overhead,
        context=work.projected_rows * 2 * spec.model.hidden * s + context_kv, gathered_kv=peer_kv,
        logits=min(work.supervised_rows, recipe.loss_chunk_rows) * spec.model.vocab * 4 * 2)


# ----------------------------------------------------------------------------------------------
# time
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DrafterSetting:
    """What a step trains and how its features arrive.

    Parameters:
        seq_len (`int`): context ``L`` (one sequence per group and step, one document, every token supervised).
        max_anchors (`int`, 2048), anchor_sampling (`str`, "locality"): the objective's draw.
        features (`str`, "host"): ``"host"``: read from host memory each step over ``host_bytes_per_s``, prefetched
            during the previous step (two buffers on the device); ``"resident"``: already on the device (one buffer).
        compact_context (`bool`, True): project only the context rows some query can see when every layer slides.
        draws (`int`, 4): anchor draws (steps) averaged over; seed (`int`, 0): the objective's seed.
        host_bytes_per_s (`float`): per-GPU host -> device bandwidth (:data:`HOST_LINK_BYTES_PER_S`).
    """

    seq_len: int
    max_anchors: int = PAPER_ANCHORS
    anchor_sampling: str = "locality"
    features: str = "host"
    compact_context: bool = True
    draws: int = 4
    seed: int = 0
    host_bytes_per_s: float = HOST_LINK_BYTES_PER_S

    def __post_init__(self):
        if self.features not in FEATURES:
            raise ValueError(f"features must be one of {FEATURES}, got {self.features!r}.")
        for name in ("seq_len", "max_anchors", "draws"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}.")
        if not self.host_bytes_per_s > 0:
            raise ValueError(f"host_bytes_per_s must be positive, got {self.host_bytes_per_s!r}.")


@lru_cache(maxsize=32)
def _draw(seq_len: int, max_anchors: int, block_size: int, sampling: str, seed: int, step: int) -> DFlashBatch:
    objective = DFlashObjective(mask_token_id=0, block_size=block_size, max_anchors=max_anchors,
                                anchor_sampling=sampling, seed=seed)
    ids = torch.zeros(1, seq_len, dtype=torch.long)
    return objective.prepare(ids, torch.ones_like(ids), step=step)


def draw_batches(spec: DrafterSpec, setting: DrafterSetting) -> list[DFlashBatch]:
    """The objective's anchor draws of ``setting.draws`` steps over one fully supervised sequence."""
    if setting.seq_len < 2 * spec.block_size:
        raise ValueError(f"seq_len {setting.seq_len} is shorter than two blocks of {spec.block_size}; use a longer "
                         "context.")
    return [_draw(setting.seq_len, setting.max_anchors, spec.block_size, setting.anchor_sampling, setting.seed, s)
            for s in range(setting.draws)]


@lru_cache(maxsize=1024)
def _work(spec: DrafterSpec, dims: ParallelDims, setting: DrafterSetting, step: int) -> tuple[DrafterRankWork, ...]:
    batch = _draw(setting.seq_len, setting.max_anchors, spec.block_size, setting.anchor_sampling, setting.seed, step)
    return drafter_work(spec, dims, batch, setting.compact_context)


@dataclass(frozen=True)
class DrafterPrediction(LayoutPrediction):
    """One layout's projected step (averaged over the anchor draws; memory: the largest; ``bytes_per_step``: the
    context K/V bytes of the rank receiving the most).

    ``parts`` the step of the rank with the most work, by :data:`PARTS` (seconds; they add up to ``step_s``).
    """

    sequences_per_s: float
    load_s: float
    parts: dict

    @property
    def label(self) -> str:
        d = self.dims
        transport = f" {d.transport}" if d.clean_ring_size > 1 else ""
        return f"{d.mode} P={d.block_parallel_size} C={d.clean_ring_size} D={d.data_parallel_size}{transport}"

    @property
    def kv_bytes(self) -> float:
        return self.bytes_per_step

    def to_dict(self) -> dict:
        d = self.dims
        return dict(label=self.label, mode=str(d.mode), P=d.block_parallel_size, C=d.clean_ring_size,
                    D=d.data_parallel_size, transport=str(d.transport), checkpointing=self.checkpointing,
                    seq_len=self.seq_len, step_s=self.step_s, sequences_per_s=self.sequences_per_s,
                    tokens_per_s=self.tokens_per_s, peak_bytes=self.memory.total, memory=self.memory.parts(),
                    fits=self.fits, kv_bytes=self.kv_bytes, load_s=self.load_s, parts=dict(self.parts))


@dataclass(frozen=True)
class DrafterStep:
    """A drafter's training step on one layout (``works``: :func:`drafter_work`), as the planner's
    :class:`~hf_bdlm.planner.workload.Workload`: the context projection; every layer forward (twice with
    checkpointing), its context K/V moving while the draft matrices and the own attention compute; the head and loss;
    every layer backward. ``feature_buffers`` context feature buffers on the device (:func:`drafter_memory`)."""

    spec: DrafterSpec
    dims: ParallelDims
    works: tuple[DrafterRankWork, ...]
    feature_buffers: int = 1

    def step_terms(self, device: DeviceSpec, cluster: Cluster, recipe: Recipe, checkpointing: bool) -> StepTerms:
        """The segments' programs, each rank's compute and its parts by :data:`PARTS` (the computing ones)."""
        spec, dims, works = self.spec, self.dims, self.works
        mm, attn, hbm = device.matmul_flops, device.attention_flops, device.hbm_bytes_per_s
        s = recipe.activation_bytes
        G = dims.clean_ring_size
        bw = device.link_bytes_per_s(cluster.spans_nodes(G))
        lat = device.link_latency_s
        hops = (G - 1, 2 * G - 1) if dims.transport == "ring" else (1, 1)  # messages in a row: latency paid per hop
        P = len(works)
        draft, attention, context = [0.0] * P, [0.0] * P, [0.0] * P
        fwd_passes = 2 if checkpointing else 1
        projection = [2 * context_projection_flops(spec, w.projected_rows) / mm for w in works]
        segments = [(tuple((Compute(t),) for t in projection), 1)]
        for i, a in enumerate(spec.model.layers):
            hd = a.heads * a.head_dim
            fwd, bwd = [], []
            for r, w in enumerate(works):
                rows = w.anchors * spec.block_size
                kv = context_kv_flops(spec, i, w.projected_rows) / mm
                matrices = (draft_layer_flops(spec, i, rows) / mm
                            + rows * spec.activation_elements_per_row(i) * s * 2 / hbm)
                own = (w.block_pairs[i] + w.own_pairs[i]) * hd / attn
                peer = w.peer_pairs[i] * hd / attn
                f, b = FWD_ATTN_FLOPS_PER_PAIR_HEAD_DIM, BWD_ATTN_FLOPS_PER_PAIR_HEAD_DIM
                draft[r] += matrices * (fwd_passes + 2)
                attention[r] += (own + peer) * (f * fwd_passes + b)
                context[r] += kv * (fwd_passes + 2)
                if G == 1:
                    fwd.append((Compute(kv + matrices + (own + peer) * f),))
                    bwd.append((Compute(2 * kv + 2 * matrices + (own + peer) * b),))
                    continue
                row = spec.kv_row_bytes(i, s)
                members = tuple(("kv", m) for m in range(r // G * G, r // G * G + G))
                # Forward: the own K/V go out while the draft matrices and the attention over the own shard and the
                # blocks compute; backward: the peers' gradients go home while the own rows' backward computes. A
                # collective completes for all once its slowest member has received.
                fwd_done = w.recv_rows[i] * row / bw + hops[0] * lat
                bwd_done = w.recv_grad_rows[i] * row / bw + hops[1] * lat
                fwd.append((Compute(kv), Send(("kv", r), fwd_done), Compute(matrices + own * f), Wait(members),
                            Compute(peer * f)))
                bwd.append((Compute(peer * b), Send(("kv", r), bwd_done), Compute(2 * matrices + own * b),
                            Wait(members), Compute(2 * kv)))
            segments += [(tuple(fwd), fwd_passes), (tuple(bwd), 1)]
        head = [3 * (head_flops(spec, w.supervised_rows) + selector_flops(spec, w.supervised_rows)) / mm for w in works]
        segments.append((tuple((Compute(t),) for t in head), 1))
        compute = tuple(projection[r] + context[r] + draft[r] + attention[r] + head[r] for r in range(P))
        parts = tuple({"draft layers": draft[r], "attention": attention[r],
                       "context projection": projection[r] + context[r], "head and loss": head[r]} for r in range(P))
        return StepTerms(tuple(segments), compute, parts, spec.trainable_params(), spec.num_layers)

    def rank_memory(self, recipe: Recipe, checkpointing: bool) -> tuple[DrafterMemory, ...]:
        return tuple(drafter_memory(self.spec, self.dims, w, recipe, checkpointing, self.feature_buffers)
                     for w in self.works)

    def bytes_received(self, recipe: Recipe) -> tuple[dict[str, int], ...]:
        return tuple(kv_bytes_by_name(self.spec, w, recipe.activation_bytes) for w in self.works)


def _step_parts(priced: PricedStep, load: Sequence[float]) -> dict[str, float]:
    """The step of the rank with the most work by :data:`PARTS`: its compute, its waits on messages and on the group's
    slowest rank, FSDP2's exposed traffic, and the feature reads the step does not hide (``load``: each rank's)."""
    terms, times = priced.terms, priced.times
    r = max(range(len(terms.compute_s)), key=lambda q: terms.compute_s[q])
    busy = terms.compute_s[r] + times.waited_s[r] + times.idle_s[r] + times.fsdp_exposed_s
    return {**terms.parts[r], "exposed communication": times.waited_s[r], "waiting for peers": times.idle_s[r],
            "FSDP2 exposed": times.fsdp_exposed_s, "feature reads exposed": max(0.0, max(load) - busy)}


def predict_drafter(spec: DrafterSpec, dims: ParallelDims, setting: DrafterSetting, device: DeviceSpec,
                    cluster: Cluster, recipe: Recipe = Recipe(), checkpointing: bool = False) -> DrafterPrediction:
    """Step time, throughput, peak memory, fit and K/V bytes of one layout (``dims`` with its world size): each draw's
    :class:`DrafterStep` priced by :func:`~hf_bdlm.planner.workload.price_step`, averaged over the draws."""
    if recipe.model_parallel != 1:
        raise ValueError(f"tensor / expert parallelism is not modelled for drafters; got model_parallel="
                         f"{recipe.model_parallel}. Use Recipe(model_parallel=1).")
    if dims.world_size is None:
        dims = dims.with_world(cluster.gpus)
    buffers = 2 if setting.features == "host" else 1
    steps, mems, nbytes, loads = [], [], [], []
    draw_batches(spec, setting)  # checks the setting against the drafter
    for step in range(setting.draws):
        works = _work(spec, dims, replace(setting, features="host"), step)
        load = [w.feature_rows * spec.feature_width * recipe.activation_bytes / setting.host_bytes_per_s
                if setting.features == "host" else 0.0 for w in works]
        priced = price_step(DrafterStep(spec, dims, works, buffers), device, cluster, recipe, checkpointing)
        steps.append(_step_parts(priced, load))
        mems += priced.memory
        nbytes.append(priced.bytes_per_step)
        loads.append(max(load))
    parts = {k: sum(p[k] for p in steps) / len(steps) for k in PARTS}
    step = sum(parts.values())
    peak = max(mems, key=lambda m: m.total)
    D = dims.data_parallel_size
    return DrafterPrediction(dims, checkpointing, setting.seq_len, step, D * setting.seq_len / step, peak,
                             peak.total <= device.memory_bytes, sum(nbytes) / len(nbytes), D / step,
                             sum(loads) / len(loads), parts)


def drafter_layouts(world: int, transports: Sequence[str] = ("ring", "allgather")) -> list[ParallelDims]:
    """Every layout of ``world`` GPUs: per group size ``P | world``, ``cp`` (each transport), ``bp`` and ``csbp`` with
    every clean ring ``1 < C <= P`` (each transport); one GPU per group is plain data parallelism."""
    out = [ParallelDims(1, 1, "bp", world_size=world)]
    for P in divisors(world)[1:]:
        out += [ParallelDims(P, P, "cp", transport=t, world_size=world) for t in transports]
        out.append(ParallelDims(P, 1, "bp", world_size=world))
        out += [ParallelDims(P, C, "csbp", transport=t, world_size=world)
                for C in divisors(P)[1:] for t in transports]
    return out


def plan_drafter(spec: DrafterSpec, setting: DrafterSetting, device: DeviceSpec, cluster: Cluster,
                 recipe: Recipe = Recipe()) -> list[DrafterPrediction]:
    """Predictions of every layout (:func:`drafter_layouts`) with and without activation checkpointing, what fits
    first, fastest first."""
    preds = [predict_drafter(spec, d, setting, device, cluster, recipe, ac)
             for d in drafter_layouts(cluster.gpus) for ac in (False, True)]
    return sorted(preds, key=lambda p: (not p.fits, -p.tokens_per_s))


def fastest(preds: Sequence[DrafterPrediction], **match) -> DrafterPrediction | None:
    """The planner's pick (:func:`~hf_bdlm.planner.workload.recommend`) among the predictions whose dims match
    ``match`` (e.g. ``mode="cp"``, ``block_parallel_size=8``): the fastest that fits and, within the planner's tie,
    one without activation checkpointing, then the smallest peak. ``None`` when none fits."""
    return recommend(preds, prefer=lambda p: (p.checkpointing, p.memory.total), **match)


__all__ = ["PAPER_ANCHORS", "HOST_LINK_BYTES_PER_S", "RING_TILE_ROWS", "FEATURES", "PARTS", "DrafterSpec",
           "DrafterRankWork", "DrafterMemory", "DrafterSetting", "DrafterPrediction", "draft_layer_flops",
           "context_projection_flops", "context_kv_flops", "head_flops", "selector_flops", "forward_matmul_flops",
           "step_flops", "anchor_shares", "reachable_runs", "reachable_rows", "drafter_work", "kv_bytes_by_name",
           "kv_bytes", "drafter_memory", "draw_batches", "DrafterStep", "predict_drafter", "drafter_layouts",
           "plan_drafter", "fastest"]
