"""The training settings users paste from the HF docs, end to end on 2 processes under csbp, against P = 1.

For a converted causal LM (a tiny Qwen3 through ``convert_causal_lm``) and for DiffusionGemma, each setting trains 3
AdamW steps at P = 2 (csbp, one block-parallel group over 2 processes) and must log the losses of the single-process
run of the same setting (P = 1), and must really do what it says:

- ``fsdp="full_shard", fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": [<the decoder layers>]}``:
  every parameter a DTensor (the explicit class names used to be checked after ``fully_shard`` had renamed them);
- an Accelerate FSDP2 config file (``accelerate launch --config_file recipes/accelerate/cpu_2proc_fsdp2.yaml``);
- ``gradient_checkpointing=True`` (transformers' name alone): the model checkpoints its layers;
- ``bf16=True``: the layers run under bfloat16 autocast (on a CPU machine too);
- LoRA with a config as in the PEFT docs (``target_modules="all-linear"`` for the causal LM, the reference targets for
  DiffusionGemma): adapters trained, the base frozen.

See tests/distributed/hf_configs_worker.py for the runs.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchrun import ROOT, SharedJob, run_in_process
from paths import DISTRIBUTED, PYTHONPATH

FAMILIES = ["converted_qwen3", "diffusion_gemma"]
# Measured: float32 P = 2 against P = 1, 0 to 1.2e-7 relative (DiffusionGemma under FSDP2: its reduce-scatter sums in
# another order); bfloat16 autocast 2.3e-5 (converted Qwen3) and 3.4e-4 (DiffusionGemma), the rounding of bf16
# matmuls over other row splits.
FLOAT32_TOL = 2e-6
BF16_TOL = 2e-3


def _load(out: Path, tag: str) -> dict:
    return json.loads((out / f"{tag}_rank0.json").read_text())


SHARED_JOBS = [SharedJob("hf_configs", "hf_configs_worker.py", 2)]


@pytest.fixture(scope="module")
def runs(shared_launch):
    out = shared_launch.folder("hf_configs", 2)
    run_in_process("hf_configs_worker.py", "--out", str(out))  # the P = 1 references: one process
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=PYTHONPATH)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "recipes" / "accelerate" / "cpu_2proc_fsdp2.yaml"),
           str(DISTRIBUTED / "hf_configs_worker.py"), "--out", str(out), "--only", "plain"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"accelerate launch failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return {"p1": _load(out, "world1"), "p2": _load(out, "world2"), "accelerate_fsdp": _load(out, "accelerate_fsdp")}


def _rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _check_against_p1(run, reference, tol):
    assert run["world"] == 2 and run["P"] == 2 and reference["P"] == 1
    assert run["steps"] == reference["steps"] == [1, 2, 3]
    assert _rel(run["losses"], reference["losses"]) <= tol, (run["losses"], reference["losses"])


@pytest.mark.distributed
@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp_config_with_explicit_layer_classes_shards_and_matches_p1(runs, family):
    run = runs["p2"][f"{family}/fsdp_layer_classes"]
    assert run["dtensors"] == run["parameters"] > 0
    _check_against_p1(run, runs["p1"][f"{family}/plain"], FLOAT32_TOL)


@pytest.mark.distributed
@pytest.mark.parametrize("family", FAMILIES)
def test_accelerate_fsdp2_config_file_shards_and_matches_p1(runs, family):
    run = runs["accelerate_fsdp"][f"{family}/plain"]
    assert run["dtensors"] == run["parameters"] > 0
    _check_against_p1(run, runs["p1"][f"{family}/plain"], FLOAT32_TOL)


@pytest.mark.distributed
@pytest.mark.parametrize("family", FAMILIES)
def test_gradient_checkpointing_true_checkpoints_and_matches_p1(runs, family):
    run, reference = runs["p2"][f"{family}/gradient_checkpointing"], runs["p1"][f"{family}/gradient_checkpointing"]
    assert run["activation_checkpointing"] and reference["activation_checkpointing"]
    assert not runs["p1"][f"{family}/plain"]["activation_checkpointing"]
    _check_against_p1(run, reference, FLOAT32_TOL)
    # Recomputing a layer in backward changes nothing: the same losses as without checkpointing.
    assert _rel(run["losses"], runs["p1"][f"{family}/plain"]["losses"]) <= FLOAT32_TOL


@pytest.mark.distributed
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_true_runs_under_bfloat16_autocast_and_matches_p1(runs, family):
    run, reference = runs["p2"][f"{family}/bf16"], runs["p1"][f"{family}/bf16"]
    assert run["autocast"] == reference["autocast"] == ["torch.bfloat16"]
    assert runs["p1"][f"{family}/plain"]["autocast"] is None
    _check_against_p1(run, reference, BF16_TOL)


@pytest.mark.distributed
@pytest.mark.parametrize("family", FAMILIES)
def test_lora_trains_adapters_only_and_matches_p1(runs, family):
    run, reference = runs["p2"][f"{family}/lora"], runs["p1"][f"{family}/lora"]
    assert run["lora_parameters"] > 0 and run["trainable"] == run["lora_parameters"]
    _check_against_p1(run, reference, FLOAT32_TOL)


@pytest.mark.distributed
@pytest.mark.parametrize("family", FAMILIES)
def test_an_emulated_cluster_link_delays_the_exchange_and_changes_no_loss(runs, family):
    """block_parallel_link="h200-ib": every K/V transfer waits for the stretched link (at least its latency for each
    of the 3 steps' forward gathers of 2 layers), and the losses are P = 1's."""
    run = runs["p2"][f"{family}/emulated_link"]
    name, latency, rate = run["link"]
    assert name == "h200-ib" and latency > 0
    # The compute rate that stretched the link was measured by both processes of the launch at once.
    assert rate["processes"] == len(rate["per_rank"]) == 2 and rate["flops_per_s"] == min(rate["per_rank"])
    assert run["comm_wait_s"] >= 3 * 2 * latency
    assert runs["accelerate_fsdp"][f"{family}/plain"]["comm_wait_s"] < run["comm_wait_s"] / 10  # no link
    _check_against_p1(run, runs["p1"][f"{family}/plain"], FLOAT32_TOL)

