"""Records of the shipped lm-eval tasks on the two tiny counting models of `tests/evaluation/test_lm_eval.py`.

The models are the tests' own fixtures (a converted BDLM and a DiffusionGemma trained for seconds to count), so the
bounds the tests assert are read from these records:

- `converted_bdlm_results.json`, `diffusion_gemma_results.json`: lm-eval's results JSON from `hf-bdlm lm-eval --model
  bdlm --tasks bdlm_count_mc,bdlm_count_gen --batch_size 8` (mc_num 8, seed 0), run from `tests/data/lm_eval_tasks`;
- `diffusion_gemma_seeds.json`: the DiffusionGemma's scores with initial seeds 0-2 (how far a score moves when the
  training's arithmetic changes: the margin a bound needs to hold on another CPU);
- `elbo_ranking.json`: each family's bound on 10 counts of 4 words (gold) and the same words counting down.

    python scripts/lm_eval_tasks.py --out benchmarks/results/lm_eval_tasks
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"


def run_cli(folder: Path, out: Path) -> dict:
    """lm-eval's command line on the shipped tasks at batch size 8, as the tests run it; the results JSON."""
    from test_lm_eval import TASK_NAMES, TASKS, offline_env

    args = f"pretrained={folder},mc_num=8,seed=0"
    command = [str(Path(sys.executable).parent / "hf-bdlm"), "lm-eval", "--model", "bdlm", "--model_args", args,
               "--tasks", ",".join(TASK_NAMES), "--include_path", str(TASKS), "--batch_size", "8", "--device", "cpu",
               "--output_path", str(out)]
    env = {**offline_env(out), "OMP_NUM_THREADS": "1"}
    subprocess.run(command, cwd=TASKS, env=env, check=True)
    [results_file] = out.rglob("results_*.json")
    return json.loads(results_file.read_text())


def scores(results: dict) -> dict:
    r = results["results"]
    return {"acc": r["bdlm_count_mc"]["acc,none"], "exact_match": r["bdlm_count_gen"]["exact_match,none"]}


def elbo_ranking(folder: Path, family: str, offset: int) -> dict:
    from test_lm_eval import gold_and_corrupted

    good, bad = gold_and_corrupted(folder, family, offset)
    gaps = [g.log_likelihood - b.log_likelihood for g, b in zip(good, bad)]
    return {"gold": [[s.log_likelihood, s.stderr] for s in good], "corrupted": [[s.log_likelihood, s.stderr] for s in bad],
            "min_gap": min(gaps), "mean_gap": sum(gaps) / len(gaps)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", default="0,1,2", help="initial seeds of the DiffusionGemma spread")
    args = parser.parse_args(argv)
    sys.path[:0] = [str(TESTS / "evaluation"), str(TESTS), str(TESTS / "distributed")]  # test_lm_eval, its helpers
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)  # as the tests compute (conftest)
    from test_lm_eval import BD_WORD_ID, DG_WORD_ID, counting_bdlm, counting_diffusion_gemma

    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        bdlm = counting_bdlm(tmp / "bdlm")
        seeds = {}
        for seed in (int(s) for s in args.seeds.split(",")):
            folder = counting_diffusion_gemma(tmp / f"dg{seed}", seed=seed)
            results = run_cli(folder, tmp / f"dg{seed}-out")
            seeds[seed] = scores(results)
            if seed == 0:
                (args.out / "diffusion_gemma_results.json").write_text(json.dumps(results, indent=2, default=str))
                ranking = {"diffusion_gemma": elbo_ranking(folder, "diffusion_gemma", DG_WORD_ID)}
        results = run_cli(bdlm, tmp / "bdlm-out")
        (args.out / "converted_bdlm_results.json").write_text(json.dumps(results, indent=2, default=str))
        ranking["block_diffusion"] = elbo_ranking(bdlm, "block_diffusion", BD_WORD_ID)
    ranking["what"] = ("bound (nats) of 10 counts of 4 words (gold) and the same words counting down (corrupted), "
                       "mc_num=16, seed=0; the tiny models of tests/evaluation/test_lm_eval.py")
    (args.out / "elbo_ranking.json").write_text(json.dumps(ranking, indent=2))
    (args.out / "diffusion_gemma_seeds.json").write_text(json.dumps(
        {"what": "the tiny DiffusionGemma of tests/evaluation/test_lm_eval.py trained from initial seeds; lm-eval CLI, "
                 "batch 8",
         "scores": seeds}, indent=2))
    print(json.dumps({"converted_bdlm": scores(results), "diffusion_gemma_by_seed": seeds,
                      "elbo": {k: {"min_gap": v["min_gap"], "mean_gap": v["mean_gap"]}
                               for k, v in ranking.items() if isinstance(v, dict)}}, indent=2))


if __name__ == "__main__":
    main()
