"""Worker of tests/rl/test_grpo_parallel.py (a job of the shared launch of 2 processes): one GRPO step of
BDLMGRPOTrainer on the tiny float64 block-diffusion LM, per estimator, under DDP and under FSDP2.

    PYTHONPATH=.:tests torchrun --nproc_per_node 2 tests/distributed/grpo_worker.py --out /tmp/grpo

Per estimator (``trace``, ``coupled``, ``one_step``), each rank records:

- ``ddp``: the step under DDP (SGD, constant learning rate, no clipping), the loss its micro-batch gave, the number of
  forwards of the model's decoder in the loss and the decoding steps its own rows took; whether every rank ends with the
  same weights; every parameter's gradient accumulated once per backward; and, against the reference, the largest
  difference between the DDP weights and ``w0 - lr * (g0 + g1) / 2`` where ``g_r`` is the gradient of rank ``r``'s own
  micro-batch (the one DDP saw) computed on a plain copy of the initial model in this process, alone; the reference's
  loss too (the forwards under DDP, extra ``trace`` steps included, must give the same loss);
- ``fsdp2``: the same step with ``fsdp="full_shard", fsdp_config={"fsdp_version": 2}``: whether every parameter is a
  DTensor, the decoder's forwards per rank in the rollout and in the loss, the loss, and the largest difference between
  its gathered weights and the DDP run's;
- the ``time/rollout_s`` and ``time/scoring_s`` the DDP run logged;
- ``trace`` only: FSDP2 asked by an accelerate FSDP2 config's environment (against the DDP run), and activation
  checkpointing under DDP (against its reference) and FSDP2 (against that DDP run).
"""

from __future__ import annotations

import argparse
import copy
import os
from pathlib import Path

import torch
import torch.distributed as dist
from datasets import Dataset
from torch.distributed.tensor import DTensor

from shared_launch import join_process_group, leave_process_group, record_rank_result
from tiny_bdlm import tiny_bdlm, tiny_tokenizer

from hf_bdlm.rl import BDLMGRPOConfig, BDLMGRPOTrainer
from hf_bdlm.trainer.fsdp import full_model_state_dict

ESTIMATORS = ("trace", "coupled", "one_step")
FSDP2 = dict(fsdp="full_shard", fsdp_config={"fsdp_version": 2})
# What `accelerate launch --config_file recipes/accelerate/cpu_2proc_fsdp2.yaml` sets.
ACCELERATE_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
                  "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT", "FSDP_RESHARD_AFTER_FORWARD": "true"}
LR = 1e-2
# Prompts of different lengths on the two ranks (the sampler gives each rank 2 of the 4 prompts, each twice), so the
# ranks decode for a different number of forwards and their rows take a different number of decoding steps.
DATA = Dataset.from_dict({"prompt": ["w9 w10 w11", "w12 w13", "w20 w21 w22 w23 w24 w25", "w30"] * 4})


def distinct_words(completions, **kwargs):
    return [float(len(set(text.split()))) for text in completions]


def confident_bdlm():
    """The tiny float64 block-diffusion LM with its LM head scaled up: confident enough that a step commits several
    tokens above the threshold, so rows of different prompts take different numbers of decoding steps."""
    model = tiny_bdlm(0).double()
    with torch.no_grad():
        model.backbone.lm_head.weight.mul_(20.0)
    return model


def args_for(out: Path, estimator: str, **fields) -> BDLMGRPOConfig:
    return BDLMGRPOConfig(**{**dict(
        output_dir=str(out), per_device_train_batch_size=4, num_generations=2, max_completion_length=8,
        learning_rate=LR, optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0, report_to=[], use_cpu=True,
        bf16=False, gradient_checkpointing=False, save_strategy="no", temperature=0.9, confidence_threshold=0.3,
        seed=0, beta=0.0, logging_steps=1, disable_tqdm=True, max_steps=1, logp_estimator=estimator), **fields})


class Recorder:
    """The decoder's forwards (in the rollout and in the loss) and the loss's micro-batches and losses of a trainer."""

    def __init__(self, trainer: BDLMGRPOTrainer):
        self.forwards = {"rollout": 0, "loss": 0}
        self.phase = None
        self.batches, self.losses = [], []
        inner = trainer.model
        inner.decoder.register_forward_hook(lambda *_: self._count())
        rollout, compute_loss = trainer.policy.rollout, trainer._compute_loss

        def recorded_rollout(*args, **kwargs):
            self.phase = "rollout"
            try:
                return rollout(*args, **kwargs)
            finally:
                self.phase = None

        def recorded_loss(model, inputs):
            self.batches.append({k: v.clone() if torch.is_tensor(v) else copy.deepcopy(v) for k, v in inputs.items()})
            self.phase = "loss"
            try:
                loss = compute_loss(model, inputs)
            finally:
                self.phase = None
            self.losses.append(float(loss))
            return loss

        trainer.policy.rollout, trainer._compute_loss = recorded_rollout, recorded_loss

    def _count(self):
        if self.phase is not None:
            self.forwards[self.phase] += 1


def decoding_steps(batch: dict) -> int:
    """The decoding steps the rows of a micro-batch took (their last committing step, plus one)."""
    steps = batch["policy.trace_steps"]
    committed = steps[(steps >= 0) & (steps < (1 << 30))]
    return int(committed.max()) + 1 if committed.numel() else 0


