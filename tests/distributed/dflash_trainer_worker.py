"""Worker for tests/models/dflash/test_trainer.py: DFlashTrainer runs under torchrun (gloo), and the tiny fixtures
they share.

    torchrun --nproc_per_node 1 tests/distributed/dflash_trainer_worker.py --scenario reference --out /tmp/d
    torchrun --nproc_per_node 2 tests/distributed/dflash_trainer_worker.py --scenario parallel --out /tmp/d

Every run trains a tiny DFlash2 drafter (or a DFlash one) for a tiny random Llama target, for 3 SGD steps, from
the features in ``<out>/features`` (``capture(out)``: by rank 0 at the start unless they are there already), on the
same global batch of 4 sequences per step:

- ``reference`` (1 rank): one process, batch 4;
- ``parallel`` (2 ranks): data parallel (2 replicas of batch 2) and, when the sharded forward exists, one
  block-parallel group of P = 2 (batch 4) in each of csbp, cp and bp.

Each rank writes ``<scenario>_rank<r>.json`` with the logged losses per run; rank 0 also the final weights
(``<out>/<run>/weights.pt``).
"""

from __future__ import annotations

import argparse
import functools
import os
from pathlib import Path

import fixtures
import torch
import torch.distributed as dist

from shared_launch import join_process_group, leave_process_group, record_rank_result
from trainer_common import tiny_tokenizer, vocab_size

STEPS = 3
FIRST_TOKEN = 7  # ids below are the tokenizer's specials and chat words
LAYER_IDS = (1, 3)


# A random Llama of 4 layers over the tiny tokenizer's vocabulary (float32, frozen), with a head that separates tokens
# (initializer_range 0.02 leaves every softmax nearly flat).
tiny_target = functools.partial(fixtures.tiny_target, "llama", vocab_size=vocab_size(), num_hidden_layers=4,
                                head_dim=8, pad_token_id=0, bos_token_id=2, eos_token_id=3,
                                max_position_embeddings=256, head_std=0.2, frozen=True)


def progression_records(count: int = 16, seed: int = 0) -> list[dict]:
    """Sequences a drafter can learn: a few prompt tokens, then consecutive ids from a random start (the loss
    mask covers the progression)."""
    generator = torch.Generator().manual_seed(seed)
    span = vocab_size() - FIRST_TOKEN
    records = []
    for _ in range(count):
        length = int(torch.randint(14, 30, (1,), generator=generator))
        prompt = torch.randint(FIRST_TOKEN, vocab_size(), (3,), generator=generator).tolist()
        start = int(torch.randint(span, (1,), generator=generator))
        body = [FIRST_TOKEN + (start + k) % span for k in range(length - 3)]
        records.append({"input_ids": prompt + body, "loss_mask": [0] * 3 + [1] * len(body)})
    return records


def capture(out: Path, target=None, layer_ids=LAYER_IDS, records=None) -> Path:
    from hf_bdlm.models.dflash.training.capture import capture_features

    folder = out / "features"
    capture_features(target if target is not None else tiny_target(), records or progression_records(),
                     layer_ids=layer_ids, out_dir=folder, progress=False, target_id="tiny-llama")
    return folder


# A 1-layer drafter (block 4) reading target layers 1 and 3, freshly initialised from ``seed`` (default 1).
tiny_drafter = functools.partial(fixtures.tiny_drafter, num_hidden_layers=1, target_layer_ids=LAYER_IDS, block_size=4,
                                 mask_token_id=4, dflash2_fields=dict(selector_rank=8, selector_top_k=4,
                                                                      conv_group_size=8))


def config(out: Path, **overrides):
    from hf_bdlm.models.dflash.training.config import DFlashTrainingConfig

    values = dict(output_dir=str(out), report_to="none", max_steps=STEPS, logging_steps=1,
                  per_device_train_batch_size=4, optim="sgd", learning_rate=0.5, lr_scheduler_type="constant",
                  save_strategy="no", disable_tqdm=True, seed=3, max_anchors=8, dflash_loss="dpace")
    values.update(overrides)
    return DFlashTrainingConfig(**values)


def train(out: Path, features: Path, target, dflash2: bool | str = True, **overrides) -> dict:
    from hf_bdlm.models.dflash.training.trainer import DFlashTrainer

    drafter = tiny_drafter(target, dflash2 is not False, **DRAFTERS.get(dflash2, {}))
    trainer = DFlashTrainer(drafter, config(out, **overrides), train_dataset=str(features), target=target,
                            processing_class=tiny_tokenizer())
    trainer.train()
    history = [h for h in trainer.state.log_history if "loss" in h]
    result = {"steps": [h["step"] for h in history], "losses": [h["loss"] for h in history],
              "accuracy": [h.get("mean_token_accuracy") for h in history]}
    if trainer.is_world_process_zero():
        path = out / "weights.pt"
        torch.save({n: p.detach().clone() for n, p in trainer.model.named_parameters()}, path)
        result["weights"] = str(path)
    return result


# Runs: name -> (drafter kind, config overrides, layouts); 4 sequences per step everywhere. "dp": 2 data-parallel
# replicas of 2 sequences; a mode: one block-parallel group of P = 2.
MODES = ("csbp", "cp", "bp")
# "sliding": a DFlash2 drafter whose layers all slide (window 5): each rank projects and reads only the feature rows its
# ring's anchors see, in ranges balanced by those rows (the compact context).
DRAFTERS = {"sliding": dict(num_hidden_layers=2, layer_types=["sliding_attention"] * 2, sliding_window=5)}
RUNS = {
    "dpace": (True, {}, ("dp", *MODES)),
    "ce": (True, dict(dflash_loss="ce"), ("dp", "csbp", "cp")),
    "dflash_ce": (False, dict(dflash_loss="ce"), ("csbp",)),  # a DFlash drafter (no convolutions, no selector)
    "sliding": ("sliding", {}, ("csbp", "cp", "bp")),
}


def sharded_forward_exists() -> bool:
    import importlib.util

    return importlib.util.find_spec("hf_bdlm.models.dflash.training.sharded") is not None


def scenario_reference(out: Path, features: Path, target) -> dict:
    return {f"{name}/p1": train(out / name / "p1", features, target, kind, **kw)
            for name, (kind, kw, _) in RUNS.items()}


def scenario_parallel(out: Path, features: Path, target) -> dict:
    results = {}
    for name, (kind, kw, layouts) in RUNS.items():
        for layout in layouts:
            if layout == "dp":
                results[f"{name}/dp"] = train(out / name / "dp", features, target, kind, per_device_train_batch_size=2,
                                              **kw)
            elif sharded_forward_exists():
                results[f"{name}/{layout}"] = train(out / name / layout, features, target, kind, block_parallel_size=2,
                                                    block_parallel_mode=layout, **kw)
    return results


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", required=True, choices=["reference", "parallel"])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # Under torchrun: the default process group (the shared launch's, or one the trainers' Accelerate then uses).
    started = join_process_group() if "WORLD_SIZE" in os.environ else False
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    features = out / "features"
    target = tiny_target()
    rank = dist.get_rank() if dist.is_initialized() else 0
    if not features.exists() and rank == 0:  # unless the test captured them before the launch
        capture(out, target)
    if dist.is_initialized():
        dist.barrier()
    scenario = {"reference": scenario_reference, "parallel": scenario_parallel}[args.scenario]
    record_rank_result(out, f"{args.scenario}_", lambda: scenario(out, features, target))
    leave_process_group(started)

if __name__ == "__main__":
    main()
