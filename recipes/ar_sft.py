"""The AR baseline of the decoding study: the parent causal LM fine-tuned like for like with TRL's `SFTTrainer`.

Like for like with a block-diffusion recipe's YAML (``--config``), read from that file rather than repeated here: the
same data (conversational prompt/completion, loss on the completion only), the same number of steps, sequences per
step (the BDLM's 2 processes form one block-parallel group of P = 2, which shares each batch: per step
``per_device_train_batch_size x gradient_accumulation_steps x world / P`` sequences, one process taking them here),
sequence length, learning rate, schedule, warmup, weight decay, seed and activation checkpointing, so that
``hf-bdlm bench --only decoding`` compares decoding speeds at a fair quality:

    # the arithmetic tasks, like recipes/configs/smollm2_cpu_csbp.yaml (the default)
    python recipes/ar_sft.py --output_dir outputs/smollm2-135m-ar-sft
    # the fast-apply code edits, like recipes/configs/smollm2_cpu_fast_apply.yaml (the config the dataset names)
    python recipes/ar_sft.py --dataset hf_bdlm:fast_apply

``--dataset`` alone picks the shipped YAML of that dataset (:data:`CONFIGS`), ``--config`` alone takes the dataset
the YAML names; ``--max_steps 150`` for the 150-step arithmetic recipes. The model is saved with its tokenizer, a
model card (TRL's, naming the dataset and the BDLM config it matches) and ``sft_results.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

RECIPES = Path(__file__).resolve().parent
CONFIGS = {"hf_bdlm:arith": RECIPES / "configs/smollm2_cpu_csbp.yaml",
           "hf_bdlm:fast_apply": RECIPES / "configs/smollm2_cpu_fast_apply.yaml"}
LAUNCH = RECIPES / "accelerate/cpu_2proc.yaml"  # the BDLM recipes' launch: its process count is the world
OUTPUTS = {"hf_bdlm:arith": "outputs/smollm2-135m-ar-sft", "hf_bdlm:fast_apply": "outputs/smollm2-135m-ar-fast-apply"}


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="embedded:smollm2", help="a causal-LM folder or embedded:smollm2")
    p.add_argument("--config", type=Path, default=None,
                   help="the block-diffusion recipe's YAML this run matches (default: the shipped one of --dataset, "
                        f"else {CONFIGS['hf_bdlm:arith'].relative_to(RECIPES.parent)})")
    p.add_argument("--dataset", default=None, help="hf_bdlm:arith, hf_bdlm:fast_apply or a local dataset "
                                                   "(default: the config's dataset_name)")
    p.add_argument("--launch_config", type=Path, default=LAUNCH,
                   help="the BDLM run's accelerate config (its num_processes is the world; default: %(default)s)")
    p.add_argument("--output_dir", default=None, help="default: outputs/smollm2-135m-ar-sft for hf_bdlm:arith, "
                                                      "outputs/smollm2-135m-ar-fast-apply for hf_bdlm:fast_apply")
    p.add_argument("--max_steps", type=int, default=None, help="default: the config's")
    p.add_argument("--batch_size", type=int, default=None,
                   help="sequences per step (default: the config's, per_device_train_batch_size x "
                        "gradient_accumulation_steps x world / block_parallel_size)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    return p


def settings(args: argparse.Namespace) -> dict:
    """The run's effective settings: the BDLM YAML's, then the command line's overrides; ``sequences_per_step`` is
    what one step of the BDLM run takes, one process taking them all here."""
    import yaml

    config = args.config or CONFIGS.get(args.dataset or "hf_bdlm:arith")
    if config is None:
        raise SystemExit(f"--dataset {args.dataset}: name the block-diffusion recipe's YAML to match with --config")
    bdlm = yaml.safe_load(Path(config).read_text())
    world = int(yaml.safe_load(Path(args.launch_config).read_text())["num_processes"])
    group = int(bdlm.get("block_parallel_size", 1))
    if world % group:
        raise SystemExit(f"{config}: block_parallel_size {group} does not divide the launch's {world} processes")
    per_step = (int(bdlm["per_device_train_batch_size"]) * int(bdlm.get("gradient_accumulation_steps", 1))
                * world // group)
    dataset = args.dataset or bdlm["dataset_name"]
    return dict(
        config=str(config), dataset=dataset, output_dir=args.output_dir or OUTPUTS.get(dataset, "outputs/ar-sft"),
        max_steps=args.max_steps if args.max_steps is not None else int(bdlm["max_steps"]),
        sequences_per_step=args.batch_size if args.batch_size is not None else per_step,
        max_length=int(bdlm["max_length"]), learning_rate=float(bdlm["learning_rate"]),
        lr_scheduler_type=bdlm["lr_scheduler_type"], warmup_steps=int(bdlm.get("warmup_steps", 0)),
        weight_decay=float(bdlm.get("weight_decay", 0.0)), seed=int(bdlm.get("seed", 42)),
        activation_checkpointing=bool(bdlm.get("activation_checkpointing", True)),
        logging_steps=int(bdlm.get("logging_steps", 10)))


def like_for_like_section(run: dict, loss: float) -> str:
    """The model card's section saying which block-diffusion run this one matches, and how."""
    return (f"\n## Like for like\n\nThe autoregressive baseline of a block-diffusion fine-tune (hf_bdlm's "
            f"`recipes/ar_sft.py`), trained on the same data and budget as `{Path(run['config']).name}`: dataset "
            f"`{run['dataset']}` (loss on the completions), {run['max_steps']} steps of {run['sequences_per_step']} "
            f"sequences, max_length {run['max_length']}, learning rate {run['learning_rate']:g} "
            f"({run['lr_scheduler_type']}, {run['warmup_steps']} warmup steps), weight decay {run['weight_decay']:g}, "
            f"seed {run['seed']}. Mean training loss {loss:.4f}.\n")


