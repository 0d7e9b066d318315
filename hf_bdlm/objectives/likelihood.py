"""Monte-Carlo estimates of a diffusion LM's likelihood bound: seeded draws per request, absorbing-noise masks.

A diffusion LM gives ``log p(continuation | context)`` only through a bound (the ELBO of its noising process), which
is estimated by Monte Carlo: ``mc_num`` noised copies of the continuation, each scored by the model. Every draw here
is ``hash_uniform(seed, sample, request_key, position, salt)`` (:mod:`hf_bdlm.objectives.noise`): a pure function of
the seed, the request's tokens, the sample index and the position. A request gets the same noise alone or in any
batch, in any order and in any run, so its score is reproducible bit for bit wherever the model's arithmetic is.
(:func:`sample_uniform` computes a whole ``[samples, positions]`` table of them in one pass.)

- :func:`request_key`: the 64-bit key of a request (its tokens), the ``sample`` argument of every draw;
- :func:`stratified_levels`: one noise level per (sample, block), the ``mc_num`` samples of a block spread over
  ``mc_num`` strata of ``[0, 1)`` (lower variance, each level still uniform);
- :func:`absorbing_draws`: which continuation tokens a sample masks and their weights, for absorbing ``[MASK]``
  noise (the bound of LLaDA's evaluation, per block: ``l`` of the block's ``n`` tokens masked, ``l`` uniform on
  ``1..n``, weight ``n / l``);
- :func:`summarize`: the mean of the per-sample estimates and its standard error.

    import torch
    from hf_bdlm.objectives.likelihood import absorbing_draws, request_key
    key = request_key([1, 2, 3], [4, 5, 6, 7])
    draws = absorbing_draws(seed=0, key=key, num_samples=8, positions=torch.arange(3, 7), block_size=4)
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from .noise import hash_uniform

# Salts of the likelihood draws (distinct from the training draws of noise.py and the objectives).
SALT_LEVEL_OFFSET = 0x11CE_0001
SALT_LEVEL = 0x11CE_0002
SALT_MASK_ORDER = 0x11CE_0003


def request_key(context: Sequence[int], continuation: Sequence[int]) -> int:
    """A signed 64-bit key of a request's tokens (BLAKE2b): equal requests share their noise, others do not."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(len(context).to_bytes(8, "little"))
    for token in (*context, *continuation):
        digest.update(int(token).to_bytes(8, "little", signed=True))
    return int.from_bytes(digest.digest(), "little", signed=True)


def sample_uniform(seed: int, key: int, samples: torch.Tensor, positions: torch.Tensor, salt: int) -> torch.Tensor:
    """``[len(samples), len(positions)]`` uniforms in ``[0, 1)``, entry ``(k, i)`` a pure function of ``(seed, key,
    samples[k], positions[i], salt)``: ``hash_uniform`` keyed by the request and by the sample and position packed
    in one 64-bit word (positions below ``2**32``)."""
    packed = (samples.to(torch.int64)[:, None] << 32) | positions.to(torch.int64)[None, :]
    return hash_uniform(seed, 0, torch.tensor(key, dtype=torch.int64), packed, salt)


def stratified_levels(seed: int, key: int, num_samples: int, block_ids: torch.Tensor) -> torch.Tensor:
    """Levels ``u`` in ``[0, 1)``, ``[num_samples, len(block_ids)]``: for every block, sample ``k`` draws inside
    stratum ``(k + s) mod M`` of ``M = num_samples`` equal strata, ``s`` a random offset of the (request, block).

    Each level is marginally uniform on ``[0, 1)`` (the offset is uniform), and a block's ``M`` levels cover the ``M``
    strata once, so the mean of the samples' estimates is an unbiased estimate of the bound with less variance than
    independent draws. ``block_ids`` are stable ids of the blocks (e.g. their first position).
    """
    blocks = block_ids.to(torch.int64).cpu()
    offset = (hash_uniform(seed, 0, torch.tensor(key), blocks, SALT_LEVEL_OFFSET) * num_samples).floor().long()
    offset = offset.clamp(max=num_samples - 1)
    k = torch.arange(num_samples)
    jitter = sample_uniform(seed, key, k, blocks, SALT_LEVEL)
    return (((k[:, None] + offset[None, :]) % num_samples).to(torch.float64) + jitter) / num_samples


