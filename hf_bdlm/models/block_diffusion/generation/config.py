"""The generation config of block-wise diffusion decoding: `BlockDiffusionGenerationConfig` (saved beside the model as
``generation_config.json``), the transformers hooks that make a model own one (`BlockDiffusionGenerationMixin`), and the
names of its knobs and unmasking rules."""

from __future__ import annotations

import copy

from transformers import GenerationConfig

BLOCK_DIFFUSION_FIELDS = ("block_size", "steps_per_block", "confidence_threshold", "mask_token_id", "token_shift",
                          "unmasking")
# How a denoising step picks the positions it unmasks: this project's rule, and the rules of the serving engines an
# exported model runs in (docs/deploy.md), so that what is evaluated here is what they serve.
UNMASKING_STRATEGIES = ("hf_bdlm", "sglang_low_confidence", "lmdeploy_low_confidence_dynamic")
# The engines' thresholds when their launch sets none: SGLang 0.5.23 `srt/dllm/algorithm/low_confidence.py` line 17
# (`threshold` of --dllm-algorithm-config), LMDeploy 0.18.0 `pytorch/config.py` line 655 (--dllm-confidence-threshold).
ENGINE_DEFAULT_THRESHOLDS = {"sglang_low_confidence": 0.95, "lmdeploy_low_confidence_dynamic": 0.85}


class BlockDiffusionGenerationConfig(GenerationConfig):
    r"""
    A [`~transformers.GenerationConfig`] with the knobs of block-wise diffusion decoding. It is saved beside the
    model as `generation_config.json` and loaded back by `from_pretrained`.

    Parameters:
        block_size (`int`, *optional*):
            Tokens per decoding block. `None` uses the model's `config.block_size` (the block size it was trained
            with); a smaller value decodes in sub-blocks.
        steps_per_block (`int`, *optional*):
            Denoising steps per block. `None` runs until every position of the block is unmasked (each step unmasks
            the confident positions, at least one); an integer unmasks enough positions per step to finish the
            block in that many steps.
        confidence_threshold (`float`, *optional*, defaults to 0.9):
            Positions whose chosen token has at least this probability are unmasked in the same step (parallel
            decoding). `None` unmasks only the single most confident position per step (or the number
            `steps_per_block` requires).
        mask_token_id (`int`, *optional*):
            The `[MASK]` token; `None` uses the model's `config.mask_token_id`.
        token_shift (`bool`, *optional*):
            Whether the logit at position `i - 1` predicts token `i` (models trained with the `fast_dllm_v2` or
            `fast_dllm_v2_causal_clean` objective, e.g. converted causal LMs). `None` follows
            `model.config.objective`. With a shift, the first position of a block is predicted by the clean stream's
            last row (the finished previous block, as in Fast-dLLM v2's decoding; with a token-causal clean stream,
            the causal LM's own next-token prediction) and is unmasked in the block's first step.
        unmasking (`str`, *optional*, defaults to `"hf_bdlm"`):
            Which positions a denoising step fixes, and from which vocabulary:

            - `"hf_bdlm"`: the chosen token is the most probable one (or a sample) with `[MASK]` left out, as the
              `standard` objective's softmax leaves it out; every position with confidence `>=
              confidence_threshold` is fixed, at least the most confident one (or as many as `steps_per_block`
              needs).
            - `"sglang_low_confidence"`: SGLang's `LowConfidence` (`srt/dllm/algorithm/low_confidence.py`): the
              argmax and its softmax probability over the whole vocabulary, `[MASK]` included; every position with
              confidence strictly `>` the threshold, else the single most confident one; a position whose argmax is
              `[MASK]` stays masked (a step that changes nothing ends the block with its masks). Greedy only.
              `confidence_threshold=None` takes SGLang's default, 0.95.
            - `"lmdeploy_low_confidence_dynamic"`: LMDeploy's `low_confidence_dynamic`
              (`pytorch/strategies/dllm/unmasking.py`): the sampler's token over the whole vocabulary, `[MASK]`
              included, scored by its probability under the temperature-scaled softmax; the most confident position
              and every one with confidence `>=` the threshold; a `[MASK]` token is kept as a token.
              `confidence_threshold=None` takes LMDeploy's default, 0.85.

            The engine rules need a model without token shift (`objective="standard"`) and take no
            `steps_per_block`, `sub_block_size`, `block_cache` or `min_tokens_per_step` (the engines have none).
        min_tokens_per_step (`int`, *optional*, defaults to 1):
            The fewest positions a step fixes: the threshold's confident positions, but at least this many (the most
            confident first). 1 is the plain threshold rule.
        sub_block_size (`int`, *optional*):
            Unmask each block sub-block by sub-block, left to right (Fast-dLLM v2's small blocks): a step fixes only
            positions of the first sub-block that still holds a masked one. It must divide the block size. `None`:
            the whole block is one sub-block.
        block_cache (`bool`, *optional*, defaults to `False`):
            Fast-dLLM v2's sub-block cache: the first step of each sub-block runs the whole block and keeps the
            block's own K/V; the following steps of that sub-block run only its rows (and, with token shift, the row
            before it), attending to the clean prefix and to the kept K/V of the block's other rows. An
            approximation (those rows' K/V are not refreshed until the next sub-block starts); needs `sub_block_size`
            smaller than the block and `use_cache=True`.
        fuse_block_commit (`bool`, *optional*, defaults to `True`):
            Run the clean rows of a finished block (and the prompt's whole blocks) in the same forward as the first
            step of the next block, instead of a forward of their own. The same computation (the first step never
            reads the finished block's noisy rows), one forward fewer per block.
        eos_early_exit (`bool`, *optional*, defaults to `True`):
            A row is done with its block as soon as an EOS is fixed with no masked position before it: the positions
            after it are never decoded (they are cut from the output anyway). The output does not change.
        compact_batch (`bool`, *optional*, defaults to `True`):
            Each step runs only the rows of the batch that still have positions to fix; rows done with the block sit
            out the slower rows' steps instead of being recomputed with them. The output does not change.

    The usual fields apply: `max_new_tokens` (default: one block), `do_sample`, `temperature`, `top_k`, `top_p`,
    `eos_token_id` (int or list), `pad_token_id` (default: the first EOS id).
    """

    def __init__(
        self,
        block_size: int | None = None,
        steps_per_block: int | None = None,
        confidence_threshold: float | None = 0.9,
        mask_token_id: int | None = None,
        token_shift: bool | None = None,
        unmasking: str = "hf_bdlm",
        min_tokens_per_step: int = 1,
        sub_block_size: int | None = None,
        block_cache: bool = False,
        fuse_block_commit: bool = True,
        eos_early_exit: bool = True,
        compact_batch: bool = True,
        **kwargs,
    ):
        # Set before GenerationConfig.__init__, which ends by calling validate().
        self.block_size = block_size
        self.steps_per_block = steps_per_block
        self.confidence_threshold = confidence_threshold
        self.mask_token_id = mask_token_id
        self.token_shift = token_shift
        self.unmasking = unmasking
        self.min_tokens_per_step = min_tokens_per_step
        self.sub_block_size = sub_block_size
        self.block_cache = block_cache
        self.fuse_block_commit = fuse_block_commit
        self.eos_early_exit = eos_early_exit
        self.compact_batch = compact_batch
        super().__init__(**kwargs)

    @classmethod
    def from_model_config(cls, model_config) -> "BlockDiffusionGenerationConfig":
        # transformers' version compares every attribute with a plain GenerationConfig's, which lacks ours; take
        # its result (special tokens from the backbone) and add the mask token. `block_size` stays None ("the
        # model's") rather than a copy, so a later change of the model's block size is not silently ignored.
        base = GenerationConfig.from_model_config(model_config)
        config = cls(**base.to_dict())
        config.mask_token_id = getattr(model_config, "mask_token_id", None)
        config._original_object_hash = hash(config)
        return config

    def validate(self, strict: bool = False, user_set_attributes: set[str] | None = None) -> None:
        super().validate(strict=strict, user_set_attributes=user_set_attributes)
        for name in ("block_size", "steps_per_block", "sub_block_size"):
            value = getattr(self, name, None)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}.")
        least = getattr(self, "min_tokens_per_step", 1)
        if not isinstance(least, int) or isinstance(least, bool) or least < 1:
            raise ValueError(f"min_tokens_per_step must be an integer >= 1, got {least!r}.")
        for name in ("block_cache", "fuse_block_commit", "eos_early_exit", "compact_batch"):
            value = getattr(self, name, None)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}.")
        threshold = getattr(self, "confidence_threshold", None)
        if threshold is not None and not 0.0 < threshold <= 1.0:
            raise ValueError(f"confidence_threshold must lie in (0, 1] or be None, got {threshold!r}.")
        mask = getattr(self, "mask_token_id", None)
        if mask is not None and (not isinstance(mask, int) or mask < 0):
            raise ValueError(f"mask_token_id must be a non-negative integer or None, got {mask!r}.")
        unmasking = getattr(self, "unmasking", "hf_bdlm")
        if unmasking not in UNMASKING_STRATEGIES:
            raise ValueError(f"unmasking must be one of {UNMASKING_STRATEGIES}, got {unmasking!r}.")


