"""Self-contained remote code: the package's own modules bundled into two files for `trust_remote_code=True`.

`BlockDiffusionForMaskedLM.save_pretrained` writes, beside the weights,

- ``configuration_block_diffusion.py``: `BlockDiffusionConfig` and what it imports of the package (the diffusion fields'
  names and validator, :mod:`hf_bdlm.protocols.diffusion_fields`), inlined;
- ``modeling_block_diffusion.py``: the attention rule, planner, kernels, backends, the ``"bdlm"`` attention function,
  block-wise generation and `BlockDiffusionForMaskedLM`, inlined in dependency order;

and an ``auto_map`` in ``config.json`` (`AutoConfig`, `AutoModel`, `AutoModelForMaskedLM`). Where hf_bdlm is not
installed, ``AutoModel.from_pretrained(folder, trust_remote_code=True)`` runs these files. Where it is installed and
imported, transformers prefers the registered (local) classes unless ``trust_remote_code=True`` is passed, so the
``auto_map`` changes nothing for hf_bdlm users.

The files are generated from the installed sources at every save, never edited by hand. The bundler parses each
module, drops its intra-package imports (the names they bring in are inlined in the same file), hoists the stdlib /
torch / transformers imports, and refuses anything it cannot bundle faithfully (an aliased intra-package import, two
modules defining the same top-level name, a relative import other than the configuration file). Functions that
import ``hf_bdlm.hub`` (the save / upload hooks) are left out: a model loaded from remote code is saved by
transformers' own custom-code machinery, which copies these two files. To look at the output::

    python -c "from hf_bdlm.hub import bundle_remote_code as b; print(b()['modeling_block_diffusion.py'])" | less
"""

from __future__ import annotations

import ast
import functools
import inspect
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..version import __version__
from .upload import push_folder_to_hub

PACKAGE = "hf_bdlm"
CONFIG_MODULE = "configuration_block_diffusion"
MODELING_MODULE = "modeling_block_diffusion"
AUTO_MAP = {
    "AutoConfig": f"{CONFIG_MODULE}.BlockDiffusionConfig",
    "AutoModel": f"{MODELING_MODULE}.BlockDiffusionForMaskedLM",
    "AutoModelForMaskedLM": f"{MODELING_MODULE}.BlockDiffusionForMaskedLM",
}
# Bundle roots: everything each imports from the package is inlined into its file; the modeling file imports what the
# configuration file holds from it.
_CONFIG_ROOT = f"{PACKAGE}.models.block_diffusion.configuration"
_MODELING_ROOT = f"{PACKAGE}.models.block_diffusion.modeling"
_HUB = f"{PACKAGE}.hub"
_PACKAGE_DIR = Path(__file__).resolve().parent.parent


class BundleError(RuntimeError):
    """A package module cannot be turned into self-contained remote code as it is written."""


# --- reading the package -----------------------------------------------------------------------


@dataclass
class _Module:
    name: str
    path: Path
    is_package: bool
    lines: list[str]
    tree: ast.Module

    def relative_path(self) -> str:
        return self.path.relative_to(_PACKAGE_DIR.parent).as_posix()


@functools.lru_cache(maxsize=None)
def _load(name: str) -> _Module:
    parts = name.split(".")[1:]
    base = _PACKAGE_DIR.joinpath(*parts)
    if (base / "__init__.py").is_file():
        path, is_package = base / "__init__.py", True
    elif base.with_suffix(".py").is_file():
        path, is_package = base.with_suffix(".py"), False
    else:
        raise BundleError(f"cannot find the source of module {name!r} under {_PACKAGE_DIR}.")
    source = path.read_text(encoding="utf-8")
    return _Module(name, path, is_package, source.splitlines(), ast.parse(source, filename=str(path)))


def _is_intra(module_name: str | None) -> bool:
    return module_name is not None and (module_name == PACKAGE or module_name.startswith(PACKAGE + "."))


