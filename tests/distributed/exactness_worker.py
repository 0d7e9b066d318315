"""Worker for tests/test_parallel_exactness.py: many layouts checked inside one torchrun launch.

    torchrun --nproc_per_node 2 tests/distributed/exactness_worker.py --out /tmp/exact.json

For each case (backbone x objective x mode x clean ring x batch kind x dtype) every rank builds
the same tiny model and batch, computes the single-process reference loss and gradients
locally, then runs its own rows of the sharded layout; the summed losses and gradients of the
group (and the data-parallel mean across groups) must equal the reference. Bytes recorded by
the meter are checked against the formulas of docs/design.md §3 on full-attention models.
"""

from __future__ import annotations

import argparse
import json
import os
import traceback

import torch
import torch.distributed as dist
from transformers import Gemma3TextConfig, LlamaConfig, Qwen3Config

from hf_bdlm import BlockDiffusionConfig, BlockDiffusionForMaskedLM
from hf_bdlm.objectives import get_objective
from hf_bdlm.parallel.collectives import ByteMeter
from hf_bdlm.parallel.plan import ParallelDims, PlanConfig
from hf_bdlm.parallel.groups import BlockParallelGroups
from hf_bdlm.parallel.sharded import ShardedLayout

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


def run_case(case, groups_by_shape, world, rank):
    dtype = torch.float64 if case["dtype"] == "float64" else torch.float32
    P, C, mode = case["P"], case["C"], case["mode"]
    groups = groups_by_shape[(P, C)]
    torch.manual_seed(0)
    cfg = BlockDiffusionConfig(backbone_config=backbone(case["backbone"]), block_size=B, mask_token_id=MASK,
                               clean_attention=case["clean"], attention_backend=case["backend"])
    model = BlockDiffusionForMaskedLM(cfg).to(dtype)
    if dtype == torch.float64:
        float64_faithful_norms(model)
    objective = get_objective(case["objective"], cfg)
    num_groups = world // P
    # Reference: every group's batch on one process, DDP mean over groups.
    ref_grads = [torch.zeros_like(p) for p in model.parameters()]
    ref_loss = 0.0
    for gi in range(num_groups):
        corrupted = objective.corrupt(make_batch(case["batch"], seed=gi), seed=7, step=3)
        model.zero_grad()
        loss, _ = objective.loss(model, corrupted)
        loss.backward()
        ref_loss += loss.item() / num_groups
        for acc, p in zip(ref_grads, model.parameters()):
            acc += p.grad / num_groups
    # Sharded: this rank's rows of its group's batch.
    batch = make_batch(case["batch"], seed=groups.group_index)
    corrupted = objective.corrupt(batch, seed=7, step=3)
    meter = groups.group.meter
    meter.next_step()
    plan_cfg = PlanConfig(ParallelDims(P, C, mode, cp_layout=case.get("cp_layout", "balanced")), seq_len=L, block_size=B)
    layout = ShardedLayout.build(plan_cfg, groups, model.mask_rule(), case["backend"], corrupted.document_ids,
                                 transport=case.get("transport", "allgather"))
    model.zero_grad()
    loss, _ = objective.loss(model, corrupted, layout)  # the step the reference ran, on this rank's rows
    (loss * P).backward()  # DDP averages over all W ranks
    total = loss.detach().clone()
    dist.all_reduce(total)
    total = total.item() / num_groups
    grads = [p.grad.clone() for p in model.parameters()]
    for gr in grads:
        dist.all_reduce(gr)
        gr /= world
    rel = lambda a, b: (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
    errs = [(rel(a, b), n) for (n, _), a, b in zip(model.named_parameters(), grads, ref_grads)]
    grad_err, worst_param = max(errs)
    loss_err = abs(total - ref_loss) / abs(ref_loss)
    result = dict(case, loss_err=loss_err, grad_err=grad_err, worst_param=worst_param, bytes=meter.by_name())
    # Expected K/V bytes received per rank (full-attention layers only; forward + backward). The paper's CP baseline
    # gathers the whole sequence on sliding layers too, so every layer of every backbone counts.
    if case["backbone"] != "gemma3" or case.get("cp_layout") == "paper":
        s = torch.finfo(dtype).bits // 8
        layers = cfg.backbone_config.num_hidden_layers
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
    return result


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
                for bb in ("llama", "gemma3", "qwen3"):
                    for obj in ("standard", "fast_dllm_v2"):
                        clean = "causal" if obj == "fast_dllm_v2" else "block_causal"
                        for batch in ("plain", "padded", "packed"):
                            if replicas and (bb, obj, batch) != ("llama", "standard", "padded"):
                                continue
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
        # backbone and objective, each batch kind, float64 and float32, and the dense backend once.
        paper = dict(P=P, C=P, mode="cp", cp_layout="paper", backend="blockwise", transport="allgather")
        for i, (bb, obj) in enumerate((b, o) for b in ("llama", "gemma3", "qwen3") for o in ("standard", "fast_dllm_v2")):
            clean = "causal" if obj == "fast_dllm_v2" else "block_causal"
            for batch in (("plain", "padded", "packed")[i % 3], ("plain", "padded", "packed")[(i + 1) % 3]):
                if replicas and i:
                    break
                out.append(dict(paper, backbone=bb, objective=obj, clean=clean, batch=batch, dtype="float64"))
        out.append(dict(paper, backbone="llama", objective="standard", clean="block_causal", batch="packed",
                        dtype="float32"))
        out.append(dict(paper, backbone="gemma3", objective="fast_dllm_v2", clean="causal", batch="padded",
                        dtype="float32"))
        out.append(dict(paper, backbone="gemma3", objective="fast_dllm_v2", clean="causal", batch="padded",
                        dtype="float64", backend="dense"))
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
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
    results = []
    for case in all_cases:
        try:
            results.append(run_case(case, groups_by_shape, world, rank))
        except Exception:
            results.append(dict(case, error=traceback.format_exc()))
            raise
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
