"""The paper's matched comparison as one command: the same DiffusionGemma fine-tuned once per block-parallel layout.

Each layout (by default csbp, the paper's CP baseline `cp-paper` and bp: baselines that compute the step with other
arithmetic than csbp's; `cp`, this project's balanced CP, on request) trains from the same seed, data order and token
budget, in the same processes, one after the other, into `<output_dir>/<layout>` (a rerun replaces its evaluations).
Every saved checkpoint (and the initial weights, step 0) is evaluated with `BDLMEvalCallback` (the shipped offline
SWE-bench tasks by default, optionally the terminal tasks) and, beside it, on held-out loss (the trainer's `eval_loss`)
and exact match. The records of every point, each layout's seconds per training step (median and range) with the
first layout's speed over each other (a tie where the ranges overlap), and one figure (each metric against step and
against training wall-clock, every layout) go to `results_dir`.

    # CPU, a tiny random DiffusionGemma, 2 processes (a few minutes)
    torchrun --nproc_per_node 2 recipes/dg_matched.py --config recipes/configs/dg_matched_cpu.yaml
    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml recipes/dg_matched.py \\
        --config recipes/configs/dg_matched_cpu.yaml                                          # the same
    # the paper's run: docs/diffusion_gemma.md, "The paper's matched comparison"

Arguments: :class:`MatchedArguments` below, plus those of `recipes/sft.py` (TRL's `ScriptArguments` with
`exact_match_examples`, `BDLMSFTConfig`, `ModelConfig`), from the YAML and the command line. `model_name_or_path:
tiny:diffusion_gemma` builds the tiny random model (:mod:`hf_bdlm.models.diffusion_gemma.tiny`) with the same weights
for every layout; anything else is a DiffusionGemma checkpoint, loaded afresh for every layout by the trainer.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trl import ModelConfig, TrlParser

from hf_bdlm import BDLMSFTConfig, BDLMSFTTrainer
from hf_bdlm.evaluation.callback import BDLMEvalCallback
from hf_bdlm.benchmarks.matched_comparison import MatchedRecorder, loss_agreement, plot_matched, speed_comparison, step_times
from hf_bdlm.train import SFTScriptArguments, load_datasets, resolve_model_path

TINY_MODEL = "tiny:diffusion_gemma"
PAPER_CP = "cp-paper"  # block_parallel_mode cp in the paper's baseline layout (block_parallel_cp_layout "paper")
LAYOUTS = ("csbp", PAPER_CP, "bp", "cp")


def layout_arguments(layout: str) -> list[str]:
    """The trainer arguments of one layout of the comparison."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r} in layouts; use any of {', '.join(LAYOUTS)} ({PAPER_CP}: the "
                         "paper's CP baseline).")
    if layout == PAPER_CP:
        return ["--block_parallel_mode", "cp", "--block_parallel_cp_layout", "paper"]
    return ["--block_parallel_mode", layout, "--block_parallel_cp_layout", "balanced"]


