"""Counts for issue 44: files per family, largest file, longest function, imports inside functions, ModelFamily members."""
import ast, sys, json
from pathlib import Path
root = Path(sys.argv[1]); pkg = root / "hf_bdlm"
out = {}
fam = {}
for f in sorted((pkg / "models").iterdir()):
    if (f / "__init__.py").exists():
        files = [p for p in f.rglob("*.py")]
        fam[f.name] = {"files": len(files), "lines": sum(len(p.read_text().splitlines()) for p in files),
                        "top_level_files": len(list(f.glob("*.py"))),
                        "subfolders": sorted(p.name for p in f.iterdir() if p.is_dir() and (p / "__init__.py").exists())}
out["families"] = fam
sizes = sorted(((len(p.read_text().splitlines()), str(p.relative_to(root))) for p in pkg.rglob("*.py")), reverse=True)
out["largest_files"] = sizes[:5]
longest = []
inside = total = 0
for p in pkg.rglob("*.py"):
    tree = ast.parse(p.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            longest.append((node.end_lineno - node.lineno + 1, f"{p.relative_to(root)}:{node.name}"))
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    in_func = set()
    for fn in funcs:
        for n in ast.walk(fn):
            if isinstance(n, (ast.Import, ast.ImportFrom)): in_func.add(id(n))
    for n in ast.walk(tree):
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            if isinstance(n, ast.ImportFrom) and n.module == "__future__": continue
            total += 1; inside += id(n) in in_func
out["longest_functions"] = sorted(longest, reverse=True)[:5]
out["imports"] = {"total": total, "inside_functions": inside, "share": round(inside / total, 3)}
names = [p.name for p in pkg.rglob("*.py") if p.name != "__init__.py"]
from collections import Counter
out["duplicate_basenames"] = sorted(n for n, c in Counter(names).items() if c > 1)
tests = root / "tests"
def count_defs(name):
    return sum(1 for p in tests.rglob("*.py") for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.FunctionDef) and n.name == name)
out["test_builders"] = {n: count_defs(n) for n in ("tiny_target", "tiny_drafter", "tiny_tokenizer", "engine", "server", "client", "tiny_diffusion_gemma", "tokenizer")}
out["test_files"] = {"test_*.py": len(list(tests.rglob("test_*.py"))), "flat_in_tests/": len(list(tests.glob("test_*.py"))),
                     "folders": sorted({str(p.parent.relative_to(tests)) for p in tests.rglob("test_*.py")})}
print(json.dumps(out, indent=1))
