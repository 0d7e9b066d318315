"""The block-diffusion family's objectives: ``standard`` (BD3-LM) and ``fast_dllm_v2`` (AR -> BDLM conversion as in
Fast-dLLM v2, with its variant ``fast_dllm_v2_causal_clean``), on the contract of :mod:`hf_bdlm.objectives.base`."""

from __future__ import annotations

from .....objectives.base import Objective
from .fast_dllm_v2 import FastDLLMv2CausalCleanObjective, FastDLLMv2Objective
from .standard import StandardObjective

OBJECTIVE_CLASSES: dict[str, type[Objective]] = {
    StandardObjective.name: StandardObjective,
    FastDLLMv2Objective.name: FastDLLMv2Objective,
    FastDLLMv2CausalCleanObjective.name: FastDLLMv2CausalCleanObjective,
}

__all__ = ["FastDLLMv2CausalCleanObjective", "FastDLLMv2Objective", "OBJECTIVE_CLASSES", "StandardObjective"]
