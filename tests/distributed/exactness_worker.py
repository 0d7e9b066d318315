"""Worker for tests/parallel/test_exactness.py: many layouts checked inside one torchrun launch.

    torchrun --nproc_per_node 2 tests/distributed/exactness_worker.py --out /tmp/exact.json

For each case (backbone x objective x mode x clean ring x batch kind x dtype) every rank builds the same tiny model
and batch and runs its own rows of the sharded layout; the summed losses and gradients of the group (and the
data-parallel mean across groups) must equal the single-process reference. The reference of a case is computed once,
by the rank that owns the case (cases dealt round-robin over the ranks), after all the sharded runs: the reduced
losses and gradients are the same on every rank, so one rank can compare them. Bytes recorded by the meter are checked
against the formulas of docs/design.md §3 on full-attention models, and on every model against the planner's
prediction (``hf_bdlm.planner.cost.kv_bytes_by_name``), name by name.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace

import torch
import torch.distributed as dist
from transformers import Gemma3TextConfig, LlamaConfig, Qwen3Config

from flat_reduce import all_reduce_flat
from shared_launch import join_process_group, leave_process_group
from hf_bdlm import BlockDiffusionConfig, BlockDiffusionForMaskedLM
from hf_bdlm.objectives import get_objective
from hf_bdlm.parallel.collectives import ByteMeter
from hf_bdlm.parallel.plan import ParallelDims, PlanConfig
from hf_bdlm.parallel.groups import BlockParallelGroups
from hf_bdlm.parallel.sharded import ShardedLayout
from hf_bdlm.planner.cost import kv_bytes_by_name, layer_windows, mask_rule_of, rank_work
from hf_bdlm.planner.model import model_spec

VOCAB, MASK, PAD = 96, 95, 0
L, B = 64, 4
HKV, HEAD_DIM = 2, 8


def backbone(name: str):
    kw = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=HKV, intermediate_size=48, pad_token_id=PAD)
    if name == "llama":
        return LlamaConfig(**kw, head_dim=HEAD_DIM)
    if name == "qwen3":
        return Qwen3Config(**kw, head_dim=HEAD_DIM)
    if name == "gemma3":
        return Gemma3TextConfig(**kw, head_dim=HEAD_DIM, sliding_window=10,
                                layer_types=["sliding_attention", "full_attention"])
    raise ValueError(name)


def float64_faithful_norms(model) -> None:
    """Make the backbone's RMSNorms compute in the input dtype (test-only).

    transformers' RMSNorms (Llama, Qwen3, Gemma 3) upcast to float32 internally; in a float64
    model that rounds every gradient crossing a norm to float32 precision (~1e-8 relative),
    which would hide reassociation-level differences behind the backbone's own mixed precision.
    The float64 cases swap in the same formula without the cast; float32 cases keep the real norms.
    """
    import types

    for module in model.modules():
        name = type(module).__name__
        if not name.endswith("RMSNorm"):
            continue
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
        gemma = name.startswith("Gemma")

        def forward(self, x, eps=eps, gemma=gemma):
            y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
            return y * (1.0 + self.weight) if gemma else self.weight * y

        module.forward = types.MethodType(forward, module)


def make_batch(kind: str, seed: int, batch_size: int = 2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, MASK, (batch_size, L), generator=g)
    completion = torch.ones(batch_size, L, dtype=torch.long)
    completion[:, :6] = 0  # prompt
    attention = torch.ones(batch_size, L, dtype=torch.long)
    batch = {"input_ids": ids, "completion_mask": completion, "attention_mask": attention,
             "sample_ids": torch.arange(batch_size) + 1000 * seed}
    if kind == "padded":
        attention[1, 41:] = 0
        ids[1, 41:] = PAD
        completion[1, 41:] = 0
    if kind == "packed":
        doc = torch.zeros(batch_size, L, dtype=torch.long)
        doc[0, 24:] = 1
        doc[0, 48:] = 2
        doc[1, 32:] = 1
        completion[0, 24:28] = 0
        completion[1, 32:36] = 0
        batch["document_ids"] = doc
    return batch


def build(case):
    """The case's tiny model (the same weights on every rank and for the reference) and its objective."""
    dtype = torch.float64 if case["dtype"] == "float64" else torch.float32
    torch.manual_seed(0)
    cfg = BlockDiffusionConfig(backbone_config=backbone(case["backbone"]), block_size=B, mask_token_id=MASK,
                               clean_attention=case["clean"], attention_backend=case["backend"])
    model = BlockDiffusionForMaskedLM(cfg).to(dtype)
    if dtype == torch.float64:
        float64_faithful_norms(model)
    return model, get_objective(case["objective"], cfg)


