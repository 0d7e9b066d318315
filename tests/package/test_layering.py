"""The package's modules import without a circle and every import points down its rooms (:data:`LAYERS`); no module
imports another module's private name; every module path the package holds as a string (the registry's family modules
and classes, the command and study tables, the remote-code bundler's roots) names a module, and a name in it, that
exists. Read from the source as text (``ast``); only a module that makes its names on demand is imported to ask it."""

import ast
import importlib
import re
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
    ("rl",),  # GRPO for block-diffusion policies (TRL's GRPOTrainer), its estimators' draws, verifiable rewards
    ("benchmarks",),
    ("models.block_diffusion", "models.diffusion_gemma", "models.dflash"),  # the families
    ("models",),  # the families' index (re-exports the registry)
    ("train",),  # the SFT recipe
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
    assert not upward, "imports that point up a family's rooms (tests/package/test_layering.py FAMILY_ROOMS):\n" + \
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
    assert not upward, "imports that do not point down the rooms (tests/package/test_layering.py LAYERS):\n" + \
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


# --- imports inside functions ----------------------------------------------------------------------------------------
# A module's imports sit at its top, where they say what it depends on. One stays inside a function only for a reason
# its comment gives, "# lazy: <why>", at the end of its first line or on the comment lines just above it (one comment
# above a run of consecutive import statements covers the run): an optional dependency (an extra's package), keeping
# `hf-bdlm --help` and the command tables free of torch, a family's module reached through the registry by name, a
# process that must set something up before the import, or an import cost measured on a path that does not need it.
LAZY = "# lazy:"
# pending: edited by another task; the lead hoists these files' imports or gives each its reason, then takes the file
# off this list (the test fails while a listed file has nothing left to do).
PENDING_LAZY: dict[str, str] = {
}


def function_imports(root: Path, package: str = PACKAGE) -> list[tuple[Path, int, str, bool]]:
    """``(file, line, first line's text, has a reason)`` of every import statement inside a function or method of the
    package's modules (``from __future__`` aside): the reason is a :data:`LAZY` comment at the end of its first line,
    on a comment line just above it, or above the run of consecutive import statements it ends."""
    found = []
    for _, (path, _) in module_files(root, package).items():
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines), str(path))
        nodes: list[ast.stmt] = []

        def visit(node, in_function: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if in_function and isinstance(child, (ast.Import, ast.ImportFrom)) and not (
                        isinstance(child, ast.ImportFrom) and child.module == "__future__"):
                    nodes.append(child)
                visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

        visit(tree, False)
        explained_ends: set[int] = set()  # last lines of the function-level imports that have a reason
        for node in sorted(nodes, key=lambda n: n.lineno):
            above = node.lineno - 2  # index of the line above
            explained = LAZY in lines[node.lineno - 1] or above + 1 in explained_ends
            while not explained and above >= 0 and lines[above].lstrip().startswith("#"):
                explained = lines[above].lstrip().startswith(LAZY)
                above -= 1
            if explained:
                explained_ends.add(node.end_lineno)
            found.append((path, node.lineno, lines[node.lineno - 1].strip(), explained))
    return found


def unexplained_function_imports(root: Path, package: str = PACKAGE) -> list[str]:
    """``file:line: text`` of every import inside a function that gives no reason (:func:`function_imports`)."""
    return [f"{path.relative_to(root).as_posix()}:{line}: {text}"
            for path, line, text, explained in function_imports(root, package) if not explained]


def test_every_import_inside_a_function_says_why_it_is_not_at_the_top():
    found = unexplained_function_imports(ROOT)
    pending = {f.split(":")[0] for f in found} & set(PENDING_LAZY)
    assert pending == set(PENDING_LAZY), f"no import left to do in {sorted(set(PENDING_LAZY) - pending)}: take " \
                                         "it off PENDING_LAZY"
    found = [f for f in found if f.split(":")[0] not in PENDING_LAZY]
    assert not found, "imports inside functions without a reason (move them to the module's top, or say why they " \
                      f"stay with a {LAZY!r} comment; tests/package/test_layering.py):\n" + "\n".join(found)


def test_the_function_import_check_finds_an_import_without_a_reason(tmp_path):
    pkg = tmp_path / PACKAGE
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        "from __future__ import annotations\n"  # 1
        "import os\n"  # 2: module level
        "\n"
        "def f():\n"  # 4
        "    import json  # lazy: a reason\n"  # 5
        "    # lazy: the reason of a run\n"  # 6
        "    import csv\n"  # 7
        "    from typing import (\n"  # 8: the run goes on
        "        Any,\n"
        "    )\n"
        "\n"
        "    import re\n"  # 12: a blank line ends the run
        "    x = 1\n"
        "    # lazy: a reason over two lines,\n"
        "    # the second one\n"
        "    import abc\n"  # 16
        "    # a comment that is no reason\n"
        "    import ast\n"  # 18
        "\n"
        "class C:\n"
        "    import io\n"  # 21: a class body is not a function
        "\n"
        "    def m(self):\n"
        "        return lambda: __import__('x') or [__import__ for _ in ()]\n"
        "\n"
        "    async def n(self):\n"
        "        import sys\n"  # 27
        "        if self:\n"
        "            from . import b  # lazy:another\n")  # 29
    found = function_imports(tmp_path)
    assert [(line, explained) for _, line, _, explained in found] == [
        (5, True), (7, True), (8, True), (12, False), (16, True), (18, False), (27, False), (29, True)]
    assert unexplained_function_imports(tmp_path) == [
        "hf_bdlm/a.py:12: import re", "hf_bdlm/a.py:18: import ast", "hf_bdlm/a.py:27: import sys"]


