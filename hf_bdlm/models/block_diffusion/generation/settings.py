"""The settings of one decoding run (`DecodeSettings`): a generation config resolved against the model (its block
size, mask token, objective and attention rule), with the settings it cannot honour refused."""

from __future__ import annotations

from dataclasses import dataclass

from ....attention import MaskRule
from ....protocols.diffusion_fields import TOKEN_SHIFT_OBJECTIVES
from .config import ENGINE_DEFAULT_THRESHOLDS, BlockDiffusionGenerationConfig


@dataclass(frozen=True)
class DecodeSettings:
    """Everything one decoding run needs, with the model's defaults filled in."""

    block_size: int
    mask_token_id: int
    max_new_tokens: int
    steps_per_block: int | None
    confidence_threshold: float | None
    token_shift: bool
    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    rule: MaskRule
    backend: str
    unmasking: str = "hf_bdlm"
    min_tokens_per_step: int = 1
    sub_block_size: int | None = None
    block_cache: bool = False
    fuse_block_commit: bool = True
    eos_early_exit: bool = True
    compact_batch: bool = True


def resolve_settings(model, config: BlockDiffusionGenerationConfig, prompt_len: int) -> DecodeSettings:
    model_config = model.config
    vocab = model_config.backbone_config.vocab_size
    mask = config.mask_token_id if config.mask_token_id is not None else model_config.mask_token_id
    if mask is None:
        raise ValueError(
            "No mask token id: set generation_config.mask_token_id or model.config.mask_token_id (convert_causal_lm "
            "adds a [MASK] token to a causal LM)."
        )
    if not 0 <= mask < vocab:
        raise ValueError(f"mask_token_id={mask} is outside the model vocabulary of size {vocab}.")
    block = config.block_size or model_config.block_size
    if config.max_new_tokens is not None:
        max_new = config.max_new_tokens
    elif config.max_length is not None:
        max_new = config.max_length - prompt_len
    else:
        max_new = block
    if max_new <= 0:
        raise ValueError(
            f"nothing to generate: max_new_tokens={config.max_new_tokens}, max_length={config.max_length}, "
            f"prompt length {prompt_len}; set max_new_tokens to a positive integer."
        )
    eos = config.eos_token_id
    eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    pad = config.pad_token_id if config.pad_token_id is not None else (eos_ids[0] if eos_ids else None)
    shift = config.token_shift if config.token_shift is not None else model_config.objective in TOKEN_SHIFT_OBJECTIVES
    unmasking = getattr(config, "unmasking", "hf_bdlm")
    threshold = config.confidence_threshold
    if unmasking != "hf_bdlm":
        _check_engine_rule(unmasking, bool(shift), config)
        threshold = ENGINE_DEFAULT_THRESHOLDS[unmasking] if threshold is None else threshold
    sub_block = _check_sub_blocks(block, config)
    return DecodeSettings(
        block_size=block,
        mask_token_id=int(mask),
        max_new_tokens=int(max_new),
        steps_per_block=config.steps_per_block,
        confidence_threshold=threshold,
        token_shift=bool(shift),
        # Unset sampling knobs take transformers' defaults (temperature 1, top_k 50, top_p 1).
        do_sample=bool(config.do_sample),
        temperature=1.0 if config.temperature is None else float(config.temperature),
        top_k=50 if config.top_k is None else config.top_k,
        top_p=1.0 if config.top_p is None else float(config.top_p),
        eos_token_ids=eos_ids,
        pad_token_id=pad,
        rule=model.mask_rule(block),  # the training rule, sliding-window convention included
        backend=model_config.attention_backend,
        unmasking=unmasking,
        min_tokens_per_step=int(getattr(config, "min_tokens_per_step", 1)),
        sub_block_size=sub_block,
        block_cache=bool(getattr(config, "block_cache", False)),
        fuse_block_commit=bool(getattr(config, "fuse_block_commit", True)),
        eos_early_exit=bool(getattr(config, "eos_early_exit", True)),
        compact_batch=bool(getattr(config, "compact_batch", True)),
    )


def _check_sub_blocks(block: int, config: BlockDiffusionGenerationConfig) -> int | None:
    """The sub-block size of a decoding run (``None``: the whole block), refusing settings it cannot honour."""
    sub = getattr(config, "sub_block_size", None)
    if sub is not None and block % sub:
        raise ValueError(f"sub_block_size={sub} does not divide the block size {block}; pick a divisor of it "
                         "(e.g. block_size // 4).")
    if sub is not None and config.steps_per_block is not None:
        raise ValueError(f"steps_per_block={config.steps_per_block} fixes the steps of a whole block and "
                         f"sub_block_size={sub} decodes it sub-block by sub-block; set one of them (with sub-blocks, "
                         "confidence_threshold and min_tokens_per_step set how many positions a step fixes).")
    if getattr(config, "block_cache", False) and (sub is None or sub >= block):
        raise ValueError(f"block_cache=True keeps a block's K/V across the steps of a sub-block, so it needs a "
                         f"sub_block_size smaller than the block ({block}), got {sub}.")
    return sub if sub is not None and sub < block else None


def _check_engine_rule(unmasking: str, token_shift: bool, config: BlockDiffusionGenerationConfig) -> None:
    """Refuse settings an engine's unmasking rule has no counterpart for (they would not decode what it serves)."""
    if token_shift:
        raise ValueError(
            f"unmasking={unmasking!r} decodes without token shift (the logit at position i predicts token i, as the "
            "engines serve SDAR models), but this model predicts the next token (a fast_dllm_v2 objective, or "
            "token_shift=True): use unmasking='hf_bdlm', or a model trained with objective='standard'."
        )
    if config.steps_per_block is not None:
        raise ValueError(f"unmasking={unmasking!r} has no fixed number of steps per block; leave steps_per_block "
                         f"unset (got {config.steps_per_block}).")
    for name, plain in (("sub_block_size", None), ("block_cache", False), ("min_tokens_per_step", 1)):
        if getattr(config, name, plain) != plain:
            raise ValueError(f"unmasking={unmasking!r} decodes as the engine serves, which has no {name}; leave it "
                             f"at {plain} (got {getattr(config, name)!r}).")
    if unmasking == "sglang_low_confidence" and config.do_sample:
        raise ValueError("unmasking='sglang_low_confidence' is greedy (SGLang's LowConfidence always takes the "
                         "argmax and ignores sampling parameters); set do_sample=False.")
