"""The cost model: per-rank rows, attention pairs, K/V bytes, memory and step time of a layout.

Everything a rank does is read from the project's own plan (:func:`hf_bdlm.parallel.plan.make_plan`: which
noisy blocks and clean positions each rank holds) and rule (:func:`hf_bdlm.attention.masks.window_key_range`,
:func:`~hf_bdlm.attention.masks.keys_in_window`); the layout is a :class:`~hf_bdlm.parallel.dims.ParallelDims`,
whose validation is the only one. docs/design.md §6 states the formulas:

- attention pairs: every query row a rank holds, times its allowed keys (one interval per key stream,
  cut by the layer's window); the pairs among the rank's own rows are the *local* part its kernel computes
  while the peers' K/V travel. FLOPs: ``4·H·d`` per pair forward, ``10·H·d`` backward (score recompute).
- matrices: ``2 x`` active parameters per row forward (the ``top_k`` experts only), twice that backward;
  the LM head on the rows that carry a loss.
- K/V bytes received per rank (what the ``ByteMeter`` records): all-gather ``2·(G-1)·rows_sent·H_kv·d·s``
  forward and the same in the reduce-scatter backward; the ``ring`` transport ``(G-1)`` shards forward,
  ``(G-1)`` + ``G`` (dK/dV) backward; sliding layers the halo rows (all-to-all; each query's reach cut per key
  stream, as the engine selects them), back in backward.
- step time: every layer's forward and backward and the LM head, each scheduled across the group's ranks
  (:mod:`.schedule`: compute, sends and waits in the order the kernels issue them; ``cp`` / ``csbp`` overlap the
  transfer with attention over the rank's own rows, the ring chains its rotations, ``bp`` has nothing to move;
  on a CPU with more ranks than cores they share the cores), summed, plus FSDP2's exposed traffic: the backbone's
  step is a :class:`~.workload.Workload` (:class:`BackboneStep`), priced as every workload is
  (:func:`~.workload.price_step`).
- the paper's CP baseline (``cp_layout="paper"``): its plan's contiguous clean shards give the imbalance; its
  transfers are its reference's (the noisy rows' gather completes before any attention, the clean rows' gather hides
  behind the block-diagonal part only, both reduce-scatters run after every gradient) and its sliding layers gather
  the whole sequence like full ones.

    python -c "from hf_bdlm.planner.cost import *; from hf_bdlm.planner.model import model_spec; \\
from hf_bdlm.planner.hardware import device_spec; from hf_bdlm.parallel.dims import ParallelDims; \\
print(predict(model_spec('gemma3-27b'), ParallelDims(16, 16, 'csbp', world_size=16), 262144, \\
device_spec('h200'), Cluster(16, 8)).step_s)"
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Sequence

import torch

from ..attention.masks import CLEAN, NOISY, MaskRule, keys_in_window, window_key_range
from ..parallel.dims import ParallelDims, divisors
from ..parallel.plan import GroupPlan, PlanConfig, make_plan
from .hardware import DeviceSpec
from .model import ModelSpec
from .schedule import Compute, Send, Wait
from .workload import (BWD_ATTN_FLOPS_PER_PAIR_HEAD_DIM, FWD_ATTN_FLOPS_PER_PAIR_HEAD_DIM, TIE, Cluster,
                       LayoutPrediction, MemoryParts, PricedStep, Recipe, StepTerms, StepTimes, price_step,
                       recommend, schedule_step)


# ----------------------------------------------------------------------------------------------
# attention pairs
# ----------------------------------------------------------------------------------------------
def key_intervals(q_stream: torch.Tensor, q_pos: torch.Tensor, rule: MaskRule):
    """Per query row of one document, its allowed clean keys ``[clean_lo, clean_hi]`` and noisy keys
    ``[noisy_lo, noisy_hi]`` (inclusive; empty when ``lo > hi``).

    Per key stream a query's allowed keys are one interval (docs/design.md §1): a noisy query sees clean
    ``[0, s_b)`` and noisy ``[s_b, s_b + B)``; a clean query clean ``[0, s_b + B)`` (``block_causal``) or
    ``[0, q]`` (``causal``) and no noisy key; a window cuts it to :func:`window_key_range`.
    """
    q_stream, q_pos = q_stream.long(), q_pos.long()
    B = rule.block_size
    start = torch.div(q_pos, B, rounding_mode="floor") * B
    noisy = q_stream == NOISY
    clean_hi = torch.where(noisy, start - 1, q_pos if rule.clean_attention == "causal" else start + B - 1)
    clean_lo = torch.zeros_like(q_pos)
    noisy_lo, noisy_hi = start, torch.where(noisy, start + B - 1, start - 1)
    if rule.sliding_window is not None:
        w_lo, w_hi = window_key_range(q_stream, q_pos, rule)
        clean_lo, clean_hi = torch.maximum(clean_lo, w_lo), torch.minimum(clean_hi, w_hi)
        noisy_lo, noisy_hi = torch.maximum(noisy_lo, w_lo), torch.minimum(noisy_hi, w_hi)
    return clean_lo, clean_hi, noisy_lo, noisy_hi


def _overlap(lo: torch.Tensor, hi: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Keys of ``[lo, hi]`` (inclusive, per query) inside ``[start, end)``."""
    return (hi.clamp(max=end - 1) - lo.clamp(min=start) + 1).clamp(min=0)


