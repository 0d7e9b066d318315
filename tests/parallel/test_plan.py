"""Specifications of the block-parallel layout plan (hf_bdlm/parallel/plan.py).

Pure and fast (no processes): ``python -m pytest tests/parallel/test_plan.py -q``.
"""

from __future__ import annotations

import pytest
import torch

from hf_bdlm.attention.masks import CLEAN, NOISY, MaskRule, count_allowed_pairs, dense_mask
from hf_bdlm.attention.rows import vectorized_rows
from hf_bdlm.parallel.plan import ParallelDims, PlanConfig, make_plan

SCHEDULES = ("dual_end", "contiguous")


def _valid_layouts():
    """(mode, P, C, schedule) for P in {1,2,4,8}, C in {1,2,P}, plus the hybrid C=4 of P=8."""
    layouts = []
    for P in (1, 2, 4, 8):
        layouts.append(("cp", P, P, "dual_end"))
        layouts += [("bp", P, 1, s) for s in SCHEDULES]
        rings = sorted({C for C in (1, 2, P) if P % C == 0} | ({4} if P == 8 else set()))
        layouts += [("csbp", P, C, s) for C in rings for s in SCHEDULES]
    return layouts


LAYOUTS = _valid_layouts()

HYBRID = [(4, 2), (8, 2), (8, 4)]


def _plan(mode, P, C, schedule, block_size=4, blocks_per_multiple=2):
    L = blocks_per_multiple * ParallelDims(P, C, mode, schedule).required_multiple(block_size)
    return make_plan(PlanConfig(ParallelDims(P, C, mode, schedule), L, block_size))


def _ids(layout):
    mode, P, C, schedule = layout
    return f"{mode}-P{P}-C{C}-{schedule}"


def _work(plan, rule, queries="all"):
    """Allowed query-key pairs per rank; keys are all 2L rows, since the rule masks the rest."""
    keys = vectorized_rows(plan.config.seq_len)
    out = []
    for r in plan.ranks:
        rows = r.rows()
        if queries == "noisy":
            rows = rows.slice(0, r.local_noisy_rows)
        out.append(count_allowed_pairs(rows, keys, rule))
    return out


def _imbalance(work):
    return max(work) / (sum(work) / len(work))


# --- ownership -------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids)
def test_every_noisy_block_is_owned_exactly_once_per_group(layout):
    plan = _plan(*layout)
    owned = sorted(b for r in plan.ranks for b in r.noisy_blocks)
    assert owned == list(range(plan.config.num_blocks))