def _target(module: _Module, node: ast.ImportFrom) -> str:
    """Absolute name of the module a ``from ... import`` statement reads from."""
    if node.level == 0:
        return node.module or ""
    base = module.name.split(".") if module.is_package else module.name.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _top_level_names(module: _Module) -> dict[str, ast.stmt]:
    """Names a module defines itself at top level (imports excluded)."""
    names = {}
    for node in module.tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        names[leaf.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
    names.pop("__all__", None)
    return names


def _defining_module(module_name: str, name: str, seen: tuple = ()) -> str:
    """The module that defines ``name``, following re-exports of package ``__init__`` files."""
    if (module_name, name) in seen:
        raise BundleError(f"circular re-export of {name!r} through {module_name}.")
    module = _load(module_name)
    if name in _top_level_names(module):
        return module_name
    for node in module.tree.body:
        if isinstance(node, ast.ImportFrom) and _is_intra(_target(module, node)):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    if alias.asname and alias.asname != alias.name:
                        raise BundleError(f"{module.relative_path()} re-exports {alias.name!r} as {alias.asname!r}.")
                    return _defining_module(_target(module, node), alias.name, seen + ((module_name, name),))
    raise BundleError(f"{name!r} is not defined in {module.relative_path()}.")


# --- what each module needs ----------------------------------------------------------------------


def _imports_hub(node: ast.AST, module: _Module) -> bool:
    return any(
        isinstance(n, ast.ImportFrom) and (_target(module, n) == _HUB or _target(module, n).startswith(_HUB + "."))
        for n in ast.walk(node)
    )


def _hub_hooks(module: _Module) -> list[ast.AST]:
    """Functions and methods that import ``hf_bdlm.hub``: left out of the remote code."""
    hooks = []
    for node in ast.walk(module.tree):
        if isinstance(node, (ast.ClassDef, ast.Module)):
            for child in node.body:
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and _imports_hub(child, module):
                    hooks.append(child)
    return hooks


def _span(node: ast.AST) -> tuple[int, int]:
    """First and last line (1-based) of a statement, decorators included."""
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return first, node.end_lineno


def _inside(span: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
    return any(a <= span[0] and span[1] <= b for a, b in spans)


def _intra_imports(module: _Module, dropped: list[tuple[int, int]]):
    """``(node, target, top_level)`` for every intra-package import outside the dropped hooks."""
    top = {id(n) for n in module.tree.body}
    out = []
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import) and any(_is_intra(a.name) for a in node.names):
            raise BundleError(
                f"{module.relative_path()}:{node.lineno}: `import {PACKAGE}...` cannot be bundled; use "
                f"`from .module import name`."
            )
        if isinstance(node, ast.ImportFrom) and _is_intra(_target(module, node)):
            if _inside(_span(node), dropped):
                continue
            for alias in node.names:
                if alias.name == "*" or (alias.asname and alias.asname != alias.name):
                    raise BundleError(
                        f"{module.relative_path()}:{node.lineno}: `{ast.unparse(node)}` cannot be bundled "
                        "(star or aliased intra-package import)."
                    )
            out.append((node, _target(module, node), id(node) in top))
    return out


def _inlined_modules(root: str, imported: frozenset = frozenset()) -> list[str]:
    """Modules inlined into the file of ``root``, dependencies first (top-level imports decide the order); names
    defined in ``imported`` (the configuration file's modules) are imported from that file instead."""
    deps: dict[str, list[str]] = {}  # module -> modules it needs at import time
    found: list[str] = []
    pending = [root]
    while pending:
        name = pending.pop(0)
        if name in deps:
            continue
        module = _load(name)
        dropped = [_span(n) for n in _hub_hooks(module)]
        deps[name] = []
        found.append(name)
        for node, target, top_level in _intra_imports(module, dropped):
            for alias in node.names:
                owner = _defining_module(target, alias.name)
                if owner == _HUB or owner.startswith(_HUB + "."):
                    raise BundleError(
                        f"{module.relative_path()}:{node.lineno} imports {owner} at top level; import it inside "
                        "the function that uses it, so that the remote code can leave that function out."
                    )
                if owner in imported:
                    continue  # imported from the configuration file
                if top_level and owner not in deps[name]:
                    deps[name].append(owner)
                pending.append(owner)
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if name in order:
            return
        if name in visiting:
            raise BundleError(f"import cycle through {name} among top-level imports.")
        visiting.add(name)
        for dep in deps[name]:
            visit(dep)
        visiting.discard(name)
        order.append(name)

    for name in found:
        visit(name)
    return order


# --- rewriting one module --------------------------------------------------------------------------


def _statement_lines(module: _Module, node: ast.stmt) -> tuple[int, int]:
    first, last = _span(node)
    head = module.lines[first - 1].encode()[: node.col_offset].decode()  # AST offsets count UTF-8 bytes
    tail = module.lines[last - 1].encode()[node.end_col_offset :].decode().strip()
    if head.strip() or (tail and not tail.startswith("#")):
        raise BundleError(f"{module.relative_path()}:{first}: put `{ast.unparse(node)}` on lines of its own.")
    return first, last


def _body(module: _Module, *, external: list[str], from_config: frozenset = frozenset()) -> list[str]:
    """The module's code without its imports, hub hooks, ``__all__`` and docstring (kept as a comment).

    External top-level imports are appended to ``external``; names defined in ``from_config`` (the modules of the
    configuration file, when this module goes to another file) are imported from the configuration file.
    """
    if not any(
        isinstance(n, ast.ImportFrom) and n.module == "__future__" and any(a.name == "annotations" for a in n.names)
        for n in module.tree.body
    ):
        # Every bundled file starts with it, so a module without it would change meaning (eager annotations).
        raise BundleError(f"{module.relative_path()} lacks `from __future__ import annotations`.")
    hooks = _hub_hooks(module)
    dropped = [_span(n) for n in hooks]
    edits: dict[int, tuple[int, list[str]]] = {}  # first line -> (last line, replacement)
    for node in hooks:
        first, last = _span(node)
        while first > 1 and module.lines[first - 2].strip().startswith("#"):
            first -= 1  # the comment that introduces the hook goes with it
        edits[first] = (last, [])
    for node, target, top_level in _intra_imports(module, dropped):
        first, last = _statement_lines(module, node)
        indent = " " * node.col_offset
        names = [alias.name for alias in node.names]
        config_names = [n for n in names if _defining_module(target, n) in from_config]
        if config_names:
            if len(config_names) != len(names):
                raise BundleError(f"{module.relative_path()}:{first}: split `{ast.unparse(node)}` by source module.")
            statement = f"from .{CONFIG_MODULE} import {', '.join(names)}"
            if top_level:  # with the other imports at the top of the file
                external.append(statement)
                replacement = []
            else:
                replacement = [indent + statement]
        else:
            replacement = [] if top_level else [f"{indent}pass  # inlined in this file: {', '.join(names)}"]
        edits[first] = (last, replacement)
    for node in module.tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)) and not _is_intra(
            _target(module, node) if isinstance(node, ast.ImportFrom) else node.names[0].name
        ):
            first, last = _statement_lines(module, node)
            statement = ast.unparse(node)
            if statement != "from __future__ import annotations" and statement not in external:
                external.append(statement)
            edits[first] = (last, [])
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            edits[_span(node)[0]] = (_span(node)[1], [])
    docstring = ast.get_docstring(module.tree, clean=False)
    header = [f"# {'-' * 20} {module.relative_path()} {'-' * 20}"]
    if docstring is not None:
        node = module.tree.body[0]
        edits[node.lineno] = (node.end_lineno, [])
        header += ["#", *[f"# {line}".rstrip() for line in inspect.cleandoc(docstring).splitlines()]]
    out, line = [], 1
    while line <= len(module.lines):
        if line in edits:
            last, replacement = edits[line]
            out += replacement
            line = last + 1
        else:
            out.append(module.lines[line - 1])
            line += 1
    while out and not out[0].strip():
        out.pop(0)
    return header + [""] + out