# --- the module paths the package holds as text ----------------------------------------------------------------------
# Strings that look like a dotted module path of the package and are not one (each with what it is).
NOT_MODULE_PATHS = {"hf_bdlm.dflash.features": "the format name of a DFlash feature store (dflash/training/capture.py)"}
# Modules whose dict keys are old module paths: each must not be a module any more (its alias would never be used).
OLD_PATHS = {"hf_bdlm.moved": "MOVED_MODULES: an old module path -> where it moved"}
DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
PATH_LIKE = re.compile(rf"{DOTTED.pattern}(:{DOTTED.pattern})?")  # a.b.c or a.b:name


def top_level_names(path: Path) -> set[str] | None:
    """The names a module defines at top level (defs, classes, assignments, imports, also inside top-level ``if`` /
    ``try`` blocks), read with ``ast``; ``None`` when it defines ``__getattr__`` (its names are made when asked)."""
    names: set[str] = set()

    def visit(body) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
            for field in ("body", "orelse", "finalbody", "handlers"):
                if isinstance(node, (ast.If, ast.Try, ast.With, ast.ExceptHandler)) and hasattr(node, field):
                    visit(getattr(node, field))

    visit(ast.parse(path.read_text(), str(path)).body)
    return None if "__getattr__" in names else names


def module_strings(root: Path, package: str = PACKAGE) -> list[tuple[str, Path, int, str]]:
    """``(module, file, line, text)`` of every string constant of the package's modules that looks like a module path
    of the package (``<package>.a.b``, ``<package>.a.b:name``): plain strings, and f-strings whose every field is a
    name bound at the module's top level to a string (``f"{PACKAGE}.models.block_diffusion.configuration"``)."""
    found = []
    for name, (path, _) in module_files(root, package).items():
        tree = ast.parse(path.read_text(), str(path))
        constants: dict[str, str] = {}

        def value(node) -> str | None:
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                return node.value
            if isinstance(node, ast.JoinedStr):
                parts = []
                for part in node.values:
                    if isinstance(part, ast.FormattedValue):
                        if part.conversion != -1 or part.format_spec or not isinstance(part.value, ast.Name) \
                                or part.value.id not in constants:
                            return None
                        parts.append(constants[part.value.id])
                    else:
                        parts.append(part.value)
                return "".join(parts)
            return None

        for node in tree.body:  # the module's string constants, in order (one may build on another)
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                    and value(node.value) is not None:
                constants[node.targets[0].id] = value(node.value)
        # A plain string inside an f-string is one of its parts, not a string of its own.
        parts = {id(part) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for part in node.values}
        for node in ast.walk(tree):
            text = value(node) if isinstance(node, (ast.Constant, ast.JoinedStr)) and id(node) not in parts else None
            if text is not None and text.startswith(package + ".") and PATH_LIKE.fullmatch(text):
                found.append((name, path, node.lineno, text))
    return found


def resolves(text: str, modules: dict[str, tuple[Path, bool]]) -> bool:
    """Whether ``text`` names a module of ``modules`` (``a.b.c``), a module's top-level name (``a.b.name``) or, as
    ``a.b:name[.attr]``, a module and a name it defines. Read as text; a module that makes its names on demand
    (``__getattr__``) is imported to ask it."""
    module, colon, attribute = text.partition(":")
    if not DOTTED.fullmatch(module) or (colon and not DOTTED.fullmatch(attribute)):
        return False
    if not colon:
        if module in modules:
            return True
        module, _, attribute = module.rpartition(".")
    if module not in modules:
        return False
    first = attribute.split(".")[0]
    names = top_level_names(modules[module][0])
    if names is None:
        return hasattr(importlib.import_module(module), first)
    return first in names


