"""Self-distillation data for parallel decoding: a block-diffusion model's own answers to the training prompts.

dParallel (Chen et al. 2025) trains a diffusion LM on the trajectories it decodes itself, with its certainty-forcing
term: the targets are then the tokens the model would settle anyway, so the term can make them confident in parallel,
where on the data's answers it sharpens only what the model already gets right. This script writes that data: each
training prompt of the shipped tasks, answered by MODEL through its serving decoder (what ``hf-bdlm serve`` runs) in
its exact-techniques setting (confidence threshold 0.9, EOS exit; the same tokens at any batch size), as a dataset
folder the SFT recipe reads (``dataset_name: OUT``: ``train.jsonl`` the model's answers, ``test.jsonl`` the shipped
held-out split unchanged, so exact match is still scored against the references):

    python recipes/self_distill.py --model outputs/smollm2-135m-bdlm-confident --out outputs/self-distill-data \\
        --prompts 400
    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml recipes/sft.py \\
        --config recipes/configs/smollm2_cpu_self_distill.yaml

An answer the budget cuts before its EOS is left out (training on it would teach answers that never end);
``OUT/summary.json`` counts them. The ``answer`` column keeps the reference answer, and ``teacher_exact_match`` says
how many of the kept answers equal it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a block-diffusion checkpoint folder (the teacher and the student)")
    p.add_argument("--out", required=True, type=Path, help="the dataset folder to write")
    p.add_argument("--prompts", type=int, default=600, help="training prompts to answer, from the first")
    p.add_argument("--max_new_tokens", type=int, default=16, help="new tokens per answer (the quickstart's block)")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = make_parser().parse_args(argv)
    if args.prompts < 1 or args.batch_size < 1 or args.max_new_tokens < 1:
        raise SystemExit(f"--prompts {args.prompts}, --batch_size {args.batch_size} and --max_new_tokens "
                         f"{args.max_new_tokens} must each be at least 1")

    import torch

    from hf_bdlm.benchmarks.decoding_study import chat_ids, serve_decode
    from hf_bdlm.data import exact_match, load_arith
    from hf_bdlm.protocols.decoding import DecodingRequest
    from hf_bdlm.protocols.registry import family_for_config
    from hf_bdlm.serving.engine import Engine

    if args.threads:
        torch.set_num_threads(args.threads)
    train, test = load_arith("train"), load_arith("test")
    if args.prompts > len(train):
        raise SystemExit(f"--prompts {args.prompts}: the shipped training split has {len(train)} prompts")
    engine = Engine.from_pretrained(args.model, dtype=torch.float32)
    family = family_for_config(engine.model.config)
    variants = family.role("serving", args.model).decoding_variants(engine.decoder)
    if "exact techniques" not in variants:
        raise SystemExit(f"{args.model} is a {family.name} model; self-distillation data is written for block-diffusion "
                         f"models (their decoding variants: {sorted(variants)})")
    decoder = variants["exact techniques"].decoder
    eos = decoder.eos_token_ids(decoder.settings(DecodingRequest(), 1, 1))
    tokenizer = engine.tokenizer

    tick = time.perf_counter()
    rows, hits, unfinished = [], 0, 0
    examples = [train[i] for i in range(args.prompts)]
    for start in range(0, len(examples), args.batch_size):
        batch = examples[start: start + args.batch_size]
        got = serve_decode(decoder, [chat_ids(tokenizer, e) for e in batch], args.max_new_tokens, False, eos)
        for example, tokens in zip(batch, got):
            if not tokens or tokens[-1] not in eos:  # cut by the budget: it would teach answers that never end
                unfinished += 1
                continue
            text = tokenizer.decode(tokens, skip_special_tokens=True).strip()
            hits += exact_match(text, example["answer"])
            rows.append({"prompt": example["prompt"], "completion": [{"role": "assistant", "content": text}],
                         "answer": example["answer"], "task": example["task"]})
        print(f"{start + len(batch)}/{len(examples)} answered, {hits} equal the reference, {unfinished} left out "
              f"(no EOS within {args.max_new_tokens} tokens), "
              f"{time.perf_counter() - tick:.0f}s", flush=True)

    if not rows:
        raise SystemExit(f"{args.model} ended none of its {len(examples)} answers within --max_new_tokens "
                         f"{args.max_new_tokens}: raise it, or train the model further first")
    args.out.mkdir(parents=True, exist_ok=True)
    for name, split in (("train.jsonl", rows), ("test.jsonl", [test[i] for i in range(len(test))])):
        with open(args.out / name, "w") as f:
            for row in split:
                f.write(json.dumps(row) + "\n")
    summary = {"model": str(args.model), "prompts": len(examples), "rows": len(rows), "left_out_unfinished": unfinished,
               "teacher_exact_match": hits / len(rows),
               "decoding": "exact techniques (threshold 0.9, fused commit, EOS exit, compact batch)",
               "max_new_tokens": args.max_new_tokens, "seconds": time.perf_counter() - tick}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
