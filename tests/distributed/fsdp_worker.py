"""Worker for tests/trainer/test_fsdp.py: BDLMSFTTrainer with FSDP2 against DDP, under torchrun (gloo).

    torchrun --nproc_per_node 2 tests/distributed/fsdp_worker.py --scenario pairs resume diffusion_gemma --out /tmp/f
    torchrun --nproc_per_node 4 tests/distributed/fsdp_worker.py --scenario pairs4 tensor_parallel --out /tmp/f
    accelerate launch --config_file recipes/accelerate/cpu_4proc_tp2_fsdp2.yaml tests/distributed/fsdp_worker.py \
        --scenario tensor_parallel_launch --out /tmp/f

Several scenarios run in turn in one launch (the start-up of the processes is paid once), each in its own subfolder
``OUT/<scenario>`` (a single scenario writes to ``OUT`` itself); each rank writes ``<scenario>_rank<r>.json``.

Scenarios (the setups are tests/distributed/trainer_worker.py's):
- ``pairs`` (2 ranks): each run twice, as DDP and with ``fsdp="full_shard", fsdp_config={"fsdp_version": 2}``:
  csbp, bp and cp (plain, SGD), csbp with gradient accumulation + activation checkpointing + packing, csbp with
  LoRA; and csbp with FSDP2 requested the accelerate way (``ACCELERATE_USE_FSDP`` / ``FSDP_*`` environment).
- ``resume`` (2 ranks, AdamW): FSDP2 runs checkpointing at step 2 with full and with sharded state dicts, then
  resumes: the full checkpoint under FSDP2 on the same layout and under DDP with cp; the sharded one under FSDP2
  with P = 1 (2 data-parallel replicas) and under DDP with csbp; a copy of the full checkpoint without optimizer
  state resumes too (the control: its last loss must differ).
- ``pairs4`` (4 ranks), as DDP and FSDP2: csbp with P = 2 (2 data-parallel groups) with gradient accumulation +
  activation checkpointing + packing, cp with P = 4, bp with P = 4 and LoRA.
- ``diffusion_gemma`` (2 ranks, transformers' DiffusionGemma with self-conditioning; :data:`DG_SETUPS`): as DDP and
  FSDP2, P = 2 csbp and cp (SGD; the held-out loss before and after training), csbp with gradient accumulation +
  activation checkpointing + packing, csbp with LoRA (the reference targets), and P = 1 over 2 data-parallel replicas
  where one replica has no target in a step; the paper's CP baseline (cp_layout="paper") under FSDP2; then FSDP2 csbp
  with AdamW saving full checkpoints at steps 2 and 4 and
  its final model, resumed from step 2 under FSDP2 on the same layout, under DDP with bp and (the control) without its
  optimizer state; and the same run with sharded checkpoints, resumed under FSDP2 with P = 1 (2 replicas).
Each run records its logged losses, whether its parameters are sharded (DTensors), and its final weights.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shared_launch import leave_process_group, record_rank_result
from trainer_worker import run

FSDP2 = dict(fsdp="full_shard", fsdp_config={"fsdp_version": 2})
SHARDED = dict(fsdp="full_shard", fsdp_config={"fsdp_version": 2, "state_dict_type": "SHARDED_STATE_DICT"})
ACCELERATE_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
                  "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT", "FSDP_RESHARD_AFTER_FORWARD": "true"}


def scenario_pairs(out: Path) -> dict:
    results = {}
    for setup, mode in (("plain", "csbp"), ("plain", "bp"), ("plain", "cp"), ("accum_ckpt_packed", "csbp"),
                        ("lora", "csbp")):
        results[f"{setup}/{mode}/ddp"] = run(setup, out / setup / f"{mode}_ddp", 2, mode, save_strategy="no")
        results[f"{setup}/{mode}/fsdp2"] = run(setup, out / setup / f"{mode}_fsdp2", 2, mode, save_strategy="no",
                                                **FSDP2)
    os.environ.update(ACCELERATE_ENV)
    try:
        results["plain/csbp/fsdp2_accelerate_env"] = run("plain", out / "plain" / "csbp_env", 2, "csbp",
                                                          save_strategy="no")
    finally:
        for key in ACCELERATE_ENV:
            os.environ.pop(key)
    return results


def scenario_resume(out: Path) -> dict:
    r = {}
    full, sharded = out / "full", out / "sharded"
    r["full"] = run("resume", full, 2, "csbp", **FSDP2)
    r["full/same_layout"] = run("resume", out / "full_same", 2, "csbp", resume=str(full / "checkpoint-2"), **FSDP2)
    r["full/ddp_cp"] = run("resume", out / "full_ddp_cp", 2, "cp", resume=str(full / "checkpoint-2"))
    r["sharded"] = run("resume", sharded, 2, "csbp", **SHARDED)
    # P = 1 over 2 ranks: 2 data-parallel replicas of 1 sample each keep the global batch of 2.
    r["sharded/fsdp2_p1"] = run("resume", out / "sharded_p1", 1, "csbp", resume=str(sharded / "checkpoint-2"),
                                 per_device_train_batch_size=1, **SHARDED)
    r["sharded/ddp_csbp"] = run("resume", out / "sharded_ddp", 2, "csbp", resume=str(sharded / "checkpoint-2"))
    # Control: the same weights without the optimizer state (save_only_model) continue differently.
    weights_only = out / "full_weights_only"
    shutil.copytree(full / "checkpoint-2", weights_only, ignore=shutil.ignore_patterns("optimizer.pt", "scheduler.pt"),
                    dirs_exist_ok=True) if dist.get_rank() == 0 else None
    dist.barrier()
    r["full/weights_only"] = run("resume", out / "full_wo", 2, "csbp", resume=str(weights_only), **FSDP2)
    r["checkpoint_files"] = {name: sorted(os.listdir(path / "checkpoint-2")) for name, path in
                             (("full", full), ("sharded", sharded))}
    return r


def scenario_tensor_parallel(out: Path) -> dict:
    """4 ranks, global batch 4: tensor parallelism (Accelerate's ``ParallelismConfig(tp_size=2)``) under FSDP2, P = 2
    (one group, batch 4) in every mode and P = 1 (2 replicas of batch 2), against FSDP2 without it (P = 2, 2 groups of
    batch 2), itself equal to DDP and to one process (the pairs and layouts scenarios)."""
    from accelerate import ParallelismConfig

    results = {"plain/csbp/reference": run("plain", out / "reference", 2, "csbp", save_strategy="no", **FSDP2)}
    for mode, extra in (("csbp", {}), ("cp", {}), ("cp_paper", dict(block_parallel_cp_layout="paper")), ("bp", {})):
        # csbp saves (full state dict, steps 2 and 4): an ordinary checkpoint gathered from the 2-D shards.
        saving = {} if mode == "csbp" else dict(save_strategy="no")
        results[f"plain/{mode}/tp2"] = run("plain", out / f"{mode}_tp2", 2, mode.split("_")[0], **saving,
                                           per_device_train_batch_size=4,
                                           parallelism_config=ParallelismConfig(tp_size=2), **extra, **FSDP2)
    results["plain/csbp/tp2"]["checkpoint"] = str(out / "csbp_tp2" / "checkpoint-4")
    results["plain/p1/tp2"] = run("plain", out / "p1_tp2", 1, "csbp", save_strategy="no",
                                  parallelism_config=ParallelismConfig(tp_size=2), **FSDP2)
    # DiffusionGemma (its transformers plan: q/k/v, MLP, the encoder and decoder layers): P = 2 x T = 2 csbp against
    # P = 2 over 2 replicas, both FSDP2.
    dg = dict(model_kw=dict(vision_heads=2))  # whole vision heads per tensor-parallel rank
    results["dg/reference"] = run_diffusion_gemma("plain", out / "dg_reference", 2, "csbp", **dg, **FSDP2)
    results["dg/csbp/tp2"] = run_diffusion_gemma("plain", out / "dg_csbp_tp2", 2, "csbp", per_device_train_batch_size=4,
                                                 parallelism_config=ParallelismConfig(tp_size=2), **dg, **FSDP2)
    # Refused on every rank, before anything trains: no FSDP2 (DDP cannot average DTensors), LoRA on split layers.
    errors = {}
    for name, setup, extra in (("without_fsdp2", "plain", {}), ("lora", "lora", FSDP2)):
        try:
            run(setup, out / f"refused_{name}", 2, "csbp", save_strategy="no", per_device_train_batch_size=4,
                parallelism_config=ParallelismConfig(tp_size=2), **extra)
        except ValueError as error:
            errors[name] = str(error)
    results["errors"] = errors
    return results


def scenario_tensor_parallel_launch(out: Path) -> dict:
    """Under ``accelerate launch --config_file recipes/accelerate/cpu_4proc_tp2_fsdp2.yaml``: no parallelism_config in
    the training config; the tensor-parallel size comes from the launcher (its PARALLELISM_CONFIG_* variables)."""
    return {"plain/csbp/tp2_launch": run("plain", out / "csbp_tp2_launch", 2, "csbp", save_strategy="no",
                                         per_device_train_batch_size=4)}


def scenario_pairs4(out: Path) -> dict:
    results = {}
    for setup, mode, P in (("accum_ckpt_packed", "csbp", 2), ("plain", "cp", 4), ("lora", "bp", 4)):
        name = f"{setup}/{mode}_p{P}"
        results[f"{name}/ddp"] = run(setup, out / f"{setup}_{mode}_p{P}_ddp", P, mode, save_strategy="no")
        results[f"{name}/fsdp2"] = run(setup, out / f"{setup}_{mode}_p{P}_fsdp2", P, mode, save_strategy="no", **FSDP2)
    return results


# --- DiffusionGemma ----------------------------------------------------------------------------------------
# SGD where weights are compared (see trainer_worker.SETUPS: Adam turns float32 noise in ~0 gradients into O(lr)
# updates; LoRA with AdamW measured 3e-5 on an A matrix); the resume runs (AdamW) compare losses. plain and
# accum_ckpt_packed clip the gradients (max_grad_norm 1, over the sharded ones); LoRA does not: its B matrices start at
# 0, and the clipping coefficient, a norm summed in another order over the shards, differs in its last bits, which the
# next steps grow to 3.9e-6 (measured; 0 without clipping).
DG_SETUPS = {  # name -> (config overrides, LoRA?)
    "plain": (dict(optim="sgd", learning_rate=0.5), False),
    "accum_ckpt_packed": (dict(optim="sgd", learning_rate=0.05, gradient_accumulation_steps=2, packing=True,
                               activation_checkpointing=True), False),
    "lora": (dict(optim="sgd", learning_rate=0.5, max_grad_norm=0.0), True),
    "resume": (dict(learning_rate=1e-3, save_strategy="steps", save_steps=2), False),
    # P = 1 over 2 ranks: 2 data-parallel replicas, each its own sample; every supervised sample self-conditions and a
    # replica gets no supervised token in a step (5 samples over 4 steps x 2 replicas): FSDP2 must call every layer
    # as often on every rank (the replicas agree on the self-conditioning pass; the zero loss runs it too).
    "dp2_unsupervised": (dict(optim="sgd", learning_rate=0.5, per_device_train_batch_size=1, self_conditioning_prob=1.0,
                              assistant_only_loss=False, completion_only_loss=True), False),
}


def unsupervised_rows():
    """8 pre-tokenized rows; every third has no completion (dropped: nothing to learn), so 5 remain."""
    import datasets

    g = torch.Generator().manual_seed(0)
    rows = {"input_ids": [], "completion_mask": []}
    for i in range(8):
        ids = torch.randint(9, 64, (12 + i,), generator=g).tolist()
        ids[-1] = 4  # the turn end: a complete response
        rows["input_ids"].append(ids)
        rows["completion_mask"].append([0] * 5 + [1] * (len(ids) - 5) if i % 3 else [0] * len(ids))
    return datasets.Dataset.from_dict(rows)


def diffusion_gemma_config(out: Path, P: int, mode: str = "csbp", **overrides):
    """The DiffusionGemma runs' config (tests/trainer/test_fsdp.py evaluates with it at P = 1)."""
    from hf_bdlm import BDLMSFTConfig

    values = dict(
        output_dir=str(out), report_to="none", max_steps=4, logging_steps=1, per_device_train_batch_size=2,
        per_device_eval_batch_size=2, save_strategy="no", disable_tqdm=True, seed=3, max_length=64, bf16=False,
        objective="diffusion_gemma", assistant_only_loss=True, noise_eps_min=0.1, noise_eps_max=0.9,
        self_conditioning_prob=0.5, activation_checkpointing=False, block_parallel_size=P, block_parallel_mode=mode,
        dataloader_num_workers=0,
    )
    values.update(overrides)
    return BDLMSFTConfig(**values)


def run_diffusion_gemma(setup: str, out: Path, P: int, mode: str, resume: str | None = None, save_final: bool = False,
                        model_kw: dict | None = None, **extra) -> dict:
    from tiny_diffusion_gemma import conversations, tiny_model, tiny_tokenizer

    from hf_bdlm import BDLMSFTTrainer

    overrides, lora = DG_SETUPS[setup]
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0)  # target_modules unset: the reference targets
    args = diffusion_gemma_config(out, P, mode, **{**overrides, **extra})
    data = unsupervised_rows() if setup == "dp2_unsupervised" else conversations(16)
    trainer = BDLMSFTTrainer(tiny_model(**(model_kw or {})), args=args, train_dataset=data,
                             processing_class=tiny_tokenizer(), peft_config=peft_config)
    zero_losses = []
    zero_loss = trainer.step.zero  # (this run's step: counting its zero losses)
    trainer.step.zero = lambda *a, **k: zero_losses.append(1) or zero_loss(*a, **k)
    model = trainer.model
    params = list(model.parameters())
    result = {"dtensors": sum(hasattr(p, "full_tensor") for p in params), "parameters": len(params),
              "param_meshes": sorted({"/".join(p.device_mesh.mesh_dim_names) for p in params
                                      if hasattr(p, "device_mesh")})}
    decoder_calls = []  # self-conditioning: a second decoder pass in some micro-batches
    hook = (model.get_base_model() if lora else model).model.decoder.register_forward_hook(
        lambda module, args, output: decoder_calls.append(module.training))
    if setup == "plain":  # the held-out loss of the initial model (P = 1 reference: tests/trainer/test_fsdp.py)
        result["eval_loss_initial"] = trainer.evaluate(eval_dataset=conversations(4))["eval_loss"]
    trainer.train(resume_from_checkpoint=resume)
    hook.remove()
    history = [h for h in trainer.state.log_history if "loss" in h]
    zero = torch.tensor(float(len(zero_losses)))
    dist.all_reduce(zero)
    result.update(steps=[h["step"] for h in history], losses=[h["loss"] for h in history],
                  decoder_calls=sum(decoder_calls), micro_batches=4 * trainer.args.gradient_accumulation_steps,
                  activation_checkpointing=model.is_activation_checkpointing, zero_losses=int(zero))
    if setup == "plain":
        result["eval_loss"] = trainer.evaluate(eval_dataset=conversations(4))["eval_loss"]
    weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
               for n, p in model.named_parameters() if p.requires_grad}
    if save_final:  # an ordinary DiffusionGemma folder (tests/trainer/test_fsdp.py reloads it with transformers)
        trainer.save_model(str(out / "final"))
    result["weights"] = None
    if trainer.is_world_process_zero():
        torch.save(weights, out / "final_weights.pt")
        result["weights"] = str(out / "final_weights.pt")
    return result


