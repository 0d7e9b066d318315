"""The Hub folder of a block-diffusion model (`BlockDiffusionForMaskedLM`): everything a user needs, and its upload.

For block-diffusion models only (`config.model_type == "block_diffusion"`): the remote code comes from their
`save_pretrained`; a model of another family is refused (its family publishes through its own export,
`hf-bdlm export --format ...`, and `hf_bdlm.hub.upload.push_folder_to_hub`).

`save_for_hub(model, tokenizer, output_dir, info)` writes

- the weights (`model.safetensors`, or shards and their index) and `config.json` with an `auto_map`;
- `generation_config.json` (the block-wise decoding knobs);
- `configuration_block_diffusion.py` and `modeling_block_diffusion.py`, the self-contained remote code;
- the tokenizer files, when a tokenizer is given;
- `README.md`, the model card (base model, objective, block size, layout, dataset, metrics, how to load).

`push_to_hub(model, repo_id, ...)` uploads exactly that folder (written to a temporary directory) in one commit;
`push_folder_to_hub(folder, repo_id)` (:mod:`.upload`, any saved folder) uploads a folder already saved (e.g. a
trainer's `output_dir`)::

    from hf_bdlm.hub import save_for_hub, push_folder_to_hub
    save_for_hub(model, tokenizer, "out", {"dataset": "me/my-data", "metrics": {"loss": 0.4}})
    push_folder_to_hub("out", "me/my-bdlm")
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .card import write_model_card
from ..protocols.card_parts import as_list
from .upload import commit_folder, hub_api


def save_for_hub(model, tokenizer, output_dir: str | os.PathLike, info: dict | None = None, **save_kwargs) -> Path:
    r"""
    Write a complete, Hub-ready folder of a block-diffusion model into `output_dir`.

    Args:
        model ([`BlockDiffusionForMaskedLM`]):
            The model (unwrapped from DDP / FSDP; LoRA adapters merged).
        tokenizer (*optional*):
            Its tokenizer (or processor); `None` writes no tokenizer files.
        output_dir (`str` or `os.PathLike`):
            The folder; created if needed. Files of an earlier save with the same names are overwritten.
        info (`dict`, *optional*):
            What the model card cannot read from the folder: `parallel` (mode, P, C, transport, world), `dataset`,
            `metrics`, `base_model`, ... (see [`hf_bdlm.hub.write_model_card`]).
        save_kwargs:
            Passed to `model.save_pretrained` (`max_shard_size`, `is_main_process`, ...). With
            `is_main_process=False` only the model's own saving runs (transformers decides what that rank writes).

    Returns:
        `Path` of the folder.
    """
    _check_model(model)
    directory = Path(output_dir)
    model.save_pretrained(directory, **save_kwargs)
    if not save_kwargs.get("is_main_process", True):
        return directory
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    write_model_card(directory, info)
    return directory


def push_to_hub(
    model,
    repo_id: str,
    tokenizer=None,
    info: dict | None = None,
    *,
    commit_message: str | None = None,
    commit_description: str | None = None,
    private: bool | None = None,
    token: str | bool | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    max_shard_size: int | str = "50GB",
    tags: list[str] | None = None,
):
    r"""
    Upload what [`save_for_hub`] writes to the Hub repository `repo_id` (created if needed), in one commit.

    Args:
        model, tokenizer, info:
            As in [`save_for_hub`]; the card's loading snippets use `repo_id` unless `info["repo_id"]` is set.
        repo_id (`str`):
            `namespace/name` of the model repository.
        commit_message, commit_description, private, token, revision, create_pr:
            As in transformers' `push_to_hub`.
        max_shard_size (`int` or `str`, defaults to `"50GB"`):
            Largest weight file.
        tags (`list[str]`, *optional*):
            Extra tags for the card.

    Returns:
        The `huggingface_hub.CommitInfo` of the commit.
    """
    api = hub_api()
    repo_id = api.create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
    info = dict(info or {})
    info.setdefault("repo_id", repo_id)
    info.setdefault("model_name", repo_id.split("/")[-1])  # not the temporary folder's name
    if tags:
        info["tags"] = as_list(info.get("tags")) + list(tags)
    with tempfile.TemporaryDirectory() as folder:
        save_for_hub(model, tokenizer, folder, info, max_shard_size=max_shard_size)
        return commit_folder(api, folder, repo_id, commit_message or "Upload block diffusion model (hf_bdlm)",
                             commit_description, token, revision, create_pr)


def _check_model(model) -> None:
    if getattr(model, "peft_config", None) is not None or getattr(model, "_hf_peft_config_loaded", False):
        raise ValueError(
            "save_for_hub writes a full checkpoint, but the model carries LoRA/PEFT adapters: merge them first "
            "(model = model.merge_and_unload()), or save the adapters alone with model.save_pretrained(...)."
        )
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) != "block_diffusion":
        raise TypeError(
            f"save_for_hub expects a block-diffusion model (config.model_type 'block_diffusion'), got "
            f"{type(model).__name__} with model_type {getattr(config, 'model_type', None)!r}; convert a causal LM "
            "with hf_bdlm.convert_causal_lm first, and pass the model unwrapped from DDP/FSDP (model.module)."
        )
