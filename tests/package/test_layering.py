"""The package's modules import without a circle and every import points down its rooms (:data:`LAYERS`); no module
imports another module's private name. Read from the source as text (``ast``), nothing imported."""

import ast
from pathlib import Path

from package_source import PACKAGE, module_files
from paths import ROOT


# --- the package's modules and their imports -------------------------------------------------------------------------
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
    ("version", "cache", "progress", "train_help", "moved"),  # import nothing of the package
    ("checkpoints",),  # a model folder's files checked before they load; atomic saves of a run and its resume
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


# --- the rooms inside a model family ------------------------------------------------------------------------------
# A family folder opens with its model (configuration.py, modeling.py, family.py at its top); the rest sits in
# subfolders by role. Bottom to top: the model (the top-level modules but the entry's), inference (decoding, serving,
# likelihood, exports), training (trainer, objectives, sharded forward, capture: a trainer may replay decoding to
# evaluate), studies (benchmarks, planner workloads, projections), and the entry (family.py, the card, the command
# table, the package face) that hands the rest out. A module imports its own room and the rooms below it.
FAMILY_ROOMS = ("model", "inference", "training", "studies", "entry")
ENTRY_MODULES = ("family", "card", "commands")  # commands: the family's command-line tables


def family_room(module: str) -> tuple[str, str] | None:
    """``(family, room inside it)`` of a module in a family's folder, or ``None`` outside the families."""
    parts = module.split(".")[1:]
    if len(parts) < 2 or parts[0] != "models":
        return None
    rest = parts[2:]
    if not rest or rest[0] in ENTRY_MODULES:
        return parts[1], "entry"
    if rest[0] in FAMILY_ROOMS[1:4]:
        return parts[1], rest[0]
    return parts[1], "model"


def family_upward_imports(graph: dict[str, dict[str, int]], files: dict[str, Path]) -> list[str]:
    """``file:line`` of every import, inside one family, of a room of that family above the importer's."""
    order = {room: i for i, room in enumerate(FAMILY_ROOMS)}
    found = []
    for module, targets in sorted(graph.items()):
        here = family_room(module)
        for target, line in sorted(targets.items(), key=lambda item: item[1]):
            there = family_room(target)
            if here and there and here[0] == there[0] and order[there[1]] > order[here[1]]:
                found.append(f"{files[module]}:{line}: {module} (room {here[1]!r}) imports {target} (room "
                             f"{there[1]!r}, above it)")
    return found


def test_each_family_folder_opens_with_its_model_and_its_rooms_point_down():
    families = ROOT / PACKAGE / "models"
    folders = sorted(p for p in families.iterdir() if (p / "__init__.py").is_file())
    assert [p.name for p in folders] == ["block_diffusion", "dflash", "diffusion_gemma"]
    for folder in folders:
        top = {p.name for p in folder.glob("*.py")}
        assert {"configuration.py", "modeling.py", "family.py"} <= top, f"{folder}: {sorted(top)}"
        subfolders = {p.name for p in folder.iterdir() if (p / "__init__.py").is_file()}
        assert subfolders <= {"generation", *FAMILY_ROOMS[1:4]}, f"{folder}: {sorted(subfolders)}"
    graph = import_graph(ROOT)
    upward = family_upward_imports(graph, package_files(ROOT))
    assert not upward, "imports that point up a family's rooms (tests/test_layering.py FAMILY_ROOMS):\n" + \
        "\n".join(upward)


def test_the_family_room_check_finds_an_upward_import(tmp_path):
    pkg = tmp_path / PACKAGE / "models" / "toy"
    for folder in ("training", "studies"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    for init in (tmp_path / PACKAGE / "__init__.py", tmp_path / PACKAGE / "models" / "__init__.py", pkg / "__init__.py"):
        init.write_text("")
    (pkg / "modeling.py").write_text("def f():\n    from .training import trainer\n")  # model -> training: up
    (pkg / "training" / "trainer.py").write_text("from ..studies import bench\nfrom .. import modeling\n")
    (pkg / "studies" / "bench.py").write_text("from ..training import trainer\n")  # studies -> training: down
    found = family_upward_imports(import_graph(tmp_path), package_files(tmp_path))
    assert found == [
        f"{Path('hf_bdlm/models/toy/modeling.py')}:2: hf_bdlm.models.toy.modeling (room 'model') imports "
        "hf_bdlm.models.toy.training.trainer (room 'training', above it)",
        f"{Path('hf_bdlm/models/toy/training/trainer.py')}:1: hf_bdlm.models.toy.training.trainer (room 'training') "
        "imports hf_bdlm.models.toy.studies.bench (room 'studies', above it)"]


def package_files(root: Path) -> dict[str, Path]:
    return {name: path.relative_to(root) for name, (path, _) in module_files(root).items()}


def test_every_import_points_down_the_rooms():
    graph = import_graph(ROOT)
    files = package_files(ROOT)
    rooms = {room_of(m) for m in graph}
    assert rooms == set(layer_index()), f"rooms not in LAYERS: {rooms - set(layer_index())}; " \
                                        f"LAYERS rooms that do not exist: {set(layer_index()) - rooms}"
    upward = upward_imports(graph, files)
    assert not upward, "imports that do not point down the rooms (tests/test_layering.py LAYERS):\n" + \
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