def unresolved_module_strings(root: Path, package: str = PACKAGE, not_modules=NOT_MODULE_PATHS,
                              old_paths=OLD_PATHS) -> list[str]:
    """``file:line: text`` for every module string of the package (:func:`module_strings`) that names no module or
    module attribute, and every old path of :data:`OLD_PATHS` that is a module again; and, in
    ``protocols/registry.py``, every ``FamilyEntry(...)`` whose module does not define its ``class_name``."""
    modules = module_files(root, package)
    old_keys = set()
    for name in old_paths:
        if name in modules:
            tree = ast.parse(modules[name][0].read_text())
            old_keys |= {(name, key.lineno, key.value) for node in ast.walk(tree) if isinstance(node, ast.Dict)
                         for key in node.keys if isinstance(key, ast.Constant)}
    wrong = []
    for name, path, line, text in module_strings(root, package):
        where = f"{path.relative_to(root)}:{line}"
        if (name, line, text) in old_keys:
            if text in modules:
                wrong.append(f"{where}: {text} is an old path of {name} and a module again")
        elif text not in not_modules and not resolves(text, modules):
            wrong.append(f"{where}: {text}")
    registry = modules.get(f"{package}.protocols.registry")
    if registry is not None:
        for node in ast.walk(ast.parse(registry[0].read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "FamilyEntry":
                fields = dict(zip(("name", "model_types", "objectives", "module", "class_name"), node.args))
                fields.update((k.arg, k.value) for k in node.keywords)
                module, cls = (fields[k].value for k in ("module", "class_name"))
                if not resolves(f"{module}:{cls}", modules):
                    wrong.append(f"{registry[0].relative_to(root)}:{node.lineno}: FamilyEntry {module}:{cls}")
    return wrong


def test_every_module_path_the_package_holds_as_text_names_a_module():
    """The registry's family modules and classes and its command tables, the remote-code bundler's roots, the study
    and command tables, ``python -m`` targets: every string of the package that names one of its modules."""
    strings = module_strings(ROOT)
    modules = module_files(ROOT)
    registry, bundler = f"{PACKAGE}.protocols.registry", f"{PACKAGE}.hub.remote_code"
    entries = [n for n in ast.walk(ast.parse(modules[registry][0].read_text()))
               if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "FamilyEntry"]
    roots = [n.lineno for n in ast.parse(modules[bundler][0].read_text()).body if isinstance(n, ast.Assign)
             and any(getattr(t, "id", "").endswith("_ROOT") for t in n.targets)]
    seen = {(name, line) for name, _, line, _ in strings}
    assert entries and len([s for s in strings if s[0] == registry]) >= len(entries)  # the scan reads them
    assert roots and all((bundler, line) in seen for line in roots), roots
    wrong = unresolved_module_strings(ROOT)
    assert not wrong, "module paths held as text that name no module (or no such name in it):\n" + "\n".join(wrong)


def test_the_module_string_check_finds_a_wrong_module_attribute_class_and_root(tmp_path):
    pkg = tmp_path / PACKAGE
    files = {
        "__init__.py": "",
        "models/__init__.py": "",
        "models/good/__init__.py": "",
        "models/good/family.py": "class GoodFamily:\n    pass\n\n\ndef run():\n    pass\n",
        "protocols/__init__.py": "",
        "protocols/registry.py": 'REGISTRY = [\n'
                                 '    FamilyEntry("good", (), (), "hf_bdlm.models.good.family", "GoodFamily"),\n'
                                 '    FamilyEntry("bad", (), (), "hf_bdlm.models.good.family", "BadFamily"),\n]\n',
        "hub/__init__.py": "",
        "hub/remote_code.py": 'PACKAGE = "hf_bdlm"\n_CONFIG_ROOT = f"{PACKAGE}.models.good.family"\n'
                              '_MODELING_ROOT = f"{PACKAGE}.models.gone.modeling"\n',
        "tables.py": 'RUNS = ["hf_bdlm.models.good.family:run", "hf_bdlm.models.good.family:walk",\n'
                     '        "hf_bdlm.models.good.family.GoodFamily", "hf_bdlm.models.good",\n'
                     '        "hf_bdlm.models.good.familly", "hf_bdlm.dflash.features", f"hf_bdlm.{RUNS}.x"]\n'
                     'TEXT = "hf_bdlm.models.good is where it lives"\n',
        "moved.py": 'MOVED_MODULES = {"hf_bdlm.old": "hf_bdlm.models.good",\n'
                    '                 "hf_bdlm.tables": "hf_bdlm.models.good"}\n',
    }
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(text)
    assert unresolved_module_strings(tmp_path) == [
        f"{Path('hf_bdlm/hub/remote_code.py')}:3: hf_bdlm.models.gone.modeling",
        f"{Path('hf_bdlm/moved.py')}:2: hf_bdlm.tables is an old path of hf_bdlm.moved and a module again",
        f"{Path('hf_bdlm/tables.py')}:1: hf_bdlm.models.good.family:walk",
        f"{Path('hf_bdlm/tables.py')}:3: hf_bdlm.models.good.familly",
        f"{Path('hf_bdlm/protocols/registry.py')}:3: FamilyEntry hf_bdlm.models.good.family:BadFamily"]
