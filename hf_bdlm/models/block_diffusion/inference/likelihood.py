"""The likelihood of a converted block-diffusion LM: a seeded Monte-Carlo estimate of its absorbing-noise bound.

The model decodes a continuation block by block, each block denoised from ``[MASK]`` over the clean K/V of the blocks
before it. Its bound on ``log p(continuation | context)`` is the sum over the continuation's blocks of the
masked-diffusion bound of the block given the clean prefix (:func:`hf_bdlm.objectives.likelihood.absorbing_draws`):
in a block, the context's tokens stay as they are, ``l`` of the continuation's ``n`` tokens are ``[MASK]`` (``l``
uniform on ``1..n``) and their log-probabilities are weighted ``n / l``; positions past the continuation in its last
block stay ``[MASK]`` (unknown, as when decoding) and are not scored. Each masked token is predicted as ``generate``
predicts it: by its own noisy row, or with a token shift (``fast_dllm_v2`` objectives) by the row before it, a
block's first token by the clean row before the block; the ``[MASK]`` logit is left out of the softmax.

One request costs one clean pass over the blocks before its last one (once, cached) and one pass of ``mc_num + 1``
rows over its continuation's blocks: the ``mc_num`` samples and a row with every continuation token masked, whose
argmax decides ``greedy``. Requests are batched only with requests of the same block geometry (first and last
block of the continuation), so no row is ever padded and a request's numbers do not depend on its batch.

    from hf_bdlm.models import family_named
    scorer = family_named("block_diffusion").role("evaluation").likelihood_scorer(model, tokenizer)
    [estimate] = scorer.score([ScoreRequest((1, 2, 3), (4, 5))], mc_num=32, seed=0, batch_size=8)
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from transformers import DynamicCache

from ....attention import CLEAN, NOISY, LocalLayout, RowMeta
from ....attention.rows import stream_rows
from ..generation import as_block_diffusion_config, resolve_settings
from ....objectives.likelihood import absorbing_draws, request_key, summarize
from ....protocols.likelihood import BoundEstimate, LikelihoodScorer, ScoreRequest

logger = logging.getLogger(__name__)

LOGIT_CHUNK = 512  # target rows per LM-head call: [chunk, vocab] float32 logits at a time


@dataclass(frozen=True)
class _Geometry:
    """The blocks a request's bound touches: the clean prefix ``[0, last)``, the noisy blocks ``[first, last + B)``."""

    first: int
    last: int


