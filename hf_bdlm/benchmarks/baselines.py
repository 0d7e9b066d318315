"""The ``baselines`` study of ``hf-bdlm bench``: CSBP against both CP baselines and BP, side by side.

For each benchmark model, group size ``P`` and length ``L``, one fresh launch per layout (:mod:`.parallel_modes`, one
thread per rank, the all-gather transport): ``csbp``; ``cp``, this project's balanced CP (zigzag chunks, K/V gathers
overlapped with attention, window halos on sliding layers); ``cp-paper``, the CP baseline of the paper's reference
code (``block_parallel_cp_layout="paper"``: contiguous clean shards, a token slice of every noisy block, blocking
all-gathers and reduce-scatters, whole-sequence gathers on sliding layers); and ``bp`` (dual-end schedule).

Models (hidden 256, 8 heads, 2 K/V heads of 32, block 64, float32): ``dense``, 2 full-attention layers; ``sliding``,
6 layers in Gemma 3's 5:1 pattern (five sliding-window layers of width :data:`WINDOW`, then a full one).

Each row of the table gives the step time of every layout (median and range of its timed steps, at least 3), CSBP's
speed-up over each baseline (the ratio of medians; a tie where the two ranges overlap: :func:`.spread.compare`), the
exposed communication (time blocked in waits, slowest rank) and the per-rank attention work of each layout: allowed
(query, key) pairs of the slowest rank over the mean, summed over the layers (:func:`hf_bdlm.planner.cost.rank_work`).
With ``--link NAME`` every K/V transfer goes through the named emulated cluster link, stretched by the compute rate
the row's ``P`` ranks measure together once, in a launch of their own before the row's first layout
(:func:`.parallel_modes.measure_row_link`): every layout of a row goes through the same link (in every record's
``link``, ``measured: "once per row"``; records made before this stretched each launch's link by its own start-up
rate). The records go to ``baselines_<link>.json`` beside the plain ``baselines.json``. ``bp`` runs its dual-end
schedule only (``hf-bdlm bench --only modes`` times both schedules).

Caveat of this machine: with more ranks than cores (P = 4 on 2 cores) the ranks share the cores, so a rank with
less work yields its core to a busier one and the step time follows the group's total work more than its slowest
rank; layout imbalance then costs less than it does with one device per rank.
"""

from __future__ import annotations

import json
import pathlib
import tempfile
import time

from . import parallel_modes
from ..parallel.dims import ParallelDims
from ..planner.cost import layer_windows, mask_rule_of, rank_work
from .calibrate import benchmark_model
from .report import length_label, rows_table
from .spread import check_timed_steps, compare

WINDOW = 1024
MODELS = {"dense": dict(layers=2, window=None, full_every=None),
          "sliding": dict(layers=6, window=WINDOW, full_every=6)}
LAYOUTS = ("csbp", "cp", parallel_modes.PAPER_CP, "bp")


def out_name(link: str | None) -> str:
    return "baselines.json" if link is None else f"baselines_{link}.json"


def attention_imbalance(mode: str, P: int, L: int, model: str) -> float:
    """Slowest rank's allowed attention pairs over the mean, summed over the model's layers."""
    spec = benchmark_model(MODELS[model]["layers"], MODELS[model]["window"], MODELS[model]["full_every"])
    mode, cp_layout = parallel_modes.split_mode(mode)
    dims = ParallelDims(P, None, mode, cp_layout=cp_layout)
    works = rank_work(dims, L, mask_rule_of(spec), layer_windows(spec))
    per_rank = [sum(w.pairs[a.window] for a in spec.layers) for w in works]
    return max(per_rank) / (sum(per_rank) / len(per_rank))


