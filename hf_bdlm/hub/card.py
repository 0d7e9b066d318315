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
import json
import os
import re
from pathlib import Path

TEMPLATE_FILE = "model_card.md"

CARD_INFO_KEYS = {
    "model_name": "title of the card (default: the folder's name)",
    "repo_id": "Hub repo id used in the loading snippets (default: the folder's name)",
    "description": "a paragraph under the title",
    "base_model": "Hub id of the checkpoint this model was converted or fine-tuned from (default: the backbone "
    "config's `_name_or_path` when it is a Hub id)",
    "objective": "the training objective (default: `config.objective`)",
    "parallel": "the training layout: dict with mode, P, C, transport, world (or the BDLMSFTConfig names "
    "block_parallel_mode, block_parallel_size, clean_ring_size, block_parallel_transport, and world_size)",
    "dataset": "dataset name(s): a string or a list",
    "metrics": "dict metric -> value, e.g. loss, masked_token_accuracy, exact_match",
    "training": "dict of training hyperparameters to list (steps, learning_rate, ...)",
    "license": "license identifier for the Hub (default: `unknown`)",
    "tags": "extra Hub tags",
}

_PARALLEL_KEYS = {
    "mode": "mode",
    "block_parallel_mode": "mode",
    "P": "P",
    "block_parallel_size": "P",
    "C": "C",
    "clean_ring_size": "C",
    "transport": "transport",
    "block_parallel_transport": "transport",
    "world": "world",
    "world_size": "world",
    "schedule": "schedule",
    "block_schedule": "schedule",
}

