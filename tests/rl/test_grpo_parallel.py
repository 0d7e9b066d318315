"""BDLMGRPOTrainer on 2 processes (one data-parallel group), DDP and FSDP2, every estimator, on the tiny float64
block-diffusion LM (a job of the shared launch of 2 processes: tests/distributed/grpo_worker.py); its timing metrics;
the combinations it refuses.

- DDP: after one step (SGD, constant learning rate, no clipping) every rank holds the same weights, equal to
  ``w0 - lr * (g0 + g1) / 2`` where ``g_r`` is the gradient of the micro-batch rank ``r`` trained on, computed alone on
  a plain copy of the initial model (TRL splits the global batch per process and normalizes the loss by the global
  token count, so the mean of the ranks' gradients is the single-process gradient of the global batch); each rank's
  loss equals the plain copy's; every parameter's gradient is accumulated once per backward, ``trace``'s 1 + S forwards
  included.
- FSDP2 (``fsdp="full_shard", fsdp_config={"fsdp_version": 2}``, and ``trace`` from an accelerate FSDP2 config's
  environment): every parameter a DTensor; the weights after the step equal the DDP run's (``trace`` with activation
  checkpointing too); the rollouts decode for a different number of forwards on the two ranks (the whole model
  gathered: no collective in them) and ``trace``'s rows take a different number of decoding steps on the two ranks, yet
  both run 1 + (the larger) forwards in the loss.
"""

from __future__ import annotations

import json

import pytest
from accelerate import ParallelismConfig
from grpo_worker import DATA, ESTIMATORS, args_for, confident_bdlm, distinct_words
from tiny_bdlm import tiny_tokenizer
from torchrun import SharedJob

from hf_bdlm.models.block_diffusion.training.policy import BlockDiffusionPolicy
from hf_bdlm.models.diffusion_gemma.training.policy import DiffusionGemmaPolicy
from hf_bdlm.rl import BDLMGRPOTrainer

SHARED_JOBS = [SharedJob("grpo", "grpo_worker.py", 2, ("--out", "{out}"), timeout=600)]
# Measured (float64, one step, weights of magnitude ~0.1 moved by up to 0.037): DDP against the mean of the ranks'
# gradients at most 1.4e-17 absolute; FSDP2 against DDP 0.0 (also from the accelerate environment, and both with
# activation checkpointing). (Checkpointed against not: 4.3e-10, the two forms of trace's forwards round differently in
# transformers' float32 RMSNorm; no parallel effect, not asserted.)
WEIGHTS_TOL = 1e-12


