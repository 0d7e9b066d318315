"""`BDLMGRPOConfig`: TRL's `GRPOConfig` plus how a block-diffusion policy is decoded and scored."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

from ..protocols.policy import LOGP_ESTIMATORS


@dataclass
class BDLMGRPOConfig(GRPOConfig):
    r"""
    Configuration of the [`BDLMGRPOTrainer`]: every [`~trl.GRPOConfig`] field (reward weights, `num_generations`,
    `beta`, `epsilon`, `loss_type`, `num_iterations`, logging, ...) plus the ones below. Rollouts are decoded by the
    model family's serving decoder with TRL's sampling fields (`temperature`, `top_p`, `top_k`,
    `max_completion_length`), these fields, and any other field of the family's decoder in `generation_kwargs` (a
    block-diffusion model: `sub_block_size`, `min_tokens_per_step`, `fuse_block_commit`, `eos_early_exit`,
    `compact_batch`, `unmasking`, ...).

    Parameters:
        logp_estimator (`str`, defaults to `"trace"`):
            How a completion token's log-probability is computed (docs/rl.md): `"trace"` (the decoding step that
            committed it, recomputed with gradients), `"coupled"` (two forwards with complementary masks over the
            completion) or `"one_step"` (one forward, completion fully masked, prompt randomly masked: d1).
        confidence_threshold (`float`, *optional*):
            The decoder's threshold: every masked position whose confidence reaches it is committed in a step (at
            least one). `None`: the checkpoint's generation config.
        steps_per_block (`int`, *optional*):
            Denoising steps per block. `None`: the checkpoint's generation config.
        prompt_mask_ratio (`float`, defaults to `0.15`):
            `one_step`: the share of prompt tokens masked, drawn afresh at every iteration (d1's 15 %).
    """

    logp_estimator: str = field(
        default="trace",
        metadata={"help": "Per-token log-probability estimator: 'trace', 'coupled' or 'one_step'.",
                  "choices": list(LOGP_ESTIMATORS)},
    )
    confidence_threshold: float | None = field(
        default=None,
        metadata={"help": "Rollouts: commit every masked position whose confidence reaches this threshold (at least "
                          "one per step). Default: the checkpoint's generation config."},
    )
    steps_per_block: int | None = field(
        default=None,
        metadata={"help": "Rollouts: denoising steps per block. Default: the checkpoint's generation config."},
    )
    prompt_mask_ratio: float = field(
        default=0.15,
        metadata={"help": "logp_estimator='one_step': share of prompt tokens masked, drawn afresh per iteration."},
    )

    def __post_init__(self):
        super().__post_init__()
        if self.logp_estimator not in LOGP_ESTIMATORS:
            raise ValueError(f"logp_estimator={self.logp_estimator!r} is not an estimator; the estimators are "
                             f"{list(LOGP_ESTIMATORS)}.")
        if not 0.0 <= self.prompt_mask_ratio < 1.0:
            raise ValueError(f"prompt_mask_ratio must lie in [0, 1), got {self.prompt_mask_ratio!r}.")
        if self.confidence_threshold is not None and not 0.0 < self.confidence_threshold <= 1.0:
            raise ValueError(f"confidence_threshold must lie in (0, 1], got {self.confidence_threshold!r}.")
        if self.steps_per_block is not None and self.steps_per_block < 1:
            raise ValueError(f"steps_per_block must be at least 1, got {self.steps_per_block!r}.")
        if self.use_vllm or self.use_transformers_continuous_batching:
            which = "use_vllm" if self.use_vllm else "use_transformers_continuous_batching"
            raise ValueError(f"{which}=True: a block-diffusion policy's rollouts come from its family's own decoder "
                             "(vLLM and transformers' continuous batching decode causal LMs token by token); leave "
                             f"{which} unset.")
        if self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature}: GRPO samples its rollouts; set a temperature > 0.")


__all__ = ["BDLMGRPOConfig"]
