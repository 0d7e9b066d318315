"""Training objectives: corrupt a batch, then score the model's hidden states on it.

One module per objective (``standard`` = BD3-LM, ``fast_dllm_v2`` = AR -> BDLM conversion as in Fast-dLLM v2,
with its variant ``fast_dllm_v2_causal_clean``; ``diffusion_gemma`` = DiffusionGemma SFT on transformers' model), a
shared contract in ``base`` and layout-invariant noise in
``noise``. Build one by name::

    from hf_bdlm.objectives import get_objective
    objective = get_objective("standard", model.config)          # or a dict of constructor kwargs
    corrupted = objective.corrupt(batch, seed=0, step=step)
    loss, metrics = objective.loss(model, corrupted)
"""

from __future__ import annotations

from typing import Any, Mapping

from .base import CorruptedBatch, Objective, supervised_mask, target_rows_in
from .diffusion_gemma import DiffusionGemmaBatch, DiffusionGemmaObjective
from .fast_dllm_v2 import FastDLLMv2CausalCleanObjective, FastDLLMv2Objective
from .noise import hash_uniform, independent_block_t, stratified_block_t
from .standard import StandardObjective

OBJECTIVE_CLASSES: dict[str, type[Objective]] = {
    StandardObjective.name: StandardObjective,
    FastDLLMv2Objective.name: FastDLLMv2Objective,
    FastDLLMv2CausalCleanObjective.name: FastDLLMv2CausalCleanObjective,
    DiffusionGemmaObjective.name: DiffusionGemmaObjective,
}
PLANNED_OBJECTIVES = ("dflash",)


def get_objective(name: str, config_or_kwargs: Any) -> Objective:
    """Build the objective called ``name``.

    Args:
        name (`str`): `"standard"`, `"fast_dllm_v2"`, `"fast_dllm_v2_causal_clean"` or `"diffusion_gemma"` (`"dflash"`
            is planned).
        config_or_kwargs: a `BlockDiffusionConfig` (block size, mask token, noise range and weighting are
            read from it) or a mapping of constructor arguments (`block_size`, `mask_token_id`, ...).
    """
    valid = sorted(OBJECTIVE_CLASSES) + list(PLANNED_OBJECTIVES)
    if name in PLANNED_OBJECTIVES:
        raise NotImplementedError(
            f"objective {name!r} is planned but not implemented yet; available now: {sorted(OBJECTIVE_CLASSES)}."
        )
    if name not in OBJECTIVE_CLASSES:
        raise ValueError(f"unknown objective {name!r}; valid names: {valid}.")
    cls = OBJECTIVE_CLASSES[name]
    if isinstance(config_or_kwargs, Mapping):
        kwargs = dict(config_or_kwargs)
    else:
        kwargs = cls.config_kwargs(config_or_kwargs)
    required = getattr(cls, "required_kwargs", ("block_size", "mask_token_id"))
    missing = [k for k in required if kwargs.get(k) is None]
    if missing:
        given = sorted(k for k, v in kwargs.items() if v is not None)
        raise ValueError(f"objective {name!r} needs {missing}; got {given}.")
    return cls(**kwargs)


__all__ = [
    "CorruptedBatch",
    "DiffusionGemmaBatch",
    "DiffusionGemmaObjective",
    "FastDLLMv2CausalCleanObjective",
    "FastDLLMv2Objective",
    "OBJECTIVE_CLASSES",
    "Objective",
    "StandardObjective",
    "get_objective",
    "hash_uniform",
    "independent_block_t",
    "stratified_block_t",
    "supervised_mask",
    "target_rows_in",
]
