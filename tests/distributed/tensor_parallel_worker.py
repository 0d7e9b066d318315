"""Worker for tests/parallel/test_tensor.py: block parallelism x tensor parallelism equals one process.

    torchrun --nproc_per_node 4 tests/distributed/tensor_parallel_worker.py --out /tmp/tp.json

For each case every rank builds the same tiny model split over the mesh's tensor-parallel dim with the backbone's
transformers plan (:func:`hf_bdlm.parallel.tensor.apply_tensor_parallel`) and trains three SGD steps (AdamW would turn
reassociation noise on near-zero gradients into lr-sized steps) on its rank's rows of the block-parallel layout
(P = 2 x T = 2 on 4 processes, or D = 2 x T = 2 without block parallelism), its gradients averaged over the data world
as DDP would. A single-process reference trains the same steps on the same batches, once per case on the rank that
owns it (cases dealt round-robin), and is shared with every rank. Losses of every step and the final weights (gathered
from their tensor-parallel shards) must equal the reference's on every rank; the K/V bytes each rank moves must be
the formulas of docs/design.md §3 over T (a rank exchanges only its own heads).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from exactness_worker import B, HEAD_DIM, HKV, L, MASK, backbone, make_batch
from flat_reduce import all_reduce_flat
from shared_launch import join_process_group, leave_process_group
from hf_bdlm import BlockDiffusionConfig, BlockDiffusionForMaskedLM
from hf_bdlm.objectives import get_objective
from hf_bdlm.parallel.groups import BlockParallelGroups
from hf_bdlm.parallel.plan import ParallelDims, PlanConfig
from hf_bdlm.parallel.sharded import ShardedLayout
from hf_bdlm.parallel.tensor import apply_tensor_parallel

STEPS, T = 3, 2


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def build_reference(case: dict):
    torch.manual_seed(0)
    cfg = BlockDiffusionConfig(backbone_config=backbone(case["backbone"]), block_size=B, mask_token_id=MASK,
                               clean_attention=case["clean"])
    return BlockDiffusionForMaskedLM(cfg), get_objective(case["objective"], cfg)


def run_case(case: dict, groups: BlockParallelGroups) -> tuple[dict, dict]:
    """The split copy's three steps on this rank's rows: the result without its errors, and what the reference must
    match (the losses of every step, the final weights gathered from their shards)."""
    P, D = case["P"], groups.num_groups
    ref, objective = build_reference(case)
    model = BlockDiffusionForMaskedLM(ref.config)
    model.load_state_dict(ref.state_dict())
    cfg = model.config
    apply_tensor_parallel(model, groups.tp_mesh)
    split = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    meter = groups.group.meter
    losses = []
    for step in range(STEPS):
        # This rank's rows of its replica's batch, on its tensor-parallel shard of the weights.
        opt.zero_grad()
        corrupted = objective.corrupt(make_batch(case["batch"], seed=10 * step + groups.group_index), seed=7,
                                      step=step)
        meter.next_step()
        if P > 1:
            dims = ParallelDims(P, None, case["mode"], cp_layout=case.get("cp_layout", "balanced"),
                                tensor_parallel_size=T)
            layout = ShardedLayout.build(PlanConfig(dims, seq_len=L, block_size=B), groups, model.mask_rule(),
                                         "blockwise", corrupted.document_ids)
            loss, _ = objective.loss(model, corrupted, layout)
        else:
            loss, _ = objective.loss(model, corrupted)
        (loss * P).backward()  # DDP's mean over the D x P ranks of the data world is then the reference gradient
        local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]
        value, *summed = all_reduce_flat([loss.detach().reshape(1)] + local, group=groups.world_mesh.get_group())
        with torch.no_grad():
            for grad, total in zip(local, summed):
                grad.copy_(total / (D * P))
        losses.append(value.item() / D)
        opt.step()
    weights = {n: full(p.detach()).clone() for n, p in model.named_parameters()}
    result = dict(case, T=T, D=D, split_params=len(split), losses=losses, bytes=meter.by_name())
    if P > 1 and case["backbone"] != "gemma3":
        layers = cfg.backbone_config.num_hidden_layers
        per_kv = {"cp": (P - 1) / P * 2 * (2 * L), "csbp": (P - 1) / P * 2 * L, "bp": 0}[case["mode"]]
        # The last step's bytes: HKV / T heads of K and V per rank, float32, forward gather + backward reduce-scatter.
        expect = per_kv * (HKV // T) * HEAD_DIM * 4 * layers * corrupted.clean_ids.shape[0]
        names = meter.by_name()
        result.update(expect_bytes=expect,
                      fwd_bytes=sum(v for k, v in names.items() if k.endswith("all_gather")),
                      bwd_bytes=sum(v for k, v in names.items() if k.endswith("reduce_scatter")))
    return result, weights


def reference_run(case: dict, D: int) -> dict:
    """One process trains the same three SGD steps on every replica's batch, averaged as DDP averages replicas."""
    ref, objective = build_reference(case)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref_losses = []
    for step in range(STEPS):
        opt_ref.zero_grad()
        total = 0.0
        for gi in range(D):
            corrupted = objective.corrupt(make_batch(case["batch"], seed=10 * step + gi), seed=7, step=step)
            loss, _ = objective.loss(ref, corrupted)
            (loss / D).backward()
            total += loss.item() / D
        ref_losses.append(total)
        opt_ref.step()
    return {"losses": ref_losses, "values": {n: p.detach().clone() for n, p in ref.named_parameters()}}


