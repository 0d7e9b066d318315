"""Decoding speed: block-diffusion decoding (threshold and fixed-step) against the source causal LM's `generate`.

Same prompts (the shipped held-out tasks, chat template) and the same output length for every mode, EOS ignored so
that every row produces exactly `--new-tokens` tokens; batch 1 (prompts one at a time) and batch 8 (left-padded;
the BDLM decodes ragged prompts in one batch). Beside the speed, exact match on the held-out set (greedy, one
block of new tokens, EOS honoured: the quickstart's metric), printed as hits / prompts with its 95 % Wilson interval
(fewer than 100 prompts carry no quality claim). Every group of prompts (one batch) is a timed sample,
at least 3 per mode and batch size (the prompts are passed over again when they make fewer groups); tables give the
median and range of tokens per second across them, and a mode's speed over AR is the ratio of median CPU seconds per
token, a tie where the two ranges overlap (`hf_bdlm.benchmarks.spread.compare`).

- `ar`: `AutoModelForCausalLM.generate` (greedy, KV cache) of the causal LM the BDLM was converted from;
- `bdlm threshold`: block-wise decoding, positions with confidence >= `--threshold` unmasked in parallel;
- `bdlm fixed-S`: `S` denoising steps per block (`B / S` tokens per step).

    python -m benchmarks.decoding --quick                               # SmolLM2 converted on the fly
    python -m benchmarks.decoding --bdlm outputs/smollm2-135m-bdlm-csbp --out decoding.json   # the quickstart model

On a shared machine set OMP_WAIT_POLICY=PASSIVE: OpenMP's spin-waiting otherwise inflates CPU time under contention.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import time

import torch

from hf_bdlm.benchmarks.spread import MIN_TIMED_STEPS, Spread, compare


def chat_ids(tokenizer, examples) -> list[list[int]]:
    return [list(tokenizer.apply_chat_template(e["prompt"], add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]) for e in examples]


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def run_mode(mode: dict, model, prompts, batch: int, new_tokens: int | None, pad_id: int, eos) -> list[torch.Tensor]:
    """Generate for every prompt in groups of `batch`; returns each row's new tokens."""
    outs = []
    for start in range(0, len(prompts), batch):
        group = prompts[start:start + batch]
        ids, mask = left_pad(group, pad_id)
        if len(group) == 1 or all(len(p) == len(group[0]) for p in group):
            mask = None
        if mode["kind"] == "ar":
            kwargs = dict(do_sample=False, max_new_tokens=new_tokens, pad_token_id=pad_id)
            if eos is None:
                kwargs.update(eos_token_id=None, min_new_tokens=new_tokens)
            out = model.generate(ids, attention_mask=mask if mask is not None else torch.ones_like(ids), **kwargs)
        else:
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, eos_token_id=eos,
                                 confidence_threshold=mode["threshold"], steps_per_block=mode["steps"])
        outs += [row[ids.shape[1]:] for row in out]
    return outs


def measure(modes, models, prompts, batches, new_tokens, pad_id) -> list[dict]:
    """Tokens/s of every mode and batch size, one sample per group of prompts (at least :data:`MIN_TIMED_STEPS`: the
    prompts are passed over again when they make fewer groups). The modes take turns group by group (the order
    rotating), so a load change on a shared machine hits every mode alike; CPU time (all threads of this process) is
    reported beside wall time, as the cost that contention inflates least."""
    rows = []
    for batch in batches:
        for mode in modes:
            run_mode(mode, models[mode["kind"]], prompts[:batch], batch, 4, pad_id, None)  # warm-up
        samples = {m["name"]: [] for m in modes}  # per group: tokens, wall s, cpu s
        groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
        groups *= math.ceil(MIN_TIMED_STEPS / len(groups))
        for g, group in enumerate(groups):
            for k in range(len(modes)):
                mode = modes[(g + k) % len(modes)]
                wall, cpu = time.perf_counter(), time.process_time()
                outs = run_mode(mode, models[mode["kind"]], group, batch, new_tokens, pad_id, None)
                samples[mode["name"]].append((sum(o.numel() for o in outs), time.perf_counter() - wall,
                                              time.process_time() - cpu))
        for mode in modes:
            got = samples[mode["name"]]
            tokens, wall, cpu = (sum(x[i] for x in got) for i in range(3))
            rows.append({"mode": mode["name"], "batch": batch, "tokens": tokens, "seconds": wall, "cpu_seconds": cpu,
                         "tokens_per_s": tokens / wall, "tokens_per_cpu_s": tokens / cpu,
                         "groups": [dict(tokens=t, seconds=w, cpu_seconds=c) for t, w, c in got]})
            print(f"  {mode['name']:<22} batch {batch}: {_per_s(rows[-1]).describe('.1f')} tok/s wall, "
                  f"{_per_s(rows[-1], cpu=True).describe('.1f')} tok per CPU-s ({tokens} tokens, {len(got)} groups)",
                  flush=True)
    return rows


def _per_s(row: dict, cpu: bool = False) -> Spread:
    """Tokens per (wall or CPU) second of each timed group of a row."""
    key = "cpu_seconds" if cpu else "seconds"
    return Spread(g["tokens"] / g[key] for g in row["groups"])