def allowed_key_counts(q_stream: torch.Tensor, q_pos: torch.Tensor, rule: MaskRule) -> torch.Tensor:
    """Allowed keys of each query row of one document (:func:`key_intervals`; every key lies in ``[0, L)``)."""
    clean_lo, clean_hi, noisy_lo, noisy_hi = key_intervals(q_stream, q_pos, rule)
    end = int(q_pos.max()) + rule.block_size + 1 if q_pos.numel() else 0
    return _overlap(clean_lo, clean_hi, 0, end) + _overlap(noisy_lo, noisy_hi, 0, end)


@dataclass(frozen=True)
class RankWork:
    """What one rank computes and receives per layer kind (keyed by the layer's window, ``None`` = full).

    ``pairs[w]`` allowed (query, key) pairs of its queries, ``local_pairs[w]`` those among its own rows,
    ``noisy_pairs[w]`` those of its noisy queries over noisy keys (the block-diagonal part: what the paper's CP
    computes while its clean rows travel);
    ``sent_rows`` rows it contributes to the K/V gather (0 for ``bp``); ``halo_recv[w]`` / ``halo_sent[w]``
    rows a sliding layer receives from / sends to the peers. For the ring transport (full layers):
    ``source_pairs`` the pairs against the rank's local source (``csbp``: its noisy rows; ``cp``: none) and
    ``shard_pairs[m]`` those against the shard of the ``m``-th member of its gather group (its own included).
    ``members`` that group's ranks in ring order (the rank alone for ``bp``). ``kernel_calls[w]`` the attention
    kernel calls a layer's tile plans issue (:func:`~hf_bdlm.planner.kernel_work.blockwise_work`), each priced at the
    device's fixed cost per call; absent where the work counts pairs only.
    """

    noisy_rows: int
    clean_rows: int
    pairs: dict
    local_pairs: dict
    sent_rows: int
    halo_recv: dict = field(default_factory=dict)
    halo_sent: dict = field(default_factory=dict)
    source_pairs: int = 0
    shard_pairs: tuple = ()
    members: tuple = ()
    kernel_calls: dict = field(default_factory=dict)
    noisy_pairs: dict = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return self.noisy_rows + self.clean_rows


@lru_cache(maxsize=64)
def _position_intervals(seq_len: int, rule: MaskRule) -> dict:
    """:func:`key_intervals` of a noisy and of a clean query at every position."""
    pos = torch.arange(seq_len)
    return {stream: key_intervals(torch.full_like(pos, stream), pos, rule) for stream in (NOISY, CLEAN)}


@lru_cache(maxsize=64)
def _cumulative_counts(seq_len: int, rule: MaskRule) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefix sums over positions of every noisy and every clean query's allowed keys (length ``L + 1`` each)."""
    out = []
    for stream in (NOISY, CLEAN):
        pos = torch.arange(seq_len)
        counts = allowed_key_counts(torch.full_like(pos, stream), pos, rule)
        out.append(torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]))
    return out[0], out[1]


def _rank_pairs(plan: GroupPlan, rank: int, rule: MaskRule) -> tuple[int, int, int, tuple[int, ...]]:
    """A rank's allowed pairs: all, among its own rows, against noisy keys (the block-diagonal part), and against
    each gather member's clean rows (in member order). (The paper's CP baseline holds a slice of each noisy block, so
    its noisy keys are not all its own: its schedule reads the block-diagonal part, not the local one.)"""
    rp = plan.ranks[rank]
    noisy_cum, clean_cum = _cumulative_counts(rp.seq_len, rule)
    streams = ((NOISY, rp.noisy_positions(), noisy_cum), (CLEAN, rp.clean_position_index(), clean_cum))
    total = sum(int((cum[idx + 1] - cum[idx]).sum()) for _, idx, cum in streams)
    members = plan.exchange_members(rank)
    intervals = _position_intervals(rp.seq_len, rule)
    # A noisy query's noisy keys are its own block; its clean keys, and a clean query's, lie in the clean rows of the
    # gather members (the whole clean stream, split among them). Each stream's queries at once, by their positions.
    noisy_keys, clean_keys = 0, [0] * len(members)
    for stream, idx, _ in streams:
        clean_lo, clean_hi, noisy_lo, noisy_hi = (x[idx] for x in intervals[stream])
        noisy_keys += int(_overlap(noisy_lo, noisy_hi, 0, rp.seq_len).sum())
        if len(members) == 1:
            continue
        for j, m in enumerate(members):
            for a, b in plan.ranks[m].clean_positions:
                clean_keys[j] += int(_overlap(clean_lo, clean_hi, a, b).sum())
    if len(members) == 1:
        return total, total, noisy_keys, (total,)
    local = noisy_keys + clean_keys[members.index(rank)]
    return total, local, noisy_keys, tuple(clean_keys)


