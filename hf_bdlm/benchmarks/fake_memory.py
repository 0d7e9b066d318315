"""No ``L x L`` tensor: every allocation of a training step's attention at the paper's lengths, without a GPU.

A layer's attention (forward and backward of one Gemma-3-27B-shaped layer: 32 query heads, 16 K/V heads, head dim
128, bf16; a full and a sliding-window layer) runs under :class:`~torch._subclasses.fake_tensor.FakeTensorMode` for
every layout (one device, with and without packed documents; one rank of ``cp``, the paper's CP, ``bp`` and ``csbp``
at ``P = 8``) and backend, at 128K-512K tokens, and a whole 2-layer model step at the 27B's width. Fake tensors
carry shapes, dtypes and strides but no data, so the study takes minutes on a CPU; an :class:`AllocationRecorder` (a
``TorchDispatchMode`` over the fake mode) sees the output of every operator and counts a new storage as an
allocation and a dead one as freed, which gives the largest single tensor (elements, bytes, shape, the operator that
made it) and the peak of live bytes of the step. The check of issue 42: no tensor of at least ``(2L)^2 / 64``
elements on the path CUDA takes (``flex``); at this width a row of q is ``2L/64`` elements at 128K, so the records
also give the exponent with which every allocation grows with ``L`` (:func:`add_growth`).
``tests/attention/test_no_quadratic_tensor.py`` runs the check with narrow heads.

What is emulated, and how:

- **The FlexAttention kernel.** It cannot run on fake tensors, so :func:`hf_bdlm.attention.flex.flex_call` is
  replaced by a shape-only stand-in (:class:`_FlexStandIn`) whose own allocations are what the kernel returns: ``out
  [b, H, T, d]`` in the input dtype and ``lse [b, H, T]`` float32 in forward; ``dq``, ``dk``, ``dv`` (K/V heads, not
  repeated: GQA) and the float32 ``delta [b, H, T]`` row sums in backward. The kernel's own workspace (its on-chip
  tiles) is not counted. Everything around it (the per-source calls, the log-sum-exp merge, the
  K/V exchange and its buffers, autograd) is the library's code running as it runs on CUDA.
- **The CUDA branch.** A PyTorch built without CUDA cannot run autograd on fake CUDA tensors (its autograd metadata
  asks for the CUDA device guard and the process aborts), so the tensors are fake CPU tensors that report
  ``device.type == "cuda"`` to the code of :mod:`hf_bdlm.attention.flex` only: its one device branch (the CPU
  refusal / detach in ``attend_flex``) then takes the CUDA way. Nothing else on the flex path reads the device.
- **Host-side structures** (block masks, tile plans, window exchange lists, the "every pair allowed" test) are built
  for real on the CPU first, by the library's own functions, into the layout's cache: what a CUDA run builds on the
  host too. The block masks' index arrays (int32 ``[batch, 1, q tiles, kv tiles]``, moved to the GPU on CUDA) are
  measured there, not under the fake mode: ``mask_index_bytes``.
- **A rank of a group** runs in this one process: its :class:`~hf_bdlm.parallel.sharded.ShardedLayout` over a
  :class:`FakeComm` whose collectives allocate their buffers as the real ones do and move nothing
  (:func:`emulated_collectives`). The rank measured is the one with the most query x key rows (ties: the lowest).

What only a GPU can confirm: the kernel's own workspace, the caching allocator's fragmentation and rounding, and
that the compiled kernel allocates nothing beyond its outputs (``torch.cuda.max_memory_allocated`` around the same
step; ``benchmarks/gpu/`` has the runbook).

    python -m hf_bdlm.benchmarks.fake_memory --lengths 131072 262144 524288 --out benchmarks/results/fake_memory
    python -m hf_bdlm.benchmarks.fake_memory --lengths 16384 32768 --backends flex dense --model-lengths --out /tmp/fm
    python -m hf_bdlm.benchmarks.fake_memory --report-only --out benchmarks/results/fake_memory  # summary.md again
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import pathlib
import platform
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import Gemma3TextConfig

from ..attention import backends, flex, kernels
from ..attention import interface as attention_interface
from ..attention.block_mask import build_block_mask
from ..attention.masks import MaskRule
from ..attention.tiles import batch_plans
from ..parallel import collectives
from ..parallel import exchange as parallel_exchange
from ..parallel.dims import ParallelDims
from ..parallel.plan import PlanConfig, make_plan
from ..parallel.sharded import ShardedLayout
from ..planner.model import GEMMA3_27B
from ..protocols.registry import family_named, get_objective

LAYOUTS = ("single", "single-docs", "cp", "cp-paper", "bp", "csbp")
BACKENDS = ("flex", "blockwise", "dense")
KINDS = ("full", "sliding")
CUDA = torch.device("cuda")


@dataclass(frozen=True)
class LayerShape:
    """One attention layer's shape: query heads, K/V heads, head dim, dtype, the sliding layers' window."""

    heads: int
    kv_heads: int
    head_dim: int
    window: int
    block_size: int
    dtype: torch.dtype = torch.bfloat16

    @classmethod
    def gemma3_27b(cls) -> "LayerShape":
        b = GEMMA3_27B["backbone_config"]
        return cls(b["num_attention_heads"], b["num_key_value_heads"], b["head_dim"], b["sliding_window"],
                   GEMMA3_27B["block_size"])

    def rule(self, kind: str) -> MaskRule:
        base = MaskRule(self.block_size, GEMMA3_27B["clean_attention"])
        return base if kind == "full" else base.with_window(self.window)


def threshold(seq_len: int) -> int:
    """The issue's bound: ``(2L)^2 / 64`` elements (a tensor this large is taken for an ``L x L`` one)."""
    return (2 * seq_len) ** 2 // 64


