"""Uploads to the Hub: every file of a saved model folder in one commit, whatever family wrote it.

    from hf_bdlm.hub.upload import push_folder_to_hub
    push_folder_to_hub("outputs/run", "me/my-model")        # a trainer's output_dir, an export, a saved model

:func:`~hf_bdlm.hub.block_diffusion_folder.push_to_hub` (a block-diffusion model), ``save_pretrained(...,
push_to_hub=True)`` of a block-diffusion model and the families' exports (``hf-bdlm export ... --push-to-hub``)
upload through it.
"""

from __future__ import annotations

import os
from pathlib import Path

from huggingface_hub import CommitOperationAdd, HfApi

from ..version import __version__


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
    api = hub_api()
    repo_id = api.create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
    return commit_folder(api, folder, repo_id, commit_message, commit_description, token, revision, create_pr)


def folder_files(folder: str | os.PathLike) -> list[str]:
    """Paths (relative, POSIX) of the files an upload of ``folder`` sends."""
    root = Path(folder)
    files = []
    for path in sorted(root.rglob("*")):
        parts = path.relative_to(root).parts
        if path.is_file() and not any(p.startswith(".") or p == "__pycache__" for p in parts):
            files.append(Path(*parts).as_posix())
    return files


def commit_folder(api, folder, repo_id, commit_message, commit_description, token, revision, create_pr):
    """Commit every file :func:`folder_files` lists of ``folder`` to ``repo_id`` through ``api`` (an ``HfApi``)."""
    files = folder_files(folder)
    if "config.json" not in files:
        raise FileNotFoundError(
            f"{folder} holds no config.json: it is not a saved model folder (write one with "
            "save_pretrained, or hf_bdlm.hub.save_for_hub for a block-diffusion model, first)."
        )
    operations = [CommitOperationAdd(path_in_repo=f, path_or_fileobj=str(Path(folder) / f)) for f in files]
    if revision is not None and not create_pr:
        api.create_branch(repo_id=repo_id, branch=revision, token=token, exist_ok=True)
    return api.create_commit(
        repo_id=repo_id,
        operations=operations,
        commit_message=commit_message or "Upload model (hf_bdlm)",
        commit_description=commit_description,
        token=token,
        revision=revision,
        create_pr=create_pr,
    )


def hub_api():
    """An ``HfApi`` that names this library and its version in its requests."""
    return HfApi(library_name="hf-bdlm", library_version=__version__)
