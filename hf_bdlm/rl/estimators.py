"""The log-probability estimators of a block-diffusion policy: the per-token arithmetic and the seeded draws they share.

An autoregressive policy gives every completion token's log-probability in one forward. A diffusion LM gives none
exactly: a token's probability depends on what else is masked when it is predicted. GRPO needs one number per
completion token, ``log pi(token)``, with gradients; each estimator (``logp_estimator``) names which prediction of the
token that number is:

- ``trace``: the prediction that committed it during decoding (the decoding step, the block as it was at that step,
  the clean blocks before it), recomputed with gradients from the rollout's trace. Exact for the policy that
  sampled: the decoder's own sampling log-probability, not an estimate.
- ``coupled``: two forwards with complementary masks over the completion (prompt clean); each token is scored by the
  forward in which it is masked, so every token is scored exactly once.
- ``one_step``: one forward with the completion fully masked and the prompt randomly masked (d1's estimate).

This module holds what every family's implementation shares: :func:`token_log_probs` (the distribution a token is
scored under: the model's logits over temperature, ``[MASK]`` left out where the decoder leaves it out; the decoder's
trace records its sampled tokens with the same function) and the seeded draws of ``coupled`` and ``one_step``
(:func:`coupled_masks`, :func:`prompt_masks`): pure functions of the run's seed, the generation round, the iteration,
the sample's tokens and the position, so the old, reference and current log-probabilities of one iteration see the
same masks, and a sample gets them alone or in any batch.
"""

from __future__ import annotations

import hashlib
import math

import torch

from ..objectives.likelihood import absorbing_draws, request_key
from ..objectives.noise import hash_uniform
from ..protocols.policy import LOGP_ESTIMATORS

SALT_PROMPT_MASK = 0x6E1D_0001  # one_step's prompt masks (distinct from the training and likelihood draws)
SALT_NOISE_TOKEN = 0x6E1D_0002  # the tokens a uniform-state model's masked positions hold


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0,
                    excluded: int | None = None, entropy: bool = False):
    """``log p(tokens)`` under ``softmax(logits / temperature)`` with token ``excluded`` (the ``[MASK]`` a decoder never
    predicts) left out, in at least float32; and, with ``entropy``, that distribution's entropy.

    Args:
        logits (`torch.Tensor` of shape `[n, vocab]`): one row per scored token.
        tokens (`torch.LongTensor` of shape `[n]`).

    Returns:
        `(log_probs [n], entropies [n] or None)`.
    """
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if excluded is not None:
        logits = logits.index_fill(-1, torch.tensor([excluded], device=logits.device), -math.inf)
    log_probs = (logits / temperature).log_softmax(-1)
    picked = log_probs.gather(-1, tokens[:, None].to(log_probs.device))[:, 0]
    if not entropy:
        return picked, None
    finite = log_probs.masked_fill(torch.isinf(log_probs), 0.0)  # 0 * -inf would be nan
    return picked, -(finite.exp() * finite).sum(-1)


def draw_seed(seed: int, round_: int, iteration: int) -> int:
    """The seed of one iteration's draws: a 63-bit hash of the run's seed, the generation round and the iteration (GRPO
    reuses a round's completions for ``num_iterations`` iterations; each iteration draws masks of its own)."""
    digest = hashlib.blake2b(f"{seed}:{round_}:{iteration}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def sample_key(prompt: list[int], completion: list[int]) -> int:
    """The 64-bit key of a sample's tokens (:func:`hf_bdlm.objectives.likelihood.request_key`): equal samples draw the
    same masks, others do not."""
    return request_key(prompt, completion)


def coupled_masks(seed: int, key: int, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Which completion tokens the first of ``coupled``'s two forwards masks (``[n]`` bool; the second masks the
    others).

    Per block, ``l`` of the completion's ``n`` tokens in it, ``l`` uniform on ``1..n``, a uniformly random subset: the
    absorbing-noise bound's draw (:func:`hf_bdlm.objectives.likelihood.absorbing_draws`, one sample), so that the first
    forward's weighted log-probabilities are exactly one sample of the likelihood estimator, and the second forward
    its complement. ``positions``: the completion tokens' sequence positions (blocks are ``position // block_size``).
    """
    return absorbing_draws(seed, key, 1, positions, block_size).masked[0]


def prompt_masks(seed: int, key: int, positions: torch.Tensor, ratio: float) -> torch.Tensor:
    """``one_step``'s prompt masks: each prompt token at ``positions`` masked with probability ``ratio`` (``[n]``
    bool; d1 masks 15 % of the prompt, a fresh draw per iteration)."""
    return hash_uniform(seed, 0, torch.tensor(key, dtype=torch.int64), positions.to(torch.int64).cpu(),
                        SALT_PROMPT_MASK) < ratio


def noise_tokens(seed: int, key: int, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The tokens a uniform-state diffusion model's "masked" positions hold (it has no ``[MASK]``: its noise's end
    state is a token drawn uniformly from the vocabulary), one per position (``[n]``), seeded as the masks are."""
    u = hash_uniform(seed, 0, torch.tensor(key, dtype=torch.int64), positions.to(torch.int64).cpu(), SALT_NOISE_TOKEN)
    return (u * vocab_size).long().clamp(max=vocab_size - 1)


def check_estimator(name: str, available: tuple[str, ...], who: str, why: str = "") -> None:
    """Refuse an estimator that is not one of :data:`LOGP_ESTIMATORS`, or one ``who`` (a family) does not implement,
    naming the ones it does (``why``: what makes the missing one unavailable)."""
    if name not in LOGP_ESTIMATORS:
        raise ValueError(f"logp_estimator={name!r} is not an estimator; the estimators are {list(LOGP_ESTIMATORS)}.")
    if name not in available:
        raise ValueError(f"logp_estimator={name!r} is not available for {who}{': ' + why if why else ''}; use one of "
                         f"{list(available)}.")


__all__ = ["LOGP_ESTIMATORS", "check_estimator", "coupled_masks", "draw_seed", "noise_tokens", "prompt_masks",
           "sample_key", "token_log_probs"]
