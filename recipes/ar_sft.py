"""The AR baseline of the decoding benchmark: the parent causal LM fine-tuned like for like with TRL's `SFTTrainer`.

Same data (the shipped arithmetic/word tasks, conversational prompt/completion, loss on the completion only), same
sequence length, learning rate, schedule, seed and token budget as the block-diffusion quickstart
(`recipes/configs/smollm2_cpu_csbp.yaml`: 90 steps of 4 sequences: its 2 processes form one block-parallel group, which
shares each batch of 4; here one process takes the same 4), so that ``hf-bdlm bench --only decoding`` compares
decoding speeds at a fair quality (``--max_steps 150`` for the 150-step recipes):

    python recipes/ar_sft.py --output_dir outputs/smollm2-135m-ar-sft
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="embedded:smollm2", help="a causal-LM folder or embedded:smollm2")
    p.add_argument("--output_dir", default="outputs/smollm2-135m-ar-sft")
    p.add_argument("--max_steps", type=int, default=90)
    p.add_argument("--batch_size", type=int, default=4,
                   help="sequences per step (the BDLM recipe's: its block-parallel group of 2 shares a batch of 4)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = make_parser().parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from hf_bdlm.data import load_arith
    from hf_bdlm.train import resolve_model_path

    if args.threads:
        torch.set_num_threads(args.threads)
    folder = resolve_model_path(args.model)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = SFTConfig(output_dir=args.output_dir, max_steps=args.max_steps,
                       per_device_train_batch_size=args.batch_size,
                       gradient_accumulation_steps=1, learning_rate=1.0e-4, lr_scheduler_type="constant_with_warmup",
                       warmup_steps=10, weight_decay=0.0, max_length=128, seed=0, logging_steps=10,
                       save_strategy="no", report_to="none", bf16=False, completion_only_loss=True)
    trainer = SFTTrainer(model=model, args=config, train_dataset=load_arith("train"), processing_class=tokenizer)
    tick = time.perf_counter()
    result = trainer.train()
    trainer.save_model(args.output_dir)
    tokenizer.save_pretrained(args.output_dir)
    results = dict(train_loss=result.training_loss, steps=trainer.state.global_step,
                   train_s=time.perf_counter() - tick, sequences=trainer.state.global_step * args.batch_size)
    (Path(args.output_dir) / "sft_results.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