def run_sharded(case, groups_by_shape, world):
    """This rank's rows of its group's batch; returns the group-summed loss (mean over groups), the DDP-averaged
    gradients (the same on every rank) and the bytes the meter recorded."""
    dtype = torch.float64 if case["dtype"] == "float64" else torch.float32
    P, C, mode = case["P"], case["C"], case["mode"]
    groups = groups_by_shape[(P, C)]
    model, objective = build(case)
    num_groups = world // P
    batch = make_batch(case["batch"], seed=groups.group_index)
    corrupted = objective.corrupt(batch, seed=7, step=3)
    meter = groups.group.meter
    meter.next_step()
    plan_cfg = PlanConfig(ParallelDims(P, C, mode, cp_layout=case.get("cp_layout", "balanced")), seq_len=L, block_size=B)
    layout = ShardedLayout.build(plan_cfg, groups, model.mask_rule(), case["backend"], corrupted.document_ids,
                                 transport=case.get("transport", "allgather"))
    model.zero_grad()
    loss, _ = objective.loss(model, corrupted, layout)  # the step the reference runs, on this rank's rows
    (loss * P).backward()  # DDP averages over all W ranks
    total, *grads = all_reduce_flat([loss.reshape(1)] + [p.grad for p in model.parameters()])
    grads = [gr / world for gr in grads]
    result = dict(case, bytes=meter.by_name(), predicted_bytes=predicted_bytes(case, model, groups.group_rank,
                                                                         corrupted.clean_ids.shape[0]))
    # Expected K/V bytes received per rank (full-attention layers only; forward + backward). The paper's CP baseline
    # gathers the whole sequence on sliding layers too, so every layer of every backbone counts.
    if case["backbone"] != "gemma3" or case.get("cp_layout") == "paper":
        s = torch.finfo(dtype).bits // 8
        layers = model.config.backbone_config.num_hidden_layers
        per_kv = {"cp": (P - 1) / P * 2 * (2 * L), "csbp": (C - 1) / C * 2 * L, "bp": 0}[mode]
        expect = per_kv * HKV * HEAD_DIM * s * layers * corrupted.clean_ids.shape[0]
        names = meter.by_name()
        if case.get("transport") == "ring":
            # Backward re-rotates K/V ((C-1) shards) and walks dK/dV all the way home (C shards).
            ring = P if mode == "cp" else C
            got_fwd = names.get("kv.ring_kv", 0)
            got_bwd = names.get("kv_backward.ring_kv", 0)
            result.update(expect_bwd_grad_bytes=expect * ring / (ring - 1) if ring > 1 else 0,
                          bwd_grad_bytes=names.get("dkv.ring_dkv", 0))
        else:
            got_fwd = sum(v for k, v in names.items() if k.endswith("all_gather"))
            got_bwd = sum(v for k, v in names.items() if k.endswith("reduce_scatter"))
        result.update(expect_bytes=expect, fwd_bytes=got_fwd, bwd_bytes=got_bwd)
    return result, total.item() / num_groups, grads


