"""Worker for tests/models/dflash/test_parallel.py (a job of the shared launches of 2 and 4 processes): the DFlash
drafter's sharded forward (cp / bp / csbp) against one process, every case in one launch.

    torchrun --nproc_per_node 2 tests/distributed/dflash_worker.py --out /tmp/dflash.json

Each case (drafter kind, mode, loss, dtype, anchors) starts every rank from the same tiny random drafter and batch and
runs 3 SGD steps twice: the single-process reference (`drafter(features, ...)` on every anchor,
`DFlashObjective.loss_from_hidden`) and the sharded step (this rank's plan, feature rows and anchors,
`sharded_draft_forward`, the loss times `plan.loss_scale`, gradients summed over the group). Recorded per step: the
group's summed loss against the reference's, this rank's received context bytes against the module docstring's
formula, computed here independently (the sliding layer's rows from the mask rule itself), and the context rows its
``fc`` projected (a forward hook) against the plan's and against the mask rule's union over its ring's anchors (an
all-sliding drafter compacts its context, and is fed only those feature rows); after the last step every weight
against the reference's.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
import traceback

import fixtures
import torch
import torch.distributed as dist
from shared_launch import join_process_group, leave_process_group

from hf_bdlm.models.dflash.modeling import draft_context_mask
from hf_bdlm.models.dflash.training.objectives import DFlashObjective
from hf_bdlm.models.dflash.training.sharded import DFlashShardPlan, context_bytes, sharded_draft_forward
from hf_bdlm.parallel.collectives import ByteMeter
from hf_bdlm.parallel.groups import BlockParallelGroups

VOCAB, WIDTH, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 64, 32, 4, 2, 8, 4
LENGTH, BATCH, STEPS, LR, WINDOW = 32, 2, 3, 0.2, 5
DRAFTERS = {
    "dflash2": dict(dflash2=True),
    "dflash": dict(dflash2=False),
    "dflash2_sliding": dict(dflash2=True, layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW),
    "dflash2_all_sliding": dict(dflash2=True, layer_types=["sliding_attention"] * 2, sliding_window=WINDOW),
}
MATRIX = ("dflash2", "dflash", "dflash2_sliding")  # every mode x loss; the all-sliding drafter (compact context): a few


# The target: a random Qwen3 of 4 layers. The drafters: 2 layers reading target layers 1 and 3, every parameter random
# (norms around one), so no identity initialisation hides a difference; ``tiny_drafter(target, **DRAFTERS[kind])``.
tiny_target = functools.partial(fixtures.tiny_target, "qwen3", intermediate_size=48, num_hidden_layers=4,
                                pad_token_id=0)
tiny_drafter = functools.partial(
    fixtures.tiny_drafter, noise="around_one", num_hidden_layers=2, target_layer_ids=[1, 3], block_size=BLOCK,
    mask_token_id=VOCAB - 1, intermediate_size=40, rope_parameters={"rope_type": "default", "rope_theta": 50.0},
    dflash2_fields=dict(conv_kernel_size=3, conv_group_size=8, selector_rank=6, selector_top_k=5))


def tiny_data(dtype: torch.dtype, feature_width: int):
    """Two sequences: one document with a 5-token prompt; two packed documents (14 + 18 tokens) with prompts."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, VOCAB - 1, (BATCH, LENGTH), generator=g)
    loss_mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
    loss_mask[0, :5] = 0
    loss_mask[1, :3] = 0
    loss_mask[1, 14:17] = 0
    documents = torch.zeros(BATCH, LENGTH, dtype=torch.long)
    documents[1, 14:] = 1
    features = torch.randn(BATCH, LENGTH, feature_width, generator=g, dtype=torch.float64).to(dtype)
    return ids, loss_mask, documents, features


def objective_of(loss: str, max_anchors: int) -> DFlashObjective:
    return DFlashObjective(mask_token_id=VOCAB - 1, block_size=BLOCK, max_anchors=max_anchors, loss=loss,
                           anchor_sampling="uniform", seed=3)


def loss_of(objective, drafter, hidden, batch, global_sum=None):
    selector = getattr(drafter, "candidate_selector", None) if objective.config.loss == "dpace" else None
    return objective.loss_from_hidden(hidden, drafter.lm_head.weight, batch, selector=selector,
                                      global_sum=global_sum)