def scenario_diffusion_gemma(out: Path) -> dict:
    r = {}
    for setup, mode, P in (("plain", "csbp", 2), ("plain", "cp", 2), ("accum_ckpt_packed", "csbp", 2),
                           ("lora", "csbp", 2), ("dp2_unsupervised", "csbp", 1)):
        for name, kw in (("ddp", {}), ("fsdp2", FSDP2)):
            start = time.perf_counter()
            r[f"{setup}/{mode}/{name}"] = run_diffusion_gemma(setup, out / setup / f"{mode}_{name}", P, mode, **kw)
            r[f"{setup}/{mode}/{name}"]["seconds"] = time.perf_counter() - start
    # The paper's CP baseline through the trainer under FSDP2, as a comparison would run it (tests/trainer/test_fsdp.py:
    # the csbp run's losses and weights).
    r["plain/cp_paper/fsdp2"] = run_diffusion_gemma("plain", out / "plain" / "cp_paper_fsdp2", 2, "cp",
                                                    block_parallel_cp_layout="paper", **FSDP2)
    full = out / "resume"
    r["resume"] = run_diffusion_gemma("resume", full, 2, "csbp", save_final=True, **FSDP2)
    r["resume/same_layout"] = run_diffusion_gemma("resume", out / "resume_same", 2, "csbp",
                                                  resume=str(full / "checkpoint-2"), **FSDP2)
    r["resume/ddp_bp"] = run_diffusion_gemma("resume", out / "resume_ddp_bp", 2, "bp",
                                             resume=str(full / "checkpoint-2"))
    # Control: the same weights without the optimizer state continue differently.
    weights_only = out / "resume_weights_only"
    if dist.get_rank() == 0:
        shutil.copytree(full / "checkpoint-2", weights_only, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("optimizer.pt", "scheduler.pt"))
    dist.barrier()
    r["resume/weights_only"] = run_diffusion_gemma("resume", out / "resume_wo", 2, "csbp", resume=str(weights_only),
                                                   **FSDP2)
    # Sharded checkpoints (torch.distributed.checkpoint), resumed under FSDP2 with P = 1 (2 data-parallel replicas).
    sharded = out / "resume_sharded"
    r["sharded"] = run_diffusion_gemma("resume", sharded, 2, "csbp", **SHARDED)
    r["sharded/fsdp2_p1"] = run_diffusion_gemma("resume", out / "resume_sharded_p1", 1, "csbp",
                                                per_device_train_batch_size=1, resume=str(sharded / "checkpoint-2"),
                                                **SHARDED)
    r["checkpoint_files"] = {name: sorted(os.listdir(path / "checkpoint-2")) for name, path in
                             (("full", full), ("sharded", sharded))}
    r["final_dir"] = str(full / "final")
    return r


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", required=True, nargs="+", help="one or more, run in turn in one launch",
                        choices=["pairs", "resume", "pairs4", "diffusion_gemma", "tensor_parallel",
                                 "tensor_parallel_launch"])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    shared = dist.is_initialized()  # inside tests/distributed/shared_launch.py: its process group
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    scenarios = {"pairs": scenario_pairs, "resume": scenario_resume, "pairs4": scenario_pairs4,
                 "diffusion_gemma": scenario_diffusion_gemma, "tensor_parallel": scenario_tensor_parallel,
                 "tensor_parallel_launch": scenario_tensor_parallel_launch}
    for name in args.scenario:
        out = Path(args.out) / name if len(args.scenario) > 1 else Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        record_rank_result(out, f"{name}_", lambda: scenarios[name](out))
    leave_process_group(started=not shared)  # the trainer's arguments started it, or the launch


if __name__ == "__main__":
    main()