def predicted_bytes(case, model, rank: int, batch: int) -> dict[str, int]:
    """The planner's K/V bytes of this rank, by the byte meter's names, for the case's model and layout (every
    layer: full ones gathered, sliding ones' halos, the paper's CP whole)."""
    spec = model_spec(model.config)
    dims = ParallelDims(case["P"], case["C"], case["mode"], transport=case.get("transport", "allgather"),
                        cp_layout=case.get("cp_layout", "balanced"))
    work = rank_work(replace(dims, transport="allgather"), L, mask_rule_of(spec), layer_windows(spec))[rank]
    s = torch.finfo(torch.float64 if case["dtype"] == "float64" else torch.float32).bits // 8
    return kv_bytes_by_name(spec, dims, work, s, batch)


def compare_with_reference(case, result, loss, grads, world):
    """The single-process reference of ``case`` (every group's batch on one process, DDP mean over the groups)
    against the sharded run's reduced ``loss`` and ``grads``."""
    model, objective = build(case)
    num_groups = world // case["P"]
    ref_grads = [torch.zeros_like(p) for p in model.parameters()]
    ref_loss = 0.0
    for gi in range(num_groups):
        corrupted = objective.corrupt(make_batch(case["batch"], seed=gi), seed=7, step=3)
        model.zero_grad()
        ref, _ = objective.loss(model, corrupted)
        ref.backward()
        ref_loss += ref.item() / num_groups
        for acc, p in zip(ref_grads, model.parameters()):
            acc += p.grad / num_groups
    rel = lambda a, b: (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
    errs = [(rel(a, b), n) for (n, _), a, b in zip(model.named_parameters(), grads, ref_grads)]
    grad_err, worst_param = max(errs)
    return dict(result, loss_err=abs(loss - ref_loss) / abs(ref_loss), grad_err=grad_err, worst_param=worst_param)


BACKBONE_OBJECTIVES = [(bb, obj) for bb in ("llama", "gemma3", "qwen3") for obj in ("standard", "fast_dllm_v2")]
BATCHES = ("plain", "padded", "packed")
# P > 2: each layout runs every backbone x objective once, the batch kind turning with the pair; the layouts start the
# turn at different kinds so that together they run every backbone x objective x batch kind at P > 2 (cp and csbp
# with C = P start alike: their bytes are compared case by case).
BATCH_TURN = {("cp", "P"): 0, ("csbp", "P"): 0, ("bp", 1): 1, ("csbp", 1): 2, ("csbp", 2): 1}


def float64_batches(P: int, mode: str, C: int, replicas: bool) -> list[tuple[str, str, str]]:
    """(backbone, objective, batch kind) of a layout's float64 all-gather cases: the whole product at P = 2 (P = 2's
    whole matrix, in the 2-process launch), one data-parallel case with replicas, a turn of batch kinds at P > 2."""
    if replicas:
        return [("llama", "standard", "padded")]
    if P == 2:
        return [(bb, obj, batch) for bb, obj in BACKBONE_OBJECTIVES for batch in BATCHES]
    turn = BATCH_TURN[(mode, "P" if C == P else C)]
    return [(bb, obj, BATCHES[(i + turn) % 3]) for i, (bb, obj) in enumerate(BACKBONE_OBJECTIVES)]


def cases(world: int):
    out = []
    for P in sorted({world, 2} if world >= 2 else {1}):
        if world % P:
            continue
        # With 4 processes, P = 2 runs as 2 data-parallel groups: that launch checks the data-parallel mean on a subset
        # (every layout in float32, one float64 case per layout); the 2-process launch runs P = 2's whole matrix.
        replicas = world // P > 1
        for mode, Cs in (("cp", [P]), ("bp", [1]), ("csbp", sorted({1, 2, P}))):
            for C in Cs:
                if P % C:
                    continue
                for bb, obj, batch in float64_batches(P, mode, C, replicas):
                    clean = "causal" if obj == "fast_dllm_v2" else "block_causal"
                    out.append(dict(P=P, C=C, mode=mode, backbone=bb, objective=obj, clean=clean,
                                    batch=batch, dtype="float64", backend="blockwise", transport="allgather"))
                if mode != "bp" and (C > 1 or mode == "cp") and not replicas:
                    for bb, obj, batch in (("llama", "standard", "plain"), ("llama", "fast_dllm_v2", "packed"),
                                           ("gemma3", "standard", "padded"), ("qwen3", "fast_dllm_v2", "plain")):
                        clean = "causal" if obj == "fast_dllm_v2" else "block_causal"
                        out.append(dict(P=P, C=C, mode=mode, backbone=bb, objective=obj, clean=clean, batch=batch,
                                        dtype="float64", backend="blockwise", transport="ring"))
                # float32 on every layout (both transports where the ring applies), the dense backend once
                for transport in ("allgather", "ring") if mode != "bp" and (C > 1 or mode == "cp") else ("allgather",):
                    out.append(dict(P=P, C=C, mode=mode, backbone="llama", objective="standard", clean="block_causal",
                                    batch="packed", dtype="float32", backend="blockwise", transport=transport))
                out.append(dict(P=P, C=C, mode=mode, backbone="gemma3", objective="fast_dllm_v2", clean="causal",
                                batch="padded", dtype="float32", backend="blockwise", transport="allgather"))
                out.append(dict(P=P, C=C, mode=mode, backbone="gemma3", objective="fast_dllm_v2", clean="causal",
                                batch="padded", dtype="float64", backend="dense", transport="allgather"))
        # The paper's CP baseline (contiguous clean shards, token slices of every noisy block, blocking gathers): every
        # backbone and objective in float64 (two batch kinds each at P = 2, one at P > 2, every kind over the six),
        # float32, and the dense backend once.
        paper = dict(P=P, C=P, mode="cp", cp_layout="paper", backend="blockwise", transport="allgather")
        for i, (bb, obj) in enumerate(BACKBONE_OBJECTIVES):
            clean = "causal" if obj == "fast_dllm_v2" else "block_causal"
            batches = (BATCHES[i % 3], BATCHES[(i + 1) % 3])
            if replicas and i:
                batches = ()
            elif P > 2:
                batches = batches[:1]
            for batch in batches:
                out.append(dict(paper, backbone=bb, objective=obj, clean=clean, batch=batch, dtype="float64"))
        out.append(dict(paper, backbone="llama", objective="standard", clean="block_causal", batch="packed",
                        dtype="float32"))
        out.append(dict(paper, backbone="gemma3", objective="fast_dllm_v2", clean="causal", batch="padded",
                        dtype="float32"))
        out.append(dict(paper, backbone="gemma3", objective="fast_dllm_v2", clean="causal", batch="padded",
                        dtype="float64", backend="dense"))
    return out


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started = join_process_group()
    world, rank = dist.get_world_size(), dist.get_rank()
    all_cases = cases(world)
    only = os.environ.get("EXACTNESS_ONLY")  # e.g. "mode=bp,backbone=llama" to debug a subset
    if only:
        want = dict(kv.split("=") for kv in only.split(","))
        all_cases = [c for c in all_cases if all(str(c.get(k)) == v for k, v in want.items())]
    groups_by_shape = {}
    for case in all_cases:
        key = (case["P"], case["C"])
        if key not in groups_by_shape:
            groups_by_shape[key] = BlockParallelGroups.create(case["P"], case["C"], ByteMeter())
    owned, results = [], []
    for index, case in enumerate(all_cases):
        result, loss, grads = run_sharded(case, groups_by_shape, world)
        if index % world == rank:
            owned.append((index, case, result, loss, grads))
    for index, case, result, loss, grads in owned:
        results.append((index, compare_with_reference(case, result, loss, grads, world)))
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump([r for _, r in sorted(r for rs in gathered for r in rs)], f, indent=1)
    leave_process_group(started)


if __name__ == "__main__":
    main()