@pytest.mark.parametrize("layout", [lay for lay in LAYOUTS if lay[0] == "csbp"], ids=_ids)
def test_csbp_every_clean_position_is_held_exactly_once_per_ring(layout):
    plan = _plan(*layout)
    L, C = plan.config.seq_len, plan.config.clean_ring_size
    for ring in range(plan.config.group_size // C):
        members = plan.ring_members(ring * C)
        held = torch.cat([plan.ranks[m].clean_position_index() for m in members])
        assert sorted(held.tolist()) == list(range(L))


@pytest.mark.parametrize("layout", [lay for lay in LAYOUTS if lay[0] == "csbp"], ids=_ids)
def test_csbp_noisy_blocks_lie_in_the_ranks_own_clean_shard(layout):
    plan = _plan(*layout)
    B = plan.config.block_size
    for r in plan.ranks:
        clean = set(r.clean_position_index().tolist())
        assert all(set(range(b * B, (b + 1) * B)) <= clean for b in r.noisy_blocks)


@pytest.mark.parametrize("layout", [lay for lay in LAYOUTS if lay[0] == "bp"], ids=_ids)
def test_bp_clean_prefix_runs_from_zero_to_the_end_of_the_last_owned_block(layout):
    plan = _plan(*layout)
    B = plan.config.block_size
    for r in plan.ranks:
        assert r.clean_positions == ((0, (max(r.noisy_blocks) + 1) * B),)


@pytest.mark.parametrize("P", [1, 2, 4, 8])
def test_cp_ranks_cover_all_vectorized_rows_exactly_once(P):
    plan = _plan("cp", P, P, "dual_end")
    held = torch.cat([r.global_row_index() for r in plan.ranks])
    assert sorted(held.tolist()) == list(range(2 * plan.config.seq_len))


@pytest.mark.parametrize("P", [1, 2, 4, 8])
def test_cp_rank_holds_zigzag_chunks_r_and_2P_minus_1_minus_r_in_chunk_order(P):
    plan = _plan("cp", P, P, "dual_end")
    chunk = 2 * plan.config.seq_len // (2 * P)
    for r in plan.ranks:
        expected = list(range(r.rank * chunk, (r.rank + 1) * chunk))
        expected += list(range((2 * P - 1 - r.rank) * chunk, (2 * P - r.rank) * chunk))
        assert r.global_row_index().tolist() == expected


@pytest.mark.parametrize("P", [2, 4, 8])
def test_bp_dual_end_deals_block_pairs_round_robin(P):
    plan = _plan("bp", P, 1, "dual_end")
    N = plan.config.num_blocks
    for r in plan.ranks:
        pairs = range(r.rank, N // 2, P)
        assert r.noisy_blocks == tuple(sorted(b for j in pairs for b in (j, N - 1 - j)))


@pytest.mark.parametrize("mode", ["bp", "csbp"])
def test_contiguous_schedule_gives_rank_r_blocks_r_N_over_P_onwards(mode):
    P = 4
    plan = _plan(mode, P, 1 if mode == "bp" else P, "contiguous")
    n = plan.config.num_blocks // P
    for r in plan.ranks:
        assert r.noisy_blocks == tuple(range(r.rank * n, (r.rank + 1) * n))


@pytest.mark.parametrize("P", [2, 4, 8])
def test_csbp_full_ring_shards_clean_head_tail_and_owns_the_blocks_of_its_chunks(P):
    plan = _plan("csbp", P, P, "dual_end")
    B, n = plan.config.block_size, plan.config.num_blocks // (2 * P)
    for r in plan.ranks:
        c = r.ring_rank
        blocks = list(range(c * n, (c + 1) * n)) + list(range((2 * P - 1 - c) * n, (2 * P - c) * n))
        assert list(r.noisy_blocks) == blocks
        assert r.clean_position_index().tolist() == [p for b in blocks for p in range(b * B, (b + 1) * B)]


@pytest.mark.parametrize("P", [2, 4, 8])
def test_csbp_full_ring_contiguous_gives_ring_rank_c_positions_c_L_over_C_onwards(P):
    plan = _plan("csbp", P, P, "contiguous")
    shard = plan.config.seq_len // P
    for r in plan.ranks:
        assert r.clean_positions == ((r.ring_rank * shard, (r.ring_rank + 1) * shard),)


@pytest.mark.parametrize("P,C", HYBRID)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_hybrid_csbp_splits_group_into_rings_of_consecutive_ranks(P, C, schedule):
    plan = _plan("csbp", P, C, schedule)
    for r in plan.ranks:
        assert (r.ring, r.ring_rank) == divmod(r.rank, C)
        assert plan.ring_members(r.rank) == tuple(range(r.ring * C, (r.ring + 1) * C))
        # Same ring rank in every ring: the same clean shard, disjoint noisy blocks.
        twins = [t for t in plan.ranks if t.ring_rank == r.ring_rank]
        assert all(t.clean_positions == r.clean_positions for t in twins)
        assert len({b for t in twins for b in t.noisy_blocks}) == sum(len(t.noisy_blocks) for t in twins)


@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids)
def test_every_rank_owns_the_same_number_of_noisy_rows(layout):
    plan = _plan(*layout)
    assert len({r.local_noisy_rows for r in plan.ranks}) == 1


@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids)
def test_loss_rows_count_every_vectorized_row_exactly_once_per_group(layout):
    plan = _plan(*layout)
    counted = torch.cat([r.global_row_index()[r.loss_row_mask()] for r in plan.ranks])
    assert sorted(counted.tolist()) == list(range(2 * plan.config.seq_len))


@pytest.mark.parametrize("mode", ["cp", "bp", "csbp"])
def test_single_rank_plan_is_the_vectorized_layout(mode):
    plan = _plan(mode, 1, 1, "dual_end")
    assert plan.ranks[0].global_row_index().tolist() == list(range(2 * plan.config.seq_len))


# --- row metadata and gathered keys ----------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids)
def test_rows_match_global_row_index_into_vectorized_rows(layout):
    plan = _plan(*layout)
    L = plan.config.seq_len
    doc = torch.arange(L).div(2 * plan.config.block_size, rounding_mode="floor")[None].repeat(2, 1)
    for r in plan.ranks:
        expected = vectorized_rows(L, doc).select(r.global_row_index())
        got = r.rows(doc)
        assert torch.equal(got.stream, expected.stream)
        assert torch.equal(got.pos, expected.pos)
        assert torch.equal(got.doc, expected.doc)
        assert got.num_rows == r.local_noisy_rows + r.local_clean_rows


