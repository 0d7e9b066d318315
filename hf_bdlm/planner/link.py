"""Named cluster links, emulated on this machine at the named cluster's communication : compute ratio.

A GPU of achievable matmul rate ``F_gpu`` computes a step in ``T_c``; its link (bandwidth ``bw``, latency ``lat``,
from :mod:`.hardware`: datasheet line rate times the achievable fraction) moves ``B`` bytes in ``lat + B / bw``.
This machine's rank computes the same step ``s = F_gpu / F_cpu`` times slower (``F_cpu``: its measured matmul rate,
:func:`hf_bdlm.planner.calibrate.cpu_device`). Stretching the link by the same factor keeps every transfer's
share of the step::

    s · (lat + B / bw) = (s · lat) + B / (bw / s)     ->  emulated latency s · lat, emulated bandwidth bw / s

so a measured step under the emulated link shows the overlap and the exposed waits the cluster would have.
Named links (:data:`LINKS`): ``h100-nvlink`` / ``h200-nvlink`` (a group inside one node) and ``h100-ib`` /
``h200-ib`` (a group spanning nodes: each GPU's share of its node's InfiniBand), both GPUs' datasheets giving the
same NVLink and NIC figures (:data:`hf_bdlm.planner.hardware.GPUS`).

    python -c "from hf_bdlm.planner.link import emulated_link; print(emulated_link('h200-ib', 2e10).describe())"
"""

from __future__ import annotations

from ..parallel.link import LinkModel
from .hardware import DeviceSpec, device_spec

# name -> (GPU of the hardware table, whether the group spans nodes)
LINKS = {"h100-nvlink": ("h100", False), "h100-ib": ("h100", True), "h200-nvlink": ("h200", False),
         "h200-ib": ("h200", True)}


def emulated_link(name: str, cpu_matmul_flops: float, gpu: DeviceSpec | None = None) -> LinkModel:
    """The named link (:data:`LINKS`) stretched by ``F_gpu / cpu_matmul_flops`` (see the module docstring)."""
    if name not in LINKS:
        raise ValueError(f"unknown link {name!r}; the named links are {', '.join(LINKS)}.")
    if not cpu_matmul_flops > 0:
        raise ValueError(f"cpu_matmul_flops must be positive, got {cpu_matmul_flops!r}.")
    gpu_name, spans_nodes = LINKS[name]
    device = gpu or device_spec(gpu_name)
    scale = device.matmul_flops / cpu_matmul_flops
    return LinkModel(device.link_bytes_per_s(spans_nodes) / scale, device.link_latency_s * scale, name)


def link_for_this_machine(name: str, layers: int = 2) -> LinkModel:
    """:func:`emulated_link` with this machine's measured matmul rate (one single-threaded rank, the benchmark
    model of ``layers`` layers; measured once and cached beside the planner's other CPU figures)."""
    from .calibrate import benchmark_model, cpu_device

    return emulated_link(name, cpu_device(benchmark_model(layers)).matmul_flops)


__all__ = ["LINKS", "emulated_link", "link_for_this_machine"]
