"""Worker for tests/attention/test_reference_semantics.py: sharded sliding-window attention under both window
conventions.

    torchrun --nproc_per_node 2 tests/distributed/window_convention_worker.py --out /tmp/windows.json

A Gemma 3 BDLM (sliding + full layers) with a window smaller and larger than the block size; for each convention
(``per_query``, ``block_start``), clean stream and mode (``cp``, ``csbp``), every rank runs its rows of the sharded
layout, whose window exchange fetches only the clean keys the rule's windows reach; the group's loss and gradients
must equal the single-process reference.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from flat_reduce import all_reduce_flat
from shared_launch import join_process_group, leave_process_group
from transformers import Gemma3TextConfig

from hf_bdlm import BlockDiffusionConfig, BlockDiffusionForMaskedLM
from hf_bdlm.objectives import get_objective
from hf_bdlm.parallel.collectives import ByteMeter
from hf_bdlm.parallel.plan import ParallelDims, PlanConfig
from hf_bdlm.parallel import BlockParallelGroups, ShardedLayout

VOCAB, MASK, L, B = 64, 63, 64, 4


def run_case(case: dict, groups: BlockParallelGroups) -> dict:
    torch.manual_seed(0)
    backbone = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=8, intermediate_size=48, sliding_window=case["window"],
                                layer_types=["sliding_attention", "full_attention"])
    cfg = BlockDiffusionConfig(backbone_config=backbone, block_size=B, mask_token_id=MASK,
                               clean_attention=case["clean"], sliding_window_convention=case["convention"])
    model = BlockDiffusionForMaskedLM(cfg).double()
    objective = get_objective("standard", cfg)
    g = torch.Generator().manual_seed(1)
    completion = torch.ones(2, L, dtype=torch.long)
    completion[:, :6] = 0
    batch = {"input_ids": torch.randint(1, MASK, (2, L), generator=g), "completion_mask": completion}
    corrupted = objective.corrupt(batch, seed=7, step=3)
    model.zero_grad()
    ref_loss, _ = objective.loss(model, corrupted)
    ref_loss.backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]

    P = groups.group.size
    groups.group.meter.next_step()
    layout = ShardedLayout.build(PlanConfig(ParallelDims(P, P, case["mode"]), seq_len=L, block_size=B), groups, model.mask_rule(), "blockwise")
    model.zero_grad()
    loss, _ = objective.loss(model, corrupted, layout)
    loss.backward()
    total, *grads = all_reduce_flat([loss.detach().reshape(1)] + [p.grad for p in model.parameters()])
    grad_err = 0.0
    for grad, ref in zip(grads, ref_grads):
        grad_err = max(grad_err, (grad - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30))
    return dict(case, loss_err=abs(total.item() - ref_loss.item()) / abs(ref_loss.item()), grad_err=grad_err,
                window_bytes=sum(v for k, v in groups.group.meter.by_name().items() if "window" in k))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started = join_process_group()
    groups = BlockParallelGroups.create(dist.get_world_size(), dist.get_world_size(), ByteMeter())
    results = []
    for window in (3, 10):
        for convention in ("per_query", "block_start"):
            for clean in ("block_causal", "causal"):
                for mode in ("cp", "csbp"):
                    case = dict(window=window, convention=convention, clean=clean, mode=mode)
                    results.append(run_case(case, groups))
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    leave_process_group(started)


if __name__ == "__main__":
    main()