def _halo_counts(plan: GroupPlan, rule: MaskRule) -> tuple[list[int], list[int]]:
    """Rows each rank receives from / sends to its peers on a sliding layer: the peers' sent rows that some query of
    the rank reaches through its window and the stream table (:func:`keys_in_window` with the keys' streams, as
    :func:`~hf_bdlm.parallel.plan.window_exchange` selects them for the engine)."""
    P, L = len(plan.ranks), plan.config.seq_len
    recv, sent = [0] * P, [0] * P
    if not plan.config.mode.exchanges_kv or rule.sliding_window is None:
        return recv, sent
    positions = torch.arange(L)
    for me in range(P):
        peers = [p for p in plan.exchange_members(me) if p != me]
        if not peers:
            continue
        # Which positions some query of this rank reaches, per key stream (the reach is an interval per query and
        # stream), as prefix sums: a peer's rows in reach are then a few range sums.
        q = plan.ranks[me].rows()
        reached = {}
        for stream in (CLEAN, NOISY):
            hit = keys_in_window(q.stream, q.pos, positions, rule, k_stream=torch.full_like(positions, stream))
            reached[stream] = torch.cat([torch.zeros(1, dtype=torch.long), hit.long().cumsum(0)])
        for p in peers:
            rp = plan.ranks[p]
            ranges = [(CLEAN, r) for r in rp.clean_positions]
            if plan.config.mode.sends_noisy_kv:
                ranges += [(NOISY, r) for r in rp.noisy_ranges]
            n = sum(int(reached[stream][e] - reached[stream][s]) for stream, (s, e) in ranges)
            recv[me] += n
            sent[p] += n
    return recv, sent


@dataclass(frozen=True)
class CommStyle:
    """How a layout's K/V move. ``blocking``: as the paper's reference code moves them, the noisy rows' gather
    completes before any attention, the clean rows' gather overlaps the block-diagonal part (noisy queries over noisy
    keys) only, and both reduce-scatters run after every gradient; ``whole_sliding``: sliding-window layers gather the whole sequence like full
    ones instead of fetching their halos. Both hold for the paper's CP baseline, neither for the other layouts;
    :func:`predict` takes another style to price a hypothetical one (e.g. the breakdown of ``hf-bdlm plan --paper``)."""

    blocking: bool = False
    whole_sliding: bool = False

    @classmethod
    def of(cls, dims: ParallelDims) -> "CommStyle":
        return cls(dims.is_paper_cp, dims.is_paper_cp)


@lru_cache(maxsize=256)
def rank_work(dims: ParallelDims, seq_len: int, rule: MaskRule, windows: tuple,
              halos: bool | None = None) -> tuple[RankWork, ...]:
    """Per rank of a group: rows, attention pairs (all, own) per window, K/V rows sent, halo rows (``halos``: whether
    sliding layers fetch halos; default: all layouts but the paper's CP baseline)."""
    halos = not dims.is_paper_cp if halos is None else halos
    plan = make_plan(PlanConfig.from_dims(dims, seq_len, rule.block_size))
    P = dims.block_parallel_size
    pairs = [dict() for _ in range(P)]
    local = [dict() for _ in range(P)]
    diagonal = [dict() for _ in range(P)]
    recv = [dict() for _ in range(P)]
    sent = [dict() for _ in range(P)]
    source, shards = [0] * P, [()] * P
    for w in windows:
        r_w = rule.with_window(w)
        for r in range(P):
            pairs[r][w], local[r][w], noisy_keys, clean_keys = _rank_pairs(plan, r, r_w)
            diagonal[r][w] = noisy_keys
            if w is None and gather_size(dims) > 1:
                # The ring: csbp's noisy rows are a local source; cp's own shard carries them.
                own = plan.exchange_members(r).index(r)
                travels = dims.mode.sends_noisy_kv
                source[r] = 0 if travels else noisy_keys
                shards[r] = tuple(n + (noisy_keys if travels and j == own else 0) for j, n in enumerate(clean_keys))
        if w is not None and P > 1 and halos:
            rc, sc = _halo_counts(plan, r_w)
            for r in range(P):
                recv[r][w], sent[r][w] = rc[r], sc[r]
    out = []
    for r, rp in enumerate(plan.ranks):
        # What the engine sends (GroupPlan.sent_rows), to a ring of more than itself.
        sent_rows = rp.num_rows - plan.sent_row_start(r) if len(plan.exchange_members(r)) > 1 else 0
        out.append(RankWork(rp.local_noisy_rows, rp.local_clean_rows, pairs[r], local[r], sent_rows, recv[r], sent[r],
                            source[r], shards[r], plan.exchange_members(r), noisy_pairs=diagonal[r]))
    return tuple(out)


def mask_rule_of(model: ModelSpec) -> MaskRule:
    return MaskRule(model.block_size, model.clean_attention, None, model.window_convention)


def layer_windows(model: ModelSpec) -> tuple:
    return tuple(sorted({a.window for a in model.layers}, key=lambda w: -1 if w is None else w))


