"""The K/V rows a rank receives, counted against the mask rule itself (single process, no collectives run).

For every layout that moves K/V (balanced ``cp``, the paper's CP, ``csbp``), P = 2 and 4, full and sliding-window
layers, the rows the engine hands the attention as the peers' keys are compared with an independent count: the rows of
the whole vectorized sequence, not held by the rank, that some query of the rank may attend (``dense_mask`` of the
rule). A sliding layer's exchange brings exactly those; an all-gather (full layers, and every layer of the paper's CP)
brings every peer's sent rows, a superset. The planner's row counts (``rank_work``) are the engine's.
The bytes themselves are checked against the byte meter under torchrun (tests/parallel/test_exactness.py).
"""

from types import SimpleNamespace

import pytest
import torch

import hf_bdlm.parallel.exchange as exchange
from hf_bdlm.attention.masks import MaskRule, dense_mask
from hf_bdlm.attention.rows import RowMeta, vectorized_rows
from hf_bdlm.parallel.dims import ParallelDims
from hf_bdlm.parallel.plan import PlanConfig, make_plan
from hf_bdlm.parallel.sharded import ShardedLayout
from hf_bdlm.planner.cost import rank_work

L, B = 64, 4
LAYOUTS = {"cp": {}, "cp-paper": dict(cp_layout="paper"), "csbp": {}}
RULES = [MaskRule(B, "block_causal"), MaskRule(B, "causal"), MaskRule(B, "block_causal", 10, "per_query"),
         MaskRule(B, "causal", 10, "per_query"), MaskRule(B, "causal", 9, "block_start"),
         MaskRule(B, "block_causal", 13, "block_start")]


def _pairs(rows: RowMeta) -> list[tuple[int, int]]:
    return list(zip(rows.stream.tolist(), rows.pos.tolist()))


def needed_rows(held: RowMeta, rule: MaskRule) -> set[tuple[int, int]]:
    """Rows of the whole vectorized sequence, not among ``held``, that some row of ``held`` may attend."""
    everything = vectorized_rows(L)
    reached = dense_mask(held, everything, rule)[0].any(0)
    return set(_pairs(everything.select(reached.nonzero().flatten()))) - set(_pairs(held))


def received_rows(monkeypatch, layout: ShardedLayout, rule: MaskRule) -> list[tuple[int, int]]:
    """The peers' rows the engine passes to the attention as key sources (every source but the rank's own rows)."""
    seen = {}
    monkeypatch.setattr(exchange, "attend", lambda backend, q, sources, q_rows, rows, *a: seen.update(rows=rows) or q)
    monkeypatch.setattr(exchange, "gather_rows", lambda x, comm, name: x)  # the paper's noisy gather: shapes only
    n = layout.q_rows.num_rows
    key = torch.zeros(1, 2, n, 8)
    layout.attend(None, torch.zeros(1, 4, n, 8), key, key.clone(), rule, 1.0)
    own = set(_pairs(layout.q_rows))
    rows = [p for r in seen["rows"] for p in _pairs(r)]
    if layout.exchange.blocking:  # the gathers carry the own slot too
        assert sum(p in own for p in rows) == len(own)
        return [p for p in rows if p not in own]
    assert seen["rows"][0] is layout.q_rows  # the local source: every row the rank holds
    return [p for r in seen["rows"][1:] for p in _pairs(r)]


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("rule", RULES, ids=lambda r: f"{r.clean_attention}-{r.sliding_window}-{r.window_convention}")
def test_each_rank_receives_the_rows_the_mask_rule_needs(monkeypatch, rule, name, P):
    dims = ParallelDims(P, P, "csbp" if name == "csbp" else "cp", **LAYOUTS[name])
    plan = make_plan(PlanConfig.from_dims(dims, L, B))
    work = rank_work(dims, L, rule.with_window(None), (rule.sliding_window,))
    for rank in range(P):
        comm = SimpleNamespace(size=P, rank=rank)
        groups = SimpleNamespace(dims=dims, group_rank=rank, kv_exchange=lambda mode: comm)
        layout = ShardedLayout(plan, groups, rule.with_window(None))
        got = received_rows(monkeypatch, layout, rule)
        assert len(got) == len(set(got))  # no row twice
        needed = needed_rows(layout.q_rows, rule)
        peers_sent = {p for m in plan.exchange_members(rank) if m != rank for p in _pairs(plan.sent_rows(m))}
        assert needed <= peers_sent  # what a rank needs, its peers send (csbp's noisy rows are never needed)
        if rule.sliding_window is not None and not dims.is_paper_cp:
            assert set(got) == needed, (rank, len(got), len(needed))  # the window exchange: exactly these
            assert work[rank].halo_recv[rule.sliding_window] == len(got)
        else:  # an all-gather: every peer's sent rows, whatever the rule needs
            assert set(got) == peers_sent >= needed
            assert work[rank].sent_rows * (P - 1) == len(got)