def _seconds_per_token(row: dict, cpu: bool = False) -> Spread:
    key = "cpu_seconds" if cpu else "seconds"
    return Spread(g[key] / g["tokens"] for g in row["groups"])


def exact_match(modes, models, tokenizer, examples, block: int, pad_id: int, eos) -> dict[str, float]:
    from hf_bdlm.data import exact_match as match

    prompts = chat_ids(tokenizer, examples)
    scores = {}
    for mode in modes:
        outs = run_mode(mode, models[mode["kind"]], prompts, 1, block, pad_id, eos)
        texts = [tokenizer.decode(o, skip_special_tokens=True) for o in outs]
        scores[mode["name"]] = sum(match(t, e["answer"]) for t, e in zip(texts, examples)) / len(examples)
    return scores


def _quality(share: float | None, n: int) -> str:
    """``hits/n [95 % Wilson interval]`` of an exact-match share over ``n`` prompts."""
    from hf_bdlm.benchmarks.decoding import wilson_interval

    if share is None or n < 1:
        return "-"
    hits = round(share * n)
    low, high = wilson_interval(hits, n)
    return f"{hits}/{n} [{low:.0%}-{high:.0%}]"


def table(rows: list[dict], quality: dict[str, float], quality_examples: int = 0) -> str:
    """Tokens per second (wall, CPU) as the median [range] over the timed groups; the speed over AR is the ratio of
    median CPU seconds per token, a tie where the ranges overlap."""
    ar = {r["batch"]: r for r in rows if r["mode"] == "ar"}
    lines = ["| decoding | batch | tokens/s (wall) | tokens per CPU-s | vs AR (CPU) | exact match [95 % interval] |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        base = ar.get(r["batch"])
        ratio = "-" if base is None or base is r else \
            compare(_seconds_per_token(base, cpu=True), _seconds_per_token(r, cpu=True)).describe()
        lines.append(f"| {r['mode']} | {r['batch']} | {_per_s(r).describe('.1f')} | "
                     f"{_per_s(r, cpu=True).describe('.1f')} | {ratio} | "
                     f"{_quality(quality.get(r['mode']), quality_examples)} |")
    return "\n".join(lines)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bdlm", default=None, help="BDLM checkpoint (default: convert the causal LM, no training)")
    p.add_argument("--causal", default=None, help="source causal LM folder (default: the embedded SmolLM2)")
    p.add_argument("--prompts", type=int, default=16, help="prompts timed per mode and batch size")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--fixed-steps", type=int, default=None, help="steps per block of the fixed mode (default B/4)")
    p.add_argument("--quality-examples", type=int, default=20, help="held-out prompts scored by exact match")
    p.add_argument("--block-size", type=int, default=16, help="block size when converting on the fly")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="8 prompts, 32 new tokens, 10 quality examples")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    return p


def main(argv=None) -> dict:
    args = make_parser().parse_args(argv)
    if args.quick:
        args.prompts, args.new_tokens, args.quality_examples = 8, 32, 10
    torch.set_num_threads(args.threads)
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    import hf_bdlm
    from hf_bdlm.data import load_arith

    causal_dir = args.causal
    if causal_dir is None:
        from hf_bdlm.embedded import default_model_dir

        causal_dir = str(default_model_dir())
    ar = AutoModelForCausalLM.from_pretrained(causal_dir, dtype=torch.float32).eval()
    if args.bdlm:
        bdlm = AutoModel.from_pretrained(args.bdlm, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(args.bdlm)
    else:
        bdlm, tokenizer = hf_bdlm.convert_causal_lm(ar, AutoTokenizer.from_pretrained(causal_dir),
                                                    block_size=args.block_size)
        bdlm.eval()
    block = bdlm.config.block_size
    steps = args.fixed_steps or max(1, block // 4)
    modes = [{"name": "ar", "kind": "ar"},
             {"name": f"bdlm threshold {args.threshold}", "kind": "bdlm", "threshold": args.threshold, "steps": None},
             {"name": f"bdlm fixed-{steps}", "kind": "bdlm", "threshold": None, "steps": steps}]
    models = {"ar": ar, "bdlm": bdlm}
    test = load_arith("test")
    examples = [test[i] for i in range(max(args.prompts, args.quality_examples))]
    prompts = chat_ids(tokenizer, examples[:args.prompts])
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = ar.generation_config.eos_token_id
    print(f"AR {causal_dir} vs BDLM {args.bdlm or 'converted on the fly'} (block {block}); {len(prompts)} prompts, "
          f"{args.new_tokens} new tokens, {args.threads} threads", flush=True)
    with torch.no_grad():
        rows = measure(modes, models, prompts, args.batches, args.new_tokens, pad_id)
        quality = exact_match(modes, models, tokenizer, examples[:args.quality_examples], block, pad_id, eos)
    print(table(rows, quality, args.quality_examples))
    result = {"causal": causal_dir, "bdlm": args.bdlm, "block_size": block, "new_tokens": args.new_tokens,
              "prompts": len(prompts), "threads": args.threads, "rows": rows, "exact_match": quality,
              "quality_examples": args.quality_examples}
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
