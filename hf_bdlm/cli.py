"""The `hf-bdlm` command: one subparser per command, each in its own `add_*_parser` function.

    hf-bdlm serve path/to/bdlm --port 8000 --api-key secret
    hf-bdlm eval swebench --model-dir path/to/bdlm --output-dir out/swe        # shipped offline set, no Docker
    hf-bdlm eval swebench --sanity                                             # grader check: gold 100 %, empty 0 %
    hf-bdlm eval terminal-bench --base-url http://127.0.0.1:8000/v1 --output-dir out/tb

Adding a command: write `add_<name>_parser(subparsers)` that registers its arguments and sets `func` (called with
the parsed namespace, returns the exit code), and call it in `build_parser`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def add_serve_parser(subparsers) -> None:
    from .serving.config import API_KEY_ENV

    p = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible API",
        description="Serve a block diffusion LM (or a causal LM, converted on the fly) over an OpenAI-compatible API "
                    "(/v1/models, /v1/chat/completions, /v1/completions) with batched decoding.")
    p.add_argument("model_dir", help="checkpoint folder (BDLM or causal LM), or 'embedded:smollm2'")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help=f"require this bearer key (default: ${API_KEY_ENV}, else none)")
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: the folder name)")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--max-queue", type=int, default=32, help="waiting requests before 429")
    p.add_argument("--batch-wait-ms", type=float, default=10.0)
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    p.add_argument("--max-prompt-tokens", type=int, default=None)
    p.add_argument("--max-tokens-limit", type=int, default=4096)
    p.add_argument("--default-max-tokens", type=int, default=1024)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    p.add_argument("--device", default=None, help="e.g. cuda, cpu (default: where the model loads)")
    p.add_argument("--block-size", type=int, default=32, help="block size when converting a causal LM")
    p.set_defaults(func=run_serve)


def run_serve(args) -> int:
    import torch

    from .serving import Engine, ServerConfig, serve

    config = ServerConfig(host=args.host, port=args.port, max_batch_size=args.max_batch_size,
                          max_queue=args.max_queue, batch_wait_ms=args.batch_wait_ms,
                          max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
                          max_tokens_limit=args.max_tokens_limit, default_max_tokens=args.default_max_tokens)
    if args.api_key:
        config.api_key = args.api_key
    dtype = getattr(torch, args.dtype) if args.dtype else None
    engine = Engine.from_pretrained(args.model_dir, name=args.served_model_name, dtype=dtype, device=args.device,
                                    block_size=args.block_size)
    if config.host not in ("127.0.0.1", "localhost", "::1") and not config.api_key:
        print(f"warning: serving on {config.host} without an API key", file=sys.stderr)
    print(f"serving {engine.name!r} on http://{config.host}:{config.port}/v1 (batch {config.max_batch_size}, "
          f"queue {config.max_queue}, key {'required' if config.api_key else 'not required'})", flush=True)
    serve(engine, config)
    return 0


def _add_endpoint_args(p) -> None:
    group = p.add_argument_group("model endpoint (one of)")
    group.add_argument("--model-dir", help="checkpoint to serve for the evaluation (started on 127.0.0.1)")
    group.add_argument("--base-url", help="an OpenAI-compatible server already running, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", default=None, help="model id (default: the server's first model / the folder name)")
    p.add_argument("--api-key", default=os.environ.get("HF_BDLM_API_KEY"), help="key for --base-url")
    p.add_argument("--output-dir", default="outputs/eval", help="results JSON, predictions, logs, trajectories")
    agent = p.add_argument_group("agent (mini-swe-agent, text-based mode)")
    agent.add_argument("--step-limit", type=int, default=20, help="model calls per task")
    agent.add_argument("--max-tokens", type=int, default=512, help="completion budget per model call")
    agent.add_argument("--temperature", type=float, default=0.0)
    agent.add_argument("--command-timeout", type=int, default=60, help="seconds per shell command")
    p.add_argument("--quiet", action="store_true", help="no per-task progress lines")


def add_eval_parser(subparsers) -> None:
    p = subparsers.add_parser("eval", help="evaluate a model on agentic coding benchmarks",
                              description="Evaluate a served model on SWE-bench or Terminal-Bench.")
    benchmarks = p.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)

    swe = benchmarks.add_parser(
        "swebench", help="mini-swe-agent on SWE-bench instances, graded with the swebench package",
        description="Runs mini-swe-agent against the model on SWE-bench instances, writes predictions in the "
                    "harness's format (preds.jsonl) and grades them. The shipped offline set runs in local "
                    "sandboxes without Docker; real SWE-bench datasets need Docker.")
    swe.add_argument("--dataset", default="offline", help="'offline' (shipped), a .json/.jsonl file, or a hub name")
    swe.add_argument("--split", default="test")
    swe.add_argument("--instance-ids", nargs="+", default=None)
    swe.add_argument("--predictions", default=None, help="grade this predictions file instead of running the agent")
    swe.add_argument("--sanity", action="store_true", help="grade gold and empty patches only (no model)")
    swe.add_argument("--run-id", default="hf-bdlm")
    swe.add_argument("--workers", type=int, default=1, help="parallel instances on the Docker path")
    _add_endpoint_args(swe)
    swe.set_defaults(func=run_eval_swebench)

    tb = benchmarks.add_parser(
        "terminal-bench", help="Terminal-Bench tasks (local sandboxes, or the official harbor / tb harness)",
        description="Runs Terminal-Bench tasks with the model as the endpoint. The shipped offline tasks (Harbor "
                    "format) run in local sandboxes graded by their own tests; datasets need harbor or tb + Docker.")
    tb.add_argument("--tasks", default="offline", help="'offline', a folder of Harbor tasks, or a dataset name")
    tb.add_argument("--task-names", nargs="+", default=None)
    tb.add_argument("--harness", choices=["auto", "local", "harbor", "tb"], default="auto")
    tb.add_argument("--sanity", action="store_true", help="grade the reference solutions and no-op runs only")
    _add_endpoint_args(tb)
    tb.set_defaults(func=run_eval_terminal)


def _agent_settings(args, endpoint):
    from .evaluation.agent import AgentSettings

    return AgentSettings(endpoint.base_url, endpoint.model, api_key=endpoint.api_key, step_limit=args.step_limit,
                         max_tokens=args.max_tokens, temperature=args.temperature,
                         command_timeout_s=args.command_timeout)


def _needs_endpoint(args) -> None:
    if not args.model_dir and not args.base_url:
        raise SystemExit("error: give --model-dir (a checkpoint to serve) or --base-url (a running server).")


def run_eval_swebench(args) -> int:
    from .evaluation.endpoint import model_endpoint
    from .evaluation.swebench_runner import run_swebench, sanity_check
    from .evaluation.tasksets import load_swebench_instances

    out = Path(args.output_dir)
    if args.sanity:
        runs = sanity_check(load_swebench_instances(args.dataset, args.split, args.instance_ids), out,
                            progress=not args.quiet)
        for name, run in runs.items():
            print(run.table + f"\nresults: {run.results_path}\n")
        ok = runs["gold"].pass_rate == 1.0 and runs["empty"].pass_rate == 0.0
        print(f"grader sanity: gold {runs['gold'].pass_rate:.0%}, empty {runs['empty'].pass_rate:.0%} -> "
              f"{'OK' if ok else 'FAILED'}")
        return 0 if ok else 1
    if args.predictions:
        run = run_swebench(None, out, None, args.dataset, args.split, args.instance_ids, args.predictions,
                           args.run_id, args.workers, progress=not args.quiet)
    else:
        _needs_endpoint(args)
        with model_endpoint(args.model_dir, args.base_url, args.model, args.api_key) as endpoint:
            run = run_swebench(endpoint, out, _agent_settings(args, endpoint), args.dataset, args.split,
                               args.instance_ids, None, args.run_id, args.workers, progress=not args.quiet)
    return _report(run)


def run_eval_terminal(args) -> int:
    from .evaluation.endpoint import model_endpoint
    from .evaluation.tasksets import terminal_task_dirs
    from .evaluation.terminal_runner import run_local, run_terminal_bench

    out = Path(args.output_dir)
    if args.sanity:
        dirs = terminal_task_dirs(args.tasks, args.task_names)
        gold = run_local(dirs, out / "gold", None, None, mode="gold", label="terminal-sanity-gold",
                         progress=not args.quiet)
        empty = run_local(dirs, out / "empty", None, None, mode="empty", label="terminal-sanity-empty",
                          progress=not args.quiet)
        print(gold.table + "\n\n" + empty.table)
        ok = gold.pass_rate == 1.0 and empty.pass_rate == 0.0
        print(f"grader sanity: gold {gold.pass_rate:.0%}, empty {empty.pass_rate:.0%} -> {'OK' if ok else 'FAILED'}")
        return 0 if ok else 1
    _needs_endpoint(args)
    with model_endpoint(args.model_dir, args.base_url, args.model, args.api_key) as endpoint:
        run = run_terminal_bench(endpoint, out, _agent_settings(args, endpoint), args.tasks, args.task_names,
                                 args.harness, progress=not args.quiet)
    return _report(run)


def _report(run) -> int:
    if run.message:
        print(run.message, file=sys.stderr if not run.results else sys.stdout)
    if run.table:
        print(run.table)
    if run.results_path:
        print(f"results: {run.results_path}")
    return 0 if run.results or not run.message else 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-bdlm", description="Block diffusion LMs on the Hugging Face stack.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_serve_parser(subparsers)
    add_eval_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ImportError as err:
        extra = "serve" if args.command == "serve" else "eval"
        print(f"error: {err} (install the extra: pip install \"hf-bdlm[{extra}]\")", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