# --- recording allocations ---------------------------------------------------------------------------------------


@dataclass
class Allocation:
    op: str
    shape: tuple[int, ...]
    dtype: str
    elements: int
    bytes: int


class AllocationRecorder(TorchDispatchMode):
    """Records every new storage an operator returns (an allocation) and notices when it dies (freed).

    Push it inside a ``FakeTensorMode`` (it then sees the fake outputs). An output whose storage is new (not one of its
    inputs' and not alive already) is an allocation of the storage's whole size. ``largest`` is the biggest
    allocation, ``peak_bytes`` the most bytes alive at once among the storages allocated while recording, ``top``
    the few largest distinct (op, shape) allocations, ``sizes`` / ``ops`` every allocation in order (to compare runs
    at two lengths). An allocation is named by the innermost ``label(name)`` around it, else by its operator (and, in
    backward, the autograd node that ran it). Storages that existed before recording (parameters) are not counted.
    """

    def __init__(self, keep: int = 6):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = self.peak_bytes = self.count = self.total_bytes = 0
        self.largest: Allocation | None = None
        self.top: list[Allocation] = []
        self.sizes: list[int] = []
        self.ops: list[str] = []
        self.keep = keep
        self._labels: list[str] = []
        self.paused = False
        self.flex_calls = self.flex_backward_calls = 0  # the stand-in's forward and backward runs

    @contextlib.contextmanager
    def label(self, name: str):
        self._labels.append(name)
        try:
            yield
        finally:
            self._labels.pop()

    def _sweep(self) -> None:
        dead = [key for key, (ref, _) in self.live.items() if ref.expired()]
        for key in dead:
            self.current -= self.live.pop(key)[1]

    def _name(self, func) -> str:
        if self._labels:
            return self._labels[-1]
        node = torch._C._current_autograd_node()
        return f"{func} (backward: {type(node).__name__})" if node is not None else str(func)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in inputs:
                continue  # a view of an input, or written in place
            found = self.live.get(key)
            if found is not None:
                if not found[0].expired():
                    continue  # a second output on one new storage
                self.current -= self.live.pop(key)[1]  # a dead storage's address, reused
            nbytes = storage.nbytes()
            if self.current + nbytes > self.peak_bytes:
                # Frees are found lazily: only when this allocation could raise the peak does the exact number of
                # live bytes matter (the peak stays exact; the scan of every live storage runs rarely).
                self._sweep()
            self.live[key] = (StorageWeakRef(storage), nbytes)
            self.current += nbytes
            self.peak_bytes = max(self.peak_bytes, self.current)
            self.count += 1
            self.total_bytes += nbytes
            alloc = Allocation(self._name(func), tuple(t.shape), str(t.dtype).replace("torch.", ""),
                               nbytes // max(t.element_size(), 1), nbytes)
            self.sizes.append(alloc.elements)
            self.ops.append(alloc.op)
            if self.largest is None or alloc.elements > self.largest.elements:
                self.largest = alloc
            self._keep_top(alloc)
        return out

    def _keep_top(self, alloc: Allocation) -> None:
        if len(self.top) == self.keep and alloc.bytes <= self.top[-1].bytes:
            return
        if any(a.op == alloc.op and a.shape == alloc.shape for a in self.top):
            return
        self.top = sorted(self.top + [alloc], key=lambda a: -a.bytes)[: self.keep]


# --- emulated collectives ----------------------------------------------------------------------------------------


@dataclass
class FakeComm:
    """The :class:`~hf_bdlm.parallel.collectives.CommContext` of one rank, in one process: the collectives of
    :func:`emulated_collectives` allocate their buffers and move nothing; received bytes are counted."""

    size: int
    rank: int
    received: int = 0
    group: None = None

    def started(self, label: str, nbytes: int, element_size: int):
        self.received += int(nbytes)
        return None

    def hold(self, ready_at) -> None:
        pass

    def wait(self, work, what: str) -> None:
        pass


@contextlib.contextmanager
def emulated_collectives():
    """All-gather, reduce-scatter and all-to-all that return at once (their output buffers are allocated by the
    library as on a real group, under the fake mode: shapes only)."""
    saved = (collectives._all_gather_single, collectives._reduce_scatter_single, dist.all_to_all_single,
             collectives.start_gather, collectives.start_reduce_scatter, collectives._start_all_to_all)

    def labelled(fn):
        def run(*args, **kwargs):
            with _label(f"{fn.__name__} (parallel/collectives.py)"):
                return fn(*args, **kwargs)
        return run

    collectives._all_gather_single = lambda *a, **k: None
    collectives._reduce_scatter_single = lambda *a, **k: None
    dist.all_to_all_single = lambda *a, **k: None
    collectives.start_gather, collectives.start_reduce_scatter, collectives._start_all_to_all = (
        labelled(f) for f in saved[3:])
    try:
        yield
    finally:
        (collectives._all_gather_single, collectives._reduce_scatter_single, dist.all_to_all_single,
         collectives.start_gather, collectives.start_reduce_scatter, collectives._start_all_to_all) = saved


# --- the flex kernel's stand-in and the CUDA branch ----------------------------------------------------------------

_RECORDER: list[AllocationRecorder] = []


def _label(name: str):
    return _RECORDER[-1].label(name) if _RECORDER else contextlib.nullcontext()


class _FlexStandIn(torch.autograd.Function):
    """FlexAttention's outputs and gradients, shapes only (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v):
        b, h, t, _ = q.shape
        if _RECORDER:
            _RECORDER[-1].flex_calls += 1
        with _label("flex_attention (stand-in): out, lse"):
            out = q.new_empty((b, h, t, v.shape[-1]))
            lse = q.new_empty((b, h, t), dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        if _RECORDER:
            _RECORDER[-1].flex_backward_calls += 1
        with _label("flex_attention backward (stand-in): delta, dq, dk, dv"):
            delta = lse.new_empty(lse.shape)  # the kernel's rowsum(out * grad_out), float32
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        del delta
        return dq, dk, dv


def _stand_in_flex_call(q, k, v, block_mask, scale: float, with_lse: bool, *args, **kwargs):
    out, lse = _FlexStandIn.apply(q, k, v)
    return out, (lse if with_lse else None)


_ORIGINAL_DEVICE = FakeTensor.device
_FLEX_FILE = flex.__file__


def _device_seen_by_flex(self):
    """``FakeTensor.device``, except that code of :mod:`hf_bdlm.attention.flex` reading it sees ``cuda`` for a fake
    CPU tensor: the fake mode itself, the stand-in and every other module see the tensor's real (fake) device."""
    found = _ORIGINAL_DEVICE.fget(self)
    if found.type == "cpu" and sys._getframe(1).f_code.co_filename == _FLEX_FILE:
        return CUDA
    return found


@contextlib.contextmanager
def flex_on_fake_cuda():
    """Runs ``flex`` with the stand-in kernel and its CUDA branch (module docstring)."""
    original_call = flex.flex_call
    flex.flex_call = _stand_in_flex_call
    FakeTensor.device = property(_device_seen_by_flex)
    try:
        yield
    finally:
        FakeTensor.device = _ORIGINAL_DEVICE
        flex.flex_call = original_call


@contextlib.contextmanager
def blockwise_host_reads():
    """``blockwise`` reads its plans' index tensors (real CPU tensors) for values while it runs (whether a batched
    call's rows are equally spaced, so that a strided view replaces a copy): those reads run outside the fake mode,
    unrecorded, as the host code they are."""
    original = kernels._equally_spaced

    def on_host(rows):
        recorder = _RECORDER[-1] if _RECORDER else None
        if recorder is not None:
            recorder.paused = True
        try:
            with unset_fake_temporarily():
                return original(rows)
        finally:
            if recorder is not None:
                recorder.paused = False

    kernels._equally_spaced = on_host
    try:
        yield
    finally:
        kernels._equally_spaced = original


# --- host-side preparation ---------------------------------------------------------------------------------------


def _mask_bytes(mask) -> int:
    arrays = (mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices, mask.q_num_blocks,
              mask.q_indices, mask.full_q_num_blocks, mask.full_q_indices)
    return sum(a.numel() * a.element_size() for a in arrays if a is not None)


def _mask_elements(mask) -> int:
    return max(a.numel() for a in (mask.kv_indices, mask.full_kv_indices, mask.q_indices, mask.full_q_indices)
               if a is not None)


@dataclass
class HostWork:
    seconds: float = 0.0
    mask_bytes: int = 0
    mask_largest_elements: int = 0
    masks: int = 0
    sources: list = field(default_factory=list)


@contextlib.contextmanager
def host_pass(backend: str, work: HostWork):
    """Replaces the attention call of the layouts by the host-side work the backend does before its kernels (into
    the layout's cache, as the library caches it); the layout's own code (K/V selection, exchange lists) runs as
    usual on small real tensors."""
    def host_attend(name, q, sources, q_rows, k_rows, rule, scale, cache):
        start = time.perf_counter()
        work.sources = [r.num_rows for r in k_rows]
        if len(sources) == 1 and isinstance(sources[0], tuple) and backends._unmasked(q_rows, k_rows[0], rule,
                                                                                      cache):
            work.sources = ["all pairs allowed"]
        elif name == "flex":
            built = []

            def build_on_host(q_rows, k_rows, rule, device=None):
                mask = build_block_mask(q_rows, k_rows, rule)  # on the CPU: the fake run finds it in the cache
                built.append(mask)
                return mask

            flex.build_block_mask = build_on_host
            try:
                for i, rows in enumerate(k_rows):
                    flex._block_mask(cache, i, q_rows, rows, rule, CUDA)
            finally:
                flex.build_block_mask = build_block_mask
            work.masks += len(built)
            work.mask_bytes += sum(_mask_bytes(m) for m in built)
            work.mask_largest_elements = max([work.mask_largest_elements] + [_mask_elements(m) for m in built])
        elif name == "blockwise":
            batch_plans(q_rows, k_rows, rule, cache, q.shape[0])
        work.seconds += time.perf_counter() - start
        return q

    saved = parallel_exchange.attend, attention_interface.attend
    parallel_exchange.attend = attention_interface.attend = host_attend
    try:
        yield
    finally:
        parallel_exchange.attend, attention_interface.attend = saved


# --- layouts ---------------------------------------------------------------------------------------------------


def packed_documents(seq_len: int, block_size: int) -> torch.Tensor:
    """Document ids ``[1, L]`` of a packed batch: 8 documents of unequal lengths, aligned to blocks."""
    blocks = seq_len // block_size
    weights = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6], dtype=torch.float64)
    cuts = (weights.cumsum(0) / weights.sum() * blocks).round().long().clamp(1, blocks)
    ids = torch.searchsorted(cuts, torch.arange(blocks), right=True).clamp(max=len(weights) - 1)
    return ids.repeat_interleave(block_size)[None]


