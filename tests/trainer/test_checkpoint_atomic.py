"""A process killed while it writes ``checkpoint-N`` leaves no checkpoint that resume would take.

Each case trains a tiny model for 4 steps with a checkpoint every 2 in a forked process, and SIGKILLs that process
while it writes ``checkpoint-4``: half way through the weights file, the optimizer state, the model card, the
objective's state (a DFlash drafter's ``dflash_objective.json``), or with the checkpoint finished but not yet renamed
into place. Then: no ``checkpoint-4`` exists (transformers' own ``get_last_checkpoint`` returns ``checkpoint-2``), and
``train(resume_from_checkpoint=True)`` reports the unfinished save by name, resumes from ``checkpoint-2`` and ends with
the weights of the uninterrupted run, bit for bit. The trainer's saves are atomic by construction
(hf_bdlm/checkpoints/atomic.py): the checkpoint is written into a staging folder and renamed once complete.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
from pathlib import Path

import pytest
import torch
from transformers.trainer_utils import get_last_checkpoint

from trainer_common import prompt_completion, tiny_causal_lm, tiny_tokenizer  # noqa: E402

from hf_bdlm import BDLMSFTConfig, BDLMSFTTrainer  # noqa: E402
from hf_bdlm.checkpoints.atomic import check_resumable  # noqa: E402

SAVING = f"checkpoint-4{os.sep}"  # the save the kills interrupt


def _die_after_half(path: str) -> None:
    """Cut the file just written to half its bytes (a write cut short), then die as an OOM kill does."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(point: str, trainer) -> None:
    """Make this (forked) process die at ``point`` of the save of checkpoint-4."""
    if point == "weights":
        import transformers.modeling_utils as modeling_utils

        save = modeling_utils.safe_save_file

        def save_then_die(tensors, filename, *args, **kwargs):
            save(tensors, filename, *args, **kwargs)
            if SAVING in str(filename):
                _die_after_half(str(filename))
        modeling_utils.safe_save_file = save_then_die
    elif point == "optimizer":
        save = torch.save

        def save_then_die(obj, f, *args, **kwargs):
            save(obj, f, *args, **kwargs)
            if isinstance(f, str) and SAVING in f and f.endswith("optimizer.pt"):
                _die_after_half(f)
        torch.save = save_then_die
    elif point == "model card":
        import hf_bdlm.trainer.trainer as trainer_module  # the trainer's own binding of hub.write_model_card

        write = trainer_module.write_model_card

        def write_then_die(folder, *args, **kwargs):
            path = write(folder, *args, **kwargs)
            if SAVING in f"{folder}{os.sep}":
                _die_after_half(os.path.join(folder, "README.md"))
            return path
        trainer_module.write_model_card = write_then_die
    elif point == "objective state":
        save = trainer._save_extra_state

        def save_then_die(folder):
            save(folder)
            if SAVING in f"{folder}{os.sep}":
                _die_after_half(os.path.join(folder, "dflash_objective.json"))
        trainer._save_extra_state = save_then_die
    elif point == "commit":
        import hf_bdlm.checkpoints.atomic as checkpoints

        replace = checkpoints.replace_dir

        def die_before_rename(staged, final):
            if SAVING in f"{final}{os.sep}":
                os.kill(os.getpid(), signal.SIGKILL)
            replace(staged, final)
        checkpoints.replace_dir = die_before_rename
    else:
        raise ValueError(point)


# --- the two families' runs ------------------------------------------------------------------------------------------
def _converted(out: Path):
    args = BDLMSFTConfig(output_dir=str(out), report_to="none", max_steps=4, logging_steps=1, save_strategy="steps",
                         save_steps=2, disable_tqdm=True, seed=3, max_length=64, per_device_train_batch_size=2,
                         optim="adamw_torch", learning_rate=1e-3, objective="fast_dllm_v2")
    return BDLMSFTTrainer(tiny_causal_lm(), args=args, train_dataset=prompt_completion(16),
                          processing_class=tiny_tokenizer())


def _drafter(out: Path):
    from dflash_trainer_worker import capture, config, tiny_drafter, tiny_target

    from hf_bdlm.models.dflash.training.trainer import DFlashTrainer

    target = tiny_target()
    features = out.parent / "features"
    if not features.is_dir():
        capture(out.parent, target)
    args = config(out, max_steps=4, save_strategy="steps", save_steps=2, optim="adamw_torch", learning_rate=1e-3,
                  lr_scheduler_type="linear")
    return DFlashTrainer(tiny_drafter(target), args, train_dataset=str(features), target=target,
                         processing_class=tiny_tokenizer())


FAMILIES = {"converted": _converted, "drafter": _drafter}


def _train(family: str, out: Path, resume: bool | str = False, kill: str | None = None) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    trainer = FAMILIES[family](out)
    if kill is not None:
        _arm(kill, trainer)
    trainer.train(resume_from_checkpoint=resume or None)
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def _killed_run(family: str, out: Path, kill: str) -> int:
    process = multiprocessing.get_context("fork").Process(target=_train, args=(family, out), kwargs=dict(kill=kill))
    process.start()
    process.join(300)
    return process.exitcode


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("uninterrupted")
    return {family: _train(family, root / family / "run") for family in ("converted",)}


CASES = [("converted", "weights"), ("converted", "optimizer"), ("converted", "model card"), ("converted", "commit"),
         ("drafter", "objective state")]


@pytest.mark.parametrize("family,point", CASES)
def test_a_save_killed_half_way_leaves_no_checkpoint_and_resume_takes_the_last_complete_one(
        tmp_path, uninterrupted, caplog, family, point):
    out = tmp_path / family / "run"
    assert _killed_run(family, out, point) == -signal.SIGKILL
    staging = out / ".checkpoint-4.tmp-staging"
    assert not (out / "checkpoint-4").exists()
    assert (staging / "checkpoint-4").is_dir()  # what was written, kept aside
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-2")  # transformers' own choice agrees
    with pytest.raises(ValueError, match=r"checkpoint-4 is not a finished checkpoint .* Resume from .*checkpoint-2"):
        check_resumable(staging / "checkpoint-4")

    with caplog.at_level(logging.WARNING, logger="hf_bdlm.checkpoints.atomic"):
        # As the Python API passes it, and (one case) as a recipe's --resume_from_checkpoint True does.
        resumed = _train(family, out, resume="True" if point == "commit" else True)
    reported = [r.getMessage() for r in caplog.records if r.name == "hf_bdlm.checkpoints.atomic"]
    assert any(str(staging) in m and "unfinished checkpoint save" in m and "checkpoint-2" in m for m in reported), \
        reported
    assert (out / "checkpoint-4" / "trainer_state.json").is_file() and not staging.exists()
    reference = uninterrupted.get(family)
    if reference is None:  # the drafter's uninterrupted run: only its cases need it
        reference = uninterrupted.setdefault(family, _train(family, tmp_path / "reference" / "run"))
    assert resumed.keys() == reference.keys()
    for name in reference:
        assert torch.equal(resumed[name], reference[name]), name
