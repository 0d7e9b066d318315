"""The fast-apply comparison's three recipes, tied without training: the BDLM YAML
(recipes/configs/smollm2_cpu_fast_apply.yaml, recipes/sft.py), its AR parent (recipes/ar_sft.py, which reads that
YAML: same dataset, steps, sequences per step, sequence length, learning rate, schedule, seed) and the DFlash drafter
for that parent (recipes/configs/dflash_smollm2_fast_apply_cpu.yaml, recipes/dflash.py: the parent's folder as its
target, the same prompts, budgets that hold the task's longest answer)."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys

import yaml
from paths import ROOT

from hf_bdlm.data import shipped_task
from hf_bdlm.models.dflash.training.config import DFlashTrainingConfig

sys.path.insert(0, str(ROOT / "recipes"))
import ar_sft  # noqa: E402
import sft  # noqa: E402

BDLM = ROOT / "recipes/configs/smollm2_cpu_fast_apply.yaml"
DRAFTER = ROOT / "recipes/configs/dflash_smollm2_fast_apply_cpu.yaml"
LAUNCH = ROOT / "recipes/accelerate/cpu_2proc.yaml"


def _dflash_recipe():
    if "dflash_recipe" not in sys.modules:  # registered first: its dataclasses look their module up
        spec = importlib.util.spec_from_file_location("dflash_recipe", ROOT / "recipes" / "dflash.py")
        sys.modules["dflash_recipe"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["dflash_recipe"])
    return sys.modules["dflash_recipe"]


def test_the_ar_parent_trains_on_the_bdlm_recipes_sequences_steps_and_settings():
    bdlm = yaml.safe_load(BDLM.read_text())
    world = yaml.safe_load(LAUNCH.read_text())["num_processes"]
    per_step = (bdlm["per_device_train_batch_size"] * bdlm["gradient_accumulation_steps"] * world
                // bdlm["block_parallel_size"])  # a block-parallel group shares each batch
    by_dataset = ar_sft.settings(ar_sft.make_parser().parse_args(["--dataset", "hf_bdlm:fast_apply"]))
    by_config = ar_sft.settings(ar_sft.make_parser().parse_args(["--config", str(BDLM)]))
    assert {k: v for k, v in by_dataset.items() if k != "config"} == {k: v for k, v in by_config.items()
                                                                       if k != "config"}
    assert by_dataset["config"] == str(BDLM)
    assert (by_dataset["dataset"], by_dataset["max_steps"], by_dataset["sequences_per_step"]) == (
        bdlm["dataset_name"], bdlm["max_steps"], per_step) == ("hf_bdlm:fast_apply", 64, 2)
    same = {"max_length": "max_length", "learning_rate": "learning_rate", "lr_scheduler_type": "lr_scheduler_type",
            "warmup_steps": "warmup_steps", "weight_decay": "weight_decay", "seed": "seed",
            "activation_checkpointing": "activation_checkpointing"}
    assert {k: by_dataset[k] for k in same} == {k: bdlm[v] for k, v in same.items()}
    assert by_dataset["output_dir"] == "outputs/smollm2-135m-ar-fast-apply"
    card = ar_sft.like_for_like_section(by_dataset, 0.5)
    assert "`smollm2_cpu_fast_apply.yaml`" in card and "64 steps of 2 sequences, max_length 1024" in card


def test_the_bdlm_config_parses_into_a_csbp_run_on_the_task():
    bdlm = yaml.safe_load(BDLM.read_text())
    fields = {f.name for cls in (sft.SFTScriptArguments, sft.BDLMSFTConfig, sft.ModelConfig)
              for f in dataclasses.fields(cls)}
    assert not set(bdlm) - fields
    script, args, model = sft.make_parser().parse_args_and_config(
        args=["--config", str(BDLM), "--block_parallel_size", "1", "--output_dir", "/tmp/unused"])[:3]
    assert (model.model_name_or_path, script.dataset_name, args.block_size, args.objective) == (
        "embedded:smollm2", "hf_bdlm:fast_apply", 32, "fast_dllm_v2")
    assert bdlm["block_parallel_size"] == 2 and bdlm["block_parallel_mode"] == "csbp"
    train, test = sft.load_datasets(script)
    assert (len(train), len(test)) == (2210, 400)


def test_the_drafter_trains_for_the_ar_parent_on_its_answers_to_the_task(tmp_path):
    recipe = _dflash_recipe()
    config = yaml.safe_load(DRAFTER.read_text())
    fields = {f.name for cls in (recipe.DFlashRecipeArguments, DFlashTrainingConfig) for f in dataclasses.fields(cls)}
    assert not set(config) - fields, set(config) - fields
    ar = ar_sft.settings(ar_sft.make_parser().parse_args(["--dataset", "hf_bdlm:fast_apply"]))
    assert (config["target_model"], config["dataset_name"]) == (ar["output_dir"], ar["dataset"])
    longest = shipped_task("fast_apply").longest_answer_tokens
    assert config["response_max_tokens"] > longest and config["eval_max_new_tokens"] > longest
    assert (config["drafter_block_size"], config["block_parallel_size"], config["block_parallel_mode"]) == (8, 2,
                                                                                                         "csbp")
    script, args = recipe.make_parser().parse_args_and_config(
        args=["--config", str(DRAFTER), "--block_parallel_size", "1", "--output_dir", str(tmp_path)])[:2]
    assert script.eval_speculative_tokens[0] == script.drafter_block_size - 1  # the headline: block 8
    assert recipe.GOALS[script.dataset_name] == (4.0, 1.8)
    train, held_out = recipe.load_prompts(script.dataset_name)
    assert (len(train), len(held_out)) == (2210, 400) and train[0][0]["role"] == "user"
