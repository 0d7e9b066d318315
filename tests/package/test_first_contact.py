"""A first hour without surprises (issue 43, items 7-8): clear first-contact errors and warnings, and accelerate's and
vLLM's flag names accepted where ours differ.
Run: python -m pytest tests/package/test_first_contact.py -q
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from trainer_common import prompt_completion, tiny_causal_lm, tiny_tokenizer  # noqa: E402

from hf_bdlm import BlockDiffusionForMaskedLM, convert_causal_lm  # noqa: E402
from hf_bdlm.cli import build_parser, main  # noqa: E402
from hf_bdlm.models.block_diffusion.modeling import UntrainedModelWarning  # noqa: E402


# --- 7b: an untrained conversion says so --------------------------------------------------------------------------
def _untrained_warnings(model) -> list:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4)
    return [w for w in caught if issubclass(w.category, UntrainedModelWarning)]


def test_generating_from_a_fresh_conversion_warns_once_that_it_is_untrained(tmp_path):
    model, tokenizer = convert_causal_lm(tiny_causal_lm(), tiny_tokenizer(), block_size=4)
    model.save_pretrained(tmp_path)  # the marker round-trips through save / load
    loaded = BlockDiffusionForMaskedLM.from_pretrained(tmp_path).eval()
    assert loaded.config.bdlm_trained_steps == 0
    [warning] = _untrained_warnings(loaded)
    assert "has not been trained as a block diffusion LM" in str(warning.message)


def test_a_checkpoint_without_the_marker_generates_without_the_warning(tmp_path):
    model, _ = convert_causal_lm(tiny_causal_lm(), tiny_tokenizer(), block_size=4)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["bdlm_trained_steps"]  # a checkpoint saved before the field existed
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = BlockDiffusionForMaskedLM.from_pretrained(tmp_path).eval()
    assert loaded.config.bdlm_trained_steps is None and _untrained_warnings(loaded) == []


def test_the_trainer_saves_its_step_count_so_a_trained_model_does_not_warn(tmp_path):
    from hf_bdlm import BDLMSFTConfig, BDLMSFTTrainer

    args = BDLMSFTConfig(output_dir=str(tmp_path / "run"), report_to="none", max_steps=2, save_strategy="no",
                         disable_tqdm=True, max_length=64, per_device_train_batch_size=2, optim="adamw_torch",
                         objective="fast_dllm_v2", block_size=4)
    trainer = BDLMSFTTrainer(tiny_causal_lm(), args=args, train_dataset=prompt_completion(4),
                             processing_class=tiny_tokenizer())
    assert trainer.model.config.bdlm_trained_steps == 0  # converted by the trainer
    trainer.train()
    trainer.save_model(str(tmp_path / "out"))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["bdlm_trained_steps"] == 2
    loaded = BlockDiffusionForMaskedLM.from_pretrained(tmp_path / "out").eval()
    assert _untrained_warnings(loaded) == []


# --- 7c: the SDAR export refuses from the config, before any weight is read -----------------------------------------
def test_export_sdar_refuses_from_the_config_before_loading_weights_in_one_short_message(tmp_path, capsys,
                                                                                          monkeypatch):
    from transformers import PreTrainedModel

    model, tokenizer = convert_causal_lm(tiny_causal_lm(), tiny_tokenizer(), block_size=4)  # fast_dllm_v2, a Llama
    model.save_pretrained(tmp_path / "bdlm")
    tokenizer.save_pretrained(tmp_path / "bdlm")

    def no_weights(*args, **kwargs):
        raise AssertionError("weights loaded before the refusal")

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(no_weights))
    capsys.readouterr()  # the save's progress bars
    assert main(["export", "--format", "sdar", str(tmp_path / "bdlm"), str(tmp_path / "sdar")]) == 2
    err = capsys.readouterr().err
    assert "objective='fast_dllm_v2'" in err and "the backbone is 'llama'" in err
    assert "hf-bdlm convert QWEN3_DIR OUT --objective standard" in err and len(err) - len(str(tmp_path)) < 300
    assert err.count("serves") == 1 and not (tmp_path / "sdar").exists()


def test_convert_help_shows_objective_standard_for_sdar_export(capsys):
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "use '--objective standard' for a model meant for SDAR export" in help_text


# --- 7a: a model folder without its tokenizer -----------------------------------------------------------------------
def test_generate_on_a_folder_without_a_tokenizer_says_so_and_what_to_do(tmp_path, capsys):
    from tiny_bdlm import tiny_bdlm

    tiny_bdlm().save_pretrained(tmp_path / "bdlm")  # weights and config only
    assert main(["generate", str(tmp_path / "bdlm"), "w7 w8"]) == 2
    err = capsys.readouterr().err
    assert f"{str(tmp_path / 'bdlm')!r} (the model folder) has no tokenizer" in err
    assert "tokenizer.save_pretrained(DIR)" in err and "--tokenizer PATH" in err
    assert "sentencepiece" not in err and "tiktoken" not in err


def test_generate_takes_the_tokenizer_from_the_tokenizer_option(tmp_path, capsys):
    from tiny_bdlm import tiny_bdlm, tiny_tokenizer as word_tokenizer

    tiny_bdlm().save_pretrained(tmp_path / "bdlm")
    word_tokenizer().save_pretrained(tmp_path / "tok")
    assert main(["generate", str(tmp_path / "bdlm"), "w7 w8", "--tokenizer", str(tmp_path / "tok"), "--raw",
                 "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.strip()  # four decoded words


# --- 8: accelerate's and vLLM's flag names ------------------------------------------------------------------------
@pytest.mark.parametrize("ours, theirs", [
    (["train", "--nproc", "3"], ["train", "--num_processes", "3"]),
    (["train", "--accelerate-config", "a.yaml"], ["train", "--config_file", "a.yaml"]),
    (["serve", "m", "--max-batch-size", "5"], ["serve", "m", "--max-num-seqs", "5"]),
])
def test_accelerate_and_vllm_flag_names_set_the_same_field(ours, theirs):
    parser = build_parser()
    assert vars(parser.parse_known_args(theirs)[0]) == vars(parser.parse_known_args(ours)[0])
    assert parser.parse_known_args(theirs)[1] == []  # taken by us, not passed on to the recipe


def test_speculative_config_maps_to_draft_and_num_speculative_tokens():
    from hf_bdlm.cli import apply_speculative_config

    parser = build_parser()
    theirs = parser.parse_args(["serve", "m", "--speculative-config",
                                '{"model": "drafter", "num_speculative_tokens": 3}'])
    apply_speculative_config(theirs)
    ours = parser.parse_args(["serve", "m", "--draft", "drafter", "--num-speculative-tokens", "3"])
    assert (theirs.draft, theirs.num_speculative_tokens) == (ours.draft, ours.num_speculative_tokens) == ("drafter", 3)


@pytest.mark.parametrize("spec, message", [
    ('{"model": "d", "method": "eagle"}', "--speculative-config keys ['method'] are not supported"),
    ('{"num_speculative_tokens": 3}', 'needs "model"'),
    ('{"model": d}', "is not JSON"),
])
def test_speculative_config_refuses_what_it_cannot_map(spec, message, tmp_path, capsys):
    assert main(["serve", str(tmp_path), "--speculative-config", spec]) == 2  # before any model loads
    assert message in capsys.readouterr().err
