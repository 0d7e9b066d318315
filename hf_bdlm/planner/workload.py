"""What the planner prices, and how: a workload's step on a device, a cluster and a recipe, and the layout it picks.

A *workload* (:class:`Workload`) is what one training step of one layout puts on each rank of a group: the
programs of the step's segments (:mod:`.schedule`'s compute, sends and waits, in seconds at the device's rates),
each rank's compute and its parts, the parameters FSDP2 shards, each rank's peak memory by part and the bytes it
receives by name. The planner prices every workload the same way (:func:`price_step`):

- the segments run one after another across the group (:func:`~.schedule.simulate`; each starts when the previous
  one's slowest rank is done), every rank's busy, waiting and idle time summed;
- FSDP2 over the world: the bf16 parameters gathered forward and again backward, the gradients reduce-scattered (DDP:
  one all-reduce, twice a reduce-scatter's bytes), hidden behind every layer's compute but the first;
- the peak over the ranks against the device's memory, the most bytes any rank receives.

Two workloads implement it: a backbone's layers on the project's plan (:class:`hf_bdlm.planner.cost.BackboneStep`),
and a model family's own step (a speculative drafter's, in its family's folder, which imports the planner; the planner
never imports a family). :func:`recommend` picks among their predictions (:class:`LayoutPrediction`) the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import lru_cache
from typing import Callable, Protocol, Sequence, runtime_checkable

from ..parallel.dims import ParallelDims
from .hardware import DeviceSpec
from .model import ModelSpec
from .schedule import simulate

FWD_ATTN_FLOPS_PER_PAIR_HEAD_DIM = 4  # QK^T and PV: 2 FLOPs per multiply-add each
BWD_ATTN_FLOPS_PER_PAIR_HEAD_DIM = 10  # dV, dP, dQ, dK plus the recomputed QK^T (FlashAttention's backward)
TIE = 0.001  # throughputs this close are a tie for the model (it is not that precise): the preferred one wins


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

    def model_parallel_seconds(self, model: ModelSpec, rows: int, batch: int, nvlink_bytes_per_s: float) -> float:
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
# the workload interface
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryParts:
    """Peak bytes of one rank, by part: a workload's memory record subclasses it with its parts as fields (their sum
    is :attr:`total`)."""

    @property
    def total(self) -> float:
        return sum(self.parts().values())

    def parts(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def divided(self, n: int) -> "MemoryParts":
        """Every part divided among ``n`` devices (a rank's GPUs under model parallelism)."""
        return replace(self, **{k: v / n for k, v in self.parts().items()})


@dataclass(frozen=True)
class StepTerms:
    """One step of one layout as a workload puts it on the ranks of a group, for :func:`price_step`.

    ``segments``: in order, each rank's program of one segment (a tuple per rank of :mod:`.schedule` operations) and
    how many times the segment runs; ``compute_s``: each rank's work at its own processor's rate (seconds; the
    programs' compute, summed the workload's way); ``parts``: each rank's terms by the workload's names (seconds;
    what it reports per part); ``sharded_params``: the trainable parameters FSDP2 shards over the world;
    ``layers``: the FSDP2 units whose compute that traffic hides behind (all but the first).
    """

    segments: tuple
    compute_s: tuple[float, ...]
    parts: tuple[dict, ...]
    sharded_params: int
    layers: int


@runtime_checkable
class Workload(Protocol):
    """What a model's training step puts on each rank of a group, for one layout (``dims``). The planner prices it
    (:func:`price_step`) on a device, a cluster and a recipe."""

    dims: ParallelDims

    def step_terms(self, device: DeviceSpec, cluster: Cluster, recipe: Recipe, checkpointing: bool) -> StepTerms:
        """The step's segments, compute and parts (seconds at ``device``'s rates, ``cluster``'s links)."""
        ...

    def rank_memory(self, recipe: Recipe, checkpointing: bool) -> Sequence[MemoryParts]:
        """Each rank's peak memory by part."""
        ...

    def bytes_received(self, recipe: Recipe) -> Sequence[dict[str, float]]:
        """Each rank's bytes received per step, by name (forward and backward)."""
        ...


# ----------------------------------------------------------------------------------------------
# pricing a workload
# ----------------------------------------------------------------------------------------------
@lru_cache(maxsize=1024)
def _segment(programs: tuple, cores: int, efficiency: float, sync_cost: float) -> tuple[float, tuple]:
    """A segment's duration (its slowest rank) and each rank's schedule (all ranks start it together)."""
    sched = simulate(programs, cores, efficiency, sync_cost)
    return max(s.finish for s in sched), tuple(sched)


@dataclass(frozen=True)
class StepTimes:
    """The scheduled step of every rank (seconds): ``busy_s`` computing (beyond its work where it shared a
    processor), ``waited_s`` blocked in waits on messages, ``idle_s`` done with a segment before the group's slowest
    rank; FSDP2's traffic (``fsdp_comm_s``) and the part of it no compute hides (``fsdp_exposed_s``)."""

    busy_s: tuple[float, ...]
    waited_s: tuple[float, ...]
    idle_s: tuple[float, ...]
    fsdp_comm_s: float
    fsdp_exposed_s: float


def schedule_step(terms: StepTerms, dims: ParallelDims, device: DeviceSpec, cluster: Cluster,
                  recipe: Recipe) -> StepTimes:
    """The step of :class:`StepTerms` on the group: its segments scheduled one after another, plus FSDP2's parameter
    and gradient traffic over the world (``dims.world_size``)."""
    P = len(terms.compute_s)
    busy, waited, idle = [0.0] * P, [0.0] * P, [0.0] * P
    for programs, count in terms.segments:
        span, sched = _segment(tuple(programs), device.shared_cores, device.oversubscribed_efficiency,
                               device.sync_cost_s)
        for r, s in enumerate(sched):
            busy[r] += count * s.busy
            waited[r] += count * s.waited
            idle[r] += count * (span - s.finish)
    fsdp_exposed = fsdp_comm = 0.0
    W = dims.world_size or dims.block_parallel_size
    if W > 1 and recipe.gradient_sync:
        # FSDP2: all-gather the bf16 parameters in forward and again in backward, reduce-scatter the gradients (DDP:
        # one all-reduce, twice the bytes of a reduce-scatter), overlapped with every layer's compute but the first.
        n = terms.sharded_params
        frac = (W - 1) / W
        data = (2 * n * recipe.param_bytes + n * recipe.grad_bytes) * frac if recipe.fsdp else \
            2 * n * recipe.grad_bytes * frac
        data /= recipe.model_parallel  # each GPU of a rank holds its share of the parameters
        fsdp_comm = data / device.link_bytes_per_s(cluster.spans_nodes(W))
        fsdp_exposed = max(0.0, fsdp_comm - min(terms.compute_s) * (1 - 1 / max(1, terms.layers)))
    return StepTimes(tuple(busy), tuple(waited), tuple(idle), fsdp_comm, fsdp_exposed)


@dataclass(frozen=True)
class PricedStep:
    """A workload's step priced: its terms, their schedule, every rank's memory, the peak, whether it fits the device
    and the most bytes a rank receives per step."""

    terms: StepTerms
    times: StepTimes
    memory: tuple[MemoryParts, ...]
    peak: MemoryParts
    fits: bool
    bytes_per_step: float


def price_step(workload: Workload, device: DeviceSpec, cluster: Cluster, recipe: Recipe,
               checkpointing: bool) -> PricedStep:
    """Time, memory and bytes of a workload's step (``workload.dims`` with its world size)."""
    terms = workload.step_terms(device, cluster, recipe, checkpointing)
    times = schedule_step(terms, workload.dims, device, cluster, recipe)
    mems = tuple(workload.rank_memory(recipe, checkpointing))
    peak = max(mems, key=lambda m: m.total)
    nbytes = max(sum(b.values()) for b in workload.bytes_received(recipe))
    return PricedStep(terms, times, mems, peak, peak.total <= device.memory_bytes, nbytes)


# ----------------------------------------------------------------------------------------------
# predictions and the pick
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayoutPrediction:
    """One layout's predicted step: what every workload's prediction has (a workload's subclass adds its own). The
    subclass names its layout (:attr:`label`)."""

    dims: ParallelDims
    checkpointing: bool
    seq_len: int
    step_s: float
    tokens_per_s: float
    memory: MemoryParts
    fits: bool
    bytes_per_step: float  # bytes the rank receiving the most receives per step

    @property
    def label(self) -> str:
        d = self.dims
        return f"{d.mode} P={d.block_parallel_size} C={d.clean_ring_size} D={d.data_parallel_size}"

    @property
    def name(self) -> str:
        """The layout and whether activation checkpointing is on (``"... AC on"``)."""
        return f"{self.label} AC {'on' if self.checkpointing else 'off'}"


def recommend(predictions: Sequence[LayoutPrediction],
              prefer: Callable[[LayoutPrediction], object] = lambda p: p.memory.total,
              **match) -> LayoutPrediction | None:
    """The highest-throughput prediction that fits the device memory among those whose dims match ``match`` (e.g.
    ``mode="cp"``, ``block_parallel_size=8``); among those within :data:`TIE` of it, the one ``prefer`` ranks first
    (default: the smallest peak memory). ``None`` when none fits."""
    found = [p for p in predictions if p.fits and all(getattr(p.dims, k) == v for k, v in match.items())]
    if not found:
        return None
    top = max(p.tokens_per_s for p in found)
    return min((p for p in found if p.tokens_per_s >= top * (1 - TIE)), key=prefer)


def context_label(tokens: int) -> str:
    """A context length for tables: ``"512K"``, ``"1M"``."""
    return f"{tokens // 1048576}M" if tokens % 1048576 == 0 else f"{tokens // 1024}K"


def ratio_label(ratio: float | None) -> str:
    """A ratio for tables (``"2.48x"``), ``"n/a"`` when there is none."""
    return "n/a" if ratio is None else f"{ratio:.2f}x"


__all__ = ["FWD_ATTN_FLOPS_PER_PAIR_HEAD_DIM", "BWD_ATTN_FLOPS_PER_PAIR_HEAD_DIM", "TIE", "Cluster", "Recipe",
           "MemoryParts", "StepTerms", "Workload", "StepTimes", "schedule_step", "PricedStep", "price_step",
           "LayoutPrediction", "recommend", "context_label", "ratio_label"]
