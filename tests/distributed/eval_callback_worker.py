"""Worker for tests/evaluation/test_diffusion_gemma.py: DiffusionGemma training with `BDLMEvalCallback` under torchrun.

    torchrun --nproc_per_node 2 tests/distributed/eval_callback_worker.py --out /tmp/e

Three runs of the tiny DiffusionGemma (tests/distributed/tiny_diffusion_gemma.py, its context raised to 8192 so that an
agent's prompt fits), P = 2 csbp, 4 steps, checkpoints at steps 2 and 4: DDP without the callback (the reference), DDP
with it, FSDP2 with it. The callback runs one offline terminal task (1 agent step of 4 tokens) at each save. Each
rank records its logged losses and `eval/pass_rate` rows, and, on the main process, the float64 sum and norm of every
parameter of the model the server decoded at each save (under FSDP2: the plain copy of the gathered weights).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist

from shared_launch import leave_process_group, record_rank_result
from tiny_diffusion_gemma import EOS, PAD, TURN_END, conversations, tiny_model, tiny_tokenizer

EVAL_CONTEXT = 8192
FSDP2 = dict(fsdp="full_shard", fsdp_config={"fsdp_version": 2})


def servable_tiny_model(seed: int = 0):
    """The tiny DiffusionGemma with a context an agent's prompt fits in and 4 denoising steps per canvas."""
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import DiffusionGemmaGenerationConfig

    model = tiny_model(seed=seed)
    model.config.text_config.max_position_embeddings = EVAL_CONTEXT  # rotary frequencies do not depend on it
    model.generation_config = DiffusionGemmaGenerationConfig(max_denoising_steps=4, eos_token_id=[EOS, TURN_END],
                                                             pad_token_id=PAD)
    return model


def training_config(out: Path, P: int, **overrides):
    from hf_bdlm import BDLMSFTConfig

    values = dict(
        output_dir=str(out), report_to="none", max_steps=4, logging_steps=1, per_device_train_batch_size=2,
        save_strategy="steps", save_steps=2, save_only_model=True, disable_tqdm=True, seed=3, max_length=64,
        bf16=False, objective="diffusion_gemma", assistant_only_loss=True, noise_eps_min=0.1, noise_eps_max=0.9,
        self_conditioning_prob=0.5, activation_checkpointing=False, block_parallel_size=P, block_parallel_mode="csbp",
        dataloader_num_workers=0, optim="sgd", learning_rate=0.5,
    )
    values.update(overrides)
    return BDLMSFTConfig(**values)


def served_weights(callback) -> list[dict]:
    """Wrap ``callback.evaluate`` to record, per evaluation, each served parameter's float64 (sum, norm)."""
    seen = []
    evaluate = callback.evaluate

    def recording(model, tokenizer, output_dir, step):
        seen.append({"step": step, "dtensors": sum(hasattr(p, "full_tensor") for p in model.parameters()),
                     "weights": {n: [p.detach().double().sum().item(), p.detach().double().norm().item()]
                                 for n, p in model.named_parameters()}})
        return evaluate(model, tokenizer, output_dir, step)

    callback.evaluate = recording
    return seen


def train(out: Path, P: int, with_callback: bool, **overrides) -> dict:
    from hf_bdlm import BDLMSFTTrainer
    from hf_bdlm.evaluation.callback import BDLMEvalCallback

    trainer = BDLMSFTTrainer(servable_tiny_model(), args=training_config(out, P, **overrides),
                             train_dataset=conversations(16), processing_class=tiny_tokenizer())
    seen = []
    if with_callback:
        callback = BDLMEvalCallback(trainer, benchmark="terminal-bench", tasks=["create-greeting"], step_limit=1,
                                    max_tokens=4)
        seen = served_weights(callback)
        trainer.add_callback(callback)
    trainer.train()
    history = trainer.state.log_history
    return {"losses": [h["loss"] for h in history if "loss" in h],
            "eval_rows": [{"step": h["step"], "pass_rate": h["eval/pass_rate"]} for h in history
                          if "eval/pass_rate" in h],
            "dtensors": sum(hasattr(p, "full_tensor") for p in trainer.model.parameters()),
            "training_after": trainer.model.training, "served": seen}


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    shared = dist.is_initialized()  # inside tests/distributed/shared_launch.py: its process group
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(args.out)  # the trainer's arguments start the process group (gloo on CPU)
    record_rank_result(out, "", lambda: {"reference": train(out / "reference", 2, False),
                                         "ddp": train(out / "ddp", 2, True),
                                         "fsdp2": train(out / "fsdp2", 2, True, **FSDP2)})
    leave_process_group(started=not shared)  # the trainer's arguments started it, or the launch


if __name__ == "__main__":
    main()