def run_study(models, nprocs, lengths, steps: int, timeout: float, link=None, out: pathlib.Path | None = None,
              log=print, layouts=LAYOUTS) -> list[dict]:
    """Every (model, P, L, layout) record, written to ``out`` as it goes (records already in ``out`` are kept: a
    second run with other lengths or layouts adds its own)."""
    check_timed_steps(steps)
    configs = [(m, P, L, layout) for m in models for L in lengths for P in nprocs for layout in LAYOUTS
               if layout in layouts]
    what = link if isinstance(link, str) or link is None else link.describe()
    log(f"baselines: {len(configs)} runs (models {', '.join(models)}; P {', '.join(map(str, nprocs))}; "
        f"L {', '.join(map(str, lengths))}; {steps} timed steps after a warm-up"
        + (f"; through the emulated link {what}" if link is not None else "") + ")")
    kept = json.loads(out.read_text()) if out is not None and out.exists() else []
    planned = set(configs)
    kept = [r for r in kept if (r.get("model"), r["P"], r["L"], parallel_modes.mode_name(r)) not in planned]
    records: list[dict] = []
    started = time.perf_counter()
    row_links: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (model, P, L, layout) in enumerate(configs, 1):
            spec = MODELS[model]
            row_link = link
            if isinstance(link, str):  # one rate per row: every layout of the row goes through the same link
                if (model, P, L) not in row_links:
                    row_links[(model, P, L)] = parallel_modes.measure_row_link(
                        link, P, spec["layers"], pathlib.Path(tmp), timeout, spec["window"], spec["full_every"])
                    log(f"  [baselines, {time.perf_counter() - started:5.0f} s] {model:7} P={P} L={L:>6}: the row's "
                        f"link{_link_note(dict(link=row_links[(model, P, L)].as_record()))}")
                row_link = row_links[(model, P, L)]
            args = parallel_modes.launch_args(spec["layers"], steps, timeout, window=spec["window"], link=row_link,
                                              full_every=spec["full_every"])
            rec = parallel_modes.launch(layout, P, L, args, pathlib.Path(tmp), "allgather", "dual_end")
            rec.update(model=model, layers=spec["layers"], window=spec["window"], full_every=spec["full_every"])
            if "error" not in rec:
                rec["attention_imbalance"] = attention_imbalance(layout, P, L, model)
            records.append(rec)
            what = (f"error {(rec['error'].strip().splitlines() or ['?'])[-1][:80]}" if "error" in rec else
                    f"step {parallel_modes.spread_of(rec).describe('.3f')} s  wait {rec['comm_wait_s']:.3f} s  "
                    f"attention imbalance {rec['attention_imbalance']:.3f}" + _link_note(rec))
            log(f"  [baselines {i}/{len(configs)}, {time.perf_counter() - started:5.0f} s] {model:7} "
                f"{layout:8} P={P} L={L:>6}: {what}")
            if out is not None:
                out.write_text(json.dumps(kept + records, indent=1))
    return records


def _link_note(rec: dict) -> str:
    link = rec.get("link")
    if not link or "compute_rate" not in link:
        return ""
    rate = link["compute_rate"]
    return (f"  link {link['bytes_per_s'] / 1e6:.2f} MB/s + {link['latency_s'] * 1e3:.1f} ms (rate "
            f"{rate['flops_per_s'] / 1e9:.1f} GFLOP/s at {rate.get('processes_per_core', 0):g} process(es) per core)")


def rows(records: list[dict]) -> list[dict]:
    """One row per (link, model, P, L): every layout's record and CSBP's comparison with each baseline
    (:class:`~.spread.Comparison`: the ratio of median step times, a tie where the ranges overlap)."""
    groups: dict = {}
    for r in records:
        if "error" in r:
            continue
        key = ((r.get("link") or {}).get("name"), r["model"], r["P"], r["L"])
        groups.setdefault(key, {})[parallel_modes.mode_name(r)] = r
    out = []
    for (link, model, P, L), by in sorted(groups.items(), key=lambda kv: (str(kv[0][0]), *kv[0][1:])):
        cs = by.get("csbp")
        over = {m: (compare(parallel_modes.spread_of(by[m]), parallel_modes.spread_of(cs)) if cs and m in by else None)
                for m in LAYOUTS[1:]}
        out.append(dict(link=link, model=model, P=P, L=L, by=by, csbp_over=over))
    return out


def table(records: list[dict], markdown: bool = False) -> str:
    """Step seconds of every layout (median [range]), CSBP's speed-up over each (ratio of medians, or a tie), exposed
    waits and the attention imbalance of each layout."""
    head = ["link", "model", "P", "L", *(f"{m} s" for m in LAYOUTS), "CSBP / cp-paper", "CSBP / cp", "CSBP / bp",
            "wait s (csbp/cp/cp-paper)", "attn imbalance (csbp/cp/cp-paper)"]
    body = []
    for row in rows(records):
        by = row["by"]

        def cell(m, key, fmt):
            return fmt.format(by[m][key]) if m in by and key in by[m] else "-"

        steps = [parallel_modes.spread_of(by[m]).describe() if m in by else "-" for m in LAYOUTS]
        ratios = [row["csbp_over"][m].describe() if row["csbp_over"][m] else "-"
                  for m in (parallel_modes.PAPER_CP, "cp", "bp")]
        body.append([row["link"] or "none", row["model"], str(row["P"]), length_label(row["L"]), *steps, *ratios,
                     "/".join(cell(m, "comm_wait_s", "{:.2f}") for m in LAYOUTS[:3]),
                     "/".join(cell(m, "attention_imbalance", "{:.2f}") for m in LAYOUTS[:3])])
    return rows_table(head, body, markdown)
