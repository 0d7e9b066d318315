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
(``tests/evaluation/test_lm_eval.py`` integrates it for a small vocabulary). ``t_min`` is the lowest level training
draws (``noise_eps_min``, 1e-4); below it the integrand of a model that doubts clean tokens grows like ``1 / t``.

Estimated per canvas block with ``mc_num`` samples: a reconstruction canvas at ``t_min`` and a canvas at ``t``
drawn log-uniformly on ``[t_min, 1)`` (weight ``t log(1 / t_min)``), stratified over the samples
(:func:`hf_bdlm.objectives.likelihood.stratified_levels`). Positions of the last canvas past the continuation hold
uniform tokens at every level (the noise's end state: unknown, as when decoding) and are not scored. One more canvas,
every continuation token uniform noise, decides ``greedy`` by argmax. Each request is one forward of its own (its
``2 mc_num + 1`` canvases): the MoE layers group a batch's tokens by expert, and a row's numbers would then depend on
the other requests of its batch (measured: 5e-8 on the CPU kernels), so a score would change with the batch size.

    scorer = family_named("diffusion_gemma").role("evaluation").likelihood_scorer(model, tokenizer)
    [estimate] = scorer.score([ScoreRequest((2, 9, 10), (11, 12))], mc_num=32, seed=0, batch_size=8)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import torch

from ....objectives.likelihood import request_key, sample_uniform, stratified_levels, summarize
from ....protocols.likelihood import BoundEstimate, LikelihoodScorer, ScoreRequest
from ..modeling import (
    CanvasFrame,
    DiffusionGemmaLayout,
    build_canvas_frame,
    decode,
    encode,
    softcapped_logits,
    unwrap_diffusion_gemma,
)
from ..configuration import DEFAULT_NOISE_EPS

SALT_RECON_REPLACE = 0x11CE_D601
SALT_REPLACE = 0x11CE_D602
SALT_TOKEN = 0x11CE_D603
SALT_TAIL = 0x11CE_D604
PAIR_CHUNK = 64  # (canvas, slot) pairs per [pairs, vocab] float64 block of the bound's terms
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

    def __init__(self, model, tokenizer=None, t_min: float = DEFAULT_NOISE_EPS, attention_backend: str = "auto"):
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

    def score(self, requests: Sequence[ScoreRequest], *, mc_num: int, seed: int, batch_size: int,
              on_batch: Callable[[int], None] | None = None) -> list[BoundEstimate]:
        """One forward per request, its ``2 mc_num + 1`` canvases together; ``batch_size`` is not used (module
        docstring: the MoE layers would round a request's rows differently in a batch of other requests)."""
        if mc_num < 1 or batch_size < 1:
            raise ValueError(f"mc_num and batch_size must be positive integers, got {mc_num} and {batch_size}.")
        estimates = []
        with torch.no_grad():
            for request in requests:
                estimates += self._score_batch([request], mc_num, seed)
                if on_batch is not None:
                    on_batch(1)
        return estimates

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
                               canvases[i], levels[i], mc_num)
                for i in range(len(requests))]

    def _canvases(self, frame: CanvasFrame, i: int, request: ScoreRequest, mc_num: int, seed: int):
        """Request ``i``'s canvases ``[2 mc_num + 1, Nc]`` (reconstruction, diffusion, all-noise) and the diffusion
        canvases' slot levels ``[mc_num, Nc]``."""
        key = request_key(request.context, request.continuation)
        position = frame.canvas_source[i].cpu().clamp(min=0)
        target = frame.canvas_target[i].cpu()
        continuation = frame.canvas_supervised[i].cpu()
        blocks, slot_block = torch.unique(frame.canvas_block_source[i].cpu(), return_inverse=True)
        u = stratified_levels(seed, key, mc_num, blocks)  # [M, blocks]
        levels = self.t_min ** (1.0 - u[:, slot_block])  # log-uniform on [t_min, 1), per slot of its block
        # Row r of every table: samples 0..M-1 (reconstruction, then diffusion: the same draws, other levels), M.
        samples = torch.cat([torch.arange(mc_num), torch.arange(mc_num), torch.tensor([mc_num])])
        t = torch.cat([torch.full_like(levels, self.t_min), levels, torch.ones_like(levels[:1])])
        salt = torch.cat([torch.full((mc_num, 1), SALT_RECON_REPLACE), torch.full((mc_num + 1, 1), SALT_REPLACE)])
        replace = torch.where(salt == SALT_RECON_REPLACE,
                              sample_uniform(seed, key, samples, position, SALT_RECON_REPLACE),
                              sample_uniform(seed, key, samples, position, SALT_REPLACE)) < t
        drawn = (sample_uniform(seed, key, samples, position, SALT_TOKEN) * self.vocab_size).long()
        tail = (sample_uniform(seed, key, samples, position, SALT_TAIL) * self.vocab_size).long()
        canvases = torch.where(replace, drawn, target).clamp(max=self.vocab_size - 1)
        canvases = torch.where(continuation, canvases, tail.clamp(max=self.vocab_size - 1))
        return canvases, levels

    def _estimate(self, frame: CanvasFrame, i: int, hidden: torch.Tensor, canvases: torch.Tensor,
                  levels: torch.Tensor, mc_num: int) -> BoundEstimate:
        """``hidden [2 mc_num + 1, Nc, h]``: the decoder over request ``i``'s canvases."""
        slots = frame.canvas_supervised[i].nonzero().flatten()
        clean = frame.canvas_target[i, slots]
        n = slots.numel()
        log_t_min = math.log(1.0 / self.t_min)
        per_row = torch.zeros(2 * mc_num, dtype=torch.float64)
        # Every (canvas, continuation slot) pair, a chunk of pairs at a time ([pairs, vocab] float64 at most).
        rows = torch.arange(2 * mc_num).repeat_interleave(n)
        cols = slots.cpu().repeat(2 * mc_num)
        targets = clean.cpu().repeat(2 * mc_num)
        for start in range(0, rows.numel(), PAIR_CHUNK):
            r, c, x = (v[start : start + PAIR_CHUNK] for v in (rows, cols, targets))
            device_c, device_x = c.to(hidden.device), x.to(hidden.device)
            log_probs = softcapped_logits(self.model, hidden[r.to(hidden.device), device_c]).double().log_softmax(-1)
            value = torch.zeros(r.numel(), dtype=torch.float64)
            recon = r < mc_num
            if bool(recon.any()):
                value[recon] = log_probs[recon.to(hidden.device)].gather(1, device_x[recon.to(hidden.device), None])[
                    :, 0].cpu()
            diffusion = ~recon
            if bool(diffusion.any()):
                d = diffusion.to(hidden.device)
                t = levels[r[diffusion] - mc_num, c[diffusion]].to(torch.float64)
                terms = score_entropy_rate(log_probs[d].exp(), canvases[r[diffusion], c[diffusion]].to(hidden.device),
                                           device_x[d], t.to(hidden.device), self.vocab_size).cpu()
                value[diffusion] = -terms * t * log_t_min  # weight: 1 / density of the log-uniform level
            per_row.index_add_(0, r, value)
        mean, stderr = summarize(per_row[:mc_num] + per_row[mc_num:])
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
