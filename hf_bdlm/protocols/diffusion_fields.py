"""The block-diffusion fields every model config and `BDLMSFTConfig` carry: their option names and the one validator.

Block size, mask token, noise range, loss weighting and attention backend mean the same whichever family a model
belongs to, so `BlockDiffusionConfig`, the objectives and `BDLMSFTConfig` all check them here. This module imports
nothing (the remote code inlines it into ``configuration_block_diffusion.py``)::

    from hf_bdlm.protocols.diffusion_fields import check_diffusion_fields
    check_diffusion_fields(block_size=0)          # ValueError: block_size must be a positive integer, got 0.
"""

from __future__ import annotations

# The option names: ``hf_bdlm.attention.backends`` implements each backend, ``hf_bdlm.attention.masks`` each
# clean-attention kind and window convention, the objectives each loss weighting.
BACKENDS = ("auto", "dense", "blockwise", "flex")
CLEAN_ATTENTION_KINDS = ("block_causal", "causal")
WINDOW_CONVENTIONS = ("per_query", "block_start")
LOSS_WEIGHTINGS = ("inverse_t", "unit")
# Objectives whose row i - 1 predicts token i (generate shifts its logits for them; their weights are unit).
TOKEN_SHIFT_OBJECTIVES = ("fast_dllm_v2", "fast_dllm_v2_causal_clean")


def _is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_diffusion_fields(
    *,
    block_size=None,
    mask_token_id=None,
    vocab_size: int | None = None,
    objective: str | None = None,
    objectives: tuple | None = None,
    noise_eps_min=None,
    noise_eps_max=None,
    loss_weighting=None,
    attention_backend=None,
    zero_noise_ok: bool = False,
) -> None:
    """The one validator of the block-diffusion fields: checks every argument that is not ``None`` (``objective``
    against ``objectives`` when both are given).

    `BlockDiffusionConfig`, the objectives and `BDLMSFTConfig` (whose fields override the model's, so any may be
    unset) all call it, so a value is accepted or refused with the same message wherever it is given.
    """
    if block_size is not None and not _is_positive_int(block_size):
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}.")
    if mask_token_id is not None:
        if not isinstance(mask_token_id, int) or isinstance(mask_token_id, bool) or mask_token_id < 0 or (
            vocab_size is not None and mask_token_id >= vocab_size
        ):
            where = f"the backbone vocabulary of size {vocab_size}" if vocab_size is not None else "the vocabulary"
            raise ValueError(
                f"mask_token_id={mask_token_id!r} is outside {where}; resize the embeddings to include the mask "
                "token first (convert_causal_lm does this)."
            )
    if objective is not None and objectives is not None and objective not in objectives:
        raise ValueError(f"objective must be one of {objectives}, got {objective!r}.")
    zero_ok = zero_noise_ok  # an objective whose noise includes t = 0 (Objective.allows_zero_noise)
    for name, value in (("noise_eps_min", noise_eps_min), ("noise_eps_max", noise_eps_max)):
        if value is None:
            continue
        if zero_ok and not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must lie in [0, 1] for objective={objective!r}, got {value!r}.")
        if not zero_ok and not 0.0 < value <= 1.0:
            raise ValueError(
                f"{name} must lie in (0, 1], got {value!r} (0 is allowed with an objective whose noise includes "
                "t = 0, i.e. uniform-state noise)."
            )
    if noise_eps_min is not None and noise_eps_max is not None and noise_eps_min > noise_eps_max:
        raise ValueError(
            f"need noise_eps_min <= noise_eps_max, got noise_eps_min={noise_eps_min}, noise_eps_max={noise_eps_max}."
        )
    if loss_weighting is not None and loss_weighting not in LOSS_WEIGHTINGS:
        raise ValueError(f"loss_weighting must be one of {LOSS_WEIGHTINGS}, got {loss_weighting!r}.")
    if objective in TOKEN_SHIFT_OBJECTIVES and loss_weighting not in (None, "unit"):
        raise ValueError(
            f"objective={objective!r} uses unit weights (every supervised token is masked in exactly one of two "
            f"complementary views), got loss_weighting={loss_weighting!r}; leave it unset or use 'unit'."
        )
    if attention_backend is not None and attention_backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {attention_backend!r}.")


__all__ = ["BACKENDS", "CLEAN_ATTENTION_KINDS", "LOSS_WEIGHTINGS", "TOKEN_SHIFT_OBJECTIVES", "WINDOW_CONVENTIONS",
           "check_diffusion_fields"]
