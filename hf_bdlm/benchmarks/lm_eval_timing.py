"""lm-eval's `--model bdlm` wall time: 100 generation and 100 log-likelihood requests, batch 1 against batch 8.

Two lm-eval tasks are written over the shipped held-out set (`hf_bdlm/data/arith_test.jsonl`, chat template applied
as the quickstart trains): `generate_until` on its first 100 questions (until a newline, at most 16 new tokens: one
block of the quickstart model) and a 4-way multiple choice on 25 questions (100 `loglikelihood` requests: the answer
and three answers of other questions of the same kind). Each (kind, batch size) runs `--repeats` times through
`lm_eval.simple_evaluate` in this process, the kinds and batch sizes taking turns so that a load change on a shared
machine hits them alike; wall and CPU seconds per 100 requests are reported as median [range]
(`hf_bdlm.benchmarks.spread`). One more run per kind at batch 8 under cProfile splits the time into the backbone's
forward passes, the LM head, the Monte-Carlo draws and the rest (lm-eval, tokenization, decoding bookkeeping).

    python -m hf_bdlm.benchmarks.lm_eval_timing --model outputs/smollm2-135m-bdlm-csbp \
        --out benchmarks/results/lm_eval_timing
    python -m hf_bdlm.benchmarks.lm_eval_timing --quick     # embedded SmolLM2 converted untrained, 2 repeats, 20 requests

Without `--model`, the quickstart's output folder is used when it exists, else the embedded SmolLM2 converted on the
fly (untrained: it ends most answers at once, so generation is cheaper than after the fine-tune); the record says
which. On a shared machine set OMP_WAIT_POLICY=PASSIVE.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pathlib
import platform
import pstats
import random
import tempfile
import time
from collections import defaultdict

import torch

from .spread import Spread, compare

QUICKSTART = pathlib.Path("outputs/smollm2-135m-bdlm-csbp")
HELD_OUT = pathlib.Path(__file__).resolve().parents[1] / "data" / "arith_test.jsonl"
GEN_YAML = """task: bench_arith_gen
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: generate_until
doc_to_text: question
doc_to_target: answer
generation_kwargs: {{until: ["\\n"], max_gen_toks: {max_gen_toks}, do_sample: false}}
metric_list: [{{metric: exact_match, aggregation: mean, higher_is_better: true}}]
metadata: {{version: 1.0}}
"""
MC_YAML = """task: bench_arith_mc
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: multiple_choice
doc_to_text: question
doc_to_choice: choices
doc_to_target: gold
metric_list: [{{metric: acc, aggregation: mean, higher_is_better: true}}]
metadata: {{version: 1.0}}
"""
# Where the time goes, by the function that spends it (cumulative time under cProfile).
PROFILE_PARTS = {
    "backbone forward": ("hf_bdlm/models/block_diffusion/modeling.py", "forward"),
    "LM head": ("hf_bdlm/models/block_diffusion/modeling.py", "lm_logits"),
    "Monte-Carlo draws": ("hf_bdlm/objectives/likelihood.py", "absorbing_draws"),
}


def write_tasks(folder: pathlib.Path, requests: int, max_gen_toks: int) -> None:
    """The two tasks over the held-out set: `requests` generation requests, `requests` likelihood requests."""
    rows = [json.loads(line) for line in HELD_OUT.read_text().splitlines()]
    gen = [{"question": r["prompt"][-1]["content"], "answer": r["answer"]} for r in rows[:requests]]
    by_task = defaultdict(list)
    for r in rows:
        by_task[r["task"]].append(r["answer"])
    rng = random.Random(0)
    mc = []
    for r in rows[: requests // 4]:
        others = sorted({a for a in by_task[r["task"]] if a != r["answer"]})
        wrong = rng.sample(others, 3) if len(others) >= 3 else (others * 3)[:3]
        choices = [r["answer"], *wrong]
        rng.shuffle(choices)
        mc.append({"question": r["prompt"][-1]["content"], "choices": choices, "gold": choices.index(r["answer"])})
    for name, docs in (("gen", gen), ("mc", mc)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / "gen.yaml").write_text(GEN_YAML.format(data=folder / "gen.jsonl", max_gen_toks=max_gen_toks))
    (folder / "mc.yaml").write_text(MC_YAML.format(data=folder / "mc.jsonl"))


def run(lm, task: str, folder: pathlib.Path, limit: int | None = None) -> tuple[float, float, dict]:
    from lm_eval import simple_evaluate  # lazy: optional dependency (lm-eval)
    from lm_eval.tasks import TaskManager

    wall, cpu = time.perf_counter(), time.process_time()
    out = simple_evaluate(model=lm, tasks=[task], apply_chat_template=True, log_samples=False, limit=limit,
                          task_manager=TaskManager(include_path=str(folder), include_defaults=False))
    return time.perf_counter() - wall, time.process_time() - cpu, out["results"][task]


def profile(lm, task: str, folder: pathlib.Path) -> dict:
    profiler = cProfile.Profile()
    profiler.enable()
    wall = time.perf_counter()
    run(lm, task, folder)
    wall = time.perf_counter() - wall
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    parts = {part: sum(v[3] for (f, _, fn), v in stats.items() if f.endswith(file) and fn == function)
             for part, (file, function) in PROFILE_PARTS.items()}
    total = sum(v[3] for (f, _, fn), v in stats.items() if f.endswith("lm_eval_timing.py") and fn == "run")
    # The backbone's forward includes the attention; the LM head runs outside it (lm_logits), the draws on the CPU.
    parts["rest (lm-eval, tokenization, decoding bookkeeping)"] = max(total - sum(parts.values()), 0.0)
    return {"profiled_wall_s": wall, "seconds": parts,
            "share": {k: v / total for k, v in parts.items()} if total else {}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the quickstart output, else "
                        "embedded:smollm2 converted untrained)")
    parser.add_argument("--requests", type=int, default=100, help="requests of each kind (a multiple of 4)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--mc-num", type=int, default=8, help="Monte-Carlo samples per likelihood request")
    parser.add_argument("--max-gen-toks", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="20 requests of each kind, 2 repeats")
    parser.add_argument("--out", default=None, help="folder for lm_eval_timing.json and summary.md")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.repeats = 20, 2
    if args.requests % 4:
        parser.error(f"--requests {args.requests}: the likelihood task asks 4 choices per question; pass a multiple of 4")
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    # lazy: optional dependency (lm-eval, which evaluation.lm_eval_model imports)
    from ..evaluation.lm_eval_model import HFBDLMEvalModel

    model = args.model or (str(QUICKSTART) if (QUICKSTART / "config.json").is_file() else "embedded:smollm2")
    trained = model != "embedded:smollm2"
    folder = pathlib.Path(tempfile.mkdtemp(prefix="lm_eval_timing_"))
    write_tasks(folder, args.requests, args.max_gen_toks)
    models = {b: HFBDLMEvalModel(pretrained=model, batch_size=b, mc_num=args.mc_num, seed=0,
                                 conversion_block_size=16) for b in args.batch_sizes}
    tasks = {"generation": "bench_arith_gen", "likelihood": "bench_arith_mc"}
    for b, lm in models.items():  # warm-up: first-call costs (task indexing, kernels) out of the timings
        for task in tasks.values():
            run(lm, task, folder, limit=4)
    walls, cpus, scores = defaultdict(list), defaultdict(list), {}
    order = [(kind, b) for kind in tasks for b in args.batch_sizes]
    for r in range(args.repeats):
        for kind, b in order[r % len(order):] + order[: r % len(order)]:
            wall, cpu, result = run(models[b], tasks[kind], folder)
            scale = 100 / args.requests
            walls[(kind, b)].append(wall * scale)
            cpus[(kind, b)].append(cpu * scale)
            scores[(kind, b)] = {k: v for k, v in result.items() if isinstance(v, float)}
            print(f"repeat {r}: {kind:10s} batch {b}: {wall * scale:7.1f} s wall, {cpu * scale:7.1f} s CPU per 100",
                  flush=True)
    profiles = {kind: profile(models[max(args.batch_sizes)], task, folder) for kind, task in tasks.items()}
    rows = []
    for kind in tasks:
        for b in args.batch_sizes:
            rows.append({"kind": kind, "batch_size": b, "wall_s_per_100": Spread(walls[(kind, b)]).as_record(),
                         "cpu_s_per_100": Spread(cpus[(kind, b)]).as_record(), "scores": scores[(kind, b)]})
    ratios = {}
    if len(args.batch_sizes) == 2:
        one, many = args.batch_sizes
        for kind in tasks:
            ratios[kind] = compare(Spread(walls[(kind, one)]), Spread(walls[(kind, many)])).as_record()
    record = {"model": model, "trained": trained, "requests_per_kind": args.requests, "repeats": args.repeats,
              "mc_num": args.mc_num, "max_gen_toks": args.max_gen_toks, "threads": torch.get_num_threads(),
              "machine": {"cpus": os.cpu_count(), "processor": platform.processor(),
                          "load_avg_at_end": os.getloadavg()},
              "rows": rows, "batch_1_vs_batch_8_wall": ratios, "profile_batch_8": profiles}
    table = ["| requests | batch | wall s per 100 | CPU s per 100 | score |", "|---|---|---|---|---|"]
    for row in rows:
        score = ", ".join(f"{k} {v:.2f}" for k, v in row["scores"].items() if "stderr" not in k)
        table.append(f"| {row['kind']} | {row['batch_size']} | {Spread(row['wall_s_per_100']['values']).describe('.1f')}"
                     f" | {Spread(row['cpu_s_per_100']['values']).describe('.1f')} | {score} |")
    speedups = [f"- batch {args.batch_sizes[-1]} over batch {args.batch_sizes[0]}, {kind}: "
                f"{compare(Spread(walls[(kind, args.batch_sizes[0])]), Spread(walls[(kind, args.batch_sizes[-1])])).describe()}"
                for kind in tasks] if len(args.batch_sizes) == 2 else []
    summary = "\n".join(table) + "\n\n" + "\n".join(speedups) + "\n" + "\n".join(
        f"- {kind} at batch 8, profiled: " + ", ".join(f"{k} {v:.0%}" for k, v in p["share"].items())
        for kind, p in profiles.items())
    print(summary)
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "lm_eval_timing.json").write_text(json.dumps(record, indent=2) + "\n")
        (out / "summary.md").write_text(summary + "\n")


if __name__ == "__main__":
    main()