def _dims(layout: str, group_size: int) -> ParallelDims:
    if layout == "cp-paper":
        return ParallelDims(group_size, mode="cp", cp_layout="paper")
    return ParallelDims(group_size, mode=layout)


def _sharded(layout: str, group_size: int, seq_len: int, rule: MaskRule, backend: str, rank: int) -> ShardedLayout:
    dims = _dims(layout, group_size)
    plan = make_plan(PlanConfig.from_dims(dims, seq_len, rule.block_size))
    comm_size = 1 if not dims.mode.exchanges_kv else (group_size if dims.mode.sends_noisy_kv else dims.clean_ring_size)
    comm = FakeComm(comm_size, rank % comm_size)
    groups = SimpleNamespace(dims=dims, group_rank=rank, kv_exchange=lambda mode: comm)
    return ShardedLayout(plan, groups, rule, backend)


def busiest_rank(layout: str, group_size: int, seq_len: int, block_size: int) -> int:
    """The rank with the most query rows x key rows (its own and its peers' sent rows), the lowest on ties."""
    dims = _dims(layout, group_size)
    plan = make_plan(PlanConfig.from_dims(dims, seq_len, block_size))
    sent = [sum(e - s for s, e in plan.sent_ranges(m)) for m in range(group_size)]

    def load(r: int) -> int:
        rows = plan.ranks[r].num_rows
        return rows * (rows + sum(sent[m] for m in plan.exchange_members(r) if m != r))

    return max(range(group_size), key=lambda r: (load(r), -r))


