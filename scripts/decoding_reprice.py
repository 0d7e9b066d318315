"""Complete decoding-study records written before the GPU cost model counted every head call and activation bytes.

`hf_bdlm.benchmarks.decoding_study` prices each counted forward by ``max((W + A * rows) / HBM, 2 * M * rows / F)``.
Records written before (no ``"counting"`` field) lack ``A`` (activation bytes per row) in their ``forward_cost``
records, and their speculative records lack the drafter's head calls and context-projection calls (the drafter's
head went through ``F.linear``, no hook fired; its ``fc`` was not counted). This script:

- rebuilds the parts of the architectures those records measured, on the meta device (no weights): the embedded
  SmolLM2-135M's body and head, the head of its BDLM conversion (one more row: the mask token), and the DFlash2
  drafter of `recipes/configs/dflash_smollm2_cpu.yaml` (1 layer, block 8, selector rank 64);
- fills ``activation_bytes_per_row`` of every ``forward_cost`` record whose weight bytes and multiply-accumulates per
  row equal one of those parts' exactly (a part that matches none is left unpriced: its rows print "-");
- adds the drafter's missing calls as ``"reconstructed"`` (``decoding.reconstruct_drafter_calls``: one head call per
  drafter call, over the next verification's rows less the batch's rows, and one ``fc`` call per target forward over
  its rows; the rule the hooks follow, checked against them in ``tests/benchmarks/test_decoding.py``), prices the
  ``"drafter context"`` part as the drafter's ``fc``, and recomputes the GPU column;
- writes the records back (measured fields unchanged) and prints what it did.

    python scripts/decoding_reprice.py benchmarks/results/decoding_self_distill/decoding.json
    hf-bdlm bench --report-only --out benchmarks/results/decoding_self_distill       # summary.md again
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

SOURCE = "rebuilt on the meta device by scripts/decoding_reprice.py"


def architecture_parts() -> dict[tuple[int, int], tuple[str, dict]]:
    """``(weight_bytes, macs_per_row) -> (name, part_cost)`` of the parts the committed records measured."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_bdlm.benchmarks.decoding_study import part_cost
    from hf_bdlm.embedded import default_model_dir
    from hf_bdlm.models.dflash.configuration import DFlashConfig
    from hf_bdlm.models.dflash.modeling import DFlash2DraftModel

    config = AutoConfig.from_pretrained(default_model_dir())
    with torch.device("meta"):
        target = AutoModelForCausalLM.from_config(config)
        drafter = DFlash2DraftModel(DFlashConfig.for_target(config, dflash2=True, num_hidden_layers=1, block_size=8,
                                                            selector_rank=64))
        bdlm_head = torch.nn.Linear(config.hidden_size, config.vocab_size + 1, bias=False)
    parts = {"SmolLM2-135M body": target.get_decoder(), "SmolLM2-135M head": target.get_output_embeddings(),
             "SmolLM2-135M BDLM head (+ mask token)": bdlm_head, "DFlash2 drafter layer (1 layer, block 8)":
             drafter.layers[0], "DFlash2 drafter fc": drafter.fc}
    out = {}
    for name, module in parts.items():
        cost = part_cost(module)
        out[(cost["weight_bytes"], cost["macs_per_row"])] = (name, cost)
    return out


def complete(records: list[dict], log=print) -> list[dict]:
    from hf_bdlm.benchmarks import decoding_study as decoding

    parts = architecture_parts()
    fc = next(cost for name, cost in parts.values() if name == "DFlash2 drafter fc")
    costs = [r for r in records if r["kind"] == "forward_cost"]
    known = len(costs)
    for r in records:
        if decoding.reconstruct_drafter_calls(r, costs):
            log(f"{r['entry']} | {r['variant']} at batch {r['batch']}: drafter head and fc calls reconstructed")
    records.extend(costs[known:])
    for c in costs:
        if c.get("activation_bytes_per_row") is not None:
            continue
        if c["part"] == "drafter context" and not c["points"]:
            c.update(fc, costs_from=f"DFlash2 drafter fc, {SOURCE}")
            log(f"{c['entry']} | {c['part']}: priced as the DFlash2 drafter's fc")
            continue
        match = parts.get((c["weight_bytes"], c["macs_per_row"]))
        if match is None:
            log(f"{c['entry']} | {c['part']}: matches no rebuilt part ({c['weight_bytes']} weight bytes), "
                "left unpriced")
            continue
        c.update(activation_bytes_per_row=match[1]["activation_bytes_per_row"], costs_from=f"{match[0]}, {SOURCE}")
        log(f"{c['entry']} | {c['part']}: {match[0]}, A = {match[1]['activation_bytes_per_row']} bytes per row")
    decoding.reprice(records)
    return records


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("records", nargs="+", help="decoding.json files, rewritten in place")
    args = p.parse_args(argv)
    for path in map(pathlib.Path, args.records):
        records = complete(json.loads(path.read_text()), log=lambda s: print(f"{path.parent.name}: {s}"))
        path.write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