@dataclass
class MatchedArguments:
    r"""
    What the matched comparison adds to the SFT recipe's arguments.

    Parameters:
        layouts (`list[str]`, defaults to `["csbp", "cp-paper", "bp"]`):
            Layouts to train, in this order, each from the same start: `csbp`, `cp-paper` (the paper's CP baseline:
            `block_parallel_mode="cp"`, `block_parallel_cp_layout="paper"`), `bp`, `cp` (this project's balanced CP).
            The first is the reference the others' losses and speed are compared with.
        benchmarks (`list[str]`, defaults to `["swebench"]`):
            `BDLMEvalCallback` benchmarks run at every checkpoint: `swebench` (the shipped offline set) and/or
            `terminal-bench` (the shipped terminal tasks).
        eval_tasks (`list[str]`, *optional*):
            A subset of their tasks (instance ids / task names); all by default.
        eval_step_limit (`int`, defaults to 1), eval_max_tokens (`int`, defaults to 16):
            Agent budget per task and tokens per model call.
        held_out_examples (`int`, defaults to 64):
            Held-out examples the held-out loss is computed on (the first ones of the test split).
        exact_match_max_tokens (`int`, defaults to 8):
            Generation budget of each exact-match prompt.
        results_dir (`str`, *optional*):
            Where `dg_matched_records.json` and `dg_matched.png` go; defaults to `output_dir`.
        tiny_hidden_size (`int`, defaults to 32):
            Width of the tiny random model (`model_name_or_path: tiny:diffusion_gemma`).
    """

    layouts: list[str] = field(default_factory=lambda: ["csbp", PAPER_CP, "bp"],
                               metadata={"help": "Layouts to compare, the reference first: csbp, cp-paper (the "
                                                 "paper's CP baseline), bp, cp."})
    benchmarks: list[str] = field(default_factory=lambda: ["swebench"],
                                  metadata={"help": "swebench and/or terminal-bench, run at every checkpoint."})
    eval_tasks: list[str] | None = field(default=None, metadata={"help": "A subset of the benchmark's tasks."})
    eval_step_limit: int = field(default=1, metadata={"help": "Agent steps per task."})
    eval_max_tokens: int = field(default=16, metadata={"help": "Tokens per model call of the agent."})
    held_out_examples: int = field(default=64, metadata={"help": "Held-out examples of the held-out loss."})
    exact_match_max_tokens: int = field(default=8, metadata={"help": "Generation budget per exact-match prompt."})
    results_dir: str | None = field(default=None, metadata={"help": "Where the records and figure go."})
    tiny_hidden_size: int = field(default=32, metadata={"help": "Width of the tiny random DiffusionGemma."})


def make_parser() -> TrlParser:
    return TrlParser((MatchedArguments, SFTScriptArguments, BDLMSFTConfig, ModelConfig))


def _model_and_tokenizer(name: str, matched: MatchedArguments, training_args: BDLMSFTConfig, model_args: ModelConfig):
    """The tiny random model and its tokenizer, or (a checkpoint path, ``None``) for the trainer to load as
    `recipes/sft.py` does (the family's loader, the checkpoint's tokenizer or processor, `dtype` from the config)."""
    if name != TINY_MODEL:
        if model_args.dtype is not None:
            training_args.model_init_kwargs = {**(training_args.model_init_kwargs or {}), "dtype": model_args.dtype}
        return resolve_model_path(name), None
    from hf_bdlm.models.diffusion_gemma.tiny import tiny_diffusion_gemma, tiny_diffusion_gemma_tokenizer

    with training_args.main_process_first(local=True, desc="exporting the embedded tokenizer"):
        tokenizer = tiny_diffusion_gemma_tokenizer()
    return tiny_diffusion_gemma(tokenizer, seed=training_args.seed, hidden_size=matched.tiny_hidden_size), tokenizer


