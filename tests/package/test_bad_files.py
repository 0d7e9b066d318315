"""Bad files get an error that names the file and the fix, on every path a user loads them by.

A weights file cut short or with a damaged header (``AutoModel.from_pretrained``, ``hf-bdlm serve``'s engine, the
trainer given the folder, a resume from the checkpoint), a ``config.json`` from another family or model (transformers
would initialise the weights it does not find at random and only log it), a tokenizer without the model's mask token,
and a DFlash capture whose records do not match their manifest (cut short: always checked; a changed byte: with
``verify_features="sha256"``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModel

from tiny_bdlm import save_tiny_bdlm  # noqa: E402

from hf_bdlm import BDLMSFTConfig, BDLMSFTTrainer  # noqa: E402
from hf_bdlm.checkpoints.files import BadCheckpointFile  # noqa: E402
from hf_bdlm.serving import Engine  # noqa: E402

FIX = r"Download or save it again \(a checkpoint of a training run: resume from an earlier checkpoint"


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return save_tiny_bdlm(tmp_path_factory.mktemp("tiny") / "good")


def _copy(good: Path, tmp_path: Path, name: str) -> Path:
    return Path(shutil.copytree(good, tmp_path / name))


def _train_on(folder: Path, tmp_path: Path):
    from trainer_common import prompt_completion

    args = BDLMSFTConfig(str(tmp_path / "out"), report_to="none", max_steps=1, save_strategy="no", disable_tqdm=True)
    return BDLMSFTTrainer(str(folder), args=args, train_dataset=prompt_completion(4))


def _loaders(tmp_path):
    return {"AutoModel.from_pretrained": lambda f: AutoModel.from_pretrained(f),
            "hf-bdlm serve (Engine)": lambda f: Engine.from_pretrained(f),
            "BDLMSFTTrainer(folder)": lambda f: _train_on(f, tmp_path)}


@pytest.mark.parametrize("loader", ["AutoModel.from_pretrained", "hf-bdlm serve (Engine)", "BDLMSFTTrainer(folder)"])
def test_a_weights_file_cut_short_is_named_with_the_fix(good, tmp_path, loader):
    folder = _copy(good, tmp_path, "cut")
    weights = folder / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(BadCheckpointFile, match=rf"{weights} is cut short: it holds {size // 2} bytes, its header "
                                                rf"describes {size}\. {FIX}"):
        _loaders(tmp_path)[loader](folder)


def test_a_damaged_header_is_named_with_the_fix(good, tmp_path):
    folder = _copy(good, tmp_path, "damaged")
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[10:20] = b"\x00" * 10  # inside the JSON header
    weights.write_bytes(bytes(data))
    with pytest.raises(BadCheckpointFile, match=rf"{weights} has a damaged header \(.*\): it is not a readable "
                                                rf"safetensors file\. {FIX}"):
        Engine.from_pretrained(folder)


def test_a_checkpoint_cut_short_is_named_when_resuming(good, tmp_path):
    from trainer_common import prompt_completion, tiny_bdlm, tiny_tokenizer

    args = BDLMSFTConfig(str(tmp_path / "run"), report_to="none", max_steps=2, save_strategy="steps", save_steps=1,
                         disable_tqdm=True, per_device_train_batch_size=2, max_length=64)
    BDLMSFTTrainer(tiny_bdlm(), args=args, train_dataset=prompt_completion(4), processing_class=tiny_tokenizer()).train()
    weights = tmp_path / "run" / "checkpoint-2" / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size - 100)
    trainer = BDLMSFTTrainer(tiny_bdlm(), args=args, train_dataset=prompt_completion(4),
                             processing_class=tiny_tokenizer())
    with pytest.raises(BadCheckpointFile, match=rf"{weights} is cut short: .* resume from an earlier checkpoint"):
        trainer.train(resume_from_checkpoint=str(weights.parent))


@pytest.mark.parametrize("other", ["diffusion_gemma", "llama"])
def test_a_config_json_from_another_model_is_refused_not_loaded_at_random(good, tmp_path, other):
    folder = _copy(good, tmp_path, f"config_of_{other}")
    if other == "diffusion_gemma":  # another family of hf_bdlm: its generation config does not read the folder's
        from tiny_diffusion_gemma import tiny_model

        tiny_model().config.save_pretrained(folder)
        message = (rf"loading {folder} as the 'diffusion_gemma' model its config\.json describes failed: .* If "
                   r"config\.json or generation_config\.json comes from another model \(copied over\?\), put back the "
                   r"folder's own")
    else:  # a causal LM's: it would be converted, from random weights
        from transformers import LlamaConfig

        LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=64).save_pretrained(folder)
        message = (rf"{folder / 'config.json'} describes a 'llama' model \(LlamaForCausalLM\) whose weights {folder} "
                   r"does not hold: 21 of 21 are missing, e\.g\. .*; the weights hold instead e\.g\. \['backbone\..*The "
                   r"config\.json is not the one saved with these weights .* Put back the folder's own config\.json")
    with pytest.raises(BadCheckpointFile, match=message):
        Engine.from_pretrained(folder)
    with pytest.raises(BadCheckpointFile, match=message):
        _train_on(folder, tmp_path)


def test_a_tokenizer_without_the_mask_token_is_named_with_the_fix(good, tmp_path):
    folder = _copy(good, tmp_path, "no_mask")
    config = folder / "tokenizer_config.json"
    values = json.loads(config.read_text())
    values.pop("mask_token")
    config.write_text(json.dumps(values))
    message = (rf"{config}: it has no mask token, but the model's config gives mask_token_id=63 .* Save the converted "
               r"tokenizer into the folder \(tokenizer\.save_pretrained\(folder\)")
    with pytest.raises(BadCheckpointFile, match=message):
        Engine.from_pretrained(folder)
    with pytest.raises(BadCheckpointFile, match=message):
        _train_on(folder, tmp_path)


# --- a DFlash capture ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def capture_folder(tmp_path_factory) -> Path:
    from dflash_trainer_worker import capture, tiny_target

    return capture(tmp_path_factory.mktemp("capture"), tiny_target())


def _train_drafter(features: Path, tmp_path: Path, **overrides):
    from dflash_trainer_worker import config, tiny_drafter, tiny_target
    from trainer_common import tiny_tokenizer

    from hf_bdlm.models.dflash.training.trainer import DFlashTrainer

    target = tiny_target()
    return DFlashTrainer(tiny_drafter(target), config(tmp_path / "out", **overrides), train_dataset=str(features),
                         target=target, processing_class=tiny_tokenizer())


def _record(folder: Path, index: int) -> tuple[Path, str]:
    entry = json.loads((folder / "manifest.json").read_text())["records"][index]
    return folder / entry["file"], entry["file"]


def test_a_capture_record_cut_short_is_named_before_training(capture_folder, tmp_path):
    folder = Path(shutil.copytree(capture_folder, tmp_path / "features"))
    path, name = _record(folder, 3)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 64)
    with pytest.raises(ValueError, match=rf"1 of 16 records of {folder} fail verification: \['{name} \({size - 64} "
                                         rf"bytes, the manifest records {size}\)'\]\. Rerun the capture with "
                                         r"resume=True to redo them"):
        _train_drafter(folder, tmp_path)


def test_a_capture_record_whose_sha256_differs_is_named_when_asked_to_verify_it(capture_folder, tmp_path):
    folder = Path(shutil.copytree(capture_folder, tmp_path / "features"))
    path, name = _record(folder, 5)
    data = bytearray(path.read_bytes())
    data[-4:] = b"\x7f\x7f\x7f\x7f"  # the last feature value: same size, other bytes
    path.write_bytes(bytes(data))
    _train_drafter(folder, tmp_path)  # the default checks sizes only: this one passes
    with pytest.raises(ValueError, match=rf"1 of 16 records of {folder} fail verification: \['{name} \(sha256 "
                                         r"differs\)'\]\. Rerun the capture with resume=True to redo them"):
        _train_drafter(folder, tmp_path, verify_features="sha256")


def test_the_checks_pass_the_files_save_pretrained_wrote(good):
    model = AutoModel.from_pretrained(good)
    assert isinstance(Engine.from_pretrained(good).model, type(model))
    assert torch.equal(model.get_input_embeddings().weight,
                       AutoModel.from_pretrained(good).get_input_embeddings().weight)
