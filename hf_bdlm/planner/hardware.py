"""Devices and links the planner prices a step on: datasheet figures times named achievable fractions.

A :class:`DeviceSpec` holds what a step's cost depends on: achievable matmul and attention FLOP/s,
HBM bytes and bandwidth, and the per-GPU bandwidth of the intra-node (NVLink) and inter-node
(InfiniBand) links. The named GPUs of :data:`GPUS` carry datasheet peaks; the achievable rates are
those peaks times the fractions of :data:`DEFAULT_EFFICIENCY`, which are assumptions (typical
figures for large bf16 training), not fits to any result. Measured figures replace them: a JSON
file (``--gpu-spec``) with any of the :class:`DeviceSpec` fields, or single flags.

    python -c "from hf_bdlm.planner.hardware import device_spec; print(device_spec('h200'))"
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace

GB = 1e9

# Achievable fractions of the datasheet peaks (assumptions, documented in docs/design.md §6):
# - matmul: ~55 % of dense bf16 peak is what large-model training reaches on Hopper (MFU of well-tuned
#   Megatron / torchtitan runs is 40-55 % including everything else; a large GEMM alone gets more).
# - attention: FlashAttention-3's published H100 bf16 forward reaches 60-75 % of peak, its backward less;
#   block-sparse masks cut tiles, so ~40 % of peak over forward and backward.
# - links: NCCL all-gather bus bandwidth reaches ~80 % of the NVLink / InfiniBand line rate on large messages.
# - memory: ~90 % of HBM is usable by tensors (CUDA context, allocator fragmentation, NCCL buffers).
DEFAULT_EFFICIENCY = dict(matmul=0.55, attention=0.40, link=0.80, memory=0.90)
# Fixed cost of one NCCL message hop (a ring rotation, one step of a collective), an assumption of the same kind:
# small-message NCCL latencies are tens of microseconds; it only matters for short shards.
LINK_LATENCY_S = 20e-6


@dataclass(frozen=True)
class DeviceSpec:
    """A device and its links, in achievable units (bytes, FLOP/s, bytes/s).

    Parameters:
        name (`str`): for tables.
        matmul_flops (`float`): achievable matmul FLOP/s (dense, the training dtype).
        attention_flops (`float`): achievable FLOP/s of the attention kernel (forward and backward).
        memory_bytes (`float`): device memory usable by tensors.
        hbm_bytes_per_s (`float`): memory bandwidth (prices elementwise work: norms, activations, rotary).
        intra_node_bytes_per_s (`float`): per-device bandwidth of a collective inside a node (NVLink).
        inter_node_bytes_per_s (`float`): per-device bandwidth of a collective spanning nodes (its NIC).
        peak_bf16_flops (`float`): the datasheet peak the achievable rates derive from (0 when measured).
        source (`str`): where the figures come from.
        link_latency_s (`float`): fixed time a message takes besides its bytes (a collective, a ring rotation).
        shared_cores (`int`, 0): processors the ranks of a node share; 0 when every rank has its own device (GPUs).
            On a CPU with more single-threaded ranks than cores the rates above are those of a rank alone on a
            core, and the cores are shared among the ranks computing at the moment (``schedule.simulate``).
        oversubscribed_efficiency (`float`, 1.0): with more computing ranks than ``shared_cores``, the fraction
            of the cores' throughput they still get together (measured: contention for caches and memory).
        sync_cost_s (`float`, 0.0): what each synchronization point (a wait on peers) costs a rank beyond the
            messages themselves; on a CPU whose cores the ranks share, measured (the scheduler's time slices).
        kernel_call_fwd_s (`float`, 0.0) / kernel_call_bwd_s (`float`, 0.0): fixed time of one planned attention
            kernel call beyond its pairs, forward / backward (row selection, the kernel's setup, the LSE merge; the
            gradient scatter). Measured on a CPU, where the host runs it; 0 for GPUs, whose launches are asynchronous.
            Priced only where the work counts the kernel's calls (``RankWork.kernel_calls``).
    """

    name: str
    matmul_flops: float
    attention_flops: float
    memory_bytes: float
    hbm_bytes_per_s: float
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    peak_bf16_flops: float = 0.0
    source: str = ""
    link_latency_s: float = 0.0
    shared_cores: int = 0
    oversubscribed_efficiency: float = 1.0
    sync_cost_s: float = 0.0
    kernel_call_fwd_s: float = 0.0
    kernel_call_bwd_s: float = 0.0

    def link_bytes_per_s(self, spans_nodes: bool) -> float:
        return self.inter_node_bytes_per_s if spans_nodes else self.intra_node_bytes_per_s


@dataclass(frozen=True)
class Datasheet:
    """Datasheet figures of one GPU (SXM form factor): dense bf16 TFLOP/s, HBM GB, HBM TB/s, NVLink GB/s
    (bidirectional, as datasheets state it), inter-node Gb/s per GPU (one NIC per GPU in the DGX / HGX systems)."""

    bf16_tflops: float
    hbm_gb: float
    hbm_tb_s: float
    nvlink_gb_s: float
    nic_gbit_s: float
    source: str


GPUS = {
    # "NVIDIA A100 Tensor Core GPU Datasheet" (A100 80GB SXM): BF16 312 TFLOPS dense, 80 GB HBM2e, 2,039 GB/s,
    # NVLink 600 GB/s; "NVIDIA DGX A100 Datasheet": 8x 200 Gb/s HDR InfiniBand (ConnectX-6) for 8 GPUs.
    "a100": Datasheet(312, 80, 2.039, 600, 200, "NVIDIA A100 Tensor Core GPU Datasheet; DGX A100 Datasheet"),
    # "NVIDIA H100 Tensor Core GPU Datasheet" (H100 SXM): BF16 1,979 TFLOPS with sparsity = 989 dense, 80 GB HBM3,
    # 3.35 TB/s, NVLink 900 GB/s; "NVIDIA DGX H100 Datasheet": 8x 400 Gb/s ConnectX-7 InfiniBand for 8 GPUs.
    "h100": Datasheet(989, 80, 3.35, 900, 400, "NVIDIA H100 Tensor Core GPU Datasheet; DGX H100 Datasheet"),
    # "NVIDIA H200 Tensor Core GPU Datasheet" (H200 SXM): BF16 1,979 TFLOPS with sparsity = 989 dense, 141 GB HBM3e,
    # 4.8 TB/s, NVLink 900 GB/s; DGX H200: 8x 400 Gb/s ConnectX-7 InfiniBand for 8 GPUs.
    "h200": Datasheet(989, 141, 4.8, 900, 400, "NVIDIA H200 Tensor Core GPU Datasheet; DGX H200 Datasheet"),
    # "NVIDIA DGX B200 Datasheet" / HGX B200 specifications: FP16/BF16 4.5 PFLOPS with sparsity = 2,250 dense per
    # GPU (36 PFLOPS dense per 8 GPUs), 180 GB HBM3e (1,440 GB per 8), 8 TB/s per GPU (64 TB/s per 8), NVLink 5
    # 1,800 GB/s; 8x 400 Gb/s ConnectX-7 for 8 GPUs.
    "b200": Datasheet(2250, 180, 8.0, 1800, 400, "NVIDIA DGX B200 Datasheet; HGX B200 specifications"),
}


def from_datasheet(name: str, sheet: Datasheet, efficiency: dict | None = None) -> DeviceSpec:
    eff = dict(DEFAULT_EFFICIENCY, **(efficiency or {}))
    peak = sheet.bf16_tflops * 1e12
    return DeviceSpec(
        name=name, matmul_flops=peak * eff["matmul"], attention_flops=peak * eff["attention"],
        memory_bytes=sheet.hbm_gb * GB * eff["memory"], hbm_bytes_per_s=sheet.hbm_tb_s * 1e12,
        # A collective's per-device bandwidth is one direction of the link: half the bidirectional NVLink figure.
        intra_node_bytes_per_s=sheet.nvlink_gb_s / 2 * GB * eff["link"],
        inter_node_bytes_per_s=sheet.nic_gbit_s / 8 * GB * eff["link"],
        peak_bf16_flops=peak, link_latency_s=LINK_LATENCY_S,
        source=f"{sheet.source}; efficiency {eff}; link latency {LINK_LATENCY_S * 1e6:.0f} us")


def device_spec(name: str, spec_file: str | None = None, efficiency: dict | None = None,
                **overrides) -> DeviceSpec:
    """The named GPU (:data:`GPUS`) at the achievable fractions ``efficiency`` (defaults:
    :data:`DEFAULT_EFFICIENCY`), with fields replaced by ``spec_file`` (JSON object of :class:`DeviceSpec`
    fields, e.g. measured rates) and then by ``overrides`` (``None`` values ignored)."""
    key = name.lower()
    if key not in GPUS:
        raise ValueError(f"unknown gpu {name!r}; known: {', '.join(GPUS)}. Give measured figures with --gpu-spec "
                         "FILE.json (fields of DeviceSpec) to plan for another device.")
    unknown = set(efficiency or {}) - set(DEFAULT_EFFICIENCY)
    if unknown:
        raise ValueError(f"unknown efficiency factor(s) {sorted(unknown)}; known: {sorted(DEFAULT_EFFICIENCY)}.")
    spec = from_datasheet(key, GPUS[key], efficiency)
    names = {f.name for f in fields(DeviceSpec)}
    if spec_file:
        with open(spec_file) as f:
            measured = json.load(f)
        bad = sorted(set(measured) - names) if isinstance(measured, dict) else "(not an object)"
        if bad:
            raise ValueError(f"--gpu-spec {spec_file}: unknown field(s) {bad}; give a JSON object of "
                             f"{sorted(names)}.")
        spec = replace(spec, **{"source": f"measured ({spec_file})", **measured})
    given = {k: v for k, v in overrides.items() if v is not None}
    for k, v in given.items():
        if k not in names or k in ("name", "source"):
            raise ValueError(f"unknown device field {k!r}; known: {sorted(names)}.")
        if not v > 0:
            raise ValueError(f"{k} must be positive, got {v!r}.")
    return replace(spec, **given) if given else spec