# ----------------------------------------------------------------------------------------------
# bytes
# ----------------------------------------------------------------------------------------------
def gather_size(dims: ParallelDims) -> int:
    """Ranks a K/V gather spans: ``P`` (``cp``), ``C`` (``csbp``), 1 (``bp``)."""
    return {"cp": dims.block_parallel_size, "csbp": dims.clean_ring_size, "bp": 1}[dims.mode]


def gathers_whole(style: CommStyle, window) -> bool:
    """Whether a layer of this window moves its K/V by the all-gather (full layers; every layer when sliding layers
    gather whole, as the paper's CP baseline does) rather than the halo exchange."""
    return window is None or style.whole_sliding


def kv_bytes_by_name(model: ModelSpec, dims: ParallelDims, work: RankWork, elem_bytes: int,
                     batch: int = 1, style: CommStyle | None = None) -> dict[str, int]:
    """Bytes one rank receives per step, by the ``ByteMeter``'s collective names (forward and backward, every
    layer, ``batch`` sequences per group)."""
    G = gather_size(dims)
    style = style or CommStyle.of(dims)
    out: dict[str, int] = {}

    def add(name, n):
        if n:
            out[name] = out.get(name, 0) + int(n) * batch

    for a in model.layers:
        row = a.kv_heads * a.head_dim * elem_bytes  # one row of K (or of V)
        if G == 1 and a.window is None:
            continue
        if not gathers_whole(style, a.window):
            add("k_window.all_to_all", work.halo_recv.get(a.window, 0) * row)
            add("v_window.all_to_all", work.halo_recv.get(a.window, 0) * row)
            add("k_window.all_to_all_backward", work.halo_sent.get(a.window, 0) * row)
            add("v_window.all_to_all_backward", work.halo_sent.get(a.window, 0) * row)
        elif dims.transport == "ring":
            shard = work.sent_rows * row
            add("kv.ring_kv", 2 * (G - 1) * shard)
            add("kv_backward.ring_kv", 2 * (G - 1) * shard)
            add("dkv.ring_dkv", 2 * G * shard)
        else:
            for t in ("k", "v"):
                add(f"{t}.all_gather", (G - 1) * work.sent_rows * row)
                add(f"{t}.reduce_scatter", (G - 1) * work.sent_rows * row)
    return out


# ----------------------------------------------------------------------------------------------
# memory
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Memory(MemoryParts):
    """Peak bytes of one rank, by part (their sum is :attr:`total`)."""

    parameters: float
    gradients: float
    optimizer: float
    fsdp_transient: float
    activations: float
    gathered_kv: float
    logits: float


def memory(model: ModelSpec, dims: ParallelDims, work: RankWork, recipe: Recipe, checkpointing: bool,
           style: CommStyle | None = None) -> Memory:
    """Per-rank peak memory: sharded states, the gathered FSDP units, activations, gathered K/V, LM-head chunk."""
    style = style or CommStyle.of(dims)
    W = dims.world_size or dims.block_parallel_size
    n = model.total_params()
    shards = W if recipe.fsdp else 1
    s = recipe.activation_bytes
    biggest = max(model.layer_params(i) for i in range(len(model.layers)))
    transient = 0.0
    if recipe.fsdp and W > 1:
        # Gathered bf16 layers (computing + prefetched), one layer's unsharded gradients before its reduce-scatter,
        # and the root (embeddings / head), which stays gathered with its gradient.
        transient = (recipe.fsdp_prefetch_layers * biggest * recipe.param_bytes + biggest * recipe.grad_bytes
                     + model.embedding_params() * (recipe.param_bytes + recipe.grad_bytes))
    R = work.rows
    per_layer = [model.activation_elements_per_row(i) * s for i in range(len(model.layers))]
    G = gather_size(dims)
    kv_row = [a.kv_heads * a.head_dim * s * 2 for a in model.layers]  # K and V

    def gathered(i):
        a = model.layers[i]
        if not gathers_whole(style, a.window):
            return work.halo_recv.get(a.window, 0) * kv_row[i]
        if G == 1:
            return 0
        if dims.transport == "ring":
            return 2 * work.sent_rows * kv_row[i]  # the shard computed on and the one arriving
        # The all-gather buffer holds every member's rows, the own slot included; the peers' rows are views of it.
        return G * work.sent_rows * kv_row[i]

    if checkpointing:
        # Each layer's input is kept; backward recomputes one layer at a time (its activations and gathered K/V).
        acts = R * model.hidden * s * len(model.layers) + R * max(per_layer)
        kv = max(gathered(i) for i in range(len(model.layers)))
    else:
        acts = R * sum(per_layer)
        # The block-sparse kernel saves the gathered K/V of every layer for backward (the ring re-rotates them).
        kv = sum(gathered(i) if (model.layers[i].window is not None or dims.transport != "ring") else 0
                 for i in range(len(model.layers)))
        if dims.transport == "ring" and G > 1:
            kv += max(gathered(i) for i in range(len(model.layers)))
    targets = work.noisy_rows * recipe.target_fraction + (work.clean_rows if model.head_on_clean else 0)
    # fp32 logits of one chunk, their softmax / gradient (the chunk is recomputed in backward).
    logits = min(targets, recipe.loss_chunk_rows) * model.vocab * 4 * 2
    return Memory(parameters=n * recipe.param_bytes / shards, gradients=n * recipe.grad_bytes / shards,
                  optimizer=n * recipe.optimizer_bytes / shards, fsdp_transient=transient,
                  activations=acts * recipe.activation_overhead,
                  gathered_kv=kv, logits=logits)


