"""Model cards: `README.md` of a saved model, rendered by its family (``hf_bdlm/models/*/card.py``).

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

import os
from pathlib import Path

from huggingface_hub import ModelCard

from ..protocols.registry import REGISTRY, entry_for_model_type, family_named
from ..protocols.card_parts import check_info, read_json


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
    directory = Path(output_dir)
    card = ModelCard(render_model_card(directory, info))
    path = directory / "README.md"
    card.save(path)
    return path


def render_model_card(output_dir: str | os.PathLike, info: dict | None = None) -> str:
    """The card's text (see :func:`write_model_card`): rendered by the family that owns the folder's model type."""
    directory = Path(output_dir)
    info = check_info(info)
    config = read_json(directory / "config.json")
    if config is None:
        raise FileNotFoundError(
            f"{directory} has no config.json: save the model first (model.save_pretrained(output_dir), or "
            "hf_bdlm.hub.save_for_hub), then write its card."
        )
    family = entry_for_model_type(config.get("model_type"))
    if family is None:
        raise ValueError(
            f"{directory}/config.json is a {config.get('model_type')!r} config, not a model of a family hf_bdlm "
            f"trains (model types {[t for e in REGISTRY for t in e.model_types]}); convert a causal LM with "
            "hf_bdlm.convert_causal_lm first."
        )
    return family_named(family.name).render_card(directory, config, info)
