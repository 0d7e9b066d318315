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
  on a CPU with more ranks than cores they share the cores), summed, plus FSDP2's exposed traffic.
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

from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from typing import Sequence

import torch

from ..attention.masks import CLEAN, NOISY, MaskRule, keys_in_window, window_key_range
from ..parallel.dims import ParallelDims, divisors
from ..parallel.plan import GroupPlan, PlanConfig, make_plan
from .hardware import DeviceSpec
from .model import ModelSpec
from .schedule import Compute, Send, Wait, simulate

FWD_ATTN_FLOPS_PER_PAIR_HEAD_DIM = 4  # QK^T and PV: 2 FLOPs per multiply-add each
BWD_ATTN_FLOPS_PER_PAIR_HEAD_DIM = 10  # dV, dP, dQ, dK plus the recomputed QK^T (FlashAttention's backward)


@dataclass(frozen=True)
class Cluster:
    """``gpus`` devices, ``gpus_per_node`` per node; rank ``i`` sits on node ``i // gpus_per_node``."""

    gpus: int
    gpus_per_node: int

    def __post_init__(self):
        for name in ("gpus", "gpus_per_node"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive integer, got {v!r}.")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(f"--gpus {self.gpus} is not a multiple of --gpus-per-node {self.gpus_per_node}: "
                             "nodes are assumed full; give whole nodes.")

    def spans_nodes(self, group: int) -> bool:
        """Whether some group of ``group`` consecutive ranks (groups start at multiples of ``group``, as the mesh
        lays out block-parallel groups and clean rings) spans more than one node."""
        n = self.gpus_per_node
        return any(start // n != (start + group - 1) // n for start in range(0, self.gpus, group))


@dataclass(frozen=True)
class Recipe:
    """What the training step keeps in memory and moves, besides the layout (docs/design.md §6).

    Parameters:
        param_bytes (`int`, 2): bf16 parameters (FSDP2 shards, and the gathered copy a layer computes with).
        grad_bytes (`int`, 2): bf16 gradients (sharded; reduce-scattered in this dtype).
        optimizer_bytes (`int`, 8): AdamW's two fp32 states per parameter.
        activation_bytes (`int`, 2): bf16 activations and K/V.
        loss_chunk_rows (`int`, 8192): targets per LM-head call (the objectives' ``loss_chunk_size``).
        target_fraction (`float`, 0.5): targets per noisy row (``standard``: each token masked with rate
            ``t ~ U(0, 1]``, half on average).
        fsdp (`bool`, True): FSDP2 over the whole world (``False``: replicated parameters, as DDP).
        fsdp_prefetch_layers (`int`, 2): gathered layers alive at once (the one computing, the next prefetched).
        gradient_sync (`bool`, True): gradients are synchronized over the world every step (FSDP2's
            reduce-scatter, DDP's all-reduce); ``False`` for a bare forward / backward (the CPU benchmark).
        activation_overhead (`float`, 1.0): multiplies the activation estimate (what autograd saves, counted
            tensor by tensor) to account for allocator retention and kernel workspaces; give a measured ratio
            (``--validate`` prints measured against predicted peaks).
        model_parallel (`int`, 1): GPUs inside a node that share each rank of the block-parallel layout, as the
            paper's runs put tensor parallelism (27B conversion) or expert parallelism (26B-A4B) inside a node and the
            CP/BP group across nodes. A rank's compute, K/V bytes (each GPU sends its share over its own NIC) and
            memory are divided among its ``t`` GPUs; their own traffic is added, exposed, over NVLink per layer and
            pass: ``"tp"``, two all-reduces of the rank's activations (``2 (t-1)/t`` of ``rows x hidden`` each);
            ``"ep"``, on MoE layers, the dispatch and combine all-to-alls of each GPU's ``top_k`` token copies
            (``(t-1)/t`` of ``rows/t x top_k x hidden`` each).
        model_parallel_kind (`str`, "tp"): ``"tp"`` or ``"ep"``.
    """

    param_bytes: int = 2
    grad_bytes: int = 2
    optimizer_bytes: int = 8
    activation_bytes: int = 2
    loss_chunk_rows: int = 8192
    target_fraction: float = 0.5
    fsdp: bool = True
    fsdp_prefetch_layers: int = 2
    gradient_sync: bool = True
    activation_overhead: float = 1.0
    model_parallel: int = 1
    model_parallel_kind: str = "tp"

    def __post_init__(self):
        if not isinstance(self.model_parallel, int) or self.model_parallel < 1:
            raise ValueError(f"model_parallel must be a positive integer, got {self.model_parallel!r}.")
        if self.model_parallel_kind not in ("tp", "ep"):
            raise ValueError(f"model_parallel_kind must be 'tp' or 'ep', got {self.model_parallel_kind!r}.")

    def model_parallel_seconds(self, model: "ModelSpec", rows: int, batch: int, nvlink_bytes_per_s: float) -> float:
        """Exposed NVLink time of one layer's forward (or backward) pass for a rank of ``rows`` rows."""
        t = self.model_parallel
        if t == 1:
            return 0.0
        size = batch * rows * model.hidden * self.activation_bytes
        if self.model_parallel_kind == "tp":
            return 2 * 2 * (t - 1) / t * size / nvlink_bytes_per_s
        if not model.num_experts:
            return 0.0
        return 2 * (t - 1) / t * size / t * model.top_k / nvlink_bytes_per_s


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
class Memory:
    """Peak bytes of one rank, by part (their sum is :attr:`total`)."""

    parameters: float
    gradients: float
    optimizer: float
    fsdp_transient: float
    activations: float
    gathered_kv: float
    logits: float

    @property
    def total(self) -> float:
        return sum(self.parts().values())

    def parts(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


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


@lru_cache(maxsize=1024)
def _segment(programs: tuple, cores: int, efficiency: float, sync_cost: float) -> tuple[float, tuple]:
    """A segment's duration (its slowest rank) and each rank's schedule (all ranks start it together)."""
    sched = simulate(programs, cores, efficiency, sync_cost)
    return max(s.finish for s in sched), tuple(sched)


def rank_times(model: ModelSpec, dims: ParallelDims, works: Sequence[RankWork], device: DeviceSpec, cluster: Cluster,
               recipe: Recipe, checkpointing: bool, batch: int = 1,
               style: CommStyle | None = None) -> tuple[RankTime, ...]:
    """Every rank's step: each layer's forward (twice with checkpointing: the recomputation) and backward, then the
    LM head, scheduled across the group (:func:`~.schedule.simulate`; each segment starts when the previous one's
    slowest rank is done, which the collectives of ``cp`` / ``csbp`` enforce and which costs ``bp`` nothing when
    its ranks' shares are alike layer by layer), plus FSDP2's parameter and gradient traffic."""
    fwd_passes = 2 if checkpointing else 1
    style = style or CommStyle.of(dims)
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
    busy, waited, idle = [0.0] * P, [0.0] * P, [0.0] * P
    for programs, count in segments:
        span, sched = _segment(programs, device.shared_cores, device.oversubscribed_efficiency, device.sync_cost_s)
        for r, s in enumerate(sched):
            busy[r] += count * s.busy
            waited[r] += count * s.waited
            idle[r] += count * (span - s.finish)
    fsdp_exposed = fsdp_comm = 0.0
    W = dims.world_size or dims.block_parallel_size
    if W > 1 and recipe.gradient_sync:
        # FSDP2: all-gather the bf16 parameters in forward and again in backward, reduce-scatter the gradients (DDP:
        # one all-reduce, twice the bytes of a reduce-scatter), overlapped with every layer's compute but the first.
        n = model.total_params()
        frac = (W - 1) / W
        data = (2 * n * recipe.param_bytes + n * recipe.grad_bytes) * frac if recipe.fsdp else \
            2 * n * recipe.grad_bytes * frac
        data /= recipe.model_parallel  # each GPU of a rank holds its share of the parameters
        fsdp_comm = data / device.link_bytes_per_s(cluster.spans_nodes(W))
        fsdp_exposed = max(0.0, fsdp_comm - min(compute) * (1 - 1 / max(1, len(model.layers))))
    # Wall time computing beyond the work itself is processor sharing (float residue aside).
    return tuple(RankTime(compute[r], attention[r], linear[r], comm[r] + mp[r] + fsdp_comm,
                          waited[r] + mp[r] + fsdp_exposed, busy[r] - compute[r] - mp[r], idle[r]) for r in range(P))


# ----------------------------------------------------------------------------------------------
# a layout's prediction, all layouts, the recommendation
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prediction:
    dims: ParallelDims
    checkpointing: bool
    seq_len: int
    step_s: float
    tokens_per_s: float
    memory: Memory
    fits: bool
    bytes_per_step: int
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
    """Step time, throughput, peak memory and K/V bytes of one layout (``dims`` with its world size).

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
    times = rank_times(model, dims, work, device, cluster, recipe, checkpointing, batch, style)
    mems = [memory(model, dims, w, recipe, checkpointing, style) for w in work]
    if recipe.model_parallel > 1:  # a rank's states, activations and K/V are shared among its GPUs
        mems = [Memory(**{k: v / recipe.model_parallel for k, v in m.parts().items()}) for m in mems]
    peak = max(mems, key=lambda m: m.total)
    step = max(t.step_s for t in times)
    nbytes = max(sum(kv_bytes_by_name(model, dims, w, recipe.activation_bytes, batch, style).values()) for w in work)
    mean = sum(t.compute_s for t in times) / len(times)
    return Prediction(dims, checkpointing, seq_len, step, dims.data_parallel_size * batch * seq_len / step, peak,
                      peak.total <= device.memory_bytes, nbytes, times, max(t.compute_s for t in times) / mean)


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


TIE = 0.001  # throughputs this close are a tie for the model (it is not that precise): the smaller peak wins


def recommend(predictions: list[Prediction]) -> Prediction | None:
    """The highest-throughput prediction that fits the device memory (``None`` when none fits); among those within
    :data:`TIE` of it, the one with the smallest peak memory."""
    fitting = [p for p in predictions if p.fits]
    if not fitting:
        return None
    top = max(p.tokens_per_s for p in fitting)
    return min((p for p in fitting if p.tokens_per_s >= top * (1 - TIE)), key=lambda p: p.memory.total)


__all__ = ["Cluster", "CommStyle", "Recipe", "RankWork", "Memory", "RankTime", "Prediction", "allowed_key_counts", "key_intervals",
           "rank_work",
           "kv_bytes_by_name", "memory", "rank_times", "predict", "layouts", "plan_all", "recommend", "gather_size",
           "mask_rule_of", "layer_windows"]