# ----------------------------------------------------------------------------------------------
# time
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankTime:
    """One rank's step in seconds. ``compute_s`` is its work at its own processor's rate (``attention_s`` and
    ``linear_s`` are parts of it); ``comm_s`` the transfer time of what it moves. From the schedule
    (:func:`~.schedule.simulate`): ``shared_s`` the wall time added by sharing a processor with other ranks (CPU
    only), ``exposed_comm_s`` the time blocked in waits on messages (transfers not hidden behind compute, peers
    that have not sent yet) and ``idle_s`` the time it finished a segment before the group's slowest rank."""

    compute_s: float
    attention_s: float
    linear_s: float
    comm_s: float
    exposed_comm_s: float
    shared_s: float = 0.0
    idle_s: float = 0.0

    @property
    def step_s(self) -> float:
        return self.compute_s + self.shared_s + self.exposed_comm_s + self.idle_s


@dataclass(frozen=True)
class _LayerCost:
    """One rank's costs in one layer (seconds at its own rate; ``batch`` sequences)."""

    matrices_fwd: float  # matmuls of one forward pass
    elementwise_fwd: float  # elementwise traffic of one forward pass
    per_pair_fwd: float  # attention seconds per allowed pair, forward
    per_pair_bwd: float
    transfer: float  # one K + V shard (all-gather / ring) or the whole halo (sliding layers), over the link
    comm_fwd: float  # transfer seconds of what the rank receives in one forward pass
    comm_bwd: float  # and in the backward pass
    model_parallel: float = 0.0  # NVLink seconds of the model-parallel collectives of one pass (Recipe.model_parallel)
    calls_fwd: float = 0.0  # fixed cost of the attention kernel calls of one forward pass
    calls_bwd: float = 0.0


def _layer_cost(model: ModelSpec, dims: ParallelDims, work: RankWork, i: int, device: DeviceSpec, bw: float,
                recipe: Recipe, batch: int, style: CommStyle | None = None) -> _LayerCost:
    a = model.layers[i]
    t = recipe.model_parallel  # a rank's GPUs share its work and its K/V bytes (each over its own NIC)
    hd = a.heads * a.head_dim
    row = a.kv_heads * a.head_dim * recipe.activation_bytes * batch / t  # one row of K (or V), per GPU
    G = gather_size(dims)
    style = style or CommStyle.of(dims)
    if not gathers_whole(style, a.window):
        transfer = comm_fwd = 2 * work.halo_recv.get(a.window, 0) * row / bw
        comm_bwd = 2 * work.halo_sent.get(a.window, 0) * row / bw
    elif G > 1 and work.sent_rows:
        transfer = 2 * work.sent_rows * row / bw
        # Ring: (G-1) shards forward; backward (G-1) K/V shards and G dK/dV shards. All-gather: (G-1) each way.
        comm_fwd = (G - 1) * transfer
        comm_bwd = (2 * G - 1 if dims.transport == "ring" else G - 1) * transfer
    else:
        transfer = comm_fwd = comm_bwd = 0.0
    return _LayerCost(
        matrices_fwd=batch * work.rows * 2 * model.layer_active_params(i) / device.matmul_flops / t,
        # Norms, rotary, activations, residuals: what the layer keeps, read and written.
        elementwise_fwd=batch * work.rows * model.activation_elements_per_row(i) * recipe.activation_bytes * 2
        / device.hbm_bytes_per_s / t,
        per_pair_fwd=batch * FWD_ATTN_FLOPS_PER_PAIR_HEAD_DIM * hd / device.attention_flops / t,
        per_pair_bwd=batch * BWD_ATTN_FLOPS_PER_PAIR_HEAD_DIM * hd / device.attention_flops / t,
        transfer=transfer, comm_fwd=comm_fwd, comm_bwd=comm_bwd,
        model_parallel=recipe.model_parallel_seconds(model, work.rows, batch, device.intra_node_bytes_per_s),
        calls_fwd=work.kernel_calls.get(a.window, 0) * device.kernel_call_fwd_s,
        calls_bwd=work.kernel_calls.get(a.window, 0) * device.kernel_call_bwd_s)


