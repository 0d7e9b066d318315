"""The DFlash family's objective, `dflash`, on the project's counter-based noise (:mod:`hf_bdlm.objectives.noise`):

- :mod:`.dflash`: the objective itself (:class:`DFlashObjective`): anchors, labels, position weights, the CE / KL /
  D-PACE losses, and the dealing of a batch's anchors to ranks;
- :mod:`.step`: the objective as the trainer runs it (:class:`DFlashTrainingObjective`): each sequence's anchors
  drawn from ``(seed, sequence, step)``, the batch it hands the step (:class:`DFlashTrainingBatch`, its features read
  or :class:`DeferredFeatures`), and a rank's share of the loss.
"""

from __future__ import annotations

from .dflash import (
    ANCHOR_SAMPLINGS,
    LK_LOSS_TYPES,
    LOSSES,
    CandidateSelector,
    DFlashBatch,
    DFlashObjective,
    DFlashObjectiveConfig,
    active_anchor_slots,
    anchor_costs,
    anchor_generator,
    deal_anchors,
    dpace_weights,
    gather_positions,
    position_weights,
    sample_locality_anchors,
    sample_uniform_anchors,
    select_anchors,
    valid_anchor_mask,
)
from .step import SALT_SAMPLE_SEED, DeferredFeatures, DFlashTrainingBatch, DFlashTrainingObjective, sample_seed

__all__ = [
    "ANCHOR_SAMPLINGS",
    "CandidateSelector",
    "DFlashBatch",
    "DFlashObjective",
    "DFlashObjectiveConfig",
    "DFlashTrainingBatch",
    "DFlashTrainingObjective",
    "DeferredFeatures",
    "LK_LOSS_TYPES",
    "LOSSES",
    "SALT_SAMPLE_SEED",
    "active_anchor_slots",
    "anchor_costs",
    "anchor_generator",
    "deal_anchors",
    "dpace_weights",
    "gather_positions",
    "position_weights",
    "sample_locality_anchors",
    "sample_uniform_anchors",
    "select_anchors",
    "sample_seed",
    "valid_anchor_mask",
]
