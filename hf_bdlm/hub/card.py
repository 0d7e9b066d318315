"""Model cards: `README.md` of a saved block-diffusion model, rendered from the packaged template.

The card is filled from the saved folder itself (``config.json``, ``generation_config.json``, the safetensors headers
for the parameter count, the tokenizer files) and from an ``info`` dict for what a folder cannot know: the training
layout, the dataset and the metrics. Example::

    from hf_bdlm.hub import write_model_card
    model.save_pretrained("out")
    write_model_card("out", {"base_model": "HuggingFaceTB/SmolLM2-135M-Instruct", "dataset": "hf_bdlm arith",
                             "parallel": {"mode": "csbp", "P": 2, "C": 2, "transport": "allgather", "world": 2},
                             "metrics": {"loss": 0.41, "masked_token_accuracy": 0.87, "exact_match": 0.62}})
"""

from __future__ import annotations

import importlib.resources
import os
from pathlib import Path

from .card_parts import (
    METRIC_LABELS,
    OBJECTIVES,
    as_list,
    base_model_text,
    check_info,
    dataset_link,
    format_value,
    hub_repo_id,
    layout_rows,
    layout_text,
    parameters_text,
    read_json,
    unique,
)
from .diffusion_gemma_card import render_diffusion_gemma_card

TEMPLATE_FILE = "model_card.md"

_WEIGHTINGS = {"inverse_t": "weighted by `1/t` (the ELBO)", "unit": "unit weights"}
CLEAN_ATTENTION = {
    "block_causal": "a clean token sees its whole block and every earlier block",
    "causal": "token-causal, a clean token sees itself and earlier tokens, as in the causal LM",
}
GENERATION_KNOBS = {
    "block_size": "tokens per decoding block; `None` = the model's `block_size`",
    "steps_per_block": "denoising steps per block; `None` = until the block is unmasked",
    "confidence_threshold": "unmask every position at least this confident in the same step (parallel decoding)",
    "token_shift": "logit `i - 1` predicts token `i`; `None` = follow the objective",
    "max_new_tokens": "tokens to generate (default: one block)",
    "do_sample": "sample instead of taking the most likely token",
    "temperature": "sampling temperature",
    "top_k": "sampling: keep the k most likely tokens",
    "top_p": "sampling: nucleus probability mass",
    "eos_token_id": "generation stops after the block holding the first EOS",
    "pad_token_id": "fills rows that ended early",
}


def template_text() -> str:
    """The packaged model-card template (Jinja2)."""
    return importlib.resources.files("hf_bdlm.hub").joinpath(TEMPLATE_FILE).read_text(encoding="utf-8")


def write_model_card(output_dir: str | os.PathLike, info: dict | None = None) -> Path:
    r"""
    Render the model card of a saved block-diffusion model into `output_dir/README.md`.

    Args:
        output_dir (`str` or `os.PathLike`):
            A folder written by `save_pretrained` (it must hold `config.json`).
        info (`dict`, *optional*):
            What the folder cannot tell; every key is optional (see `CARD_INFO_KEYS`): `model_name`, `repo_id`,
            `description`, `base_model`, `objective`, `parallel` (`{"mode", "P", "C", "transport", "world"}`),
            `dataset`, `metrics` (`{"loss", "masked_token_accuracy", "exact_match", ...}`), `training`, `license`,
            `tags`.

    Returns:
        `Path` of the written `README.md`.
    """
    from huggingface_hub import ModelCard

    directory = Path(output_dir)
    card = ModelCard(render_model_card(directory, info))
    path = directory / "README.md"
    card.save(path)
    return path