def _layer_programs(dims: ParallelDims, works: Sequence[RankWork], costs: Sequence[_LayerCost], window,
                    latency: float, style: CommStyle | None = None) -> tuple[tuple, tuple]:
    """The forward and backward programs of one layer on each rank of a group, in the order the kernels issue
    them (docs/design.md §3): all-gather / halo exchange started, local rows computed, wait, peers' rows; backward
    the peers' rows first, their gradients sent home while the local rows compute. The ring rotates shard by shard:
    forward a received shard is passed on before it is computed on; backward the dK/dV accumulator of a shard
    follows it, so each rotation waits for the predecessor's compute."""
    G = gather_size(dims)
    style = style or CommStyle.of(dims)
    fwd, bwd = [], []
    for r, (w, c) in enumerate(zip(works, costs)):
        pairs, local = w.pairs[window], w.local_pairs[window]
        f, b = c.per_pair_fwd, c.per_pair_bwd
        other = c.matrices_fwd + c.elementwise_fwd
        # The model-parallel collectives (inside a node) hold the pass back: time busy, counted as communication.
        # The kernel calls' fixed costs are host work spread over the pass; they are counted with the rest of it.
        pf = [Compute(other + c.model_parallel + c.calls_fwd)]
        pb = [Compute(2 * other + c.model_parallel + c.calls_bwd)]
        members = w.members
        exchanged = dims.mode.exchanges_kv and len(members) > 1 and (window is not None or w.sent_rows > 0)
        whole = gathers_whole(style, window)
        if not exchanged:
            pf.append(Compute(pairs * f))
            pb.append(Compute(pairs * b))
        elif window is None and dims.transport == "ring":
            hop = c.transfer + latency
            me = members.index(r)
            prev = members[me - 1]
            pf += [Send(("kv", 0, r), hop), Compute(w.source_pairs * f)]
            pb += [Compute(w.source_pairs * b), Send(("kv", 0, r), hop)]
            for s in range(G):
                shard = w.shard_pairs[(me - s) % G]
                if s > 0:
                    # Backward: the shard and the accumulator come from the same predecessor, one synchronization.
                    pf.append(Wait((("kv", s - 1, prev),)))
                    pb.append(Wait((("kv", s - 1, prev), ("dkv", s - 1, prev))))
                    if s < G - 1:
                        pf.append(Send(("kv", s, r), hop))
                        pb.append(Send(("kv", s, r), hop))
                pf.append(Compute(shard * f))
                pb += [Compute(shard * b), Send(("dkv", s, r), hop)]
            pb.append(Wait((("dkv", G - 1, prev),)))
        else:
            # A collective completes for all members once the last has joined and the data has moved: each member's
            # contribution arrives the slowest member's transfer (and one latency) after it is posted.
            hops = G - 1 if whole else 1  # the all-gather's G - 1 shards; an all-to-all
            done = max(costs[m].transfer for m in members) * hops + latency
            keys = tuple(("c", m) for m in members)
            if style.blocking:
                # As the paper's reference runs it: the noisy rows' gather completes first; the clean rows' gather
                # starts and the block-diagonal part computes meanwhile, the rest after its wait. Backward: every
                # gradient, then the clean rows' reduce-scatter, then the noisy rows'.
                noisy = [_noisy_share(dims, works[m]) for m in members]
                n_done = max(costs[m].transfer * n for m, n in zip(members, noisy)) * hops + latency
                c_done = max(costs[m].transfer * (1 - n) for m, n in zip(members, noisy)) * hops + latency
                n_keys = tuple(("n", m) for m in members)
                diagonal = w.noisy_pairs[window] if noisy[members.index(r)] else 0
                head = [Send(("n", r), n_done), Wait(n_keys)] if any(noisy) else []
                pf += head + [Send(("c", r), c_done), Compute(diagonal * f), Wait(keys),
                              Compute((pairs - diagonal) * f)]
                pb += [Compute(pairs * b), Send(("c", r), c_done), Wait(keys)] + head
            else:
                pf += [Send(("c", r), done), Compute(local * f), Wait(keys), Compute((pairs - local) * f)]
                pb += [Compute((pairs - local) * b), Send(("c", r), done), Compute(local * b), Wait(keys)]
        fwd.append(tuple(pf))
        bwd.append(tuple(pb))
    return tuple(fwd), tuple(bwd)


def _noisy_share(dims: ParallelDims, work: RankWork) -> float:
    """The fraction of a rank's sent rows that are noisy (``cp``: its noisy rows travel too; ``csbp``: none)."""
    if not dims.mode.sends_noisy_kv or not work.sent_rows:
        return 0.0
    return work.noisy_rows / work.sent_rows


