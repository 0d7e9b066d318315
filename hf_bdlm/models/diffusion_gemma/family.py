"""The DiffusionGemma family: transformers' `DiffusionGemmaForBlockDiffusion`, fine-tuned as it is.

The checkpoint stays a plain transformers DiffusionGemma one (the objective's settings go to the model card, not to
its config). Its roles: training
(`DiffusionGemmaTraining`: the `diffusion_gemma` objective built from the model, its tokenizer and the run's arguments;
the canvas-frame layout of each batch, sharded by the block-parallel plugin (:mod:`.training.sharded`); a step that
drives the encoder and decoder itself, through a :class:`~hf_bdlm.protocols.step.TrainingStep`; FSDP2 units that keep
the tied encoder/decoder layers together (:mod:`.training.fsdp`); LoRA's reference targets), serving
(transformers' `generate`, one random stream per request: :mod:`.inference.serving`), evaluation (its uniform-state
bound: :mod:`.inference.likelihood`), planning (its cost traits and the paper's 26B-A4B preset) and policy (GRPO's
rollouts and its ``coupled`` and ``one_step`` estimators: :mod:`.training.policy`). The entry renders its model card
(:mod:`.card`).
"""

from __future__ import annotations

import logging
import os

from transformers import AutoProcessor, AutoTokenizer

from ...checkpoints.files import load_pretrained
from ...protocols.decoding import DecodingVariant
from ...protocols.entry import ModelFamily
from ...protocols.roles import EvaluationSpec, LossStep, PlanningSpec, PolicySpec, ServingSpec, TrainingSpec
from ...protocols.step import run_step
from .card import render_diffusion_gemma_card
from .inference.likelihood import DiffusionGemmaLikelihoodScorer
from .inference.serving import DiffusionGemmaServingDecoder
from .modeling import (
    DIFFUSION_GEMMA_LORA_TARGETS,
    diffusion_gemma_class,
    unwrap_diffusion_gemma,
    use_block_diffusion_attention,
)
from .configuration import DEFAULT_NOISE_EPS, MODEL_PREDICTION_TYPES
from .inference.engines import fill_decoding_settings
from .training.fsdp import shard_diffusion_gemma
from .training.objectives import DiffusionGemmaObjective
from .training.policy import DiffusionGemmaPolicy, rollout_settings
from .training.sharded import diffusion_gemma_layout, frame_padding

# The objective feeds text only: the vision tower never gets a gradient (frozen, so that DDP expects none).
VISION_PARAMETER_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")
# BDLMSFTConfig fields that only this family's objective reads, with their defaults.
OBJECTIVE_DEFAULTS = {"noise_eps_min": DEFAULT_NOISE_EPS, "noise_eps_max": 1.0 - DEFAULT_NOISE_EPS,
                      "self_conditioning_prob": 0.5, "ar_loss_weight": 1.0, "model_prediction_type": "mean",
                      "attention_backend": "auto"}

logger = logging.getLogger(__name__)


