"""Counts for the layering check (README.md): imports that point up under the final LAYERS (a tree's modules mapped to
the rooms they live in after the change), pairs of rooms importing each other, circles, private-name imports.

    python benchmarks/results/layering_check/count.py TREE      # TREE: a checkout (the one before, or this one)
"""
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
import test_installed_wheel as t
root = Path(sys.argv[1])
MOVED = {"hf_bdlm.modeling": "models.block_diffusion", "hf_bdlm.configuration": "models.block_diffusion",
         "hf_bdlm.generation": "models.block_diffusion", "hf_bdlm.conversion": "models.block_diffusion",
         "hf_bdlm.objectives.standard": "models.block_diffusion", "hf_bdlm.objectives.fast_dllm_v2": "models.block_diffusion",
         "hf_bdlm.models": "protocols", "hf_bdlm.models.family": "protocols", "hf_bdlm.models.step": "protocols",
         "hf_bdlm.models.card_parts": "protocols", "hf_bdlm.models.exports": "hub", "hf_bdlm.planner.calibrate": "benchmarks"}
def room(m):
    return MOVED.get(m) or t.room_of(m)
g = t.import_graph(root)
files = t.package_files(root)
idx = t.layer_index()
up = []
for m, ts in g.items():
    for tg, line in ts.items():
        a, b = room(m), room(tg)
        if a != b and (a not in idx or b not in idx or idx[b] >= idx[a]):
            up.append(f"{files[m]}:{line} {a} -> {b}")
print("upward imports under final LAYERS:", len(up))
for u in sorted(up): print("  ", u)
edges = collections.defaultdict(list)
for m, ts in g.items():
    for tg, line in ts.items():
        a, b = t.room_of(m), t.room_of(tg)
        if a != b: edges[(a, b)].append(1)
pairs = [(a, b) for (a, b) in edges if (b, a) in edges and a < b]
print("mutual room pairs (rooms as they are, families separate):", len(pairs), "statements:",
      sum(len(edges[p]) + len(edges[(p[1], p[0])]) for p in pairs), sorted(pairs))
# The counting: folders and top-level modules, the families one `models` folder.
folder = collections.defaultdict(set)
for m, ts in g.items():
    for tg, line in ts.items():
        a, b = t.room_of(m).split(".")[0], t.room_of(tg).split(".")[0]
        if a != b:
            folder[(a, b)].add(f"{files[m]}:{line}")
mutual = sorted((a, b) for (a, b) in folder if (b, a) in folder and a < b)
print("pairs of folders importing each other (families as one models/):", len(mutual), "import statements:",
      sum(len(folder[(a, b)]) + len(folder[(b, a)]) for a, b in mutual),
      "of which the fewer direction of each pair:", sum(min(len(folder[(a, b)]), len(folder[(b, a)])) for a, b in mutual))
for a, b in mutual:
    print(f"   {a} <-> {b}: {len(folder[(a, b)])} / {len(folder[(b, a)])}")
print("room circles:", len(t.room_cycles(g, files)))
print("module circles:", len(t.circles(g)))
pv = t.private_imports(root)
print("private-name imports:", len(pv))
for p in pv:
    print("  ", Path(p.split(":")[0]).relative_to(root.resolve()), p.split(":", 1)[1])
