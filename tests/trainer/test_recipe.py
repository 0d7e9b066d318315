"""recipes/sft.py and its YAML configs: every config names real fields, the parser reads them, the script trains a
tiny model end to end, and (slow) `accelerate launch` runs the embedded SmolLM2 CSBP config on 2 CPU processes.
"""

import dataclasses
import json
import os
import subprocess
import sys

from embedded_model import needs_embedded_model
import pytest
import yaml
from paths import ROOT

sys.path.insert(0, str(ROOT / "recipes"))
import sft  # noqa: E402
from trainer_common import tiny_causal_lm, tiny_tokenizer  # noqa: E402

# recipes/sft.py's configs (dg_matched_cpu.yaml belongs to recipes/dg_matched.py:
# tests/models/diffusion_gemma/test_matched_recipe.py; dflash_smollm2_cpu.yaml to recipes/dflash.py:
# tests/models/dflash/test_trainer.py; dflash_smollm2_fast_apply_cpu.yaml to recipes/dflash.py:
# tests/trainer/test_fast_apply_recipes.py).
OTHER_RECIPES = ("dg_matched_cpu.yaml", "dflash_smollm2_cpu.yaml", "dflash_smollm2_fast_apply_cpu.yaml")
CONFIGS = sorted(p for p in (ROOT / "recipes" / "configs").glob("*.yaml") if p.name not in OTHER_RECIPES)
ACCELERATE = sorted((ROOT / "recipes" / "accelerate").glob("*.yaml"))


def parse(*argv):
    return sft.make_parser().parse_args_and_config(args=list(argv))[:3]


