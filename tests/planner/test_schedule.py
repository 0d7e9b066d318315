"""The planner's step schedule (``hf_bdlm.planner.schedule`` and how ``cost.rank_times`` uses it): processor sharing
on a CPU with more ranks than cores, waits on peers' messages, the ring's rotation-by-rotation chain, and errors.

Pure functions: no processes are launched.
"""

from dataclasses import replace

import pytest

from hf_bdlm.attention.masks import MaskRule
from hf_bdlm.parallel.dims import ParallelDims
from hf_bdlm.planner.kernel_work import blockwise_work
from hf_bdlm.planner.cost import Cluster, Recipe, _layer_programs, _LayerCost, predict, rank_work
from hf_bdlm.planner.hardware import DeviceSpec
from hf_bdlm.planner.model import AttentionShape, ModelSpec
from hf_bdlm.planner.schedule import Compute, Send, Wait, simulate


def test_ranks_on_their_own_devices_run_in_parallel():
    sched = simulate([[Compute(1.0)], [Compute(3.0)], [Compute(2.0)]])
    assert [s.finish for s in sched] == [1.0, 3.0, 2.0] and [s.busy for s in sched] == [1.0, 3.0, 2.0]


def test_more_ranks_than_cores_share_them_and_a_finished_rank_frees_its_share():
    # Works 1, 3, 1, 3 on 2 cores: all four at half speed until the short ones finish (t = 2), then the long ones
    # each get a core for their remaining 2 s: done at 4 = total work / cores.
    sched = simulate([[Compute(1.0)], [Compute(3.0)], [Compute(1.0)], [Compute(3.0)]], cores=2)
    assert [s.finish for s in sched] == pytest.approx([2.0, 4.0, 2.0, 4.0])
    # Contention lowers the shared speed only while more ranks than cores compute.
    slow = simulate([[Compute(1.0)], [Compute(3.0)], [Compute(1.0)], [Compute(3.0)]], cores=2, efficiency=0.8)
    assert [s.finish for s in slow] == pytest.approx([2.5, 4.5, 2.5, 4.5])


def test_a_wait_ends_when_the_peers_message_has_travelled():
    sched = simulate([[Send("a", 0.5), Compute(1.0), Wait(("b",)), Compute(1.0)],
                      [Compute(3.0), Send("b", 0.25), Wait(("a",))]])
    assert sched[0].finish == pytest.approx(3.0 + 0.25 + 1.0) and sched[0].waited == pytest.approx(2.25)
    assert sched[1].finish == pytest.approx(3.0) and sched[1].waited == 0.0  # "a" arrived at 0.5


def test_a_blocked_rank_gives_its_core_to_the_others():
    # Rank 0 waits (from t = 0) for rank 2's message; ranks 1 and 2 then have a core each.
    sched = simulate([[Wait(("m",)), Compute(1.0)], [Compute(2.0)], [Compute(2.0), Send("m", 0.0)]], cores=2)
    assert [s.finish for s in sched] == pytest.approx([3.0, 2.0, 2.0])


def test_waiting_on_a_message_nobody_sends_is_an_error():
    with pytest.raises(ValueError, match="deadlock: ranks wait on messages nobody sends: {0: \\['never'\\]}"):
        simulate([[Wait(("never",))], [Compute(1.0)]])
    with pytest.raises(ValueError, match="sent twice"):
        simulate([[Send("x", 0.0), Send("x", 0.0)]])


def _work_costs(shards, source=0.0):
    """Two ring ranks whose shard work is ``shards[r][m]`` seconds (one pair = one second forward and backward)."""
    dims = ParallelDims(2, 2, "cp", transport="ring", world_size=2)
    works = rank_work(dims, 256, MaskRule(4), (None,))
    works = [replace(w, source_pairs=source, shard_pairs=tuple(shards[r]), pairs={None: source + sum(shards[r])},
                     local_pairs={None: source + shards[r][r]}) for r, w in enumerate(works)]
    costs = [_LayerCost(0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0)] * 2
    return dims, works, costs


def test_the_ring_backward_waits_each_rotation_for_the_predecessors_accumulator():
    # Balanced in total (4 s each) but not rotation by rotation: rank 0 computes 3 s on its own shard, then 1 s on
    # rank 1's; rank 1 the reverse. Backward, rotation 1 needs the predecessor's accumulator of rotation 0, so the
    # layer takes max(3, 1) + max(1, 3) = 6 s; forward shards are passed on before they are computed: 4 s.
    dims, works, costs = _work_costs([[3.0, 1.0], [3.0, 1.0]])
    fwd, bwd = _layer_programs(dims, works, costs, None, latency=0.0)
    assert max(s.finish for s in simulate(fwd)) == pytest.approx(4.0)
    assert max(s.finish for s in simulate(bwd)) == pytest.approx(6.0)
    # The all-gather transport of the same work synchronizes once: local 3 s, then the peer's rows.
    gathered = [ParallelDims(2, 2, "cp", world_size=2), works, costs]
    fwd, bwd = _layer_programs(*gathered, None, latency=0.0)
    assert max(s.finish for s in simulate(bwd)) == pytest.approx(4.0)