class DiffusionGemmaTraining(TrainingSpec):
    """Fine-tunes DiffusionGemma as it is: every response block of a sample in one encoder + decoder pass, the step
    driving the model's parts itself (DDP, FSDP2 and block parallelism; not DeepSpeed)."""

    owns_step = True
    config_fields = ("self_conditioning_prob", "ar_loss_weight", "model_prediction_type", "freeze_router")

    def load(self, path, config, args, processing_class, init_kwargs):
        return load_pretrained(diffusion_gemma_class().from_pretrained, path, **init_kwargs), processing_class

    def objective_class(self, name: str):
        return DiffusionGemmaObjective

    def check_args(self, args) -> None:
        """The fields only this objective reads, and the distribution it supports (DDP, FSDP2, block parallelism;
        not DeepSpeed)."""
        if args.objective in self.objectives and args.loss_weighting is not None:
            raise ValueError(
                f"loss_weighting={args.loss_weighting!r} does not apply to objective='diffusion_gemma' (a flat "
                "cross-entropy over the canvas); leave it unset."
            )
        p = args.self_conditioning_prob
        if p is not None and not 0.0 <= p <= 1.0:
            raise ValueError(f"self_conditioning_prob must lie in [0, 1], got {p!r}.")
        if args.ar_loss_weight is not None and args.ar_loss_weight < 0:
            raise ValueError(f"ar_loss_weight must be >= 0, got {args.ar_loss_weight!r}.")
        if args.model_prediction_type is not None and args.model_prediction_type not in MODEL_PREDICTION_TYPES:
            raise ValueError(
                f"model_prediction_type must be one of {MODEL_PREDICTION_TYPES}, got {args.model_prediction_type!r}."
            )

    # --- training ---------------------------------------------------------------------------------------------
    def step(self, model, args, tokenizer, plugin):
        """The `diffusion_gemma` objective for the model, from the config's fields, in a step over ``plugin``'s
        layout.

        The canvas length is the model's; the fill token is the tokenizer's EOS (else the model's first EOS id); a
        response that does not end with an EOS id of the tokenizer, the text config or the generation config counts
        as truncated (its fill is not supervised). With `freeze_router` (default) the MoE routers stop training. The
        model's attention is routed through hf_bdlm when a layout is passed (``generate`` is unchanged).
        """
        dg = unwrap_diffusion_gemma(model)
        canvas = dg.config.canvas_length
        if args.block_size is not None and args.block_size != canvas:
            raise ValueError(
                f"block_size={args.block_size} differs from the DiffusionGemma model's canvas_length={canvas} (the "
                "block its generate denoises); leave block_size unset."
            )
        _refuse_deepspeed(args)
        kwargs = DiffusionGemmaObjective.config_kwargs(dg.config)
        ends = set(kwargs.pop("end_token_ids") or [])
        generation_eos = getattr(getattr(dg, "generation_config", None), "eos_token_id", None)
        ends |= {generation_eos} if isinstance(generation_eos, int) else set(generation_eos or [])
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            kwargs["fill_token_id"] = tokenizer.eos_token_id
            ends.add(tokenizer.eos_token_id)
        if tokenizer is not None and tokenizer.pad_token_id is not None:
            kwargs["pad_token_id"] = tokenizer.pad_token_id
        if kwargs.get("fill_token_id") is None:
            raise ValueError("neither the tokenizer nor the DiffusionGemma config names an EOS token to fill canvases "
                             "with.")
        for name, default in OBJECTIVE_DEFAULTS.items():
            value = getattr(args, name)
            kwargs[name] = default if value is None else value
        frame_multiple, canvas_multiple = frame_padding(args.parallel_dims, canvas)
        objective = DiffusionGemmaObjective(end_token_ids=ends or None, pad_to_multiple_of=frame_multiple,
                                            canvas_blocks_multiple_of=canvas_multiple,
                                            certainty_weight=args.certainty_weight or 0.0, **kwargs)
        freeze_router = args.freeze_router is None or args.freeze_router
        for name, param in dg.named_parameters():
            if (freeze_router and ".router." in name) or name.startswith(VISION_PARAMETER_PREFIXES):
                param.requires_grad_(False)
        use_block_diffusion_attention(dg)
        if getattr(dg, "generation_config", None) is not None:
            # The decoding settings generate would fill in at each call, written down: the checkpoints this run saves
            # carry them, so vLLM (which reads them from generation_config.json) decodes as generate does.
            filled = fill_decoding_settings(dg.generation_config)
            if filled:
                logger.info("generation config: %s set to the values generate uses", ", ".join(filled))
        return DiffusionGemmaLossStep(objective, plugin)

    def default_lora_targets(self, model):
        """The reference fine-tune's: the attention and dense-MLP linears of the encoder and decoder layers (router,
        experts, self-conditioning and vision frozen)."""
        return DIFFUSION_GEMMA_LORA_TARGETS

    def shard_fsdp(self, model, fully_shard_kwargs, fsdp_plugin):
        return shard_diffusion_gemma(model, fully_shard_kwargs, fsdp_plugin)


