"""Hub-ready checkpoints: one folder with everything a user needs, and its upload.

`save_for_hub(model, tokenizer, output_dir, info)` writes

- the weights (`model.safetensors`, or shards and their index) and `config.json` with an `auto_map`;
- `generation_config.json` (the block-wise decoding knobs);
- `configuration_block_diffusion.py` and `modeling_block_diffusion.py`, the self-contained remote code;
- the tokenizer files, when a tokenizer is given;
- `README.md`, the model card (base model, objective, block size, layout, dataset, metrics, how to load).

`push_to_hub(model, repo_id, ...)` uploads exactly that folder (written to a temporary directory) in one commit;
`push_folder_to_hub(folder, repo_id)` uploads a folder already saved (e.g. a trainer's `output_dir`)::

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


def save_for_hub(model, tokenizer, output_dir: str | os.PathLike, info: dict | None = None, **save_kwargs) -> Path:
    r"""
    Write a complete, Hub-ready checkpoint of a block-diffusion model into `output_dir`.

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
    api = _api()
    repo_id = api.create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
    info = dict(info or {})
    info.setdefault("repo_id", repo_id)
    info.setdefault("model_name", repo_id.split("/")[-1])  # not the temporary folder's name
    if tags:
        info["tags"] = as_list(info.get("tags")) + list(tags)
    with tempfile.TemporaryDirectory() as folder:
        save_for_hub(model, tokenizer, folder, info, max_shard_size=max_shard_size)
        return _commit_folder(api, folder, repo_id, commit_message, commit_description, token, revision, create_pr)


def push_folder_to_hub(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    commit_message: str | None = None,
    commit_description: str | None = None,
    private: bool | None = None,
    token: str | bool | None = None,
    revision: str | None = None,
    create_pr: bool = False,
):
    """Upload every file of a saved folder (hidden files and `__pycache__` excepted) to `repo_id` in one commit."""
    api = _api()
    repo_id = api.create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
    return _commit_folder(api, folder, repo_id, commit_message, commit_description, token, revision, create_pr)


def folder_files(folder: str | os.PathLike) -> list[str]:
    """Paths (relative, POSIX) of the files an upload of ``folder`` sends."""
    root = Path(folder)
    files = []
    for path in sorted(root.rglob("*")):
        parts = path.relative_to(root).parts
        if path.is_file() and not any(p.startswith(".") or p == "__pycache__" for p in parts):
            files.append(Path(*parts).as_posix())
    return files


def _commit_folder(api, folder, repo_id, commit_message, commit_description, token, revision, create_pr):
    from huggingface_hub import CommitOperationAdd

    files = folder_files(folder)
    if "config.json" not in files:
        raise FileNotFoundError(
            f"{folder} holds no config.json: it is not a saved model folder (write one with "
            "hf_bdlm.hub.save_for_hub first)."
        )
    operations = [CommitOperationAdd(path_in_repo=f, path_or_fileobj=str(Path(folder) / f)) for f in files]
    if revision is not None and not create_pr:
        api.create_branch(repo_id=repo_id, branch=revision, token=token, exist_ok=True)
    return api.create_commit(
        repo_id=repo_id,
        operations=operations,
        commit_message=commit_message or "Upload block diffusion model (hf_bdlm)",
        commit_description=commit_description,
        token=token,
        revision=revision,
        create_pr=create_pr,
    )


def _api():
    from huggingface_hub import HfApi

    from ..version import __version__

    return HfApi(library_name="hf-bdlm", library_version=__version__)


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