def make_layout(layout: str, seq_len: int, shape: LayerShape, backend: str, group_size: int = 8):
    """``(layout, its query rows, the rank measured or None)`` for one of :data:`LAYOUTS` (a layer's rule is passed to
    its ``attend``; the layout holds the full-attention one)."""
    base = shape.rule("full")
    if layout in ("single", "single-docs"):
        doc = packed_documents(seq_len, shape.block_size) if layout == "single-docs" else None
        out = attention_interface.LocalLayout.vectorized(seq_len, base, backend, document_ids=doc)
        return out, out.q_rows.num_rows, None
    rank = busiest_rank(layout, group_size, seq_len, shape.block_size)
    out = _sharded(layout, group_size, seq_len, base, backend, rank)
    return out, out.q_rows.num_rows, rank


# --- one measurement ---------------------------------------------------------------------------------------------


@dataclass
class Record:
    """One measured step. ``largest``: the largest allocation (:class:`Allocation` as a dict); ``passed``: it and the
    largest block-mask index array are both under ``threshold_elements``; ``growth``: filled by :func:`add_growth`."""

    study: str
    layout: str
    backend: str
    seq_len: int
    kind: str
    group_size: int
    rank: int | None
    query_rows: int
    threshold_elements: int
    largest: dict | None = None
    passed: bool | None = None
    growth: float | None = None
    growth_basis: str | None = None
    peak_bytes: int = 0
    allocations: int = 0
    allocated_bytes: int = 0
    mask_index_bytes: int = 0
    mask_largest_elements: int = 0
    key_sources: list = field(default_factory=list)
    received_bytes: int = 0
    flex_calls: int = 0
    flex_backward_calls: int = 0
    host_seconds: float = 0.0
    fake_seconds: float = 0.0
    top: list = field(default_factory=list)
    error: str | None = None


def _error(err: Exception) -> str:
    """The exception and the innermost frame of this package it passed through (file:line)."""
    where = [f for f in traceback.extract_tb(err.__traceback__) if "hf_bdlm" in f.filename]
    at = f" at {where[-1].filename.split('hf_bdlm/')[-1]}:{where[-1].lineno}" if where else ""
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:240]}{at}"


