"""What every model family's card (``hf_bdlm/models/*/card.py``, and the cards of exported folders) shares: the info
dict's keys and checks, the label tables, the pieces of text read from a saved folder, the values every trained
model's card renders the same way (:func:`trained_card_values`) and the rendering of a packaged template
(:func:`render_card_template`). It imports no family.
"""

from __future__ import annotations

import importlib.resources
import json
import os
import re
from pathlib import Path

import jinja2
from huggingface_hub import ModelCardData
from safetensors import safe_open

CARD_INFO_KEYS = {
    "model_name": "title of the card (default: the folder's name)",
    "repo_id": "Hub repo id used in the loading snippets (default: the folder's name)",
    "description": "a paragraph under the title",
    "base_model": "Hub id of the checkpoint this model was converted or fine-tuned from (default: the backbone "
    "config's `_name_or_path` when it is a Hub id)",
    "objective": "the training objective (default: `config.objective`)",
    "parallel": "the training layout: dict with mode, P, C, transport, world (or the BDLMSFTConfig names "
    "block_parallel_mode, block_parallel_size, clean_ring_size, block_parallel_transport, block_parallel_cp_layout, "
    "tensor_parallel_size, and world_size)",
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
    "cp_layout": "cp_layout",
    "block_parallel_cp_layout": "cp_layout",
    "T": "T",
    "tensor_parallel_size": "T",
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
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")  # namespace/name


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
                    f"unknown key {key!r} in info['parallel']; use mode, P, C, transport, world (and schedule, "
                    "cp_layout, T)."
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


def parameters_text(directory: Path) -> str:
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
              ("transport", "Clean K/V transport"), ("schedule", "Block schedule"), ("cp_layout", "CP layout"),
              ("T", "Tensor-parallel size T"), ("world", "World size W"))
    for key, label in labels:
        if parallel.get(key) is not None:
            rows.append((label, f"`{parallel[key]}`" if isinstance(parallel[key], str) else str(parallel[key])))
    world, group, tp = parallel.get("world"), parallel.get("P"), parallel.get("T", 1)
    if all(isinstance(v, int) and v > 0 for v in (world, group, tp)) and world % (group * tp) == 0:
        rows.append(("Data-parallel replicas D = W / P" + (" / T" if tp > 1 else ""), str(world // (group * tp))))
    return rows


def dataset_link(name: str) -> str:
    return f"[{name}](https://huggingface.co/datasets/{name})" if hub_repo_id(name) else f"`{name}`"


def format_value(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
        return str(value)
    return f"`{value}`"


def trained_card_values(directory: Path, info: dict, *, library_name: str, tags: list[str], base_model: str | None,
                        name_or_path: str | None) -> dict:
    """The values every trained model's card renders the same way: the Hub metadata block (``card_data``: library,
    base model, ``tags`` plus the training mode and the info's tags, datasets on the Hub, license), the title, the
    description, the id of the loading snippets, the base model, the parameter count, the training layout, the
    datasets, the metrics and whether the folder holds a tokenizer and a chat template. ``info``: checked
    (:func:`check_info`); ``name_or_path``: what the base model was loaded from, when not a Hub id."""
    datasets = as_list(info.get("dataset"))
    card_data = ModelCardData(
        library_name=library_name,
        base_model=base_model,
        tags=unique(tags + ([info["parallel"]["mode"]] if info.get("parallel", {}).get("mode") else [])
                    + as_list(info.get("tags"))),
        pipeline_tag="text-generation",
        datasets=[d for d in datasets if hub_repo_id(d)] or None,
        license=info.get("license", "unknown"),
    )
    tokenizer_config = read_json(directory / "tokenizer_config.json")
    return dict(
        card_data=card_data.to_yaml(),
        model_name=info.get("model_name") or directory.resolve().name,
        description=info.get("description"),
        model_id=info.get("repo_id") or directory.resolve().name,
        base_model_text=base_model_text(base_model, name_or_path),
        parameters_text=parameters_text(directory),
        layout_text=layout_text(info.get("parallel")),
        layout_rows=layout_rows(info.get("parallel")),
        dataset_text=", ".join(dataset_link(d) for d in datasets) + "." if datasets else "Not recorded.",
        metric_rows=[(METRIC_LABELS.get(k, k), format_value(v)) for k, v in (info.get("metrics") or {}).items()],
        has_tokenizer=tokenizer_config is not None or (directory / "tokenizer.json").is_file(),
        has_chat_template=(directory / "chat_template.jinja").is_file()
        or bool((tokenizer_config or {}).get("chat_template")),
    )


def render_card_template(package: str, template_file: str, values: dict) -> str:
    """``template_file`` (Jinja2, packaged in ``package``) rendered with ``values``; a value it names and ``values``
    lacks is an error, not an empty string."""
    template = importlib.resources.files(package).joinpath(template_file).read_text(encoding="utf-8")
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    return env.from_string(template).render(**values).strip() + "\n"