@pytest.fixture(scope="module")
def ranks(shared_launch):
    out = shared_launch.folder("grpo", 2)
    return [json.loads((out / f"grpo_rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.distributed
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_ddp_step_equals_the_mean_of_the_ranks_own_gradients(ranks, estimator):
    for rank in ranks:
        ddp = rank[estimator]["ddp"]
        assert ddp["wrapped"] == "DistributedDataParallel" and ddp["same_weights_on_every_rank"]
        assert ddp["moved"] > 1e-3  # the step moved the weights
        assert ddp["weights_vs_reference"] <= WEIGHTS_TOL, ddp["weights_vs_reference"]
        assert ddp["loss"] == ddp["reference_loss"]  # the forwards under DDP, extra trace steps included
        assert ddp["accumulations"] == [1] and ddp["parameters"] == 21  # one AccumulateGrad per parameter


@pytest.mark.distributed
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_fsdp2_shards_and_its_step_equals_ddp(ranks, estimator):
    for rank in ranks:
        fsdp2, ddp = rank[estimator]["fsdp2"], rank[estimator]["ddp"]
        assert fsdp2["dtensors"] == fsdp2["parameters"] == 21
        assert fsdp2["loss"] == ddp["loss"]
        assert fsdp2["loss_forwards"] == ddp["loss_forwards"]
    assert ranks[0][estimator]["fsdp2"]["weights_vs_ddp"] <= WEIGHTS_TOL  # gathered on rank 0


@pytest.mark.distributed
def test_fsdp2_from_an_accelerate_config_and_with_activation_checkpointing_equals_ddp(ranks):
    """``trace`` with FSDP2 asked by an accelerate FSDP2 config's environment; and under activation checkpointing
    (TRL's default), DDP against the mean of the ranks' own gradients and FSDP2 against that DDP run."""
    env, ddp_ckpt, fsdp2_ckpt = (ranks[0]["trace"][k] for k in ("fsdp2_accelerate_env", "ddp_checkpointing",
                                                                  "fsdp2_checkpointing"))
    assert env["dtensors"] == fsdp2_ckpt["dtensors"] == 21
    assert env["weights_vs_ddp"] <= WEIGHTS_TOL and env["loss_forwards"] == ranks[0]["trace"]["ddp"]["loss_forwards"]
    assert ddp_ckpt["same_weights_on_every_rank"] and ddp_ckpt["accumulations"] == [1]
    assert ddp_ckpt["weights_vs_reference"] <= WEIGHTS_TOL and fsdp2_ckpt["weights_vs_ddp"] <= WEIGHTS_TOL
    # Checkpointed, trace runs each step in the training form (no clean forward): S forwards, on both ranks.
    steps = [rank["trace"]["fsdp2_checkpointing"]["decoding_steps"] for rank in ranks]
    assert [rank["trace"][m]["loss_forwards"] for rank in ranks for m in ("ddp_checkpointing", "fsdp2_checkpointing")] \
        == [max(steps)] * 4


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_ranks_that_decode_and_replay_different_step_counts_run_the_same_forwards(ranks, mode):
    rollouts = [rank["trace"][mode]["rollout_forwards"] for rank in ranks]
    steps = [rank["trace"][mode]["decoding_steps"] for rank in ranks]
    assert len(set(rollouts)) == 2, rollouts  # the ranks' rollouts decode for different numbers of forwards
    assert len(set(steps)) == 2, steps  # and their rows took different numbers of decoding steps
    assert [rank["trace"][mode]["loss_forwards"] for rank in ranks] == [1 + max(steps)] * 2


@pytest.mark.distributed
def test_the_log_times_rollouts_and_scoring_apart(ranks):
    for estimator in ESTIMATORS:
        times = ranks[0][estimator]["ddp"]["times"]
        assert times["time/rollout_s"] > 0 and times["time/scoring_s"] > 0
        assert times["time/rollout_s"] + times["time/scoring_s"] <= times["step_time"]


# --- one process -------------------------------------------------------------------------------------------------
def trainer_for(tmp_path, **fields) -> BDLMGRPOTrainer:
    return BDLMGRPOTrainer(confident_bdlm(), reward_funcs=distinct_words, args=args_for(tmp_path, "trace", **fields),
                           train_dataset=DATA, processing_class=tiny_tokenizer())


def test_a_step_logs_its_rollout_and_scoring_seconds(tmp_path):
    trainer = trainer_for(tmp_path)
    trainer.train()
    [log] = [h for h in trainer.state.log_history if "loss" in h]
    assert log["time/rollout_s"] > 0 and log["time/scoring_s"] > 0
    assert log["time/rollout_s"] + log["time/scoring_s"] <= log["step_time"]


def test_fsdp2_on_one_process_is_refused(tmp_path, monkeypatch):
    # An accelerate FSDP2 config (its environment) on one process; transformers refuses fsdp= itself there.
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    with pytest.raises(ValueError, match="FSDP2 was requested .* but this is a single process: launch at least 2"):
        trainer_for(tmp_path)
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ValueError, match="BDLMGRPOTrainer shards with FSDP2 only, got fsdp_version=1"):
        trainer_for(tmp_path)


def test_bad_parallel_combinations_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="ddp_find_unused_parameters=True: the estimators apply the LM head outside"):
        trainer_for(tmp_path, ddp_find_unused_parameters=True)
    with pytest.raises(ValueError, match="parallelism_config: BDLMGRPOTrainer trains one data-parallel group"):
        trainer_for(tmp_path, parallelism_config=ParallelismConfig())


def test_only_the_block_diffusion_policy_trains_on_several_processes():
    assert BlockDiffusionPolicy.data_parallel and not DiffusionGemmaPolicy.data_parallel
    assert "outside the DDP or FSDP2 wrapper" in DiffusionGemmaPolicy.single_process_reason