@contextlib.contextmanager
def recording(backend: str, fake_mode: FakeTensorMode | None = None):
    """The fake mode (a new one by default), emulated collectives, the backend's emulation, and an
    :class:`AllocationRecorder` on top."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(fake_mode or FakeTensorMode(allow_non_fake_inputs=True))
        stack.enter_context(emulated_collectives())
        if backend == "flex":
            stack.enter_context(flex_on_fake_cuda())
        if backend == "blockwise":
            stack.enter_context(blockwise_host_reads())
        recorder = stack.enter_context(AllocationRecorder())
        _RECORDER.append(recorder)
        stack.callback(_RECORDER.pop)
        yield recorder


def measure_attention(layout: str, backend: str, seq_len: int, kind: str, shape: LayerShape | None = None,
                      group_size: int = 8) -> Record:
    """Forward and backward of one layer's attention under the fake mode; every allocation recorded."""
    shape = shape or LayerShape.gemma3_27b()
    rule = shape.rule(kind)
    obj, rows, rank = make_layout(layout, seq_len, shape, backend, group_size)
    record = Record("attention", layout, backend, seq_len, kind, 1 if rank is None else group_size, rank, rows,
                    threshold(seq_len))
    work = HostWork()
    with host_pass(backend, work), emulated_collectives():  # small real tensors: only the rows matter here
        small = torch.zeros(1, 1, rows, 1)
        obj.attend(None, small, small, small.clone(), rule, 1.0)
    record.host_seconds, record.mask_index_bytes = work.seconds, work.mask_bytes
    record.mask_largest_elements, record.key_sources = work.mask_largest_elements, work.sources
    comm = obj.exchange.comm if isinstance(obj, ShardedLayout) else None
    if comm is not None:
        comm.received = 0
    start = time.perf_counter()
    recorder = None
    try:
        with recording(backend) as recorder:
            with recorder.label("input q, k, v"):
                q = torch.empty(1, shape.heads, rows, shape.head_dim, dtype=shape.dtype, requires_grad=True)
                k = torch.empty(1, shape.kv_heads, rows, shape.head_dim, dtype=shape.dtype, requires_grad=True)
                v = torch.empty(1, shape.kv_heads, rows, shape.head_dim, dtype=shape.dtype, requires_grad=True)
            out = obj.attend(None, q, k, v, rule, shape.head_dim ** -0.5)
            with recorder.label("grad of the output (ones)"):
                grad = torch.ones_like(out)
            out.backward(grad)
            del q, k, v, out, grad
    except Exception as err:  # noqa: BLE001 - recorded: the table says what could not run and where
        record.error = _error(err)
    record.fake_seconds = time.perf_counter() - start
    _fill(record, recorder)
    if comm is not None:
        record.received_bytes = comm.received
    return record


def _fill(record: Record, recorder: AllocationRecorder | None) -> None:
    if recorder is None:
        return
    record.peak_bytes, record.allocations, record.allocated_bytes = (recorder.peak_bytes, recorder.count,
                                                                     recorder.total_bytes)
    record.largest = None if recorder.largest is None else asdict(recorder.largest)
    record.top = [asdict(a) for a in recorder.top]
    record.flex_calls, record.flex_backward_calls = recorder.flex_calls, recorder.flex_backward_calls
    record._sizes, record._ops = recorder.sizes, recorder.ops  # not serialized: for add_growth
    if record.error is None and recorder.largest is not None:
        record.passed = recorder.largest.elements < record.threshold_elements and \
            record.mask_largest_elements < record.threshold_elements


def _exponent(small: Record, large: Record) -> tuple[float, str]:
    """The largest exponent with which an allocation of ``small``'s step grows into ``large``'s, and how the
    allocations were paired (see :func:`add_growth`)."""
    scale = math.log(large.seq_len / small.seq_len)

    def worst(pairs) -> float:
        return max((math.log(y / x) / scale for x, y in pairs if x > 0 and y > 0), default=0.0)

    if small._ops == large._ops:
        return worst(zip(small._sizes, large._sizes)), "every allocation"
    by_op: dict[str, tuple[list, list]] = {}
    for ops, sizes, side in ((small._ops, small._sizes, 0), (large._ops, large._sizes, 1)):
        for op, n in zip(ops, sizes):
            by_op.setdefault(op, ([], []))[side].append(n)
    found = 0.0
    for a, b in by_op.values():
        if len(a) == len(b):
            found = max(found, worst(zip(sorted(a), sorted(b))))
        elif a and b:
            found = max(found, worst([(max(a), max(b))]))
    return found, "per operator"


