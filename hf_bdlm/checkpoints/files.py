"""Checks of the files a model folder holds, before they are loaded: each bad file gets an error naming it and the fix.

- A safetensors file cut short (a download, a copy or a save that did not finish) or with a damaged header:
  :func:`check_weight_files` reads each file's header (8 bytes of length, then JSON) and compares the size it promises
  with the file's. safetensors stores no checksum, so a byte changed inside the tensor data is not detectable here.
- A ``config.json`` from another model (a folder whose config and weights disagree): transformers loads such a folder
  with every weight it does not find *randomly initialised*, and only logs it. :func:`load_pretrained` loads with
  ``output_loading_info=True`` and refuses a model that misses weights, naming the config and the weights it read.

    from transformers import AutoModel
    from hf_bdlm.checkpoints.files import load_pretrained
    model = load_pretrained(AutoModel.from_pretrained, "path/to/folder", dtype="auto")
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable
from pathlib import Path

WEIGHTS_INDEX = "model.safetensors.index.json"


class BadCheckpointFile(ValueError):
    """A file of a model folder that cannot be what it claims to be (cut short, damaged, from another model)."""


def check_safetensors(path: str | os.PathLike) -> None:
    """Raise :class:`BadCheckpointFile` when ``path`` is not a whole safetensors file (header and data)."""
    path = Path(path)
    size = path.stat().st_size
    fix = ("Download or save it again (a checkpoint of a training run: resume from an earlier checkpoint, "
           "resume_from_checkpoint=True takes the last complete one).")
    if size < 8:
        raise BadCheckpointFile(f"{path} is cut short: {size} bytes, not even a safetensors header. {fix}")
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if 8 + header_len > size:
            raise BadCheckpointFile(
                f"{path} is cut short: its header says {header_len} bytes of metadata follow, the file holds "
                f"{size - 8}. {fix}")
        try:
            header = json.loads(f.read(header_len))
            ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
        except (ValueError, KeyError, TypeError, IndexError) as err:
            raise BadCheckpointFile(f"{path} has a damaged header ({err}): it is not a readable safetensors file. "
                                    f"{fix}") from None
    expected = 8 + header_len + max(ends, default=0)
    if size < expected:
        raise BadCheckpointFile(f"{path} is cut short: it holds {size} bytes, its header describes {expected}. {fix}")
    if size > expected:
        raise BadCheckpointFile(f"{path} has {size - expected} bytes more than its header describes: it is damaged "
                                f"or two files were written over each other. {fix}")


def weight_files(folder: str | os.PathLike) -> list[Path]:
    """The safetensors files of ``folder`` (the shards its index names, or every ``*.safetensors`` beside it)."""
    folder = Path(folder)
    index = folder / WEIGHTS_INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError) as err:
            raise BadCheckpointFile(f"{index} is damaged ({err}). Download or save the model again.") from None
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise BadCheckpointFile(f"{index} names {len(missing)} weight files that {folder} lacks ({missing[:3]}): "
                                    "the download or copy is incomplete. Download or save the model again.")
        return [folder / s for s in shards]
    return sorted(folder.glob("*.safetensors"))


def check_weight_files(folder: str | os.PathLike) -> None:
    """Check every safetensors file of the model folder ``folder`` (nothing for a Hub id or another format)."""
    if Path(folder).is_dir():
        for path in weight_files(folder):
            check_safetensors(path)


def load_pretrained(load: Callable, path: str | os.PathLike, **kwargs):
    """``load(path, **kwargs)`` (a ``from_pretrained``) after :func:`check_weight_files`, refusing a model whose weights
    the folder does not hold (transformers would initialise them at random and only log it).

    Raises:
        BadCheckpointFile: a weight file is cut short or damaged, or the model misses weights (its config is not the
            one saved with these weights).
    """
    check_weight_files(path)
    folder = Path(path)
    config = folder / "config.json"
    try:
        model, info = load(path, output_loading_info=True, **kwargs)
    except (ValueError, KeyError, TypeError) as err:  # a config file that does not parse as this model's
        if not folder.is_dir():
            raise
        model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
        raise BadCheckpointFile(
            f"loading {folder} as the {model_type!r} model its config.json describes failed: {type(err).__name__}: "
            f"{err}. If config.json or generation_config.json comes from another model (copied over?), put back the "
            "folder's own (the ones save_pretrained wrote)."
        ) from err
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        model_type = getattr(getattr(model, "config", None), "model_type", "?")
        unexpected = sorted(info.get("unexpected_keys") or ())
        held = f"; the weights hold instead e.g. {unexpected[:3]}" if unexpected else ""
        total = len(list(model.state_dict()))
        raise BadCheckpointFile(
            f"{config if folder.is_dir() else path} describes a {model_type!r} model ({type(model).__name__}) whose "
            f"weights {folder} does not hold: {len(missing)} of {total} are missing, e.g. {missing[:3]}{held}. The "
            "config.json is not the one saved with these weights (copied from another model?). Put back the "
            "folder's own config.json (the one save_pretrained wrote), or load the folder these weights came from."
        )
    return model


def file_sha256(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in 8 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
