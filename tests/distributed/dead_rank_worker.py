"""A training run one of whose ranks is SIGKILLed mid-step (tests/trainer/test_faults.py; launched by faults_worker.py).

    torchrun --nproc_per_node 2 tests/distributed/dead_rank_worker.py --out /tmp/k --mode csbp --where exchange

The run trains a tiny model of ``--family`` for ``STEPS`` AdamW steps (linear schedule with warm-up) with a
checkpoint every 2 steps: ``converted`` (a causal Llama converted by the trainer, ``fast_dllm_v2``),
``diffusion_gemma`` (transformers' DiffusionGemma, self-conditioning) or ``dflash`` (a DFlash2 drafter on features
captured into ``--features``). At step ``--kill-step`` rank ``--kill-rank`` writes ``OUT/killed.json`` (the time, its
rank, pid and the step) and SIGKILLs itself ``--where``:

- ``forward``: entering the forward of its last decoder layer;
- ``backward``: when the gradient reaches its first decoder layer's output (the later layers' backward is done);
- ``exchange``: right after posting a K/V all-gather of the block-parallel exchange, before its wait: the
  collective is in flight on every rank of the group;
- ``save``: while writing ``checkpoint-<kill-step>``, after the weights and before the optimizer state.

Every rank writes its pid to ``OUT/pid.<rank>`` first. :func:`main` also runs in a shared launch (no kill): with
``--resume`` it resumes from the last complete checkpoint of ``OUT``; rank 0 writes ``OUT/final_weights.pt``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

STEPS = 4
TRAINING = dict(report_to="none", max_steps=STEPS, logging_steps=1, save_strategy="steps", save_steps=2,
                disable_tqdm=True, seed=3, bf16=False, optim="adamw_torch", learning_rate=1e-3,
                lr_scheduler_type="linear", warmup_steps=1)
FSDP2 = dict(fsdp="full_shard", fsdp_config={"fsdp_version": 2})


def die(out: Path, where: str, step: int) -> None:
    """Record when and where this rank dies, then SIGKILL it (no handler runs, nothing is flushed: an OOM kill)."""
    with open(out / "killed.json", "w") as f:
        json.dump({"time": time.time(), "rank": dist.get_rank(), "where": where, "step": step, "pid": os.getpid()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.kill(os.getpid(), signal.SIGKILL)


def decoder_layers(model) -> list[torch.nn.Module]:
    # Llama / Qwen3 / DFlash: *DecoderLayer; DiffusionGemma: its decoder's DiffusionGemmaDecoderTextLayer.
    layers = [m for m in model.modules() if type(m).__name__.endswith(("DecoderLayer", "DecoderTextLayer"))]
    if not layers:
        raise RuntimeError(f"no decoder layer in {type(model).__name__}")
    return layers


def arm(trainer, out: Path, where: str, step: int) -> None:
    """Make this rank die at optimizer step ``step`` (1-based) at ``where``."""
    def now() -> bool:
        return trainer.state.global_step == step - 1 and trainer.model.training

    layers = decoder_layers(trainer.model)
    if where == "forward":
        layers[-1].register_forward_pre_hook(lambda module, args: die(out, where, step) if now() else None)
    elif where == "backward":
        def hook(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            if now() and hidden.requires_grad:
                hidden.register_hook(lambda grad: die(out, where, step))
        layers[0].register_forward_hook(hook)
    elif where == "exchange":
        from hf_bdlm.parallel import collectives

        start = collectives.start_gather

        def start_then_die(*args, **kwargs):
            handle = start(*args, **kwargs)
            if now():
                die(out, where, step)
            return handle
        collectives.start_gather = start_then_die
    elif where == "save":
        save = trainer._save_optimizer_and_scheduler

        def save_then_die(output_dir):
            if trainer.state.global_step == step:
                die(out, where, step)
            return save(output_dir)
        trainer._save_optimizer_and_scheduler = save_then_die
    else:
        raise ValueError(where)


def build_trainer(family: str, out: Path, mode: str, P: int, wrapper: str, features: str | None = None):
    from hf_bdlm import BDLMSFTConfig, BDLMSFTTrainer

    common = dict(output_dir=str(out), block_parallel_size=P, block_parallel_mode=mode, **TRAINING,
                  **(FSDP2 if wrapper == "fsdp2" else {}))
    if family == "converted":
        from trainer_common import prompt_completion, tiny_causal_lm, tiny_tokenizer

        args = BDLMSFTConfig(**common, per_device_train_batch_size=2, max_length=64, objective="fast_dllm_v2")
        return BDLMSFTTrainer(tiny_causal_lm(), args=args, train_dataset=prompt_completion(16),
                              processing_class=tiny_tokenizer())
    if family == "diffusion_gemma":
        from fsdp_worker import diffusion_gemma_config
        from tiny_diffusion_gemma import conversations, tiny_model, tiny_tokenizer

        args = diffusion_gemma_config(out, P, mode, **{k: v for k, v in common.items() if k != "output_dir"})
        return BDLMSFTTrainer(tiny_model(), args=args, train_dataset=conversations(16),
                              processing_class=tiny_tokenizer())
    if family == "dflash":
        from dflash_trainer_worker import config, tiny_drafter, tiny_target
        from trainer_common import tiny_tokenizer

        from hf_bdlm.models.dflash.training.trainer import DFlashTrainer

        target = tiny_target()
        args = config(out, **{k: v for k, v in common.items() if k != "output_dir"})
        return DFlashTrainer(tiny_drafter(target), args, train_dataset=features, target=target,
                             processing_class=tiny_tokenizer())
    raise ValueError(family)


def train(family: str, out: Path, mode: str, wrapper: str, features: str | None, resume: bool = False,
          kill: tuple[str, int, int] | None = None) -> None:
    """One run over the default process group's world (a kill: ``(where, rank, step)``)."""
    trainer = build_trainer(family, out, mode, _world()[1], wrapper, features)
    if kill is not None and _world()[0] == kill[1]:
        arm(trainer, out, kill[0], kill[2])
    trainer.train(resume_from_checkpoint=True if resume else None)
    weights = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
               for n, p in trainer.model.named_parameters()}
    if trainer.is_world_process_zero():
        torch.save(weights, out / "final_weights.pt")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--family", default="converted", choices=["converted", "diffusion_gemma", "dflash"])
    parser.add_argument("--mode", default="csbp", choices=["csbp", "cp", "bp"])
    parser.add_argument("--wrapper", default="ddp", choices=["ddp", "fsdp2"])
    parser.add_argument("--features", default=None, help="the dflash family's captured features")
    parser.add_argument("--where", default=None, choices=["forward", "backward", "exchange", "save"])
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--kill-step", type=int, default=3)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shared = dist.is_initialized()  # inside a shared launch; else the trainer's arguments start the group
    (out / f"pid.{_world()[0]}").write_text(str(os.getpid()))
    kill = (args.where, args.kill_rank, args.kill_step) if args.where else None
    train(args.family, out, args.mode, args.wrapper, args.features, args.resume, kill)
    dist.barrier()
    if not shared:
        dist.destroy_process_group()


def _world() -> tuple[int, int]:
    """(rank, world size), before the trainer has started the process group too."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


if __name__ == "__main__":
    main()
