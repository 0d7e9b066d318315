"""What the user hands to `BDLMSFTTrainer`, resolved and checked before any work is done.

- the model: a BDLM (object or checkpoint folder) is used as is; a causal LM (object or folder) is converted with
  `convert_causal_lm`; the config's diffusion fields are written into the model's config; transformers'
  `DiffusionGemmaForBlockDiffusion` (object or folder) trains as it is with the `diffusion_gemma` objective, whose
  settings stay out of its config (the checkpoint remains a plain DiffusionGemma one);
- the datasets: each must carry the fields its TRL format needs; the global sample index column is added;
- the PEFT config: LoRA must target modules that exist.

Each check raises before anything is loaded into the trainer, converted or written, with the value received and
what to do.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Any

import datasets
import torch
from accelerate.utils import is_peft_model
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from trl.data_utils import get_dataset_column_names, is_conversational

from ..configuration import TOKEN_SHIFT_OBJECTIVES, BlockDiffusionConfig
from ..diffusion_gemma import (
    diffusion_gemma_class,
    is_diffusion_gemma,
    is_diffusion_gemma_config,
    unwrap_diffusion_gemma,
    use_block_diffusion_attention,
)
from ..modeling import BlockDiffusionForMaskedLM
from ..objectives import Objective, get_objective
from .collator import SAMPLE_ID_COLUMN
from .config import BDLMSFTConfig

logger = logging.getLogger(__name__)

DEFAULT_CONVERSION_BLOCK_SIZE = 32


def load_diffusion_model(model, processing_class, args: BDLMSFTConfig):
    """Resolve ``model`` to a block-diffusion model and its tokenizer; convert causal LMs.

    Returns:
        `(model, processing_class, base_model_name)`.
    """
    from ..conversion import convert_causal_lm

    convert_kwargs = {"block_size": args.block_size or DEFAULT_CONVERSION_BLOCK_SIZE, "seed": args.seed}
    if args.objective is not None:
        convert_kwargs["objective"] = args.objective
    if args.attention_backend is not None:
        convert_kwargs["attention_backend"] = args.attention_backend
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        kwargs = _model_init_kwargs(args)
        config = AutoConfig.from_pretrained(path, trust_remote_code=args.trust_remote_code)
        _check_objective_fits(args, is_diffusion_gemma_config(config), config.model_type)
        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(path, trust_remote_code=args.trust_remote_code)
        if is_diffusion_gemma_config(config):
            loaded = diffusion_gemma_class().from_pretrained(path, **kwargs)
        elif config.model_type == BlockDiffusionConfig.model_type:
            loaded = AutoModel.from_pretrained(path, **kwargs)
        else:
            causal = AutoModelForCausalLM.from_pretrained(path, **kwargs)
            loaded, processing_class = convert_causal_lm(causal, processing_class, **convert_kwargs)
            logger.info("converted causal LM %s into a block diffusion model (block size %d, mask token id %d)",
                        path, loaded.config.block_size, loaded.config.mask_token_id)
        return loaded, processing_class, path
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"model must be a path or a model object, got {type(model).__name__}; pass a BlockDiffusionForMaskedLM, "
            "a causal LM to convert, or a local checkpoint folder."
        )
    base_name = getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__
    inner = model.get_base_model() if is_peft_model(model) else model
    _check_objective_fits(args, is_diffusion_gemma(inner), getattr(getattr(inner, "config", None), "model_type", ""))
    if isinstance(inner, BlockDiffusionForMaskedLM) or is_diffusion_gemma(inner):
        if processing_class is None:
            processing_class = _tokenizer_near(model)
        return model, processing_class, base_name
    if isinstance(model, PreTrainedModel) and model.get_output_embeddings() is not None:
        if processing_class is None:
            processing_class = _tokenizer_near(model)
        converted, processing_class = convert_causal_lm(model, processing_class, **convert_kwargs)
        return converted, processing_class, base_name
    raise TypeError(
        f"{type(model).__name__} is neither a BlockDiffusionForMaskedLM nor a causal LM with an LM head; pass a "
        "block-diffusion model, a *ForCausalLM model to convert, or a local checkpoint folder."
    )


def _check_objective_fits(args: BDLMSFTConfig, diffusion_gemma: bool, model_type: str) -> None:
    if args.objective == "diffusion_gemma" and not diffusion_gemma:
        raise ValueError(
            f"objective='diffusion_gemma' trains transformers' DiffusionGemmaForBlockDiffusion; got a {model_type!r} "
            "model. Pass a DiffusionGemma model (object or local folder), or another objective."
        )
    if diffusion_gemma and args.objective not in (None, "diffusion_gemma"):
        raise ValueError(
            f"a DiffusionGemma model trains with objective='diffusion_gemma' (its own encoder-decoder objective), got "
            f"objective={args.objective!r}; leave objective unset or set it to 'diffusion_gemma'."
        )


def _tokenizer_near(model):
    path = getattr(model.config, "_name_or_path", "")
    if path and os.path.isdir(path):
        return AutoTokenizer.from_pretrained(path)
    raise ValueError(
        f"no processing_class was given and the model's config names no local folder to load a tokenizer from "
        f"(_name_or_path={path!r}); pass processing_class=<its tokenizer>."
    )


def _model_init_kwargs(args) -> dict[str, Any]:
    kwargs = dict(args.model_init_kwargs or {})
    dtype = kwargs.get("dtype", "float32")
    if isinstance(dtype, str) and dtype in ("bfloat16", "float16", "float32"):
        dtype = getattr(torch, dtype)
    kwargs["dtype"] = dtype
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    return kwargs


def configure_objective(model: BlockDiffusionForMaskedLM, args: BDLMSFTConfig, tokenizer=None) -> Objective:
    """Apply the config's diffusion fields to the model's config and build the objective from it.

    The saved checkpoint thus records the block size, objective and noise it was trained with. A DiffusionGemma
    model gets the `diffusion_gemma` objective instead (:func:`configure_diffusion_gemma`).
    """
    if is_diffusion_gemma(model):
        return configure_diffusion_gemma(model, args, tokenizer)
    cfg = model.config
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
    return get_objective(cfg.objective, cfg)


def configure_diffusion_gemma(model, args: BDLMSFTConfig, tokenizer=None) -> Objective:
    """The `diffusion_gemma` objective for transformers' DiffusionGemma model, from the config's fields.

    The canvas length is the model's; the fill token is the tokenizer's EOS (else the model's first EOS id); a
    response that does not end with an EOS id of the tokenizer, the text config or the generation config counts as
    truncated (its fill is not supervised). With `freeze_router` (default) the MoE routers stop training. The model's
    attention is routed through hf_bdlm when a layout is passed (``generate`` is unchanged).
    """
    from ..objectives.diffusion_gemma import DEFAULT_NOISE_EPS, DiffusionGemmaObjective

    dg = unwrap_diffusion_gemma(model)
    canvas = dg.config.canvas_length
    if args.block_size is not None and args.block_size != canvas:
        raise ValueError(
            f"block_size={args.block_size} differs from the DiffusionGemma model's canvas_length={canvas} (the block "
            "its generate denoises); leave block_size unset."
        )
    _check_diffusion_gemma_distribution(args)
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
        raise ValueError("neither the tokenizer nor the DiffusionGemma config names an EOS token to fill canvases with.")
    defaults = {"noise_eps_min": DEFAULT_NOISE_EPS, "noise_eps_max": 1.0 - DEFAULT_NOISE_EPS,
                "self_conditioning_prob": 0.5, "ar_loss_weight": 1.0, "model_prediction_type": "mean",
                "attention_backend": "blockwise"}
    for name, default in defaults.items():
        value = getattr(args, name)
        kwargs[name] = default if value is None else value
    from ..parallel.diffusion_gemma import frame_padding

    frame_multiple, canvas_multiple = frame_padding(args.parallel_dims, canvas)
    objective = DiffusionGemmaObjective(end_token_ids=ends or None, pad_to_multiple_of=frame_multiple,
                                        canvas_blocks_multiple_of=canvas_multiple, **kwargs)
    freeze_router = args.freeze_router is None or args.freeze_router
    for name, param in dg.named_parameters():
        # The objective feeds text only: the vision tower never gets a gradient (frozen, so that DDP expects none).
        if (freeze_router and ".router." in name) or name.startswith(VISION_PARAMETER_PREFIXES):
            param.requires_grad_(False)
    use_block_diffusion_attention(dg)
    return objective


VISION_PARAMETER_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")


def _check_diffusion_gemma_distribution(args: BDLMSFTConfig) -> None:
    """DDP, FSDP2 (units: the tied encoder/decoder layer pairs) and block parallelism are supported for DiffusionGemma;
    DeepSpeed is not: refuse it."""
    deepspeed = bool(args.deepspeed) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in ("1", "true")
    if deepspeed:
        raise NotImplementedError(
            "objective='diffusion_gemma' trains with DDP or FSDP2 (any world size, with block parallelism), not with "
            "DeepSpeed: its ZeRO partitioning would have to keep the tied encoder and decoder layers together, which "
            "is not built. Launch without the DeepSpeed setting, with fsdp='full_shard' and fsdp_config="
            "{'fsdp_version': 2} (or an accelerate FSDP2 config) to shard the model."
        )


def add_sample_ids(dataset, name: str = "train"):
    """Add the global sample index column (kept through tokenization; keys the noise)."""
    if dataset is None or isinstance(dataset, datasets.IterableDataset):
        return dataset
    if not isinstance(dataset, datasets.Dataset):
        raise TypeError(f"the {name} dataset must be a datasets.Dataset, got {type(dataset).__name__}.")
    if SAMPLE_ID_COLUMN in dataset.column_names:
        return dataset
    return dataset.add_column(SAMPLE_ID_COLUMN, list(range(len(dataset))))


def check_dataset_format(dataset, args: BDLMSFTConfig, formatting_func, name: str = "train") -> None:
    """Raise a clear error when the dataset lacks the fields its TRL format needs (before any work)."""
    if isinstance(dataset, datasets.IterableDataset):
        raise NotImplementedError(
            f"the {name} dataset is an IterableDataset; BDLMSFTTrainer needs a map-style datasets.Dataset (the global "
            "sample index keys the diffusion noise). Materialise it first, e.g. Dataset.from_generator."
        )
    if not isinstance(dataset, datasets.Dataset):
        raise TypeError(f"the {name} dataset must be a datasets.Dataset, got {type(dataset).__name__}.")
    if len(dataset) == 0:
        raise ValueError(f"the {name} dataset is empty.")
    columns = set(get_dataset_column_names(dataset))
    text = args.dataset_text_field
    if formatting_func is None and "input_ids" not in columns:
        if "prompt" in columns or "completion" in columns:
            missing = sorted({"prompt", "completion"} - columns)
            if missing:
                raise ValueError(
                    f"the {name} dataset has a {'prompt' if 'prompt' in columns else 'completion'!r} column but no "
                    f"{missing[0]!r} column: the prompt-completion format needs both (columns: {sorted(columns)})."
                )
        elif not ({"messages", "conversations", text} & columns):
            raise ValueError(
                f"the {name} dataset has the columns {sorted(columns)}, which match no SFT format: language "
                f"modeling needs {text!r} (set dataset_text_field for another column), prompt-completion needs "
                "'prompt' and 'completion', conversational needs 'messages', pre-tokenized data needs 'input_ids'; "
                "or pass a formatting_func."
            )
    if args.completion_only_loss and formatting_func is None and not (
        {"prompt", "completion"} <= columns or {"input_ids", "completion_mask"} <= columns
    ):
        raise ValueError(
            f"completion_only_loss=True needs a prompt-completion dataset ('prompt' and 'completion' columns); the "
            f"{name} dataset has {sorted(columns)}."
        )
    if args.assistant_only_loss and not is_conversational(dataset[0]):
        raise ValueError(
            f"assistant_only_loss=True needs a conversational dataset ('messages', or 'prompt'/'completion' as lists "
            f"of messages); the first {name} example is not conversational."
        )


def check_peft_config(peft_config):
    if peft_config is None:
        return None
    if getattr(peft_config, "task_type", None) is not None:
        peft_config = copy.deepcopy(peft_config)
        logger.info("peft_config.task_type=%r ignored: a block-diffusion model is not a causal LM.",
                    peft_config.task_type)
        peft_config.task_type = None
    return peft_config


def check_lora_targets(peft_config, model: torch.nn.Module) -> None:
    """Raise when LoRA targets nothing (PEFT cannot infer targets for this model type).

    DiffusionGemma without `target_modules` gets the reference targets (set on `peft_config`): the attention and
    dense-MLP linears of the encoder and decoder layers (router, experts, self-conditioning and vision frozen).
    """
    if is_diffusion_gemma(model) and getattr(peft_config, "target_modules", None) is None:
        if not getattr(peft_config, "target_parameters", None):
            from ..diffusion_gemma import DIFFUSION_GEMMA_LORA_TARGETS

            logger.info("LoRA target_modules unset: using DiffusionGemma's reference targets %s",
                        DIFFUSION_GEMMA_LORA_TARGETS)
            peft_config.target_modules = DIFFUSION_GEMMA_LORA_TARGETS
    targets = getattr(peft_config, "target_modules", None)
    if targets is None:
        if getattr(peft_config, "target_parameters", None):
            return
        raise ValueError(
            "peft_config.target_modules is not set, and PEFT cannot infer LoRA targets for model_type "
            "'block_diffusion'. Name them, e.g. target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj'] or "
            "'all-linear'."
        )
    if targets == "all-linear":
        return
    from peft.tuners.tuners_utils import check_target_module_exists

    names = [name for name, _ in model.named_modules() if name]
    if not any(check_target_module_exists(peft_config, name) for name in names):
        linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        shown = sorted(targets) if isinstance(targets, (set, list, tuple)) else targets
        raise ValueError(
            f"LoRA target_modules={shown!r} match no module of the model, so nothing would be trained. Its linear "
            f"layers are named {linear}."
        )


def dataset_name(dataset) -> str:
    info = getattr(dataset, "info", None)
    for attr in ("dataset_name", "builder_name"):
        value = getattr(info, attr, None)
        if value:
            return value
    return "custom"