def all_ranks(value):
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def ddp_step(out: Path, estimator: str, **fields) -> tuple[dict, dict]:
    trainer = BDLMGRPOTrainer(confident_bdlm(), reward_funcs=distinct_words, args=args_for(out, estimator, **fields),
                              train_dataset=DATA, processing_class=tiny_tokenizer())
    initial = copy.deepcopy(trainer.model)
    # TRL patched the model's forward (a fused LM head) with a closure over the model's own bound forward, which a
    # copy would keep calling: the copy runs its class's forward.
    vars(initial).pop("forward", None)
    recorder = Recorder(trainer)
    accumulated = {name: 0 for name, p in trainer.model.named_parameters() if p.requires_grad}
    for name, p in trainer.model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: accumulated.__setitem__(name, accumulated[name] + 1))
    trainer.train()
    wrapped = type(trainer.model_wrapped).__name__
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    flat = torch.cat([w.flatten() for w in weights.values()])
    others = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(others, flat)

    # The reference: each rank's own micro-batch on a plain copy of the initial model, in this process alone (no
    # wrapper, no collective in its forwards); SGD on the mean of the ranks' gradients.
    [batch] = recorder.batches
    plain = initial.train()
    trainer.model.train()
    loss = trainer.compute_loss(plain, batch)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in plain.named_parameters()}
    worst = moved = 0.0
    for name, grad in grads.items():
        summed = grad / dist.get_world_size()
        dist.all_reduce(summed)
        expected = dict(initial.named_parameters())[name].detach() - LR * summed
        worst = max(worst, float((weights[name] - expected).abs().max()))
        moved = max(moved, float((weights[name] - dict(initial.named_parameters())[name].detach()).abs().max()))
    history = trainer.state.log_history
    step_log = next(h for h in history if "loss" in h)
    result = {
        "wrapped": wrapped,
        "same_weights_on_every_rank": all(torch.equal(others[0], o) for o in others),
        "accumulations": sorted(set(accumulated.values())),
        "parameters": len(accumulated),
        "loss": recorder.losses[0],
        "reference_loss": float(loss),
        "weights_vs_reference": worst,
        "moved": moved,
        "loss_forwards": recorder.forwards["loss"],
        "rollout_forwards": recorder.forwards["rollout"],
        "decoding_steps": decoding_steps(batch) if estimator == "trace" else None,
        "times": {k: step_log.get(k) for k in ("time/rollout_s", "time/scoring_s", "step_time")},
    }
    return result, weights


def fsdp2_step(out: Path, estimator: str, ddp_weights: dict, **fields) -> dict:
    trainer = BDLMGRPOTrainer(confident_bdlm(), reward_funcs=distinct_words,
                              args=args_for(out, estimator, **fields), train_dataset=DATA,
                              processing_class=tiny_tokenizer())
    recorder = Recorder(trainer)
    trainer.train()
    params = list(trainer.model.parameters())
    state = full_model_state_dict(trainer.model)
    worst = None
    if dist.get_rank() == 0:
        worst = max(float((state[n] - w).abs().max()) for n, w in ddp_weights.items())
        assert set(state) >= set(ddp_weights)
    [batch] = recorder.batches
    return {
        "dtensors": sum(isinstance(p, DTensor) for p in params), "parameters": len(params),
        "loss": recorder.losses[0],
        "loss_forwards": recorder.forwards["loss"],
        "rollout_forwards": recorder.forwards["rollout"],
        "decoding_steps": decoding_steps(batch) if estimator == "trace" else None,
        "weights_vs_ddp": worst,
    }


def run(out: Path) -> dict:
    results = {}
    for estimator in ESTIMATORS:
        ddp, weights = ddp_step(out / estimator / "ddp", estimator)
        fsdp2 = fsdp2_step(out / estimator / "fsdp2", estimator, weights, **FSDP2)
        results[estimator] = {"ddp": ddp, "fsdp2": fsdp2}
        if estimator == "trace":
            # FSDP2 asked for the accelerate way (an accelerate FSDP2 config's environment); activation checkpointing
            # (TRL's default; trace then runs each step in the training form), under DDP and FSDP2.
            os.environ.update(ACCELERATE_ENV)
            try:
                results["trace"]["fsdp2_accelerate_env"] = fsdp2_step(out / "trace" / "fsdp2_env", "trace", weights)
            finally:
                for key in ACCELERATE_ENV:
                    os.environ.pop(key)
            ckpt, ckpt_weights = ddp_step(out / "trace" / "ddp_ckpt", "trace", gradient_checkpointing=True)
            ckpt["weights_vs_ddp"] = max(float((ckpt_weights[n] - w).abs().max()) for n, w in weights.items())
            results["trace"]["ddp_checkpointing"] = ckpt
            results["trace"]["fsdp2_checkpointing"] = fsdp2_step(out / "trace" / "fsdp2_ckpt", "trace", ckpt_weights,
                                                                 gradient_checkpointing=True, **FSDP2)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    started = join_process_group()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record_rank_result(out, "grpo_", lambda: run(out))
    leave_process_group(started)


if __name__ == "__main__":
    main()