OBJECTIVES = {
    "standard": "BD3-LM, absorbing `[MASK]` noise with one masking rate `t` per block; the loss is the cross-entropy "
    "of the masked tokens",
    "fast_dllm_v2": "Fast-dLLM v2 (AR to block-diffusion conversion), token shift (the logit at position `i - 1` "
    "predicts token `i`, as in the causal LM), two complementary masks per sequence, unit weights, block-causal clean "
    "stream",
    "fast_dllm_v2_causal_clean": "Fast-dLLM v2 with the clean stream kept token-causal, identical to the source causal "
    "LM (its KV cache is the causal LM's own), a block's first token predicted by the clean row before it",
    "diffusion_gemma": "DiffusionGemma, uniform-state noise with self-conditioning, plus the encoder's next-token loss",
    "dflash": "DFlash, a block drafter distilled from a frozen target model's features (speculative decoding)",
}
_WEIGHTINGS = {"inverse_t": "weighted by `1/t` (the ELBO)", "unit": "unit weights"}
CLEAN_ATTENTION = {
    "block_causal": "a clean token sees its whole block and every earlier block",
    "causal": "token-causal, a clean token sees itself and earlier tokens, as in the causal LM",
}
MODES = {
    "csbp": "context-sharded block parallelism: noisy blocks split over the P ranks of a group, the clean stream "
    "sharded over a ring of C ranks",
    "bp": "block parallelism: noisy blocks split over the P ranks of a group, the clean stream computed by each rank",
    "cp": "context parallelism (baseline): the clean and noisy rows sharded head-tail over the P ranks",
}
METRIC_LABELS = {
    "loss": "Loss (training objective)",
    "eval_loss": "Held-out loss",
    "masked_token_accuracy": "Masked-token accuracy",
    "masked_accuracy": "Masked-token accuracy",
    "exact_match": "Exact match",
    "exact_match_before": "Exact match before training",
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
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")  # namespace/name


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
        from .diffusion_gemma_card import render_diffusion_gemma_card

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


def check_info(info: dict | None) -> dict:
    info = dict(info or {})
    unknown = sorted(set(info) - set(CARD_INFO_KEYS))
    if unknown:
        raise ValueError(
            f"unknown model-card info keys {unknown}; the card takes: "
            + "; ".join(f"{k} ({v})" for k, v in CARD_INFO_KEYS.items())
        )
    if info.get("parallel") is not None:
        if not isinstance(info["parallel"], dict):
            raise ValueError(f"info['parallel'] must be a dict, got {type(info['parallel']).__name__}.")
        parallel = {}
        for key, value in info["parallel"].items():
            if key not in _PARALLEL_KEYS:
                raise ValueError(
                    f"unknown key {key!r} in info['parallel']; use mode, P, C, transport, world (and schedule)."
                )
            parallel[_PARALLEL_KEYS[key]] = value
        if parallel.get("mode") is not None and parallel["mode"] not in MODES:
            raise ValueError(f"info['parallel']['mode'] must be one of {tuple(MODES)}, got {parallel['mode']!r}.")
        info["parallel"] = parallel
    for key in ("metrics", "training"):
        if info.get(key) is not None and not isinstance(info[key], dict):
            raise ValueError(f"info[{key!r}] must be a dict of name -> value, got {type(info[key]).__name__}.")
    return info


def read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def as_list(value) -> list:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def unique(items: list) -> list:
    return list(dict.fromkeys(i for i in items if i))


def hub_repo_id(name: str | None) -> str | None:
    """``name`` when it reads as a Hub repo id (``namespace/name``) and is not a local path, else ``None``."""
    if not name or not _HUB_ID.match(name) or os.path.exists(name):
        return None
    return name


def base_model_text(base_model: str | None, name_or_path: str | None) -> str:
    if base_model:
        return f"[{base_model}](https://huggingface.co/{base_model})"
    if name_or_path:
        return f"`{Path(name_or_path).name}` (a local checkpoint)"
    return "not recorded (trained from a fresh initialisation, or converted without a recorded name)"


def _backbone_text(backbone: dict) -> str:
    architecture = (backbone.get("architectures") or [None])[0]
    parts = [f"`{backbone.get('model_type', 'unknown')}`" + (f" (`{architecture}`)" if architecture else "")]
    for key, label in (("num_hidden_layers", "layers"), ("hidden_size", "hidden"), ("num_attention_heads", "heads"),
                       ("num_key_value_heads", "KV heads"), ("vocab_size", "vocabulary")):
        if backbone.get(key) is not None:
            parts.append(f"{backbone[key]} {label}")
    return ", ".join(parts)


def parameters_text(directory: Path) -> str:
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return "unknown (no safetensors weights in the folder)"
    total = 0
    for file in files:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                numel = 1
                for size in f.get_slice(key).get_shape():
                    numel *= size
                total += numel
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if total >= scale:
            return f"{total / scale:.3g}{suffix} ({total:,})"
    return f"{total:,}"


def _objective_text(objective: str, weighting: str | None) -> str:
    text = f"`{objective}` — " + OBJECTIVES.get(objective, "see hf_bdlm.objectives")
    if objective == "standard" and weighting in _WEIGHTINGS:
        text += ", " + _WEIGHTINGS[weighting]
    return text


def layout_text(parallel: dict | None) -> str:
    if not parallel:
        return "Not recorded (a single process, or a run that did not report its layout)."
    mode = parallel.get("mode")
    text = f"`{mode}` — " + MODES[mode] if mode else "mode not recorded"
    return text + ". The loss and gradients equal the single-device reference for every layout."


def layout_rows(parallel: dict | None) -> list[tuple[str, str]]:
    if not parallel:
        return []
    rows = []
    labels = (("mode", "Mode"), ("P", "Block-parallel group size P"), ("C", "Clean ring size C"),
              ("transport", "Clean K/V transport"), ("schedule", "Block schedule"), ("world", "World size W"))
    for key, label in labels:
        if parallel.get(key) is not None:
            rows.append((label, f"`{parallel[key]}`" if isinstance(parallel[key], str) else str(parallel[key])))
    world, group = parallel.get("world"), parallel.get("P")
    if isinstance(world, int) and isinstance(group, int) and group > 0 and world % group == 0:
        rows.append(("Data-parallel replicas D = W / P", str(world // group)))
    return rows


def dataset_link(name: str) -> str:
    return f"[{name}](https://huggingface.co/datasets/{name})" if hub_repo_id(name) else f"`{name}`"


def format_value(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
        return str(value)
    return f"`{value}`"
