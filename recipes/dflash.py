"""Train a DFlash2 speculative drafter for a target causal LM, then measure what it buys: acceptance length and greedy
tokens/s with and without it, at batch 1, outputs identical.

    # the embedded CPU default: a drafter for SmolLM2-135M-Instruct on 2 CPU processes, csbp (see the config)
    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml recipes/dflash.py \\
        --config recipes/configs/dflash_smollm2_cpu.yaml
    # a smoke run in one process: any field overridden on the command line
    python recipes/dflash.py --config recipes/configs/dflash_smollm2_cpu.yaml --block_parallel_size 1 \\
        --train_prompts 16 --response_max_tokens 24 --max_steps 3 --eval_prompts 2 --eval_max_new_tokens 16
    # the fast-apply code edits: a drafter for the AR parent fine-tuned by recipes/ar_sft.py --dataset
    # hf_bdlm:fast_apply, trained on that parent's own answers to the training prompts
    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml recipes/dflash.py \\
        --config recipes/configs/dflash_smollm2_fast_apply_cpu.yaml

Stages (the data stages run once, cached in ``data_dir``; a rerun reuses what is there):

1. **responses**: the target's own greedy answers to ``train_prompts`` prompts of the dataset (a drafter learns to
   predict the target, so it trains on the target's outputs: self-distillation), ``data_dir/responses.jsonl``; every
   process answers its share of the prompts;
2. **features**: the target's hidden states at the drafter's layers over prompt + answer (``capture_features``),
   ``data_dir/features``; the loss covers the answers;
   The target's answers to the ``eval_prompts`` held-out prompts (one at a time, ``eval_max_new_tokens`` each: what
   the measurement decodes) are captured too, ``data_dir/eval_features``: the trainer's eval set;
3. **training**: a new drafter (``drafter_layers`` layers, initialised from the target's last layers) trained by
   `DFlashTrainer` on every process (each reads only its context rows of the features), saved to ``output_dir``;
   then its acceptance on the held-out capture as the trainer's eval counts it
   (:meth:`~hf_bdlm.models.dflash.training.trainer.DFlashTrainer.served_acceptance`, at the headline proposal count);
4. **measurement** (main process): ``eval_prompts`` held-out prompts decoded greedily by the target alone
   (``generate``) and with the drafter (``speculative_generate``) at each of ``eval_speculative_tokens`` proposals
   per target forward, ``eval_max_new_tokens`` each; the outputs must be identical.
   ``output_dir/dflash_results.json`` records, per proposal count, the acceptance length, both tokens/s and their
   ratio (the first count is the headline, ``speculative``), the training eval's acceptance beside the measured one
   (``acceptance``: equal where the features the decoding loop computes step by step choose the same proposals as
   the captured ones), and the time of every stage.

Arguments: :class:`DFlashRecipeArguments` below and :class:`~hf_bdlm.models.dflash.training.config.DFlashTrainingConfig`
(`target_model`, the objective's options, TRL's training fields, block parallelism), from the YAML and the command
line.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from trl import TrlParser

from hf_bdlm.models.dflash.training.config import DFlashTrainingConfig

RESPONSES = "responses.jsonl"
EVAL_RESPONSES = "eval_responses.jsonl"
# What the embedded CPU config aims at (block 8): tokens per target forward, and greedy tokens/s over the target alone.
GOAL_ACCEPTANCE, GOAL_SPEEDUP = 3.0, 1.8
# The fast-apply answers are mostly copied from the prompt: the drafter is asked for more there.
GOALS = {"hf_bdlm:fast_apply": (4.0, 1.8)}


@dataclass
class DFlashRecipeArguments:
    r"""
    What the recipe adds to `DFlashTrainingConfig`.

    Parameters:
        dataset_name (`str`, defaults to `"hf_bdlm:arith"`):
            The prompts: a shipped dataset, `hf_bdlm:arith` or `hf_bdlm:fast_apply` (train prompts for the data,
            held-out prompts for the measurement), or a dataset `datasets.load_dataset` reads with a conversational
            `prompt` column.
        train_prompts (`int`, defaults to `1024`):
            Prompts the target answers for the training data.
        response_max_tokens (`int`, defaults to `96`):
            Longest answer generated per prompt.
        generation_batch_size (`int`, defaults to `32`):
            Prompts per batched `generate` call (and records per capture forward).
        drafter_layers (`int`, defaults to `1`):
            The drafter's decoder layers.
        target_features (`int`, defaults to `3`):
            Target layers the drafter reads, spread by the serving engines' rule (`default_target_layer_ids`).
        drafter_init (`str`, defaults to `"target_layers"`):
            `"target_layers"` (copies of the target's last layers) or `"scratch"`.
        drafter_block_size (`int`, defaults to `8`):
            Tokens per draft block, the anchor included.
        selector_rank (`int`, defaults to `64`):
            Rank of the candidate selector's two `vocabulary x rank` codebooks (the published drafters' 256 makes
            them 25M parameters for a 49K vocabulary, most of a small drafter's optimizer step).
        data_dir (`str`, *optional*):
            Where the answers and features are cached; defaults to `<output_dir>/data`.
        eval_prompts (`int`, defaults to `20`), eval_max_new_tokens (`int`, defaults to `96`):
            The measurement: held-out prompts, decoded one at a time, and the new tokens of each.
        eval_speculative_tokens (`list[int]`, *optional*):
            The proposal counts measured (``num_speculative_tokens``: proposals the target verifies per forward,
            ``1 .. block - 1``), the first one the headline; default ``[block - 1]``.
        main_process_threads (`int`, defaults to `0`):
            Threads of the stages the main process runs alone (answers, features, measurement); `0`: every core.
            On a machine other work also loads, 1 avoids multithreaded matrix products stalling on busy cores.
    """

    dataset_name: str = field(default="hf_bdlm:arith", metadata={
        "help": "'hf_bdlm:arith', 'hf_bdlm:fast_apply' or a local dataset."})
    train_prompts: int = field(default=1024, metadata={"help": "Prompts the target answers for the training data."})
    response_max_tokens: int = field(default=96, metadata={"help": "Longest generated answer."})
    generation_batch_size: int = field(default=32, metadata={"help": "Prompts per generate / capture call."})
    drafter_layers: int = field(default=1, metadata={"help": "Decoder layers of the drafter."})
    target_features: int = field(default=3, metadata={"help": "Target layers the drafter reads."})
    drafter_init: str = field(default="target_layers", metadata={"help": "'target_layers' or 'scratch'."})
    drafter_block_size: int = field(default=8, metadata={"help": "Tokens per draft block."})
    selector_rank: int = field(default=64, metadata={"help": "Rank of the candidate selector's codebooks."})
    data_dir: str | None = field(default=None, metadata={"help": "Cache of answers and features."})
    eval_prompts: int = field(default=20, metadata={"help": "Held-out prompts of the measurement."})
    eval_max_new_tokens: int = field(default=96, metadata={"help": "New tokens per measured prompt."})
    eval_speculative_tokens: list[int] = field(default_factory=list, metadata={
        "help": "Proposals verified per target forward, each measured (default: block - 1); the first is the headline."})
    main_process_threads: int = field(default=0, metadata={"help": "Threads of the main process's own stages (0: "
                                                                   "every core)."})


def make_parser(subparsers=None) -> TrlParser:
    dataclass_types = (DFlashRecipeArguments, DFlashTrainingConfig)
    if subparsers is not None:
        return subparsers.add_parser("dflash", help="train and measure a DFlash drafter",
                                     dataclass_types=dataclass_types)
    return TrlParser(dataclass_types)


# --- data ----------------------------------------------------------------------------------------------------------
def load_prompts(name: str):
    """``(train prompts, held-out prompts)``: lists of chat messages."""
    if name.startswith("hf_bdlm:"):
        from hf_bdlm.data import load_splits

        train, test = load_splits(name)
        return [r["prompt"] for r in train], [r["prompt"] for r in test]
    from datasets import load_dataset

    loaded = load_dataset(name)
    train = [r["prompt"] for r in loaded["train"]]
    test = [r["prompt"] for r in loaded["test"]] if "test" in loaded else train[-64:]
    return train, test


def prompt_ids(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def eos_ids(target, tokenizer) -> list[int]:
    eos = target.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    return eos or [tokenizer.eos_token_id]


@torch.inference_mode()
def generate_responses(target, tokenizer, prompts, path: Path, *, max_tokens: int, batch_size: int) -> list[dict]:
    """The target's greedy answers (left-padded batches), appended to ``path`` as they come: ``{"input_ids":
    prompt + answer, "loss_mask": 0 on the prompt, 1 on the answer (its EOS included)}``. Resumes a partial file."""
    done = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    stops, pad = set(eos_ids(target, tokenizer)), tokenizer.pad_token_id
    pad = pad if pad is not None else next(iter(stops))
    with open(path, "a", encoding="utf-8") as out:
        for start in range(len(done), len(prompts), batch_size):
            batch = [prompt_ids(tokenizer, p) for p in prompts[start : start + batch_size]]
            width = max(len(ids) for ids in batch)
            input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in batch])
            attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch])
            new = target.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=max_tokens,
                                  do_sample=False, pad_token_id=pad)[:, width:]
            for ids, answer in zip(batch, new.tolist()):
                cut = next((i + 1 for i, t in enumerate(answer) if t in stops), len(answer))
                record = {"input_ids": ids + answer[:cut], "loss_mask": [0] * len(ids) + [1] * cut}
                out.write(json.dumps(record) + "\n")
                done.append(record)
            out.flush()
    return done


def answer_prompts(target, tokenizer, recipe: DFlashRecipeArguments, data_dir: Path, state) -> list[dict]:
    """The records of ``data_dir/responses.jsonl``, written first if missing: each process answers every
    ``world``-th prompt into its own part file (resumable), then the main process merges them in prompt order."""
    path = data_dir / RESPONSES
    if path.is_file():
        return [json.loads(line) for line in path.read_text().splitlines()]
    prompts, _ = load_prompts(recipe.dataset_name)
    prompts = prompts[: recipe.train_prompts]
    world, rank = state.num_processes, state.process_index
    parts = [data_dir / f"responses.part{r}-of-{world}.jsonl" for r in range(world)]
    with main_process_threads(recipe.main_process_threads if world == 1 else torch.get_num_threads()):
        generate_responses(target, tokenizer, prompts[rank::world], parts[rank], max_tokens=recipe.response_max_tokens,
                           batch_size=recipe.generation_batch_size)
    state.wait_for_everyone()
    if state.is_main_process:
        shares = [part.read_text().splitlines() for part in parts]
        lines = [shares[i % world][i // world] for i in range(len(prompts))]
        temporary = path.with_name(f".{path.name}.tmp")
        temporary.write_text("".join(line + "\n" for line in lines))
        os.replace(temporary, path)
        for part in parts:
            part.unlink()
    state.wait_for_everyone()
    return [json.loads(line) for line in path.read_text().splitlines()]


@contextlib.contextmanager
def main_process_threads(count: int):
    """``count`` threads (0: every core) for a stage the main process runs while the other ranks wait (under a
    launcher each rank holds one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(count or os.cpu_count() or threads)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# --- the measurement -----------------------------------------------------------------------------------------------
@torch.inference_mode()
def measure(target, drafter, tokenizer, prompts, *, max_new_tokens: int, speculative_tokens=(),
            goal: tuple[float, float] = (GOAL_ACCEPTANCE, GOAL_SPEEDUP)) -> list[dict]:
    """Greedy decoding of each prompt alone, by the target and with the drafter at each of ``speculative_tokens``
    proposals per target forward (default: ``B - 1``): per count, the acceptance length, tokens/s of each and their
    ratio, measured prompt by prompt side by side, against ``goal`` (acceptance length, speed-up); raises when an
    output differs (speculative decoding is lossless)."""
    from hf_bdlm.models.dflash.inference.speculative import speculative_generate, speculative_token_count

    block = int(drafter.config.block_size)
    counts = [speculative_token_count(k, block) for k in (speculative_tokens or [None])]
    drafter.eval()
    encoded = [torch.tensor([prompt_ids(tokenizer, p)]) for p in prompts]
    target.generate(encoded[0], do_sample=False, max_new_tokens=4)  # warm-up (first-call allocations)
    speculative_generate(target, drafter, encoded[0], max_new_tokens=4)
    plain_s, tokens = 0.0, 0
    spec_s, verified, accepted = [0.0] * len(counts), [0] * len(counts), [0.0] * len(counts)
    for ids in encoded:
        tick = time.perf_counter()
        plain = target.generate(ids, do_sample=False, max_new_tokens=max_new_tokens)
        plain_s += time.perf_counter() - tick
        tokens += plain.shape[1] - ids.shape[1]
        for i, count in enumerate(counts):
            tick = time.perf_counter()
            fast, stats = speculative_generate(target, drafter, ids, max_new_tokens=max_new_tokens,
                                               num_speculative_tokens=count)
            spec_s[i] += time.perf_counter() - tick
            if not torch.equal(fast, plain):
                raise RuntimeError(f"speculative decoding changed the output of a prompt ({ids.shape[1]} tokens, "
                                   f"{count} proposals per forward): {fast[0, ids.shape[1]:].tolist()} vs "
                                   f"{plain[0, ids.shape[1]:].tolist()}")
            forwards = stats.target_forwards - 1  # the prefill proposes nothing
            verified[i] += forwards
            accepted[i] += stats.mean_acceptance_length * forwards
    results = []
    for i, count in enumerate(counts):
        acceptance, speedup = accepted[i] / max(verified[i], 1), plain_s / spec_s[i]
        results.append({
            "prompts": len(encoded), "new_tokens": tokens, "max_new_tokens": max_new_tokens,
            "acceptance_length": acceptance, "block_size": block, "num_speculative_tokens": count,
            "target_tokens_per_s": tokens / plain_s, "speculative_tokens_per_s": tokens / spec_s[i],
            "speedup": speedup, "outputs_identical": True, "threads": torch.get_num_threads(),
            "goal": {"acceptance_length": goal[0], "speedup": goal[1],
                     "met": acceptance >= goal[0] and speedup >= goal[1]}})
    return results


# --- the recipe ----------------------------------------------------------------------------------------------------
def main(recipe: DFlashRecipeArguments, args: DFlashTrainingConfig) -> dict:
    from accelerate import PartialState
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_bdlm.models.dflash.training.capture import capture_features
    from hf_bdlm.models.dflash.configuration import default_target_layer_ids
    from hf_bdlm.models.dflash.target import resolve_target_path
    from hf_bdlm.models.dflash.modeling import DFlash2DraftModel
    from hf_bdlm.models.dflash.training.trainer import DFlashTrainer

    if not args.target_model:
        raise ValueError("target_model is required (a folder, a Hub id or 'embedded:smollm2').")
    start, timings = time.perf_counter(), {}
    state = PartialState()
    say = print if state.is_main_process else (lambda *a, **k: None)
    data_dir = Path(recipe.data_dir or Path(args.output_dir) / "data")
    with state.main_process_first():
        path = resolve_target_path(args.target_model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)
    text = target.config.get_text_config()
    layer_ids = default_target_layer_ids(int(text.num_hidden_layers), recipe.target_features)
    features = data_dir / "features"

    # 1-2. The target's answers (every process answers its share of the prompts), then their features (the main
    # process; the others wait).
    data_dir.mkdir(parents=True, exist_ok=True)
    tick = time.perf_counter()
    records = answer_prompts(target, tokenizer, recipe, data_dir, state)
    timings["responses_s"] = time.perf_counter() - tick
    with state.main_process_first():
        if state.is_main_process:
            tick = time.perf_counter()
            with main_process_threads(recipe.main_process_threads):
                capture_features(target, records, layer_ids=layer_ids, out_dir=features,
                                 batch_size=max(1, recipe.generation_batch_size // 4), target_id=args.target_model,
                                 progress=not args.disable_tqdm)
            timings["features_s"] = time.perf_counter() - tick
            answered = sum(r["loss_mask"].count(1) for r in records)
            say(f"[1/3] data: {len(records)} answers of {args.target_model} ({answered} tokens), features of layers "
                f"{list(layer_ids)} in {data_dir} ({timings['responses_s']:.0f}s + {timings['features_s']:.0f}s)")

    # The held-out prompts' answers, one prompt at a time as the measurement decodes them, and their features: the
    # trainer's eval set, on which it counts the acceptance serving reaches.
    _, held_out = load_prompts(recipe.dataset_name)
    held_out = held_out[: recipe.eval_prompts]
    eval_features = data_dir / "eval_features"
    with state.main_process_first():
        if state.is_main_process:
            with main_process_threads(recipe.main_process_threads):
                eval_records = generate_responses(target, tokenizer, held_out, data_dir / EVAL_RESPONSES,
                                                  max_tokens=recipe.eval_max_new_tokens, batch_size=1)
                capture_features(target, eval_records, layer_ids=layer_ids, out_dir=eval_features,
                                 batch_size=max(1, recipe.generation_batch_size // 4), target_id=args.target_model,
                                 progress=not args.disable_tqdm)

    # 3. Training: every process, each reading its own context rows.
    torch.manual_seed(args.seed)
    drafter = DFlash2DraftModel.from_target(target, init=recipe.drafter_init, num_hidden_layers=recipe.drafter_layers,
                                            target_layer_ids=layer_ids, block_size=recipe.drafter_block_size,
                                            selector_rank=recipe.selector_rank)
    if recipe.eval_speculative_tokens and args.eval_num_speculative_tokens is None:
        args.eval_num_speculative_tokens = recipe.eval_speculative_tokens[0]  # the headline count, as measured
    trainer = DFlashTrainer(drafter, args, train_dataset=str(features), eval_dataset=str(eval_features),
                            processing_class=tokenizer,
                            target=args.target_model)  # embedding and head only: every rank binds the same heads
    trainer.model_card_info["dataset"] = (f"{recipe.dataset_name}: the target's own greedy answers to {len(records)} "
                                          "training prompts")
    plugin = trainer.plugin
    say(f"[2/3] training a {recipe.drafter_layers}-layer DFlash2 drafter (block {recipe.drafter_block_size}, "
        f"{sum(p.numel() for p in drafter.parameters()):,} parameters): world {plugin.world_size} = "
        f"{plugin.data_parallel_size} data-parallel x P {plugin.block_parallel_size} ({plugin.mode}), "
        f"{len(trainer.train_dataset)} sequences, {args.max_steps} steps")
    tick = time.perf_counter()
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    timings["train_s"] = time.perf_counter() - tick
    steps = trainer.state.global_step
    results = {"train_loss": result.training_loss, "steps": steps,
               "seconds_per_step": timings["train_s"] / max(steps, 1),
               "parallel": {"world": plugin.world_size, "P": plugin.block_parallel_size, "mode": str(plugin.mode)}}
    say(f"      {steps} steps in {timings['train_s']:.0f}s ({results['seconds_per_step']:.2f}s/step), "
        f"mean loss {result.training_loss:.3f}")
    tick = time.perf_counter()
    evaluated = trainer.served_acceptance()  # every process replays its share of the held-out records
    timings["eval_acceptance_s"] = time.perf_counter() - tick
    results["acceptance"] = {"training_eval": evaluated.acceptance_length,
                             "verification_steps": evaluated.verification_steps,
                             "num_speculative_tokens": args.eval_num_speculative_tokens or recipe.drafter_block_size - 1}

    # 4. The measurement, on the main process, with the whole target bound.
    if state.is_main_process:
        drafter.bind_target(target)
        tick = time.perf_counter()
        with main_process_threads(recipe.main_process_threads):
            sweep = measure(target, drafter, tokenizer, held_out, max_new_tokens=recipe.eval_max_new_tokens,
                            speculative_tokens=recipe.eval_speculative_tokens,
                            goal=GOALS.get(recipe.dataset_name, (GOAL_ACCEPTANCE, GOAL_SPEEDUP)))
        timings["measure_s"] = time.perf_counter() - tick
        results["speculative"], results["speculative_sweep"] = sweep[0], sweep
        spec = sweep[0]
        say(f"[3/3] {spec['prompts']} held-out prompts, {spec['new_tokens']} tokens, outputs identical; target alone "
            f"{spec['target_tokens_per_s']:.1f} tokens/s")
        for row in sweep:
            say(f"      {row['num_speculative_tokens']} proposals per forward (block {row['block_size']}): acceptance "
                f"length {row['acceptance_length']:.2f}, {row['speculative_tokens_per_s']:.1f} tokens/s "
                f"({row['speedup']:.2f}x)")
        results["acceptance"]["served"] = spec["acceptance_length"]
        say(f"      acceptance length on the held-out prompts: {evaluated.acceptance_length:.3f} by the training eval "
            f"(captured features), {spec['acceptance_length']:.3f} decoded")
        trainer.model_card_info["results"] = {"acceptance_length": round(spec["acceptance_length"], 3),
                                              "eval_acceptance_length": round(evaluated.acceptance_length, 3),
                                              "eval_verification_steps": evaluated.verification_steps}
    state.wait_for_everyone()
    trainer.save_model(args.output_dir)
    if state.is_main_process:
        results["timings"] = {**timings, "total_s": time.perf_counter() - start}
        out = Path(args.output_dir) / "dflash_results.json"
        out.write_text(json.dumps(results, indent=2))
        say(f"saved the drafter and {out.name} to {Path(args.output_dir).resolve()}; serve it with `hf-bdlm serve "
            f"TARGET --draft {args.output_dir}` or export it: `hf-bdlm dflash export {args.output_dir} --out DIR "
            f"--target ID`")
    return results


def run(argv: list[str] | None = None) -> dict:
    """Parse ``argv`` (default: the command line) with :func:`make_parser` and run :func:`main`."""
    recipe, args = make_parser().parse_args_and_config(args=argv)[:2]
    return main(recipe, args)


if __name__ == "__main__":
    run()
