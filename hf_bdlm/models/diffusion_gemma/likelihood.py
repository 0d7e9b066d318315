"""The likelihood of DiffusionGemma: a seeded Monte-Carlo estimate of its uniform-state diffusion bound.

DiffusionGemma denoises canvases of ``B`` tokens, each starting right after the text before it (the continuation's
first token opens the first canvas), over the clean encoder cache of that text. Its noise is uniform-state: at level
``t`` each canvas token is replaced by a token drawn uniformly from the ``N`` of the vocabulary with probability
``t``, ``q_t(z | x) = (1 - t) [z = x] + t / N``. A continuous-time Markov chain with uniform jump rate
``beta_t = 1 / (1 - t)`` has exactly these marginals, and the model's decoder output ``x_theta`` (the posterior of the
clean token given the whole noisy canvas, the ``mean`` reading of the objective and of transformers' ``generate``)
fixes the chain's reverse rates through the ratios

    s_y = p_t(z with z_i = y) / p_t(z) = sum_v x_theta(v) q_t(y | v) / q_t(z_i | v)
        = x_theta(z_i) b / a + x_theta(y) a / b + (1 - x_theta(z_i) - x_theta(y)),   a = 1 - t + t / N,  b = t / N.

The bound is that of the generative process "uniform tokens at ``t = 1``, the reverse chain down to ``t_min``, then
each token drawn from ``x_theta``" (the prior ``q_1`` is uniform; the denoising score entropy bound of Lou et al., arXiv 2310.16834, for these
rates):

    log p(x | context) >= E_{z ~ q_tmin}[ sum_i log x_theta(x_i | z) ]
                          - int_tmin^1 dt E_{z ~ q_t}[ sum_i (beta_t / N) sum_{y != z_i} r_y phi(s_y / r_y - 1) ],

with ``r_y = q_t(y | x_i) / q_t(z_i | x_i)`` and ``phi(d) = d - log(1 + d)`` (the score-entropy term written as a
Bregman divergence, which stays exact where ``s`` and ``r`` are close). With the true posterior the bound is tight
(``tests/test_lm_eval.py`` integrates it for a small vocabulary). ``t_min`` is the lowest level training draws
(``noise_eps_min``, 1e-4); below it the integrand of a model that doubts clean tokens grows like ``1 / t``.

Estimated per canvas block with ``mc_num`` samples: a reconstruction canvas at ``t_min`` and a canvas at ``t``
drawn log-uniformly on ``[t_min, 1)`` (weight ``t log(1 / t_min)``), stratified over the samples
(:func:`hf_bdlm.objectives.likelihood.stratified_levels`). Positions of the last canvas past the continuation hold
uniform tokens at every level (the noise's end state: unknown, as when decoding) and are not scored. One more canvas,
every continuation token uniform noise, decides ``greedy`` by argmax. Requests are batched only with requests of the
same canvas geometry, so no row is ever padded.

    scorer = family_named("diffusion_gemma").likelihood_scorer(model, tokenizer)
    [estimate] = scorer.score([ScoreRequest((2, 9, 10), (11, 12))], mc_num=32, seed=0, batch_size=8)
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Sequence

import torch

from ...objectives.likelihood import request_key, stratified_levels, summarize
from ...objectives.noise import hash_uniform
from ..family import BoundEstimate, LikelihoodScorer, ScoreRequest
from .modeling import (
    CanvasFrame,
    DiffusionGemmaLayout,
    build_canvas_frame,
    decode,
    encode,
    softcapped_logits,
    unwrap_diffusion_gemma,
)
from .objective import DEFAULT_NOISE_EPS

SALT_RECON_REPLACE = 0x11CE_D601
SALT_REPLACE = 0x11CE_D602
SALT_TOKEN = 0x11CE_D603
SALT_TAIL = 0x11CE_D604
SLOT_CHUNK = 16  # canvas slots per [slots, vocab] float64 block of the bound's terms
SERIES_BELOW = 1e-3  # |d| under which phi(d) = d - log1p(d) is summed as its series (no cancellation)


def bregman_phi(d: torch.Tensor) -> torch.Tensor:
    """``phi(d) = d - log(1 + d)`` (``d > -1``), exact near 0 through its series."""
    series = d * d * (0.5 - d * (1 / 3 - d * (0.25 - d * 0.2)))
    return torch.where(d.abs() < SERIES_BELOW, series, d - torch.log1p(d))


def score_entropy_rate(probs: torch.Tensor, noisy: torch.Tensor, clean: torch.Tensor, t: torch.Tensor,
                       vocab_size: int) -> torch.Tensor:
    """The integrand of the bound at level ``t`` for each canvas slot (module docstring):
    ``(beta_t / N) sum_{y != z} r_y phi(s_y / r_y - 1)``.

    Args:
        probs (`torch.DoubleTensor` of shape `[n, N]`): the decoder's distribution ``x_theta`` at each slot.
        noisy, clean (`torch.LongTensor` of shape `[n]`): the noisy token ``z`` and the clean token ``x``.
        t (`torch.DoubleTensor` of shape `[n]`): the slot's noise level, in ``(0, 1)``.
    """
    n = probs.shape[0]
    rows = torch.arange(n, device=probs.device)
    b = (t / vocab_size)[:, None]
    a = 1.0 - t[:, None] + b
    p_z = probs[rows, noisy][:, None]
    rest = (1.0 - p_z - probs).clamp(min=0.0)
    s = p_z * (b / a) + probs * (a / b) + rest
    q_z = torch.where((noisy == clean)[:, None], a, b)  # q_t(z | x)
    r = (b / q_z).expand(n, probs.shape[1]).clone()  # q_t(y | x) / q_t(z | x), y != x
    r[rows, clean] = (a / q_z)[:, 0]
    terms = r * bregman_phi(s / r - 1.0)
    terms[rows, noisy] = 0.0
    return terms.sum(1) / ((1.0 - t) * vocab_size)


class DiffusionGemmaLikelihoodScorer(LikelihoodScorer):
    """Scores a `DiffusionGemmaForBlockDiffusion` (module docstring)."""

    bound = "uniform-state diffusion ELBO (score entropy over t in [t_min, 1], reconstruction at t_min)"

    def __init__(self, model, tokenizer=None, t_min: float = DEFAULT_NOISE_EPS, attention_backend: str = "blockwise"):
        if not 0.0 < t_min < 1.0:
            raise ValueError(f"t_min must lie in (0, 1), got {t_min!r}.")
        self.model = unwrap_diffusion_gemma(model).eval()
        text = self.model.config.get_text_config()
        self.vocab_size = int(text.vocab_size)
        self.block_size = int(self.model.config.canvas_length)
        self.pad_token_id = int(text.pad_token_id or 0)
        self.t_min = float(t_min)
        self.backend = attention_backend
        self.device = next(self.model.parameters()).device
        self.context_length = int(getattr(text, "max_position_embeddings", 0) or 1 << 30)

    def score(self, requests: Sequence[ScoreRequest], *, mc_num: int, seed: int, batch_size: int
              ) -> list[BoundEstimate]:
        if mc_num < 1 or batch_size < 1:
            raise ValueError(f"mc_num and batch_size must be positive integers, got {mc_num} and {batch_size}.")
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i, request in enumerate(requests):
            groups[self._geometry(request)].append(i)
        results: list[BoundEstimate | None] = [None] * len(requests)
        for members in groups.values():
            for start in range(0, len(members), batch_size):
                chunk = members[start : start + batch_size]
                with torch.no_grad():
                    for i, estimate in zip(chunk, self._score_batch([requests[i] for i in chunk], mc_num, seed)):
                        results[i] = estimate
        return results

    def _geometry(self, request: ScoreRequest) -> tuple:
        """Requests of equal geometry have equal frames up to their tokens: the same rows, blocks and documents."""
        frame = self._frame([request])
        return (frame.frame_length, tuple(frame.canvas_blocks.tolist()), tuple(frame.clean_rows.doc[0].tolist()),
                tuple(frame.canvas_rows.doc[0].tolist()))

    def _frame(self, requests: list[ScoreRequest]) -> CanvasFrame:
        for r in requests:
            if not r.context or not r.continuation:
                raise ValueError(f"a likelihood request needs at least one context and one continuation token, got "
                                 f"{len(r.context)} and {len(r.continuation)}.")
            if len(r.context) + len(r.continuation) > self.context_length:
                raise ValueError(f"a request of {len(r.context) + len(r.continuation)} tokens exceeds the model's "
                                 f"context of {self.context_length}; shorten the task's contexts.")
        width = max(len(r.context) + len(r.continuation) for r in requests)
        ids = torch.full((len(requests), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros_like(ids, dtype=torch.bool)
        supervised = torch.zeros_like(attention)
        for i, r in enumerate(requests):
            tokens = r.context + r.continuation
            ids[i, : len(tokens)] = torch.tensor(tokens)
            attention[i, : len(tokens)] = True
            supervised[i, len(r.context) : len(tokens)] = True
        # The fill past the continuation is replaced by noise below; it is never a target (truncated).
        return build_canvas_frame(ids.to(self.device), attention.to(self.device), supervised.to(self.device),
                                  block_size=self.block_size, fill_token_id=self.pad_token_id,
                                  pad_token_id=self.pad_token_id, truncated=torch.ones(len(requests), dtype=torch.bool))

    def _score_batch(self, requests: list[ScoreRequest], mc_num: int, seed: int) -> list[BoundEstimate]:
        frame = self._frame(requests)
        per_request = 2 * mc_num + 1  # reconstruction canvases, diffusion canvases, the all-noise canvas
        _, cache = encode(self.model, frame, DiffusionGemmaLayout.local(frame, self.backend))
        cache.batch_repeat_interleave(per_request)
        repeated = _repeat_frame(frame, per_request)
        canvases, levels = zip(*(self._canvases(frame, i, r, mc_num, seed) for i, r in enumerate(requests)))
        hidden = decode(self.model, repeated, DiffusionGemmaLayout.local(repeated, self.backend),
                        torch.cat(canvases).to(self.device), cache)
        return [self._estimate(frame, i, hidden[i * per_request : (i + 1) * per_request],
                               canvases[i].to(self.device), levels[i], mc_num)
                for i in range(len(requests))]

    def _canvases(self, frame: CanvasFrame, i: int, request: ScoreRequest, mc_num: int, seed: int):
        """Request ``i``'s ``2 mc_num + 1`` canvases ``[rows, Nc]`` and each diffusion sample's slot levels."""
        key = torch.tensor(request_key(request.context, request.continuation))
        source = frame.canvas_source[i].cpu()
        target = frame.canvas_target[i].cpu()
        continuation = frame.canvas_supervised[i].cpu()
        blocks, slot_block = torch.unique(frame.canvas_block_source[i].cpu(), return_inverse=True)
        u = stratified_levels(seed, int(key), mc_num, blocks)  # [M, blocks]
        levels = self.t_min ** (1.0 - u[:, slot_block])  # log-uniform on [t_min, 1), per slot of its block
        position = source.clamp(min=0)
        rows = []
        for kind, salt, count in (("recon", SALT_RECON_REPLACE, mc_num), ("diffusion", SALT_REPLACE, mc_num),
                                  ("noise", SALT_REPLACE, 1)):
            for k in range(count):
                step = k if kind != "noise" else mc_num
                t = {"recon": torch.full_like(levels[0], self.t_min), "diffusion": levels[k],
                     "noise": torch.ones_like(levels[0])}[kind]
                replace = hash_uniform(seed, step, key, position, salt) < t
                drawn = (hash_uniform(seed, step, key, position, SALT_TOKEN) * self.vocab_size).long()
                canvas = torch.where(replace & continuation, drawn.clamp(max=self.vocab_size - 1), target)
                tail = (hash_uniform(seed, step, key, position, SALT_TAIL) * self.vocab_size).long()
                rows.append(torch.where(continuation, canvas, tail.clamp(max=self.vocab_size - 1)))
        return torch.stack(rows), levels

    def _estimate(self, frame: CanvasFrame, i: int, hidden: torch.Tensor, canvases: torch.Tensor,
                  levels: torch.Tensor, mc_num: int) -> BoundEstimate:
        slots = frame.canvas_supervised[i].nonzero().flatten()
        clean = frame.canvas_target[i, slots]
        recon = torch.zeros(mc_num, dtype=torch.float64)
        rate = torch.zeros(mc_num, dtype=torch.float64)
        weight = levels.to(torch.float64) * math.log(1.0 / self.t_min)  # 1 / density of log-uniform t
        for k in range(2 * mc_num):
            for start in range(0, slots.numel(), SLOT_CHUNK):
                part = slots[start : start + SLOT_CHUNK]
                x = clean[start : start + SLOT_CHUNK]
                log_probs = softcapped_logits(self.model, hidden[k, part]).double().log_softmax(-1)
                if k < mc_num:
                    recon[k] += log_probs.gather(1, x[:, None]).sum().cpu()
                    continue
                probs = log_probs.exp()
                s = k - mc_num
                t = levels[s, part.cpu()].to(torch.float64).to(probs.device)
                terms = score_entropy_rate(probs, canvases[k, part], x, t, self.vocab_size)
                rate[s] += (terms.cpu() * weight[s, part.cpu()]).sum()
        mean, stderr = summarize(recon - rate)
        greedy_logits = softcapped_logits(self.model, hidden[2 * mc_num, slots])
        greedy = bool((greedy_logits.argmax(-1) == clean).all())
        return BoundEstimate(mean, stderr, greedy)


def _repeat_frame(frame: CanvasFrame, n: int) -> CanvasFrame:
    """Each batch row of ``frame`` repeated ``n`` times in a row (the samples of a request share its geometry)."""
    batch = frame.clean_ids.shape[0]
    fields = {}
    for field in dataclasses.fields(frame):
        value = getattr(frame, field.name)
        if torch.is_tensor(value) and value.dim() >= 2 and value.shape[0] == batch:
            value = value.repeat_interleave(n, dim=0)
        fields[field.name] = value
    for name in ("clean_rows", "canvas_rows"):
        rows = getattr(frame, name)
        fields[name] = dataclasses.replace(rows, doc=None if rows.doc is None else rows.doc.repeat_interleave(n, 0))
    return CanvasFrame(**fields)
