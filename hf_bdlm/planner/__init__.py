"""Layout planner: predicts per-rank peak memory and step time of every parallel layout, recommends one.

- :mod:`.model`: a backbone's sizes from a transformers config (dense and MoE), and the paper's presets.
- :mod:`.hardware`: named GPUs (datasheet figures) times named achievable fractions, or measured figures.
- :mod:`.workload`: what a workload gives per rank (step segments, compute by part, memory by part, bytes by name)
  and the one pricing of it on a device, a cluster and a recipe (:func:`~.workload.price_step`), the prediction
  record, the pick (:func:`~.workload.recommend`). A backbone's step (:mod:`.cost`) and a family's own (a speculative
  drafter's, in its family's folder) are workloads; the planner imports no family.
- :mod:`.cost`: attention pairs, K/V bytes, memory and step time per rank of a backbone, read from the project's plan.
- :mod:`.kernel_work`: the pairs and calls the ``blockwise`` kernel's tile plans compute on each rank.
- :mod:`.rank_rate`, :mod:`.link`: the matmul rate a run's ranks get, measured in them at once, and the named cluster
  links stretched by it (bytes charged at the cluster's element size) that benchmarks and the trainer emulate.
- :mod:`.plan_command`: ``hf-bdlm plan``.

CPU rates measured on this machine and the predictions of benchmark records (``--validate``) are the benchmarks'
(:mod:`hf_bdlm.benchmarks.calibrate`), which import the planner; the planner imports no benchmark.

    hf-bdlm plan --model gemma3-27b --context 262144 --gpus 16 --gpus-per-node 8 --gpu h200
"""

import importlib

# Names and the module defining each, imported on first use (the `hf-bdlm plan` parser loads no torch).
_EXPORTS = {"BackboneStep": "cost", "Prediction": "cost", "plan_all": "cost", "predict": "cost",
            "DeviceSpec": "hardware", "device_spec": "hardware", "ModelSpec": "model", "model_spec": "model",
            "Cluster": "workload", "LayoutPrediction": "workload", "Recipe": "workload", "Workload": "workload",
            "price_step": "workload", "recommend": "workload"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
