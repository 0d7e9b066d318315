"""Worker for tests/models/diffusion_gemma/test_parallel.py: DiffusionGemma layouts against the single process, one
launch.

    torchrun --nproc_per_node 2 tests/distributed/diffusion_gemma_worker.py --out /tmp/dg.json

For each case (P, mode, clean ring C, transport, self-conditioning, batch kind, dtype) every rank builds the same tiny
DiffusionGemma and batch, computes the single-process loss and gradients (`DiffusionGemmaObjective.loss` with the
default frame) and then its own rows of the sharded layout (the frame padded as the layout needs); the group's summed
losses and the data-parallel mean of the gradients must equal the reference. K/V bytes received are recorded with
the formulas of hf_bdlm/models/diffusion_gemma/training/sharded.py: all-gathers of the full layer and the W - 1 halos of the
sliding layer.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from flat_reduce import all_reduce_flat
from shared_launch import join_process_group, leave_process_group
from tiny_diffusion_gemma import B, EOS, HEAD_DIM, HKV, TURN_END, VOCAB, W, float64_faithful, make_batch, tiny_model

from hf_bdlm.models.diffusion_gemma.modeling import diffusion_gemma_rule
from hf_bdlm.objectives import get_objective
from hf_bdlm.parallel.collectives import ByteMeter
from hf_bdlm.models.diffusion_gemma.training.sharded import ShardedDiffusionGemmaLayout, frame_padding
from hf_bdlm.parallel.dims import ParallelDims
from hf_bdlm.parallel.groups import BlockParallelGroups
from hf_bdlm.parallel.plan import PlanConfig

SEED, STEP = 7, 0  # at step 0 one sample of each batch self-conditions and the other does not (probability 0.5)
SELF_CONDITIONING = {"off": 0.0, "mixed": 0.5}


def objective(self_conditioning: str, dims: ParallelDims | None = None):
    frame_multiple, canvas_multiple = frame_padding(dims, B) if dims else (None, None)
    return get_objective("diffusion_gemma", dict(
        block_size=B, vocab_size=VOCAB, fill_token_id=EOS, end_token_ids={EOS, TURN_END}, noise_eps_min=0.1,
        noise_eps_max=0.9, self_conditioning_prob=SELF_CONDITIONING[self_conditioning],
        pad_to_multiple_of=frame_multiple, canvas_blocks_multiple_of=canvas_multiple))


def build_model(dtype: str):
    model = tiny_model().train()
    return float64_faithful(model) if dtype == "float64" else model


def halo_rows(ranges, starts, held) -> int:
    """Clean positions in ``[s - W + 1, s)`` for a start ``s`` of ``starts`` that are not ``held``: what a rank must
    receive on the sliding layer."""
    needed = set()
    for s in starts:
        needed |= set(range(max(0, s - W + 1), s))
    return len(needed - held)


def expected_bytes(case, layout, corrupted, dtype) -> dict:
    """K/V bytes this rank receives per the table of hf_bdlm/models/diffusion_gemma/training/sharded.py."""
    frame = corrupted.frame
    s = torch.finfo(dtype).bits // 8
    b, F, Nc = frame.clean_ids.shape[0], frame.frame_length, frame.num_canvas_rows
    n = layout.comm.size
    share = (n - 1) / n
    per_row = 2 * HKV * HEAD_DIM * s * b  # K and V of one row, every sequence of the batch
    # The paper's CP baseline gathers whole layers on the sliding layer too (the tiny model: one sliding, one full).
    paper = case.get("cp_layout") == "paper"
    layers = 2 if paper else 1
    encoder = layers * share * F * per_row
    decoder = layers * share * (F + Nc if case["mode"] == "cp" else F) * per_row
    passes = 2 if SELF_CONDITIONING[case["self_conditioning"]] > 0 and bool(corrupted.self_conditioning.any()) else 1
    rp = layout.plan.ranks[layout.groups.group_rank]
    held = set(rp.clean_position_index().tolist())
    window = 0
    if n > 1 and not paper:
        clean_starts = [start for start, _ in rp.clean_positions]
        block_starts = [blk * B for blk in rp.noisy_blocks]
        window = (halo_rows(rp.clean_positions, clean_starts, held)
                  + passes * halo_rows(None, block_starts, held)) * per_row
    return {"fwd": encoder + passes * decoder, "bwd": encoder + decoder, "window": window, "ring": n}


def run_sharded(case, groups, world):
    """This rank's rows of its group's batch, the frame padded as the layout needs: the group-summed loss (mean over
    groups), the DDP-averaged gradients by name (the same on every rank) and the bytes every rank received."""
    dtype = torch.float64 if case["dtype"] == "float64" else torch.float32
    P, C, mode = case["P"], case["C"], case["mode"]
    model = build_model(case["dtype"])
    num_groups = world // P
    dims = ParallelDims(P, C, mode, transport=case["transport"], cp_layout=case.get("cp_layout", "balanced"))
    sharded = objective(case["self_conditioning"], dims)
    corrupted = sharded.corrupt(make_batch(case["batch"], seed=groups.group_index), seed=SEED, step=STEP)
    frame = corrupted.frame
    plan = groups.plan(PlanConfig(dims, frame.frame_length, B, noisy_blocks=tuple(frame.canvas_blocks.tolist())))
    layout = ShardedDiffusionGemmaLayout(plan, groups, frame, diffusion_gemma_rule(B), "blockwise", case["transport"])
    meter = groups.group.meter
    meter.next_step()
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss, _ = sharded.loss(model, corrupted, layout)
    (loss * P).backward()  # DDP averages over all W ranks
    seconds = time.perf_counter() - start
    params = list(model.named_parameters())
    total, *summed = all_reduce_flat([loss.reshape(1)] + [torch.zeros_like(p) if p.grad is None else p.grad
                                                          for _, p in params])
    grads = {n: grad / world for (n, _), grad in zip(params, summed)}
    names = meter.by_name()
    if case["transport"] == "ring":
        got = {"fwd": names.get("kv.ring_kv", 0), "bwd": names.get("kv_backward.ring_kv", 0),
               "dkv": names.get("dkv.ring_dkv", 0)}
    else:
        got = {"fwd": sum(v for k, v in names.items() if k.endswith("all_gather")),
               "bwd": sum(v for k, v in names.items() if k.endswith("reduce_scatter"))}
    got["window"] = sum(v for k, v in names.items() if "window" in k and k.endswith("all_to_all"))
    per_rank = [None] * world  # every rank's bytes against its own expectation
    dist.all_gather_object(per_rank, (got, expected_bytes(case, layout, corrupted, dtype)))
    result = dict(case, bytes=[g for g, _ in per_rank], expect=[e for _, e in per_rank], seconds=seconds,
                  frame=frame.frame_length, canvas_rows=frame.num_canvas_rows,
                  nonzero_grads=sum(1 for _, p in model.named_parameters() if p.grad is not None))
    return result, total.item() / num_groups, grads


def compare_with_reference(case, result, loss, grads, world):
    """The single-process reference of ``case`` (every group's batch on one process with the default frame, mean over
    the data-parallel groups) against the sharded run's reduced ``loss`` and ``grads``."""
    model = build_model(case["dtype"])
    num_groups = world // case["P"]
    reference = objective(case["self_conditioning"])
    ref_grads = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    ref_loss = 0.0
    for gi in range(num_groups):
        model.zero_grad(set_to_none=True)
        ref, _ = reference.loss(model, reference.corrupt(make_batch(case["batch"], seed=gi), seed=SEED, step=STEP))
        ref.backward()
        ref_loss += ref.item() / num_groups
        for n, p in model.named_parameters():
            if p.grad is not None:
                ref_grads[n] += p.grad / num_groups
    rel = lambda a, b: (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)
    grad_err, worst = max((rel(grads[n], ref_grads[n]), n) for n in ref_grads)
    return dict(result, loss_err=abs(loss - ref_loss) / abs(ref_loss), grad_err=grad_err, worst_param=worst,
                loss=ref_loss)