class DiffusionGemmaLossStep(LossStep):
    """This rank's rows of the batch's canvas frame (:func:`.training.sharded.diffusion_gemma_layout`), through the
    step's encoder and decoder passes."""

    def __init__(self, objective, plugin):
        self.objective, self.plugin = objective, plugin

    def __call__(self, runner, corrupted, optional_pass=None):
        layout = diffusion_gemma_layout(corrupted.frame, self.plugin.sharding_groups(), self.objective.attention_backend)
        return run_step(runner, self.objective.loss, corrupted, layout, self_conditioning_pass=optional_pass)

    def zero(self, runner, inputs, optional_pass=None):
        return run_step(runner, self.objective.zero_loss, inputs, self_conditioning_pass=bool(optional_pass))


class DiffusionGemmaServing(ServingSpec):
    """transformers' own ``generate``, one canvas at a time per request."""

    def load(self, path, config, init_kwargs, block_size):
        """The model and its tokenizer (a processor's tokenizer, with the processor's chat template when the
        tokenizer has none); ``block_size`` is unused (the canvas length is the model's)."""
        model = load_pretrained(diffusion_gemma_class().from_pretrained, path, **init_kwargs)
        tokenizer = AutoTokenizer.from_pretrained(path)
        if not getattr(tokenizer, "chat_template", None):
            tokenizer.chat_template = _processor_chat_template(path)
        return model, tokenizer

    def decoder(self, model, tokenizer):
        return DiffusionGemmaServingDecoder(unwrap_diffusion_gemma(model), tokenizer)

    def decoding_variants(self, decoder):
        """Its own settings (the generation config: denoising steps and adaptive stop per canvas) and as many
        denoising steps as the canvas has tokens, without the adaptive stop (the careful reference)."""
        canvas = int(decoder.model.config.canvas_length)
        config = decoder.model.generation_config
        own = f"own settings ({getattr(config, 'max_denoising_steps', None)} steps max, adaptive stop)"
        return {own: DecodingVariant(decoder, description="the checkpoint's generation config"),
                f"{canvas} steps per canvas": DecodingVariant(
                    decoder.with_overrides(max_denoising_steps=canvas, confidence_threshold=1e-9), reference=True,
                    description="as many denoising steps as the canvas has tokens, no adaptive stop")}


class DiffusionGemmaEvaluation(EvaluationSpec):
    """lm-eval scores what ``hf-bdlm serve`` loads, its likelihood by the uniform-state diffusion bound."""

    def likelihood_scorer(self, model, tokenizer):
        return DiffusionGemmaLikelihoodScorer(model, tokenizer)


class DiffusionGemmaPlanning(PlanningSpec):
    """The MoE encoder-decoder's traits, the paper's 26B-A4B preset and its settings."""

    def cost_traits(self, text_config: dict) -> dict:
        """The text config has no ``attention_k_eq_v`` and its global layers no ``v_proj`` (K = V); the encoder is
        causal and its loss scores the clean rows; a canvas block's window is ``block_start``; the self-conditioning
        block is a dense MLP of the model's width (``3 h I + h``)."""
        h = text_config["hidden_size"]
        return {"k_eq_v": True, "clean_attention": "causal", "window_convention": "block_start",
                "head_on_clean": True, "extra_params": 3 * h * (text_config.get("intermediate_size") or 0) + h}

    def paper_settings(self):
        # The paper's MoE SFT of DiffusionGemma 26B-A4B, expert parallelism 2 inside a GPU pair.
        return (("MoE SFT", "diffusiongemma-26b-a4b", 262144,
                 "CSBP / best baseline throughput 1.18-1.45x, equal or lower memory", "ep"),
                ("MoE SFT", "diffusiongemma-26b-a4b", 524288, "1.61x full-model speedup at 512K", "ep"))

    def presets(self) -> dict[str, dict]:
        """``diffusiongemma-26b-a4b``, the paper's MoE SFT setting. **Assumed sizes**, chosen to be consistent with
        the name (about 25-26B parameters, about 4B active per token) and the Gemma 4 config fields; they are not a
        published config: hidden 2816, 30 layers, 16 heads, 8 K/V heads of dim 256 on sliding layers (window 1024,
        five of six layers), 2 K/V heads of dim 512 on global layers (V = K), 128 experts, top 8, expert MLP 704,
        dense MLP 2112 beside the experts, vocabulary 262144; canvas 256."""
        layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(30)]
        return {"diffusiongemma-26b-a4b": dict(
            model_type="diffusion_gemma", canvas_length=256,
            text_config=dict(hidden_size=2816, num_hidden_layers=30, num_attention_heads=16, num_key_value_heads=8,
                             head_dim=256, global_head_dim=512, num_global_key_value_heads=2, intermediate_size=2112,
                             enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=704,
                             vocab_size=262144, sliding_window=1024, layer_types=layer_types,
                             attention_k_eq_v=True, tie_word_embeddings=True))}