@dataclass(frozen=True)
class AbsorbingDraws:
    """Which continuation tokens each sample masks, and the weight of a masked token's log-probability.

    Args:
        masked (`torch.BoolTensor` of shape `[num_samples, n]`): token ``i`` is ``[MASK]`` in sample ``k``.
        weight (`torch.DoubleTensor` of shape `[num_samples, n]`): ``n_b / l`` on masked tokens (``n_b`` tokens of
            its block in the continuation, ``l`` of them masked), 0 elsewhere.
    """

    masked: torch.Tensor
    weight: torch.Tensor


def absorbing_draws(seed: int, key: int, num_samples: int, positions: torch.Tensor, block_size: int
                    ) -> AbsorbingDraws:
    """The masks of ``num_samples`` Monte-Carlo samples of the absorbing-noise bound of a continuation.

    Per block, the continuation's ``n`` tokens in it are masked ``l`` at a time, ``l = 1 + floor(u n)`` with ``u``
    from :func:`stratified_levels` (so ``l`` is uniform on ``1..n``), the ``l`` tokens with the smallest draws
    ``sample_uniform(seed, key, k, position, SALT_MASK_ORDER)`` (a uniformly random subset); each masked token's
    log-probability is weighted ``n / l``. Summed over the blocks, the weighted log-probabilities of one sample are
    an unbiased estimate of the bound

        log p(x | context) >= sum over blocks  E_l E_S [ (n / l) sum_{i in S} log p(x_i | x without S) ],

    which is the lower-variance form of LLaDA's conditional bound (arXiv 2502.09992, the estimator its evaluation
    uses: ``l`` uniform, weight ``n / l``) applied block by block, each block given the clean blocks before it, as
    block diffusion decodes.

    Args:
        positions (`torch.LongTensor` of shape `[n]`): sequence positions of the continuation's tokens.
        block_size (`int`): the model's block size (blocks are ``position // block_size``).
    """
    positions = positions.to(torch.int64).cpu()
    blocks = positions // block_size
    block_ids, local = torch.unique(blocks, return_inverse=True)
    levels = stratified_levels(seed, key, num_samples, block_ids)  # [M, J]
    order = sample_uniform(seed, key, torch.arange(num_samples), positions, SALT_MASK_ORDER)  # [M, n]
    masked = torch.zeros(num_samples, positions.numel(), dtype=torch.bool)
    weight = torch.zeros(num_samples, positions.numel(), dtype=torch.float64)
    for j in range(block_ids.numel()):
        idx = (local == j).nonzero().flatten()
        n = idx.numel()
        count = (1 + (levels[:, j] * n).floor().long()).clamp(max=n)  # [M], uniform on 1..n
        rank = order[:, idx].argsort(dim=1).argsort(dim=1)
        chosen = rank < count[:, None]
        masked[:, idx] = chosen
        weight[:, idx] = chosen.to(torch.float64) * (n / count.to(torch.float64))[:, None]
    return AbsorbingDraws(masked, weight)


def summarize(per_sample: torch.Tensor) -> tuple[float, float]:
    """``(mean, standard error)`` of a request's per-sample estimates ``[num_samples]`` (float64).

    The standard error is the sample standard deviation over ``sqrt(num_samples)``: the error of independent
    samples, an upper bound for stratified ones. One sample has no error estimate: ``nan``.
    """
    per_sample = per_sample.to(torch.float64)
    mean = float(per_sample.mean())
    if per_sample.numel() < 2:
        return mean, math.nan
    return mean, float(per_sample.std(unbiased=True) / math.sqrt(per_sample.numel()))