def _file_header(title: str, sources: list[str]) -> list[str]:
    listed = "\n".join(f"    {s}" for s in sources)
    return [
        '"""' + title,
        "",
        f"Generated by hf_bdlm {__version__} (hf_bdlm.hub.remote_code) from:",
        listed,
        "",
        "Do not edit: re-save the model with hf_bdlm to regenerate. With hf_bdlm installed, `import hf_bdlm` and load",
        "without trust_remote_code to use the maintained package instead.",
        '"""',
        "",
        "from __future__ import annotations",
        "",
    ]


def _check_unique_names(modules: list[str]) -> None:
    owners: dict[str, str] = {}
    for name in modules:
        for defined in _top_level_names(_load(name)):
            if defined in owners:
                raise BundleError(
                    f"{defined!r} is defined at top level in both {owners[defined]} and {name}; one remote-code file "
                    "cannot hold both. Rename one of them."
                )
            owners[defined] = name


@functools.lru_cache(maxsize=None)
def bundle_remote_code() -> dict[str, str]:
    """The two remote-code files, ``{file name: source}``, built from the installed package's modules."""
    config_modules = _inlined_modules(_CONFIG_ROOT)
    modeling_modules = _inlined_modules(_MODELING_ROOT, frozenset(config_modules))
    _check_unique_names(config_modules)
    _check_unique_names(modeling_modules)

    external, bodies = [], []
    for name in config_modules:
        bodies += ["", ""] + _body(_load(name), external=external)
    config_lines = _file_header(
        "BlockDiffusionConfig, self-contained (remote code for `trust_remote_code=True`).",
        [_load(n).relative_path() for n in config_modules],
    )
    config_lines += external + bodies

    external, bodies = [], []
    for name in modeling_modules:
        bodies += ["", ""] + _body(_load(name), external=external, from_config=frozenset(config_modules))
    modeling_lines = _file_header(
        "BlockDiffusionForMaskedLM and everything it runs, self-contained (remote code for `trust_remote_code=True`).",
        [_load(n).relative_path() for n in modeling_modules],
    )
    modeling_lines += external + bodies

    files = {
        f"{CONFIG_MODULE}.py": "\n".join(config_lines).rstrip() + "\n",
        f"{MODELING_MODULE}.py": "\n".join(modeling_lines).rstrip() + "\n",
    }
    for file_name, source in files.items():
        _check_bundle(file_name, source)
    return files


