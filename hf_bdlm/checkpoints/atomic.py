"""Atomic checkpoints: ``checkpoint-N`` appears whole, or not at all; a resume takes the last whole one.

transformers' Trainer writes ``checkpoint-N`` file by file (weights, model card, optimizer, scheduler, RNG states,
``trainer_state.json``; a family adds its objective's state), and ``resume_from_checkpoint=True`` takes the folder
named ``checkpoint-<largest N>`` (``transformers.trainer_utils.get_last_checkpoint``). A process killed half way
through a save would leave a folder with that name and half its files, which the next resume loads. So
``BDLMSFTTrainer`` lets the Trainer write the checkpoint into a hidden staging folder beside it (the first-use
cache's temporary sibling, ``hf_bdlm.cache``) and renames it into place once every rank has finished writing:

    output_dir/.checkpoint-6.tmp-staging/checkpoint-6/...   while the ranks write
    output_dir/checkpoint-6/...                               after the commit (one rename)

The staging name matches neither transformers' checkpoint pattern nor its glob, so ``get_last_checkpoint``, the
rotation of old checkpoints (``save_total_limit``) and resume never see a checkpoint that was not finished.
:func:`last_complete_checkpoint` is what ``resume_from_checkpoint=True`` uses here: the last ``checkpoint-N`` with its
``trainer_state.json`` (transformers writes it last: a folder written without staging, by an older version or another
trainer, is complete only with it); the unfinished folders it passes over are reported by name.

    from hf_bdlm.checkpoints.atomic import last_complete_checkpoint
    path = last_complete_checkpoint("outputs/run")     # None when there is none
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..cache import leftovers, replace_dir, sync_tree, temporary_sibling

logger = logging.getLogger(__name__)

TRAINER_STATE_NAME = "trainer_state.json"  # transformers' name; written last by its _save_checkpoint
STAGING_TAG = "staging"
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def checkpoint_path(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / f"{PREFIX_CHECKPOINT_DIR}-{step}"


class CheckpointCommit:
    """One atomic save of ``checkpoint-<step>`` in ``run_dir``, written by every rank.

    Args:
        run_dir: the folder that holds the checkpoints (the trainer's output folder).
        step: the global step being saved.
        writer: whether this process publishes the checkpoint (``TrainingArguments.should_save``: the main process, or
            each node's with ``save_on_each_node``).
        barrier: waits for every rank (``accelerator.wait_for_everyone``).

    :meth:`prepare` clears what an interrupted save of the same step left, then every rank writes into
    :attr:`staging_run_dir` (the Trainer's checkpoint folder goes to ``staging_run_dir/checkpoint-<step>``);
    :meth:`commit` waits for every rank, and the writer flushes the files to disk and renames the folder into place.
    """

    def __init__(self, run_dir: str | os.PathLike, step: int, writer: bool, barrier: Callable[[], None]):
        self.final = checkpoint_path(run_dir, step)
        self.staging_run_dir = temporary_sibling(self.final, STAGING_TAG)
        self.staged = self.staging_run_dir / self.final.name
        self.writer, self.barrier = writer, barrier

    def prepare(self) -> None:
        if self.writer:
            for stale in leftovers(self.final):
                logger.warning("Removing %s, left by an interrupted save of %s.", stale, self.final.name)
                if stale.is_dir():
                    shutil.rmtree(stale, ignore_errors=True)
                else:
                    stale.unlink(missing_ok=True)
            self.staging_run_dir.mkdir(parents=True, exist_ok=True)
        self.barrier()  # nobody writes into the staging folder before it is clean

    def commit(self) -> Path:
        self.barrier()  # every rank has written its part (RNG state, sharded weights and optimizer state)
        if self.writer:
            if not self.staged.is_dir():
                raise RuntimeError(f"the checkpoint save wrote nothing to {self.staged}; nothing to commit.")
            sync_tree(self.staged)
            try:
                replace_dir(self.staged, self.final)
            except FileNotFoundError:  # another writer on a shared file system (save_on_each_node) committed first
                if not self.final.is_dir():
                    raise
            shutil.rmtree(self.staging_run_dir, ignore_errors=True)
        self.barrier()  # no rank reads the checkpoint (best model, next resume) before it is in place
        return self.final

    def published(self, path: str | None) -> str | None:
        """``path`` (e.g. the best checkpoint the Trainer recorded) with the staging folder replaced by the final one."""
        if path is not None and Path(path) == self.staged:
            return str(self.final)
        return path


def is_complete(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` is a finished checkpoint: it holds the trainer state, which the Trainer writes last."""
    return (Path(folder) / TRAINER_STATE_NAME).is_file()


def unfinished_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Checkpoint saves that did not finish in ``run_dir``: staging folders holding a checkpoint (or part of one), and
    ``checkpoint-N`` folders without their trainer state."""
    root = Path(run_dir)
    if not root.is_dir():
        return []
    found = []
    for entry in sorted(root.iterdir()):
        match = _CHECKPOINT.match(entry.name)
        if match and entry.is_dir() and not is_complete(entry):
            found.append(entry)
        elif entry.name.startswith(f".{PREFIX_CHECKPOINT_DIR}-") and entry.is_dir() and any(entry.iterdir()):
            found.append(entry)
    return found


def last_complete_checkpoint(run_dir: str | os.PathLike, report: bool = True) -> str | None:
    """The complete ``checkpoint-N`` of ``run_dir`` with the largest ``N``, or ``None``.

    With ``report``, each unfinished save it passes over (of a later step than the one returned) is logged as a
    warning naming its folder: it is skipped, never loaded.
    """
    root = Path(run_dir)
    if not root.is_dir():
        return None
    steps = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _CHECKPOINT.match(p.name)) and p.is_dir())
    chosen = next((p for _, p in reversed(steps) if is_complete(p)), None)
    if report:
        floor = _step(chosen) if chosen is not None else -1
        for folder in unfinished_checkpoints(root):
            if _step(folder) > floor:
                logger.warning(
                    "%s is an unfinished checkpoint save (the run stopped while writing it): skipped; resuming from %s. "
                    "It is removed when the run saves step %d again.", folder,
                    chosen if chosen is not None else "the start", _step(folder))
    return str(chosen) if chosen is not None else None


def check_resumable(path: str | os.PathLike) -> None:
    """Raise a clear error when ``path`` (given to ``resume_from_checkpoint``) is not a finished checkpoint."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"resume_from_checkpoint={str(path)!r} is not a folder; pass a checkpoint-N folder or True.")
    staging = folder.parent.name.startswith(".") and folder.parent.name.endswith(f".tmp-{STAGING_TAG}")
    if staging or not is_complete(folder):
        last = last_complete_checkpoint(folder.parent.parent if staging else folder.parent, report=False)
        raise ValueError(
            f"{folder} is not a finished checkpoint (no {TRAINER_STATE_NAME}: the run stopped while writing it). "
            f"Resume from {last or 'an earlier checkpoint'}, or pass resume_from_checkpoint=True to take the last "
            "complete one."
        )


def _step(folder: Path) -> int:
    match = re.search(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)", folder.name)
    return int(match.group(1)) if match else -1