@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids)
def test_local_layout_is_noisy_blocks_ascending_then_clean_ascending(layout):
    plan = _plan(*layout)
    for r in plan.ranks:
        rows = r.rows()
        n = r.local_noisy_rows
        assert (rows.stream[:n] == NOISY).all() and (rows.stream[n:] == CLEAN).all()
        assert (rows.pos[:n].diff() > 0).all() and (rows.pos[n:].diff() > 0).all()


@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids)
def test_gathered_key_rows_match_their_global_index(layout):
    plan = _plan(*layout)
    L = plan.config.seq_len
    for r in plan.ranks:
        index = plan.gathered_key_global_index(r.rank)
        expected = vectorized_rows(L).select(index)
        got = plan.gathered_key_rows(r.rank)
        assert torch.equal(got.stream, expected.stream) and torch.equal(got.pos, expected.pos)


@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids)
def test_gathered_keys_are_the_concatenation_over_ring_members(layout):
    plan = _plan(*layout)
    mode = plan.config.mode
    for r in plan.ranks:
        got = plan.gathered_key_global_index(r.rank).tolist()
        if mode == "bp":
            assert got == []
            continue
        expected = []
        for m in plan.ring_members(r.rank):
            index = plan.ranks[m].global_row_index()
            expected += (index if mode == "cp" else index[plan.ranks[m].local_noisy_rows :]).tolist()
        assert got == expected


@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids)
def test_every_allowed_key_of_a_local_query_is_local_or_gathered(layout):
    """No rank misses a key: block-causal clean attention allows a superset of causal."""
    plan = _plan(*layout)
    L = plan.config.seq_len
    keys = vectorized_rows(L)
    rule = MaskRule(plan.config.block_size)
    for r in plan.ranks:
        available = torch.zeros(2 * L, dtype=torch.bool)
        if plan.config.mode == "cp":
            available[plan.gathered_key_global_index(r.rank)] = True
        else:
            # bp and csbp attend their own noisy rows locally (bp also its clean prefix).
            local = r.global_row_index()
            available[local if plan.config.mode == "bp" else local[: r.local_noisy_rows]] = True
            available[plan.gathered_key_global_index(r.rank)] = True
        needed = dense_mask(r.rows(), keys, rule)[0].any(0)
        assert not (needed & ~available).any()


@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids)
def test_gathered_key_count_matches_the_mode(layout):
    plan = _plan(*layout)
    L = plan.config.seq_len
    expected = {"cp": 2 * L, "bp": 0, "csbp": L}[plan.config.mode]
    assert all(plan.gathered_key_global_index(r.rank).numel() == expected for r in plan.ranks)


def test_ring_members_of_each_mode():
    assert make_plan(PlanConfig(ParallelDims(4, mode="cp"), 64, 4)).ring_members(2) == (0, 1, 2, 3)
    assert make_plan(PlanConfig(ParallelDims(4, mode="bp"), 64, 4)).ring_members(2) == (2,)
    assert make_plan(PlanConfig(ParallelDims(4, mode="csbp"), 64, 4)).ring_members(2) == (0, 1, 2, 3)
    assert make_plan(PlanConfig(ParallelDims(4, 2, mode="csbp"), 64, 4)).ring_members(3) == (2, 3)


# --- work balance ----------------------------------------------------------------------------

BALANCE_RULES = [MaskRule(8, "block_causal"), MaskRule(8, "causal")]
BALANCED = [("cp", P, P) for P in (2, 4, 8)] + [("csbp", P, P) for P in (2, 4, 8)]
BALANCED += [("csbp", P, C) for P, C in HYBRID]


@pytest.mark.parametrize("rule", BALANCE_RULES, ids=lambda r: r.clean_attention)
@pytest.mark.parametrize("mode,P,C", [pytest.param(*b, id=f"{b[0]}-P{b[1]}-C{b[2]}") for b in BALANCED])
@pytest.mark.parametrize("blocks_per_rank", [4, 8])
def test_cp_and_csbp_dual_end_balance_attention_work_within_5_percent(mode, P, C, rule, blocks_per_rank):
    # Measured: exactly 1.000 — a zigzag chunk pair (or dual-end block pair) has the same cost
    # on every rank because per-block cost is linear in the block index.
    plan = make_plan(PlanConfig(ParallelDims(P, C, mode), blocks_per_rank * P * 8, 8))
    assert _imbalance(_work(plan, rule)) <= 1.05


