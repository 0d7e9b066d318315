"""The block-diffusion family: causal LMs converted into `BlockDiffusionForMaskedLM` (Llama, Qwen, Gemma, ...).

A checkpoint of this family has ``model_type: block_diffusion``; any other causal LM (object or folder) is converted
on load (:func:`hf_bdlm.models.block_diffusion.conversion.convert_causal_lm`). The run's diffusion fields (block size, objective, noise,
attention backend) are written into the model's config, so the saved checkpoint records what it was trained with.
Its roles: training (each batch is the vectorized ``[noisy ; clean]`` sequence, sharded by the block-parallel plugin,
:class:`hf_bdlm.parallel.ShardedLayout`; the objective calls the model's forward), serving (the ragged block decoder,
:mod:`.inference.serving`), evaluation (the absorbing-noise bound, :mod:`.inference.likelihood`), planning (the
planner's defaults) and policy (GRPO's rollouts and log-probability estimators, :mod:`.training.policy`).
"""

from __future__ import annotations

import logging
import os

from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES

from ...checkpoints.files import BadCheckpointFile, load_pretrained
from ...protocols.diffusion_fields import TOKEN_SHIFT_OBJECTIVES
from ...protocols.decoding import DecodingVariant
from ...protocols.entry import ModelFamily
from ...protocols.registry import REGISTRY
from ...protocols.roles import EvaluationSpec, LossStep, PlanningSpec, PolicySpec, ServingSpec, TrainingSpec
from ...protocols.step import unwrap_model
from .card import render_block_diffusion_card
from .configuration import BlockDiffusionConfig
from .conversion import convert_causal_lm
from .inference.likelihood import BlockDiffusionLikelihoodScorer
from .inference.serving import BlockDiffusionServingDecoder
from .modeling import BlockDiffusionForMaskedLM
from .training.objectives import OBJECTIVE_CLASSES
from .training.policy import BlockDiffusionPolicy, rollout_fields

logger = logging.getLogger(__name__)

DEFAULT_CONVERSION_BLOCK_SIZE = 32


class BlockDiffusionTraining(TrainingSpec):
    """Trains a converted causal LM (or a block-diffusion checkpoint) with the ``standard`` or ``fast_dllm_v2``
    objectives; the objective calls the model's forward on the vectorized ``[noisy ; clean]`` rows."""

    def load(self, path, config, args, processing_class, init_kwargs):
        if config.model_type == BlockDiffusionConfig.model_type:
            check_mask_token(getattr(processing_class, "tokenizer", processing_class), config, path)
            return load_pretrained(AutoModel.from_pretrained, path, **init_kwargs), processing_class
        causal = load_pretrained(AutoModelForCausalLM.from_pretrained, path, **init_kwargs)
        return self.convert(causal, processing_class, args, path)

    def adopt(self, model, processing_class, args):
        if self.family.claims_model(model):
            return model, processing_class
        if isinstance(model, PreTrainedModel) and model.get_output_embeddings() is not None:
            return self.convert(model, processing_class, args, type(model).__name__)
        raise TypeError(
            f"{type(model).__name__} is neither a model of a family hf_bdlm trains nor a causal LM with an LM head; "
            "pass a model of a registered family (hf_bdlm.models.family_names()), a *ForCausalLM model to convert, "
            "or a local checkpoint folder."
        )

    def convert(self, causal, processing_class, args, source):
        """``causal`` converted with the run's block size, objective and backend (``source`` names it in the log)."""
        kwargs = {"block_size": args.block_size or DEFAULT_CONVERSION_BLOCK_SIZE, "seed": args.seed}
        if args.objective is not None:
            kwargs["objective"] = args.objective
        if args.attention_backend is not None:
            kwargs["attention_backend"] = args.attention_backend
        model, processing_class = convert_causal_lm(causal, processing_class, **kwargs)
        logger.info("converted causal LM %s into a block diffusion model (block size %d, mask token id %d)",
                    source, model.config.block_size, model.config.mask_token_id)
        return model, processing_class

    def objective_class(self, name: str):
        return OBJECTIVE_CLASSES[name]

    def step(self, model, args, tokenizer, plugin):
        """The config's diffusion fields written into the model's config, the objective built from it."""
        cfg = unwrap_model(model).config
        updates = {
            "block_size": args.block_size,
            "objective": args.objective,
            "noise_eps_min": args.noise_eps_min,
            "noise_eps_max": args.noise_eps_max,
            "attention_backend": args.attention_backend,
        }
        if args.loss_weighting is not None and (args.objective or cfg.objective) not in TOKEN_SHIFT_OBJECTIVES:
            updates["loss_weighting"] = args.loss_weighting
        for name, value in updates.items():
            if value is not None and getattr(cfg, name) != value:
                logger.info("model config: %s %r -> %r (from BDLMSFTConfig)", name, getattr(cfg, name), value)
                setattr(cfg, name, value)
        cfg.validate_diffusion_fields()
        objective = self.objective_class(cfg.objective).build(cfg, certainty_weight=args.certainty_weight or 0.0)
        return BlockDiffusionLossStep(model, objective, plugin)