def main(argv: list[str] | None = None) -> dict:
    args = make_parser().parse_args(argv)
    run = settings(args)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from hf_bdlm.data import load_splits
    from hf_bdlm.hub.exports import serving_model_id
    from hf_bdlm.train import resolve_model_path

    if args.threads:
        torch.set_num_threads(args.threads)
    folder = resolve_model_path(args.model)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = SFTConfig(output_dir=run["output_dir"], max_steps=run["max_steps"],
                       per_device_train_batch_size=run["sequences_per_step"], gradient_accumulation_steps=1,
                       learning_rate=run["learning_rate"], lr_scheduler_type=run["lr_scheduler_type"],
                       warmup_steps=run["warmup_steps"], weight_decay=run["weight_decay"],
                       max_length=run["max_length"], seed=run["seed"], logging_steps=run["logging_steps"],
                       gradient_checkpointing=run["activation_checkpointing"], save_strategy="no", report_to="none",
                       bf16=False, completion_only_loss=True)
    train, _ = load_splits(run["dataset"])
    trainer = SFTTrainer(model=model, args=config, train_dataset=train, processing_class=tokenizer)
    tick = time.perf_counter()
    result = trainer.train()
    trainer.save_model(run["output_dir"])
    tokenizer.save_pretrained(run["output_dir"])
    # TRL's card: the base model by its Hub id (the embedded SmolLM2's, not the local export folder), the quick start
    # by the folder's name (the repository id once pushed); the shipped dataset is no Hub dataset, so it is named in
    # the card's own section rather than linked
    model.config._name_or_path = serving_model_id(args.model)
    trainer.hub_model_id = Path(run["output_dir"]).name
    trainer.create_model_card(model_name=Path(run["output_dir"]).name, tags=["hf_bdlm", "ar-baseline"])
    card = Path(run["output_dir"]) / "README.md"
    card.write_text(card.read_text() + like_for_like_section(run, result.training_loss))
    results = dict(train_loss=result.training_loss, steps=trainer.state.global_step,
                   train_s=time.perf_counter() - tick, sequences=trainer.state.global_step * run["sequences_per_step"],
                   settings=run)
    (Path(run["output_dir"]) / "sft_results.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
