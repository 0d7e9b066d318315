"""The installed `hf-bdlm` command: train (through accelerate launch), convert and generate, with clear errors.

Every test runs the console script pip installed (``.venv/bin/hf-bdlm``), as a user would.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer_common import tiny_causal_lm, tiny_tokenizer  # noqa: E402

BIN = Path(sys.executable).parent / "hf-bdlm"
ENV = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", OMP_NUM_THREADS="1")


def run_cli(*args, timeout=300, cwd=None):
    exe = str(BIN) if BIN.exists() else shutil.which("hf-bdlm")
    assert exe, "the hf-bdlm console script is not installed (pip install -e .)"
    return subprocess.run([exe, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=ENV, cwd=cwd)


@pytest.fixture(scope="module")
def causal_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("causal")
    tiny_causal_lm().save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def bdlm_dir(causal_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "bdlm"
    proc = run_cli("convert", causal_dir, out, "--block-size", 4)
    assert proc.returncode == 0, proc.stderr
    return out, proc.stdout


def test_help_lists_every_command():
    proc = run_cli("--help")
    assert proc.returncode == 0
    for command in ("train", "convert", "generate", "serve", "eval"):
        assert command in proc.stdout


def test_convert_writes_a_bdlm_that_keeps_the_causal_weights(causal_dir, bdlm_dir):
    from transformers import AutoModel, AutoModelForCausalLM

    import hf_bdlm  # noqa: F401  (registers the Auto classes)

    out, stdout = bdlm_dir
    assert "block size 4, objective fast_dllm_v2" in stdout
    bdlm, causal = AutoModel.from_pretrained(out), AutoModelForCausalLM.from_pretrained(causal_dir)
    assert type(bdlm).__name__ == "BlockDiffusionForMaskedLM" and bdlm.config.block_size == 4
    rows = causal.get_input_embeddings().weight.shape[0]
    assert torch.equal(bdlm.get_input_embeddings().weight[:rows], causal.get_input_embeddings().weight)
    assert torch.equal(bdlm.backbone.model.layers[1].mlp.down_proj.weight, causal.model.layers[1].mlp.down_proj.weight)
    assert (out / "tokenizer.json").exists()


def test_generate_prints_what_model_generate_decodes(bdlm_dir):
    from transformers import AutoModel, AutoTokenizer

    import hf_bdlm  # noqa: F401

    out, _ = bdlm_dir
    proc = run_cli("generate", out, "what is the sum of 1 and 2", "--max-new-tokens", 8)
    assert proc.returncode == 0, proc.stderr
    model, tok = AutoModel.from_pretrained(out).eval(), AutoTokenizer.from_pretrained(out)
    ids = tok.apply_chat_template([{"role": "user", "content": "what is the sum of 1 and 2"}],
                                  add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    with torch.no_grad():
        want = model.generate(torch.tensor([list(ids)]), max_new_tokens=8)
    assert proc.stdout.strip() == tok.decode(want[0, len(ids):], skip_special_tokens=True).strip()


@pytest.mark.distributed
def test_train_with_two_processes_runs_the_recipe_under_accelerate(causal_dir, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"prompt": [{"role": "user", "content": f"what is the sum of {i} and 1"}],
             "completion": [{"role": "assistant", "content": str(i + 1)}]} for i in range(8)]
    (data / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "out"
    proc = run_cli("train", "--nproc", 2, "--model_name_or_path", causal_dir, "--dataset_name", data,
                   "--output_dir", out, "--block_size", 4, "--max_steps", 2, "--per_device_train_batch_size", 2,
                   "--block_parallel_size", 2, "--max_length", 64, "--report_to", "none", "--save_strategy", "no",
                   "--activation_checkpointing", "false", "--disable_tqdm", "true", timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "world 2 = 1 data-parallel x P 2 (csbp, clean ring C 2)" in proc.stdout
    assert json.loads((out / "sft_results.json").read_text())["steps"] == 2


# Errors are checked in-process through the same main() the console script calls (each subprocess costs an import
# of torch and transformers); the entry point itself is exercised by the tests above.
@pytest.mark.parametrize(
    "args, message",
    [
        (("convert", "/nonexistent/model", "out"), "model folder '/nonexistent/model' does not exist"),
        (("generate", "/nonexistent/model", "hi"), "model folder '/nonexistent/model' does not exist"),
        (("train", "--nproc", "0"), "--nproc must be at least 1, got 0"),
        (("train", "--accelerate-config", "/nonexistent.yaml"), "--accelerate-config '/nonexistent.yaml' is not a file"),
    ],
)
def test_bad_input_exits_2_naming_the_value(args, message, capsys):
    from hf_bdlm.cli import main

    assert main(list(args)) == 2
    assert message in capsys.readouterr().err


def test_generate_refuses_a_causal_lm_and_says_to_convert(causal_dir, capsys):
    from hf_bdlm.cli import main

    assert main(["generate", str(causal_dir), "hi"]) == 2
    assert "hf-bdlm convert" in capsys.readouterr().err


def test_convert_refuses_a_non_empty_output_folder(causal_dir, capsys):
    from hf_bdlm.cli import main

    assert main(["convert", str(causal_dir), str(causal_dir)]) == 2
    assert "is not empty" in capsys.readouterr().err


def test_unknown_options_of_other_commands_are_rejected(capsys):
    from hf_bdlm.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["convert", "a", "b", "--blocksize", "4"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --blocksize 4" in capsys.readouterr().err