def test_there_are_the_seven_configs_and_six_launch_files():
    assert {p.name for p in CONFIGS} == {"smollm2_cpu_csbp.yaml", "smollm2_cpu_parallel.yaml",
                                         "smollm2_cpu_confident.yaml", "smollm2_cpu_self_distill.yaml",
                                         "smollm2_cpu_fast_apply.yaml",
                                         "qwen3_conversion_256k_16gpu.yaml",
                                         "diffusion_gemma_26b_a4b_sft_256k_16gpu.yaml"}
    assert {p.name for p in ACCELERATE} == {"cpu_2proc.yaml", "cpu_2proc_fsdp2.yaml", "fsdp2_8gpu.yaml",
                                            "multinode_2x8gpu.yaml", "cpu_4proc_tp2_fsdp2.yaml",
                                            "tp2_fsdp2_2x8gpu.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_config_names_only_real_fields(path):
    fields = {f.name for cls in (sft.SFTScriptArguments, sft.BDLMSFTConfig, sft.ModelConfig)
              for f in dataclasses.fields(cls)}
    unknown = set(yaml.safe_load(path.read_text())) - fields
    assert not unknown, unknown


@pytest.mark.parametrize("path", ACCELERATE, ids=lambda p: p.stem)
def test_accelerate_configs_launch_the_right_world(path):
    config = yaml.safe_load(path.read_text())
    assert config["num_processes"] == {"cpu_2proc": 2, "cpu_2proc_fsdp2": 2, "fsdp2_8gpu": 8,
                                       "multinode_2x8gpu": 16, "cpu_4proc_tp2_fsdp2": 4,
                                       "tp2_fsdp2_2x8gpu": 16}[path.stem]
    if path.stem != "cpu_2proc":
        assert config["distributed_type"] == "FSDP" and config["fsdp_config"]["fsdp_version"] == 2
    # Tensor parallelism (inside a node) comes with FSDP2 over the rest, as the trainer requires.
    tp = config.get("parallelism_config", {}).get("parallelism_config_tp_size", 1)
    assert tp == (2 if "tp2" in path.stem else 1)


def test_cpu_config_parses_into_a_csbp_run():
    # One process here, so the group size is overridden on the command line (the YAML asks for 2).
    script, args, model = parse("--config", str(ROOT / "recipes/configs/smollm2_cpu_csbp.yaml"),
                                "--block_parallel_size", "1", "--output_dir", "/tmp/unused")
    assert model.model_name_or_path == "embedded:smollm2" and script.dataset_name == "hf_bdlm:arith"
    assert (args.block_parallel_mode, args.objective, args.block_size, args.bf16) == ("csbp", "fast_dllm_v2", 16,
                                                                                     False)
    assert yaml.safe_load((ROOT / "recipes/configs/smollm2_cpu_csbp.yaml").read_text())["block_parallel_size"] == 2


def test_the_longer_run_is_the_quickstart_trained_on_with_the_quickstart_as_its_checkpoint_90():
    quick = yaml.safe_load((ROOT / "recipes/configs/smollm2_cpu_csbp.yaml").read_text())
    longer = yaml.safe_load((ROOT / "recipes/configs/smollm2_cpu_parallel.yaml").read_text())
    changed = {k for k in quick.keys() | longer.keys() if quick.get(k) != longer.get(k)}
    assert changed == {"output_dir", "max_steps", "save_strategy", "save_steps", "save_only_model",
                       "exact_match_examples"}
    # a constant learning rate after warm-up: the first 90 steps are the quickstart's, whatever max_steps is
    assert longer["lr_scheduler_type"] == "constant_with_warmup" and longer["save_steps"] == quick["max_steps"]
    assert longer["max_steps"] > quick["max_steps"]


def test_qwen3_config_is_a_256k_csbp_conversion_over_16_ranks():
    config = yaml.safe_load((ROOT / "recipes/configs/qwen3_conversion_256k_16gpu.yaml").read_text())
    assert (config["max_length"], config["block_parallel_size"], config["clean_ring_size"]) == (262144, 16, 16)
    assert config["objective"] == "fast_dllm_v2" and config["packing"] is True
    _, args, _ = parse("--config", str(ROOT / "recipes/configs/qwen3_conversion_256k_16gpu.yaml"),
                       "--block_parallel_size", "1", "--clean_ring_size", "1", "--bf16", "false",
                       "--output_dir", "/tmp/unused")
    assert args.max_length == 262144 and args.max_length % (2 * 16 * args.block_size) == 0


def test_diffusion_gemma_config_is_a_256k_csbp_sft_over_16_ranks():
    _, args, _ = parse("--config", str(ROOT / "recipes/configs/diffusion_gemma_26b_a4b_sft_256k_16gpu.yaml"),
                       "--block_parallel_size", "1", "--clean_ring_size", "1", "--bf16", "false",
                       "--output_dir", "/tmp/x")
    config = yaml.safe_load((ROOT / "recipes/configs/diffusion_gemma_26b_a4b_sft_256k_16gpu.yaml").read_text())
    assert (config["max_length"], config["block_parallel_size"], config["clean_ring_size"]) == (262144, 16, 16)
    assert (args.objective, args.noise_eps_min, args.self_conditioning_prob, args.assistant_only_loss) == (
        "diffusion_gemma", 1e-4, 0.5, True)


def test_unknown_embedded_model_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown embedded model 'gpt5'"):
        sft.resolve_model_path("embedded:gpt5")


def test_recipe_converts_trains_scores_and_saves_a_tiny_model(tmp_path):
    model_dir = tmp_path / "causal"
    tiny_causal_lm().save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    data = tmp_path / "data"
    data.mkdir()
    for split, n in (("train", 12), ("test", 3)):
        rows = [{"prompt": [{"role": "user", "content": f"what is the sum of {i} and 1"}],
                 "completion": [{"role": "assistant", "content": str(i + 1)}], "answer": str(i + 1)}
                for i in range(n)]
        (data / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "out"
    results = sft.main(*parse(
        "--model_name_or_path", str(model_dir), "--dataset_name", str(data), "--output_dir", str(out),
        "--block_size", "4", "--max_steps", "2", "--per_device_train_batch_size", "2", "--max_length", "64",
        "--exact_match_examples", "2", "--report_to", "none", "--activation_checkpointing", "false",
        "--save_strategy", "no", "--disable_tqdm", "true",
    ))
    assert results["steps"] == 2 and 0 <= results["exact_match"] <= 1 and "exact_match_before" in results
    saved = set(os.listdir(out))
    assert {"model.safetensors", "config.json", "sft_results.json"} <= saved
    assert json.loads((out / "config.json").read_text())["model_type"] == "block_diffusion"


@pytest.mark.slow
@pytest.mark.distributed
@needs_embedded_model
def test_accelerate_launch_runs_the_embedded_cpu_csbp_config(tmp_path):
    out = tmp_path / "smollm2"
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "recipes/accelerate/cpu_2proc.yaml"), str(ROOT / "recipes/sft.py"),
           "--config", str(ROOT / "recipes/configs/smollm2_cpu_csbp.yaml"), "--max_steps", "1",
           "--per_device_train_batch_size", "2", "--exact_match_examples", "0", "--output_dir", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "world 2 = 1 data-parallel x P 2 (csbp, clean ring C 2)" in proc.stdout
    results = json.loads((out / "sft_results.json").read_text())
    assert results["steps"] == 1
    card = (out / "README.md").read_text()
    assert "csbp" in card


def test_the_confident_run_is_the_longer_run_plus_the_certainty_term_alone():
    longer = yaml.safe_load((ROOT / "recipes/configs/smollm2_cpu_parallel.yaml").read_text())
    confident = yaml.safe_load((ROOT / "recipes/configs/smollm2_cpu_confident.yaml").read_text())
    changed = {k for k in longer.keys() | confident.keys() if longer.get(k) != confident.get(k)}
    assert changed == {"output_dir", "certainty_weight"} and confident["certainty_weight"] > 0
    _, args, _ = parse("--config", str(ROOT / "recipes/configs/smollm2_cpu_confident.yaml"),
                       "--block_parallel_size", "1", "--output_dir", "/tmp/unused")
    assert args.certainty_weight == confident["certainty_weight"]


def test_the_ar_baseline_sees_the_bdlm_recipes_sequences():
    # The decoding study's AR parent (recipes/ar_sft.py) is trained on the BDLM recipe's token budget: as many steps,
    # each of the sequences one step of the 2-process recipe takes (a block-parallel group shares one batch).
    import ar_sft

    quick = yaml.safe_load((ROOT / "recipes/configs/smollm2_cpu_csbp.yaml").read_text())
    world = yaml.safe_load((ROOT / "recipes/accelerate/cpu_2proc.yaml").read_text())["num_processes"]
    per_step = quick["per_device_train_batch_size"] * world // quick["block_parallel_size"]
    defaults = ar_sft.settings(ar_sft.make_parser().parse_args([]))  # read from the quickstart's YAML
    assert (defaults["max_steps"], defaults["sequences_per_step"]) == (quick["max_steps"], per_step) == (90, 4)
    assert defaults["dataset"] == "hf_bdlm:arith" and defaults["output_dir"] == "outputs/smollm2-135m-ar-sft"


# --- recipes/self_distill.py: a block-diffusion model's own answers as SFT data ---------------------------------------


def _self_distill_model(tmp_path, eos):
    """The tiny random block-diffusion checkpoint; ``eos`` its generation config's EOS ids (``None``: it never ends)."""
    from tiny_bdlm import MASK, save_tiny_bdlm

    folder = save_tiny_bdlm(tmp_path / "bdlm")
    config = json.loads((folder / "generation_config.json").read_text())
    config["eos_token_id"] = eos if eos is None else [t for t in eos if t != MASK]
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


def test_self_distill_writes_the_models_own_answers_as_a_dataset_the_recipe_reads(tmp_path):
    import self_distill

    # Every token ends an answer: each answer is the model's first settled token, then it stops.
    folder = _self_distill_model(tmp_path, eos=list(range(64)))
    out = tmp_path / "data"
    summary = self_distill.main(["--model", str(folder), "--out", str(out), "--prompts", "5", "--batch_size", "2",
                                 "--max_new_tokens", "4", "--threads", "1"])
    assert (summary["prompts"], summary["rows"], summary["left_out_unfinished"]) == (5, 5, 0)
    train, test = sft.load_datasets(sft.SFTScriptArguments(dataset_name=str(out)))
    from hf_bdlm.data import load_splits

    shipped_train, shipped_test = load_splits("hf_bdlm:arith")
    assert len(train) == 5 and list(test) == list(shipped_test)  # the held-out split unchanged
    for i, row in enumerate(train):
        assert row["prompt"] == shipped_train[i]["prompt"] and row["answer"] == shipped_train[i]["answer"]
        [turn] = row["completion"]
        assert turn["role"] == "assistant" and len(turn["content"].split()) <= 1  # one token, its EOS dropped
    assert summary["teacher_exact_match"] == 0.0  # a random model's words are not the tasks' answers


def test_self_distill_refuses_a_model_whose_answers_never_end(tmp_path):
    import self_distill

    folder = _self_distill_model(tmp_path, eos=None)
    with pytest.raises(SystemExit, match="ended none of its 2 answers within --max_new_tokens 4"):
        self_distill.main(["--model", str(folder), "--out", str(tmp_path / "data"), "--prompts", "2",
                           "--max_new_tokens", "4"])
    assert not (tmp_path / "data").exists()
    with pytest.raises(SystemExit, match="--prompts 0"):
        self_distill.main(["--model", str(folder), "--out", str(tmp_path / "data"), "--prompts", "0"])


def test_the_self_distillation_run_trains_the_confident_model_on_its_own_answers():
    confident = yaml.safe_load((ROOT / "recipes/configs/smollm2_cpu_confident.yaml").read_text())
    distill = yaml.safe_load((ROOT / "recipes/configs/smollm2_cpu_self_distill.yaml").read_text())
    assert distill["model_name_or_path"] == confident["output_dir"]
    documented = (ROOT / "recipes/self_distill.py").read_text()
    assert f"--model {confident['output_dir']} --out {distill['dataset_name']}" in documented
    same = ("block_size", "objective", "certainty_weight", "learning_rate", "per_device_train_batch_size",
            "block_parallel_size", "block_parallel_mode", "max_length")
    assert {k: distill[k] for k in same} == {k: confident[k] for k in same}
