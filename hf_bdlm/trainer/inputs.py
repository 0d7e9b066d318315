"""What the user hands to `BDLMSFTTrainer`, resolved and checked before any work is done.

- the model: its family (``hf_bdlm.models``) is found from the checkpoint's config or the object's class and loads
  it (a causal LM is converted by the family that converts them); the objective asked for must be one of that
  family's;
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
from peft.tuners.tuners_utils import check_target_module_exists
from transformers import AutoConfig, AutoTokenizer
from trl.data_utils import get_dataset_column_names, is_conversational

from ..embedded import resolve_model_path
from ..protocols.entry import ModelFamily
from ..protocols.registry import (converting_family, entry_named, family_for_config, family_for_model,
                                  family_for_objective, family_names)
from ..protocols.step import unwrap_model
from .collator import SAMPLE_ID_COLUMN
from .config import BDLMSFTConfig

logger = logging.getLogger(__name__)

def load_diffusion_model(model, processing_class, args: BDLMSFTConfig):
    """Resolve ``model`` to a model of a registered family and its tokenizer (causal LMs are converted).

    Returns:
        `(model, processing_class, base_model_name, family)`.
    """
    if isinstance(model, (str, os.PathLike)):
        name = os.fspath(model)
        path = resolve_model_path(name)  # embedded:smollm2 -> its exported folder (exported on first use)
        config = AutoConfig.from_pretrained(path, trust_remote_code=args.trust_remote_code)
        family = family_for_config(config)
        _check_objective_fits(args, family, config.model_type)
        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(path, trust_remote_code=args.trust_remote_code)
        training = family.role("training", path)
        loaded, processing_class = training.load(path, config, args, processing_class, _model_init_kwargs(args))
        return loaded, processing_class, name, family
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"model must be a path or a model object, got {type(model).__name__}; pass a model of a family hf_bdlm "
            f"trains {family_names()}, a causal LM to convert, or a local checkpoint folder."
        )
    base_name = getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__
    inner = unwrap_model(model)
    family = family_for_model(inner)
    model_type = getattr(getattr(inner, "config", None), "model_type", "")
    if family is None:
        family = converting_family()
    _check_objective_fits(args, family, model_type)
    if processing_class is None:
        processing_class = _tokenizer_near(model)
    model, processing_class = family.role("training", base_name).adopt(model, processing_class, args)
    return model, processing_class, base_name, family


def _check_objective_fits(args: BDLMSFTConfig, family: ModelFamily, model_type: str) -> None:
    """The objective asked for must be one the model's family trains."""
    trains = entry_named(family.name).objectives
    if args.objective is None or args.objective in trains:
        return
    owner = family_for_objective(args.objective)
    raise ValueError(
        f"objective={args.objective!r} trains the {owner.name!r} family ({', '.join(owner.model_types)} models); got "
        f"a {model_type!r} model of the {family.name!r} family, which trains {list(trains)}. Pass a model "
        f"of the {owner.name!r} family, or leave objective unset (the model's own)."
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

    A family with reference targets (``TrainingSpec.default_lora_targets``) gets them when `target_modules` is
    unset (set on `peft_config`).
    """
    family = family_for_model(model)
    defaults = family.role("training").default_lora_targets(model) if family is not None else None
    if defaults is not None and getattr(peft_config, "target_modules", None) is None:
        if not getattr(peft_config, "target_parameters", None):
            logger.info("LoRA target_modules unset: using the %s family's reference targets %s", family.name, defaults)
            peft_config.target_modules = defaults
    targets = getattr(peft_config, "target_modules", None)
    if targets is None:
        if getattr(peft_config, "target_parameters", None):
            return
        model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise ValueError(
            f"peft_config.target_modules is not set, and PEFT cannot infer LoRA targets for model_type "
            f"{model_type!r}. Name them, e.g. target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj'] or "
            "'all-linear'."
        )
    if targets == "all-linear":
        return
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
