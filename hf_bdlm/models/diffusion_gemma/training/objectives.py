"""`diffusion_gemma`: DiffusionGemma's SFT objective, with every response block of a sample trained in one pass.

The model is transformers' ``DiffusionGemmaForBlockDiffusion`` (a causal encoder reads clean tokens into a KV cache,
a bidirectional decoder denoises canvases of ``canvas_length`` = B tokens over it); the attention glue and the frame
are in :mod:`hf_bdlm.models.diffusion_gemma.modeling`. Per sample (per document of a packed row):

- the response is the last contiguous supervised span (earlier assistant turns are context, as in TRL's reference
  recipe); it is cut into canvas blocks of B tokens starting at its first token; the last block is filled with the
  EOS (fill) token past the response end, the fill supervised unless the response was truncated;
- every block is corrupted independently: ``t ~ U(noise_eps_min, noise_eps_max)`` per (sample, block), and each
  canvas token is replaced by a uniformly drawn vocabulary token with probability ``t`` (uniform-state noise, no
  ``[MASK]``); ``noise_eps_min = noise_eps_max = 0`` means no corruption;
- self-conditioning: with probability ``self_conditioning_prob`` per sample and step, the decoder first runs without
  gradient and its soft predictions condition the scored pass (``0`` skips the first pass);
- loss = mean cross-entropy over all supervised canvas positions of the batch (flat: no ``1/t`` weight, the uniform
  kernel's ELBO is flat) + ``ar_loss_weight`` x mean next-token cross-entropy of the encoder over all next-token
  pairs of the batch (soft-capped logits, as the decoder's).

``model_prediction_type="mean"`` scores the decoder's distribution as the posterior mean of the clean token.
``"mean_loo"`` reads it as the *leave-one-out* posterior ``p(x_0 | x_t without position i)`` and scores its Bayes
combination with the observed noisy token ``z`` under the uniform kernel ``q(z | v) = (1 - t)[z = v] + t / V``: the
logit of ``z`` gains ``log(1 + (1 - t) V / t)``. A model trained so needs that combination at sampling time
(transformers' ``generate`` does not apply it); the model card records the choice.

**Against TRL's example trainer** (one random response block per sample and step): every block here is an
independent draw of the same corruption law as TRL's single block, so a sample's all-block mean equals the
expectation of TRL's loss over its uniformly chosen block, exactly rather than by sampling the block (lower
variance, same expectation). Across the batch the mean is per supervised token (TRL averages per sample, then over
samples): both estimate the same flat per-token objective when responses have equal block counts, and a sample's
weight here is proportional to its number of blocks. The encoder term is TRL's unchanged. What differs in value is
the context: TRL's encoder reads the whole sequence into one cache and masks it, so its sliding layers see keys of
the previous ``W - 1`` *tokens of the sequence* as the canvas's cache would not; here every block sees what
``generate`` gives it.

All random draws are ``hash_uniform(seed, step, sample, position, salt)`` keyed by positions of the collated row,
never by the frame, the batch or the rank::

    obj = get_objective("diffusion_gemma", dict(block_size=4, vocab_size=64, fill_token_id=1))
    corrupted = obj.corrupt({"input_ids": ids, "completion_mask": mask}, seed=0, step=0)
    loss, metrics = obj.loss(model, corrupted)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..modeling import (
    CanvasFrame,
    DiffusionGemmaLayout,
    build_canvas_frame,
    decode,
    encode,
    self_conditioning_embeddings,
    softcapped_logits,
    unwrap_diffusion_gemma,
)
from ....objectives.base import Objective, certainty_entropy, check_certainty_weight, supervised_mask
from ....objectives.noise import hash_uniform
from ..configuration import DEFAULT_NOISE_EPS, MODEL_PREDICTION_TYPES

# Salts of this objective's draws (distinct from noise.py's).
SALT_CANVAS_T = 0x5EED_D601
SALT_CANVAS_REPLACE = 0x5EED_D602
SALT_UNIFORM_TOKEN = 0x5EED_D603
SALT_SELF_CONDITIONING = 0x5EED_D604


@dataclass
class DiffusionGemmaBatch:
    """A corrupted DiffusionGemma batch.

    Args:
        frame (:class:`~hf_bdlm.models.diffusion_gemma.modeling.CanvasFrame`): rows, clean canvas targets, next-token pairs.
        noisy_ids (`torch.LongTensor` of shape `[b, Nc]`): the corrupted canvases (the decoder's input).
        canvas_t (`torch.DoubleTensor` of shape `[b, Nc]`): corruption rate of each canvas token's block.
        self_conditioning (`torch.BoolTensor` of shape `[b]`): samples conditioned on a first pass.
        sample_ids (`torch.LongTensor` of shape `[b]`): global sample ids (keys of the noise).
        normalizer (`float`): supervised canvas tokens (the trainer sets the whole optimizer step's).
        ar_normalizer (`float`): next-token pairs of this batch.
        ar_step_normalizer (`float`, *optional*): next-token pairs of the whole optimizer step (set by the trainer
            under gradient accumulation / data parallelism); `None` uses `ar_normalizer`.
    """

    frame: CanvasFrame
    noisy_ids: torch.Tensor
    canvas_t: torch.Tensor
    self_conditioning: torch.Tensor
    sample_ids: torch.Tensor
    normalizer: float
    ar_normalizer: float
    ar_step_normalizer: float | None = None

    @property
    def masked(self) -> torch.Tensor:
        """Canvas tokens the noise replaced (a replacement may draw the same token)."""
        return self.noisy_ids != self.frame.canvas_target


class DiffusionGemmaObjective(Objective):
    """DiffusionGemma SFT (see the module docstring).

    Parameters:
        block_size (`int`): the model's `canvas_length`.
        vocab_size (`int`): vocabulary of the uniform noise.
        fill_token_id (`int`): the token past the response end in the last canvas (the tokenizer's EOS).
        pad_token_id (`int`, defaults to 0): token of the frame's pad rows.
        end_token_ids (`set[int]`, *optional*): a response not ending with one of these was truncated (its fill is
            not supervised); `None` treats no response as truncated. A batch key `truncated` (`[b]`) overrides it.
        noise_eps_min (`float`, defaults to 1e-4), noise_eps_max (`float`, defaults to 1 - 1e-4):
            range of the per-block replacement rate `t`; `0 <= min <= max <= 1` (0 / 0: no corruption).
        self_conditioning_prob (`float`, defaults to 0.5): per-sample probability of the self-conditioning pass.
        ar_loss_weight (`float`, defaults to 1.0): weight of the encoder's next-token loss (0 skips it).
        model_prediction_type (`str`, defaults to `"mean"`): `"mean"` or `"mean_loo"`.
        attention_backend (`str`, defaults to `"auto"`: flex on CUDA, blockwise elsewhere): see `hf_bdlm.attention.backends`.
        loss_chunk_size (`int`, defaults to 8192): rows per LM-head call (chunks recomputed in backward).
        pad_to_multiple_of (`int`, *optional*): frame length multiple (parallel layouts).
        canvas_blocks_multiple_of (`int`, *optional*): canvas blocks padded to a multiple of this count (parallel
            layouts deal them in equal shares; see `hf_bdlm.models.diffusion_gemma.training.sharded.frame_padding`).
    """

    name = "diffusion_gemma"
    allows_zero_noise = True  # uniform-state noise: t = 0 leaves the canvas clean
    required_kwargs = ("block_size", "vocab_size", "fill_token_id")

    def __init__(
        self,
        *,
        block_size: int,
        vocab_size: int,
        fill_token_id: int,
        pad_token_id: int = 0,
        end_token_ids=None,
        noise_eps_min: float = DEFAULT_NOISE_EPS,
        noise_eps_max: float = 1.0 - DEFAULT_NOISE_EPS,
        self_conditioning_prob: float = 0.5,
        ar_loss_weight: float = 1.0,
        model_prediction_type: str = "mean",
        attention_backend: str = "auto",
        loss_chunk_size: int = 8192,
        pad_to_multiple_of: int | None = None,
        canvas_blocks_multiple_of: int | None = None,
        certainty_weight: float = 0.0,
    ):
        for name, value in (("block_size", block_size), ("vocab_size", vocab_size), ("loss_chunk_size", loss_chunk_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if not 0 <= fill_token_id < vocab_size:
            raise ValueError(f"fill_token_id={fill_token_id} is not a token id of the vocabulary of {vocab_size}.")
        if not 0.0 <= noise_eps_min <= noise_eps_max <= 1.0:
            raise ValueError(
                f"need 0 <= noise_eps_min <= noise_eps_max <= 1, got noise_eps_min={noise_eps_min}, "
                f"noise_eps_max={noise_eps_max} (0 / 0 trains without corruption)."
            )
        if not 0.0 <= self_conditioning_prob <= 1.0:
            raise ValueError(f"self_conditioning_prob must lie in [0, 1], got {self_conditioning_prob!r}.")
        if ar_loss_weight < 0:
            raise ValueError(f"ar_loss_weight must be >= 0, got {ar_loss_weight!r}.")
        if model_prediction_type not in MODEL_PREDICTION_TYPES:
            raise ValueError(
                f"model_prediction_type must be one of {MODEL_PREDICTION_TYPES}, got {model_prediction_type!r}."
            )
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.fill_token_id = int(fill_token_id)
        self.pad_token_id = int(pad_token_id)
        self.end_token_ids = None if end_token_ids is None else {int(t) for t in end_token_ids}
        self.noise_eps_min = float(noise_eps_min)
        self.noise_eps_max = float(noise_eps_max)
        self.self_conditioning_prob = float(self_conditioning_prob)
        self.ar_loss_weight = float(ar_loss_weight)
        self.model_prediction_type = model_prediction_type
        self.attention_backend = attention_backend
        self.loss_chunk_size = loss_chunk_size
        self.pad_to_multiple_of = pad_to_multiple_of
        self.canvas_blocks_multiple_of = canvas_blocks_multiple_of
        self.certainty_weight = check_certainty_weight(certainty_weight)

    @classmethod
    def config_kwargs(cls, config: Any) -> dict[str, Any]:
        """Constructor arguments taken from a `DiffusionGemmaConfig` (the fill token is its first EOS id)."""
        text = config.get_text_config()
        eos = text.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        kwargs = dict(block_size=config.canvas_length, vocab_size=text.vocab_size,
                      fill_token_id=eos_ids[0] if eos_ids else None, end_token_ids=eos_ids or None)
        if text.pad_token_id is not None:
            kwargs["pad_token_id"] = text.pad_token_id
        return kwargs

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(block_size={self.block_size}, noise_eps=[{self.noise_eps_min}, "
            f"{self.noise_eps_max}], self_conditioning_prob={self.self_conditioning_prob}, "
            f"ar_loss_weight={self.ar_loss_weight}, model_prediction_type={self.model_prediction_type!r})"
        )

    def card_settings(self) -> dict[str, Any]:
        """The objective's knobs, for the model card."""
        return {
            "objective": self.name,
            "canvas_length": self.block_size,
            "noise_eps": f"[{self.noise_eps_min:g}, {self.noise_eps_max:g}]",
            "self_conditioning_prob": self.self_conditioning_prob,
            "ar_loss_weight": self.ar_loss_weight,
            "model_prediction_type": self.model_prediction_type,
        } | ({"certainty_weight": self.certainty_weight} if self.certainty_weight else {})

    @property
    def has_optional_pass(self) -> bool:
        """The self-conditioning decoder pass runs for a sample with probability ``self_conditioning_prob``."""
        return self.self_conditioning_prob > 0

    def needs_optional_pass(self, corrupted: DiffusionGemmaBatch) -> bool:
        return bool(corrupted.self_conditioning.any())

    def set_step_normalizers(self, held: list, sum_over_replicas) -> None:
        """The encoder's next-token loss is normalized by the next-token pairs of the whole optimizer step."""
        step_pairs = sum_over_replicas(float(sum(c.ar_normalizer for c in held)))
        for c in held:
            c.ar_step_normalizer = step_pairs

    # --- corruption ---------------------------------------------------------------------------------------------
    def corrupt(self, batch: Mapping[str, torch.Tensor], *, seed: int, step: int) -> DiffusionGemmaBatch:
        if "input_ids" not in batch:
            raise ValueError(f"the batch has no 'input_ids' (keys: {sorted(batch)}).")
        input_ids = batch["input_ids"]
        if input_ids.dim() != 2 or input_ids.numel() == 0:
            raise ValueError(f"input_ids must be a non-empty [batch, L] tensor, got shape {tuple(input_ids.shape)}.")
        b = input_ids.shape[0]
        supervised = supervised_mask(batch)
        attention = batch.get("attention_mask")
        attention = torch.ones_like(input_ids, dtype=torch.bool) if attention is None else attention.bool()
        sample_ids = batch.get("sample_ids")
        sample_ids = torch.arange(b, device=input_ids.device) if sample_ids is None else sample_ids.long()
        frame = build_canvas_frame(
            input_ids, attention, supervised, block_size=self.block_size, fill_token_id=self.fill_token_id,
            pad_token_id=self.pad_token_id, document_ids=batch.get("document_ids"),
            position_ids=batch.get("position_ids"), truncated=batch.get("truncated"),
            end_token_ids=self.end_token_ids, pad_to_multiple_of=self.pad_to_multiple_of,
            canvas_blocks_multiple_of=self.canvas_blocks_multiple_of,
        )
        if not bool(frame.canvas_supervised.any()):
            raise ValueError(
                f"the batch has no supervised token (completion_mask & attention_mask is all zero over {b} "
                "sequence(s)); there is no response to denoise. Check that completions were not truncated away."
            )
        sid = sample_ids[:, None]
        source, block_source = frame.canvas_source, frame.canvas_block_source
        u_t = hash_uniform(seed, step, sid, block_source.clamp(min=0), SALT_CANVAS_T)
        canvas_t = self.noise_eps_min + (self.noise_eps_max - self.noise_eps_min) * u_t
        replace = (hash_uniform(seed, step, sid, source.clamp(min=0), SALT_CANVAS_REPLACE) < canvas_t) & (source >= 0)
        drawn = (hash_uniform(seed, step, sid, source.clamp(min=0), SALT_UNIFORM_TOKEN) * self.vocab_size).long()
        noisy = torch.where(replace, drawn.clamp(max=self.vocab_size - 1), frame.canvas_target)
        coin = hash_uniform(seed, step, sample_ids, torch.zeros_like(sample_ids), SALT_SELF_CONDITIONING)
        return DiffusionGemmaBatch(
            frame=frame,
            noisy_ids=noisy,
            canvas_t=canvas_t,
            self_conditioning=coin < self.self_conditioning_prob,
            sample_ids=sample_ids,
            normalizer=float(frame.canvas_supervised.sum()),
            ar_normalizer=float(frame.ar_pairs.sum()),
        )

    # --- loss -----------------------------------------------------------------------------------------------------
    def loss(self, model: torch.nn.Module, corrupted: DiffusionGemmaBatch, layout: DiffusionGemmaLayout | None = None,
             self_conditioning_pass: bool | None = None):
        """One training step's loss over the rows ``layout`` holds: the encoder once, the decoder over the canvases
        (twice for the samples that self-condition), the LM head only on scored rows.

        ``layout`` defaults to every row on this device (:meth:`DiffusionGemmaLayout.local`); a rank of a
        block-parallel group passes its :class:`~hf_bdlm.models.diffusion_gemma.training.sharded.ShardedDiffusionGemmaLayout`, and
        the ranks' losses add up to the single-device loss. ``self_conditioning_pass`` (default: whether a sample
        self-conditions) runs the decoder's first pass or not; with ``True`` and no sample self-conditioning it runs
        and is discarded (FSDP2 with data-parallel replicas: every rank calls the decoder as often as the others).
        Returns ``(loss, metrics)`` as :meth:`loss_from_hidden`.
        """
        dg = self._model(model)
        frame = corrupted.frame
        layout = layout or DiffusionGemmaLayout.local(frame, self.attention_backend)
        encoder_hidden, cache = encode(dg, frame, layout)
        signal = None
        conditioned = self.self_conditioning_prob > 0 and bool(corrupted.self_conditioning.any())
        if conditioned if self_conditioning_pass is None else self_conditioning_pass:
            with torch.no_grad():
                first = decode(dg, frame, layout, corrupted.noisy_ids, cache)
                if conditioned:
                    signal = self_conditioning_embeddings(dg, first, corrupted.self_conditioning,
                                                          self.loss_chunk_size)
        canvas_hidden = decode(dg, frame, layout, corrupted.noisy_ids, cache, signal)
        clean_index, counted = layout.clean_index, layout.clean_loss_index
        scored = encoder_hidden
        if counted is not None:
            counted = counted.to(encoder_hidden.device)
            scored, clean_index = encoder_hidden[:, counted], clean_index.to(counted.device)[counted]
        loss, metrics = self.loss_from_hidden(dg, corrupted, scored, canvas_hidden, clean_index, layout.canvas_index)
        # Backward must traverse every layer on every rank, targets or not: a sharded layout's attention sends
        # gradients to its peers from there (an exact zero that keeps the whole graph).
        return loss + (encoder_hidden.sum() + canvas_hidden.sum()) * 0.0, metrics

    def loss_from_hidden(self, model, corrupted: DiffusionGemmaBatch, encoder_hidden: torch.Tensor,
                         canvas_hidden: torch.Tensor, clean_index: torch.Tensor | None = None,
                         canvas_index: torch.Tensor | None = None):
        """Loss of the targets whose rows are held: ``encoder_hidden [b, f, h]`` for frame rows ``clean_index``
        (default: all ``F``), ``canvas_hidden [b, n, h]`` for canvas rows ``canvas_index`` (default: all ``Nc``).

        Normalizers count the whole batch (step), so the losses of ranks that partition the rows add up to the
        single-device loss. Returns ``(loss, metrics)``; ``metrics`` holds detached sums: ``loss_sum`` / ``ce_sum``
        (canvas cross-entropy), ``correct``, ``count`` (canvas targets scored), ``normalizer``, ``ar_ce_sum``,
        ``ar_count``, ``ar_normalizer``.
        """
        dg = self._model(model)
        frame = corrupted.frame
        device = canvas_hidden.device
        if corrupted.normalizer <= 0:
            raise ValueError("corrupted.normalizer is 0: the batch has no supervised canvas token.")
        canvas_row = _local_rows(canvas_index, frame.num_canvas_rows, device)
        sample, row = frame.canvas_supervised.nonzero(as_tuple=True)
        held = canvas_row[row] >= 0
        sample, row = sample[held], row[held]
        certainty = self.certainty_weight > 0 and torch.is_grad_enabled()  # a training term (the base class's)
        d_sum, correct, entropy = self._canvas_cross_entropy(
            dg, canvas_hidden[sample, canvas_row[row]], frame.canvas_target[sample, row],
            corrupted.noisy_ids[sample, row], corrupted.canvas_t[sample, row], certainty,
        )
        loss = d_sum / corrupted.normalizer
        if certainty:
            loss = loss + self.certainty_weight * entropy / corrupted.normalizer
        ar_sum = torch.zeros((), device=device)
        ar_count = torch.zeros((), dtype=torch.long, device=device)
        ar_normalizer = corrupted.ar_step_normalizer or corrupted.ar_normalizer
        if self.ar_loss_weight > 0 and ar_normalizer > 0:
            clean_row = _local_rows(clean_index, frame.frame_length, device)
            s, f = frame.ar_pairs.nonzero(as_tuple=True)
            keep = clean_row[f] >= 0
            s, f = s[keep], f[keep]
            ar_sum = self._next_token_cross_entropy(dg, encoder_hidden[s, clean_row[f]], frame.clean_ids[s, f + 1])
            ar_count = keep.sum()
            loss = loss + self.ar_loss_weight * ar_sum / ar_normalizer
        metrics = {
            "loss_sum": d_sum.detach(),
            "ce_sum": d_sum.detach(),
            "correct": correct,
            "count": torch.tensor(int(sample.numel()), device=device),
            "normalizer": torch.tensor(float(corrupted.normalizer), device=device),
            "ar_ce_sum": ar_sum.detach(),
            "ar_count": ar_count,
            "ar_normalizer": torch.tensor(float(ar_normalizer), device=device),
        }
        if certainty:
            metrics["certainty_sum"] = entropy.detach()
        return loss, metrics

    def zero_loss(self, model, inputs: Mapping[str, torch.Tensor],
                  self_conditioning_pass: bool = False) -> torch.Tensor:
        """A zero that reaches every trained parameter (a data-parallel replica with nothing to score).

        With ``self_conditioning_pass`` the decoder runs once more, without gradient, as on the replicas whose step
        self-conditions (FSDP2 gathers the layers for each call: every rank must call them as often)."""
        dg = self._model(model)
        ids = inputs["input_ids"]
        canvas = ids[:, : self.block_size]
        out = dg(input_ids=ids, decoder_input_ids=canvas)
        if self_conditioning_pass:
            with torch.no_grad():
                dg.model.decoder(decoder_input_ids=canvas, cache=out.cache)
        return (out.logits.sum() + softcapped_logits(dg, out.encoder_last_hidden_state).sum()) * 0.0

    # --- pieces ---------------------------------------------------------------------------------------------------
    def _model(self, model):
        dg = unwrap_diffusion_gemma(model)
        if dg is None:
            raise TypeError(
                f"the diffusion_gemma objective trains transformers' DiffusionGemmaForBlockDiffusion (possibly inside "
                f"PEFT), got {type(model).__name__}."
            )
        if dg.config.canvas_length != self.block_size:
            raise ValueError(
                f"the objective uses block_size={self.block_size} but the model's canvas_length is "
                f"{dg.config.canvas_length}; build it from the model's config."
            )
        return dg

    def _canvas_cross_entropy(self, model, hidden, tokens, observed, t, certainty: bool = False):
        """(Σ CE, argmax hits, Σ entropy over the hits, 0 unless ``certainty``) over canvas targets."""
        loo = self.model_prediction_type == "mean_loo"
        vocab = self.vocab_size

        def score(h, tok, obs, rate):
            logits = softcapped_logits(model, h)
            if loo:
                # Bayes combination of the leave-one-out prediction with the observed token's uniform kernel.
                bonus = torch.log1p((1.0 - rate) * vocab / rate.clamp(min=1e-30)).to(logits.dtype)
                logits = logits.scatter_add(1, obs[:, None], bonus[:, None])
            ce = F.cross_entropy(logits, tok, reduction="sum")
            hits = logits.argmax(dim=-1) == tok
            entropy = ce.new_zeros(())
            if certainty:  # in at least float32, as the CE
                entropy = certainty_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), hits)
            return ce, hits.sum().detach(), entropy

        return _chunked(score, self.loss_chunk_size, hidden, tokens, observed, t)

    def _next_token_cross_entropy(self, model, hidden, tokens):
        def score(h, tok):
            return (F.cross_entropy(softcapped_logits(model, h), tok, reduction="sum"),)

        return _chunked(score, self.loss_chunk_size, hidden, tokens)[0]


def _local_rows(index: torch.Tensor | None, total: int, device) -> torch.Tensor:
    """Map from global row to held row (-1 where not held)."""
    if index is None:
        return torch.arange(total, device=device)
    table = torch.full((total,), -1, dtype=torch.long, device=device)
    table[index.to(device)] = torch.arange(index.numel(), device=device)
    return table


def _chunked(fn, chunk: int, *tensors):
    """Sum of ``fn`` over row chunks; chunks are recomputed in backward so ``[rows, vocab]`` logits never pile up."""
    n = tensors[0].shape[0]
    if n <= chunk or not torch.is_grad_enabled():
        if n == 0:
            return tuple(torch.zeros((), device=tensors[0].device) for _ in range(3))
        return fn(*tensors)
    parts = [checkpoint(fn, *(t[s : s + chunk] for t in tensors), use_reentrant=False) for s in range(0, n, chunk)]
    return tuple(torch.stack(p).sum() for p in zip(*parts))


__all__ = ["DiffusionGemmaBatch", "DiffusionGemmaObjective", "MODEL_PREDICTION_TYPES"]
