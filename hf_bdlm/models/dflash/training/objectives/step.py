"""The `dflash` objective as the trainer runs it (:class:`DFlashTrainingObjective`), around the objective's anchors and
losses (:class:`~.dflash.DFlashObjective`):

- **anchors**: the draft blocks of sequence ``s`` at step ``t`` are drawn by the `DFlashObjective` seeded with
  :func:`sample_seed` ``(seed, s)``, whatever the layout, accumulation or resume;
- **batch**: :class:`DFlashTrainingBatch`, the anchors and the drafter's inputs; its features are read from the capture,
  or, under block parallelism, deferred (:class:`DeferredFeatures`) until the step's plan says which rows this rank
  projects;
- **loss**: this rank's share of the step's loss, drafted through the layout the trainer hands in (its ``draft``,
  ``global_sum`` and ``loss_scale``: :func:`~hf_bdlm.models.dflash.training.trainer.draft_layout`), so that the ranks'
  shares add up to the loss of the whole optimizer step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .....objectives.base import supervised_mask
from .....objectives.noise import hash_uniform
from .....protocols.step import unwrap_model
from ..capture import FeatureStore
from .dflash import (
    DFlashBatch,
    DFlashObjective,
    DFlashObjectiveConfig,
    active_anchor_slots,
    gather_positions,
    select_anchors,
)

# Salt of the per-sequence anchor seed in the project's counter-based hash.
SALT_SAMPLE_SEED = 0xD1A5_5EED


def sample_seed(seed: int, sample_id: int) -> int:
    """The anchor seed of sequence ``sample_id`` in a run seeded ``seed`` (a 62-bit integer, a pure function)."""
    zero = torch.zeros((), dtype=torch.int64)
    return int(hash_uniform(seed, sample_id, zero, zero, salt=SALT_SAMPLE_SEED).item() * 2.0**53) >> 1


# --- the batch -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeferredFeatures:
    """The features of a block-parallel micro-batch, not read yet: :meth:`rows` reads the rows a rank's plan has it
    project (``plan.projected_runs``), and only those, from the capture.

    Attributes:
        stores (`Sequence[FeatureStore]`): the captures. records (`torch.LongTensor` of shape `(b, 2)`): each row's
            store and record (``-1``: a placeholder row, no features).
    """

    stores: Sequence[FeatureStore]
    records: torch.Tensor

    def rows(self, runs: Sequence[tuple[int, int]]) -> torch.Tensor:
        """``[b, sum of stop - start, feature_width]``: the rows of ``runs`` (ascending sequence ranges) of every
        sequence, zero past a record's end."""
        store0 = self.stores[0]
        count = sum(stop - start for start, stop in runs)
        out = torch.zeros(self.records.shape[0], count, store0.feature_width,
                          dtype=getattr(torch, store0.manifest["dtype"]))
        for i, (index, record) in enumerate(self.records.tolist()):
            if index < 0:
                continue
            store = self.stores[index]
            n = store.lengths[record]
            inside, where, at = [], [], 0  # the runs cut to the record, and where each lands among the rows asked
            for start, stop in runs:
                if min(stop, n) > start:
                    inside.append((start, min(stop, n)))
                    where.append(torch.arange(at, at + min(stop, n) - start))
                at += stop - start
            if inside:
                out[i, torch.cat(where)] = store.feature_runs(record, inside)
        return out



@dataclass
class DFlashTrainingBatch:
    """One micro-batch ready for the step: its anchors and the inputs of the drafter.

    Attributes:
        anchors (`DFlashBatch`): the anchors of every sequence (the slots some sequence uses).
        input_ids (`torch.LongTensor` of shape `(b, L)`).
        features (`torch.Tensor` of shape `(b, L, feature_width)`, or [`DeferredFeatures`]): every row's features
            (``P = 1``), or those the layout reads once its plan is known (block parallelism).
        teacher (`torch.Tensor` of shape `(b, L, hidden)`, *optional*): `"kl"`: the target's pre-norm last states.
        samples (`int`): sequences of the micro-batch (an empty share's placeholder row not counted).
        normalizer (`float`): `"ce"` / `"kl"`: sequences of the whole optimizer step (set by the trainer).
        micro_batches (`int`): micro-batches of the optimizer step (`"dpace"` averages over them).
        selector_alpha (`float`, *optional*): the candidate selector loss's weight at this step.
    """

    anchors: DFlashBatch
    input_ids: torch.Tensor
    features: "torch.Tensor | DeferredFeatures"
    teacher: torch.Tensor | None
    samples: int
    normalizer: float
    micro_batches: int = 1
    selector_alpha: float | None = None