def test_latency_is_paid_per_ring_rotation():
    dims, works, costs = _work_costs([[1.0, 1.0], [1.0, 1.0]])
    base = max(s.finish for s in simulate(_layer_programs(dims, works, costs, None, 0.0)[1]))
    slow = max(s.finish for s in simulate(_layer_programs(dims, works, costs, None, 0.5)[1]))
    # Backward: rotation 1 waits for the accumulator of rotation 0 (one hop) and the step ends after its last hop.
    assert slow - base == pytest.approx(2 * 0.5)


def test_the_papers_cp_hides_its_clean_gather_behind_the_block_diagonal_part_only():
    # As its reference runs a layer: the noisy rows' gather completes first (3 s: half of a 6 s shard, P = 2), then
    # the clean rows' gather (3 s) starts and the block-diagonal part (2 s of pairs) computes meanwhile; the other 8 s
    # of pairs wait for it. Backward: all 10 s of pairs, then the clean rows' reduce-scatter, then the noisy rows'.
    dims = ParallelDims(2, 2, "cp", world_size=2, cp_layout="paper")
    works = [replace(w, pairs={None: 10.0}, noisy_pairs={None: 2.0}) for w in rank_work(dims, 64, MaskRule(4), (None,))]
    assert all(w.noisy_rows * 2 == w.sent_rows for w in works)  # half of what a rank sends is noisy
    for transfer, forward in ((6.0, 3.0 + 3.0 + 8.0), (2.0, 1.0 + 2.0 + 8.0)):  # a gather longer / shorter than 2 s
        costs = [_LayerCost(0.0, 0.0, 1.0, 1.0, transfer, 0.0, 0.0)] * 2
        fwd, bwd = _layer_programs(dims, works, costs, None, latency=0.0)
        assert [s.finish for s in simulate(fwd)] == pytest.approx([forward] * 2)
        assert [s.finish for s in simulate(bwd)] == pytest.approx([10.0 + transfer] * 2)  # nothing overlaps


def _cpu(cores, efficiency=1.0):
    return DeviceSpec("cpu", 1e11, 1e11, float("inf"), 2e10, 5e8, 5e8, shared_cores=cores,
                      oversubscribed_efficiency=efficiency)


def test_an_imbalanced_schedule_gains_from_shared_cores_a_balanced_one_does_not():
    model = ModelSpec(name="t", hidden=256, vocab=1024, layers=(AttentionShape(8, 2, 32, None),) * 2,
                      intermediate=512, block_size=64)
    recipe = Recipe(param_bytes=4, grad_bytes=4, optimizer_bytes=0, activation_bytes=4, fsdp=False,
                    gradient_sync=False)
    rule = MaskRule(64)
    step = {}
    for schedule in ("dual_end", "contiguous"):
        dims = ParallelDims(4, 1, "bp", schedule, world_size=4)
        work = blockwise_work(dims, 4096, rule, rank_work(dims, 4096, rule, (None,)))
        own = predict(model, dims, 4096, _cpu(0), Cluster(4, 4), recipe, work=work)
        shared = predict(model, dims, 4096, _cpu(2), Cluster(4, 4), recipe, work=work)
        step[schedule] = (own.step_s, shared.step_s, [r.compute_s for r in own.ranks])
    own, shared, compute = step["dual_end"]
    assert shared == pytest.approx(sum(compute) / 2, rel=0.02)  # balanced: the cores' total work, halved
    own, shared, compute = step["contiguous"]
    assert own == pytest.approx(max(compute))  # own devices: the slowest rank
    # Two cores shared by four ranks: all at half speed until the lightest finishes, then three at 2/3, then two
    # at full speed (each layer has the same proportions, so the layer-by-layer schedule sums to this).
    w, t, done = sorted(compute), 0.0, 0.0
    for i, x in enumerate(w):
        t += (x - done) / min(1.0, 2 / (len(w) - i))
        done = x
    assert shared == pytest.approx(t, rel=0.02) and shared < 2 * max(compute)  # a fixed half core would be 2x


def test_each_synchronization_costs_the_measured_wait_cost():
    programs = [[Send("a", 0.0), Compute(1.0), Wait(("b",)), Compute(1.0)], [Send("b", 0.0), Compute(2.0),
                                                                              Wait(("a",))]]
    free, costly = simulate(programs), simulate(programs, wait_cost=0.25)
    # Rank 0's message was there long before rank 1 waited: it still pays the cost of the synchronization.
    assert [s.finish for s in free] == pytest.approx([2.0, 2.0])
    assert [s.finish for s in costly] == pytest.approx([2.25, 2.25])
    assert [s.waited for s in costly] == pytest.approx([0.25, 0.25])
