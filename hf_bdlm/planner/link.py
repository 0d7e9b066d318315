"""Named cluster links, emulated on this machine at the named cluster's communication : compute ratio.

A GPU of achievable matmul rate ``F_gpu`` (in the cluster's training dtype) computes a step in ``T_c``; its link
(bandwidth ``bw``, latency ``lat``, from :mod:`.hardware`: datasheet line rate times the achievable fraction) moves
the step's ``N`` elements of ``e`` bytes (the cluster's dtype: 2 for bf16) in ``lat + N·e / bw``. A rank of the run
here computes the same step ``s = F_gpu / F_cpu`` times slower, where ``F_cpu`` is the rate a rank of *this run*
gets, in the dtype it computes in and under its own processes per core (:func:`.rank_rate.measure_rank_rate`: at
P = 4 on 2 cores each rank gets half a core, so ``F_cpu`` halves and the link stretches twice as much). Stretching
the link by the same factor keeps every transfer's share of the step::

    s · (lat + N·e / bw) = (s · lat) + N·e / (bw / s)     ->  emulated latency s · lat, emulated bandwidth bw / s

and the link charges each transfer its elements at ``e`` bytes, however wide they are here (a CPU run moves float32:
:meth:`~hf_bdlm.parallel.emulated_link.LinkModel.wire_bytes`). So a measured step under the emulated link shows the
overlap and the exposed waits the cluster would have. Named links (:data:`LINKS`): ``h100-nvlink`` / ``h200-nvlink`` (a group
inside one node) and ``h100-ib`` / ``h200-ib`` (a group spanning nodes: each GPU's share of its node's InfiniBand),
both GPUs' datasheets giving the same NVLink and NIC figures (:data:`hf_bdlm.planner.hardware.GPUS`); each trains in
bf16.

    python -c "from hf_bdlm.planner.link import emulated_link; print(emulated_link('h200-ib', 2e10).describe())"
"""

from __future__ import annotations

from dataclasses import dataclass

from ..parallel.emulated_link import LinkModel
from .hardware import DeviceSpec, device_spec
from .model import ModelSpec
from .rank_rate import DEFAULT_WINDOW_S, RankRate, measure_rank_rate

ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class ClusterLink:
    """A named cluster link.

    Parameters:
        gpu (`str`): the GPU of the hardware table (:data:`hf_bdlm.planner.hardware.GPUS`).
        spans_nodes (`bool`): the group spans nodes (InfiniBand) or sits inside one (NVLink).
        dtype (`str`, defaults to `"bfloat16"`): the cluster's training dtype: what each K/V element costs on the
            link, and the dtype of the GPU's matmul rate (the hardware table's rates are bf16 rates).
    """

    gpu: str
    spans_nodes: bool
    dtype: str = "bfloat16"

    def __post_init__(self):
        if self.dtype != "bfloat16":
            raise ValueError(f"a named link's dtype is the dtype its GPU rate is given in: the hardware table's rates "
                             f"are bf16 rates, got dtype={self.dtype!r}.")

    @property
    def element_bytes(self) -> int:
        return ELEMENT_BYTES[self.dtype]


LINKS = {"h100-nvlink": ClusterLink("h100", False), "h100-ib": ClusterLink("h100", True),
         "h200-nvlink": ClusterLink("h200", False), "h200-ib": ClusterLink("h200", True)}


def emulated_link(name: str, cpu_rate: float | RankRate, gpu: DeviceSpec | None = None) -> LinkModel:
    """The named link (:data:`LINKS`) stretched by ``F_gpu / F_cpu`` (see the module docstring). ``cpu_rate``: the
    measured :class:`~.rank_rate.RankRate` of the run (written into the link's record), or a rate in FLOP/s."""
    if name not in LINKS:
        raise ValueError(f"unknown link {name!r}; the named links are {', '.join(LINKS)}.")
    flops = cpu_rate.flops_per_s if isinstance(cpu_rate, RankRate) else cpu_rate
    if not flops > 0:
        raise ValueError(f"the CPU's matmul rate must be positive FLOP/s, got {flops!r}.")
    link = LINKS[name]
    device = gpu or device_spec(link.gpu)
    scale = device.matmul_flops / flops
    bandwidth = device.link_bytes_per_s(link.spans_nodes)
    rate = cpu_rate.as_record() if isinstance(cpu_rate, RankRate) else dict(flops_per_s=flops, method="given")
    details = dict(gpu=device.name, spans_nodes=link.spans_nodes, cluster_dtype=link.dtype,
                   gpu_matmul_flops=device.matmul_flops, cluster_bytes_per_s=bandwidth,
                   cluster_latency_s=device.link_latency_s, scale=scale, compute_rate=rate)
    return LinkModel(bandwidth / scale, device.link_latency_s * scale, name, link.element_bytes, details)


def link_for_this_machine(name: str, model: ModelSpec, dtype: str = "float32",
                          window_s: float = DEFAULT_WINDOW_S) -> LinkModel:
    """:func:`emulated_link` at the rate the ranks of this launch get now, all computing ``model``'s matmuls at once
    in ``dtype`` (:func:`.rank_rate.measure_rank_rate`: a collective call when a process group is up). Nothing is
    cached."""
    if name not in LINKS:
        raise ValueError(f"unknown link {name!r}; the named links are {', '.join(LINKS)}.")
    return emulated_link(name, measure_rank_rate(model, dtype, window_s))


__all__ = ["ClusterLink", "ELEMENT_BYTES", "LINKS", "emulated_link", "link_for_this_machine"]