def sgd(model, lr: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad and p.grad is not None:
                p -= lr * p.grad
    model.zero_grad(set_to_none=True)


def expected_bytes(plan, drafter, batch, mine_of, element_size: int) -> tuple[int, int]:
    """The module docstring's formula, with the sliding layer's rows taken from the mask rule itself: the rows outside
    a rank's range that any query of its blocks may see."""
    C, L = plan.ring_size, plan.sequence_length
    if C == 1:
        return 0, 0
    row = 2 * BATCH * KV_HEADS * HEAD_DIM * element_size
    everything = torch.arange(L).expand(BATCH, -1)

    def seen(rank: int, window: int) -> set[int]:
        mine = mine_of(rank)
        mask = draft_context_mask(mine.anchor_positions, everything, BLOCK, anchor_document_starts=mine.document_starts,
                                  anchor_valid=mine.anchor_valid, sliding_window=window)
        lo, hi = plan.context_ranges[rank]
        return {p for p in mask.flatten(0, 2).any(0).nonzero().flatten().tolist() if not lo <= p < hi}

    ring = range(plan.rank - plan.rank % C, plan.rank - plan.rank % C + C)  # the ranks sharing one context copy
    forward = backward = 0
    for layer in drafter.layers:
        window = layer.self_attn.sliding_window
        if window is None:
            forward += (C - 1) * (L // C) * row
            backward += (C - 1) * (L // C) * row
        else:
            lo, hi = plan.context_range
            forward += len(seen(plan.rank, window)) * row
            backward += sum(sum(1 for p in seen(r, window) if lo <= p < hi) for r in ring if r != plan.rank) * row
    return forward, backward


def expected_projected(plan, windows, mine_of) -> int:
    """The context rows this rank must project, from the mask rule: its whole range unless every layer slides, else
    the rows of its range that some query of its ring's anchors sees on the widest window."""
    lo, hi = plan.context_range
    if any(w is None for w in windows):
        return hi - lo
    everything = torch.arange(plan.sequence_length).expand(BATCH, -1)
    seen = torch.zeros(plan.sequence_length, dtype=torch.bool)
    for member in plan.ring_members:
        mine = mine_of(member)
        seen |= draft_context_mask(mine.anchor_positions, everything, BLOCK,
                                   anchor_document_starts=mine.document_starts, anchor_valid=mine.anchor_valid,
                                   sliding_window=max(windows)).flatten(0, 2).any(0)
    return int(seen[lo:hi].sum())


def run_case(case: dict, groups: BlockParallelGroups, targets: dict) -> dict:
    dtype = torch.float64 if case["dtype"] == "float64" else torch.float32
    P, C, rank, group, ring = case["P"], case["C"], groups.group_rank, groups.group, groups.ring
    target = targets[case["dtype"]]
    reference = tiny_drafter(target, **DRAFTERS[case["drafter"]])
    sharded = tiny_drafter(target, **DRAFTERS[case["drafter"]])
    initial = {n: p.detach().clone() for n, p in sharded.named_parameters()}
    if case.get("checkpointing"):  # a recomputed layer exchanges its context rows again
        sharded.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids, loss_mask, documents, features = tiny_data(dtype, reference.config.feature_width)
    objective = objective_of(case["loss"], case["max_anchors"])
    windows = [reference.config.layer_window(i) for i in range(reference.config.num_hidden_layers)]
    rel = lambda a, b: (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
    fc_rows: list[int] = []
    hook = sharded.fc.register_forward_hook(lambda module, args, out: fc_rows.append(args[0].shape[1]))
    steps = []
    seconds = 0.0
    for step in range(STEPS):
        batch = objective.prepare(ids, loss_mask, documents, step=step)
        out = reference(features, ids, batch.anchor_positions, batch.anchor_valid, document_ids=documents,
                        return_logits=False)
        ref_loss = loss_of(objective, reference, out.hidden_states, batch)
        ref_loss.backward()
        sgd(reference, LR)

        group.meter.next_step()
        start_time = time.perf_counter()
        plan = DFlashShardPlan.build(batch, mode=case["mode"], world=P, rank=rank, layer_windows=windows, ring_size=C)
        mine = plan.select(batch)
        start, stop = plan.context_range
        rows = features[:, plan.projected_rows] if plan.compacts_context else features[:, start:stop]
        fc_rows.clear()
        out = sharded_draft_forward(sharded, rows, ids, mine, plan, ring)
        projected = list(fc_rows)
        loss = loss_of(objective, sharded, out.hidden_states, mine, plan.global_sum(group)) * plan.loss_scale
        loss.backward()
        for p in sharded.parameters():  # what DDP does (as a sum; it averages a loss scaled by P the same way)
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=group.group)
        sgd(sharded, LR)
        seconds += time.perf_counter() - start_time
        total = loss.detach().clone()
        dist.all_reduce(total, group=group.group)
        names = group.meter.by_name()
        got = (sum(v for k, v in names.items() if k.endswith(("all_gather", ".all_to_all"))),
               sum(v for k, v in names.items() if k.endswith(("reduce_scatter", "all_to_all_backward"))))
        kv_width, size = sharded.config.num_key_value_heads * sharded.config.head_dim, torch.finfo(dtype).bits // 8
        steps.append(dict(
            loss=ref_loss.item(), loss_err=abs(total.item() - ref_loss.item()) / abs(ref_loss.item()),
            anchors=len(plan.anchor_slots[rank]), active=len(plan.anchor_slots[0]) if case["mode"] == "cp" else None,
            bytes=got, formula=context_bytes(plan, windows, batch_size=BATCH, kv_width=kv_width, element_size=size),
            expected=expected_bytes(plan, sharded, batch,
                                    lambda r: DFlashShardPlan.build(batch, mode=case["mode"], world=P, rank=r,
                                                                    layer_windows=windows, ring_size=C).select(batch),
                                    size),
            names=sorted(names), fc_rows=projected, projected=plan.num_projected, shard=stop - start,
            expected_projected=expected_projected(
                plan, windows, lambda r: DFlashShardPlan.build(batch, mode=case["mode"], world=P, rank=r,
                                                               layer_windows=windows, ring_size=C).select(batch))))
    hook.remove()
    weight_err, worst = max((rel(p, reference.get_parameter(n)), n) for n, p in sharded.named_parameters())
    moved = sum(1 for n, p in sharded.named_parameters() if not torch.equal(p, initial[n]))
    return dict(case, rank=rank, steps=steps, weight_err=weight_err, worst_param=worst, seconds=seconds,
                moved=moved, parameters=sum(1 for _ in sharded.parameters()))


def cases(world: int) -> list[dict]:
    """World 2: every drafter of the matrix x mode x loss in float32, float64 for each drafter and mode with one loss,
    and a batch with one active anchor slot (a rank without anchors); the all-sliding drafter (compact context) in
    every mode in float64 and twice in float32. World 4: each mode once with few anchors (ranks without any), csbp
    with clean rings of 2 (context over 2 ranks, anchors over 4), and the all-sliding drafter under cp and csbp."""
    rings = {"cp": world, "bp": 1, "csbp": world}
    out = []
    if world == 2:
        for drafter in MATRIX:
            for mode in ("cp", "bp", "csbp"):
                for loss in ("ce", "dpace"):
                    out.append(dict(drafter=drafter, mode=mode, loss=loss, dtype="float32", max_anchors=6))
                out.append(dict(drafter=drafter, mode=mode, loss="dpace" if drafter != "dflash" else "ce",
                                dtype="float64", max_anchors=6))
        for mode in ("bp", "csbp"):
            out.append(dict(drafter="dflash2_sliding", mode=mode, loss="dpace", dtype="float64", max_anchors=1))
        out.append(dict(drafter="dflash2_sliding", mode="csbp", loss="dpace", dtype="float32", max_anchors=6,
                        checkpointing=True))
        for mode in ("cp", "bp", "csbp"):
            out.append(dict(drafter="dflash2_all_sliding", mode=mode, loss="dpace", dtype="float64", max_anchors=3))
        out.append(dict(drafter="dflash2_all_sliding", mode="csbp", loss="ce", dtype="float32", max_anchors=6))
        out.append(dict(drafter="dflash2_all_sliding", mode="cp", loss="dpace", dtype="float32", max_anchors=3,
                        checkpointing=True))
    else:
        for mode in ("cp", "bp", "csbp"):
            out.append(dict(drafter="dflash2_sliding", mode=mode, loss="dpace", dtype="float32", max_anchors=3))
        out.append(dict(drafter="dflash2_sliding", mode="csbp", loss="ce", dtype="float64", max_anchors=6))
        out.append(dict(drafter="dflash2_sliding", mode="csbp", loss="dpace", dtype="float32", max_anchors=6, C=2))
        out.append(dict(drafter="dflash2", mode="csbp", loss="ce", dtype="float64", max_anchors=6, C=2))
        out.append(dict(drafter="dflash2_all_sliding", mode="cp", loss="ce", dtype="float64", max_anchors=3))
        out.append(dict(drafter="dflash2_all_sliding", mode="csbp", loss="dpace", dtype="float32", max_anchors=4, C=2))
    return [dict(c, P=world, C=c.get("C", rings[c["mode"]])) for c in out]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started = join_process_group()
    world = dist.get_world_size()
    targets = {"float32": tiny_target(dtype=torch.float32), "float64": tiny_target(dtype=torch.float64)}
    groups, results = {}, []
    for case in cases(world):
        key = (case["P"], case["C"])
        if key not in groups:  # every rank creates the same groups in the same order
            groups[key] = BlockParallelGroups.create(*key, ByteMeter())
        try:
            results.append(run_case(case, groups[key], targets))
        except Exception:
            results.append(dict(case, error=traceback.format_exc()))
            raise
    everyone: list = [None] * world
    dist.all_gather_object(everyone, results)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump([case for ranks in zip(*everyone) for case in ranks], f, indent=1)
    leave_process_group(started)


if __name__ == "__main__":
    main()