@pytest.mark.parametrize("rule", BALANCE_RULES, ids=lambda r: r.clean_attention)
@pytest.mark.parametrize("P", [2, 4, 8])
def test_bp_dual_end_balances_noisy_query_work_within_5_percent(P, rule):
    # Every pair (j, N-1-j) costs (N+1) B^2 noisy pairs, so this is exact at N = 4P already.
    plan = make_plan(PlanConfig(ParallelDims(P, mode="bp"), 4 * P * 8, 8))
    assert _imbalance(_work(plan, rule, queries="noisy")) <= 1.05


@pytest.mark.parametrize("rule", BALANCE_RULES, ids=lambda r: r.clean_attention)
@pytest.mark.parametrize("P", [2, 4, 8])
def test_bp_dual_end_balances_total_work_within_5_percent_once_blocks_reach_20_per_rank(P, rule):
    # bp replicates the clean prefix: rank r's last block is at best N-1-r (distinct per rank),
    # so its clean work is ~(N-r)^2 B^2/2 and the busiest rank exceeds the mean by about
    # P(P-1)/(N(P+1)) whatever the dealing: measured 1.08 / 1.16 / 1.22 at N = 4P for
    # P = 2 / 4 / 8, so 5% cannot hold there. Noisy work is exactly balanced (above), and
    # the replicated-prefix excess falls under 5% from N = 20P (measured 1.04 at P = 8).
    plan = make_plan(PlanConfig(ParallelDims(P, mode="bp"), 20 * P * 4, 4))
    assert _imbalance(_work(plan, MaskRule(4, rule.clean_attention))) <= 1.05


