"""The layouts against the paper's own code: ``turbo-dllm`` 0.1.6 (``dllm_parallel``, a dev dependency).

The paper's CP baseline (``block_parallel_cp_layout="paper"``) must hold on every rank what the reference's CP-only
path holds: the contiguous clean shard of ``runtime_clean_layout`` (block-parallel size 1) and, in every noisy block,
the token offsets of ``active_query_offsets_for_context_rank``; DiffusionGemma's canvas is sliced the same way. The
balanced layouts are checked against the reference's too: balanced ``cp`` is its Megatron zigzag over the
``[noisy ; clean]`` rows (``context_parallel_sequence_intervals``), ``csbp`` with ``C = P`` its dual-chunk clean
shards and dual-end block schedule. Pure functions, no processes.
"""

from types import SimpleNamespace

import pytest
import torch
from dllm_parallel.core.attention.layout import (
    active_query_indices_for_context_rank,
    active_query_offsets_for_context_rank,
    clean_intervals,
    clean_intervals_for_runtime,
    context_parallel_sequence_intervals,
    runtime_clean_layout,
)
from dllm_parallel.core.schedules.block import build_block_schedule

from hf_bdlm.models.diffusion_gemma.training.sharded import canvas_slots
from hf_bdlm.parallel.dims import ParallelDims
from hf_bdlm.parallel.plan import PlanConfig, make_plan

# (P, B): every B a multiple of P; edge cases B = P (one offset per rank), B / P odd (one contiguous run), B / P = 2
# (a head and a tail of one offset each), and large blocks.
GRID = [(P, B) for P, Bs in ((2, (2, 4, 6, 8, 10, 16, 64)), (4, (4, 8, 12, 16, 20, 32, 64, 128)),
                             (8, (8, 16, 24, 40, 64, 128))) for B in Bs]
CPU = torch.device("cpu")


def _merged(intervals) -> tuple[tuple[int, int], ...]:
    out: list[list[int]] = []
    for start, stop in intervals:
        if out and out[-1][1] == start:
            out[-1][1] = stop
        elif stop > start:
            out.append([start, stop])
    return tuple((s, e) for s, e in out)


@pytest.mark.parametrize("P,B", GRID, ids=lambda v: str(v))
@pytest.mark.parametrize("blocks_per_rank", [1, 3])  # the shortest sequence the layout takes, and a longer one
def test_papers_cp_holds_the_reference_clean_shards_and_noisy_offsets(P, B, blocks_per_rank):
    L = P * B * blocks_per_rank
    plan = make_plan(PlanConfig(ParallelDims(P, P, "cp", cp_layout="paper"), L, B))
    runtime = SimpleNamespace(block_parallel_size=1)  # the reference's pure CP
    assert runtime_clean_layout(runtime) == "contiguous"
    shards = clean_intervals_for_runtime(L, P, runtime)
    for r, rp in enumerate(plan.ranks):
        assert rp.clean_positions == _merged(shards[r])
        offsets = active_query_offsets_for_context_rank(block_size=B, context_parallel_size=P,
                                                        context_parallel_rank=r, device=CPU)
        assert torch.equal(rp.noisy_offset_index(), offsets)
        active = active_query_indices_for_context_rank(active_len=L, block_size=B, context_parallel_size=P,
                                                       context_parallel_rank=r, device=CPU)
        assert torch.equal(rp.noisy_positions(), active)  # the same rows, in the same order
    # Over the group every noisy row is held once.
    held = torch.cat([rp.noisy_positions() for rp in plan.ranks])
    assert torch.equal(held.sort().values, torch.arange(L))


@pytest.mark.parametrize("P,B", [(2, 2), (2, 6), (4, 8), (4, 12), (8, 16), (8, 24)], ids=lambda v: str(v))
def test_diffusion_gemmas_papers_cp_slices_the_canvas_as_the_reference(P, B):
    # A frame of 4P blocks whose canvas is 2P blocks of it (the response), as DiffusionGemma's plan takes them.
    L = 4 * P * B
    canvas = tuple(range(P, 3 * P))
    plan = make_plan(PlanConfig(ParallelDims(P, P, "cp", cp_layout="paper"), L, B, noisy_blocks=canvas))
    frame = SimpleNamespace(canvas_blocks=torch.tensor(canvas), block_size=B)
    for r, rp in enumerate(plan.ranks):
        slots = canvas_slots(frame, rp.noisy_blocks, rp.noisy_offset_index())
        active = active_query_indices_for_context_rank(active_len=len(canvas) * B, block_size=B,
                                                       context_parallel_size=P, context_parallel_rank=r, device=CPU)
        assert torch.equal(slots, active)
        assert rp.clean_positions == _merged(clean_intervals(L, P, layout="contiguous")[r])


@pytest.mark.parametrize("P,B", [(2, 4), (4, 8), (8, 4)], ids=lambda v: str(v))
def test_balanced_layouts_are_the_references_zigzag_and_dual_end_schedule(P, B):
    L = 4 * P * B
    cp = make_plan(PlanConfig(ParallelDims(P, P, "cp"), L, B))
    csbp = make_plan(PlanConfig(ParallelDims(P, P, "csbp"), L, B))
    schedule = build_block_schedule(num_blocks=L // B, block_parallel_size=P, context_parallel_size=P)
    for r in range(P):
        zigzag = context_parallel_sequence_intervals(seq_len=L, context_parallel_size=P, rank=r)  # of [noisy ; clean]
        assert torch.equal(cp.ranks[r].global_row_index(), torch.cat([torch.arange(s, e) for s, e in zigzag]))
        assert csbp.ranks[r].clean_positions == _merged(clean_intervals(L, P, layout="dual_chunk")[r])
        assert csbp.ranks[r].noisy_blocks == tuple(sorted(schedule.active_blocks_by_worker[r]))
