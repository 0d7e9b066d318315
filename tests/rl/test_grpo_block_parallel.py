"""BDLMGRPOTrainer with block parallelism (``block_parallel_size=2``): the 2 ranks of a group share each row, every
scoring forward sharded over them as SFT shards it, against one process (a job of the shared launch of 2 processes:
tests/distributed/grpo_block_parallel_worker.py, the tiny float64 block-diffusion LM, float64 RMSNorms); the
combinations it refuses.

- Scoring (the policy, ``PolicyScoring.block_parallel``): for every estimator, under ``csbp`` (all-gather and ring
  K/V transport), ``bp`` and ``cp``, and ``csbp`` with a token shift, three rows (a prompt of 31 tokens, one of 3, one
  of 19; 11 completion tokens each) give on each rank the log-probabilities and entropies of one process, and the
  group's summed gradients of a weighted sum of them equal one process's gradient; each rank's forwards ran fewer rows
  than the frame's ``2L``, as many forwards as one process.
- Training (one GRPO step under DDP, SGD): both ranks train on the same micro-batch (the group's pooled rows: prompts,
  completions, advantages), decoded on the first rank only; the weights after the step equal ``w0 - lr * g``, ``g``
  the gradient of that micro-batch's loss on one process; the loss (and the logged loss) is that process's; the logged
  token count counts the group's rows once.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from torchrun import SharedJob

from hf_bdlm.rl import BDLMGRPOConfig
from hf_bdlm.rl.config import BLOCK_PARALLEL_FIELDS
from hf_bdlm.rl.trainer import check_block_parallel
from hf_bdlm.trainer.config import BDLMSFTConfig

SHARED_JOBS = [SharedJob("grpo_block_parallel", "grpo_block_parallel_worker.py", 2, ("--out", "{out}"), timeout=600)]
# Measured (float64): log-probabilities and entropies at most 3.1e-15 from one process's (values of magnitude ~1-5),
# the group's gradients at most 9.9e-16 relative to the largest gradient; the weights after a GRPO step at most
# 1.7e-17 from the one-process step (weights moved by up to 0.04), its loss 6.9e-17 from the one-process loss.
VALUES_TOL = 1e-12
GRAD_REL_TOL = 1e-12
WEIGHTS_TOL = 1e-12
LAYOUTS = ("csbp", "csbp_ring", "bp", "cp")
ESTIMATORS = ("trace", "coupled", "one_step")
TRAINER_CASES = ESTIMATORS + ("coupled_reference_checkpointing",)


@pytest.fixture(scope="module")
def ranks(shared_launch):
    out = shared_launch.folder("grpo_block_parallel", 2)
    return [json.loads((out / f"grpo_bp_rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.distributed
@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("case", [f"{layout}/standard" for layout in LAYOUTS] + ["csbp/fast_dllm_v2"])
def test_sharded_scoring_equals_one_process(ranks, case, estimator):
    for rank in ranks:
        got = rank["scoring"][f"{case}/{estimator}"]
        assert got["same_completions_on_every_rank"] and got["tokens"] == 33
        assert got["log_probs_err"] <= VALUES_TOL and got["entropies_err"] <= VALUES_TOL, got
        assert got["grad_rel_err"] <= GRAD_REL_TOL and got["grad_scale"] > 1.0, got
        assert got["requires_grad"]
        # Sharded: each rank's forwards run part of the frame's rows, as many forwards as one process.
        assert got["forwards"] == got["reference_forwards"] >= 1
        assert all(rows < got["frame_rows"] for rows in got["rows_per_forward"]), got
    if case.startswith(("csbp", "cp")):  # the rows split evenly (bp replicates the clean prefix)
        assert {rows for rank in ranks for rows in rank["scoring"][f"{case}/{estimator}"]["rows_per_forward"]} == \
            {ranks[0]["scoring"][f"{case}/{estimator}"]["frame_rows"] // 2}


@pytest.mark.distributed
@pytest.mark.parametrize("case", TRAINER_CASES)
def test_a_block_parallel_grpo_step_equals_one_process_on_the_groups_rows(ranks, case):
    zero, one = (rank["trainer"][case] for rank in ranks)
    assert zero["group"] == [0, 0, 2] and one["group"] == [0, 1, 2]
    for key in ("prompts", "completions", "advantages"):
        assert zero[key] == one[key], key  # the same rows, in the same order, on both ranks
    # The micro-batch holds 2 x per_device_train_batch_size rows, from the group's pooled round (the long prompt in it).
    assert zero["rows"] == 4 and max(map(len, zero["prompts"])) == 30
    assert any(a != 0 for a in zero["advantages"])
    assert zero["rollout_forwards"] > 0 and one["rollout_forwards"] == 0  # decoded once, by the group's first rank
    assert len(zero["round_tokens"]) == 1 and zero["round_tokens"] == one["round_tokens"]
    assert zero["num_tokens"] == one["num_tokens"] == zero["round_tokens"][0]  # the group's rows counted once
    for rank in (zero, one):
        assert rank["wrapped"] == "DistributedDataParallel"
        assert rank["moved"] > 1e-3
        assert rank["weights_vs_reference"] <= WEIGHTS_TOL, rank["weights_vs_reference"]
        assert abs(rank["loss"] - rank["reference_loss"]) <= WEIGHTS_TOL
        assert rank["logged_loss"] == pytest.approx(rank["loss"], rel=1e-6, abs=1e-12)  # the log: float32, unscaled
    if case == "coupled_reference_checkpointing":
        assert abs(zero["loss"]) > 0.1  # the entropy bonus: a loss that is not 0 at the first iteration


@pytest.mark.distributed
def test_block_parallelism_with_fsdp2_or_diffusion_gemma_is_refused_by_name(ranks):
    for rank in ranks:
        assert "block_parallel_size=2 with FSDP2: untested" in rank["refused"]["fsdp2"]
        assert ("block_parallel_size=2 with DiffusionGemmaForBlockDiffusion ('diffusion_gemma' family) and "
                "logp_estimator='coupled'") in rank["refused"]["diffusion_gemma"]
        assert "none of its estimators does" in rank["refused"]["diffusion_gemma"]


# --- one process -------------------------------------------------------------------------------------------------
def config(**fields) -> BDLMGRPOConfig:
    return BDLMGRPOConfig(output_dir="unused", use_cpu=True, report_to=[], num_generations=2,
                          per_device_train_batch_size=2, **fields)


def test_the_block_parallel_fields_are_the_sft_configs():
    sft, grpo = BDLMSFTConfig.__dataclass_fields__, BDLMGRPOConfig.__dataclass_fields__
    for name in BLOCK_PARALLEL_FIELDS:
        assert grpo[name].default == sft[name].default and dict(grpo[name].metadata) == dict(sft[name].metadata)
    assert config().parallel_dims.block_parallel_size == 1


def test_a_block_parallel_size_that_does_not_divide_the_world_is_refused():
    with pytest.raises(ValueError, match="block_parallel_size=2 does not divide the world size 1"):
        config(block_parallel_size=2)
    with pytest.raises(ValueError, match="block_parallel_mode must be one of"):
        config(block_parallel_mode="ring")


@pytest.mark.parametrize("given,named", [
    (dict(tools=[print]), "tools"),
    (dict(environment_factory=object), "environment_factory"),
    (dict(rollout_func=print), "rollout_func"),
    (dict(peft_config=object()), "a peft_config"),
])
def test_what_block_parallelism_does_not_run_is_refused_by_name(given, named):
    arguments = {**dict(peft_config=None, tools=None, environment_factory=None, rollout_func=None), **given}
    with pytest.raises(ValueError, match=f"block_parallel_size=2 with {named}"):
        check_block_parallel(SimpleNamespace(block_parallel_size=2), **arguments)
    check_block_parallel(SimpleNamespace(block_parallel_size=1), **arguments)  # P = 1: nothing sharded, nothing refused