@pytest.mark.parametrize("P", [2, 4, 8])
def test_bp_dual_end_imbalance_at_4_blocks_per_rank_is_only_the_replicated_prefix(P):
    rule = MaskRule(8)
    plan = make_plan(PlanConfig(ParallelDims(P, mode="bp"), 4 * P * 8, 8))
    total, noisy = _work(plan, rule), _work(plan, rule, queries="noisy")
    N, B = plan.config.num_blocks, 8
    # Block-causal clean prefix through block m: sum_{i<=m} (i+1) B^2; rank r ends at N-1-r.
    prefix = [(N - r) * (N - r + 1) // 2 * B * B for r in range(P)]
    assert [t - n for t, n in zip(total, noisy)] == prefix
    assert len(set(noisy)) == 1


# --- validation ------------------------------------------------------------------------------


INVALID = [
    ("ring_not_dividing_group", dict(group_size=4, clean_ring_size=3, mode="csbp"),
     r"clean_ring_size=3 does not divide group_size=4"),
    ("ring_in_bp", dict(group_size=4, clean_ring_size=2, mode="bp"), r"mode='bp'.*clean_ring_size.*got 2"),
    ("ring_smaller_than_group_in_cp", dict(group_size=4, clean_ring_size=2, mode="cp"),
     r"mode='cp'.*group_size=4, got 2"),
    ("contiguous_cp", dict(group_size=4, mode="cp", schedule="contiguous"),
     r"mode='cp'.*schedule='contiguous'"),
    ("unknown_mode", dict(group_size=4, mode="tp"), r"mode must be one of .*got 'tp'"),
    ("unknown_schedule", dict(group_size=4, mode="bp", schedule="snake"),
     r"schedule must be one of .*got 'snake'"),
    ("length_not_multiple_of_block", dict(seq_len=66, group_size=2, mode="bp"),
     r"seq_len=66 is not a multiple of block_size=4"),
    ("too_few_blocks_csbp", dict(seq_len=24, group_size=4, mode="csbp"),
     r"seq_len=24 has 6 blocks.*fewer than the 8.*multiple of 32"),
    ("too_few_blocks_cp", dict(seq_len=8, group_size=4, mode="cp"),
     r"seq_len=8 has 2 blocks.*fewer than the 4.*multiple of 16"),
    ("padding_csbp", dict(seq_len=80, group_size=4, mode="csbp"),
     r"seq_len=80 is not a multiple of 32.*pad the sequence to a multiple of 32"),
    ("padding_hybrid_csbp", dict(seq_len=80, group_size=4, clean_ring_size=2, mode="csbp"),
     r"seq_len=80.*pad the sequence to a multiple of 32"),
    ("padding_bp", dict(seq_len=48, group_size=4, mode="bp"),
     r"seq_len=48.*pad the sequence to a multiple of 32"),
    ("padding_cp", dict(seq_len=72, group_size=4, mode="cp"),
     r"seq_len=72.*pad the sequence to a multiple of 16"),
    ("zero_length", dict(seq_len=0, group_size=4), r"seq_len must be a positive integer, got 0"),
    ("zero_group", dict(group_size=0), r"block_parallel_size must be a positive integer, got 0"),
]


@pytest.mark.parametrize("kwargs,match", [pytest.param(k, m, id=i) for i, k, m in INVALID])
def test_invalid_configuration_raises_value_error_naming_the_values(kwargs, match):
    # The layout is checked where it is declared (ParallelDims), the sequence where the plan is made (PlanConfig).
    layout = {("block_parallel_size" if k == "group_size" else k): v for k, v in kwargs.items() if k != "seq_len"}
    with pytest.raises(ValueError, match=match):
        make_plan(PlanConfig(ParallelDims(**layout), kwargs.get("seq_len", 64), 4))


@pytest.mark.parametrize(
    "mode,schedule,C,expected",
    [("cp", "dual_end", None, 4 * 8), ("bp", "dual_end", 1, 2 * 4 * 8), ("bp", "contiguous", 1, 4 * 8),
     ("csbp", "dual_end", 4, 2 * 4 * 8), ("csbp", "dual_end", 2, 2 * 4 * 8), ("csbp", "contiguous", 2, 4 * 8)],
)
def test_required_multiple_of_each_layout(mode, schedule, C, expected):
    assert ParallelDims(4, C, mode, schedule).required_multiple(8) == expected
    make_plan(PlanConfig(ParallelDims(4, C, mode, schedule), expected, 8))  # the multiple itself is accepted


def test_rank_out_of_range_raises_value_error():
    with pytest.raises(ValueError, match=r"rank must be in \[0, 4\).*got 4"):
        make_plan(PlanConfig(ParallelDims(4), 64, 4)).ring_members(4)


# --- the paper's CP baseline layout ---------------------------------------------------------------------------------
@pytest.mark.parametrize("P,B", [(2, 4), (2, 8), (4, 4), (4, 8), (4, 16), (8, 16)])
def test_paper_cp_layout_holds_every_noisy_token_once_and_contiguous_clean_shards(P, B):
    L = 4 * P * B
    plan = make_plan(PlanConfig(ParallelDims(P, mode="cp", cp_layout="paper"), seq_len=L, block_size=B))
    noisy = torch.cat([r.noisy_positions() for r in plan.ranks])
    assert sorted(noisy.tolist()) == list(range(L))  # every noisy row on exactly one rank
    for r in plan.ranks:
        assert r.noisy_blocks == tuple(range(L // B))  # a slice of every block
        assert r.local_noisy_rows == L // P and r.local_clean_rows == L // P
        assert r.clean_positions == ((r.rank * L // P, (r.rank + 1) * L // P),)
        offsets = r.noisy_offset_index().tolist()
        if (B // P) % 2 == 0 and P > 1:  # two-ended: offset k and B-1-k together
            assert sorted(offsets) == sorted(B - 1 - o for o in offsets)
    assert all(m.loss_row_mask().sum() == 2 * L // P for m in plan.ranks)


def test_paper_cp_layout_is_unbalanced_on_clean_work_as_the_paper_baseline_is():
    # Clean->clean causal pairs of rank r's contiguous shard: the last rank does (2P-1)/P of the mean.
    P, B = 4, 8
    L = 64 * P
    plan = make_plan(PlanConfig(ParallelDims(P, mode="cp", cp_layout="paper"), seq_len=L, block_size=B))
    pairs = [sum(p + 1 for p in r.clean_position_index().tolist()) for r in plan.ranks]
    assert max(pairs) / (sum(pairs) / P) == pytest.approx((2 * P - 1) / P, rel=0.02)


def test_paper_cp_layout_errors_name_the_fix():
    with pytest.raises(ValueError, match="block_size=6 must be a multiple of 4"):
        PlanConfig(ParallelDims(4, mode="cp", cp_layout="paper"), seq_len=96, block_size=6)
    with pytest.raises(ValueError, match="layout of mode='cp'.*use mode='cp'"):
        ParallelDims(2, mode="csbp", cp_layout="paper")
    with pytest.raises(ValueError, match="blocking all-gathers.*Use 'allgather'"):
        ParallelDims(2, mode="cp", transport="ring", cp_layout="paper")
    with pytest.raises(ValueError, match="block_parallel_cp_layout must be one of"):
        ParallelDims(2, mode="cp", cp_layout="zigzag")
