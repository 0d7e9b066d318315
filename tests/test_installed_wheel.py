"""The installed wheel is self-contained; the package's modules import without a circle and every import points down
its rooms (:data:`LAYERS`).

The wheel is built from a copy of this checkout and installed (not editable) into a folder of its own; every command
then runs with this interpreter (which has the dependencies), that folder on ``PYTHONPATH`` and a temporary working
folder outside the checkout: the package imports from the wheel, every module of it imports, every ``hf-bdlm``
subcommand answers ``--help``, ``hf-bdlm bench`` runs its smallest real configuration (torchrun at P = 2 and the single
process) and writes its records and plots, and ``hf-bdlm plan --validate`` predicts the committed records.
"""

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "hf_bdlm"
RECORDS = ROOT / "tests" / "data" / "parallel_modes_cpu_2k4k.json"


# --- the package's modules and their imports -------------------------------------------------------------------------
def module_files(root: Path, package: str = PACKAGE) -> dict[str, tuple[Path, bool]]:
    """``{dotted name: (file, is_package)}`` of every module under ``root / package`` (folders with ``__init__.py``)."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if any(not (root.joinpath(*parts[:i]) / "__init__.py").is_file() for i in range(1, len(parts))):
            continue  # a file in package data, not a module
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """``{module: {imported module: line}}`` for every import of a package module, at module level or inside a
    function. ``from X import Y`` counts as an import of ``X.Y`` when that is a module, else of ``X``. Importing
    ``a.b.c`` also initialises the packages ``a`` and ``a.b`` first; those implicit imports are not edges: a
    package's ``__init__`` imports its submodules to re-export them, so every submodule would close a circle with
    its own package, which Python resolves (the submodule reads nothing from the half-initialised package)."""
    modules = module_files(root)

    def nearest(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for name, (path, is_package) in modules.items():
        edges = graph.setdefault(name, {})
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    here = name.split(".") if is_package else name.split(".")[:-1]
                    base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            for target in targets:
                if target == PACKAGE or target.startswith(PACKAGE + "."):
                    found = nearest(target)
                    if found and found != name:
                        edges.setdefault(found, node.lineno)
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_among_the_package_modules():
    graph = import_graph(ROOT)
    assert len(graph) > 50 and "hf_bdlm.benchmarks.parallel_modes" in graph["hf_bdlm.benchmarks.calibrate"]
    found = circles(graph)
    assert not found, "import circles (module -> {imported: line}):\n" + "\n".join(
        f"{m} -> {{{', '.join(f'{t}: {graph[m][t]}' for t in c if t in graph[m])}}}" for c in found for m in c)


def test_the_circle_check_finds_a_circle(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "data").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import g\n")  # a lazy import closes the circle
    (pkg / "data" / "script.py").write_text("import hf_bdlm.a\n")  # package data: not a module
    (pkg / "c.py").write_text("import hf_bdlm.sub.b\nfrom hf_bdlm import a\n")
    graph = import_graph(tmp_path)
    assert set(graph) == {"hf_bdlm", "hf_bdlm.a", "hf_bdlm.sub", "hf_bdlm.sub.b", "hf_bdlm.c"}
    assert graph["hf_bdlm.c"] == {"hf_bdlm.sub.b": 1, "hf_bdlm.a": 2}
    assert circles(graph) == [["hf_bdlm.a", "hf_bdlm.sub.b"]]


# --- the rooms and their order ---------------------------------------------------------------------------------------
# The package's rooms, bottom to top (docs/design.md §4): a room is a folder, a model family's folder, or a top-level
# module. A module may import its own room and the rooms below it, never a room above (imports inside functions
# count); rooms on one line do not import each other (the families: a host reaches a family only through the registry
# in protocols/, by name). A new folder or top-level module must be placed here.
LAYERS = (
    ("version", "cache", "checkpoint_files", "progress", "train_help"),  # import nothing of the package
    ("embedded", "data"),  # the shipped model and dataset
    ("protocols",),  # ModelFamily, TrainingStep, the card parts, the diffusion fields, the registry
    ("attention",),
    ("parallel",),
    ("objectives",),  # the contract every objective follows, layout-invariant noise
    ("hub",),
    ("planner",),
    ("trainer",),
    ("serving",),
    ("evaluation",),
    ("benchmarks",),
    ("models.block_diffusion", "models.diffusion_gemma", "models.dflash"),  # the families
    ("models",),  # the families' index (re-exports the registry)
    ("train", "matched_comparison"),  # the SFT recipe, the matched comparison of layouts
    ("cli",),
    ("__init__",),  # the public face: nothing inside the package imports it
)


def room_of(module: str) -> str:
    """The room of a dotted module name: ``models.<family>`` for a family's modules, else the folder or top-level
    module under the package (``__init__`` for the package itself)."""
    parts = module.split(".")[1:]
    if not parts:
        return "__init__"
    if parts[0] == "models" and len(parts) > 1:
        return f"models.{parts[1]}"
    return parts[0]


def layer_index(layers=LAYERS) -> dict[str, int]:
    return {room: i for i, line in enumerate(layers) for room in line}


def upward_imports(graph: dict[str, dict[str, int]], files: dict[str, Path], layers=LAYERS) -> list[str]:
    """``file:line`` of every import of a room that is not below the importer's (above it, beside it on its line, or
    a room :data:`LAYERS` does not place)."""
    index = layer_index(layers)
    found = []
    for module, targets in sorted(graph.items()):
        here = room_of(module)
        for target, line in sorted(targets.items(), key=lambda item: item[1]):
            there = room_of(target)
            if there == here:
                continue
            if here not in index or there not in index:
                unplaced = here if here not in index else there
                found.append(f"{files[module]}:{line}: {module} imports {target}; room {unplaced!r} is not in LAYERS")
            elif index[there] >= index[here]:
                where = "above" if index[there] > index[here] else "beside"
                found.append(f"{files[module]}:{line}: {module} (room {here!r}) imports {target} (room {there!r}, "
                             f"{where} it)")
    return found


def room_cycles(graph: dict[str, dict[str, int]], files: dict[str, Path]) -> list[str]:
    """Each circle of rooms (rooms that import each other, directly or through other rooms) with the import statements
    between its rooms, ``file:line`` each: the imports that close it."""
    rooms: dict[str, dict[str, list[str]]] = {}
    for module, targets in graph.items():
        for target, line in targets.items():
            a, b = room_of(module), room_of(target)
            if a != b:
                rooms.setdefault(a, {}).setdefault(b, []).append(f"{files[module]}:{line} ({module} -> {target})")
    room_graph = {a: {b: 0 for b in targets} for a, targets in rooms.items()}
    return [f"{' <-> '.join(cycle)}:\n" + "\n".join(f"    {a} -> {b}: " + "; ".join(sorted(rooms[a][b]))
                                             for a in cycle for b in cycle if b in rooms.get(a, {}))
            for cycle in circles(room_graph)]


def private_imports(root: Path, package: str = PACKAGE) -> list[str]:
    """``file:line`` of every import of another module's private (``_name``) name."""
    found = []
    for name, (path, is_package) in module_files(root, package).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            here = name.split(".") if is_package else name.split(".")[:-1]
            target = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module or ""
            if target == package or target.startswith(package + "."):
                found += [f"{path}:{node.lineno}: from {target} import {a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def package_files(root: Path) -> dict[str, Path]:
    return {name: path.relative_to(root) for name, (path, _) in module_files(root).items()}


def test_every_import_points_down_the_rooms():
    graph = import_graph(ROOT)
    files = package_files(ROOT)
    rooms = {room_of(m) for m in graph}
    assert rooms == set(layer_index()), f"rooms not in LAYERS: {rooms - set(layer_index())}; " \
                                        f"LAYERS rooms that do not exist: {set(layer_index()) - rooms}"
    upward = upward_imports(graph, files)
    assert not upward, "imports that do not point down the rooms (tests/test_installed_wheel.py LAYERS):\n" + \
        "\n".join(upward)
    cycles = room_cycles(graph, files)
    assert not cycles, "rooms that import each other:\n" + "\n".join(cycles)


def test_no_module_imports_another_modules_private_name():
    found = private_imports(ROOT)
    assert not found, "imports of another module's private name:\n" + "\n".join(found)


def test_the_room_checks_find_an_upward_import_a_circle_of_rooms_and_a_private_import(tmp_path):
    pkg = tmp_path / PACKAGE
    for folder in ("low", "high", "side"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("def f():\n    from ..high.b import g\n")  # up, inside a function
    (pkg / "high" / "b.py").write_text("from ..low import a\n\n\ndef g():\n    pass\n")
    (pkg / "side" / "c.py").write_text("from ..high import b\nfrom ..low.a import _hidden\n")  # up, no circle
    layers = (("low",), ("side",), ("high",), ("__init__",))
    graph = import_graph(tmp_path)
    files = package_files(tmp_path)
    upward = upward_imports(graph, files, layers)
    assert upward == [f"{Path('hf_bdlm/low/a.py')}:2: hf_bdlm.low.a (room 'low') imports hf_bdlm.high.b (room 'high', "
                      "above it)",
                      f"{Path('hf_bdlm/side/c.py')}:1: hf_bdlm.side.c (room 'side') imports hf_bdlm.high.b (room "
                      "'high', above it)"]
    cycles = room_cycles(graph, files)
    assert len(cycles) == 1 and cycles[0].startswith("high <-> low:")
    assert f"{Path('hf_bdlm/low/a.py')}:2 (hf_bdlm.low.a -> hf_bdlm.high.b)" in cycles[0]
    assert f"{Path('hf_bdlm/high/b.py')}:1 (hf_bdlm.high.b -> hf_bdlm.low.a)" in cycles[0]
    assert "side" not in cycles[0]
    assert upward_imports(graph, files, layers[:1] + layers[2:])[-1].endswith("room 'side' is not in LAYERS")
    assert private_imports(tmp_path) == [f"{pkg / 'side' / 'c.py'}:2: from hf_bdlm.low.a import _hidden"]


# --- the wheel --------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The wheel built from a copy of the checkout (pip, offline, this environment's setuptools), installed with
    ``pip install --target``: a folder holding ``hf_bdlm`` and nothing of the checkout."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / PACKAGE, src / PACKAGE, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    pip = [sys.executable, "-m", "pip", "--no-cache-dir"]
    build = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", str(src),
                            "-w", str(tmp / "dist")], capture_output=True, text=True, env=env, cwd=tmp, timeout=300)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("hf_bdlm-*.whl")
    install = subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(tmp / "site"), str(wheel)],
                             capture_output=True, text=True, env=env, cwd=tmp, timeout=300)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    return tmp / "site"


