"""K/V rows each rank receives on one sliding-window layer, per layout, against the rows the mask rule needs.

For ``cp`` (balanced), ``cp`` in the paper's layout and ``csbp`` (``C = P``), P = 2 and 4, every rank of a group, this
counts from the plan (no processes, no model):

- ``received``: the rows the engine brings to the rank (the window exchange's lists, ``window_exchange``; the paper's
  CP gathers every member's rows whole, as on a full layer);
- ``received_by_position``: what the window lists held before they cut each query's reach per key stream (a key
  row was fetched when its *position* lay in some query's window, whatever its stream: clean queries then requested
  the peers' noisy rows, which no clean query may attend);
- ``needed``: the peers' sent rows that some query of the rank may attend, from the dense mask of the rule itself
  (``dense_mask``), independent of the window lists;
- ``planner``: the planner's halo count (``rank_work``), from which it prices the layer's bytes.

The rule is the sliding benchmark model's (``hf_bdlm.benchmarks.parallel_modes.model_config``: Qwen3 sliding layers,
block-causal clean stream, per-query window). Example (about a minute on one core)::

    python scripts/cp_window_rows.py --out benchmarks/results/baselines/cp_rows_before_after.json
"""

from __future__ import annotations

import argparse
import json

import torch

from hf_bdlm.attention.masks import MaskRule, dense_mask, keys_in_window
from hf_bdlm.benchmarks.parallel_modes import model_config
from hf_bdlm.parallel.dims import ParallelDims
from hf_bdlm.parallel.plan import PlanConfig, make_plan, window_exchange
from hf_bdlm.planner.cost import rank_work

LAYOUTS = (("cp", dict(mode="cp")), ("cp-paper", dict(mode="cp", cp_layout="paper")), ("csbp", dict(mode="csbp")))


def needed_rows(queries, keys, rule: MaskRule, chunk: int = 1024) -> int:
    """Key rows that at least one query may attend under ``rule`` (the dense mask, in key chunks)."""
    return sum(int(dense_mask(queries, keys.slice(s, s + chunk), rule)[0].any(0).sum())
               for s in range(0, keys.num_rows, chunk))


def count(name: str, P: int, L: int, B: int, rule: MaskRule) -> list[dict]:
    dims = ParallelDims(P, P, **dict(LAYOUTS)[name])
    plan = make_plan(PlanConfig.from_dims(dims, L, B))
    planner = rank_work(dims, L, rule.with_window(None), (rule.sliding_window,))
    out = []
    for me in range(P):
        members = plan.exchange_members(me)
        queries = [plan.ranks[m].rows() for m in members]
        sent = [plan.sent_rows(m) for m in members]
        at = members.index(me)
        peers = [s for i, s in enumerate(sent) if i != at]
        q = queries[at]
        by_position = sum(int(keys_in_window(q.stream, q.pos, s.pos, rule).sum()) for s in peers)
        if dims.is_paper_cp:  # it gathers every member's rows on sliding layers too
            received = halo = sum(s.num_rows for s in peers)
            by_position = received
        else:
            received = sum(window_exchange(at, queries, sent, rule)[2])
            halo = planner[me].halo_recv[rule.sliding_window]
        out.append(dict(layout=name, P=P, rank=me, received=received, received_by_position=by_position,
                        needed=sum(needed_rows(q, s, rule) for s in peers), planner=halo))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--groups", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cfg = model_config(layers=1, window=args.window)
    rule = MaskRule(args.block_size, cfg.clean_attention, args.window, cfg.sliding_window_convention)
    rows = [r for P in args.groups for name, _ in LAYOUTS for r in count(name, P, args.seq_len, args.block_size, rule)]
    print(f"K/V rows received per sliding layer (L = {args.seq_len}, block {args.block_size}, window {args.window}, "
          f"{rule.clean_attention}, {rule.window_convention})")
    print(f"{'layout':9} {'P':>2} {'rank':>4} {'by position':>12} {'received':>9} {'needed':>7} {'planner':>8}")
    for r in rows:
        print(f"{r['layout']:9} {r['P']:>2} {r['rank']:>4} {r['received_by_position']:>12} {r['received']:>9} "
              f"{r['needed']:>7} {r['planner']:>8}")
    if args.out:
        record = dict(seq_len=args.seq_len, block_size=args.block_size, window=args.window,
                      clean_attention=rule.clean_attention, window_convention=rule.window_convention,
                      command="python scripts/cp_window_rows.py --out " + args.out, rows=rows)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
