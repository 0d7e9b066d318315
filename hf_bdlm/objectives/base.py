"""What every objective shares: the corrupted-batch contract, batch checks and the target loss.

An objective turns a collated batch into a :class:`CorruptedBatch` (``corrupt``) and scores the
model's hidden states on it (``loss`` on one device, ``loss_from_hidden`` on any subset of rows).
Supervision is a flat list of targets, each naming the row whose hidden state predicts it
(sample, stream, global position), so a rank holding only some rows scores only its targets
while the normalizer, which counts the whole batch, keeps the per-rank losses summable.

    python -m pytest tests/objectives/test_objectives.py -q
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..attention.masks import CLEAN, NOISY
from ..protocols.diffusion_fields import check_diffusion_fields
from ..attention.interface import LocalLayout, TrainingLayout
from ..attention.rows import RowMeta, check_block_aligned_documents, document_positions
from .noise import independent_block_t, stratified_block_t, token_uniform



@dataclass
class CorruptedBatch:
    """A corrupted batch and its supervision targets.

    Args:
        noisy_ids (`torch.LongTensor` of shape `[b, L]`): the noisy sequence `x_t`.
        clean_ids (`torch.LongTensor` of shape `[b, L]`): the clean sequence `x`.
        position_ids (`torch.LongTensor` of shape `[b, L]`): RoPE positions, shared by both streams.
        document_ids (`torch.LongTensor` of shape `[b, L]`, *optional*): packed-document ids.
        target_sample (`torch.LongTensor` of shape `[n]`): batch row of each target.
        target_stream (`torch.LongTensor` of shape `[n]`): stream (`masks.NOISY` / `masks.CLEAN`) of the
            row whose hidden state predicts the target.
        target_row_pos (`torch.LongTensor` of shape `[n]`): global position of that predicting row.
        target_token (`torch.LongTensor` of shape `[n]`): the token to predict.
        target_weight (`torch.DoubleTensor` of shape `[n]`): weight of its cross-entropy.
        normalizer (`float`): supervised tokens of the whole batch; loss = `sum(w * CE) / normalizer`.
        masked (`torch.BoolTensor` of shape `[b, L]`): positions replaced by `[MASK]` in `x_t`.
        sample_ids (`torch.LongTensor` of shape `[b]`, *optional*): global sample id of each row.
        block_t (`torch.DoubleTensor` of shape `[b, L / block_size]`, *optional*): masking rate of each block.
    """

    noisy_ids: torch.Tensor
    clean_ids: torch.Tensor
    position_ids: torch.Tensor
    document_ids: torch.Tensor | None
    target_sample: torch.Tensor
    target_stream: torch.Tensor
    target_row_pos: torch.Tensor
    target_token: torch.Tensor
    target_weight: torch.Tensor
    normalizer: float
    masked: torch.Tensor
    sample_ids: torch.Tensor | None = None
    block_t: torch.Tensor | None = None

    @property
    def num_targets(self) -> int:
        return int(self.target_token.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.clean_ids.shape[1])


@dataclass
class CheckedBatch:
    """A validated collator batch, with the defaults filled in (internal to the objectives)."""

    input_ids: torch.Tensor
    supervised: torch.Tensor
    attention_mask: torch.Tensor
    sample_ids: torch.Tensor
    position_ids: torch.Tensor
    document_ids: torch.Tensor | None


def supervised_mask(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Positions that are supervised: ``completion_mask & attention_mask`` (pad is never supervised).

    A batch without ``completion_mask`` supervises every non-pad token (plain pre-training data).
    """
    input_ids = batch["input_ids"]
    supervised = torch.ones_like(input_ids, dtype=torch.bool)
    for key in ("completion_mask", "attention_mask"):
        value = batch.get(key)
        if value is not None:
            _check_shape(key, value, input_ids)
            supervised &= value.bool()
    return supervised