@pytest.fixture
def work(tmp_path) -> Path:
    assert ROOT not in tmp_path.resolve().parents
    return tmp_path


def run_installed(site: Path, cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python ARGS`` with the wheel's folder as the only ``PYTHONPATH``, in ``cwd`` (outside the checkout)."""
    env = dict(os.environ, PYTHONPATH=str(site), HF_BDLM_HOME=str(cwd / "hf_bdlm_home"), HF_HUB_OFFLINE="1",
               HF_HUB_DISABLE_TELEMETRY="1", OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def subcommands() -> list[str]:
    from hf_bdlm.cli import build_parser

    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(action.choices)


# One process on the wheel (each start imports torch and transformers: seconds): where hf_bdlm imports from, every
# module imported, `python -m hf_bdlm.cli --help` (run as -m runs it) and every subcommand's --help.
PROBE = """
import contextlib, importlib, io, json, runpy, sys
import hf_bdlm

def help_of(argv, main):
    out, code = io.StringIO(), None
    sys.argv = argv
    try:
        with contextlib.redirect_stdout(out):
            main()
    except SystemExit as exit:
        code = exit.code
    return [code, out.getvalue()]

modules, failed = sys.argv[1].split(","), {}
for name in modules:
    try:
        importlib.import_module(name)
    except Exception as err:
        failed[name] = f"{type(err).__name__}: {err}"
files = {name: getattr(sys.modules.get(name), "__file__", None) for name in modules}
commands = sys.argv[2].split(",")
top = help_of(["hf-bdlm", "--help"], lambda: runpy.run_module("hf_bdlm.cli", run_name="__main__", alter_sys=True))
from hf_bdlm.cli import main
helps = {c: help_of(["hf-bdlm", c, "--help"], lambda: sys.exit(main())) for c in commands}
print(json.dumps(dict(file=hf_bdlm.__file__, files=files, failed=failed, help=top, helps=helps)))
"""


@pytest.fixture(scope="module")
def probe(site, tmp_path_factory) -> dict:
    """The results of :data:`PROBE`."""
    cwd = tmp_path_factory.mktemp("probe")
    proc = run_installed(site, cwd, "-c", PROBE, ",".join(module_files(ROOT)), ",".join(subcommands()), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_wheel_holds_every_module_and_imports_from_its_own_folder(site, probe):
    assert set(module_files(site)) == set(module_files(ROOT))
    assert Path(probe["file"]).resolve() == (site / PACKAGE / "__init__.py").resolve()
    assert not probe["failed"], probe["failed"]
    outside = {n: f for n, f in probe["files"].items() if f is None or site.resolve() not in Path(f).resolve().parents}
    assert not outside, f"modules not imported from the wheel: {outside}"
    # Package data the commands read.
    for data in ("data/arith_train.jsonl", "models/block_diffusion/model_card.md",
                 "models/diffusion_gemma/model_card.md", "evaluation/tasks/swebench_offline.jsonl"):
        assert (site / PACKAGE / data).is_file(), data


def test_every_subcommand_answers_help(probe):
    commands = subcommands()
    assert {"train", "convert", "generate", "serve", "eval", "bench", "plan"} <= set(commands)
    code, text = probe["help"]
    assert code == 0 and text.startswith("usage: hf-bdlm "), text
    listed = text.split("positional arguments:")[-1]
    assert all(f"    {c} " in listed for c in commands), (commands, text)
    for command in commands:
        code, text = probe["helps"][command]
        usage = text.splitlines()[0] if text else ""
        assert code == 0 and usage.startswith(f"usage: hf-bdlm {command} "), (command, code, text[:500])


@pytest.mark.distributed
def test_bench_runs_its_smallest_configuration_from_the_wheel(site, work):
    """csbp (all-gather) at P = 2 under torchrun and the single process, L = 256, 1 layer, 3 steps (the fewest a timed
    study takes): the command end to end (the entry point's main; the console script itself answers in
    tests/test_cli.py), each measurement its own launch, writing the planner's records and the plots."""
    out = work / "bench"
    proc = run_installed(site, work, "-m", "hf_bdlm.cli", "bench", "--only", "modes", "--lengths", "256",
                         "--nprocs", "2", "--modes", "csbp", "--transports", "allgather", "--layers", "1",
                         "--steps", "3", "--min-time", "0", "--no-calibrate", "--out", "bench", timeout=240)
    if proc.returncode and (out / "parallel_modes.json").exists():
        failed = [r["error"] for r in json.loads((out / "parallel_modes.json").read_text()) if "error" in r]
        pytest.fail("a measurement failed:\n" + "\n".join(failed) + proc.stdout[-1000:])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "[modes 2/2," in proc.stdout
    records = json.loads((out / "parallel_modes.json").read_text())
    assert isinstance(records, list)
    assert {(r["mode"], r["P"], r["L"]) for r in records} == {("single", 1, 256), ("csbp", 2, 256)}
    assert {(r["mode"], r["transport"]) for r in records} == {("single", None), ("csbp", "allgather")}
    for r in records:
        for key in ("mode", "transport", "schedule", "P", "C", "L", "layers", "window", "step_s", "tokens_per_s",
                    "peak_mem_bytes", "bytes_per_step", "bytes_by_name", "comm_wait_s"):
            assert key in r, key
        assert r["step_s"] > 0 and r["peak_mem_bytes"] > 0
        assert r["steps"] == len(r["step_times"]) == 3  # --steps 3 and no --min-time
        assert r["step_spread"]["values"] == r["step_times"] and r["step_spread"]["median"] == r["step_s"]
    gather = next(r for r in records if r["mode"] == "csbp")
    # docs/design.md §3: csbp receives (C - 1) / C * 2 (K, V) * L * H_kv * d * 4 bytes per layer forward, as much
    # backward.
    assert gather["bytes_per_step"] == 2 * (1 / 2 * 2 * 256 * 2 * 32 * 4)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["studies"]["modes"]["failed"] == 0 and summary["machine"]["cpus"] >= 1
    assert len(summary["plots"]) == 4
    assert all((out / name).stat().st_size > 5000 and (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
               for name in summary["plots"])
    assert "CSBP's speed-up over each mode" in (out / "summary.md").read_text()


def test_plan_validate_predicts_the_committed_records_from_the_wheel(site, work):
    # The committed records at L = 2K (those at 4K take most of the time: their tile plans are 4x larger).
    records = [r for r in json.loads(RECORDS.read_text()) if r["L"] == 2048 and "error" not in r]
    assert len(records) >= 5
    (work / "parallel_modes.json").write_text(json.dumps(records))
    one = dict(matmul_flops=5e10, attention_flops=4e10, hbm_bytes_per_s=1e10, intra_node_bytes_per_s=3e8,
               inter_node_bytes_per_s=3e8, sync_cost_s=1e-3, benchmark_layers=2, benchmark_step_s=2.0)
    (work / "rates.json").write_text(json.dumps({"processes": {"1": one, "2": dict(one, matmul_flops=4e10)}}))
    proc = run_installed(site, work, "-m", "hf_bdlm.cli", "plan", "--validate", "parallel_modes.json",
                         "--rates-cache", "rates.json", "--cores", "2")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    n = len(records)
    assert f"bytes equal for {n}/{n}" in proc.stdout and "DIFFER" not in proc.stdout
    assert "CPU figures: rates.json" in proc.stdout and "pred_s" in proc.stdout
