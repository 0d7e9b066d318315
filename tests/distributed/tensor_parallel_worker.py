"""Worker for tests/test_parallel_tensor.py: block parallelism x tensor parallelism equals one process.

    torchrun --nproc_per_node 4 tests/distributed/tensor_parallel_worker.py --out /tmp/tp.json

For each case every rank builds the same tiny model twice: a single-process reference, and a copy split over the
mesh's tensor-parallel dim with the backbone's transformers plan (:func:`hf_bdlm.parallel.tensor.apply_tensor_parallel`).
Both train three SGD steps (AdamW would turn reassociation noise on near-zero gradients into
lr-sized steps) on the same batches; the split copy runs its rank's rows of the block-parallel layout
(P = 2 x T = 2 on 4 processes, or D = 2 x T = 2 without block parallelism), its gradients averaged over the data world
as DDP would. Losses of every step and the final weights (gathered from their tensor-parallel shards) must equal
the reference's; the K/V bytes each rank moves must be the formulas of docs/design.md §3 over T (a rank exchanges
only its own heads).
"""

from __future__ import annotations

import argparse
import json
import traceback

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from exactness_worker import B, HEAD_DIM, HKV, L, MASK, backbone, make_batch
from hf_bdlm import BlockDiffusionConfig, BlockDiffusionForMaskedLM
from hf_bdlm.objectives import get_objective
from hf_bdlm.parallel.groups import BlockParallelGroups
from hf_bdlm.parallel.plan import ParallelDims, PlanConfig
from hf_bdlm.parallel.sharded import ShardedLayout
from hf_bdlm.parallel.tensor import apply_tensor_parallel