def _check_shape(name: str, value: torch.Tensor, input_ids: torch.Tensor) -> None:
    if tuple(value.shape) != tuple(input_ids.shape):
        raise ValueError(
            f"batch[{name!r}] has shape {tuple(value.shape)} but input_ids has shape {tuple(input_ids.shape)}; "
            "the collator must give every per-token field the shape [batch, L]."
        )


def target_rows_in(rows: RowMeta, corrupted: CorruptedBatch) -> torch.Tensor:
    """Index, among ``rows``, of the row predicting each target (``-1`` where ``rows`` lacks it).

    ``rows`` are the rows a forward ran over (e.g. :func:`~hf_bdlm.attention.rows.vectorized_rows`, or a
    rank's rows from the parallel plan); the result is the ``row_index`` of :meth:`Objective.loss_from_hidden`.
    """
    return rows.index_of(corrupted.target_stream, corrupted.target_row_pos, corrupted.seq_len)


class Objective:
    """Base class of the training objectives: ``corrupt`` a batch, then score hidden states on it.

    Parameters:
        block_size (`int`): tokens per diffusion block.
        mask_token_id (`int`): id of the absorbing `[MASK]` token (its logit is excluded from the softmax when
            the objective's reference does so, `exclude_mask_logit`).
        noise_eps_min (`float`, defaults to 1e-3), noise_eps_max (`float`, defaults to 1.0):
            range of the per-block masking rate `t`.
        loss_weighting (`str`, defaults to `"inverse_t"`): `"inverse_t"` (`w = 1/t`) or `"unit"` (`w = 1`).
        loss_chunk_size (`int`, defaults to 8192):
            targets scored per LM-head call; above it, chunks are recomputed in backward instead of keeping
            `[n, vocab]` logits alive (at long context `n * vocab` floats would not fit).
        certainty_weight (`float`, defaults to 0.0):
            weight `beta` of the certainty-forcing term (dParallel, Chen et al. 2025): the entropy of the model's
            distribution at each target it already predicts (argmax = target), added as
            `beta * sum(H) / normalizer`. It sharpens predictions that are right, meant to let more positions
            clear a confidence threshold in the same decoding step (measured: docs/evaluation.md). A training term: a forward without gradient
            (evaluation) scores the cross-entropy alone, so `eval_loss` compares with runs without it.
    """

    name: ClassVar[str] = ""
    # How the per-block masking rates are drawn: "stratified" (noise.stratified_block_t) or "independent".
    block_rate_sampling: ClassVar[str] = "stratified"
    # Whether the [MASK] logit is left out of the softmax of the loss (BD3-LM's SUBS parameterization).
    exclude_mask_logit: ClassVar[bool] = True
    # Whether the noise range may include 0 (uniform-state noise: t = 0 is a clean canvas, 0 / 0 no corruption).
    allows_zero_noise: ClassVar[bool] = False

    def __init__(
        self,
        *,
        block_size: int,
        mask_token_id: int,
        noise_eps_min: float = 1e-3,
        noise_eps_max: float = 1.0,
        loss_weighting: str = "inverse_t",
        loss_chunk_size: int = 8192,
        certainty_weight: float = 0.0,
    ):
        check_diffusion_fields(block_size=block_size, mask_token_id=mask_token_id, objective=self.name or None,
                               noise_eps_min=noise_eps_min, noise_eps_max=noise_eps_max, loss_weighting=loss_weighting,
                               zero_noise_ok=self.allows_zero_noise)
        if loss_chunk_size <= 0:
            raise ValueError(f"loss_chunk_size must be positive, got {loss_chunk_size}.")
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        self.noise_eps_min = float(noise_eps_min)
        self.noise_eps_max = float(noise_eps_max)
        self.loss_weighting = loss_weighting
        self.loss_chunk_size = loss_chunk_size
        self.certainty_weight = check_certainty_weight(certainty_weight)

    @classmethod
    def config_kwargs(cls, config: Any) -> dict[str, Any]:
        """Constructor arguments taken from a `BlockDiffusionConfig`."""
        return dict(
            block_size=config.block_size,
            mask_token_id=config.mask_token_id,
            noise_eps_min=config.noise_eps_min,
            noise_eps_max=config.noise_eps_max,
            loss_weighting=config.loss_weighting,
        )

    @classmethod
    def build(cls, config_or_kwargs: Any, **training: Any) -> "Objective":
        """The objective from a model config (:meth:`config_kwargs`) or a mapping of constructor arguments, with
        ``training`` settings the config does not hold (``certainty_weight``) on top."""
        kwargs = dict(config_or_kwargs) if isinstance(config_or_kwargs, Mapping) else cls.config_kwargs(
            config_or_kwargs)
        kwargs.update(training)
        required = getattr(cls, "required_kwargs", ("block_size", "mask_token_id"))
        missing = [k for k in required if kwargs.get(k) is None]
        if missing:
            given = sorted(k for k, v in kwargs.items() if v is not None)
            raise ValueError(f"objective {cls.name!r} needs {missing}; got {given}.")
        return cls(**kwargs)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(block_size={self.block_size}, mask_token_id={self.mask_token_id}, "
            f"noise_eps=[{self.noise_eps_min}, {self.noise_eps_max}], loss_weighting={self.loss_weighting!r})"
        )

    # --- what the trainer asks of every objective ------------------------------------------
    def card_settings(self) -> dict[str, Any]:
        """Settings for the model card that the saved config does not record (the certainty term's weight, when
        trained with one; the rest are in the config)."""
        return {"certainty_weight": self.certainty_weight} if self.certainty_weight else {}

    # Whether the objective has a pass that runs for some samples only (drawn per sample), which every rank must run
    # when any needs it under FSDP2 (each layer call gathers over the world).
    has_optional_pass: ClassVar[bool] = False

    def needs_optional_pass(self, corrupted) -> bool:
        """Whether this corrupted batch runs the optional pass."""
        return False

    def set_step_normalizers(self, held: list, sum_over_replicas) -> None:
        """Set loss normalizers of the whole optimizer step on this step's corrupted batches ``held``, beyond the
        supervised-token count the trainer sums (``sum_over_replicas(float) -> float``); none by default."""

    # --- corruption --------------------------------------------------------------------------
    def corrupt(self, batch: Mapping[str, torch.Tensor], *, seed: int, step: int) -> CorruptedBatch:
        """Corrupt a collated batch; the noise depends only on (seed, step, sample id, position)."""
        raise NotImplementedError

    def check_batch(self, batch: Mapping[str, torch.Tensor]) -> CheckedBatch:
        """Validate a collator batch and fill in the defaults (sample ids, positions)."""
        if "input_ids" not in batch:
            raise ValueError(f"the batch has no 'input_ids' (keys: {sorted(batch)}).")
        input_ids = batch["input_ids"]
        if input_ids.dim() != 2 or input_ids.numel() == 0:
            raise ValueError(f"input_ids must be a non-empty [batch, L] tensor, got shape {tuple(input_ids.shape)}.")
        b, length = input_ids.shape
        if length % self.block_size:
            raise ValueError(
                f"sequence length {length} is not a multiple of block_size={self.block_size}; the collator "
                "must pad each batch to a multiple of the block size (pad tokens are never supervised)."
            )
        supervised = supervised_mask(batch)
        if not supervised.any():
            raise ValueError(
                f"the batch has no supervised token (completion_mask & attention_mask is all zero over {b} "
                f"sequence(s) of length {length}); the loss would be 0/0. Check that the completions were not "
                "truncated away and that the collator sets completion_mask on the assistant tokens."
            )
        clash = supervised & (input_ids == self.mask_token_id)
        if clash.any():
            row, pos = (int(v) for v in clash.nonzero()[0])
            raise ValueError(
                f"supervised token at batch row {row}, position {pos} is the mask token id {self.mask_token_id}: "
                "it cannot be a target (its logit is excluded). The tokenizer must not emit the [MASK] token in text."
            )
        attention_mask = batch.get("attention_mask")
        attention_mask = (
            torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        )
        sample_ids = batch.get("sample_ids")
        if sample_ids is None:
            sample_ids = torch.arange(b, device=input_ids.device)
        elif tuple(sample_ids.shape) != (b,):
            raise ValueError(
                f"sample_ids must have shape [{b}] (one global id per row), got {tuple(sample_ids.shape)}."
            )
        document_ids = batch.get("document_ids")
        if document_ids is not None:
            _check_shape("document_ids", document_ids, input_ids)
            check_block_aligned_documents(document_ids, self.block_size)
        position_ids = batch.get("position_ids")
        if position_ids is None:
            if document_ids is not None:
                position_ids = document_positions(document_ids)
            else:
                position_ids = torch.arange(length, device=input_ids.device).expand(b, length)
        else:
            _check_shape("position_ids", position_ids, input_ids)
        return CheckedBatch(
            input_ids=input_ids,
            supervised=supervised,
            attention_mask=attention_mask,
            sample_ids=sample_ids.to(device=input_ids.device, dtype=torch.long),
            position_ids=position_ids,
            document_ids=document_ids,
        )

    def block_rates(self, checked: CheckedBatch, *, seed: int, step: int) -> torch.Tensor:
        """Masking rate ``t`` of every (row, block), ``[b, L / block_size]`` float64."""
        length = checked.input_ids.shape[1]
        if self.block_rate_sampling == "independent":
            return independent_block_t(
                seed, step, checked.sample_ids, length // self.block_size, self.noise_eps_min, self.noise_eps_max
            )
        # A sample's extent ends at its last non-pad token; stratifying over that extent (not over the
        # padded length) keeps t independent of which other samples share the batch. Right padding assumed.
        pos = torch.arange(1, length + 1, device=checked.input_ids.device)
        extent = torch.where(checked.attention_mask, pos, torch.zeros_like(pos)).amax(dim=1)
        blocks = (extent + self.block_size - 1) // self.block_size
        return stratified_block_t(
            seed, step, checked.sample_ids, blocks, length // self.block_size, self.noise_eps_min, self.noise_eps_max
        )

    def token_draws(self, checked: CheckedBatch, *, seed: int, step: int) -> torch.Tensor:
        """One uniform per (row, position), ``[b, L]`` float64: a token is masked when its draw < t."""
        length = checked.input_ids.shape[1]
        positions = torch.arange(length, device=checked.input_ids.device)
        return token_uniform(seed, step, checked.sample_ids[:, None], positions[None, :])

    def per_token(self, block_values: torch.Tensor) -> torch.Tensor:
        """Expand ``[b, N]`` per-block values to ``[b, N * block_size]`` per-token values."""
        return block_values.repeat_interleave(self.block_size, dim=1)

    # --- loss --------------------------------------------------------------------------------
    def loss_from_hidden(
        self,
        model: torch.nn.Module,
        hidden_of_rows: torch.Tensor,
        corrupted: CorruptedBatch,
        row_index: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss of the targets whose predicting rows are among ``hidden_of_rows``.

        Args:
            model: the `BlockDiffusionForMaskedLM` (its `lm_logits` applies the head).
            hidden_of_rows (`torch.FloatTensor` of shape `[b, R, hidden]`): last hidden states of some rows.
            corrupted: the batch the rows come from.
            row_index (`torch.LongTensor` of shape `[n]`): for each target, its predicting row's index in
                `hidden_of_rows` (dim 1), or `-1` to skip it (another rank holds or counts that row); see
                :func:`target_rows_in`.

        Returns:
            `(loss, metrics)`: ``loss = sum(w * CE) / corrupted.normalizer`` over the held targets, so the
            losses of ranks that partition the targets add up to the single-device loss; ``metrics`` holds
            detached sums to all-reduce: ``loss_sum`` (Σ w·CE), ``ce_sum`` (Σ CE), ``correct`` (argmax hits),
            ``count`` (targets scored) and ``normalizer`` (already the whole batch's: sum it over data-parallel
            replicas only, not over the ranks of a block-parallel group); with a certainty term in training also
            ``certainty_sum`` (Σ entropy over the targets predicted right).
        """
        self._check_model(model)
        if tuple(row_index.shape) != tuple(corrupted.target_token.shape):
            raise ValueError(
                f"row_index must have one entry per target ({corrupted.num_targets}), "
                f"got shape {tuple(row_index.shape)}."
            )
        if corrupted.normalizer <= 0:
            raise ValueError("corrupted.normalizer is 0: the batch has no supervised token, the loss is undefined.")
        held = row_index >= 0
        hidden = hidden_of_rows[corrupted.target_sample[held], row_index[held]]
        certainty = self.certainty_weight > 0 and torch.is_grad_enabled()
        weighted, ce, correct, entropy = self._target_cross_entropy(
            model, hidden, corrupted.target_token[held], corrupted.target_weight[held], certainty
        )
        if hidden.shape[0] == 0:
            # No target on these rows: a zero that still reaches every parameter, so backward (and DDP's
            # gradient hooks) see the same graph as on ranks that do hold targets.
            weighted = weighted + model.lm_logits(hidden_of_rows[:1, :1]).sum() * 0.0
        loss = weighted / corrupted.normalizer
        if certainty:
            loss = loss + self.certainty_weight * entropy / corrupted.normalizer
        metrics = {
            "loss_sum": weighted.detach(),
            "ce_sum": ce.detach(),
            "correct": correct,
            "count": held.sum(),
            "normalizer": torch.tensor(float(corrupted.normalizer), device=loss.device),
        }
        if certainty:
            metrics["certainty_sum"] = entropy.detach()
        return loss, metrics

    def loss(
        self,
        model: torch.nn.Module,
        corrupted: CorruptedBatch,
        layout: TrainingLayout | None = None,
        *,
        scorer: torch.nn.Module | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The training step of one rank: the backbone over the rows ``layout`` holds, the loss of their targets.

        Args:
            model: what runs the forward (the `BlockDiffusionForMaskedLM`, or a DDP / PEFT wrapper of it).
            corrupted: the corrupted batch (the whole batch: every rank of a group holds it).
            layout: the rows this rank holds; `None` is every row on this device
                (:meth:`~hf_bdlm.attention.interface.LocalLayout.vectorized`), a block-parallel rank passes its
                :class:`~hf_bdlm.parallel.ShardedLayout`. Both go through the same code.
            scorer: the `BlockDiffusionForMaskedLM` whose LM head scores the targets (default: ``model``).

        Returns:
            ``(loss, metrics)`` as :meth:`loss_from_hidden`: over a group, the ranks' losses add up to the
            single-device loss.
        """
        scorer = model if scorer is None else scorer
        self._check_model(scorer)
        # Once per step, not per forward: the rows form runs unchecked (generate checks its prompt once).
        scorer.config.check_token_ids(corrupted.clean_ids, "clean_input_ids")
        if layout is None:
            layout = LocalLayout.vectorized(corrupted.seq_len, scorer.mask_rule(), scorer.config.attention_backend,
                                            corrupted.document_ids)
        ids, pos = layout.local_inputs(corrupted.noisy_ids, corrupted.clean_ids, corrupted.position_ids)
        out = model(input_ids=ids, position_ids=pos, bdlm_layout=layout, return_logits=False)
        return self.loss_from_hidden(scorer, out.hidden_states, corrupted, layout.loss_row_index(corrupted))

    def _check_model(self, model: torch.nn.Module) -> None:
        config = getattr(model, "config", None)
        for field in ("mask_token_id", "block_size"):
            have = getattr(config, field, None)
            if have is not None and have != getattr(self, field):
                raise ValueError(
                    f"the objective uses {field}={getattr(self, field)} but the model's config has {field}={have}; "
                    "build the objective from the model's config (get_objective(name, model.config))."
                )

    def _target_cross_entropy(
        self, model: torch.nn.Module, hidden: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor,
        certainty: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(Σ w·CE, Σ CE, argmax hits, Σ entropy over the hits, 0 unless ``certainty``) over targets, the [MASK]
        logit excluded; chunked over targets."""
        chunk = self.loss_chunk_size
        if hidden.shape[0] <= chunk or not torch.is_grad_enabled():
            return _chunk_cross_entropy(
                hidden, tokens, weights, model.lm_logits, self.mask_token_id, self.exclude_mask_logit, certainty
            )
        totals = []
        for start in range(0, hidden.shape[0], chunk):
            sl = slice(start, start + chunk)
            totals.append(
                checkpoint(
                    _chunk_cross_entropy,
                    hidden[sl], tokens[sl], weights[sl], model.lm_logits, self.mask_token_id, self.exclude_mask_logit,
                    certainty, use_reentrant=False,
                )
            )
        return tuple(torch.stack(parts).sum() for parts in zip(*totals))


def _chunk_cross_entropy(hidden, tokens, weights, lm_logits, mask_token_id: int, exclude_mask_logit: bool,
                         certainty: bool = False):
    # Float32 softmax whatever the model dtype: the CE of a bf16 logit row loses ~2 digits.
    logits = lm_logits(hidden)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # CE in at least float32; float64 models stay float64
    # [MASK] is never a clean token: generate never picks it, nor does the accuracy metric. BD3-LM also drops it
    # from the softmax; Fast-dLLM v2 keeps it (a causal-LM loss over the whole vocabulary).
    without_mask = logits.index_fill(-1, torch.tensor([mask_token_id], device=logits.device), float("-inf"))
    scored = without_mask if exclude_mask_logit else logits
    ce = F.cross_entropy(scored, tokens, reduction="none")
    hits = without_mask.argmax(dim=-1) == tokens
    entropy = ce.new_zeros(())
    if certainty:
        # The same distribution as the CE's, its excluded logit the dtype's lowest finite value instead of -inf: a
        # probability of exactly 0 whose p * log p, and its gradient, stay 0 rather than 0 * inf.
        finite = logits.index_fill(-1, torch.tensor([mask_token_id], device=logits.device),
                                   torch.finfo(logits.dtype).min) if exclude_mask_logit else logits
        entropy = certainty_entropy(finite, hits)
    return (weights.to(ce.dtype) * ce).sum(), ce.sum(), hits.sum().detach(), entropy


def check_certainty_weight(value: Any) -> float:
    """``certainty_weight`` as a float, or a clear error: a finite number >= 0 (0 turns the term off)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(
            f"certainty_weight must be a finite number >= 0 (0 turns the certainty-forcing term off), got {value!r}."
        )
    return float(value)


def certainty_entropy(logits: torch.Tensor, hits: torch.Tensor) -> torch.Tensor:
    """Σ over the rows where ``hits`` of the entropy of ``softmax(logits)`` (finite logits: mask a logit out with
    the dtype's lowest value, not ``-inf``): the certainty-forcing term, which sharpens only the predictions that
    are already right."""
    log_p = F.log_softmax(logits[hits], dim=-1)
    return -(log_p.exp() * log_p).sum()


__all__ = [
    "CLEAN",
    "NOISY",
    "CheckedBatch",
    "CorruptedBatch",
    "Objective",
    "certainty_entropy",
    "check_certainty_weight",
    "supervised_mask",
    "target_rows_in",
]
