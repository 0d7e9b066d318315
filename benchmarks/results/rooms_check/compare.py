"""Before/after comparison of the whole-model equivalence matrix: every field of every case equal (timings aside)."""
import json, sys, collections
from pathlib import Path
d = Path(sys.argv[1])
TIMING = {"seconds", "wall_s", "time_s"}
def strip(x):
    if isinstance(x, dict): return {k: strip(v) for k, v in x.items() if k not in TIMING}
    if isinstance(x, list): return [strip(v) for v in x]
    return x
def errs(case, key):
    vals = [case[key]] if key in case else []
    for s in case.get("steps", []):
        if key in s: vals.append(s[key])
    return vals
def bytes_of(case):
    return {k: case[k] for k in case if "bytes" in k or k in ("bytes", "moved", "names")} | \
        {"steps": [{k: s[k] for k in s if k in ("bytes", "names", "fc_rows", "projected")} for s in case.get("steps", [])]}
rows = []
for w in ("exactness_worker", "diffusion_gemma_worker", "dflash_worker"):
    by = collections.defaultdict(lambda: collections.defaultdict(list))
    for P in (2, 4):
        b = json.loads((d / f"before-{w}-w{P}.json").read_text())
        a = json.loads((d / f"after-{w}-w{P}.json").read_text())
        assert len(a) == len(b), (w, P, len(b), len(a))
        for cb, ca in zip(b, a):
            g = by[cb["dtype"]]
            g["n"].append(1)
            g["same"].append(strip(cb) == strip(ca))
            g["bytes_same"].append(bytes_of(cb) == bytes_of(ca))
            g["loss_b"] += errs(cb, "loss_err"); g["loss_a"] += errs(ca, "loss_err")
            gk = "grad_err" if "grad_err" in cb else "weight_err"
            g["grad_b"] += errs(cb, gk); g["grad_a"] += errs(ca, gk)
    for dt, g in sorted(by.items()):
        rows.append(dict(worker=w, dtype=dt, cases=len(g["n"]), identical=sum(g["same"]), bytes_identical=sum(g["bytes_same"]),
                         max_loss_err_before=max(g["loss_b"]), max_loss_err_after=max(g["loss_a"]),
                         max_grad_err_before=max(g["grad_b"]), max_grad_err_after=max(g["grad_a"])))
for r in rows:
    print(f"| {r['worker']} | {r['dtype']} | {r['cases']} | {r['max_loss_err_before']:.3g} / {r['max_loss_err_after']:.3g} | "
          f"{r['max_grad_err_before']:.3g} / {r['max_grad_err_after']:.3g} | {r['identical']}/{r['cases']} | {r['bytes_identical']}/{r['cases']} |")
if len(sys.argv) > 2:
    Path(sys.argv[2]).write_text(json.dumps(rows, indent=1))
