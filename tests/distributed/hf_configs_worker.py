"""Worker for tests/trainer/test_hf_configs.py: the training settings users paste from the HF docs, end to end.

    torchrun --nproc_per_node 2 tests/distributed/hf_configs_worker.py --out /tmp/h       # P = 2 csbp
    python tests/distributed/hf_configs_worker.py --out /tmp/h                             # P = 1, the references
    accelerate launch --config_file recipes/accelerate/cpu_2proc_fsdp2.yaml \\
        tests/distributed/hf_configs_worker.py --out /tmp/h --only plain                  # FSDP2 from the config file

For each model family (a tiny Qwen3 converted with ``convert_causal_lm``, transformers' tiny DiffusionGemma) and each
setting of :data:`SETTINGS`, ``BDLMSFTTrainer`` trains 3 steps with AdamW under csbp (``block_parallel_size`` = the
world: 2, or 1 for the reference) and records the logged losses and what the setting turned on (DTensor parameters
under FSDP2, activation checkpointing, LoRA adapters, the autocast dtype). tests/trainer/test_hf_configs.py runs the
P = 2 runs in the shared 2-process launch (tests/distributed/shared_launch.py) and the references in its own process.
"""

from __future__ import annotations

import argparse
import json
import os
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from shared_launch import leave_process_group

QWEN3_FSDP = dict(fsdp="full_shard",
                  fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["Qwen3DecoderLayer"]})
DG_FSDP = dict(fsdp="full_shard", fsdp_config={
    "fsdp_version": 2, "transformer_layer_cls_to_wrap": ["DiffusionGemmaEncoderTextLayer", "DiffusionGemmaDecoderTextLayer"]})

# name -> per family: config overrides as pasted (fsdp ones only on several processes) and LoRA or not.
SETTINGS = {
    "plain": ({}, {}, False),
    "fsdp_layer_classes": (QWEN3_FSDP, DG_FSDP, False),
    "gradient_checkpointing": ({"gradient_checkpointing": True}, {"gradient_checkpointing": True}, False),
    "bf16": ({"bf16": True}, {"bf16": True}, False),
    "lora": ({}, {}, True),
    # Not an HF setting: the emulated cluster link (measurements) delays the K/V exchange and changes no number.
    "emulated_link": ({"block_parallel_link": "h200-ib"}, {"block_parallel_link": "h200-ib"}, False),
}
FAMILIES = ("converted_qwen3", "diffusion_gemma")


def tiny_converted_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from trainer_common import MASK, PAD, vocab_size

    from hf_bdlm import convert_causal_lm

    torch.manual_seed(0)
    causal = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=vocab_size(), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=48, head_dim=8, pad_token_id=PAD, bos_token_id=2, eos_token_id=3))
    model, _ = convert_causal_lm(causal, mask_token_id=MASK, block_size=4)
    return model


def family_inputs(family: str):
    """(model, tokenizer, training data, LoRA config as pasted from the PEFT docs, without dropout: its masks are
    drawn per rank, so a run with dropout is not layout invariant)."""
    from peft import LoraConfig

    if family == "converted_qwen3":
        from trainer_common import prompt_completion, tiny_tokenizer

        lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")
        return tiny_converted_qwen3(), tiny_tokenizer(), prompt_completion(16), lora
    from tiny_diffusion_gemma import conversations, tiny_model, tiny_tokenizer

    return tiny_model(), tiny_tokenizer(), conversations(16), LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0)


def run(family: str, setting: str, out: Path, P: int) -> dict:
    from hf_bdlm import BDLMSFTConfig, BDLMSFTTrainer

    model, tokenizer, data, lora = family_inputs(family)
    qwen3_overrides, dg_overrides, use_lora = SETTINGS[setting]
    overrides = qwen3_overrides if family == "converted_qwen3" else dg_overrides
    values = dict(output_dir=str(out), report_to="none", max_steps=3, logging_steps=1, per_device_train_batch_size=2,
                  learning_rate=1e-3, save_strategy="no", disable_tqdm=True, seed=5, max_length=64,
                  block_parallel_size=P, block_parallel_mode="csbp", activation_checkpointing=False)
    if family == "diffusion_gemma":
        values.update(objective="diffusion_gemma", assistant_only_loss=True, self_conditioning_prob=0.5)
    values.update(overrides)
    if "gradient_checkpointing" in overrides:
        values.pop("activation_checkpointing")  # as pasted: the HF name alone
    trainer = BDLMSFTTrainer(model, args=BDLMSFTConfig(**values), train_dataset=data, processing_class=tokenizer,
                             peft_config=lora if use_lora else None)
    autocast = []
    target = trainer.model.get_base_model() if use_lora else trainer.model
    first_linear = next(m for m in target.modules() if isinstance(m, torch.nn.Linear))
    hook = first_linear.register_forward_pre_hook(
        lambda module, args: autocast.append(str(torch.get_autocast_dtype("cpu")) if torch.is_autocast_enabled("cpu")
                                              else None))
    trainer.train()
    hook.remove()
    history = [h for h in trainer.state.log_history if "loss" in h]
    params = list(trainer.model.parameters())
    return {
        "steps": [h["step"] for h in history],
        "losses": [h["loss"] for h in history],
        "dtensors": sum(hasattr(p, "full_tensor") for p in params),
        "parameters": len(params),
        "trainable": sum(p.requires_grad for p in params),
        "lora_parameters": sum("lora_" in name for name, _ in trainer.model.named_parameters()),
        "activation_checkpointing": bool(getattr(target, "is_activation_checkpointing", False)),
        "autocast": sorted({a for a in autocast if a}) or None,
        "world": trainer.plugin.world_size,
        "P": trainer.plugin.block_parallel_size,
        "link": None if trainer.plugin.link is None else [trainer.plugin.link.name, trainer.plugin.link.latency_s,
                                                          trainer.plugin.link.details["compute_rate"]],
        "comm_wait_s": 0.0 if trainer.plugin.groups is None else
        trainer.plugin.groups.group.wait_seconds + trainer.plugin.groups.ring.wait_seconds,
    }


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", nargs="*", default=None, help="settings to run (default: all that fit the world)")
    args = parser.parse_args(argv)
    shared = dist.is_initialized()  # inside tests/distributed/shared_launch.py: its process group
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    settings = args.only or [s for s in SETTINGS if world > 1 or not s.startswith("fsdp")]
    if world > 1 and not args.only:
        settings.remove("plain")  # its P = 2 run is the accelerate-config one
    out = Path(args.out)
    tag = "accelerate_fsdp" if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" else f"world{world}"
    results = {}
    try:
        for family in FAMILIES:
            for setting in settings:
                results[f"{family}/{setting}"] = run(family, setting, out / tag / family / setting, world)
    except Exception:
        results["error"] = traceback.format_exc()
        raise
    finally:
        rank = dist.get_rank() if dist.is_initialized() else 0
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{tag}_rank{rank}.json").write_text(json.dumps(results, indent=1))
    leave_process_group(started=not shared)  # the trainer's arguments started it, or the launch


if __name__ == "__main__":
    main()
