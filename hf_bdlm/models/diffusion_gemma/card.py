"""The model card of a fine-tuned DiffusionGemma (a plain transformers checkpoint trained by hf_bdlm).

`hf_bdlm.hub.write_model_card` renders it when the saved `config.json` is a `diffusion_gemma` one; the info dict is
the same as for block-diffusion checkpoints (`CARD_INFO_KEYS`), its `training` entries listing the objective's
settings (`DiffusionGemmaObjective.card_settings`)::

    model.save_pretrained("out"); tokenizer.save_pretrained("out")
    write_model_card("out", {"training": {"self_conditioning_prob": 0.5, "ar_loss_weight": 1.0}})
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

from ...protocols.card_parts import (
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
from .engines import decoding_settings, launch_commands

TEMPLATE_FILE = "model_card.md"
SETTING_LABELS = {
    "objective": "Objective",
    "canvas_length": "Canvas length",
    "noise_eps": "Replacement rate `t` range",
    "self_conditioning_prob": "Self-conditioning probability",
    "ar_loss_weight": "Encoder next-token loss weight",
    "model_prediction_type": "Model prediction type",
}


def template_text() -> str:
    return importlib.resources.files(__package__).joinpath(TEMPLATE_FILE).read_text(encoding="utf-8")


def render_diffusion_gemma_card(directory: Path, config: dict, info: dict | None) -> str:
    """The card's text for a saved DiffusionGemma folder (``config`` is its parsed ``config.json``)."""
    import jinja2
    from huggingface_hub import ModelCardData

    info = check_info(info)
    text = config.get("text_config") or {}
    base_model = info.get("base_model") or hub_repo_id(config.get("_name_or_path"))
    datasets = as_list(info.get("dataset"))
    training = dict(info.get("training") or {})
    prediction = training.get("model_prediction_type", "mean")
    card_data = ModelCardData(
        library_name="transformers",
        base_model=base_model,
        tags=unique(["diffusion_gemma", "block-diffusion", "hf-bdlm", "diffusion-language-model"]
                     + ([info["parallel"]["mode"]] if info.get("parallel", {}).get("mode") else [])
                     + as_list(info.get("tags"))),
        pipeline_tag="text-generation",
        datasets=[d for d in datasets if hub_repo_id(d)] or None,
        license=info.get("license", "unknown"),
    )
    tokenizer_config = read_json(directory / "tokenizer_config.json")
    generation = read_json(directory / "generation_config.json") or {}
    canvas = config.get("canvas_length")
    window = text.get("sliding_window")
    settings = decoding_settings(directory)
    commands = launch_commands(info.get("repo_id") or str(directory), canvas, settings)
    values = dict(
        card_data=card_data.to_yaml(),
        model_name=info.get("model_name") or directory.resolve().name,
        description=info.get("description"),
        model_id=info.get("repo_id") or directory.resolve().name,
        canvas_length=canvas,
        window_reach=f"W - 1 = {window - 1}" if window else "W - 1",
        base_model_text=base_model_text(base_model, config.get("_name_or_path")),
        architecture_text=_architecture_text(config, text),
        parameters_text=parameters_text(directory),
        attention_text=_attention_text(text),
        dtype=config.get("dtype") or text.get("dtype") or "float32",
        objective_text="`diffusion_gemma` — " + OBJECTIVES["diffusion_gemma"] + ".",
        settings_rows=[(SETTING_LABELS.get(k, k), format_value(v)) for k, v in training.items()],
        loo=prediction == "mean_loo",
        layout_text=layout_text(info.get("parallel")),
        layout_rows=layout_rows(info.get("parallel")),
        dataset_text=", ".join(dataset_link(d) for d in datasets) + "." if datasets else "Not recorded.",
        metric_rows=[(METRIC_LABELS.get(k, k), format_value(v)) for k, v in (info.get("metrics") or {}).items()],
        has_chat_template=(directory / "chat_template.jinja").is_file()
        or bool((tokenizer_config or {}).get("chat_template")),
        example_max_new_tokens=generation.get("max_new_tokens") or 2 * int(canvas or 32),
        **settings,
        vllm_command=commands["vllm"],
        sglang_command=commands["sglang"],
    )
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    return env.from_string(template_text()).render(**values).strip() + "\n"


def _architecture_text(config: dict, text: dict) -> str:
    architecture = (config.get("architectures") or ["DiffusionGemmaForBlockDiffusion"])[0]
    parts = [f"`{architecture}`"]
    for key, label in (("num_hidden_layers", "layers"), ("hidden_size", "hidden"), ("num_attention_heads", "heads"),
                       ("vocab_size", "vocabulary")):
        if text.get(key) is not None:
            parts.append(f"{text[key]} {label}")
    if text.get("num_experts"):
        parts.append(f"MoE {text['num_experts']} experts, top-{text.get('top_k_experts')}")
    return ", ".join(parts) + "; encoder and decoder share their weights"


def _attention_text(text: dict) -> str:
    types = text.get("layer_types") or []
    sliding = sum(t == "sliding_attention" for t in types)
    if not sliding:
        return "full attention on every layer"
    return (f"sliding window W = {text.get('sliding_window')} on {sliding} of {len(types)} layers, full attention "
            "on the others")
