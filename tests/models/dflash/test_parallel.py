"""The DFlash drafter under block parallelism (hf_bdlm/models/dflash/training/sharded.py): the plan (who holds which context
rows, projects which of them, and drafts which anchors), the sharded forward in one process (P = 1 and bp need no
peers), and the training steps of every mode on 2 and 4 gloo processes against one process: losses, weights, the
bytes each rank receives and the context rows it projects (an all-sliding drafter projects only the rows in reach).

The pure tests run in-process; the distributed ones read the job of tests/distributed/dflash_worker.py in the shared
launches of 2 and 4 processes (every case in each).
"""

from __future__ import annotations

import json

import pytest
import torch

from dflash_worker import BLOCK, DRAFTERS, LENGTH, MATRIX, WINDOW, objective_of, tiny_data, tiny_drafter, tiny_target

from hf_bdlm.models.dflash.modeling import draft_context_mask
from hf_bdlm.models.dflash.training.objectives import DFlashObjective, active_anchor_slots, anchor_costs, deal_anchors
from hf_bdlm.models.dflash.training.sharded import DFlashShardPlan, balanced_bounds, context_bytes, sharded_draft_forward
from torchrun import SharedJob  # noqa: E402

MODES = ("cp", "bp", "csbp")


def packed_batch(seed: int, length: int = 48, max_anchors: int = 10, sampling: str = "uniform"):
    """Three sequences: one document; two documents; three documents with a padding tail (document -1)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 30, (3, length), generator=g)
    loss_mask = (torch.rand(3, length, generator=g) > 0.2).long()
    documents = torch.zeros(3, length, dtype=torch.long)
    documents[1, length // 3:] = 1
    documents[2, length // 4:] = 1
    documents[2, length // 2:] = 2
    documents[2, length - 5:] = -1
    objective = DFlashObjective(mask_token_id=31, block_size=4, max_anchors=max_anchors, loss="ce",
                                anchor_sampling=sampling, seed=seed)
    return objective.prepare(ids, loss_mask, documents, step=seed)


def plans(batch, mode, world, windows=(None,), ring=None):
    return [DFlashShardPlan.build(batch, mode=mode, world=world, rank=r, layer_windows=windows, ring_size=ring)
            for r in range(world)]


# --- the plan ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode, world, ring", [("cp", 1, None), ("cp", 2, None), ("cp", 3, None), ("cp", 4, None),
                                              ("bp", 1, None), ("bp", 3, None), ("bp", 4, None), ("csbp", 2, None),
                                              ("csbp", 3, None), ("csbp", 4, None), ("csbp", 4, 2), ("csbp", 4, 1),
                                              ("csbp", 6, 3)])
def test_every_context_row_is_held_once_per_ring_and_everywhere_under_bp(mode, world, ring):
    batch = packed_batch(0)
    for plan in plans(batch, mode, world, ring=ring):
        C = plan.ring_size
        assert C == ring if ring else C == (1 if mode == "bp" else world)
        assert plan.ring_members == tuple(range(plan.rank // C * C, plan.rank // C * C + C))
        for first in range(0, world, C):  # each ring holds one copy of the context, cut in contiguous shards
            held = torch.zeros(batch.sequence_length, dtype=torch.long)
            for start, stop in plan.context_ranges[first:first + C]:
                assert stop - start == 48 // C
                held[start:stop] += 1
            assert bool((held == 1).all())
            assert plan.context_ranges[first:first + C] == tuple(sorted(plan.context_ranges[first:first + C]))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_anchors_are_drafted_once_under_bp_and_csbp_and_by_every_rank_under_cp(mode, world, seed):
    batch = packed_batch(seed, sampling="locality" if seed == 2 else "uniform")
    active = active_anchor_slots(batch).tolist()
    shares = [plan.anchor_slots[plan.rank] for plan in plans(batch, mode, world)]
    if mode == "cp" or world == 1:
        assert all(list(share) == active for share in shares)
    else:
        assert sorted(s for share in shares for s in share) == active  # each active slot once, no inactive slot
        if world > len(active):
            assert any(not share for share in shares)  # more ranks than anchors: some rank drafts none


def test_bp_and_csbp_deal_the_anchors_by_their_cost_over_every_layer():
    batch = packed_batch(1)
    windows = (5, None, 5)
    active = active_anchor_slots(batch)
    costs = 2 * anchor_costs(batch, sliding_window=5) + anchor_costs(batch)
    expected = [tuple(active[part].tolist()) for part in deal_anchors(costs[active], 3)]
    for mode in ("bp", "csbp"):
        assert plans(batch, mode, 3, windows)[0].anchor_slots == tuple(expected)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_full_attention_shares_are_the_papers_owned_anchors(world, seed):
    """The oracle (``dllm_parallel``'s block-parallel anchor ownership) deals the same active anchors to each rank; it
    also pads a share with invalid slots (no loss) to a power-of-two bucket for compiled kernels, which we skip."""
    from types import SimpleNamespace

    training = pytest.importorskip("dllm_parallel.core.models.backbones.dflash.training")
    batch = packed_batch(seed, max_anchors=16)
    active = set(active_anchor_slots(batch).tolist())
    assert len(active) >= world
    for plan in plans(batch, "csbp", world, (None, None)):
        runtime = SimpleNamespace(active_block_mode="dual_end", block_parallel_size=world,
                                  block_parallel_rank=plan.rank)
        owned, _ = training._owned_anchor_selection(batch, runtime=runtime, device=torch.device("cpu"))
        assert plan.anchor_slots[plan.rank] == tuple(s for s in owned.tolist() if s in active)


@pytest.mark.parametrize("mode, ring", [("cp", None), ("csbp", None), ("csbp", 2)])
@pytest.mark.parametrize("window", [1, 3, 6, 30])
def test_window_rows_are_exactly_the_peer_rows_the_mask_rule_lets_a_rank_see(mode, ring, window):
    batch = packed_batch(3)
    everything = torch.arange(batch.sequence_length).expand(3, -1)
    for plan in plans(batch, mode, 4, (window, None), ring):
        mine = plan.select(batch)
        seen = draft_context_mask(mine.anchor_positions, everything, BLOCK, anchor_document_starts=mine.document_starts,
                                  anchor_valid=mine.anchor_valid, sliding_window=window).flatten(0, 2).any(0)
        start, stop = plan.context_range
        seen[start:stop] = False
        assert plan.window_rows[window][plan.rank] == tuple(seen.nonzero().flatten().tolist())


@pytest.mark.parametrize("windows", [(6,), (6, None)], ids=["compact", "whole"])
@pytest.mark.parametrize("ring", [4, 2])
def test_window_exchange_sends_each_ring_peer_exactly_the_rows_it_receives(ring, windows):
    batch = packed_batch(4)
    group = plans(batch, "csbp", 4, windows, ring)
    assert all(plan.compacts_context == (windows == (6,)) for plan in group)
    exchanges = [plan.window_exchange(6) for plan in group]
    for me, (send_index, send_counts, recv_counts, received) in enumerate(exchanges):
        members, at = group[me].ring_members, me % ring  # counts are indexed by ring rank
        assert len(send_counts) == len(recv_counts) == ring and send_counts[at] == recv_counts[at] == 0
        assert len(send_index) == sum(send_counts)
        assert received.tolist() == list(group[me].window_rows[6][me]) and len(received) == sum(recv_counts)
        for j, peer in enumerate(members):
            assert exchanges[peer][1][at] == recv_counts[j]  # what the peer sends me is what I expect from it
        offset = 0
        for peer, count in zip(members, send_counts):  # rows sent to a peer: its needed rows that I hold, ascending
            start, stop = group[me].context_range
            rows = group[me].projected_rows[send_index[offset:offset + count]].tolist()  # index my projected rows
            assert rows == [r for r in group[peer].window_rows[6][peer] if start <= r < stop]
            offset += count


def _seen_by_ring(batch, group, rank, window):
    """Brute force: the rows any query of any anchor of ``rank``'s ring may see on a layer of ``window``."""
    everything = torch.arange(batch.sequence_length).expand(batch.anchor_positions.shape[0], -1)
    seen = torch.zeros(batch.sequence_length, dtype=torch.bool)
    for member in group[rank].ring_members:
        mine = group[member].select(batch)
        seen |= draft_context_mask(mine.anchor_positions, everything, BLOCK,
                                   anchor_document_starts=mine.document_starts, anchor_valid=mine.anchor_valid,
                                   sliding_window=window).flatten(0, 2).any(0)
    return seen


@pytest.mark.parametrize("mode, world, ring", [("cp", 1, None), ("cp", 4, None), ("bp", 3, None), ("csbp", 4, None),
                                              ("csbp", 4, 2), ("csbp", 6, 3)])
@pytest.mark.parametrize("windows", [(3, 6), (6,), (30, 2)])
@pytest.mark.parametrize("sampling", ["uniform", "locality"])
def test_projected_rows_are_the_rows_of_the_range_the_rings_anchors_see_through_the_widest_window(
        mode, world, ring, windows, sampling):
    batch = packed_batch(8, sampling=sampling)
    group = plans(batch, mode, world, windows, ring)
    for plan in group:
        start, stop = plan.context_range
        seen = _seen_by_ring(batch, group, plan.rank, max(windows))
        assert plan.compacts_context and plan.compact_window == max(windows)
        assert plan.projected_rows.tolist() == (seen[start:stop].nonzero().flatten() + start).tolist()
        runs = plan.projected_runs  # disjoint ascending runs, separated by at least one row
        assert all(a < b for a, b in runs) and all(b < c for (_, b), (c, _) in zip(runs, runs[1:]))
        assert plan.num_projected == len(plan.projected_rows) == sum(b - a for a, b in runs)
        for w in set(windows):  # every row a peer needs from this rank is one it projects
            for peer in plan.ring_members:
                needed = {r for r in group[peer].window_rows[w][peer] if start <= r < stop}
                assert needed <= set(plan.projected_rows.tolist())


@pytest.mark.parametrize("mode, world, ring", [("cp", 2, None), ("cp", 4, None), ("csbp", 4, None), ("csbp", 4, 2),
                                              ("csbp", 6, 3)])
@pytest.mark.parametrize("seed", [0, 8, 9])
def test_compact_ranges_cut_each_ring_by_its_seen_rows_not_by_its_rows(mode, world, ring, seed):
    """Locality anchors cluster: equal shards would leave most seen rows on one rank; the compact ranges still cut
    [0, L) into contiguous ascending ranges, each projecting as many seen rows as any other, within one."""
    batch = packed_batch(seed, sampling="locality")
    group = plans(batch, mode, world, (6,), ring)
    C = group[0].ring_size
    for first in range(0, world, C):
        members = group[first:first + C]
        ranges = [p.context_range for p in members]
        assert ranges[0][0] == 0 and ranges[-1][1] == 48
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, ascending, disjoint
        counts = [p.num_projected for p in members]
        seen = _seen_by_ring(batch, group, first, 6)
        assert sum(counts) == int(seen.sum())
        assert max(counts) - min(counts) <= 1, (ranges, counts)


def test_balanced_bounds_give_each_part_its_share_of_the_rows():
    assert balanced_bounds([(3, 10), (20, 25)], 48, 2) == (0, 9, 48)        # rows 3..8 | 9, 20..24
    assert balanced_bounds([(3, 10), (20, 25)], 48, 4) == (0, 6, 9, 22, 48)
    assert balanced_bounds([(5, 6)], 48, 3) == (0, 5, 5, 48)                # one row: two empty ranges
    assert balanced_bounds([], 48, 4) == (0, 12, 24, 36, 48)                # nothing seen: equal shards


def test_a_full_attention_layer_or_compact_context_false_projects_whole_ranges():
    batch = packed_batch(9, sampling="locality")
    for mode in MODES:
        compact = plans(batch, mode, 4, (5, 5))
        assert sum(p.num_projected for p in compact) < sum(p.context_range[1] - p.context_range[0] for p in compact)
        for plan in plans(batch, mode, 4, (5, None)) + [
                DFlashShardPlan.build(batch, mode=mode, world=4, rank=r, layer_windows=(5, 5), compact_context=False)
                for r in range(4)]:
            start, stop = plan.context_range
            assert not plan.compacts_context and plan.compact_window is None
            assert plan.projected_runs == ((start, stop),)
            assert torch.equal(plan.projected_rows, torch.arange(start, stop))


def test_bp_exchanges_nothing_and_cp_counts_each_rank_once():
    batch = packed_batch(5)
    for mode in MODES:
        plan = DFlashShardPlan.build(batch, mode=mode, world=4, rank=1, layer_windows=(None, 3))
        assert plan.exchanges_context == (mode != "bp") and plan.splits_anchors == (mode != "cp")
        assert plan.loss_scale == (0.25 if mode == "cp" else 1.0)
        assert plan.window_rows[3] == ((),) * 4 if mode == "bp" else any(plan.window_rows[3])
        if mode == "bp":
            assert context_bytes(plan, (None, 3), batch_size=3, kv_width=16, element_size=4) == (0, 0)
    assert DFlashShardPlan.build(batch, mode="cp", world=4, rank=0).global_sum(None) is None
    single = DFlashShardPlan.build(batch, mode="csbp", world=1, rank=0)
    assert single.loss_scale == 1.0 and not single.exchanges_context and single.global_sum(None) is None
    with pytest.raises(ValueError, match="splits the anchors: pass the group's CommContext"):
        DFlashShardPlan.build(batch, mode="bp", world=2, rank=0).global_sum(None)


def test_full_layer_bytes_are_the_ring_peers_rows_of_k_and_v():
    batch = packed_batch(6)
    row = 3 * 16 * 4  # b = 3 sequences x H_kv * d = 16 x 4 bytes
    for ring, peer_rows in ((4, 3 * 12), (2, 1 * 24)):
        plan = DFlashShardPlan.build(batch, mode="csbp", world=4, rank=2, layer_windows=(None, None), ring_size=ring)
        # 2 layers x (C - 1) * L / C rows x K and V; backward returns as much.
        assert context_bytes(plan, (None, None), batch_size=3, kv_width=16, element_size=4) == \
            (2 * peer_rows * 2 * row,) * 2


def test_plan_errors_name_the_bad_value_and_the_fix():
    batch = packed_batch(7)  # L = 48
    with pytest.raises(ValueError, match=r"mode must be one of \('cp', 'bp', 'csbp'\), got 'dp'"):
        DFlashShardPlan.build(batch, mode="dp", world=2, rank=0)
    for mode in ("cp", "csbp"):
        with pytest.raises(ValueError, match=r"ring_size=5 equal contiguous shards, but the sequence length is 48, "
                                             r"not a multiple of 5: pad the sequences to a multiple of 5 tokens"):
            DFlashShardPlan.build(batch, mode=mode, world=5, rank=0)
    assert DFlashShardPlan.build(batch, mode="bp", world=5, rank=4).context_range == (0, 48)  # bp: any P
    assert DFlashShardPlan.build(batch, mode="csbp", world=10, rank=9, ring_size=2).context_range == (24, 48)
    with pytest.raises(ValueError, match="ring_size must be an int dividing world=4, got 3"):
        DFlashShardPlan.build(batch, mode="csbp", world=4, rank=0, ring_size=3)
    with pytest.raises(ValueError, match="mode='cp' has ring_size=4 .* got 2; use mode='csbp' for rings of 2 ranks"):
        DFlashShardPlan.build(batch, mode="cp", world=4, rank=0, ring_size=2)
    with pytest.raises(ValueError, match="mode='bp' has ring_size=1 .* got 2"):
        DFlashShardPlan.build(batch, mode="bp", world=4, rank=0, ring_size=2)
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, world=2\), got 2"):
        DFlashShardPlan.build(batch, mode="cp", world=2, rank=2)
    with pytest.raises(ValueError, match="world must be an int >= 1"):
        DFlashShardPlan.build(batch, mode="cp", world=0, rank=0)
    with pytest.raises(ValueError, match="a layer window must be None or an int >= 1, got 0"):
        DFlashShardPlan.build(batch, mode="cp", world=2, rank=0, layer_windows=(None, 0))
    plan = DFlashShardPlan.build(batch, mode="cp", world=2, rank=0)
    with pytest.raises(ValueError, match=r"no exchange for sliding window 4; it knows windows \[\]"):
        plan.window_exchange(4)
    with pytest.raises(ValueError, match="built for sequences of 48 tokens, the batch has 32"):
        plan.select(packed_batch(7, length=32))