def add_growth(records: list[Record]) -> None:
    """For each configuration measured at several lengths, the exponent ``g`` with which its allocations grow in ``L``
    (1: linear, 2: quadratic), written into every record of it.

    When two consecutive lengths make the same sequence of allocations (the same operators in the same order: every
    flex and dense step), ``g`` is the largest per-allocation exponent ``log(e2 / e1) / log(L2 / L1)``
    (``growth_basis="every allocation"``): no tensor of the step grows faster. Otherwise (the model step's loss runs
    one chunk per 8192 targets; blockwise one kernel call per tile) the allocations are paired per operator: in size
    order where an operator allocates as often at both lengths (the k-th smallest of the longer run is at most ``c``
    times the k-th smallest of the shorter one when every allocation grows by at most ``c``), by their largest
    otherwise (``"per operator"``).
    """
    groups: dict[tuple, list[Record]] = {}
    for r in records:
        if r.error is None and r.largest is not None and hasattr(r, "_sizes"):
            groups.setdefault((r.study, r.layout, r.backend, r.kind, r.group_size), []).append(r)
    for found in groups.values():
        found.sort(key=lambda r: r.seq_len)
        pairs = [_exponent(a, b) for a, b in zip(found, found[1:])]
        if pairs:
            for r in found:
                r.growth = round(max(g for g, _ in pairs), 3)
                r.growth_basis = "per operator" if any(b == "per operator" for _, b in pairs) else "every allocation"


# --- a whole 2-layer model step ------------------------------------------------------------------------------------


def gemma3_two_layer_config(backend: str = "flex"):
    """The BDLM config of a 2-layer Gemma 3 of the 27B's width (one sliding, one full layer; full vocabulary)."""
    b = GEMMA3_27B["backbone_config"]
    backbone = Gemma3TextConfig(
        hidden_size=b["hidden_size"], num_hidden_layers=2, num_attention_heads=b["num_attention_heads"],
        num_key_value_heads=b["num_key_value_heads"], head_dim=b["head_dim"],
        intermediate_size=b["intermediate_size"], vocab_size=b["vocab_size"], sliding_window=b["sliding_window"],
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=1 << 20,
        tie_word_embeddings=True, attn_logit_softcapping=None, final_logit_softcapping=None)
    return family_named("block_diffusion").new_config(
        backbone_config=backbone, block_size=GEMMA3_27B["block_size"], clean_attention=GEMMA3_27B["clean_attention"],
        mask_token_id=b["vocab_size"] - 1, attention_backend=backend)


def measure_model_step(seq_len: int, backend: str = "flex") -> Record:
    """One training step (forward and backward) of a 2-layer Gemma-3 BDLM of the 27B's width on one device (``2L``
    rows), as :meth:`~hf_bdlm.objectives.base.Objective.loss` runs it (the backbone over the layout's rows, then the
    objective's chunked cross-entropy; every noisy row scored, the most the loss can hold). The parameters are built
    before recording (not counted), their gradients are counted."""
    config = gemma3_two_layer_config(backend)
    record = Record("model", "single", backend, seq_len, "2-layer step", 1, None, 2 * seq_len, threshold(seq_len))
    shape = LayerShape.gemma3_27b()
    layout = attention_interface.LocalLayout.vectorized(seq_len, shape.rule("full"), backend)
    work = HostWork()
    with host_pass(backend, work):
        small = torch.zeros(1, 1, 2 * seq_len, 1)
        for kind in KINDS:
            layout.attend(None, small, small, small.clone(), shape.rule(kind), 1.0)
    record.host_seconds, record.mask_index_bytes = work.seconds, work.mask_bytes
    record.mask_largest_elements = work.mask_largest_elements
    objective = get_objective("standard", config)
    start = time.perf_counter()
    recorder = None
    try:
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        with fake_mode:
            default_dtype = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)  # fake parameters cannot be cast in place: build them in bf16
            try:
                model = family_named("block_diffusion").new_model(config).train()
            finally:
                torch.set_default_dtype(default_dtype)
        with recording(backend, fake_mode) as recorder:
            noisy = torch.zeros(1, seq_len, dtype=torch.long)
            clean = torch.zeros(1, seq_len, dtype=torch.long)
            ids, pos = layout.local_inputs(noisy, clean, torch.arange(seq_len)[None])
            out = model(input_ids=ids, position_ids=pos, bdlm_layout=layout, return_logits=False)
            # Objective.loss_from_hidden selects the held targets' rows by a boolean mask (a shape the fake mode
            # cannot know); every noisy row is a target here, so the selection is the first L rows.
            hidden = out.hidden_states[0, :seq_len]
            weighted, _, _, _ = objective._target_cross_entropy(model, hidden, noisy[0], torch.ones(seq_len))
            (weighted / seq_len).backward()
            del out, hidden, weighted, model
    except Exception as err:  # noqa: BLE001
        record.error = _error(err)
    record.fake_seconds = time.perf_counter() - start
    _fill(record, recorder)
    return record


