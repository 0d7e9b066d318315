"""Worker of tests/rl/test_grpo_block_parallel.py (a job of the shared launch of 2 processes): GRPO scoring sharded over
a block-parallel group of the 2 ranks, on the tiny float64 block-diffusion LM, against one process.

    PYTHONPATH=.:tests:tests/distributed torchrun --nproc_per_node 2 tests/distributed/grpo_block_parallel_worker.py \
        --out /tmp/grpo_bp

Each rank records:

- ``scoring``: per layout (``csbp`` with each K/V transport, ``bp``, ``cp``; ``csbp`` with a token shift too) and per
  estimator, the policy's log-probabilities and entropies of three rows (a long prompt, a short one, a middle one)
  sharded over the group (``PolicyScoring.block_parallel``, the plugin SFT uses) against the same call on one process
  (the largest absolute difference), and the gradient of a fixed weighted sum of them: the group's summed gradients
  against the one-process gradient (largest difference relative to the largest gradient); the rows each rank's forwards
  ran against the frame's ``2L``; whether both ranks decoded the same completions;
- ``trainer``: per estimator, one GRPO step of ``BDLMGRPOTrainer`` with ``block_parallel_size=2`` under DDP (SGD,
  constant learning rate; ``coupled`` also with a reference model, activation checkpointing and an entropy
  bonus): the micro-batch each rank trained on (its rows, prompts, completions and advantages, for the
  test to compare across ranks), the decoder's forwards in the rollout on this rank, the logged ``num_tokens`` and the
  tokens of the round's rows (the group's), the loss, the logged loss, and,
  against the reference (the same rows on one process: the trainer's block parallelism off, a plain copy of the initial
  model), its loss and the largest difference between the weights after the step and ``w0 - lr * g``;
- ``refused``: the errors of block parallelism with FSDP2 and with DiffusionGemma.

The backbone's RMSNorms compute in float64 for this job (transformers' compute in float32, which rounds a float64
model's reassociation-level differences up to float32's): restored when the job ends.
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from datasets import Dataset
from transformers import LlamaConfig
from transformers.models.llama import modeling_llama

from grpo_worker import FSDP2, LR, Recorder, all_ranks, args_for, confident_bdlm, distinct_words
from shared_launch import join_process_group, leave_process_group, record_rank_result
from tiny_bdlm import BLOCK, MASK, padded_batch, tiny_tokenizer
from tiny_diffusion_gemma import tiny_model as tiny_dg, tiny_tokenizer as dg_tokenizer

from hf_bdlm import BlockDiffusionConfig, BlockDiffusionForMaskedLM
from hf_bdlm.models import family_named
from hf_bdlm.parallel import BlockParallelPlugin
from hf_bdlm.protocols.policy import PolicyScoring
from hf_bdlm.rl import BDLMGRPOTrainer

ESTIMATORS = ("trace", "coupled", "one_step")
# A long prompt (31 tokens: several blocks of context, over both ranks), a short one, one in between.
PROMPTS = [[2] + list(range(7, 37)), [2, 5, 9], [2] + list(range(40, 58))]
LAYOUTS = {"csbp": dict(mode="csbp"), "csbp_ring": dict(mode="csbp", transport="ring"), "bp": dict(mode="bp"),
           "cp": dict(mode="cp")}
# Prompts of different lengths, one of them long; the group pools both ranks' shares of each round.
DATA = Dataset.from_dict({"prompt": [" ".join(f"w{i}" for i in range(7, 37)), "w12 w13",
                                     "w20 w21 w22 w23 w24 w25", "w30"] * 4})
BP = dict(block_parallel_size=2, per_device_train_batch_size=2, steps_per_generation=2)


def float64_forward(self, hidden):
    return self.weight * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def tiny_model(objective: str) -> BlockDiffusionForMaskedLM:
    torch.manual_seed(0)
    backbone = LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256)
    model = BlockDiffusionForMaskedLM(BlockDiffusionConfig(backbone_config=backbone, block_size=BLOCK,
                                                           mask_token_id=MASK, objective=objective))
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        model.backbone.lm_head.weight.mul_(20.0)  # confident: steps commit several tokens (trace's steps differ)
    return model.double()


def scoring_case(plugin: BlockParallelPlugin, objective: str, estimator: str) -> dict:
    model = tiny_model(objective)
    args = args_for(Path("unused"), estimator, max_completion_length=11, temperature=0.8, confidence_threshold=0.3)
    policy = family_named("block_diffusion").role("policy").policy(model, tiny_tokenizer(), args)
    rollout = policy.rollout(model, PROMPTS, seed=3, trace=estimator == "trace")
    batch = padded_batch(PROMPTS, rollout.completions, rollout.rows)
    scoring = PolicyScoring(estimator, temperature=0.8, seed=11, prompt_mask_ratio=0.3, cache_clean_rows=False)
    weights = torch.randn(batch.completion_ids.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    rows_seen = []
    hook = model.decoder.register_forward_hook(
        lambda module, args, kwargs, out: rows_seen.append(int(kwargs["position_ids"].shape[1])), with_kwargs=True)

    def run(block_parallel):
        model.zero_grad()
        rows_seen.clear()
        lp, ent = policy.log_probs(model, batch, replace(scoring, block_parallel=block_parallel), entropy=True)
        ((weights * lp).sum() + 0.1 * (weights * ent).sum()).backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        return lp.requires_grad, lp.detach(), ent.detach(), grads, list(rows_seen)

    try:
        _, ref_lp, ref_ent, ref_grads, ref_rows = run(None)
        requires_grad, lp, ent, grads, sharded_rows = run(plugin)
    finally:
        hook.remove()
    group = plugin.groups.group.group
    for grad in grads:
        dist.all_reduce(grad, group=group)  # the group's gradients add up to one process's
    scale = max(float(g.abs().max()) for g in ref_grads)
    L = -(-max(len(p) + len(c) for p, c in zip(PROMPTS, rollout.completions)) // plugin.pad_multiple(BLOCK)) * \
        plugin.pad_multiple(BLOCK)
    return {
        "same_completions_on_every_rank": all(c == rollout.completions for c in all_ranks(rollout.completions)),
        "tokens": int(batch.completion_mask.sum()),
        "log_probs_err": float((lp - ref_lp).abs().max()),
        "entropies_err": float((ent - ref_ent).abs().max()),
        "grad_rel_err": max(float((g - r).abs().max()) for g, r in zip(grads, ref_grads)) / scale,
        "grad_scale": scale,
        "forwards": len(sharded_rows), "reference_forwards": len(ref_rows),
        "rows_per_forward": sorted(set(sharded_rows)), "frame_rows": 2 * L,
        "requires_grad": requires_grad,
    }


def trainer_case(out: Path, estimator: str, **fields) -> dict:
    trainer = BDLMGRPOTrainer(confident_bdlm(), reward_funcs=distinct_words, train_dataset=DATA,
                              args=args_for(out, estimator, **BP, **fields), processing_class=tiny_tokenizer())
    initial = copy.deepcopy(trainer.model)
    vars(initial).pop("forward", None)  # TRL's patched forward closes over the trained model's bound forward
    recorder = Recorder(trainer)
    round_tokens = []  # the tokens of each round's rows (this rank holds the group's)
    generate = trainer._generate_and_score_completions

    def recorded_round(inputs):
        output = generate(inputs)
        round_tokens.append(int(output["prompt_mask"].sum() + output["completion_mask"].sum()))
        return output

    trainer._generate_and_score_completions = recorded_round
    trainer.train()
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    [batch] = recorder.batches
    step_log = next(h for h in trainer.state.log_history if "loss" in h)

    # The reference: the same rows on one process (block parallelism off, a plain copy of the initial model).
    plugin, trainer.block_parallel = trainer.block_parallel, None
    plain = initial.train()
    trainer.model.train()
    loss = trainer.compute_loss(plain, batch)
    loss.backward()
    initial_weights = dict(initial.named_parameters())
    worst = moved = 0.0
    for name, p in plain.named_parameters():
        expected = initial_weights[name].detach() - LR * p.grad
        worst = max(worst, float((weights[name] - expected).abs().max()))
        moved = max(moved, float((weights[name] - initial_weights[name].detach()).abs().max()))
    prompts = [tuple(row[mask.bool()].tolist()) for row, mask in zip(batch["prompt_ids"], batch["prompt_mask"])]
    return {
        "wrapped": type(trainer.model_wrapped).__name__,
        "group": [plugin.data_parallel_rank, plugin.group_rank, plugin.block_parallel_size],
        "rows": len(prompts), "prompts": prompts,
        "completions": [row[mask.bool()].tolist() for row, mask in zip(batch["completion_ids"],
                                                                        batch["completion_mask"])],
        "advantages": batch["advantages"].tolist(),
        "rollout_forwards": recorder.forwards["rollout"],
        "num_tokens": step_log["num_tokens"], "round_tokens": round_tokens,
        "loss": recorder.losses[0], "logged_loss": step_log["loss"], "reference_loss": float(loss),
        "weights_vs_reference": worst, "moved": moved,
    }


def refusal(build) -> str:
    try:
        build()
    except ValueError as error:
        return str(error)
    return ""


def refusals(out: Path) -> dict:
    data = Dataset.from_dict({"prompt": ["w9 w10", "w12 w13"] * 2})
    return {
        "fsdp2": refusal(lambda: BDLMGRPOTrainer(confident_bdlm(), reward_funcs=distinct_words, train_dataset=data,
                                                 args=args_for(out / "fsdp2", "coupled", **BP, **FSDP2),
                                                 processing_class=tiny_tokenizer())),
        "diffusion_gemma": refusal(lambda: BDLMGRPOTrainer(
            tiny_dg(), reward_funcs=distinct_words, train_dataset=data, processing_class=dg_tokenizer(),
            args=args_for(out / "dg", "coupled", **BP, top_k=0, confidence_threshold=None))),
    }


def run(out: Path) -> dict:
    results = {"scoring": {}, "trainer": {}}
    plugins = {name: BlockParallelPlugin(block_parallel_size=2, **fields).setup("cpu")
               for name, fields in LAYOUTS.items()}
    for name, plugin in plugins.items():
        for estimator in ESTIMATORS:
            results["scoring"][f"{name}/standard/{estimator}"] = scoring_case(plugin, "standard", estimator)
    for estimator in ESTIMATORS:
        results["scoring"][f"csbp/fast_dllm_v2/{estimator}"] = scoring_case(plugins["csbp"], "fast_dllm_v2", estimator)
    for estimator in ESTIMATORS:
        results["trainer"][estimator] = trainer_case(out / estimator, estimator)
    # A reference model (beta != 0: its forwards sharded too), activation checkpointing, an entropy bonus (a loss
    # that is not 0 at the first iteration, the entropies' gradient through the sharded forward).
    results["trainer"]["coupled_reference_checkpointing"] = trainer_case(out / "coupled_ref", "coupled", beta=0.04,
                                                                         gradient_checkpointing=True, entropy_coef=0.1)
    results["refused"] = refusals(out)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    started = join_process_group()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    original = modeling_llama.LlamaRMSNorm.forward
    modeling_llama.LlamaRMSNorm.forward = float64_forward
    try:
        record_rank_result(out, "grpo_bp_", lambda: run(out))
    finally:
        modeling_llama.LlamaRMSNorm.forward = original
    leave_process_group(started)


if __name__ == "__main__":
    main()