def _check_bundle(file_name: str, source: str) -> None:
    """What transformers will check when it loads the file: it compiles, imports nothing of hf_bdlm, and its only
    relative import is the configuration file (transformers finds relative imports with this very regex)."""
    tree = ast.parse(source, filename=file_name)
    compile(tree, file_name, "exec")
    relative = set(re.findall(r"^\s*from\s+\.(\S+)\s+import", source, flags=re.MULTILINE))
    relative |= set(re.findall(r"^\s*import\s+\.(\S+)\s*$", source, flags=re.MULTILINE))
    allowed = set() if file_name.startswith(CONFIG_MODULE) else {CONFIG_MODULE}
    if relative - allowed:
        raise BundleError(f"{file_name} would need files that are not written: {sorted(relative - allowed)}.")
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        if any(_is_intra(n) for n in names):
            raise BundleError(f"{file_name}:{node.lineno} still imports the package: `{ast.unparse(node)}`.")


# --- writing -------------------------------------------------------------------------------------------


def write_remote_code(save_directory: str | os.PathLike) -> list[Path]:
    """Write the two remote-code files into ``save_directory``; returns their paths. (The `auto_map` is set in
    the config by :func:`save_with_remote_code`.)"""
    directory = Path(save_directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for file_name, source in bundle_remote_code().items():
        path = directory / file_name
        path.write_text(source, encoding="utf-8")
        paths.append(path)
    return paths


_HUB_SAVE_KWARGS = ("repo_id", "commit_message", "commit_description", "create_pr", "private", "revision")


def save_with_remote_code(model, save, save_directory, *args, **kwargs):
    """`save_pretrained` of a block-diffusion model: ``save`` (transformers' own) with an ``auto_map`` in
    config.json, then the remote-code files. ``push_to_hub=True`` uploads the whole folder afterwards, so the
    remote-code files are part of the upload."""
    # lazy: import cost measured: +8.7 s (transformers, the model it registers) on the hub's 0.13 s; exports use neither
    from transformers import PreTrainedModel

    if os.path.isfile(save_directory):  # transformers logs the error and writes nothing; so do we
        return save(save_directory, *args, **kwargs)
    bound = inspect.signature(PreTrainedModel.save_pretrained).bind(model, save_directory, *args, **kwargs)
    arguments = bound.arguments
    push = arguments.pop("push_to_hub", False)
    extra = dict(arguments.pop("kwargs", {}))
    hub_kwargs = {k: extra.pop(k) for k in _HUB_SAVE_KWARGS if k in extra} if push else {}
    token = arguments.get("token")
    arguments.pop("self")

    config = model.config
    previous = getattr(config, "auto_map", None)
    config.auto_map = {**(previous or {}), **AUTO_MAP}
    try:
        result = save(**arguments, **extra)
    finally:
        if previous is None:
            del config.auto_map
        else:
            config.auto_map = previous
    is_main = arguments.get("is_main_process", True)
    should_save = getattr(model, "should_save_on_this_rank", None)  # transformers >= 5.24
    if should_save(is_main) if should_save is not None else is_main:
        write_remote_code(save_directory)
        if push:
            repo_id = hub_kwargs.pop("repo_id", os.fspath(save_directory).rstrip(os.sep).split(os.sep)[-1])
            push_folder_to_hub(save_directory, repo_id, token=token, **hub_kwargs)
    return result
