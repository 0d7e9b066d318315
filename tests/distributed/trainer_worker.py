"""Worker for tests/trainer/test_distributed.py: real BDLMSFTTrainer runs under torchrun (gloo).

    torchrun --nproc_per_node 2 tests/distributed/trainer_worker.py --scenario layouts --out /tmp/t
    torchrun --nproc_per_node 1 tests/distributed/trainer_worker.py --scenario reference --out /tmp/t
    torchrun --nproc_per_node 4 tests/distributed/trainer_worker.py --scenario data --out /tmp/t

Scenarios:
- ``layouts`` (2 ranks, one block-parallel group): each training setup of :data:`SETUPS` for 4 steps with
  ``block_parallel_size=2`` (csbp; bp, cp and csbp with the ring transport on the plain setup), checkpoint at
  step 2; logged losses, final weights and (plain setup) the held-out loss are written.
- ``reference`` (1 rank): the same setups with P = 1, plus two resumes of the AdamW setup from step 2: from
  its own checkpoint (same layout) and from the P = 2 csbp checkpoint of ``layouts`` (layout change).
  tests/trainer/test_distributed.py runs it inside the test process (``torchrun.run_in_process``) and the other
  two in the shared launches of 2 and 4 processes (tests/distributed/shared_launch.py).
- ``data`` (4 ranks = 2 data-parallel groups x P 2): one epoch with gradient accumulation, recording the
  sample ids and scored targets of every micro-batch on every rank; plus the bad-world-size error.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist

from shared_launch import leave_process_group, record_rank_result
from trainer_common import language_modeling, long_documents, prompt_completion, tiny_bdlm, tiny_tokenizer

from hf_bdlm import BDLMSFTConfig, BDLMSFTTrainer

STEPS = 4
# name -> (model kwargs, dataset builder, config overrides, LoRA?). Weight equality is checked with SGD: Adam divides
# each gradient element by its own running magnitude, so an element whose gradient is ~0 turns float32
# reassociation noise into an O(lr) update; AdamW runs compare losses (and LoRA weights).
SETUPS = {
    "plain": (dict(objective="standard"), lambda: prompt_completion(24), dict(optim="sgd", learning_rate=0.05), False),
    "accum_ckpt_packed": (
        dict(objective="fast_dllm_v2"),
        lambda: language_modeling(24),
        dict(packing=True, max_length=32, gradient_accumulation_steps=2, activation_checkpointing=True, optim="sgd",
             learning_rate=0.05),
        False,
    ),
    "lora": (dict(objective="standard"), lambda: prompt_completion(24), dict(learning_rate=5e-3), True),
    "resume": (dict(objective="standard"), lambda: prompt_completion(24), dict(learning_rate=1e-3), False),
    # bf16 autocast over float32 weights, sequences of ~900 tokens (1808 rows): gathers are in flight for a while.
    "bf16": (dict(objective="standard"), lambda: long_documents(4), dict(bf16=True, use_cpu=True, max_length=1024, max_steps=2),
             False),
}


def config(out: Path, P: int, mode: str = "csbp", **overrides) -> BDLMSFTConfig:
    values = dict(
        output_dir=str(out), report_to="none", max_steps=STEPS, logging_steps=1, per_device_train_batch_size=2,
        learning_rate=1e-3, activation_checkpointing=False, save_strategy="steps", save_steps=2, disable_tqdm=True,
        block_parallel_size=P, block_parallel_mode=mode, bf16=False, seed=3, max_length=64,
    )
    values.update(overrides)
    return BDLMSFTConfig(**values)


def run(setup: str, out: Path, P: int, mode: str = "csbp", resume: str | None = None, **extra) -> dict:
    model_kw, data, overrides, lora = SETUPS[setup]
    overrides = {**overrides, **extra}
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = BDLMSFTTrainer(tiny_bdlm(**model_kw), args=config(out, P, mode, **overrides), train_dataset=data(),
                             processing_class=tiny_tokenizer(), peft_config=peft_config)
    trainer.train(resume_from_checkpoint=resume)
    history = [h for h in trainer.state.log_history if "loss" in h]
    result = {
        "steps": [h["step"] for h in history],
        "losses": [h["loss"] for h in history],
        "accuracy": [h.get("mean_token_accuracy") for h in history],
        "weights": None,
        # FSDP2 leaves the parameters sharded (DTensors); DDP leaves them whole.
        "sharded": any(hasattr(p, "full_tensor") for p in trainer.model.parameters()),
        # The mesh dims each parameter is split over: ("dp_bp",) under FSDP2, ("dp_bp", "tp") with tensor parallelism.
        "param_meshes": sorted({"/".join(p.device_mesh.mesh_dim_names) for p in trainer.model.parameters()
                                if hasattr(p, "device_mesh")}),
    }
    if setup == "plain":
        # Held-out loss after training: every group rank holds part of it; the trainer sums it over the group.
        result["eval_loss"] = trainer.evaluate(eval_dataset=prompt_completion(5))["eval_loss"]
    # Under FSDP2 the parameters are sharded DTensors: every rank takes part in gathering them.
    weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
               for n, p in trainer.model.named_parameters() if p.requires_grad}
    if trainer.is_world_process_zero():
        path = out / "final_weights.pt"
        torch.save(weights, path)
        result["weights"] = str(path)
    return result


def scenario_layouts(out: Path) -> dict:
    results = {}
    for setup in SETUPS:
        results[f"{setup}/csbp"] = run(setup, out / setup / "p2_csbp", 2, "csbp")
    for mode in ("bp", "cp"):
        results[f"plain/{mode}"] = run("plain", out / "plain" / f"p2_{mode}", 2, mode)
    results["bf16/cp"] = run("bf16", out / "bf16" / "p2_cp", 2, "cp")
    results["plain/csbp_ring"] = run("plain", out / "plain" / "p2_csbp_ring", 2, "csbp",
                                     block_parallel_transport="ring")
    results["plain/cp_paper"] = run("plain", out / "plain" / "p2_cp_paper", 2, "cp", block_parallel_cp_layout="paper")
    return results


def scenario_reference(out: Path) -> dict:
    results = {}
    for setup in SETUPS:
        results[f"{setup}/p1"] = run(setup, out / setup / "p1", 1)
    results["resume/p1_from_p1"] = run("resume", out / "resume" / "p1_from_p1", 1,
                                       resume=str(out / "resume" / "p1" / "checkpoint-2"))
    results["resume/p1_from_p2_csbp"] = run("resume", out / "resume" / "p1_from_p2", 1,
                                            resume=str(out / "resume" / "p2_csbp" / "checkpoint-2"))
    return results


class RecordingTrainer(BDLMSFTTrainer):
    """Records what every micro-batch held and how many targets this rank scored."""

    records: list

    def _record(self, mode, metrics, inputs):
        self.records.append({
            "step": self.state.global_step,
            "sample_ids": inputs["sample_ids"].tolist(),
            "supervised": int(inputs["completion_mask"].sum()),
            "scored": 0 if metrics is None else int(metrics["count"]),
        })
        super()._record(mode, metrics, inputs)


def scenario_data(out: Path) -> dict:
    result = {}
    try:
        BDLMSFTConfig(output_dir=str(out / "bad"), report_to="none", block_parallel_size=3)
        result["bad_world_error"] = None
    except ValueError as err:
        result["bad_world_error"] = str(err)
    args = config(out / "data", 2, "csbp", max_steps=-1, num_train_epochs=1, gradient_accumulation_steps=2,
                  save_strategy="no")
    trainer = RecordingTrainer(tiny_bdlm(objective="fast_dllm_v2"), args=args, train_dataset=prompt_completion(13),
                               processing_class=tiny_tokenizer())
    trainer.records = []
    trainer.train()
    plugin = trainer.plugin
    result.update(
        records=trainer.records,
        replica=plugin.data_parallel_rank,
        group_rank=plugin.group_rank,
        mesh_shape=list(plugin.device_mesh.shape),
        mesh_dims=list(plugin.device_mesh.mesh_dim_names),
        bp_group_ranks=dist.get_process_group_ranks(plugin.groups.bp_mesh.get_group()),
        ring_ranks=dist.get_process_group_ranks(plugin.device_mesh.get_group("clean_ring")),
        world_mesh_size=plugin.groups.world_mesh.size(),
        losses=[h["loss"] for h in trainer.state.log_history if "loss" in h],
        dataset=[{"sample_id": row["bdlm_sample_id"],
                  # fast_dllm_v2 predicts token i from i-1: position 0 is never a target.
                  "targets": sum(1 for i, lab in enumerate(row["labels"]) if lab != -100 and i > 0)}
                 for row in trainer.train_dataset],
    )
    # One group of P = 4 in the paper's CP baseline layout: the single process's run (scenario "reference").
    result["plain/cp_paper_p4"] = run("plain", out / "plain_p4_cp_paper", 4, "cp", block_parallel_cp_layout="paper")
    return result


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", required=True, choices=["layouts", "reference", "data"])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    shared = dist.is_initialized()  # inside tests/distributed/shared_launch.py: its process group
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    out = Path(args.out)
    scenario = {"layouts": scenario_layouts, "reference": scenario_reference, "data": scenario_data}[args.scenario]
    record_rank_result(out, f"{args.scenario}_", lambda: scenario(out))
    leave_process_group(started=not shared)  # the trainer's arguments started it, or the launch


if __name__ == "__main__":
    main()