def with_errors(result: dict, values: dict, reference: dict) -> dict:
    """``result`` with its errors against the reference: every step's loss (or the one step's) and the final weights
    (DiffusionGemma: the gradients)."""
    rel = lambda a, b: (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
    err, worst = max((rel(values[n], reference["values"][n]), n) for n in values)
    losses, ref_losses = result["losses"], reference["losses"]
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    if result["backbone"] == "diffusion_gemma":
        return dict(result, loss_err=loss_err, grad_err=err, worst_param=worst, weight_err=None)
    return dict(result, ref_losses=ref_losses, loss_err=loss_err, weight_err=err, worst_param=worst)


def dg_build(case: dict):
    from tiny_diffusion_gemma import float64_faithful, tiny_model

    model = tiny_model(vision_heads=2).train()
    return float64_faithful(model) if case["dtype"] == "float64" else model


def run_diffusion_gemma_case(case: dict, groups: BlockParallelGroups) -> tuple[dict, dict]:
    """DiffusionGemma (its encoder split by its transformers plan, the tied decoder alike), one step of P = 2 x T = 2:
    the result without its errors, the loss and the gradients gathered from their shards (float64 with float64-faithful
    norms and eager experts, or float32)."""
    from diffusion_gemma_worker import SEED, STEP, objective
    from tiny_diffusion_gemma import B as DG_B, make_batch as dg_batch

    from hf_bdlm.models.diffusion_gemma.modeling import diffusion_gemma_rule
    from hf_bdlm.models.diffusion_gemma.training.sharded import ShardedDiffusionGemmaLayout

    P, D = case["P"], groups.num_groups
    model = dg_build(case)
    apply_tensor_parallel(model, groups.tp_mesh)
    dims = ParallelDims(P, None, case["mode"], tensor_parallel_size=T)
    sharded = objective(case["self_conditioning"], dims)
    corrupted = sharded.corrupt(dg_batch(case["batch"], seed=groups.group_index), seed=SEED, step=STEP)
    frame = corrupted.frame
    plan = groups.plan(PlanConfig(dims, frame.frame_length, DG_B, noisy_blocks=tuple(frame.canvas_blocks.tolist())))
    layout = ShardedDiffusionGemmaLayout(plan, groups, frame, diffusion_gemma_rule(DG_B), "blockwise", "allgather")
    loss, _ = sharded.loss(model, corrupted, layout)
    (loss * P).backward()
    names = [n for n, _ in model.named_parameters()]
    full_grads = [torch.zeros_like(full(p.detach())) if p.grad is None else full(p.grad)
                  for _, p in model.named_parameters()]
    value, *summed = all_reduce_flat([loss.detach().reshape(1)] + full_grads, group=groups.world_mesh.get_group())
    grads = {n: grad / (D * P) for n, grad in zip(names, summed)}
    split = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    return dict(case, T=T, D=D, split_params=len(split), losses=[value.item() / D]), grads


def diffusion_gemma_reference(case: dict, D: int) -> dict:
    """One step's loss and gradients of every replica's batch on one process."""
    from diffusion_gemma_worker import SEED, STEP, objective
    from tiny_diffusion_gemma import make_batch as dg_batch

    ref = dg_build(case)
    reference = objective(case["self_conditioning"])
    ref_loss = 0.0
    for gi in range(D):
        loss, _ = reference.loss(ref, reference.corrupt(dg_batch(case["batch"], seed=gi), seed=SEED, step=STEP))
        (loss / D).backward()
        ref_loss += loss.item() / D
    return {"losses": [ref_loss], "values": {n: torch.zeros_like(p) if p.grad is None else p.grad.clone()
                                             for n, p in ref.named_parameters()}}


def cases(world: int) -> list[dict]:
    out = []
    for bb, obj, batch in (("llama", "standard", "packed"), ("qwen3", "standard", "plain"),
                           ("gemma3", "fast_dllm_v2", "padded")):
        clean = "causal" if obj == "fast_dllm_v2" else "block_causal"
        base = dict(backbone=bb, objective=obj, clean=clean, batch=batch)
        out += [dict(base, P=2, mode="csbp"), dict(base, P=2, mode="cp"), dict(base, P=2, mode="cp", cp_layout="paper"),
                dict(base, P=2, mode="bp")]
    out.append(dict(backbone="llama", objective="standard", clean="block_causal", batch="plain", P=1, mode="csbp"))
    for dtype, sc, batch in (("float64", "mixed", "plain"), ("float32", "mixed", "packed")):
        out += [dict(backbone="diffusion_gemma", dtype=dtype, self_conditioning=sc, batch=batch, P=2, mode=mode)
                for mode in ("csbp", "cp")]
    return [c for c in out if world % (c["P"] * T) == 0]


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started = join_process_group()
    world, rank = dist.get_world_size(), dist.get_rank()
    groups_by_shape: dict[tuple, BlockParallelGroups] = {}  # (P, C): bp's clean ring is the rank alone
    todo, runs = cases(world), []
    for case in todo:
        shape = (case["P"], 1 if case["mode"] == "bp" else case["P"])
        if shape not in groups_by_shape:
            mode = "bp" if shape[1] == 1 and shape[0] > 1 else "csbp"
            groups_by_shape[shape] = BlockParallelGroups.build(ParallelDims(*shape, mode, tensor_parallel_size=T))
        runner = run_diffusion_gemma_case if case["backbone"] == "diffusion_gemma" else run_case
        runs.append(runner(case, groups_by_shape[shape]))
    # Each case's single-process reference once, on the rank that owns it, then shared: every rank compares its own
    # split run with it.
    references = {}
    for index, case in enumerate(todo):
        if index % world == rank:
            reference = diffusion_gemma_reference if case["backbone"] == "diffusion_gemma" else reference_run
            references[index] = reference(case, runs[index][0]["D"])
    shared = [None] * world
    dist.all_gather_object(shared, references)
    references = {index: ref for part in shared for index, ref in part.items()}
    results = [with_errors(result, values, references[index]) for index, (result, values) in enumerate(runs)]
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump([dict(r, rank=i) for i, rs in enumerate(gathered) for r in rs], f, indent=1)
    leave_process_group(started)


if __name__ == "__main__":
    main()