@dataclass(frozen=True)
class BackboneStep:
    """A backbone's training step on one layout, as the planner's :class:`~.workload.Workload`: every layer's forward
    (twice with checkpointing: the recomputation) and backward over each rank's rows and pairs (``works``:
    :func:`rank_work`, or what a kernel's tiles compute), then the LM head; ``batch`` sequences per group, the K/V
    moved in ``style`` (default: the layout's own, :meth:`CommStyle.of`)."""

    model: ModelSpec
    dims: ParallelDims
    works: tuple[RankWork, ...]
    batch: int = 1
    style: CommStyle | None = None

    def comm_style(self) -> CommStyle:
        return self.style or CommStyle.of(self.dims)

    def step_terms(self, device: DeviceSpec, cluster: Cluster, recipe: Recipe, checkpointing: bool) -> StepTerms:
        """Each layer's forward and backward programs (:func:`_layer_programs`), then the LM head's; per rank its
        compute and the parts :class:`RankTime` reports (``attention``, ``linear``, ``transfer``: the K/V transfer
        time, ``model parallel``: the NVLink collectives')."""
        model, dims, works, batch = self.model, self.dims, self.works, self.batch
        style = self.comm_style()
        fwd_passes = 2 if checkpointing else 1
        G = gather_size(dims)
        bw = device.link_bytes_per_s(cluster.spans_nodes(G if dims.mode.exchanges_kv else 1))
        P = len(works)
        compute, attention, linear, comm, mp = [0.0] * P, [0.0] * P, [0.0] * P, [0.0] * P, [0.0] * P
        segments = []
        for i, a in enumerate(model.layers):
            costs = [_layer_cost(model, dims, w, i, device, bw, recipe, batch, style) for w in works]
            fwd, bwd = _layer_programs(dims, works, costs, a.window, device.link_latency_s, style)
            segments += [(fwd, fwd_passes), (bwd, 1)]
            for r, (w, c) in enumerate(zip(works, costs)):
                attn = w.pairs[a.window] * (c.per_pair_fwd * fwd_passes + c.per_pair_bwd) \
                    + c.calls_fwd * fwd_passes + c.calls_bwd
                attention[r] += attn
                linear[r] += c.matrices_fwd * (fwd_passes + 2)
                compute[r] += attn + (c.matrices_fwd + c.elementwise_fwd) * (fwd_passes + 2)
                comm[r] += c.comm_fwd * fwd_passes + c.comm_bwd
                mp[r] += c.model_parallel * (fwd_passes + 1)
        head = []
        for r, w in enumerate(works):
            targets = w.noisy_rows * recipe.target_fraction + (w.clean_rows if model.head_on_clean else 0)
            t = batch * targets * model.head_flops_per_row() * 3 / device.matmul_flops / recipe.model_parallel
            head.append((Compute(t),))
            linear[r] += t
            compute[r] += t
        segments.append((tuple(head), 1))
        parts = tuple({"attention": attention[r], "linear": linear[r], "transfer": comm[r], "model parallel": mp[r]}
                      for r in range(P))
        return StepTerms(tuple(segments), tuple(compute), parts, model.total_params(), len(model.layers))

    def rank_memory(self, recipe: Recipe, checkpointing: bool) -> tuple[Memory, ...]:
        """Each rank's peak (:func:`memory`), shared among its GPUs under model parallelism."""
        mems = [memory(self.model, self.dims, w, recipe, checkpointing, self.comm_style()) for w in self.works]
        if recipe.model_parallel > 1:  # a rank's states, activations and K/V are shared among its GPUs
            mems = [m.divided(recipe.model_parallel) for m in mems]
        return tuple(mems)

    def bytes_received(self, recipe: Recipe) -> tuple[dict[str, int], ...]:
        """Each rank's K/V bytes by the ``ByteMeter``'s names (:func:`kv_bytes_by_name`)."""
        return tuple(kv_bytes_by_name(self.model, self.dims, w, recipe.activation_bytes, self.batch, self.comm_style())
                     for w in self.works)


def _rank_times(terms: StepTerms, times: StepTimes) -> tuple[RankTime, ...]:
    """Every rank's :class:`RankTime` from its scheduled step. Wall time computing beyond the work itself is processor
    sharing (float residue aside); the model-parallel collectives hold the passes back: communication, exposed."""
    out = []
    for r, (compute, parts) in enumerate(zip(terms.compute_s, terms.parts)):
        mp = parts["model parallel"]
        out.append(RankTime(compute, parts["attention"], parts["linear"], parts["transfer"] + mp + times.fsdp_comm_s,
                            times.waited_s[r] + mp + times.fsdp_exposed_s, times.busy_s[r] - compute - mp,
                            times.idle_s[r]))
    return tuple(out)


def rank_times(model: ModelSpec, dims: ParallelDims, works: Sequence[RankWork], device: DeviceSpec, cluster: Cluster,
               recipe: Recipe, checkpointing: bool, batch: int = 1,
               style: CommStyle | None = None) -> tuple[RankTime, ...]:
    """Every rank's step (:class:`BackboneStep`): each layer's forward (twice with checkpointing: the recomputation)
    and backward, then the LM head, scheduled across the group (:func:`~.workload.schedule_step`; each segment starts
    when the previous one's slowest rank is done, which the collectives of ``cp`` / ``csbp`` enforce and which costs
    ``bp`` nothing when its ranks' shares are alike layer by layer), plus FSDP2's parameter and gradient traffic."""
    terms = BackboneStep(model, dims, tuple(works), batch, style).step_terms(device, cluster, recipe, checkpointing)
    return _rank_times(terms, schedule_step(terms, dims, device, cluster, recipe))


# ----------------------------------------------------------------------------------------------
# a layout's prediction, all layouts, the recommendation
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prediction(LayoutPrediction):
    """A backbone layout's :class:`~.workload.LayoutPrediction` with every rank's step (``ranks``) and the slowest
    rank's compute over the mean (``imbalance``)."""

    ranks: tuple[RankTime, ...]
    imbalance: float  # slowest rank's compute over the mean

    @property
    def label(self) -> str:
        d = self.dims
        extra = f" {d.transport}" if d.mode.exchanges_kv and gather_size(d) > 1 and not d.is_paper_cp else ""
        extra += "" if d.mode.exchanges_kv else f" {d.schedule}"
        mode = "cp-paper" if d.is_paper_cp else d.mode
        return f"{mode} P={d.block_parallel_size} C={d.clean_ring_size} D={d.data_parallel_size}{extra}"


