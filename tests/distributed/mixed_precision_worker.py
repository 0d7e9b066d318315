"""Worker for tests/parallel/test_mixed_precision.py: every layout under bf16 autocast with float32 weights.

    torchrun --nproc_per_node 2 tests/distributed/mixed_precision_worker.py --out /tmp/bf16.json

The sequence is long enough (L = 2048, 4096 rows) that the all-gathers and ring transfers are
still in flight while a rank computes its local sources, so any read of a buffer before its wait
shows up as wrong or non-finite numbers. For each layout of P = world (cp / bp / csbp with every
clean ring size, both transports) every rank runs its own rows of the layout twice; it records the
error of the group's loss and gradients against the single-process autocast reference (computed
once per backbone on one rank and broadcast), whether everything is finite, and whether the two
runs are bit-identical.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from flat_reduce import all_reduce_flat
from shared_launch import join_process_group, leave_process_group
from transformers import Gemma3TextConfig, Qwen3Config

from hf_bdlm import BlockDiffusionConfig, BlockDiffusionForMaskedLM
from hf_bdlm.objectives import get_objective
from hf_bdlm.parallel.collectives import ByteMeter
from hf_bdlm.parallel.plan import ParallelDims, PlanConfig
from hf_bdlm.parallel.groups import BlockParallelGroups
from hf_bdlm.parallel.sharded import ShardedLayout

VOCAB, MASK, PAD = 96, 95, 0
L, B = 2048, 32


def model(backbone: str) -> BlockDiffusionForMaskedLM:
    kw = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=96, head_dim=16, pad_token_id=PAD)
    if backbone == "qwen3":
        bb = Qwen3Config(**kw)
    else:
        bb = Gemma3TextConfig(**kw, sliding_window=80, layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    cfg = BlockDiffusionConfig(backbone_config=bb, block_size=B, mask_token_id=MASK, attention_backend="blockwise")
    return BlockDiffusionForMaskedLM(cfg)  # float32 weights


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, MASK, (1, L), generator=g)
    completion = torch.ones(1, L, dtype=torch.long)
    completion[:, :64] = 0
    return {"input_ids": ids, "completion_mask": completion, "sample_ids": torch.tensor([0])}


def grads_of(m) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in m.parameters()]


def reference(m, objective, corrupted):
    m.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = objective.loss(m, corrupted)
    loss.backward()
    return loss.item(), grads_of(m)


def sharded(m, objective, corrupted, groups, P, C, mode, transport):
    cfg = PlanConfig(ParallelDims(P, C, mode), seq_len=L, block_size=B)
    layout = ShardedLayout.build(cfg, groups, m.mask_rule(), "blockwise", None, transport=transport)
    m.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = objective.loss(m, corrupted, layout)
    loss.backward()
    # Every data-parallel group runs the same batch here: sum over the world, then average over the groups.
    groups_count = dist.get_world_size() // P
    total, *grads = all_reduce_flat([loss.detach().reshape(1)] + grads_of(m))
    return total.item() / groups_count, [g / groups_count for g in grads]


def layouts(world: int):
    """Every layout of P = world (one group: P = 2's layouts run in the 2-process launch)."""
    out = []
    P = world
    for mode, Cs in (("cp", [P]), ("bp", [1]), ("csbp", sorted({1, 2, P}))):
        for C in Cs:
            transports = ["allgather", "ring"] if C > 1 or mode == "cp" else ["allgather"]
            out += [dict(P=P, C=C, mode=mode, transport=t, backbone="qwen3") for t in transports]
    # Sliding-window layers exchange only their window's rows (all-to-all): one csbp case per world.
    out.append(dict(P=world, C=world, mode="csbp", transport="allgather", backbone="gemma3"))
    return out


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started = join_process_group()
    world = dist.get_world_size()
    groups = {}
    # The single-process reference of each backbone, computed once (backbones dealt over the ranks) and broadcast.
    backbones = sorted({case["backbone"] for case in layouts(world)})
    refs = {}
    for i, name in enumerate(backbones):
        if i % world == dist.get_rank():
            m = model(name)
            objective = get_objective("standard", m.config)
            refs[name] = reference(m, objective, objective.corrupt(batch(), seed=5, step=0))
    for i, name in enumerate(backbones):
        shared = [refs.get(name)]
        dist.broadcast_object_list(shared, src=i % world)
        refs[name] = shared[0]
    results = []
    for case in layouts(world):
        P, C = case["P"], case["C"]
        if (P, C) not in groups:
            groups[P, C] = BlockParallelGroups.create(P, C, ByteMeter())
        m = model(case["backbone"])
        objective = get_objective("standard", m.config)
        corrupted = objective.corrupt(batch(), seed=5, step=0)
        ref_loss, ref_grads = refs[case["backbone"]]
        runs = [sharded(m, objective, corrupted, groups[P, C], P, C, case["mode"], case["transport"]) for _ in range(2)]
        (loss, grads), (loss2, grads2) = runs
        rel = lambda a, b: (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
        results.append(dict(
            case,
            loss=loss,
            ref_loss=ref_loss,
            loss_err=abs(loss - ref_loss) / abs(ref_loss),
            grad_err=max(rel(a, b) for a, b in zip(grads, ref_grads)),
            finite=bool(torch.isfinite(torch.tensor(loss)) and all(torch.isfinite(g).all() for g in grads)),
            identical=loss == loss2 and all(torch.equal(a, b) for a, b in zip(grads, grads2)),
        ))
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    leave_process_group(started)


if __name__ == "__main__":
    main()