def render_model_card(output_dir: str | os.PathLike, info: dict | None = None) -> str:
    """The card's text (see :func:`write_model_card`)."""
    import jinja2
    from huggingface_hub import ModelCardData

    from ..version import __version__

    directory = Path(output_dir)
    info = check_info(info)
    config = read_json(directory / "config.json")
    if config is None:
        raise FileNotFoundError(
            f"{directory} has no config.json: save the model first (model.save_pretrained(output_dir), or "
            "hf_bdlm.hub.save_for_hub), then write its card."
        )
    if config.get("model_type") == "diffusion_gemma":  # transformers' DiffusionGemma, fine-tuned by hf_bdlm
        return render_diffusion_gemma_card(directory, config, info)
    if config.get("model_type") != "block_diffusion":
        raise ValueError(
            f"{directory}/config.json is a {config.get('model_type')!r} config, not a block-diffusion model "
            "(model_type 'block_diffusion'); convert it with hf_bdlm.convert_causal_lm first."
        )
    backbone = config.get("backbone_config") or {}
    generation = read_json(directory / "generation_config.json") or {}
    objective = info.get("objective", config.get("objective", "standard"))
    base_model = info.get("base_model") or hub_repo_id(backbone.get("_name_or_path"))
    datasets = as_list(info.get("dataset"))
    model_type = backbone.get("model_type", "unknown")

    card_data = ModelCardData(
        library_name="hf-bdlm",
        base_model=base_model,
        tags=unique(["block-diffusion", "hf-bdlm", "diffusion-language-model", model_type, objective]
                     + ([info["parallel"]["mode"]] if info.get("parallel", {}).get("mode") else [])
                     + as_list(info.get("tags"))),
        pipeline_tag="text-generation",
        datasets=[d for d in datasets if hub_repo_id(d)] or None,
        license=info.get("license", "unknown"),
    )
    tokenizer_config = read_json(directory / "tokenizer_config.json")
    values = dict(
        card_data=card_data.to_yaml(),
        model_name=info.get("model_name") or directory.resolve().name,
        description=info.get("description"),
        model_id=info.get("repo_id") or directory.resolve().name,
        hf_bdlm_version=__version__,
        block_size=config.get("block_size"),
        mask_token_id=config.get("mask_token_id"),
        attention_backend=config.get("attention_backend"),
        dtype=config.get("dtype") or "float32",
        base_model_text=base_model_text(base_model, backbone.get("_name_or_path")),
        backbone_text=_backbone_text(backbone),
        parameters_text=parameters_text(directory),
        objective_text=_objective_text(objective, config.get("loss_weighting")),
        clean_attention_text=f"`{config.get('clean_attention')}` — "
        + CLEAN_ATTENTION.get(config.get("clean_attention"), "see hf_bdlm.attention.masks"),
        layout_text=layout_text(info.get("parallel")),
        layout_rows=layout_rows(info.get("parallel")),
        dataset_text=", ".join(dataset_link(d) for d in datasets) + "." if datasets else "Not recorded.",
        training_rows=[(k, format_value(v)) for k, v in (info.get("training") or {}).items()],
        metric_rows=[(METRIC_LABELS.get(k, k), format_value(v)) for k, v in (info.get("metrics") or {}).items()],
        has_tokenizer=tokenizer_config is not None or (directory / "tokenizer.json").is_file(),
        has_chat_template=(directory / "chat_template.jinja").is_file()
        or bool((tokenizer_config or {}).get("chat_template")),
        example_max_new_tokens=generation.get("max_new_tokens") or 2 * int(config.get("block_size") or 32),
        example_threshold=generation.get("confidence_threshold") or 0.9,
        generation_rows=[
            (k, format_value(generation[k]) if k in generation else "default", meaning)
            for k, meaning in GENERATION_KNOBS.items()
        ],
    )
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    return env.from_string(template_text()).render(**values).strip() + "\n"


# --- pieces ------------------------------------------------------------------------------------------


def _backbone_text(backbone: dict) -> str:
    architecture = (backbone.get("architectures") or [None])[0]
    parts = [f"`{backbone.get('model_type', 'unknown')}`" + (f" (`{architecture}`)" if architecture else "")]
    for key, label in (("num_hidden_layers", "layers"), ("hidden_size", "hidden"), ("num_attention_heads", "heads"),
                       ("num_key_value_heads", "KV heads"), ("vocab_size", "vocabulary")):
        if backbone.get(key) is not None:
            parts.append(f"{backbone[key]} {label}")
    return ", ".join(parts)


def _objective_text(objective: str, weighting: str | None) -> str:
    text = f"`{objective}` — " + OBJECTIVES.get(objective, "see hf_bdlm.objectives")
    if objective == "standard" and weighting in _WEIGHTINGS:
        text += ", " + _WEIGHTINGS[weighting]
    return text
