"""What lm-eval's ``loglikelihood`` needs from a family (its evaluation role,
:class:`hf_bdlm.protocols.roles.EvaluationSpec`): a seeded Monte-Carlo estimate of the family's likelihood bound."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass(frozen=True)
class ScoreRequest:
    """One likelihood request in tokens: score ``continuation`` given ``context`` (at least one token each)."""

    context: tuple[int, ...]
    continuation: tuple[int, ...]


@dataclass(frozen=True)
class BoundEstimate:
    """A Monte-Carlo estimate of a likelihood bound.

    Attributes:
        log_likelihood (`float`): the mean of the per-sample estimates of the bound on ``log p(continuation |
            context)`` (nats).
        stderr (`float`): its standard error (``nan`` with a single sample).
        greedy (`bool`): whether one parallel denoising step from the prior (every continuation token at the noise's
            end state) predicts the whole continuation by argmax.
    """

    log_likelihood: float
    stderr: float
    greedy: bool


class LikelihoodScorer:
    """What lm-eval's ``loglikelihood`` needs from a family: a seeded Monte-Carlo estimate of its likelihood bound.

    ``score`` draws every random number as a pure function of ``(seed, request tokens, sample, position)``
    (:mod:`hf_bdlm.objectives.likelihood`), so a request scores the same alone, in any batch and in any run.

    Attributes:
        bound (`str`): what is estimated, in words (logged with the scores).
    """

    bound: str = ""

    def score(self, requests: Sequence[ScoreRequest], *, mc_num: int, seed: int, batch_size: int,
              on_batch: Callable[[int], None] | None = None) -> list[BoundEstimate]:
        """One estimate per request, ``mc_num`` samples each, ``batch_size`` requests per forward pass; ``on_batch``
        is called after each forward pass with the number of requests it scored (a progress bar)."""
        raise NotImplementedError


__all__ = ["BoundEstimate", "LikelihoodScorer", "ScoreRequest"]