STEPS, T = 3, 2


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def run_case(case: dict, groups: BlockParallelGroups) -> dict:
    P, D = case["P"], groups.num_groups
    torch.manual_seed(0)
    cfg = BlockDiffusionConfig(backbone_config=backbone(case["backbone"]), block_size=B, mask_token_id=MASK,
                               clean_attention=case["clean"])
    ref = BlockDiffusionForMaskedLM(cfg)
    model = BlockDiffusionForMaskedLM(cfg)
    model.load_state_dict(ref.state_dict())
    apply_tensor_parallel(model, groups.tp_mesh)
    split = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    objective = get_objective(case["objective"], cfg)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    meter = groups.group.meter
    ref_losses, losses = [], []
    for step in range(STEPS):
        # Reference: every replica's batch on one process, averaged as DDP averages replicas.
        opt_ref.zero_grad()
        total = 0.0
        for gi in range(D):
            corrupted = objective.corrupt(make_batch(case["batch"], seed=10 * step + gi), seed=7, step=step)
            loss, _ = objective.loss(ref, corrupted)
            (loss / D).backward()
            total += loss.item() / D
        ref_losses.append(total)
        opt_ref.step()
        # Split: this rank's rows of its replica's batch, on its tensor-parallel shard of the weights.
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
        data_world = groups.world_mesh.get_group()
        with torch.no_grad():
            for p in model.parameters():
                local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                dist.all_reduce(local, group=data_world)
                local /= D * P
        value = loss.detach().clone()
        dist.all_reduce(value, group=data_world)
        losses.append(value.item() / D)
        opt.step()
    rel = lambda a, b: (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
    weight_errs = [(rel(full(p.detach()), q.detach()), n)
                   for (n, p), q in zip(model.named_parameters(), ref.parameters())]
    weight_err, worst = max(weight_errs)
    result = dict(case, T=T, D=D, split_params=len(split), losses=losses, ref_losses=ref_losses,
                  loss_err=max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
                  weight_err=weight_err, worst_param=worst, bytes=meter.by_name())
    if P > 1 and case["backbone"] != "gemma3":
        layers = cfg.backbone_config.num_hidden_layers
        per_kv = {"cp": (P - 1) / P * 2 * (2 * L), "csbp": (P - 1) / P * 2 * L, "bp": 0}[case["mode"]]
        # The last step's bytes: HKV / T heads of K and V per rank, float32, forward gather + backward reduce-scatter.
        expect = per_kv * (HKV // T) * HEAD_DIM * 4 * layers * corrupted.clean_ids.shape[0]
        names = meter.by_name()
        result.update(expect_bytes=expect,
                      fwd_bytes=sum(v for k, v in names.items() if k.endswith("all_gather")),
                      bwd_bytes=sum(v for k, v in names.items() if k.endswith("reduce_scatter")))
    return result


def run_diffusion_gemma_case(case: dict, groups: BlockParallelGroups) -> dict:
    """DiffusionGemma (its encoder split by its transformers plan, the tied decoder alike), one step's loss and
    gradients of P = 2 x T = 2 against one process, float64 with float64-faithful norms and eager experts."""
    from diffusion_gemma_worker import SEED, STEP, objective
    from tiny_diffusion_gemma import B as DG_B, float64_faithful, make_batch as dg_batch, tiny_model

    from hf_bdlm.models.diffusion_gemma.modeling import diffusion_gemma_rule
    from hf_bdlm.models.diffusion_gemma.sharded import ShardedDiffusionGemmaLayout

    P, D = case["P"], groups.num_groups
    build = lambda: float64_faithful(tiny_model(vision_heads=2).train()) if case["dtype"] == "float64" \
        else tiny_model(vision_heads=2).train()
    ref, model = build(), build()
    apply_tensor_parallel(model, groups.tp_mesh)
    reference = objective(case["self_conditioning"])
    ref_loss = 0.0
    for gi in range(D):
        loss, _ = reference.loss(ref, reference.corrupt(dg_batch(case["batch"], seed=gi), seed=SEED, step=STEP))
        (loss / D).backward()
        ref_loss += loss.item() / D
    dims = ParallelDims(P, None, case["mode"], tensor_parallel_size=T)
    sharded = objective(case["self_conditioning"], dims)
    corrupted = sharded.corrupt(dg_batch(case["batch"], seed=groups.group_index), seed=SEED, step=STEP)
    frame = corrupted.frame
    plan = groups.plan(PlanConfig(dims, frame.frame_length, DG_B, noisy_blocks=tuple(frame.canvas_blocks.tolist())))
    layout = ShardedDiffusionGemmaLayout(plan, groups, frame, diffusion_gemma_rule(DG_B), "blockwise", "allgather")
    loss, _ = sharded.loss(model, corrupted, layout)
    (loss * P).backward()
    data_world = groups.world_mesh.get_group()
    value = loss.detach().clone()
    dist.all_reduce(value, group=data_world)
    rel = lambda a, b: (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
    errors = []
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        grad = torch.zeros_like(full(p.detach())) if p.grad is None else full(p.grad).clone()
        dist.all_reduce(grad, group=data_world)
        grad /= D * P
        errors.append((rel(grad, torch.zeros_like(grad) if q.grad is None else q.grad), n))
    grad_err, worst = max(errors)
    split = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    return dict(case, T=T, D=D, split_params=len(split), loss_err=abs(value.item() / D - ref_loss) / abs(ref_loss),
                grad_err=grad_err, worst_param=worst, losses=[value.item() / D], weight_err=None)


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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    groups_by_shape: dict[tuple, BlockParallelGroups] = {}  # (P, C): bp's clean ring is the rank alone
    results = []
    for case in cases(world):
        shape = (case["P"], 1 if case["mode"] == "bp" else case["P"])
        if shape not in groups_by_shape:
            mode = "bp" if shape[1] == 1 and shape[0] > 1 else "csbp"
            groups_by_shape[shape] = BlockParallelGroups.build(ParallelDims(*shape, mode, tensor_parallel_size=T))
        try:
            runner = run_diffusion_gemma_case if case["backbone"] == "diffusion_gemma" else run_case
            results.append(runner(case, groups_by_shape[shape]))
        except Exception:
            results.append(dict(case, error=traceback.format_exc()))
            raise
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump([dict(r, rank=i) for i, rs in enumerate(gathered) for r in rs], f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
