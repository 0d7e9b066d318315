"""The model card of a block-diffusion checkpoint (a converted causal LM), rendered from the packaged template.

`hf_bdlm.hub.write_model_card` renders it for a ``block_diffusion`` config (see that function for the ``info`` dict).
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

from ...protocols.card_parts import (
    METRIC_LABELS,
    OBJECTIVES,
    as_list,
    base_model_text,
    dataset_link,
    format_value,
    hub_repo_id,
    layout_rows,
    layout_text,
    parameters_text,
    read_json,
    unique,
)

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
    "unmasking": "which positions a step fixes: `hf_bdlm`, or SGLang's / LMDeploy's rule (`docs/deploy.md`)",
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
    return importlib.resources.files(__package__).joinpath(TEMPLATE_FILE).read_text(encoding="utf-8")


def render_block_diffusion_card(directory: Path, config: dict, info: dict) -> str:
    """The card's text for a saved block-diffusion folder (``config``: its parsed ``config.json``; ``info`` checked)."""
    import jinja2
    from huggingface_hub import ModelCardData

    from ...version import __version__

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