class BlockDiffusionGenerationMixin:
    """transformers hooks that make a block-diffusion model own a [`BlockDiffusionGenerationConfig`].

    `PreTrainedModel` creates `model.generation_config`, writes `generation_config.json` in `save_pretrained` and
    reads it in `from_pretrained` only when `can_generate()` is true, which needs `GenerationMixin` (the autoregressive
    loop, not ours). This mixin supplies the three hooks instead; it must come before `PreTrainedModel` in the bases
    so that its `generation_config_class` wins.
    """

    generation_config_class = BlockDiffusionGenerationConfig

    @classmethod
    def can_generate(cls) -> bool:
        return True

    def adjust_generation_fn(
        self, generation_config, from_auto_class, from_pipeline, pretrained_model_name_or_path, **kwargs
    ) -> None:
        """Called by `from_pretrained`: load `generation_config.json` (or keep the one made from the model config)."""
        if generation_config is not None:
            self.generation_config = as_block_diffusion_config(generation_config)
            return
        if pretrained_model_name_or_path is None:
            return
        hub_keys = ("cache_dir", "force_download", "proxies", "local_files_only", "token", "revision", "subfolder")
        load_kwargs = {k: kwargs[k] for k in hub_keys if kwargs.get(k) is not None}
        try:
            self.generation_config = BlockDiffusionGenerationConfig.from_pretrained(
                pretrained_model_name_or_path, _from_auto=from_auto_class, _from_pipeline=from_pipeline, **load_kwargs
            )
        except OSError:
            pass  # no generation_config.json: keep the config PreTrainedModel built from the model config


def as_block_diffusion_config(config: GenerationConfig | dict | None) -> BlockDiffusionGenerationConfig:
    """A copy of ``config`` as a [`BlockDiffusionGenerationConfig`] (plain `GenerationConfig`s are converted)."""
    if config is None:
        return BlockDiffusionGenerationConfig()
    if isinstance(config, dict):
        return BlockDiffusionGenerationConfig.from_dict(config)
    if isinstance(config, BlockDiffusionGenerationConfig):
        return copy.deepcopy(config)
    return BlockDiffusionGenerationConfig.from_dict(config.to_dict())