VARIANTS = (("float32", "mixed", "packed"), ("float32", "off", "plain"), ("float64", "mixed", "plain"),
            ("float64", "off", "packed"))
# P > 2 runs two variants per layout, each pair both dtypes and both self-conditioning settings on one batch kind:
# the layouts alternate the pairs (every variant on four layouts); cp and csbp with C = P take the same pair on each
# transport, so that their bytes compare.
PAIRS = {"packed": (VARIANTS[0], VARIANTS[3]), "plain": (VARIANTS[1], VARIANTS[2])}
PAIR_OF_LAYOUT = {("cp", "P", "allgather"): "packed", ("cp", "P", "ring"): "plain", ("bp", 1, "allgather"): "packed",
                  ("csbp", 1, "allgather"): "plain", ("csbp", 2, "allgather"): "plain", ("csbp", 2, "ring"): "packed",
                  ("csbp", "P", "allgather"): "packed", ("csbp", "P", "ring"): "plain"}


def cases(world: int) -> list[dict]:
    """Every layout of P = world (cp, bp, csbp with C in {1, 2, P}; ring transport where a ring exists): at P = 2 in
    the four variants of dtype x self-conditioning x batch, at P > 2 in two of them (:data:`PAIR_OF_LAYOUT`); the
    paper's CP baseline in the four; with 4 processes also P = 2 x 2 data-parallel groups."""
    out = []
    P = world
    layouts = [("cp", P, "allgather"), ("cp", P, "ring"), ("bp", 1, "allgather"), ("csbp", 1, "allgather")]
    layouts += [("csbp", C, t) for C in sorted({2, P}) for t in ("allgather", "ring")]
    for mode, C, transport in layouts:
        variants = VARIANTS if P == 2 else PAIRS[PAIR_OF_LAYOUT[(mode, "P" if C == P else C, transport)]]
        for dtype, sc, batch in variants:
            out.append(dict(P=P, C=C, mode=mode, transport=transport, dtype=dtype, self_conditioning=sc, batch=batch))
    for dtype, sc, batch in VARIANTS:  # the paper's CP baseline layout (token slices of every canvas block)
        out.append(dict(P=P, C=P, mode="cp", transport="allgather", cp_layout="paper", dtype=dtype,
                        self_conditioning=sc, batch=batch))
    if world == 4:  # data parallelism: two groups of P = 2, each its own batch, gradients averaged over the world
        for mode, C, transport, (dtype, sc, batch) in (("csbp", 2, "allgather", VARIANTS[0]),
                                                       ("cp", 2, "ring", VARIANTS[2]), ("bp", 1, "allgather", VARIANTS[3])):
            out.append(dict(P=2, C=C, mode=mode, transport=transport, dtype=dtype, self_conditioning=sc, batch=batch))
    return out


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started = join_process_group()
    world = dist.get_world_size()
    todo = cases(world)
    only = os.environ.get("EXACTNESS_ONLY")  # e.g. "mode=cp,dtype=float32" to debug a subset
    if only:
        want = dict(kv.split("=") for kv in only.split(","))
        todo = [c for c in todo if all(str(c.get(k)) == v for k, v in want.items())]
    groups = {}
    owned, results = [], []
    for index, case in enumerate(todo):
        key = (case["P"], case["C"])
        if key not in groups:
            groups[key] = BlockParallelGroups.create(case["P"], case["C"], ByteMeter())
        result, loss, grads = run_sharded(case, groups[key], world)
        if index % world == dist.get_rank():
            owned.append((index, case, result, loss, grads))
    # Each case's reference once, on the rank that owns it (the reduced loss and gradients are the same everywhere).
    for index, case, result, loss, grads in owned:
        results.append((index, compare_with_reference(case, result, loss, grads, world)))
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    results = [r for _, r in sorted(r for rs in gathered for r in rs)]
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    leave_process_group(started)


if __name__ == "__main__":
    main()
