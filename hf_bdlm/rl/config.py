"""`BDLMGRPOConfig`: TRL's `GRPOConfig` plus how a block-diffusion policy is decoded and scored."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

from ..parallel.dims import ParallelDims
from ..protocols.policy import LOGP_ESTIMATORS
from ..trainer.config import BDLMSFTConfig

# The block-parallel fields, as BDLMSFTConfig declares them (the same names, defaults and meaning).
BLOCK_PARALLEL_FIELDS = ("block_parallel_size", "clean_ring_size", "block_parallel_mode", "block_parallel_transport",
                         "block_parallel_cp_layout", "block_schedule")


def _sft_field(name: str):
    declared = BDLMSFTConfig.__dataclass_fields__[name]
    return field(default=declared.default, metadata=dict(declared.metadata))


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

        > Block parallelism: [`~hf_bdlm.BDLMSFTConfig`]'s fields, the same names and meaning (`docs/rl.md`, Parallel)

        block_parallel_size (`int`, defaults to `1`):
            Ranks `P` of a block-parallel group (must divide the world size). The group's ranks pool their shares of
            the generation batch (TRL's `per_device_train_batch_size` each): every rank of the group holds the
            group's rows, decoded once (by the group's first rank), and every scoring forward runs sharded over the
            group as SFT runs it. The `W / P` groups are data-parallel replicas.
        clean_ring_size, block_parallel_mode, block_parallel_transport, block_parallel_cp_layout, block_schedule:
            the layout of the sharded forward, as in [`~hf_bdlm.BDLMSFTConfig`].
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
    block_parallel_size: int = _sft_field("block_parallel_size")
    clean_ring_size: int | None = _sft_field("clean_ring_size")
    block_parallel_mode: str = _sft_field("block_parallel_mode")
    block_parallel_transport: str = _sft_field("block_parallel_transport")
    block_parallel_cp_layout: str = _sft_field("block_parallel_cp_layout")
    block_schedule: str = _sft_field("block_schedule")

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
        # The world size is known once TrainingArguments has set up the distributed state (as BDLMSFTConfig reads it).
        self.parallel_dims = ParallelDims(self.block_parallel_size, self.clean_ring_size, self.block_parallel_mode,
                                          self.block_schedule, self.block_parallel_transport, self.world_size,
                                          self.block_parallel_cp_layout)
        self.clean_ring_size = self.parallel_dims.clean_ring_size


__all__ = ["BLOCK_PARALLEL_FIELDS", "BDLMGRPOConfig"]
