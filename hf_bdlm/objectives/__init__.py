"""Training objectives: corrupt a batch, then score the model's hidden states on it.

One module per objective of converted causal LMs (``standard`` = BD3-LM, ``fast_dllm_v2`` = AR -> BDLM conversion as
in Fast-dLLM v2, with its variant ``fast_dllm_v2_causal_clean``), the contract every objective follows (``base``,
which a model family's own objectives subclass in its folder under ``hf_bdlm/models/``) and layout-invariant noise in
``noise``. Build one by name::

    from hf_bdlm.objectives import get_objective
    objective = get_objective("standard", model.config)          # or a dict of constructor kwargs
    corrupted = objective.corrupt(batch, seed=0, step=step)
    loss, metrics = objective.loss(model, corrupted)
"""

from __future__ import annotations

from typing import Any

from .base import CorruptedBatch, Objective, supervised_mask, target_rows_in
from ..models.block_diffusion.objectives.fast_dllm_v2 import FastDLLMv2CausalCleanObjective, FastDLLMv2Objective
from .noise import hash_uniform, independent_block_t, stratified_block_t
from ..models.block_diffusion.objectives.standard import StandardObjective

OBJECTIVE_CLASSES: dict[str, type[Objective]] = {
    StandardObjective.name: StandardObjective,
    FastDLLMv2Objective.name: FastDLLMv2Objective,
    FastDLLMv2CausalCleanObjective.name: FastDLLMv2CausalCleanObjective,
}


def get_objective(name: str, config_or_kwargs: Any) -> Objective:
    """Build the objective called ``name``, of whichever model family trains it (see ``hf_bdlm.models``).

    Args:
        name (`str`): `"standard"`, `"fast_dllm_v2"`, `"fast_dllm_v2_causal_clean"`, or an objective of another
            family (``hf_bdlm.models.all_objectives()``).
        config_or_kwargs: the model's config (a `BlockDiffusionConfig`: block size, mask token, noise range and
            weighting are read from it) or a mapping of constructor arguments (`block_size`, `mask_token_id`, ...).
    """
    from ..protocols.registry import get_objective as build

    return build(name, config_or_kwargs)


__all__ = [
    "CorruptedBatch",
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
