"""The planner's K/V bytes per step and rank, per layout: the paper's settings and the CPU baselines study's models.

What ``hf-bdlm plan`` prices as traffic (``rank_work`` + ``kv_bytes_by_name``, the byte meter's names), for balanced
``cp``, the paper's CP and ``csbp`` (``C = P``); the largest rank's total, and its sliding layers' halo exchange
(``k_window.all_to_all``, the forward K bytes). Run it on two source trees to compare them, e.g. before and after a
change to how halos are counted (a minute or two on one core)::

    python scripts/planner_kv_bytes.py --out after.json
    git archive <commit> hf_bdlm | tar -x -C /tmp/old && PYTHONPATH=/tmp/old python scripts/planner_kv_bytes.py
"""

from __future__ import annotations

import argparse
import json

from hf_bdlm.benchmarks.parallel_modes import model_config
from hf_bdlm.parallel.dims import ParallelDims
from hf_bdlm.planner.plan_command import PAPER_GROUP, paper_settings
from hf_bdlm.planner.cost import kv_bytes_by_name, layer_windows, mask_rule_of, rank_work
from hf_bdlm.planner.model import model_spec

LAYOUTS = (("cp", {}), ("cp-paper", dict(cp_layout="paper")), ("csbp", {}))


def layout_bytes(model, P: int, L: int, elem_bytes: int) -> list[dict]:
    out = []
    for name, extra in LAYOUTS:
        dims = ParallelDims(P, P, "csbp" if name == "csbp" else "cp", world_size=P, **extra)
        works = rank_work(dims, L, mask_rule_of(model), layer_windows(model))
        by_rank = [kv_bytes_by_name(model, dims, w, elem_bytes) for w in works]
        top = max(by_rank, key=lambda b: sum(b.values()))
        out.append(dict(layout=name, P=P, L=L, bytes_per_step=sum(top.values()),
                        k_window_all_to_all=top.get("k_window.all_to_all", 0)))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    rows = []
    # The paper's settings (hf-bdlm plan --paper): one group of 8 ranks, bf16 K/V.
    for setting, preset, L, _, _ in paper_settings():
        for r in layout_bytes(model_spec(preset), PAPER_GROUP, L, 2):
            rows.append(dict(r, setting=f"{setting} ({preset})"))
    # The CPU baselines study (hf-bdlm bench --only baselines): float32 K/V, one sequence.
    for label, cfg in (("dense", model_config(2)), ("sliding", model_config(6, 1024, full_every=6))):
        for P, L in ((2, 16384), (4, 16384), (4, 32768)):
            for r in layout_bytes(model_spec(cfg), P, L, 4):
                rows.append(dict(r, setting=f"baselines study, {label} model"))
    print(f"{'setting':42} {'layout':9} {'P':>2} {'L':>7} {'K/V bytes per step':>20} {'k_window.all_to_all':>20}")
    for r in rows:
        print(f"{r['setting']:42} {r['layout']:9} {r['P']:>2} {r['L']:>7} {r['bytes_per_step']:>20,} "
              f"{r['k_window_all_to_all']:>20,}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
