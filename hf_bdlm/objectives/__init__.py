"""Training objectives: corrupt a batch, then score the model's hidden states on it.

What every objective shares: the contract (``base``, which each model family's objectives subclass in its folder
under ``hf_bdlm/models/``: the block-diffusion family's ``standard`` and ``fast_dllm_v2`` in
``models/block_diffusion/training/objectives/``), layout-invariant noise (``noise``) and the seeded draws of likelihood bounds
(``likelihood``). Build any family's objective by name (the registry finds its family)::

    from hf_bdlm.objectives import get_objective
    objective = get_objective("standard", model.config)          # or a dict of constructor kwargs
    corrupted = objective.corrupt(batch, seed=0, step=step)
    loss, metrics = objective.loss(model, corrupted)
"""

from __future__ import annotations

from ..protocols.registry import get_objective  # builds any family's objective by name
from .base import CorruptedBatch, Objective, supervised_mask, target_rows_in
from .noise import hash_uniform, independent_block_t, stratified_block_t

__all__ = [
    "CorruptedBatch",
    "Objective",
    "get_objective",
    "hash_uniform",
    "independent_block_t",
    "stratified_block_t",
    "supervised_mask",
    "target_rows_in",
]
