"""Layout-invariant noise: a counter-based hash RNG and the per-block masking rates built on it.

Every random number an objective draws is ``hash_uniform(seed, step, sample, position, salt)``:
a pure function of its arguments, computed with int64 tensor arithmetic that never overflows.
So the noise of a token does not depend on the batch layout, the number of ranks or the rank,
nor on the device (integer ops are exact everywhere), and a slice of the values equals the
values of the slice. Nothing here keeps generator state.

    python -c "import torch; from hf_bdlm.objectives.noise import hash_uniform; \\
print(hash_uniform(0, 0, torch.arange(2)[:, None], torch.arange(4), salt=1))"
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF
_GOLDEN32 = 0x9E3779B9  # keeps zero inputs from hashing to zero

# Salts of the draws the objectives make (any distinct constants; they separate the streams).
SALT_BLOCK_T = 0x5EED_0001
SALT_TOKEN_MASK = 0x5EED_0002
SALT_BLOCK_JITTER = 0x5EED_0003
SALT_TOKEN_REDRAW = 0x5EED_1000_0000  # + round: the token draws of a block redrawn by BD3-LM's clipped resampling


def _mul32(x, c: int):
    """``(x * c) mod 2**32`` for ``x < 2**32``, split in 16-bit halves so no product reaches 2**49.

    A plain ``x * c`` with a 32-bit ``c`` can exceed 2**63 and overflow int64 (undefined in C++,
    and not guaranteed to wrap identically on every backend).
    """
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _fmix32(x):
    """MurmurHash3's 32-bit finaliser (full avalanche); works on Python ints and int64 tensors."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def _absorb(h, value):
    """Mix a 64-bit ``value`` (its two 32-bit words, low first) into the 32-bit state ``h``."""
    if isinstance(value, int):
        value &= _M64  # Python ints: take the two's-complement 64-bit word, as int64 tensors hold
    h = _fmix32(((h ^ (value & _M32)) + _GOLDEN32) & _M32)
    # `>>` on a negative int64 is arithmetic; the mask keeps exactly bits 32..63.
    return _fmix32(((h ^ ((value >> 32) & _M32)) + _GOLDEN32) & _M32)


def hash_uniform(seed: int, step: int, sample: torch.Tensor, position: torch.Tensor, salt: int) -> torch.Tensor:
    """Uniform numbers in ``[0, 1)`` as a pure function of ``(seed, step, sample, position, salt)``.

    Args:
        seed (`int`), step (`int`), salt (`int`):
            Scalars (any Python ints; reduced to 64 bits).
        sample (`torch.LongTensor`), position (`torch.LongTensor`):
            Global sample ids and global positions; broadcast against each other.

    Returns:
        `torch.DoubleTensor` of the broadcast shape, on the inputs' device. Each value carries 53
        random bits (exact in float64), so it is identical on every device and under any slicing.
    """
    sample = torch.as_tensor(sample, dtype=torch.int64)
    position = torch.as_tensor(position, dtype=torch.int64, device=sample.device)
    # The scalar prefix is hashed once in Python; only the per-element words touch tensors.
    h = _absorb(_absorb(_absorb(_GOLDEN32, salt), seed), step)
    h = _absorb(_absorb(torch.full_like(sample, h), sample), position)
    high = _fmix32(h) >> 5  # 27 bits
    low = _fmix32(h ^ 0x68E31DA4) >> 6  # 26 independent bits from a second finalisation
    bits = (high << 26) | low  # < 2**53: exactly representable in float64
    return bits.to(torch.float64) * (2.0**-53)


def _to_range(u: torch.Tensor, eps_min: float, eps_max: float) -> torch.Tensor:
    return eps_min + (eps_max - eps_min) * u


def stratified_block_t(
    seed: int,
    step: int,
    sample_ids: torch.Tensor,
    blocks_per_sample: torch.Tensor,
    num_blocks: int,
    eps_min: float,
    eps_max: float,
) -> torch.Tensor:
    """Per-sample stratified masking rates, one per (sample, block): BD3-LM's antithetic sampling, per sample.

    BD3-LM (``_sample_t`` with ``antithetic_sampling``) cuts ``[0, 1)`` into one stratum per (sample, block) of the
    *batch* and draws an independent uniform inside each. Here the strata are those of one sample, so the rates do
    not depend on the batch (layout invariance): a sample with ``n`` blocks cuts ``[0, 1)`` into ``n`` strata and
    block ``j`` takes stratum ``(j + s) mod n`` at an independent position ``v_j`` inside it,

        u_j = ((j + s) mod n + v_j) / n,   s = floor(n * r),

    with ``r = hash_uniform(seed, step, sample, 0, SALT_BLOCK_T)`` and ``v_j = hash_uniform(seed, step, sample, j,
    SALT_BLOCK_JITTER)``, then ``t_j = eps_min + (eps_max - eps_min) * u_j``. The sample's first ``n`` blocks cover
    the ``n`` strata exactly once (lower variance), and the random offset ``s`` makes every block's rate marginally
    uniform on ``[eps_min, eps_max]`` (BD3-LM's fixed assignment gives block ``j`` of a lone sample the ``j``-th
    stratum), so the loss stays an unbiased estimate of the ELBO (``tests/attention/test_reference_semantics.py``).

    ``n`` is the sample's own block count (``blocks_per_sample [b]``, from its non-pad extent), not the padded batch
    length, so the rates do not change when a sample is batched with longer ones. Blocks ``j >= n`` (padding) get
    a rate as well; they hold no supervised token.

    Returns:
        `torch.DoubleTensor` of shape ``[b, num_blocks]``.
    """
    device = sample_ids.device
    n = blocks_per_sample.clamp(min=1).to(torch.long)[:, None]
    r = hash_uniform(seed, step, sample_ids[:, None], torch.zeros(1, dtype=torch.int64, device=device), SALT_BLOCK_T)
    offset = torch.minimum((r * n).floor().to(torch.long), n - 1)  # r * n < n up to rounding
    j = torch.arange(num_blocks, device=device)
    v = hash_uniform(seed, step, sample_ids[:, None], j[None, :], SALT_BLOCK_JITTER)
    # Each op is one IEEE-rounded kernel (no fused multiply-add), so every device agrees.
    u = (((j[None, :] + offset) % n).to(torch.float64) + v) / n.to(torch.float64)
    return _to_range(u, eps_min, eps_max)


def independent_block_t(
    seed: int, step: int, sample_ids: torch.Tensor, num_blocks: int, eps_min: float, eps_max: float
) -> torch.Tensor:
    """Independent masking rates, one per (sample, block), uniform on ``[eps_min, eps_max]``.

    Fast-dLLM v2's draw (``t = torch.rand(blocks)``, ``p = (1 - eps) * t + eps``), keyed by
    ``hash_uniform(seed, step, sample, block, SALT_BLOCK_T)``. Returns `torch.DoubleTensor` ``[b, num_blocks]``.
    """
    j = torch.arange(num_blocks, device=sample_ids.device)
    return _to_range(hash_uniform(seed, step, sample_ids[:, None], j[None, :], SALT_BLOCK_T), eps_min, eps_max)


def token_uniform(seed: int, step: int, sample: torch.Tensor, position: torch.Tensor, redraw: int = 0) -> torch.Tensor:
    """The per-token masking draw (``redraw > 0``: the ``redraw``-th fresh draw of a resampled block)."""
    salt = SALT_TOKEN_MASK if redraw == 0 else SALT_TOKEN_REDRAW + redraw
    return hash_uniform(seed, step, sample, position, salt)
