"""Worker for tests/test_trainer_fsdp.py: BDLMSFTTrainer with FSDP2 against DDP, under torchrun (gloo).

    torchrun --nproc_per_node 2 tests/distributed/fsdp_worker.py --scenario pairs --out /tmp/f
    torchrun --nproc_per_node 2 tests/distributed/fsdp_worker.py --scenario resume --out /tmp/f
    torchrun --nproc_per_node 4 tests/distributed/fsdp_worker.py --scenario pairs4 --out /tmp/f

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
Each run records its logged losses, whether its parameters are sharded (DTensors), and its final weights.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

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


def scenario_pairs4(out: Path) -> dict:
    results = {}
    for setup, mode, P in (("accum_ckpt_packed", "csbp", 2), ("plain", "cp", 4), ("lora", "bp", 4)):
        name = f"{setup}/{mode}_p{P}"
        results[f"{name}/ddp"] = run(setup, out / f"{setup}_{mode}_p{P}_ddp", P, mode, save_strategy="no")
        results[f"{name}/fsdp2"] = run(setup, out / f"{setup}_{mode}_p{P}_fsdp2", P, mode, save_strategy="no", **FSDP2)
    return results


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", required=True, choices=["pairs", "resume", "pairs4"])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(args.out)
    scenario = {"pairs": scenario_pairs, "resume": scenario_resume, "pairs4": scenario_pairs4}[args.scenario]
    try:
        result = scenario(out)
    except Exception:
        result = {"error": traceback.format_exc()}
        raise
    finally:
        rank = dist.get_rank() if dist.is_initialized() else 0
        (out / f"{args.scenario}_rank{rank}.json").write_text(json.dumps(result, indent=1))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