class DiffusionGemmaPolicySpec(PolicySpec):
    """GRPO over DiffusionGemma: rollouts by its serving decoder (transformers' generate, a random stream per row),
    log-probabilities by ``coupled`` or ``one_step`` on its uniform-state noise (:mod:`.training.policy`; ``trace``
    is not available: generate records no per-token commit)."""

    estimators = DiffusionGemmaPolicy.estimators

    def check_args(self, args) -> None:
        if args.top_k or args.min_p is not None or args.repetition_penalty != 1.0:
            raise ValueError(f"top_k={args.top_k!r}, min_p={args.min_p!r}, repetition_penalty="
                             f"{args.repetition_penalty!r}: DiffusionGemma's sampler applies none of them (its "
                             "entropy-bound sampler keeps the whole distribution); leave them unset.")

    def policy(self, model, tokenizer, args):
        dg = unwrap_diffusion_gemma(model)
        decoder = self.family.role("serving").decoder(dg, tokenizer)
        if args.generation_kwargs:
            decoder = decoder.with_overrides(**args.generation_kwargs)
        pad = getattr(tokenizer, "pad_token_id", None)
        pad = pad if pad is not None else dg.config.get_text_config().pad_token_id or 0
        return DiffusionGemmaPolicy(decoder, rollout_settings(decoder, args), int(pad))


class DiffusionGemmaFamily(ModelFamily):
    name = "diffusion_gemma"
    roles = {"training": DiffusionGemmaTraining, "serving": DiffusionGemmaServing,
             "evaluation": DiffusionGemmaEvaluation, "planning": DiffusionGemmaPlanning,
             "policy": DiffusionGemmaPolicySpec}
    refusals = {"drafting": "--draft takes a drafter folder; pass a drafter folder, or serve it without --draft."}

    def claims_model(self, model) -> bool:
        return unwrap_diffusion_gemma(model) is not None

    def block_size(self, model) -> int:
        return int(unwrap_diffusion_gemma(model).config.canvas_length)

    def render_card(self, directory: os.PathLike, config: dict, info: dict | None) -> str:
        return render_diffusion_gemma_card(directory, config, info)


def _processor_chat_template(path):
    """The chat template a processor saved beside the tokenizer, or ``None``."""
    try:
        return getattr(AutoProcessor.from_pretrained(path), "chat_template", None)
    except (OSError, ValueError, TypeError, KeyError):  # no processor in the folder
        return None


def _refuse_deepspeed(args) -> None:
    """DDP, FSDP2 (units: the tied encoder/decoder layer pairs) and block parallelism are supported; DeepSpeed is
    not."""
    deepspeed = bool(args.deepspeed) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in ("1", "true")
    if deepspeed:
        raise NotImplementedError(
            "objective='diffusion_gemma' trains with DDP or FSDP2 (any world size, with block parallelism), not with "
            "DeepSpeed: its ZeRO partitioning would have to keep the tied encoder and decoder layers together, which "
            "is not built. Launch without the DeepSpeed setting, with fsdp='full_shard' and fsdp_config="
            "{'fsdp_version': 2} (or an accelerate FSDP2 config) to shard the model."
        )