# --- the sharded forward in one process ------------------------------------------------------------------------------
def _case(kind: str, dtype=torch.float64, max_anchors: int = 6):
    target = tiny_target(dtype=dtype)
    drafter = tiny_drafter(target, **DRAFTERS[kind])
    ids, loss_mask, documents, features = tiny_data(dtype, drafter.config.feature_width)
    batch = objective_of("ce", max_anchors).prepare(ids, loss_mask, documents, step=1)
    windows = [drafter.config.layer_window(i) for i in range(drafter.config.num_hidden_layers)]
    return drafter, ids, documents, features, batch, windows


class RowCounter:
    """Counts the context rows ``fc`` projects (a forward hook)."""

    def __init__(self, drafter):
        self.rows: list[int] = []
        self.handle = drafter.fc.register_forward_hook(lambda module, args, out: self.rows.append(args[0].shape[1]))


@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_one_rank_runs_the_drafters_own_forward(kind):
    drafter, ids, documents, features, batch, windows = _case(kind, max_anchors=6)
    whole = drafter(features, ids, batch.anchor_positions, batch.anchor_valid, document_ids=documents)
    plan = DFlashShardPlan.build(batch, mode="csbp", world=1, rank=0, layer_windows=windows)
    assert plan.compacts_context == (kind == "dflash2_all_sliding")
    mine = plan.select(batch)
    counter = RowCounter(drafter)
    out = sharded_draft_forward(drafter, features, ids, mine, plan, None, return_logits=True)
    assert counter.rows == [plan.num_projected]
    assert plan.num_projected < LENGTH if plan.compacts_context else plan.num_projected == LENGTH
    rows = (plan.anchor_index[:, None] * BLOCK + torch.arange(BLOCK)).flatten()
    if plan.compacts_context:  # fewer keys: the same sums in another order
        torch.testing.assert_close(out.hidden_states, whole.hidden_states[:, rows], rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(out.logits, whole.logits[:, rows], rtol=1e-13, atol=1e-13)
    else:
        assert torch.equal(out.hidden_states, whole.hidden_states[:, rows])
        assert torch.equal(out.logits, whole.logits[:, rows])


@pytest.mark.parametrize("mode, world", [("csbp", 1), ("bp", 2)])
def test_the_compact_forward_takes_the_whole_range_or_only_the_projected_rows(mode, world):
    drafter, ids, _, features, batch, windows = _case("dflash2_all_sliding", max_anchors=3)
    for plan in plans(batch, mode, world, windows):
        assert 0 < plan.num_projected < LENGTH
        mine = plan.select(batch)
        from_range = sharded_draft_forward(drafter, features, ids, mine, plan, None).hidden_states
        from_rows = sharded_draft_forward(drafter, features[:, plan.projected_rows], ids, mine, plan, None)
        assert torch.equal(from_range, from_rows.hidden_states)


@pytest.mark.parametrize("layer_windows", [(WINDOW, WINDOW), (3, WINDOW), (WINDOW, 2)])
@pytest.mark.parametrize("mode", ["bp", "cp"])
def test_compact_ranks_give_the_single_process_outputs_and_gradients(mode, layer_windows):
    """bp on 2 ranks (each projects the rows its own anchors see) and one cp rank (every active anchor's): outputs
    equal the drafter's own forward, and the ranks' gradients add up to its gradient (layers of different windows:
    the widest decides the rows)."""
    drafter, ids, documents, features, batch, _ = _case("dflash2_all_sliding", max_anchors=4)
    for layer, window in zip(drafter.layers, layer_windows):
        layer.self_attn.sliding_window = window
    objective = objective_of("ce", 4)
    whole = drafter(features, ids, batch.anchor_positions, batch.anchor_valid, document_ids=documents,
                    return_logits=False).hidden_states
    objective.loss_from_hidden(whole, drafter.lm_head.weight, batch).backward()
    expected = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
    drafter.zero_grad(set_to_none=True)
    counter = RowCounter(drafter)
    world = 2 if mode == "bp" else 1
    group = plans(batch, mode, world, layer_windows)
    for plan in group:
        assert plan.compact_window == max(layer_windows)
        mine = plan.select(batch)
        out = sharded_draft_forward(drafter, features, ids, mine, plan, None).hidden_states
        rows = (plan.anchor_index[:, None] * BLOCK + torch.arange(BLOCK)).flatten()
        torch.testing.assert_close(out, whole[:, rows], rtol=1e-13, atol=1e-13)
        objective.loss_from_hidden(out, drafter.lm_head.weight, mine).backward()
    assert counter.rows == [plan.num_projected for plan in group] and all(n < LENGTH for n in counter.rows)
    for name, grad in expected.items():
        torch.testing.assert_close(drafter.get_parameter(name).grad, grad, rtol=1e-12, atol=1e-12, msg=name)


def test_bp_ranks_draft_their_own_blocks_of_the_single_process_forward():
    drafter, ids, documents, features, batch, windows = _case("dflash2_sliding")
    whole = drafter(features, ids, batch.anchor_positions, batch.anchor_valid, document_ids=documents).hidden_states
    for plan in plans(batch, "bp", 2, windows):
        out = sharded_draft_forward(drafter, features, ids, plan.select(batch), plan, None).hidden_states
        rows = (plan.anchor_index[:, None] * BLOCK + torch.arange(BLOCK)).flatten()
        torch.testing.assert_close(out, whole[:, rows], rtol=1e-13, atol=1e-13)


def test_forward_errors_name_the_bad_value_and_the_fix():
    drafter, ids, _, features, batch, windows = _case("dflash2_sliding")
    plan = DFlashShardPlan.build(batch, mode="csbp", world=2, rank=1, layer_windows=windows)
    mine = plan.select(batch)
    with pytest.raises(ValueError, match=r"this rank's feature rows \[16, 32\) .* got \(2, 32, 64\). Pass features"):
        sharded_draft_forward(drafter, features, ids, mine, plan, None)
    with pytest.raises(ValueError, match=r"exchanges context K/V: pass the CommContext of this rank's ring"):
        sharded_draft_forward(drafter, features[:, 16:], ids, mine, plan, None)
    with pytest.raises(ValueError, match="pass plan.select\\(batch\\)"):
        sharded_draft_forward(drafter, features[:, 16:], ids, batch, plan, None)
    full_only = DFlashShardPlan.build(batch, mode="bp", world=2, rank=0)
    with pytest.raises(ValueError, match=r"sliding windows \[5\] the plan was not built for"):
        sharded_draft_forward(drafter, features, ids, full_only.select(batch), full_only, None)
    compact = DFlashShardPlan.build(batch, mode="bp", world=2, rank=0, layer_windows=(5, 5))
    with pytest.raises(ValueError, match=r"only the context rows within window 5 of the anchors, but the drafter's "
                                         r"layers have windows \[5, None\] \(None: full attention\): build the plan"):
        sharded_draft_forward(drafter, features, ids, compact.select(batch), compact, None)
    n = compact.num_projected
    with pytest.raises(ValueError, match=rf"shape \[b=2, 32, features\] or only the {n} rows it projects "
                                         r"\(plan.projected_rows\), got \(2, 7, 64\)"):
        sharded_draft_forward(drafter, features[:, :7], ids, compact.select(batch), compact, None)


# --- every mode on 2 and 4 processes against one process ------------------------------------------------------------
# Relative to the reference (weights: to each tensor's largest element), over 3 SGD steps (lr 0.2). Measured maxima:
# float32 loss 3.5e-7, weights 4.1e-6 (csbp, P = 2); float64 loss 3.2e-15, weights 2.9e-14.
TOLERANCE = {"float32": (2e-6, 1e-5), "float64": (1e-12, 1e-12)}


SHARED_JOBS = [SharedJob("dflash_parallel", "dflash_worker.py", world, ("--out", "{out}/results.json"))
               for world in (2, 4)]


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def results(request, shared_launch):
    folder = shared_launch.folder("dflash_parallel", request.param)
    return request.param, json.loads((folder / "results.json").read_text())


@pytest.mark.distributed
def test_matrix_covers_every_drafter_mode_loss_and_a_rank_without_anchors(results):
    world, cases = results
    assert all("error" not in c for c in cases) and {c["rank"] for c in cases} == set(range(world))
    kinds = {(c["drafter"], c["mode"], c["loss"], c["dtype"]) for c in cases}
    if world == 2:
        assert {(d, m, loss) for d in MATRIX for m in MODES for loss in ("ce", "dpace")} \
            <= {k[:3] for k in kinds if k[3] == "float32"}
        assert {(d, m) for d in DRAFTERS for m in MODES} <= {k[:2] for k in kinds if k[3] == "float64"}
        assert {("dflash2_all_sliding", m) for m in ("cp", "csbp")} <= {k[:2] for k in kinds if k[3] == "float32"}
    else:
        assert {m for _, m, _, _ in kinds} == set(MODES)
        assert {(c["mode"], c["C"]) for c in cases} == {("cp", 4), ("bp", 1), ("csbp", 4), ("csbp", 2)}
        assert {(c["mode"], c["C"]) for c in cases if c["drafter"] == "dflash2_all_sliding"} == {("cp", 4),
                                                                                                  ("csbp", 2)}
    if world == 2:
        assert any(c.get("checkpointing") for c in cases)
    idle = [c for c in cases if c["mode"] != "cp" and any(s["anchors"] == 0 for s in c["steps"])]
    assert {c["mode"] for c in idle} == {"bp", "csbp"}  # ranks with no anchor still take part and train exactly


@pytest.mark.distributed
def test_three_steps_give_the_single_process_losses_and_weights(results):
    _, cases = results
    bad = [{k: c[k] for k in ("drafter", "mode", "loss", "dtype", "max_anchors", "rank", "weight_err", "worst_param")}
           | {"loss_err": max(s["loss_err"] for s in c["steps"])}
           for c in cases if max(s["loss_err"] for s in c["steps"]) > TOLERANCE[c["dtype"]][0]
           or c["weight_err"] > TOLERANCE[c["dtype"]][1]]
    assert not bad, bad
    for c in cases:  # the steps trained the drafter: losses moved, every tensor (D-PACE: the selector too)
        assert len({round(s["loss"], 6) for s in c["steps"]}) > 1, c["steps"]
        trained = c["parameters"] if c["loss"] == "dpace" or not c["drafter"].startswith("dflash2") else \
            c["parameters"] - 3  # CE leaves the candidate selector's three tensors alone
        assert c["moved"] == trained, c


@pytest.mark.distributed
def test_every_rank_receives_the_bytes_of_the_formula(results):
    world, cases = results
    for c in cases:
        for s in c["steps"]:
            forward, backward = s["formula"]
            recomputed = 2 if c.get("checkpointing") else 1  # gradient checkpointing runs each layer's forward twice
            assert s["bytes"] == [recomputed * forward, backward] and s["formula"] == s["expected"], c
            if c["mode"] == "bp":
                assert s["bytes"] == [0, 0] and not s["names"]
            else:  # a full layer always gathers; sliding layers only the rows in reach (maybe none)
                assert s["bytes"][0] > 0 or c["drafter"] == "dflash2_all_sliding", c
                assert all(n.startswith("dflash_context_") for n in s["names"])
        if c["drafter"] == "dflash2_sliding" and c["mode"] != "bp":
            # 2 layers x the ring peers' rows x K and V x b = 2 sequences x H_kv = 2 heads x d = 8 x s: full gathers
            C = c["C"]
            whole = 2 * (C - 1) * (LENGTH // C) * 2 * 2 * 2 * 8 * (4 if c["dtype"] == "float32" else 8)
            assert all(s["formula"][0] < whole for s in c["steps"]), c  # the sliding layer fetches its window only
    compact = [s for c in cases if c["drafter"] == "dflash2_all_sliding" and c["mode"] != "bp" for s in c["steps"]]
    assert any(s["bytes"][0] > 0 for s in compact)  # the compact rows travel too


@pytest.mark.distributed
def test_every_rank_projects_the_rows_of_the_plan_and_the_mask_rule(results):
    """An all-sliding drafter projects (``fc`` input rows, counted by a hook) exactly the rows of its range that its
    ring's anchors can see; any other drafter its whole range."""
    _, cases = results
    for c in cases:
        for s in c["steps"]:
            assert s["fc_rows"] == [s["projected"]] and s["projected"] == s["expected_projected"], c
            if c["drafter"] != "dflash2_all_sliding":
                assert s["projected"] == s["shard"], c
    compact = [s for c in cases if c["drafter"] == "dflash2_all_sliding" for s in c["steps"]]
    assert compact and all(s["projected"] <= s["shard"] for s in compact)
    assert sum(s["projected"] for s in compact) < sum(s["shard"] for s in compact)  # rows were left out