def train_layout(layout: str, argv: list[str], say) -> tuple[list[dict], dict]:
    """Fine-tune one layout; its points and a summary (seconds, final metrics)."""
    matched, script_args, training_args, model_args = make_parser().parse_args_and_config(args=argv)[:4]
    if training_args.save_strategy != "steps":
        raise ValueError(f"save_strategy must be 'steps' (every checkpoint is evaluated), got "
                         f"{training_args.save_strategy!r}; set save_steps to the evaluation cadence.")
    train, test = load_datasets(script_args)
    if test is None:
        raise ValueError(f"the dataset {script_args.dataset_name!r} has no held-out split "
                         f"({script_args.dataset_test_split!r}); the held-out loss needs one.")
    held_out = test.select(range(min(matched.held_out_examples, len(test))))
    n_exact = min(script_args.exact_match_examples, len(test)) if {"prompt", "answer"} <= set(test.column_names) else 0
    exact_examples = [test[i] for i in range(n_exact)]

    eval_dir = Path(training_args.output_dir) / "eval"
    if training_args.process_index == 0 and eval_dir.exists():
        shutil.rmtree(eval_dir)  # the agent's sandboxes must start empty: a rerun replaces the evaluations
    started = time.perf_counter()
    model, tokenizer = _model_and_tokenizer(model_args.model_name_or_path, matched, training_args, model_args)
    trainer = BDLMSFTTrainer(model, args=training_args, train_dataset=train, eval_dataset=held_out,
                             processing_class=tokenizer)
    plugin = trainer.plugin
    say(f"[{layout}] world {plugin.world_size} = {plugin.data_parallel_size} data-parallel x P "
        f"{plugin.block_parallel_size} ({plugin.mode}); {len(trainer.train_dataset)} training samples, "
        f"{len(held_out)} held-out, {len(exact_examples)} exact-match prompts, benchmarks {matched.benchmarks}")
    eval_callbacks = [BDLMEvalCallback(trainer, benchmark=b, tasks=matched.eval_tasks,
                                       output_dir=str(eval_dir / b),
                                       step_limit=matched.eval_step_limit, max_tokens=matched.eval_max_tokens,
                                       seed=training_args.seed)
                      for b in matched.benchmarks]
    recorder = MatchedRecorder(layout, matched.benchmarks, exact_examples, matched.exact_match_max_tokens,
                               seed=training_args.seed)
    for callback in [*eval_callbacks, recorder]:
        trainer.add_callback(callback)
    recorder.record_initial(trainer, eval_callbacks)
    tick = time.perf_counter()
    trainer.train()
    train_wall = time.perf_counter() - tick
    last_train = [p for p in recorder.points if p["kind"] == "train"][-1]
    last_checkpoint = [p for p in recorder.points if p["kind"] == "checkpoint"][-1]
    summary = {"steps": trainer.state.global_step, "wall_s": train_wall, "train_s": last_train["train_s"],
               "setup_s": tick - started, "final": last_checkpoint["metrics"],
               "final_train_loss": last_train["metrics"]["loss"]}
    say(f"[{layout}] {summary['steps']} steps in {train_wall:.0f}s ({summary['train_s']:.0f}s training); "
        f"final {summary['final']}")
    trainer.accelerator.wait_for_everyone()
    return recorder.points, summary


def main(argv: list[str] | None = None) -> dict | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    matched, _, training_args, _ = make_parser().parse_args_and_config(args=argv)[:4]
    for layout in matched.layouts:
        layout_arguments(layout)  # an unknown layout fails before any training
    if len(set(matched.layouts)) != len(matched.layouts):
        raise ValueError(f"layouts {matched.layouts} names a layout twice; each trains into <output_dir>/<layout>.")
    base_dir = Path(training_args.output_dir)
    is_main = int(os.environ.get("RANK", "0")) == 0
    say = print if is_main else (lambda *a, **k: None)
    # The held-out loss is measured at every checkpoint, on the trainer's own evaluation loop.
    cadence = ["--eval_strategy", "steps", "--eval_steps", str(training_args.save_steps)]
    points, summaries = [], {}
    for layout in matched.layouts:
        layout_argv = argv + cadence + layout_arguments(layout) + ["--output_dir", str(base_dir / layout)]
        layout_points, summaries[layout] = train_layout(layout, layout_argv, say)
        points += layout_points
    if not is_main:
        return None
    reference = matched.layouts[0]
    agreement = {other: loss_agreement(points, reference, other) for other in matched.layouts[1:]}
    speed = {other: speed_comparison(points, reference, other) for other in matched.layouts[1:]}
    for layout in matched.layouts:
        summaries[layout]["step_s"] = step_times(points, layout).as_record()
    results_dir = Path(matched.results_dir or base_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    record = {"launch": " ".join(sys.argv), "arguments": {"matched": asdict(matched), "argv": argv},
              "world_size": int(os.environ.get("WORLD_SIZE", "1")), "layouts": matched.layouts,
              "summary": summaries, "loss_agreement": {f"{reference}_vs_{o}": a for o, a in agreement.items()},
              "speed": {f"{reference}_over_{o}": c for o, c in speed.items()}, "points": points}
    (results_dir / "dg_matched_records.json").write_text(json.dumps(record, indent=1))
    figure = plot_matched(points, results_dir / "dg_matched.png",
                          title=f"{' vs '.join(matched.layouts)}: same seed, data order and token budget")
    say(f"loss agreement ({reference} vs others): {agreement}")
    for layout in matched.layouts:
        say(f"[{layout}] seconds per training step: {step_times(points, layout).describe('.3f')}"
            + (f"; {reference} over it: {speed[layout]['describe']}" if layout in speed else ""))
    say(f"records and figure in {results_dir.resolve()} ({figure.name})")
    return record


if __name__ == "__main__":
    main()