def predict(model: ModelSpec, dims: ParallelDims, seq_len: int, device: DeviceSpec, cluster: Cluster,
            recipe: Recipe = Recipe(), checkpointing: bool = False, batch: int = 1,
            work: tuple[RankWork, ...] | None = None, style: CommStyle | None = None) -> Prediction:
    """Step time, throughput, peak memory and K/V bytes of one layout (``dims`` with its world size): the
    :class:`BackboneStep` priced by :func:`~.workload.price_step`.

    ``work`` replaces the per-rank work :func:`rank_work` counts (e.g. the pairs a particular kernel's tiles compute);
    ``style`` how its K/V move (default: the layout's own, :meth:`CommStyle.of`).
    """
    style = style or CommStyle.of(dims)
    if dims.world_size is None:
        dims = dims.with_world(cluster.gpus)
    if work is None:
        # The transport moves the same rows differently: the plan, pairs and halos are the allgather layout's.
        work = rank_work(replace(dims, transport="allgather"), seq_len, mask_rule_of(model), layer_windows(model),
                         not style.whole_sliding)
    priced: PricedStep = price_step(BackboneStep(model, dims, tuple(work), batch, style), device, cluster, recipe,
                                    checkpointing)
    times = _rank_times(priced.terms, priced.times)
    step = max(t.step_s for t in times)
    mean = sum(t.compute_s for t in times) / len(times)
    return Prediction(dims, checkpointing, seq_len, step, dims.data_parallel_size * batch * seq_len / step,
                      priced.peak, priced.fits, priced.bytes_per_step, times, max(t.compute_s for t in times) / mean)


def layouts(world: int, seq_len: int, block_size: int, ring_transport: bool = True,
            paper_cp: bool = False) -> list[ParallelDims]:
    """Every layout of ``world`` ranks that a sequence of ``seq_len`` fits: ``cp``, ``bp`` (both schedules) and
    ``csbp`` with every clean ring ``C | P``, per group size ``P | world`` (with ``paper_cp``, also the paper's CP
    baseline); validity is :class:`ParallelDims`'s (and the plan's, for the sequence length)."""
    out = []
    for P in divisors(world):
        cands = [("cp", P, "dual_end", "allgather"), ("bp", 1, "dual_end", "allgather"),
                 ("bp", 1, "contiguous", "allgather")]
        if paper_cp and P > 1:
            cands.append(("cp-paper", P, "dual_end", "allgather"))
        cands += [("csbp", C, "dual_end", "allgather") for C in divisors(P)]
        if ring_transport:
            cands += [("cp", P, "dual_end", "ring")] + [("csbp", C, "dual_end", "ring") for C in divisors(P) if C > 1]
        seen = set()
        for mode, C, schedule, transport in cands:
            if P == 1 and (mode, schedule, transport) != ("bp", "dual_end", "allgather"):
                continue  # one rank per group: every mode is the same single-device step
            dims = ParallelDims(P, C, "cp" if mode == "cp-paper" else mode, schedule, transport, world,
                                "paper" if mode == "cp-paper" else "balanced")
            if dims in seen:
                continue
            try:
                PlanConfig.from_dims(dims, seq_len, block_size)
            except ValueError:
                continue
            seen.add(dims)
            out.append(dims)
    return out


def plan_all(model: ModelSpec, seq_len: int, device: DeviceSpec, cluster: Cluster, recipe: Recipe = Recipe(),
             ring_transport: bool = True, paper_cp: bool = False) -> list[Prediction]:
    """Predictions of every layout, with and without activation checkpointing, fastest (tokens/s) first."""
    if seq_len % model.block_size:
        raise ValueError(f"--context {seq_len} is not a multiple of the block size {model.block_size}; use a "
                         f"multiple of {model.block_size} (or --block-size).")
    found = layouts(cluster.gpus, seq_len, model.block_size, ring_transport, paper_cp)
    if not found:
        raise ValueError(f"no layout of {cluster.gpus} GPUs fits --context {seq_len} with block size "
                         f"{model.block_size}: a sequence needs whole blocks per rank; use a context that is a "
                         f"multiple of {2 * cluster.gpus * model.block_size}.")
    preds = [predict(model, d, seq_len, device, cluster, recipe, ac) for d in found for ac in (False, True)]
    return sorted(preds, key=lambda p: -p.tokens_per_s)


__all__ = ["Cluster", "CommStyle", "Recipe", "RankWork", "Memory", "RankTime", "BackboneStep", "Prediction",
           "allowed_key_counts", "key_intervals", "rank_work", "kv_bytes_by_name", "memory", "rank_times", "predict",
           "layouts", "plan_all", "recommend", "gather_size", "mask_rule_of", "layer_windows", "TIE"]
