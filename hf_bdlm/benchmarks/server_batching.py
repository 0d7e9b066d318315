"""Server throughput with and without batching, and its behaviour under overload, against a real uvicorn server.

1. batching: `--requests` concurrent chat requests (the shipped held-out prompts, different lengths, greedy,
   `max_tokens` generated exactly via `ignore_eos`) against a server with `max_batch_size=1`, then one with
   `max_batch_size=8`, each burst sent `--repeats` times (at least 3) after a warm-up; generated tokens/s (median and
   range over the bursts), mean latency and the mean batch the scheduler formed; the speed-up over the first server is
   the ratio of median seconds per token, a tie where the ranges overlap (`hf_bdlm.benchmarks.spread.compare`);
2. overload: `--flood` concurrent clients against a server with a small queue; counts of 200 / 429 / anything
   else, and whether the server still answers afterwards.

    python -m hf_bdlm.benchmarks.server_batching --quick                          # SmolLM2 converted on the fly
    python -m hf_bdlm.benchmarks.server_batching --model outputs/smollm2-135m-bdlm-csbp --out serving.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import pathlib
import time

import torch

from ..data import load_arith
from .spread import MIN_TIMED_STEPS, Spread, check_timed_steps, compare


def run_requests(base_url: str, model: str, prompts: list[list[dict]], max_tokens: int, workers: int) -> dict:
    import openai  # lazy: optional dependency (openai)

    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)

    def one(messages):
        start = time.perf_counter()
        try:
            out = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                 temperature=0, extra_body={"ignore_eos": True})
            return 200, out.usage.completion_tokens, time.perf_counter() - start
        except openai.RateLimitError:
            return 429, 0, time.perf_counter() - start
        except openai.APIStatusError as err:
            return err.status_code, 0, time.perf_counter() - start

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(one, prompts))
    seconds = time.perf_counter() - start
    codes = [r[0] for r in results]
    tokens = sum(r[1] for r in results)
    latencies = [r[2] for r in results if r[0] == 200]
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "mean_latency_s": sum(latencies) / max(1, len(latencies)),
            "codes": {str(c): codes.count(c) for c in sorted(set(codes))}}


def _per_s(row: dict) -> Spread:
    return Spread(b["tokens_per_s"] for b in row["bursts"])


def _seconds_per_token(row: dict) -> Spread:
    return Spread(b["seconds"] / b["tokens"] for b in row["bursts"])


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="embedded:smollm2", help="checkpoint folder (or embedded:smollm2)")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--flood", type=int, default=32, help="concurrent clients of the overload test")
    p.add_argument("--flood-queue", type=int, default=4, help="queue size of the overload test")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=MIN_TIMED_STEPS,
                   help=f"timed bursts per server, at least {MIN_TIMED_STEPS}")
    p.add_argument("--quick", action="store_true", help="8 requests of 32 tokens, flood 16")
    p.add_argument("--out", default=None)
    return p


def main(argv=None) -> dict:
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        check_timed_steps(args.repeats, "--repeats")
    except ValueError as err:
        parser.error(str(err))
    if args.quick:
        args.requests, args.max_tokens, args.flood = 8, 32, 16
    torch.set_num_threads(args.threads)
    # lazy: optional dependency (fastapi, uvicorn: the serve extra)
    from ..serving import Engine, ServerConfig, ServerThread

    engine = Engine.from_pretrained(args.model, dtype=torch.float32, block_size=16)
    test = load_arith("test")
    prompts = [test[i]["prompt"] for i in range(args.requests)]
    result = {"model": args.model, "requests": args.requests, "max_tokens": args.max_tokens, "batching": []}
    print(f"{engine.name}: {args.requests} concurrent requests x {args.max_tokens} tokens, {args.threads} threads")
    for size in args.batch_sizes:
        config = ServerConfig(port=0, max_batch_size=size, max_queue=max(64, args.requests), batch_wait_ms=20)
        with ServerThread(engine, config) as server:
            run_requests(server.base_url, engine.name, prompts[:2], 4, 2)  # warm-up
            stats = server.app.state.scheduler.stats
            before_batches, before_jobs = stats.batches, stats.jobs
            bursts = [run_requests(server.base_url, engine.name, prompts, args.max_tokens, args.requests)
                      for _ in range(args.repeats)]
            mean_batch = (stats.jobs - before_jobs) / max(1, stats.batches - before_batches)
        tokens, seconds = sum(b["tokens"] for b in bursts), sum(b["seconds"] for b in bursts)
        codes = {c: sum(b["codes"].get(c, 0) for b in bursts) for c in sorted({c for b in bursts for c in b["codes"]})}
        row = {"max_batch_size": size, "bursts": bursts, "tokens": tokens, "seconds": seconds,
               "tokens_per_s": Spread(b["tokens_per_s"] for b in bursts).median,
               "mean_latency_s": sum(b["mean_latency_s"] for b in bursts) / len(bursts), "mean_batch": mean_batch,
               "codes": codes}
        result["batching"].append(row)
        print(f"  max_batch_size {size}: {_per_s(row).describe('.1f')} tok/s, mean latency "
              f"{row['mean_latency_s']:.1f}s, mean batch {row['mean_batch']:.1f}, codes {row['codes']}", flush=True)
    base = result["batching"][0]
    for row in result["batching"]:
        speedup = compare(_seconds_per_token(base), _seconds_per_token(row))
        row["speedup"] = dict(speedup.as_record(), describe=speedup.describe())
    config = ServerConfig(port=0, max_batch_size=8, max_queue=args.flood_queue, batch_wait_ms=20)
    with ServerThread(engine, config) as server:
        flood = run_requests(server.base_url, engine.name, [prompts[i % len(prompts)] for i in range(args.flood)],
                             16, args.flood)
        after = run_requests(server.base_url, engine.name, prompts[:1], 4, 1)
    flood["alive_after"] = after["codes"] == {"200": 1}
    result["overload"] = {**flood, "clients": args.flood, "queue": args.flood_queue}
    print(f"  overload: {args.flood} clients, queue {args.flood_queue}: codes {flood['codes']}, "
          f"server answers afterwards: {flood['alive_after']}")
    print("\n| max batch size | tokens/s | speedup | mean latency (s) | mean batch formed |\n|---|---|---|---|---|")
    for row in result["batching"]:
        speedup = "-" if row is result["batching"][0] else row["speedup"]["describe"]
        print(f"| {row['max_batch_size']} | {_per_s(row).describe('.1f')} | {speedup} | "
              f"{row['mean_latency_s']:.1f} | {row['mean_batch']:.1f} |")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