class BlockDiffusionLikelihoodScorer(LikelihoodScorer):
    """Scores a [`BlockDiffusionForMaskedLM`] (module docstring). ``tokenizer`` is unused (requests are tokens)."""

    bound = "absorbing-noise block-diffusion ELBO (masked tokens weighted n/l per block)"

    def __init__(self, model, tokenizer=None):
        self.model = model.eval()
        config = as_block_diffusion_config(getattr(model, "generation_config", None))
        config.block_size = None  # the bound is the trained model's: its own block size, whatever decoding uses
        settings = resolve_settings(model, config, prompt_len=1)
        self.block_size = settings.block_size
        self.mask_token_id = settings.mask_token_id
        self.token_shift = settings.token_shift
        self.rule, self.backend = settings.rule, settings.backend
        self.device = next(model.parameters()).device
        self.context_length = int(getattr(model.config.backbone_config, "max_position_embeddings", 0) or 1 << 30)

    def score(self, requests: Sequence[ScoreRequest], *, mc_num: int, seed: int, batch_size: int,
              on_batch: Callable[[int], None] | None = None) -> list[BoundEstimate]:
        if mc_num < 1 or batch_size < 1:
            raise ValueError(f"mc_num and batch_size must be positive integers, got {mc_num} and {batch_size}.")
        groups: dict[_Geometry, list[int]] = defaultdict(list)
        for i, request in enumerate(requests):
            groups[self._geometry(request)].append(i)
        results: list[BoundEstimate | None] = [None] * len(requests)
        for geometry, members in groups.items():
            for start in range(0, len(members), batch_size):
                chunk = members[start : start + batch_size]
                with torch.no_grad():
                    estimates = self._score_batch(geometry, [requests[i] for i in chunk], mc_num, seed)
                for i, estimate in zip(chunk, estimates):
                    results[i] = estimate
                if on_batch is not None:
                    on_batch(len(chunk))
        return results

    def _geometry(self, request: ScoreRequest) -> _Geometry:
        if not request.context or not request.continuation:
            raise ValueError(f"a likelihood request needs at least one context and one continuation token, got "
                             f"{len(request.context)} and {len(request.continuation)}.")
        total = len(request.context) + len(request.continuation)
        if total > self.context_length:
            raise ValueError(f"a request of {total} tokens exceeds the model's context of {self.context_length}; "
                             "shorten the task's contexts (or its few-shot examples).")
        B = self.block_size
        return _Geometry(first=len(request.context) // B * B, last=(total - 1) // B * B)

    def _score_batch(self, geometry: _Geometry, requests: list[ScoreRequest], mc_num: int, seed: int
                     ) -> list[BoundEstimate]:
        B, device = self.block_size, self.device
        rows_per_request = mc_num + 1
        first, last = geometry.first, geometry.last
        # The clean prefix (every block before the last one), once per request.
        cache, clean_hidden = None, None
        if last:
            ids = torch.tensor([list(r.context + r.continuation)[:last] for r in requests], device=device)
            clean = stream_rows(CLEAN, torch.arange(last, device=device))
            cache = DynamicCache()
            clean_hidden = self._run(ids, clean, clean, cache)
            cache.batch_repeat_interleave(rows_per_request)
        # The noisy blocks: mc_num samples, then the all-masked row, per request.
        columns = torch.arange(first, last + B)
        noisy_ids, keys, draws = [], [], []
        for r in requests:
            tokens = torch.tensor(r.context + r.continuation)
            block = torch.full((B + last - first,), self.mask_token_id, dtype=torch.long)
            block[: tokens.numel() - first] = tokens[first:]
            positions = torch.arange(len(r.context), tokens.numel())
            key = request_key(r.context, r.continuation)
            drawn = absorbing_draws(seed, key, mc_num, positions, B)
            masked = torch.cat([drawn.masked, torch.ones(1, positions.numel(), dtype=torch.bool)])
            rows = block.expand(rows_per_request, -1).clone()
            rows[:, positions - first] = torch.where(masked, self.mask_token_id, tokens[positions])
            noisy_ids.append(rows)
            keys.append((positions, tokens[positions], masked, drawn.weight))
        noisy = stream_rows(NOISY, columns.to(device))
        k_rows = noisy if cache is None else RowMeta.cat([stream_rows(CLEAN, torch.arange(last, device=device)),
                                                           noisy])
        hidden = self._run(torch.cat(noisy_ids).to(device), noisy, k_rows, cache)
        return [self._estimate(hidden[i * rows_per_request : (i + 1) * rows_per_request],
                               None if clean_hidden is None else clean_hidden[i], first, *keys[i])
                for i in range(len(requests))]

    def _run(self, ids: torch.Tensor, q_rows: RowMeta, k_rows: RowMeta, cache) -> torch.Tensor:
        positions = q_rows.pos[None].expand(ids.shape[0], -1)
        out = self.model(input_ids=ids, position_ids=positions, bdlm_layout=LocalLayout(q_rows, k_rows, self.rule,
                         self.backend), past_key_values=cache, use_cache=cache is not None, return_logits=False)
        return out.hidden_states

    def _estimate(self, hidden, clean_hidden, first, positions, targets, masked, weight) -> BoundEstimate:
        """``hidden [mc_num + 1, columns, h]``: one request's noisy rows; the last row has every target masked."""
        row, target = masked.nonzero(as_tuple=True)
        column = positions[target] - first
        if self.token_shift:
            # Position j is predicted by row j - 1; a block's first position by the clean row before the block.
            at_start = positions[target] % self.block_size == 0
            source = hidden[row, (column - 1).clamp(min=0).to(hidden.device)]
            if bool(at_start.any()):
                source[at_start.to(hidden.device)] = clean_hidden[positions[target][at_start] - 1]
        else:
            source = hidden[row, column.to(hidden.device)]
        log_probs, argmax = self._log_probs(source, targets[target].to(hidden.device))
        samples = masked.shape[0] - 1
        per_sample = torch.zeros(samples, dtype=torch.float64)
        scored = row < samples
        per_sample.index_add_(0, row[scored], log_probs[scored.to(log_probs.device)].cpu().double()
                              * weight[row[scored], target[scored]])
        mean, stderr = summarize(per_sample)
        greedy = bool((argmax[~scored.to(argmax.device)].cpu() == targets[target[~scored]]).all())
        return BoundEstimate(mean, stderr, greedy)

    def _log_probs(self, hidden: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probability of ``tokens`` and the argmax token of each row of ``hidden``, [MASK] left out."""
        log_probs, argmax = [], []
        for start in range(0, hidden.shape[0], LOGIT_CHUNK):
            logits = self.model.lm_logits(hidden[start : start + LOGIT_CHUNK])
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
            logits[:, self.mask_token_id] = -torch.inf  # [MASK] is never a prediction (as in generate)
            normalized = logits.log_softmax(-1)
            log_probs.append(normalized.gather(1, tokens[start : start + LOGIT_CHUNK, None])[:, 0])
            argmax.append(normalized.argmax(-1))
        return torch.cat(log_probs), torch.cat(argmax)
