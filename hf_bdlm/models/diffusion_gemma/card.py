"""The model card of a fine-tuned DiffusionGemma (a plain transformers checkpoint trained by hf_bdlm).

`hf_bdlm.hub.write_model_card` renders it when the saved `config.json` is a `diffusion_gemma` one; the info dict is
the same as for block-diffusion checkpoints (`CARD_INFO_KEYS`), its `training` entries listing the objective's
settings (`DiffusionGemmaObjective.card_settings`)::

    model.save_pretrained("out"); tokenizer.save_pretrained("out")
    write_model_card("out", {"training": {"self_conditioning_prob": 0.5, "ar_loss_weight": 1.0}})
"""

from __future__ import annotations

from pathlib import Path

from ...protocols.card_parts import (
    check_info,
    format_value,
    hub_repo_id,
    read_json,
    render_card_template,
    trained_card_values,
)
from .inference.engines import decoding_settings, launch_commands

OBJECTIVE_TEXT = "DiffusionGemma, uniform-state noise with self-conditioning, plus the encoder's next-token loss"

TEMPLATE_FILE = "model_card.md"
SETTING_LABELS = {
    "objective": "Objective",
    "canvas_length": "Canvas length",
    "noise_eps": "Replacement rate `t` range",
    "self_conditioning_prob": "Self-conditioning probability",
    "ar_loss_weight": "Encoder next-token loss weight",
    "model_prediction_type": "Model prediction type",
}


def render_diffusion_gemma_card(directory: Path, config: dict, info: dict | None) -> str:
    """The card's text for a saved DiffusionGemma folder (``config`` is its parsed ``config.json``)."""
    info = check_info(info)
    text = config.get("text_config") or {}
    base_model = info.get("base_model") or hub_repo_id(config.get("_name_or_path"))
    training = dict(info.get("training") or {})
    prediction = training.get("model_prediction_type", "mean")
    values = trained_card_values(
        directory, info, library_name="transformers", base_model=base_model, name_or_path=config.get("_name_or_path"),
        tags=["diffusion_gemma", "block-diffusion", "hf-bdlm", "diffusion-language-model"])
    generation = read_json(directory / "generation_config.json") or {}
    canvas = config.get("canvas_length")
    window = text.get("sliding_window")
    settings = decoding_settings(directory)
    commands = launch_commands(info.get("repo_id") or str(directory), canvas, settings)
    values.update(
        canvas_length=canvas,
        window_reach=f"W - 1 = {window - 1}" if window else "W - 1",
        architecture_text=_architecture_text(config, text),
        attention_text=_attention_text(text),
        dtype=config.get("dtype") or text.get("dtype") or "float32",
        objective_text="`diffusion_gemma` — " + OBJECTIVE_TEXT + ".",
        settings_rows=[(SETTING_LABELS.get(k, k), format_value(v)) for k, v in training.items()],
        loo=prediction == "mean_loo",
        example_max_new_tokens=generation.get("max_new_tokens") or 2 * int(canvas or 32),
        **settings,
        vllm_command=commands["vllm"],
        sglang_command=commands["sglang"],
    )
    return render_card_template(__package__, TEMPLATE_FILE, values)


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
