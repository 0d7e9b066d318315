"""`BDLMSFTConfig`: TRL's `SFTConfig` plus the block-diffusion and block-parallel fields.

Invalid values are rejected when the config is built (not at the first training step), with
the value received and what to do. Tiny CPU example::

    from hf_bdlm import BDLMSFTConfig
    args = BDLMSFTConfig(output_dir="out", block_size=16, objective="fast_dllm_v2", max_length=128,
                         block_parallel_size=2, block_parallel_mode="csbp")   # under a 2-process launch
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from accelerate import ParallelismConfig
from trl import SFTConfig

from ..objectives.base import check_certainty_weight
from ..planner.link import LINKS
from ..protocols.diffusion_fields import check_diffusion_fields
from ..protocols.registry import PLANNED_OBJECTIVES, REGISTRY, all_objectives, family_for_objective, family_named
from ..parallel.dims import CP_LAYOUTS, MODES, SCHEDULES, TRANSPORTS, ParallelDims

ACCELERATE_PARALLELISM_ENV = "ACCELERATE_USE_PARALLELISM_CONFIG"  # set by `accelerate launch` with parallelism_config

OVERLONG_POLICIES = ("error", "truncate", "drop")
PACKING_STRATEGIES = ("bfd",)


@dataclass
class BDLMSFTConfig(SFTConfig):
    r"""
    Configuration of the [`BDLMSFTTrainer`]: every [`~trl.SFTConfig`] field plus the ones below.

    Fields left to `None` take the model's value (`BlockDiffusionConfig`), so a BDLM checkpoint trains as it was
    configured unless the config says otherwise.

    Parameters:
        > Parameters that control the diffusion objective

        block_size (`int`, *optional*):
            Tokens per diffusion block. Defaults to the model's; when a causal LM is converted, to 32. Setting it on a
            BDLM checkpoint changes the model's block size (the weights do not depend on it).
        objective (`str`, *optional*):
            Training objective: `"standard"` (BD3-LM), `"fast_dllm_v2"` (AR -> BDLM conversion as in Fast-dLLM v2:
            token shift, complementary masks, block-causal clean stream), `"fast_dllm_v2_causal_clean"` (its variant
            whose clean stream stays the causal LM's, token-causal), or an objective of another model family
            (`hf_bdlm.models.all_objectives()`; each family's objectives are documented in its folder and in
            `docs/`). Defaults to the model's.
        noise_eps_min (`float`, *optional*), noise_eps_max (`float`, *optional*):
            Range the per-block masking rate `t` is clipped to, `0 < noise_eps_min <= noise_eps_max <= 1`.
            Default to the model's. With an objective whose noise includes `t = 0` (`Objective.allows_zero_noise`:
            uniform-state noise) `0` is allowed: `0` / `0` trains without corruption.
        loss_weighting (`str`, *optional*):
            `"inverse_t"` (`1/t`, the ELBO) or `"unit"`; the `fast_dllm_v2` objectives always use `"unit"`. Defaults to
            the model's.
        attention_backend (`str`, *optional*):
            `"auto"` (`"flex"` on CUDA tensors, `"blockwise"` elsewhere), `"dense"`, `"blockwise"` or `"flex"` (see
            `hf_bdlm.attention.backends`). Defaults to the model's. CPU training needs `"auto"`, `"blockwise"` or
            `"dense"`.
        certainty_weight (`float`, *optional*):
            Weight `beta` of the certainty-forcing term (dParallel, Chen et al. 2025): `beta` times the entropy of the
            model's distribution at each masked target it already predicts (argmax = target), over the loss's
            normalizer. It makes right predictions confident, meant to let more positions clear a confidence threshold
            in one decoding step (measured: docs/evaluation.md). Evaluation scores the cross-entropy alone. Read by the objectives that denoise by
            confidence; a family whose model is not decoded that way refuses it. Defaults to off (`0`).

        > Parameters of a self-conditioning encoder-decoder family's objective (its training role's `config_fields`;
        > rejected with any other objective; documented with that family in `docs/`)

        self_conditioning_prob (`float`, *optional*):
            Per-sample probability of the self-conditioning pass (a first decoder pass without gradient whose soft
            predictions condition the scored pass); `0` skips it. Defaults to `0.5`.
        ar_loss_weight (`float`, *optional*):
            Weight of the encoder's next-token loss. Defaults to `1.0`.
        model_prediction_type (`str`, *optional*):
            `"mean"` (the decoder predicts the clean token's posterior) or `"mean_loo"` (its leave-one-out posterior,
            combined with the observed token in the loss). Defaults to `"mean"`.
        freeze_router (`bool`, *optional*):
            Keep the MoE routers frozen in full fine-tuning (LoRA never trains them). Defaults to `True`.

        > Parameters that control block parallelism

        block_parallel_size (`int`, *optional*, defaults to `1`):
            Ranks `P` of a block-parallel group sharing one batch of sequences. Must divide the world size `W`; the
            `W / P` groups are data-parallel replicas that receive disjoint data. `per_device_train_batch_size` is
            then the batch of a group (all its ranks hold the same samples), and a step's global batch is
            `per_device_train_batch_size * gradient_accumulation_steps * W / P` samples.
        clean_ring_size (`int`, *optional*):
            Ranks `C` of a clean ring, `C | P`. Defaults to `P` for `"csbp"` and `"cp"`, and to `1` for `"bp"`.
        block_parallel_mode (`str`, *optional*, defaults to `"csbp"`):
            `"csbp"` (context-sharded block parallelism), `"bp"` (block parallelism, replicated clean prefix) or
            `"cp"` (zigzag context parallelism over both streams, the baseline).
        block_parallel_cp_layout (`str`, *optional*, defaults to `"balanced"`):
            Under `"cp"`: `"balanced"` (zigzag chunks, K/V gathers overlapped with attention, window halos on sliding
            layers) or `"paper"`, the CP baseline of the paper's reference code that its published speed-ups are
            measured against (a contiguous clean shard per rank, a token slice of every noisy block, blocking
            all-gathers and reduce-scatters, whole-sequence gathers on sliding layers; `block_size` a multiple of
            `P`). For comparisons; `"balanced"` is never slower.
        block_parallel_transport (`str`, *optional*, defaults to `"allgather"`):
            How clean K/V travel: `"allgather"` (async all-gather over the ring) or `"ring"` (shards rotate peer to
            peer; bounds transient memory to two shards).
        block_schedule (`str`, *optional*, defaults to `"dual_end"`):
            Noisy-block schedule: `"dual_end"` (balanced block pairs `(j, N-1-j)`) or `"contiguous"`.
        block_parallel_link (`str`, *optional*):
            For measurements: run every K/V transfer of the block-parallel layout through an emulated cluster link,
            `"h100-nvlink"`, `"h100-ib"`, `"h200-nvlink"` or `"h200-ib"`: K/V charged at the cluster's bf16 element size,
            the link stretched by the matmul rate every process of the launch measures at its start, all at once and
            in the step's compute dtype, so that communication takes the share of a step it would take on that cluster
            (`hf_bdlm.planner.link`; `docs/benchmarks.md`). Only the K/V exchange is emulated, not the data-parallel
            gradient reduction.
        parallelism_config (`accelerate.ParallelismConfig`, *optional*):
            Tensor parallelism: `ParallelismConfig(tp_size=T)` splits every layer's heads and MLP over `T` ranks with
            the backbone's own transformers plan, inside each block-parallel group (ranks `(g*P + r)*T + t`; the world
            is `W = D x P x T`). The trainer applies it itself, over its own mesh (`hf_bdlm.parallel.tensor`), and
            with more than one block-parallel or data-parallel rank it needs FSDP2 (`fsdp="full_shard"`,
            `fsdp_config={"fsdp_version": 2}`), which shards over `D x P` as Accelerate shards over `dp_shard` beside
            `tp`. Its other sizes stay 1: block parallelism replaces Accelerate's `cp_size`, and the data-parallel
            replicas are the ranks left over.

        > Parameters that control the data

        overlong_samples (`str`, *optional*, defaults to `"error"`):
            What to do with a sample longer than `max_length` (with packing: a document longer than `max_length`):
            `"error"` (stop before training, naming how many and which), `"truncate"` (keep the first `max_length`
            tokens, TRL's `keep_start`) or `"drop"`. Truncated or dropped samples and tokens are counted, logged and
            kept in `trainer.data_report`. Samples are never truncated silently.

    Block alignment: every sequence, and with `packing=True` every packed document, is padded to a multiple of
    `block_size` with the pad token; pad tokens are never supervised. With `packing=True` the documents are packed
    whole (best-fit decreasing, `packing_strategy="bfd"`) into rows of `max_length` tokens, which must be a multiple of
    `block_size`, and attend only within their document.

    > [!NOTE]
    > Defaults that differ from [`~trl.SFTConfig`]: `bf16` defaults to `True` only when a CUDA device is used (else
    > `False`), and `ddp_find_unused_parameters` to `False` (the LM head is applied outside the model's forward, to the
    > rows that carry targets, which DDP's unused-parameter search would misread). Checkpointing is on by default as in
    > TRL, under transformers' current name `activation_checkpointing` (`gradient_checkpointing` is its deprecated
    > alias).
    """

    # The diffusion objective
    block_size: int | None = field(default=None, metadata={"help": "Tokens per diffusion block (default: the model's)."})
    objective: str | None = field(
        default=None,
        metadata={"help": "Training objective: 'standard', 'fast_dllm_v2', 'fast_dllm_v2_causal_clean' or another "
                          "family's (hf_bdlm.models.all_objectives(); default: the model's)."},
    )
    noise_eps_min: float | None = field(default=None, metadata={"help": "Lowest per-block masking rate."})
    noise_eps_max: float | None = field(default=None, metadata={"help": "Highest per-block masking rate."})
    loss_weighting: str | None = field(default=None, metadata={"help": "'inverse_t' or 'unit' (default: the model's)."})
    attention_backend: str | None = field(
        default=None, metadata={"help": "'auto', 'dense', 'blockwise' or 'flex' (default: the model's)."}
    )
    certainty_weight: float | None = field(
        default=None,
        metadata={"help": "Weight of the certainty-forcing term: the entropy at the masked targets the model already "
                          "predicts, so more of them clear a confidence threshold per decoding step (default: off)."},
    )
    self_conditioning_prob: float | None = field(
        default=None,
        metadata={"help": "encoder-decoder objective: per-sample probability of self-conditioning (default 0.5)."}
    )
    ar_loss_weight: float | None = field(
        default=None,
        metadata={"help": "encoder-decoder objective: weight of the encoder's next-token loss (default 1.0)."}
    )
    model_prediction_type: str | None = field(
        default=None, metadata={"help": "encoder-decoder objective: 'mean' or 'mean_loo' (default 'mean')."}
    )
    freeze_router: bool | None = field(
        default=None,
        metadata={"help": "encoder-decoder objective: keep MoE routers frozen in full fine-tuning (default True)."}
    )

    # Block parallelism
    block_parallel_size: int = field(default=1, metadata={"help": "Ranks P sharing one batch (must divide the world)."})
    clean_ring_size: int | None = field(
        default=None, metadata={"help": "Ranks C of a clean ring, C | P (default: P for csbp/cp, 1 for bp)."}
    )
    block_parallel_mode: str = field(
        default="csbp", metadata={"help": "'csbp', 'bp' or 'cp'.", "choices": list(MODES)}
    )
    block_parallel_transport: str = field(
        default="allgather", metadata={"help": "'allgather' or 'ring'.", "choices": list(TRANSPORTS)}
    )
    block_parallel_cp_layout: str = field(
        default="balanced", metadata={"help": "under cp: 'balanced' or 'paper' (the paper's CP baseline).",
                                      "choices": list(CP_LAYOUTS)}
    )
    block_schedule: str = field(
        default="dual_end", metadata={"help": "'dual_end' or 'contiguous'.", "choices": list(SCHEDULES)}
    )
    block_parallel_link: str | None = field(
        default=None, metadata={"help": "emulated cluster link for measurements: 'h100-nvlink', 'h100-ib', "
                                        "'h200-nvlink' or 'h200-ib' (default: none)."}
    )

    # Training. TRL turns checkpointing on by default under the name transformers now deprecates (a FutureWarning on
    # every config); __post_init__ applies the same default under the current name.
    gradient_checkpointing: bool | None = field(
        default=None, metadata={"help": "Deprecated alias of activation_checkpointing (default: on)."}
    )

    # Data
    overlong_samples: str = field(
        default="error",
        metadata={
            "help": "What to do with samples longer than max_length: 'error', 'truncate' or 'drop'.",
            "choices": list(OVERLONG_POLICIES),
        },
    )

    def __post_init__(self):
        if not self.use_cpu and not torch.accelerator.is_available():
            # A machine without accelerators trains on the CPU whatever the flag says, but the flag decides two things:
            # under torchrun Accelerate sets up a multi-process CPU world (gloo) only when asked for the CPU (otherwise
            # every process would silently train alone), and transformers accepts bf16=True (CPU autocast) only then.
            self.use_cpu = True
        if self.bf16 is None:
            # TRL turns bf16 on everywhere; a CPU run in bf16 would be slow and would not match float32 references.
            self.bf16 = torch.cuda.is_available() and not self.use_cpu and not self.fp16
        if self.ddp_find_unused_parameters is True:
            raise ValueError(
                "ddp_find_unused_parameters=True is not supported by BDLMSFTTrainer: the loss applies the LM head "
                "outside the model's forward, so DDP's search would mark the head unused and then see its gradient "
                "arrive. Every parameter is used in every step; leave ddp_find_unused_parameters unset."
            )
        self.ddp_find_unused_parameters = False
        if getattr(self, "activation_checkpointing", None) is None and self.gradient_checkpointing is None:
            self.activation_checkpointing = True  # TRL's default, set where transformers reads it
        self._check_diffusion_fields()
        self._check_data_fields()
        super().__post_init__()
        # The world size is known only once TrainingArguments has set up the distributed state.
        self._check_block_parallel_fields(self.world_size)

    # --- validation ----------------------------------------------------------------------------
    def _check_diffusion_fields(self) -> None:
        if self.objective in PLANNED_OBJECTIVES:
            raise ValueError(
                f"objective={self.objective!r} is planned but not implemented yet; available now: "
                f"{sorted(all_objectives())}."
            )
        zero_noise_ok = self.objective in all_objectives() and family_named(
            family_for_objective(self.objective).name).role("training").objective_class(self.objective).allows_zero_noise
        check_diffusion_fields(block_size=self.block_size, objective=self.objective,
                               objectives=tuple(sorted(all_objectives())), noise_eps_min=self.noise_eps_min,
                               noise_eps_max=self.noise_eps_max, loss_weighting=self.loss_weighting,
                               attention_backend=self.attention_backend, zero_noise_ok=zero_noise_ok)
        if self.certainty_weight is not None:
            check_certainty_weight(self.certainty_weight)
        self._check_family_fields()

    def _check_family_fields(self) -> None:
        """Fields that only one model family's objectives read are rejected with another objective; the family checks
        their values (``TrainingSpec.check_args``)."""
        for entry in REGISTRY:
            family = family_named(entry.name)
            if not family.has_role("training"):
                continue
            training = family.role("training")
            given = sorted(name for name in training.config_fields if getattr(self, name) is not None)
            if given and self.objective is not None and self.objective not in entry.objectives:
                names = " or ".join(f"objective={o!r}" for o in entry.objectives)
                raise ValueError(f"{given} apply to {names} only, got objective={self.objective!r}.")
            if given or self.objective in entry.objectives:
                training.check_args(self)

    def _check_data_fields(self) -> None:
        if self.overlong_samples not in OVERLONG_POLICIES:
            raise ValueError(f"overlong_samples must be one of {OVERLONG_POLICIES}, got {self.overlong_samples!r}.")
        if self.padding_free:
            raise ValueError(
                "padding_free=True flattens a batch into one sequence, which a block-diffusion batch cannot be "
                "(each row is a [clean, noisy] pair of block-aligned sequences). Use packing=True instead: documents "
                "are packed whole, aligned to block boundaries, with per-document attention."
            )
        packs = self.packing or bool(self.eval_packing)
        if packs and self.packing_strategy not in PACKING_STRATEGIES:
            why = {
                "wrapped": "it cuts documents mid-sequence, so a document would start mid-block and lose its prompt",
                "bfd_split": "it splits overflowing documents, so a completion could be separated from its prompt",
            }.get(self.packing_strategy, "it is not a block-aligned strategy")
            raise ValueError(
                f"packing_strategy={self.packing_strategy!r} cannot be honoured by block-diffusion packing: {why}. "
                f"Use packing_strategy='bfd' (whole documents, best-fit decreasing, each aligned to the block size)."
            )
        if packs and self.max_length is None:
            raise ValueError("packing=True needs max_length (the length of a packed row); got max_length=None.")
        if packs and self.block_size is not None and self.max_length % self.block_size:
            raise ValueError(
                f"with packing=True, max_length={self.max_length} must be a multiple of block_size={self.block_size} "
                f"(packed documents are aligned to block boundaries); use e.g. max_length="
                f"{(self.max_length // self.block_size) * self.block_size or self.block_size}."
            )

    def _check_block_parallel_fields(self, world_size: int) -> None:
        if self.block_parallel_link is not None:
            if self.block_parallel_link not in LINKS:
                raise ValueError(f"block_parallel_link={self.block_parallel_link!r} is not a named link; use one of "
                                 f"{list(LINKS)}, or leave it unset (no emulation).")
        self.parallel_dims = ParallelDims(self.block_parallel_size, self.clean_ring_size, self.block_parallel_mode,
                                          self.block_schedule, self.block_parallel_transport, world_size,
                                          self.block_parallel_cp_layout, self._tensor_parallel_size())
        self.clean_ring_size = self.parallel_dims.clean_ring_size

    def _tensor_parallel_size(self) -> int:
        """``T`` from Accelerate's ``ParallelismConfig``; its other dimensions are refused (what replaces each)."""
        pc = self.parallelism_config
        if pc is None and os.environ.get(ACCELERATE_PARALLELISM_ENV, "false").lower() == "true":
            # `accelerate launch` with a parallelism_config section: its sizes arrive as PARALLELISM_CONFIG_* variables.
            pc = self.parallelism_config = ParallelismConfig()
        if pc is None:
            return 1
        replaced = {
            "cp_size": "block parallelism is this trainer's context parallelism (block_parallel_size, "
                       "block_parallel_mode='cp' for a CP baseline)",
            "sp_size": "block parallelism shards the sequence (block_parallel_size)",
            "dp_shard_size": "FSDP2 is requested with fsdp='full_shard', fsdp_config={'fsdp_version': 2}, and shards "
                             "over every data-parallel and block-parallel rank",
            "dp_replicate_size": "the data-parallel replicas are the ranks left over (W / (P x T))",
        }
        for name, instead in replaced.items():
            value = getattr(pc, name, 1) or 1
            if value != 1:
                raise ValueError(f"parallelism_config.{name}={value} is not supported by BDLMSFTTrainer: {instead}. "
                                 f"Set only tp_size in ParallelismConfig.")
        return pc.tp_size or 1

    @property
    def data_parallel_size(self) -> int:
        """Data-parallel replicas `D = W / (P x T)`."""
        return self.parallel_dims.data_parallel_size
