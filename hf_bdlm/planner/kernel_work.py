"""What the ``blockwise`` kernel computes on each rank of a layout: the query-key pairs of its tile plans (masked-out
pairs of a dense masked call included) and its kernel calls, over the sources the sharded layout attends to.

:func:`~.cost.rank_work` counts the allowed pairs; a kernel computes whole tiles, so on a CPU (and at a window's edge)
it computes more. ``hf-bdlm plan --validate`` prices each rank's attention by these counts
(:mod:`hf_bdlm.benchmarks.calibrate`)::

    works = blockwise_work(dims, seq_len, rule, rank_work(dims, seq_len, rule, layer_windows(model)))
"""

from __future__ import annotations

from dataclasses import replace

from ..attention.rows import RowMeta
from ..attention.tiles import plan_attention
from ..parallel.dims import ParallelDims
from ..parallel.plan import PlanConfig, make_plan, window_exchange


def computed_pairs(plan, source: int | None = None) -> int:
    """Query-key pairs a tile plan's kernel calls compute (masked-out pairs of a dense masked call included), over
    every source or one."""
    total = 0
    for c in plan.calls:
        if source is not None and c.source != source:
            continue
        n, q = (1, c.q_rows[1] - c.q_rows[0]) if isinstance(c.q_rows, tuple) else (
            (1, c.q_rows.numel()) if c.q_rows.dim() == 1 else tuple(c.q_rows.shape))
        k = c.k_rows[1] - c.k_rows[0] if isinstance(c.k_rows, tuple) else c.k_rows.shape[-1]
        total += n * q * k
    return total


def blockwise_work(dims: ParallelDims, seq_len: int, rule, works) -> list:
    """``works`` (from :func:`~.cost.rank_work`) with the pairs the ``blockwise`` kernel computes on each rank, for
    every window of ``works`` (full and sliding-window layers): the tile plans of the sources the sharded layout
    attends to (own rows; the peers' gathered rows, each ring shard, or a sliding layer's halo rows).

    Masked-out pairs of a dense masked call are computed too: at the edge of a 1024-token window the 512-row group
    tiles are about half allowed, so a sliding layer's kernel computes about 1.5x its allowed pairs."""
    plan = make_plan(PlanConfig.from_dims(dims, seq_len, rule.block_size))
    out = list(works)
    for window in works[0].pairs if works else ():
        rule_w = rule.with_window(window)
        for r, (rp, w) in enumerate(zip(plan.ranks, out)):
            q = rp.rows()
            members = plan.exchange_members(r)
            exchanged = dims.mode.exchanges_kv and len(members) > 1
            if window is None and exchanged and w.sent_rows > 0 and dims.transport == "ring":
                n = plan.sent_row_start(r)
                tiles = [plan_attention(q, [q.slice(0, n)], rule_w)] if n else []
                shard_tiles = [plan_attention(q, [plan.sent_rows(m)], rule_w) for m in members]
                source = computed_pairs(tiles[0]) if n else 0
                shards = tuple(computed_pairs(t) for t in shard_tiles)
                total, local = source + sum(shards), source + shards[members.index(r)]
                calls = sum(len(t.calls) for t in tiles + shard_tiles)
                out[r] = replace(w, pairs={**w.pairs, window: total}, local_pairs={**w.local_pairs, window: local},
                                 source_pairs=source, shard_pairs=shards,
                                 kernel_calls={**w.kernel_calls, window: calls})
                continue
            total, local, calls = _computed_rank_pairs(plan, r, q, members, exchanged, dims.is_paper_cp, rule_w)
            # The paper's CP computes its block-diagonal part (the gathered noisy source) while the clean rows travel.
            noisy = {**w.noisy_pairs, window: local} if dims.is_paper_cp and exchanged else w.noisy_pairs
            out[r] = replace(w, pairs={**w.pairs, window: total}, local_pairs={**w.local_pairs, window: local},
                             noisy_pairs=noisy, kernel_calls={**w.kernel_calls, window: calls})
    return out


def _computed_rank_pairs(plan, r: int, q, members, exchanged: bool, blocking: bool, rule):
    """``(all, local, calls)``: the pairs the kernel computes for rank ``r`` under ``rule`` (all sources; those it
    computes before its wait: its own rows, or under the paper's CP the gathered noisy rows) and its kernel calls,
    over the sources :class:`~hf_bdlm.parallel.exchange.ExchangePass` attends to (allgather / all-to-all transports)."""
    if not exchanged:
        tiles = plan_attention(q, [q], rule)
        return computed_pairs(tiles), computed_pairs(tiles), len(tiles.calls)
    if blocking:  # the paper's CP: every member's noisy rows, then every member's clean rows (sliding layers too)
        noisy = RowMeta.cat([plan.ranks[m].rows().slice(0, plan.ranks[m].local_noisy_rows) for m in members])
        clean = RowMeta.cat([plan.ranks[m].rows().slice(plan.ranks[m].local_noisy_rows, plan.ranks[m].num_rows)
                             for m in members])
        tiles = plan_attention(q, [noisy, clean], rule)
        return computed_pairs(tiles), computed_pairs(tiles, 0), len(tiles.calls)
    if rule.sliding_window is None:
        peers = RowMeta.cat([plan.sent_rows(m) for m in members if m != r])
    else:  # the halo rows the all-to-all brings
        peers = window_exchange(members.index(r), [plan.ranks[m].rows() for m in members],
                                [plan.sent_rows(m) for m in members], rule)[3]
    tiles = plan_attention(q, [q, peers], rule)
    return computed_pairs(tiles), computed_pairs(tiles, 0), len(tiles.calls)


__all__ = ["blockwise_work", "computed_pairs"]