class BlockDiffusionLossStep(LossStep):
    """This rank's rows of the vectorized batch (:meth:`BlockParallelPlugin.layout`), scored by the model's forward."""

    def __init__(self, model, objective, plugin):
        self.model, self.objective, self.plugin = model, objective, plugin

    def __call__(self, runner, corrupted, optional_pass=None):
        inner = unwrap_model(self.model)
        layout = self.plugin.layout(corrupted.seq_len, int(inner.config.block_size), inner.mask_rule(),
                                    inner.config.attention_backend, corrupted.document_ids)
        return self.objective.loss(runner, corrupted, layout, scorer=inner)

    def zero(self, runner, inputs, optional_pass=None):
        ids = inputs["input_ids"]
        hidden = runner(input_ids=ids, clean_input_ids=ids, return_logits=False).hidden_states
        return (hidden.sum() + unwrap_model(self.model).lm_logits(hidden[:, :1]).sum()) * 0.0


class BlockDiffusionServing(ServingSpec):
    """Serves a block-diffusion checkpoint, or a causal LM converted on load (untrained: a warning says so)."""

    def load(self, path, config, init_kwargs, block_size):
        if config.model_type != BlockDiffusionConfig.model_type:
            check_causal_lm_config(config, path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        if config.model_type == BlockDiffusionConfig.model_type:
            check_mask_token(tokenizer, config, path)
            return load_pretrained(AutoModel.from_pretrained, path, **init_kwargs), tokenizer
        logger.warning("%s is a causal LM: converting it to a block diffusion LM (block size %d, no training)", path,
                       block_size)
        causal = load_pretrained(AutoModelForCausalLM.from_pretrained, path, **init_kwargs)
        model, tokenizer = convert_causal_lm(causal, tokenizer, block_size=block_size)
        model.generation_config.eos_token_id = causal.generation_config.eos_token_id
        return model, tokenizer

    def decoder(self, model, tokenizer):
        return BlockDiffusionServingDecoder(model, tokenizer)

    def decoding_variants(self, decoder):
        """The decoding techniques, each on its own over one baseline (threshold 0.9, EOS honoured at the block's
        end, every technique off), all of them together, and the references: one token per step, and no stop at
        EOS (the whole budget)."""
        none = dict(fuse_block_commit=False, eos_early_exit=False, compact_batch=False)
        sub = max(1, decoder.model.config.block_size // 4)
        plain = dict(confidence_threshold=0.9, steps_per_block=None, **none)
        variants = {
            "one per step": DecodingVariant(decoder.with_generation(confidence_threshold=None, steps_per_block=None),
                                            reference=True, description="one position per step (the reference)"),
            "threshold 0.9": DecodingVariant(decoder.with_generation(**plain),
                                             description="confidence >= 0.9 in parallel; every technique off"),
            "to max_new_tokens": DecodingVariant(decoder.with_generation(**plain), ignore_eos=True,
                                                 baseline="threshold 0.9",
                                                 description="no stop at EOS: the whole budget, cut after"),
            "no KV cache": DecodingVariant(decoder.with_generation(use_cache=False, **plain), baseline="threshold 0.9",
                                           description="the clean prefix recomputed at every step"),
        }
        for name, fields, what in (
                ("+ fused commit", dict(fuse_block_commit=True), "a block's clean rows run with the next block's step"),
                ("+ EOS exit", dict(eos_early_exit=True), "a row stops at the step its EOS settles"),
                ("+ compact batch", dict(compact_batch=True), "rows done with the block sit out the others' steps"),
                ("+ min 2 per step", dict(min_tokens_per_step=2), "at least 2 positions per step"),
                (f"+ sub-blocks {sub}", dict(sub_block_size=sub), f"left to right in sub-blocks of {sub}"),
                (f"+ sub-block cache {sub}", dict(sub_block_size=sub, block_cache=True),
                 "sub-blocks; a sub-block's later steps run its rows only")):
            variants[name] = DecodingVariant(decoder.with_generation(**{**plain, **fields}), baseline="threshold 0.9",
                                             description=what)
        exact = dict(confidence_threshold=0.9, steps_per_block=None, fuse_block_commit=True, eos_early_exit=True,
                     compact_batch=True)
        variants["exact techniques"] = DecodingVariant(decoder.with_generation(**exact), baseline="threshold 0.9",
                                                       description="fused commit, EOS exit, compact batch")
        variants[f"all, sub-block cache {sub}"] = DecodingVariant(
            decoder.with_generation(**exact, sub_block_size=sub, block_cache=True), baseline="exact techniques",
            description="the exact techniques + sub-blocks and their cache")
        return variants


class BlockDiffusionEvaluation(EvaluationSpec):
    """lm-eval scores what ``hf-bdlm serve`` loads, its likelihood by the absorbing-noise bound."""

    def likelihood_scorer(self, model, tokenizer):
        return BlockDiffusionLikelihoodScorer(model, tokenizer)


class BlockDiffusionPolicySpec(PolicySpec):
    """GRPO over a trained block-diffusion checkpoint: rollouts by its serving decoder (the ragged block decoder, its
    techniques and threshold as the run sets them), log-probabilities by every estimator
    (:mod:`.training.policy`)."""

    estimators = BlockDiffusionPolicy.estimators

    def load(self, path, config, init_kwargs):
        if config.model_type != BlockDiffusionConfig.model_type:
            raise ValueError(
                f"{path} holds a causal LM (model_type={config.model_type!r}), not a block-diffusion model: GRPO "
                "improves a policy that already decodes. Convert and fine-tune it first (hf-bdlm train, "
                "docs/usage.md), then pass the trained folder (or run TRL's GRPOTrainer on the causal LM itself).")
        return self.family.role("serving", path).load(path, config, init_kwargs, DEFAULT_CONVERSION_BLOCK_SIZE)

    def check_args(self, args) -> None:
        if args.min_p is not None or args.repetition_penalty != 1.0:
            raise ValueError(f"min_p={args.min_p!r}, repetition_penalty={args.repetition_penalty!r}: the block decoder "
                             "applies neither (temperature, top_k and top_p it does); leave them unset.")

    def policy(self, model, tokenizer, args):
        inner = unwrap_model(model)
        eos = inner.generation_config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        if tokenizer is not None and tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
            eos = [tokenizer.eos_token_id, *eos]
        pad = getattr(tokenizer, "pad_token_id", None)
        decoder = self.family.role("serving").decoder(inner, tokenizer)
        return BlockDiffusionPolicy(decoder.with_generation(**rollout_fields(args, eos, pad)))


class BlockDiffusionFamily(ModelFamily):
    name = "block_diffusion"
    converts_causal_lms = True
    roles = {"training": BlockDiffusionTraining, "serving": BlockDiffusionServing,
             "evaluation": BlockDiffusionEvaluation, "planning": PlanningSpec, "policy": BlockDiffusionPolicySpec}
    refusals = {"drafting": "--draft takes a drafter folder; pass a drafter folder, or serve it without --draft."}

    def claims_model(self, model) -> bool:
        return isinstance(unwrap_model(model), BlockDiffusionForMaskedLM)

    def block_size(self, model) -> int:
        return int(unwrap_model(model).config.block_size)

    def new_config(self, **fields):
        return BlockDiffusionConfig(**fields)

    def new_model(self, config):
        return BlockDiffusionForMaskedLM(config)

    def render_card(self, directory: os.PathLike, config: dict, info: dict | None) -> str:
        return render_block_diffusion_card(directory, config, info)


def check_causal_lm_config(config, path) -> None:
    """Refuse, from the config alone, a checkpoint that is neither a registered family's nor a decoder-only causal LM
    (an encoder such as BERT has a causal-LM class in transformers, but nothing to convert)."""
    model_type = getattr(config, "model_type", None)
    if (model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES
            and not getattr(config, "is_encoder_decoder", False)):
        return
    families = sorted(t for e in REGISTRY for t in e.model_types)
    raise ValueError(
        f"{path} holds a model_type={model_type!r} checkpoint, which hf_bdlm cannot load: it loads the model types "
        f"of its families {families} and converts decoder-only causal LMs (transformers' AutoModelForCausalLM types "
        "without a masked-LM head, e.g. 'llama', 'qwen2', 'mistral', 'gemma3_text'). Pass such a checkpoint folder."
    )


def check_mask_token(tokenizer, config, path) -> None:
    """The tokenizer of a block-diffusion folder must be the one saved with it: its mask token is the model's
    ``mask_token_id`` (the token the noise writes and the decoder fills in)."""
    mask_id = config.mask_token_id
    if tokenizer is None or getattr(tokenizer, "mask_token_id", None) == mask_id:
        return
    folder = os.fspath(path)
    where = os.path.join(folder, "tokenizer_config.json") if os.path.isdir(folder) else f"the tokenizer of {folder}"
    found = getattr(tokenizer, "mask_token", None)
    has = (f"its mask token is {found!r} (id {tokenizer.mask_token_id})" if found is not None else
           "it has no mask token")
    raise BadCheckpointFile(
        f"{where}: {has}, but the model's config gives mask_token_id={mask_id} (the token the model denoises). The "
        "tokenizer is not the one saved with the model (the source causal LM's, without the [MASK] token that "
        "convert_causal_lm adds?). Save the converted tokenizer into the folder (tokenizer.save_pretrained(folder), "
        "with the tokenizer convert_causal_lm returned), or pass it as processing_class."
    )