# --- the study -----------------------------------------------------------------------------------------------------


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _fmt_k(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _op(name: str) -> str:
    return name.replace("aten.", "").replace(".default", "").replace("|", "/")


_DTYPES = {"bfloat16": "bf16", "float32": "f32", "float64": "f64", "int64": "i64", "int32": "i32", "bool": "bool"}


def _largest(r: dict) -> str:
    a = r["largest"]
    shape = "x".join(str(n) for n in a["shape"])
    dtype = _DTYPES.get(a["dtype"], a["dtype"])
    return f"{a['elements']:.3g} ({_fmt_bytes(a['bytes'])}): {shape} {dtype}, {_op(a['op'])}"


def _growth(r: dict) -> str:
    if r["growth"] is None:
        return "-"
    return f"{r['growth']:.2f}" + ("*" if r["growth_basis"] == "per operator" else "")


def _who(r: dict) -> str:
    return r["layout"] + (f" (rank {r['rank']}/{r['group_size']})" if r["rank"] is not None else "")


LEGEND = (
    "Gemma-3-27B layer shape (32 query heads, 16 K/V heads, head dim 128, bf16, block 32, window 1024 on sliding "
    "layers), batch 1: forward + backward of one layer's attention (q, k, v leaves; the output's gradient all ones). "
    "Sharded layouts: one rank of P = 8, the one with the most query x key rows. *largest*: the largest single "
    "allocation (elements (bytes): shape dtype, the operator, stand-in or collective that made it; `(backward: X)`: "
    "run by autograd node X); */ bound*: its elements over (2L)^2/64; *growth*: the exponent with which the step's "
    "allocations grow with L over the lengths measured (1 linear, 2 quadratic; 0 constant): the largest "
    "per-allocation exponent where the runs make the same allocations in the same order, else with the allocations "
    "paired per operator (marked *: the model step, whose loss runs one chunk per 8192 targets); *peak*: most "
    "bytes alive at once in the step (q, k, v and their gradients included); *mask idx*: the flex block masks' index "
    "arrays (int32 [1, 1, q tiles, kv tiles] and their transposes, built on the host, moved to the GPU under CUDA; not "
    "in *peak*); *pass*: the largest tensor and the largest index array are both under (2L)^2/64 elements. The "
    "FlexAttention kernel is a shape-only stand-in (its outputs and gradients, not its on-chip workspace).")

NOTE = (
    "At this width a row of q holds 32 x 128 = 4096 elements, which is 2L/64 at L = 128K: a one-device step's q, its "
    "gradient and its output are exactly (2L)^2/64 elements there (linear in L: growth 1.00), and the whole model's "
    "MLP activations (2L x 21504) and loss chunk (8192 x 262208) are above the bound at every length without growing "
    "faster than L. The bound tells an L x L tensor from a row tensor only where a row is well under 2L/64 elements "
    "wide (tests/attention/test_no_quadratic_tensor.py: 4 heads of 16); *growth* tells them apart at any width.")


def _short(r: dict) -> str:
    """The largest allocation in a few words: elements, shape and dtype, what made it."""
    if r["error"]:
        return f"not run: {_op(r['error'])}"
    a = r["largest"]
    dtype = _DTYPES.get(a["dtype"], a["dtype"])
    return f"{a['elements']:.3g}: {'x'.join(map(str, a['shape']))} {dtype}, {_op(a['op'])}"


def docs_table(records: list[dict]) -> str:
    """One row per (study, layout, backend, L), the full and the sliding layer side by side (the docs' table)."""
    rows: dict[tuple, dict] = {}
    for r in records:
        rows.setdefault((r["study"], _who(r), r["backend"], r["seq_len"]), {})[r["kind"]] = r
    lines = ["| layout | backend | L | largest tensor (elements: shape, made by) | / bound | growth | peak | mask idx "
             "| pass |", "|---|---|---|---|---|---|---|---|---|"]

    def both(kinds, fn):
        values = [fn(r) for r in kinds.values()]
        return values[0] if len(set(values)) == 1 else " / ".join(values)

    for (study, who, backend, seq_len), kinds in rows.items():
        what = who if study == "attention" else who + ", whole 2-layer model step"
        if all(r["error"] for r in kinds.values()):
            lines.append(f"| {what} | {backend} | {_fmt_k(seq_len)} | {both(kinds, _short)} | | | | | - |")
            continue
        ratio = both(kinds, lambda r: "-" if r["error"] else
                     f"{r['largest']['elements'] / r['threshold_elements']:.3g}")
        mask = both(kinds, lambda r: _fmt_bytes(r["mask_index_bytes"]) if r["mask_index_bytes"] else "-")
        verdict = both(kinds, lambda r: "yes" if r["passed"] else "**no**")
        lines.append(f"| {what} | {backend} | {_fmt_k(seq_len)} | {both(kinds, _short)} | {ratio} | "
                     f"{both(kinds, _growth)} | {both(kinds, lambda r: _fmt_bytes(r['peak_bytes']))} | {mask} | "
                     f"{verdict} |")
    return "\n".join(lines)


def summary_markdown(records: list[dict], command: str, skipped: list[str]) -> str:
    bounds = sorted({(r["seq_len"], r["threshold_elements"]) for r in records})
    lines = [
        "# No L x L tensor: every allocation of a training step's attention under FakeTensorMode",
        "",
        f"Command: `{command}`",
        "",
        LEGEND,
        "",
        "Bound (2L)^2/64: " + ", ".join(f"{_fmt_k(L)}: {b:.3g} elements" for L, b in bounds) + ".",
        "",
        "Where the full and the sliding layer differ, a cell shows `full / sliding`.",
        "",
        docs_table(records),
        "",
        NOTE,
    ]
    if skipped:
        lines += ["", "Not run: " + "; ".join(skipped) + "."]
    lines += ["", "## Largest allocations of every step", "",
              "Per measured step (full and sliding layers apart): the five largest distinct (op, shape) allocations, "
              "and how often the FlexAttention stand-in ran forward / backward (one call per key source).", "",
              "| study | layout | backend | L | layer | five largest distinct allocations | flex calls (fwd/bwd) |",
              "|---|---|---|---|---|---|---|"]
    for r in records:
        top = "; ".join(f"{_op(a['op'])} {'x'.join(map(str, a['shape']))} {_DTYPES.get(a['dtype'], a['dtype'])}"
                        for a in r["top"][:5])
        lines.append(f"| {r['study']} | {_who(r)} | {r['backend']} | {_fmt_k(r['seq_len'])} | {r['kind']} | {top} | "
                     f"{r['flex_calls']}/{r['flex_backward_calls']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hf_bdlm.benchmarks.fake_memory", description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[131072, 262144, 524288])
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--blockwise-lengths", type=int, nargs="*", default=[65536, 131072],
                   help="lengths at which blockwise runs instead of --lengths: its host plans and its kernel calls "
                        "under the fake mode take 20-30 s per layer at 128K, minutes beyond")
    p.add_argument("--blockwise-layouts", nargs="*", default=[x for x in LAYOUTS if x != "cp-paper"],
                   choices=LAYOUTS)
    p.add_argument("--model-lengths", type=int, nargs="*", default=[65536, 131072],
                   help="lengths of the whole 2-layer model step (flex, one device); two give its growth")
    p.add_argument("--out", type=pathlib.Path, required=True)
    p.add_argument("--report-only", action="store_true",
                   help="rewrite summary.md from the folder's fake_memory.json, measuring nothing")
    args = p.parse_args(argv)
    if args.report_only:
        saved = json.loads((args.out / "fake_memory.json").read_text())
        (args.out / "summary.md").write_text(summary_markdown(saved["records"], saved["meta"]["command"],
                                                              saved["meta"].get("not_run", [])))
        print(f"wrote {args.out / 'summary.md'}")
        return 0
    # The host work is many small operations: intra-op threads only slow them (10x on 2 loaded cores).
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m hf_bdlm.benchmarks.fake_memory " + " ".join(argv if argv is not None else sys.argv[1:])
    begin = time.perf_counter()
    runs = []
    for layout in args.layouts:
        for backend in args.backends:
            if backend == "blockwise":
                lengths = args.blockwise_lengths if layout in args.blockwise_layouts else []
            else:
                lengths = args.lengths
            runs += [(layout, backend, seq_len, kind) for seq_len in lengths for kind in args.kinds]
    skipped = []
    if "blockwise" in args.backends:
        longer = [n for n in args.lengths if n not in args.blockwise_lengths]
        if longer:
            skipped.append(f"blockwise at {', '.join(map(_fmt_k, longer))} (its host plans and its one-by-one kernel "
                           "calls under the fake mode take 20-30 s per layer at 128K here, and grow with L; it is the "
                           "CPU path)")
        left_out = [x for x in args.layouts if x not in args.blockwise_layouts]
        if left_out:
            skipped.append(f"blockwise for {', '.join(left_out)} (the paper CP's rank holds a slice of every block: "
                           "tens of thousands of kernel calls per layer, 100 s at 16K under the fake mode)")
    records = []
    for layout, backend, seq_len, kind in runs:
        r = measure_attention(layout, backend, seq_len, kind, group_size=args.group_size)
        records.append(r)
        print(f"{layout:12s} {backend:9s} L={seq_len:7d} {kind:7s} largest={(r.largest or {}).get('elements', 0):.3g} "
              f"bound={r.threshold_elements:.3g} peak={_fmt_bytes(r.peak_bytes)} mask={_fmt_bytes(r.mask_index_bytes)} "
              f"pass={r.passed} host {r.host_seconds:.1f}s fake {r.fake_seconds:.1f}s {r.error or ''}",
              flush=True)
    for seq_len in args.model_lengths:
        r = measure_model_step(seq_len)
        records.append(r)
        print(f"model step L={seq_len} largest={(r.largest or {}).get('elements', 0):.3g} peak="
              f"{_fmt_bytes(r.peak_bytes)} pass={r.passed} host {r.host_seconds:.1f}s fake {r.fake_seconds:.1f}s "
              f"{r.error or ''}", flush=True)
    add_growth(records)
    rows = [asdict(r) for r in records]
    meta = {"command": command, "seconds": round(time.perf_counter() - begin, 1), "torch": torch.__version__,
            "python": platform.python_version(), "machine": platform.machine(),
            "layer_shape": {k: (str(v) if isinstance(v, torch.dtype) else v)
                            for k, v in asdict(LayerShape.gemma3_27b()).items()},
            "group_size": args.group_size, "bound": "(2L)^2/64 elements", "not_run": skipped}
    (args.out / "fake_memory.json").write_text(json.dumps({"meta": meta, "records": rows}, indent=1) + "\n")
    (args.out / "summary.md").write_text(summary_markdown(rows, command, skipped))
    print(f"wrote {args.out / 'fake_memory.json'} and {args.out / 'summary.md'} in {meta['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