# --- the objective, as the trainer sees it ----------------------------------------------------------------------------
def _cat_batches(parts: list[DFlashBatch]) -> DFlashBatch:
    if len(parts) == 1:
        return parts[0]
    fields = {}
    for field in dataclasses.fields(DFlashBatch):
        values = [getattr(p, field.name) for p in parts]
        fields[field.name] = torch.cat(values) if isinstance(values[0], torch.Tensor) else values[0]
    return DFlashBatch(**fields)


class DFlashTrainingObjective:
    """The `dflash` objective for the trainer: draws each sequence's anchors (:meth:`corrupt`) and scores a rank's
    share of a batch (:meth:`loss`), around a :class:`~.dflash.DFlashObjective`.

    Args:
        config (`DFlashObjectiveConfig`): the objective's settings (its ``seed`` is the run's).
        token_accuracy (`bool`, defaults to `True`): count the drafter's correct first choices for the log.
        teacher_head (`Callable`, *optional*): `"kl"`: the target's pre-norm last states -> its logits.
    """

    name = "dflash"
    allows_zero_noise = False
    has_optional_pass = False
    required_kwargs = ("mask_token_id",)

    def __init__(self, config: DFlashObjectiveConfig, token_accuracy: bool = True,
                 teacher_head: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.objective = DFlashObjective(config)
        self.config = config
        self.block_size = config.block_size
        self.mask_token_id = config.mask_token_id
        self.token_accuracy = token_accuracy
        self.teacher_head = teacher_head
        self.feature_stores: Sequence[FeatureStore] | None = None  # DFlashTrainer's captures, for deferred features

    @classmethod
    def build(cls, config_or_kwargs) -> "DFlashTrainingObjective":
        """From `DFlashObjectiveConfig` keyword arguments, or a drafter's config (its block size and mask id)."""
        if isinstance(config_or_kwargs, Mapping):
            kwargs = dict(config_or_kwargs)
        else:
            kwargs = {"block_size": config_or_kwargs.block_size, "mask_token_id": config_or_kwargs.mask_token_id}
        if kwargs.get("mask_token_id") is None:
            given = sorted(k for k, v in kwargs.items() if v is not None)
            raise ValueError(f"objective 'dflash' needs mask_token_id; got {given}.")
        return cls(DFlashObjectiveConfig(**kwargs))

    @property
    def seed(self) -> int:
        """The run's anchor seed (a resumed run's is its checkpoint's)."""
        return self.objective.seed

    def __repr__(self) -> str:
        return f"DFlashTrainingObjective({self.config})"

    # --- what the trainer asks of every objective ------------------------------------------------------------------
    def card_settings(self) -> dict[str, Any]:
        c = self.config
        return {"dflash_loss": c.loss, "max_anchors": c.max_anchors, "anchor_sampling": c.anchor_sampling,
                "decay_gamma": c.decay_gamma, **({"dpace_alpha": c.dpace_alpha, "lk_loss_type": c.lk_loss_type}
                                                 if c.loss == "dpace" else {})}

    def needs_optional_pass(self, corrupted) -> bool:
        return False

    def set_step_normalizers(self, held: list, sum_over_replicas) -> None:
        """The step's micro-batch count (each holds its own D-PACE normalisation; the step averages them)."""
        for corrupted in held:
            corrupted.micro_batches = len(held)

    def state_dict(self) -> dict[str, Any]:
        return self.objective.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.objective.load_state_dict(state)

    # --- anchors ---------------------------------------------------------------------------------------------------
    def corrupt(self, batch: Mapping[str, torch.Tensor], *, seed: int, step: int,
                total_steps: int | None = None) -> DFlashTrainingBatch:
        """Draw the anchors of a collated batch (:class:`DFlashFeatureCollator`): sequence ``s`` with the objective
        seeded by :func:`sample_seed` ``(seed, s)`` at ``step``. ``total_steps``: the selector loss's schedule
        (training only; evaluation weighs it fully)."""
        if "features" not in batch and "feature_records" not in batch:
            raise ValueError("a DFlash batch carries the target's features (keys: "
                             f"{sorted(batch)}): train drafters with DFlashTrainer, whose collator reads them from the "
                             "capture (DFlashFeatureCollator).")
        if "features" not in batch and self.feature_stores is None:
            raise ValueError("the batch defers its features (feature_records) but the objective knows no feature "
                             "stores: train with DFlashTrainer, which sets objective.feature_stores.")
        input_ids = batch["input_ids"]
        supervised = supervised_mask(batch)
        sample_ids = batch.get("sample_ids")
        if sample_ids is None:
            sample_ids = torch.arange(input_ids.shape[0])
        parts, own_seed = [], self.objective.seed
        try:
            for row, sample in enumerate(sample_ids.tolist()):
                self.objective.seed = sample_seed(seed, sample)
                mask = supervised[row : row + 1] if sample >= 0 else torch.zeros_like(supervised[row : row + 1])
                parts.append(self.objective.prepare(input_ids[row : row + 1], mask, step=step))
        finally:
            self.objective.seed = own_seed
        full = _cat_batches(parts)
        slots = active_anchor_slots(full)
        if slots.numel() == 0:  # nothing to draft: one invalid slot keeps the step's graph (and collectives) whole
            slots = torch.zeros(1, dtype=torch.long, device=slots.device)
        samples = int((sample_ids >= 0).sum())
        alpha = self.objective.selector_alpha(step, total_steps) if total_steps else None
        return DFlashTrainingBatch(anchors=select_anchors(full, slots), input_ids=input_ids,
                                   features=batch["features"] if "features" in batch else
                                   DeferredFeatures(self.feature_stores, batch["feature_records"].cpu()),
                                   teacher=batch.get("teacher"), samples=samples, normalizer=float(max(samples, 1)),
                                   selector_alpha=alpha)

    # --- the loss --------------------------------------------------------------------------------------------------
    def loss(self, model, corrupted: DFlashTrainingBatch, layout) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This rank's share of the step's loss (the shares of all ranks add up to it), and its metric sums."""
        drafter = unwrap_model(model)
        config = self.config
        share, hidden = layout.draft(drafter, corrupted)
        teacher = None
        if config.loss == "kl":
            if self.teacher_head is None or corrupted.teacher is None:
                raise ValueError("dflash_loss='kl' needs the target's teacher states (capture with --teacher) and its "
                                 "final norm (train with DFlashTrainer and target / target_model).")
            teacher = gather_positions(corrupted.teacher, share.teacher_positions)
        selector = getattr(drafter, "candidate_selector", None) if config.loss == "dpace" else None
        value = self.objective.loss_from_hidden(
            hidden, drafter.lm_head.weight, share, output_multiplier=drafter.config.output_multiplier,
            logit_softcap=drafter.config.final_logit_softcapping, teacher_hidden_states=teacher,
            teacher_head=self.teacher_head if teacher is not None else None, selector=selector,
            selector_alpha=corrupted.selector_alpha, global_sum=layout.global_sum)
        if config.loss == "dpace":
            value = value / corrupted.micro_batches
        else:  # the micro-batch's mean over its rows, as a share of the mean over the step's sequences
            value = value * (corrupted.input_ids.shape[0] / corrupted.normalizer)
        value = value * layout.loss_scale
        metrics = {"loss_sum": value.detach()}
        metrics.update(self._correct(drafter, hidden, share, layout.loss_scale))
        return value, metrics

    @torch.no_grad()
    def _correct(self, drafter, hidden: torch.Tensor, share: DFlashBatch, scale: float) -> dict[str, torch.Tensor]:
        mask = share.supervised_mask.reshape(-1)
        count = mask.sum().double() * scale
        if not self.token_accuracy:
            return {"correct": count.new_zeros(()), "count": count.new_zeros(())}
        rows = mask.nonzero().flatten()
        states, labels = hidden.reshape(-1, hidden.shape[-1])[rows], share.target_token_ids.reshape(-1)[rows]
        correct = torch.zeros((), dtype=torch.float64, device=hidden.device)
        for start in range(0, rows.numel(), self.config.chunk_rows):
            part = slice(start, start + self.config.chunk_rows)
            correct += (drafter.compute_logits(states[part]).argmax(-1) == labels[part]).sum()
        return {"correct": correct * scale, "count": count}

    def zero_loss(self, model) -> torch.Tensor:
        """A zero reaching every trained parameter of the drafter."""
        trained = [p for p in unwrap_model(model).parameters() if p.requires_grad]
        return sum((p.reshape(-1)[:1].sum() * 0.0 for p in trained), trained[0].new_zeros(()))


__all__ = ["DFlashTrainingBatch", "DFlashTrainingObjective", "DeferredFeatures", "SALT_SAMPLE_SEED", "sample_seed"]
