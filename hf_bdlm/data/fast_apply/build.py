"""Builder of the fast-apply dataset: functions from the standard library's source, each with one edit.

    python -m hf_bdlm.data.fast_apply.build               # rewrites train.jsonl, heldout.jsonl, NOTICE, README.md here
    python -m hf_bdlm.data.fast_apply.build --out-dir /tmp/fa

Source: the `.py` files of the standard library of the interpreter that runs this script, for the modules and
packages of `MODULE_ROOTS` (pure Python, human-written). The builder refuses to run on another major.minor than
`PINNED_PYTHON` unless `--python-version-ok` is given, and records the exact version (`python_version`) in every
record and in `NOTICE`; the shipped files were built from CPython's 3.11 standard library. Files are skipped when they
are not UTF-8, hold a tab or a carriage return, sit in a test folder, or carry a licence text of their own besides the
PSF licence (`FOREIGN_LICENCE_PHRASES`: `http.cookies`, `urllib.robotparser`, `xml.etree`, `xmlrpc.client`), so
`NOTICE` covers all the code; modules known to carry such terms (`logging`, `tarfile`, `optparse`, `tomllib`, `re`,
`sqlite3`, `turtle`, ...) and generated or data-only ones (`keyword`, `token`, `encodings`, ...) are not in
`MODULE_ROOTS` at all, nor are `test`, `idlelib`, `lib2to3`, `tkinter`, `ensurepip` and `distutils`.

Functions: the module's top-level functions and the methods of its top-level classes (decorators included), cut out
by their line range (`ast`), dedented, with trailing whitespace removed from each line. Kept when they parse on their
own, hold no docstring longer than `MAX_DOCSTRING_LINES` lines (so answers stay mostly code) and no tab, and tokenize
(embedded SmolLM2 tokenizer) to `MIN_TOKENS`..`MAX_TOKENS` tokens; a text seen before (same function twice) is dropped.
At most `MAX_PER_MODULE` functions per module (a seeded sample), so that large modules do not dominate.

Edits: one per function, of six kinds (`EDIT_KINDS`), made on the text at positions `ast` gives, so the rest of the
function keeps its exact formatting:

- `inserted_statement`: a guard for a parameter at the top of the body (`if p is None: raise ValueError(...)` or an
  `assert`), a `logger.debug` line after an assignment, or a `continue` guard at the top of a `for` loop's body;
- `changed_literal`: a number changed (0 -> 1, 1 -> 2, up to 16 -> plus one, else doubled), `True`/`False` flipped, or a
  word of a message string replaced (`WORD_SWAPS`);
- `changed_condition`: in an `if`/`elif`/`while` test, a comparison flipped (`<` <-> `>=`, `==` <-> `!=`, `in` <->
  `not in`, `is` <-> `is not`, ...), `and` <-> `or` swapped, or a plain test negated (or its `not` dropped);
- `renamed_local`: a local variable assigned in the function renamed at every use (`RENAMES`, else `<name>_value`),
  to a name the function does not contain;
- `removed_line`: a one-line simple statement removed (not a `return`, `raise`, `pass`, import, or an assignment to a
  name read elsewhere in the function; never the only statement of its block);
- `new_argument`: a keyword parameter with a default added to the signature (before `**kwargs`), used in the body for
  some names (`if verbose: logger.debug(...)`), just added for the others.

Each edit is checked: the edited function parses, differs from the original (also as a tree), and for the literal,
condition and rename kinds its tree equals the original's tree with the same change made on the tree. A kind applies
to a function when its edit passes these checks, the answer is `MIN_TOKENS`..`MAX_TOKENS` tokens long and the snippet
elides something (holds a marker; functions whose edit spans them whole are dropped). Of the kinds that apply, the
one used least so far is taken (ties: the kinds in cyclic order from the function's index plus a seeded offset), so
the six kinds come out about equally often.

Snippet: the lines of the edited function around each changed line range (`difflib` on lines) with `CONTEXT_LINES`
lines of context, widened to whole logical lines (a statement over several lines or a docstring is shown whole or not
at all); each elided run of two or more lines becomes one `# ... existing code ...` line (a single elided line is shown
as it is), indented like the run's first statement (a run at the top: like the less indented of its last statement
and the first shown one).

Split: by top-level module or package (`email.*` all in one split, so no module is in both): the groups in seeded order
go to the held-out split until it holds `HELDOUT_TARGET` records (a group larger than `MAX_HELDOUT_GROUP` records is
left to train), the rest to train. Each split is then shuffled (seeded), so that any prefix covers many modules.

Deterministic: a fixed seed, string-seeded generators (not hash-dependent), modules and functions in sorted order,
folder listings sorted, and JSON written with fixed key order.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import difflib
import functools
import io
import json
import keyword
import os
import pathlib
import random
import re
import statistics
import sys
import sysconfig
import textwrap
import time
import tokenize

from . import EDIT_KINDS, FAST_APPLY_DIR, MARKER, count_tokens, embedded_tokenizer, format_prompt

PINNED_PYTHON = (3, 11)
SEED = 20250611
MIN_TOKENS, MAX_TOKENS = 48, 320
MAX_DOCSTRING_LINES = 6
MAX_PER_MODULE = 24
HELDOUT_TARGET = 400
MAX_HELDOUT_GROUP = 80
CONTEXT_LINES = 2

# Top-level standard-library modules and packages read (packages with all their submodules but test folders).
MODULE_ROOTS = (
    "_collections_abc", "_compression", "_markupbase", "_osx_support", "_pydecimal", "_pyio", "_strptime",
    "_threading_local", "_weakrefset", "abc", "argparse", "ast", "asyncio", "base64", "bdb", "bisect", "bz2",
    "calendar", "cgi", "cmd", "code", "codecs", "codeop", "collections", "colorsys", "compileall", "concurrent",
    "configparser", "contextlib", "copy", "copyreg", "csv", "dataclasses", "datetime", "dbm", "difflib", "dis",
    "doctest", "email", "enum", "filecmp", "fileinput", "fnmatch", "fractions", "ftplib", "functools", "genericpath",
    "getopt", "gettext", "glob", "graphlib", "gzip", "hashlib", "heapq", "hmac", "html", "http", "imaplib",
    "importlib", "inspect", "ipaddress", "json", "linecache", "locale", "lzma", "mailbox", "mimetypes",
    "modulefinder", "multiprocessing", "netrc", "ntpath", "numbers", "operator", "os", "pathlib", "pdb", "pickle",
    "pickletools", "pkgutil", "poplib", "posixpath", "pprint", "py_compile", "pyclbr", "pydoc", "queue", "quopri",
    "random", "reprlib", "rlcompleter", "runpy", "sched", "secrets", "selectors", "shelve", "shlex", "shutil",
    "smtplib", "socket", "socketserver", "ssl", "statistics", "string", "subprocess", "symtable", "sysconfig",
    "tabnanny", "tempfile", "textwrap", "threading", "timeit", "tokenize", "traceback", "tracemalloc", "types",
    "typing", "unittest", "urllib", "uuid", "venv", "warnings", "wave", "weakref", "webbrowser", "wsgiref", "xml",
    "xmlrpc", "zipapp", "zipfile", "zipimport", "zoneinfo",
)
SKIPPED_FOLDERS = {"test", "tests", "__pycache__", "idle_test"}
# A file holding one of these carries licence terms of its own (besides the PSF licence): left out.
FOREIGN_LICENCE_PHRASES = ("Permission to use", "Redistribution and use", "Permission is hereby granted",
                           "Permission is granted", "SPDX-License-Identifier", "Secret Labs", "two licenses",
                           "GNU General Public")

WORD_SWAPS = {
    "invalid": "bad", "must": "should", "cannot": "can't", "expected": "wanted", "argument": "parameter",
    "unknown": "unrecognized", "value": "input", "file": "path", "error": "failure", "empty": "blank",
    "missing": "absent", "not": "never", "unsupported": "unhandled", "name": "identifier", "only": "just",
    "object": "instance", "already": "previously", "required": "needed", "type": "kind", "number": "count",
    "string": "text", "list": "sequence", "found": "located", "allowed": "permitted", "closed": "shut",
    "length": "size", "line": "row",
}
RENAMES = {
    "i": "idx", "j": "jdx", "k": "key", "n": "count", "s": "text", "v": "value", "x": "item", "c": "ch", "e": "exc",
    "f": "fp", "m": "match", "p": "part", "d": "mapping", "l": "items", "t": "tmp", "a": "first", "b": "second",
    "res": "result", "ret": "result", "rv": "result", "buf": "buffer", "msg": "message", "tmp": "temp",
    "val": "value", "idx": "index", "pos": "position", "lst": "items", "obj": "instance", "fn": "func",
    "func": "callback", "args": "arguments", "name": "label", "result": "outcome", "value": "item_value",
    "data": "payload", "line": "text_line", "lines": "text_lines", "path": "file_path", "key": "item_key",
    "parts": "pieces", "size": "length", "start": "begin", "end": "stop", "text": "content", "count": "total",
    "length": "size_total", "items": "entries", "state": "current_state",
}
NEW_ARGUMENTS = (("strict", "False", "bool"), ("verbose", "False", "bool"), ("timeout", "None", "float | None"),
                 ("encoding", "None", "str | None"), ("limit", "None", "int | None"), ("debug", "False", "bool"),
                 ("check", "True", "bool"), ("quiet", "False", "bool"), ("errors", '"strict"', "str"),
                 ("max_depth", "None", "int | None"), ("callback", "None", "Callable | None"),
                 ("copy", "False", "bool"))
FLAG_ARGUMENTS = {"verbose", "debug"}
COMPARE_FLIPS = {ast.Lt: (ast.GtE, ">="), ast.GtE: (ast.Lt, "<"), ast.Gt: (ast.LtE, "<="), ast.LtE: (ast.Gt, ">"),
                 ast.Eq: (ast.NotEq, "!="), ast.NotEq: (ast.Eq, "=="), ast.Is: (ast.IsNot, "is not"),
                 ast.IsNot: (ast.Is, "is"), ast.In: (ast.NotIn, "not in"), ast.NotIn: (ast.In, "in")}
COMPARE_TEXT = {ast.Lt: r"<", ast.GtE: r">=", ast.Gt: r">", ast.LtE: r"<=", ast.Eq: r"==", ast.NotEq: r"!=",
                ast.Is: r"is", ast.IsNot: r"is\s+not", ast.In: r"in", ast.NotIn: r"not\s+in"}
BUILTIN_NAMES = frozenset(dir(builtins))


def count_tokens_batch(texts: list[str]) -> list[int]:
    """`count_tokens` of each text, encoded in one batch (the same counts, less overhead)."""
    if not texts:
        return []
    return [len(e.ids) for e in embedded_tokenizer().encode_batch_fast(texts, add_special_tokens=False)]


class EditFailed(Exception):
    """The function offers no place for this kind of edit."""


# --------------------------------------------------------------------------------------------------------------- source


def stdlib_dir() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def module_files(root: pathlib.Path) -> list[tuple[str, str]]:
    """`(dotted module name, path relative to the standard library folder)` of every module of `MODULE_ROOTS`,
    sorted by module name; test folders and missing roots are skipped."""
    found = []
    for name in MODULE_ROOTS:
        if (root / f"{name}.py").is_file():
            found.append((name, f"{name}.py"))
            continue
        package = root / name
        if not (package / "__init__.py").is_file():
            continue
        for folder, dirnames, filenames in os.walk(package):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_FOLDERS)
            rel = pathlib.Path(folder).relative_to(root)
            for filename in sorted(filenames):
                if not filename.endswith(".py"):
                    continue
                parts = list(rel.parts) + ([] if filename == "__init__.py" else [filename[:-3]])
                found.append((".".join(parts), (rel / filename).as_posix()))
    return sorted(found)


def read_source(path: pathlib.Path) -> str | None:
    """The file's text, or None when it is not UTF-8, holds a tab or carriage return, or carries its own licence."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return None
    if "\t" in text or "\r" in text or "\x0c" in text:
        return None
    if any(phrase in text for phrase in FOREIGN_LICENCE_PHRASES):
        return None
    return text


def _docstring_lines(node) -> int:
    body = getattr(node, "body", None)
    if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
        return body[0].end_lineno - body[0].lineno + 1
    return 0


def _statements(node):
    """`node` and the statements under it, through statement blocks only (no expressions: faster than `ast.walk`)."""
    stack = [node]
    while stack:
        node = stack.pop()
        yield node
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            block = getattr(node, field, None)
            if isinstance(block, list):
                stack.extend(block)


def is_clean_function(function: str) -> bool:
    """Whether a cut-out function parses on its own, as one function, with no docstring over `MAX_DOCSTRING_LINES`."""
    try:
        parsed = ast.parse(function)
    except SyntaxError:
        return False
    if len(parsed.body) != 1 or not isinstance(parsed.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    return all(_docstring_lines(n) <= MAX_DOCSTRING_LINES for n in _statements(parsed))


def extract_functions(module: str, rel_path: str, text: str) -> list[dict]:
    """Top-level functions and methods of top-level classes of one module, as dedented texts with their line range
    (not checked yet: see `is_clean_function`)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.split("\n")
    candidates = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            candidates.append((node.name, node))
        elif isinstance(node, ast.ClassDef):
            candidates += [(f"{node.name}.{item.name}", item) for item in node.body
                           if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))]
    functions = []
    for qualname, node in candidates:
        first = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
        last = node.end_lineno - 1
        if not lines[first].lstrip().startswith(("@", "def ", "async ")):  # the decorator / def line starts the range
            continue
        tail = lines[last][_char_col(lines[last], node.end_col_offset):].strip()
        if tail and not tail.startswith("#"):  # e.g. `; other statement` after the function's last line
            continue
        segment = textwrap.dedent("\n".join(lines[first:last + 1]))
        function = "\n".join(line.rstrip() for line in segment.split("\n")).strip("\n")
        if function[:1].isspace() or MARKER in function:
            continue
        functions.append({"module": module, "qualname": qualname, "source": f"Lib/{rel_path}:{first + 1}-{last + 1}",
                          "lineno": first + 1, "text": function})
    return functions


# ----------------------------------------------------------------------------------------------------------- text edits


@functools.lru_cache(maxsize=8)
def _parse(text: str) -> ast.Module:
    """The tree of a function's text, shared by the edits tried on it: read only (`_expected` mutates a fresh one)."""
    return ast.parse(text)


def _char_col(line: str, byte_col: int) -> int:
    """`ast` columns count UTF-8 bytes; the text is edited by characters."""
    return len(line.encode("utf-8")[:byte_col].decode("utf-8", errors="ignore"))


def _span(lines: list[str], node) -> tuple[int, int, int, int]:
    """0-based (start line, start char, end line, end char) of a node in the function text."""
    l0, l1 = node.lineno - 1, node.end_lineno - 1
    return l0, _char_col(lines[l0], node.col_offset), l1, _char_col(lines[l1], node.end_col_offset)


def _segment(lines: list[str], span) -> str:
    l0, c0, l1, c1 = span
    if l0 == l1:
        return lines[l0][c0:c1]
    return "\n".join([lines[l0][c0:]] + lines[l0 + 1:l1] + [lines[l1][:c1]])


def _replace(lines: list[str], replacements: list[tuple[tuple[int, int, int, int], str]]) -> list[str]:
    """Apply non-overlapping `(span, new text)` replacements, last first."""
    text_lines = list(lines)
    for (l0, c0, l1, c1), new in sorted(replacements, key=lambda r: r[0], reverse=True):
        merged = text_lines[l0][:c0] + new + text_lines[l1][c1:]
        text_lines[l0:l1 + 1] = merged.split("\n")
    return text_lines


def _indent(line: str) -> str:
    return line[:len(line) - len(line.lstrip())]


def _starts_line(lines: list[str], node) -> bool:
    l0, c0, _, _ = _span(lines, node)
    return lines[l0][:c0].strip() == ""


def _ends_line(lines: list[str], node) -> bool:
    _, _, l1, c1 = _span(lines, node)
    rest = lines[l1][c1:].strip()
    return rest == "" or rest.startswith("#")


def _parents(tree) -> dict:
    parents = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    return parents


def _walk_index(tree, node) -> int:
    return next(i for i, n in enumerate(ast.walk(tree)) if n is node)


def _expected(text: str, tree, node, mutate) -> str:
    """`ast.dump` of a copy of `tree` (parsed from `text`) in which the copy of `node` went through
    `mutate(copy_of_node, parent)`."""
    index = _walk_index(tree, node)
    clone = ast.parse(text)  # a fresh tree: faster than copy.deepcopy
    target = list(ast.walk(clone))[index]
    mutate(target, _parents(clone).get(target))
    return ast.dump(clone)


def _replace_child(parent, old, new) -> None:
    for field, value in ast.iter_fields(parent):
        if value is old:
            setattr(parent, field, new)
            return
        if isinstance(value, list):
            for i, item in enumerate(value):
                if item is old:
                    value[i] = new
                    return
    raise AssertionError("child not found")


def _docstring_nodes(tree) -> set:
    return {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)) and _docstring_lines(n)}


def _fstring_parts(tree) -> set:
    return {id(n) for j in ast.walk(tree) if isinstance(j, ast.JoinedStr) for n in ast.walk(j)}


def _words(text: str) -> set[str]:
    return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))


def _params(func) -> list[ast.arg]:
    a = func.args
    return a.posonlyargs + a.args + a.kwonlyargs


def _guard_params(func) -> list[str]:
    """Parameters a guard can check: not `self`/`cls`, not `*args`/`**kwargs`, without a default."""
    a = func.args
    positional = a.posonlyargs + a.args
    defaults = dict(zip([p.arg for p in positional[len(positional) - len(a.defaults):]], a.defaults))
    defaults.update({p.arg: d for p, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None})
    names = []
    for p in positional + a.kwonlyargs:
        if p.arg in ("self", "cls") or p.arg.startswith("_"):
            continue
        if p.arg not in defaults:
            names.append(p.arg)
    return names


def _body_start(lines: list[str], func) -> tuple[int, str] | None:
    """(line index, indentation) where a statement can go at the top of the body, after the docstring."""
    body = func.body[1:] if _docstring_lines(func) else func.body
    anchor = body[0] if body else func.body[0]
    if not _starts_line(lines, anchor) or anchor.lineno - 1 <= func.lineno - 1:
        return None
    l0 = anchor.lineno - 1 if body else anchor.end_lineno
    return l0, _indent(lines[anchor.lineno - 1])


def edit_inserted_statement(text: str, rng: random.Random) -> tuple:
    lines = text.split("\n")
    tree = _parse(text)
    func = tree.body[0]
    name = func.name
    options = []
    start = _body_start(lines, func)
    if start is not None:
        l0, ind = start
        for p in _guard_params(func):
            options.append((l0, [f"{ind}if {p} is None:", f'{ind}    raise ValueError("{name}() needs {p}")'],
                            f"guard on {p}"))
            options.append((l0, [f'{ind}assert {p} is not None, "{p} is required"'], f"assert on {p}"))
    for node in ast.walk(func):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and _starts_line(lines, node) and _ends_line(lines, node) and node is not func):
            target = node.targets[0].id
            ind = _indent(lines[node.lineno - 1])
            options.append((node.end_lineno, [f'{ind}logger.debug("{name}: {target}=%r", {target})'],
                            f"log of {target}"))
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name) and _starts_line(lines, node.body[0]) \
                and node.body[0].lineno > node.lineno:
            ind = _indent(lines[node.body[0].lineno - 1])
            options.append((node.body[0].lineno - 1, [f"{ind}if {node.target.id} is None:", f"{ind}    continue"],
                            f"skip of {node.target.id}"))
    if not options:
        raise EditFailed("no place to insert a statement")
    l0, new_lines, what = rng.choice(options)
    edited = lines[:l0] + new_lines + lines[l0:]
    return "\n".join(edited), what


def _new_int(value: int) -> int:
    if value == 0:
        return 1
    if value == 1:
        return 2
    return value + 1 if value <= 16 else value * 2


def edit_changed_literal(text: str, rng: random.Random) -> tuple:
    lines = text.split("\n")
    tree = _parse(text)
    skip = _docstring_nodes(tree) | _fstring_parts(tree)
    options = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Constant) or id(node) in skip or node.lineno != node.end_lineno:
            continue
        span = _span(lines, node)
        source = _segment(lines, span)
        value = node.value
        if isinstance(value, bool):
            if source in ("True", "False"):
                options.append((node, span, str(not value), not value))
        elif isinstance(value, int):
            new = _new_int(value)
            if re.fullmatch(r"0|[1-9][0-9]*", source):
                options.append((node, span, str(new), new))
            elif re.fullmatch(r"0x[0-9a-f]+", source):
                options.append((node, span, hex(new), new))
            elif re.fullmatch(r"0X[0-9A-F]+", source):
                options.append((node, span, "0X" + format(new, "X"), new))
        elif isinstance(value, float):
            if re.fullmatch(r"[0-9]+\.[0-9]+", source):
                new = value * 2 if value else 1.0
                if "e" not in repr(new):
                    options.append((node, span, repr(new), new))
        elif isinstance(value, str):
            match = re.fullmatch(r"(['\"])([^'\"\\\n]*)\1", source)
            if not match or " " not in value:
                continue
            words = re.findall(r"[A-Za-z']+", value)
            for word in words:
                if word.lower() in WORD_SWAPS and word == word.lower():
                    replacement = WORD_SWAPS[word]
                    if "'" in replacement and match.group(1) == "'":
                        continue
                    new = re.sub(rf"\b{re.escape(word)}\b", replacement, value, count=1)
                    options.append((node, span, f"{match.group(1)}{new}{match.group(1)}", new))
                    break
    if not options:
        raise EditFailed("no literal to change")
    node, span, new_source, new_value = rng.choice(options)

    def mutate(target, parent):
        target.value = new_value

    edited = "\n".join(_replace(lines, [(span, new_source)]))
    return edited, f"{_segment(lines, span)} -> {new_source}", _expected(text, tree, node, mutate)


def edit_changed_condition(text: str, rng: random.Random) -> tuple:
    lines = text.split("\n")
    tree = _parse(text)
    skip = _fstring_parts(tree)
    options = []
    for stmt in ast.walk(tree):
        if not isinstance(stmt, (ast.If, ast.While)) or id(stmt.test) in skip:
            continue
        test = stmt.test
        for node in ast.walk(test):
            if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in COMPARE_FLIPS:
                a, b = _span(lines, node.left), _span(lines, node.comparators[0])
                if a[2] != b[0]:
                    continue
                gap = lines[a[2]][a[3]:b[1]]
                op = type(node.ops[0])
                m = re.fullmatch(rf"(\s*)({COMPARE_TEXT[op]})(\s*)", gap)
                if not m or (op in (ast.Is, ast.IsNot, ast.In, ast.NotIn) and not (m.group(1) and m.group(3))):
                    continue
                new_op, new_text = COMPARE_FLIPS[op]
                span = (a[2], a[3], b[0], b[1])

                def mutate(target, parent, new_op=new_op):
                    target.ops = [new_op()]

                options.append((node, span, f"{m.group(1)}{new_text}{m.group(3)}", mutate,
                                f"{m.group(2)} -> {new_text}"))
            elif isinstance(node, ast.BoolOp) and len(node.values) == 2:
                a, b = _span(lines, node.values[0]), _span(lines, node.values[1])
                if a[2] != b[0]:
                    continue
                gap = lines[a[2]][a[3]:b[1]]
                old = "and" if isinstance(node.op, ast.And) else "or"
                new = "or" if old == "and" else "and"
                m = re.fullmatch(rf"(\s+){old}(\s+)", gap)
                if not m:
                    continue

                def mutate(target, parent, new=new):
                    target.op = ast.Or() if new == "or" else ast.And()

                options.append((node, (a[2], a[3], b[0], b[1]), f"{m.group(1)}{new}{m.group(2)}", mutate,
                                f"{old} -> {new}"))
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            t, o = _span(lines, test), _span(lines, test.operand)
            if t[0] == o[0] and re.fullmatch(r"not\s+", lines[t[0]][t[1]:o[1]]) and not isinstance(
                    test.operand, (ast.BoolOp, ast.Compare, ast.IfExp, ast.NamedExpr)):
                def mutate(target, parent):
                    _replace_child(parent, target, target.operand)

                options.append((test, (t[0], t[1], o[0], o[1]), "", mutate, "not dropped"))
        elif isinstance(test, (ast.Name, ast.Attribute, ast.Call, ast.Subscript)):
            t = _span(lines, test)

            def mutate(target, parent):
                _replace_child(parent, target, ast.UnaryOp(op=ast.Not(), operand=target))

            options.append((test, (t[0], t[1], t[0], t[1]), "not ", mutate, "negated"))
    if not options:
        raise EditFailed("no condition to change")
    node, span, new_text, mutate, what = rng.choice(options)
    edited = "\n".join(_replace(lines, [(span, new_text)]))
    return edited, what, _expected(text, tree, node, mutate)


def edit_renamed_local(text: str, rng: random.Random) -> tuple:
    lines = text.split("\n")
    tree = _parse(text)
    func = tree.body[0]
    nodes = list(ast.walk(func))
    if any(isinstance(n, (ast.ClassDef, ast.Match, ast.Global, ast.Nonlocal)) for n in nodes):
        raise EditFailed("class, match, global or nonlocal inside")
    excluded = {a.arg for n in nodes if isinstance(n, ast.arguments)
                for a in n.posonlyargs + n.args + n.kwonlyargs + [n.vararg, n.kwarg] if a is not None}
    excluded |= {n.name for n in nodes if isinstance(n, (ast.ExceptHandler, ast.FunctionDef, ast.AsyncFunctionDef))}
    excluded |= {(a.asname or a.name).split(".")[0] for n in nodes if isinstance(n, ast.alias) for a in [n]}
    stored = sorted({n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)} - excluded)
    words = _words(text)
    options = []
    for old in stored:
        uses = [n for n in nodes if isinstance(n, ast.Name) and n.id == old]
        if len(uses) < 2 or old.startswith("__"):
            continue
        spans = [_span(lines, n) for n in uses]
        if any(_segment(lines, s) != old for s in spans):
            continue  # a position ast reports inside an f-string that is off: leave the name alone
        new = RENAMES.get(old, f"{old}_value")
        if new in words or keyword.iskeyword(new) or new in BUILTIN_NAMES:
            new = f"{old}_value"
            if new in words:
                continue
        options.append((old, new, spans))
    if not options:
        raise EditFailed("no local to rename")
    old, new, spans = rng.choice(options)
    edited = "\n".join(_replace(lines, [(s, new) for s in spans]))
    clone = ast.parse(text)
    for n in ast.walk(clone):
        if isinstance(n, ast.Name) and n.id == old:
            n.id = new
    return edited, f"{old} -> {new}", ast.dump(clone)


def edit_removed_line(text: str, rng: random.Random) -> tuple:
    lines = text.split("\n")
    tree = _parse(text)
    func = tree.body[0]
    docstrings = _docstring_nodes(tree)
    loaded = {n.id for n in ast.walk(func) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    options = []
    for parent in ast.walk(func):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(parent, field, None)
            if not isinstance(block, list) or not block or not isinstance(block[0], ast.stmt):
                continue
            real = [s for s in block if not (isinstance(s, ast.Expr) and id(s.value) in docstrings)]
            if len(real) < 2:
                continue
            for stmt in real:
                if isinstance(stmt, (ast.Return, ast.Raise, ast.Pass, ast.Import, ast.ImportFrom, ast.Global,
                                     ast.Nonlocal, ast.If, ast.For, ast.AsyncFor, ast.While, ast.With,
                                     ast.AsyncWith, ast.Try, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                                     ast.Match, getattr(ast, "TryStar", ast.Try))):
                    continue
                if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                    continue
                if isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                    names = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
                    if isinstance(stmt, ast.Assign) and names & loaded:
                        continue
                if stmt.lineno != stmt.end_lineno or not _starts_line(lines, stmt) or not _ends_line(lines, stmt):
                    continue
                options.append(stmt)
    if not options:
        raise EditFailed("no line to remove")
    stmt = rng.choice(options)
    l0 = stmt.lineno - 1
    return "\n".join(lines[:l0] + lines[l0 + 1:]), lines[l0].strip()


def edit_new_argument(text: str, rng: random.Random) -> tuple:
    lines = text.split("\n")
    tree = _parse(text)
    func = tree.body[0]
    a = func.args
    if a.posonlyargs:
        raise EditFailed("positional-only parameters")
    words = _words(text)
    choices = [c for c in NEW_ARGUMENTS if c[0] not in words]
    if not choices:
        raise EditFailed("no fresh parameter name")
    name, default, annotation = rng.choice(choices)
    annotated = any(p.annotation is not None for p in _params(func) + [a.vararg, a.kwarg] if p is not None)
    param = f"{name}: {annotation} = {default}" if annotated else f"{name}={default}"
    if a.kwarg is not None:
        l0, c0, _, _ = _span(lines, a.kwarg)
        if lines[l0][c0 - 2:c0] != "**":
            raise EditFailed("no ** before **kwargs")
        insertion = ((l0, c0 - 2, l0, c0 - 2), f"{param}, ")
    else:
        last = None
        if a.kwonlyargs:
            last = [a.kwonlyargs[-1]] + ([a.kw_defaults[-1]] if a.kw_defaults[-1] is not None else [])
        elif a.vararg is not None:
            last = [a.vararg]
        elif a.args:
            last = [a.args[-1]] + ([a.defaults[-1]] if a.defaults else [])
        if last is None:
            l0 = func.lineno - 1
            m = re.match(rf"(\s*(?:async\s+)?def\s+{re.escape(func.name)}\s*\()\)", lines[l0])
            if not m:
                raise EditFailed("unusual empty signature")
            c0 = len(m.group(1))
            insertion = ((l0, c0, l0, c0), param)
        else:
            end = max(_span(lines, n)[2:] for n in last)
            insertion = ((end[0], end[1], end[0], end[1]), f", {param}")
    edited_lines = _replace(lines, [insertion])
    what = f"parameter {name}={default}"
    if name in FLAG_ARGUMENTS and rng.random() < 0.5:
        edited_func = ast.parse("\n".join(edited_lines)).body[0]
        start = _body_start(edited_lines, edited_func)
        if start is not None:
            l0, ind = start
            edited_lines = (edited_lines[:l0] + [f"{ind}if {name}:", f'{ind}    logger.debug("{func.name}() called")']
                            + edited_lines[l0:])
            what += ", used"
    return "\n".join(edited_lines), what


EDITORS = {
    "inserted_statement": edit_inserted_statement, "changed_literal": edit_changed_literal,
    "changed_condition": edit_changed_condition, "renamed_local": edit_renamed_local,
    "removed_line": edit_removed_line, "new_argument": edit_new_argument,
}
assert tuple(EDITORS) == EDIT_KINDS


@functools.lru_cache(maxsize=64)
def _dump(text: str) -> str:
    return ast.dump(_parse(text))


def apply_edit(kind: str, original: str, rng: random.Random) -> tuple[str, str]:
    """`(edited function, short description)`; raises EditFailed when the kind has no place or its check fails."""
    result = EDITORS[kind](original, rng)
    edited, what = result[0], result[1]
    try:
        edited_tree = ast.parse(edited)
    except SyntaxError as err:
        raise EditFailed(f"edited function does not parse: {err}") from None
    if edited == original or ast.dump(edited_tree) == _dump(original):
        raise EditFailed("edit changed nothing")
    if len(result) == 3 and ast.dump(edited_tree) != result[2]:
        raise EditFailed("edited tree differs from the expected tree")
    if kind == "new_argument":
        params = [p.arg for p in _params(edited_tree.body[0])]
        if what.split()[1].split("=")[0] not in params:
            raise EditFailed("parameter not in the edited signature")
    return edited, what


# -------------------------------------------------------------------------------------------------------------- snippet


def logical_lines(text: str) -> list[tuple[int, int]]:
    """`(first, last)` 0-based line index of the logical line each line belongs to: a statement continued over
    several lines (brackets, a multi-line string, a backslash) is one logical line; a blank or comment line is its
    own."""
    lines = text.split("\n")
    groups = [(i, i) for i in range(len(lines))]
    start = None
    for tok in tokenize.generate_tokens(io.StringIO(text + "\n").readline):
        if tok.type in (tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            continue
        if tok.type == tokenize.NEWLINE:
            if start is not None:
                last = min(tok.start[0] - 1, len(lines) - 1)
                for i in range(start, last + 1):
                    groups[i] = (start, last)
            start = None
        elif start is None:
            start = tok.start[0] - 1
    return groups


def make_snippet(original: str, edited: str, context: int = CONTEXT_LINES) -> str:
    """The edit as code-editing tools write it: the changed lines of `edited` with `context` lines around them,
    widened to whole logical lines (a statement over several lines, a docstring, is shown whole or not at all); each
    elided run of two or more lines is replaced by one marker line, indented like the run's first statement, or, for a
    run at the top, like the less indented of the run's last statement and the first shown one."""
    old, new = original.split("\n"), edited.split("\n")
    groups = logical_lines(edited)
    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    shown = [False] * len(new)
    for tag, _, _, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        # a removed line (j1 == j2) shows the lines around the gap it leaves
        for j in range(max(0, j1 - context), min(len(new), max(j2, j1) + context)):
            shown[j] = True
    for j in range(len(new)):
        if shown[j]:
            first, last = groups[j]
            for i in range(first, last + 1):
                shown[i] = True
    # a single elided line is shown instead of a marker
    for j in range(len(new)):
        if not shown[j] and (j == 0 or shown[j - 1]) and (j == len(new) - 1 or shown[j + 1]):
            shown[j] = True
    out, j = [], 0
    while j < len(new):
        if shown[j]:
            out.append(new[j])
            j += 1
            continue
        k = j
        while k < len(new) and not shown[k]:
            k += 1
        gap = [i for i in range(j, k) if new[i].strip()]
        if not gap:  # blank lines only: shown as they are
            out += new[j:k]
        else:
            if j == 0:  # above the first shown line: the less indented of the last elided and the first shown
                below = [i for i in range(k, len(new)) if new[i].strip()][:1]
                indent = min((_indent(new[groups[i][0]]) for i in [gap[-1]] + below), key=len)
            else:  # the first elided statement
                indent = _indent(new[groups[gap[0]][0]])
            out.append(indent + MARKER)
        j = k
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------------------ the build


def _function_rng(function: dict, salt: str) -> random.Random:
    return random.Random(f"{SEED}:{salt}:{function['module']}:{function['qualname']}:{function['lineno']}")


def collect_functions(root: pathlib.Path, log=print) -> tuple[list[dict], list[str]]:
    """The eligible functions of `MODULE_ROOTS`, at most `MAX_PER_MODULE` per module, in (module, line) order, and
    the modules whose files were skipped (`read_source`)."""
    seen, selected, skipped = set(), [], []
    for module, rel_path in module_files(root):
        text = read_source(root / rel_path)
        if text is None:
            skipped.append(module)
            continue
        functions = []
        for function in extract_functions(module, rel_path, text):
            if function["text"] not in seen:
                seen.add(function["text"])
                functions.append(function)
        # each token holds at least one byte: fewer bytes than MIN_TOKENS cannot make enough tokens
        functions = [f for f in functions if len(f["text"].encode("utf-8")) >= MIN_TOKENS]
        for function, tokens in zip(functions, count_tokens_batch([f["text"] for f in functions])):
            function["tokens"] = tokens
        eligible = [f for f in functions if MIN_TOKENS <= f["tokens"] <= MAX_TOKENS and is_clean_function(f["text"])]
        if len(eligible) > MAX_PER_MODULE:
            eligible = random.Random(f"{SEED}:select:{module}").sample(eligible, MAX_PER_MODULE)
            eligible.sort(key=lambda f: f["lineno"])
        selected += eligible
    log(f"skipped {len(skipped)} files (encoding, tabs or a licence of their own): {', '.join(skipped)}")
    return selected, skipped


def make_record(function: dict, index: int, offset: int, used: dict[str, int], python_version: str) -> dict | None:
    """The record of one function, or None when no kind of edit applies. A kind applies when its edit passes its
    checks, the answer has `MIN_TOKENS`..`MAX_TOKENS` tokens and the snippet elides something (holds a marker). Of the
    kinds that apply, the one used least so far (`used`, updated) is taken; ties go to the kinds in cyclic order from
    the function's `index + offset`."""
    original = function["text"]
    cyclic = [EDIT_KINDS[(index + offset + i) % len(EDIT_KINDS)] for i in range(len(EDIT_KINDS))]
    # the first kind that applies in this order is the least used one that applies (ties: the cyclic order)
    for kind in sorted(cyclic, key=lambda k: used[k]):
        try:
            edited, what = apply_edit(kind, original, _function_rng(function, kind))
        except EditFailed:
            continue
        tokens = count_tokens(edited)
        if not MIN_TOKENS <= tokens <= MAX_TOKENS:
            continue
        snippet = make_snippet(original, edited)
        if MARKER in snippet:
            break
    else:
        return None
    used[kind] += 1
    return {
        "prompt": [{"role": "user", "content": format_prompt(function["module"], original, snippet)}],
        "completion": [{"role": "assistant", "content": edited}],
        "answer": edited,
        "task": "fast_apply",
        "edit": kind,
        "edit_detail": what,
        "module": function["module"],
        "qualname": function["qualname"],
        "source": function["source"],
        "python_version": python_version,
        "original": original,
        "snippet": snippet,
        "answer_tokens": tokens,
    }


def split_records(records: list[dict]) -> tuple[list[dict], list[dict]]:
    """(train, held-out): whole top-level modules/packages, in seeded order, to held-out until it is large enough."""
    groups: dict[str, list[dict]] = {}
    for record in records:
        groups.setdefault(record["module"].split(".")[0], []).append(record)
    order = sorted(groups)
    random.Random(f"{SEED}:split").shuffle(order)
    train, heldout = [], []
    for name in order:
        group = groups[name]
        if len(heldout) < HELDOUT_TARGET and len(group) <= MAX_HELDOUT_GROUP:
            heldout += group
        else:
            train += group
    random.Random(f"{SEED}:shuffle:train").shuffle(train)
    random.Random(f"{SEED}:shuffle:heldout").shuffle(heldout)
    return train, heldout


def split_stats(records: list[dict]) -> dict:
    answer = [r["answer_tokens"] for r in records]
    prompt = count_tokens_batch([r["prompt"][0]["content"] for r in records])
    kinds = {k: sum(r["edit"] == k for r in records) for k in EDIT_KINDS}
    return {
        "records": len(records), "modules": len({r["module"] for r in records}),
        "answer_tokens": {"min": min(answer), "median": statistics.median(answer),
                          "mean": round(statistics.fmean(answer), 1), "max": max(answer)},
        "prompt_tokens": {"min": min(prompt), "median": statistics.median(prompt),
                          "mean": round(statistics.fmean(prompt), 1), "max": max(prompt)},
        "edits": kinds,
    }


def psf_licence_text(root: pathlib.Path) -> str:
    """The PSF License Agreement section of the interpreter's own `LICENSE.txt`, reproduced as its clause 2 asks."""
    path = root / "LICENSE.txt"
    if not path.is_file():
        raise SystemExit(f"{path} is missing: the PSF licence text to ship with the extracted code is read from it.")
    text = path.read_text(encoding="utf-8")
    start = text.index("PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2")
    end = text.index("BEOPEN.COM LICENSE AGREEMENT")
    return text[start:end].strip("\n")


def notice_text(root: pathlib.Path, version: str, modules: list[str], skipped: list[str]) -> str:
    licence = psf_licence_text(root)
    match = re.search(r'"(Copyright \(c\) .*?All Rights Reserved)"', licence, re.S)
    if match is None:
        raise SystemExit("No PSF copyright notice found in the interpreter's LICENSE.txt.")
    copyright_notice = textwrap.fill(" ".join(match.group(1).split()), width=110, initial_indent="    ",
                                     subsequent_indent="    ")
    module_list = textwrap.fill(", ".join(modules) + ".", width=110)
    skipped_list = textwrap.fill(", ".join(skipped) + "." if skipped else "none.", width=110)
    return f"""\
Fast-apply dataset of hf_bdlm: notice for the extracted code
============================================================

The functions in train.jsonl and heldout.jsonl (the fields "original" and "answer", the function and the edit
shown in "prompt", and "completion") are taken from the source of the standard library of CPython {version}
(the Lib/*.py files of that interpreter, read by build.py in this folder). That code carries PSF's notice of
copyright,

{copyright_notice}

and is distributed under the Python Software Foundation License Version 2, reproduced below from the
LICENSE.txt file of the same interpreter. Files whose source carries licence terms of their own besides
the PSF licence (or that are not UTF-8, or hold tabs) were left out:
{skipped_list}

Summary of the changes made (clause 3 of the licence): each function was cut out of its module by its line
range, dedented, and stripped of trailing whitespace; in "answer" and "completion" it was then changed by one
mechanical edit (a statement inserted, a literal changed, a condition changed, a local variable renamed, a line
removed, or a keyword parameter added), recorded in the field "edit". The prompts' instructions and the edits'
generator are part of hf_bdlm.

The records come from these {len(modules)} modules:
{module_list}

{licence}
"""


def readme_text(version: str, stats: dict) -> str:
    rows = []
    for split, s in stats.items():
        a, p = s["answer_tokens"], s["prompt_tokens"]
        kinds = ", ".join(f"{k} {v}" for k, v in s["edits"].items())
        rows.append(f"| {split} | {s['records']} | {s['modules']} | {a['min']} / {a['median']} / {a['mean']} / "
                    f"{a['max']} | {p['min']} / {p['median']} / {p['mean']} / {p['max']} | {kinds} |")
    table = "\n".join(rows)
    return f"""\
---
license: psf-2.0
configs:
- config_name: default
  data_files:
  - split: train
    path: train.jsonl
  - split: test
    path: heldout.jsonl
---
# Fast-apply code edits (hf_bdlm)

Written by `build.py` in this folder (do not edit by hand). A Python function from the standard library of
CPython {version} and an edit snippet (`{MARKER}` marks unchanged lines) in the prompt; the whole edited function,
bare, as the answer. The split `test` of `datasets.load_dataset` on this folder is `heldout.jsonl`. The code's
licence: `NOTICE`. Scoring: `hf_bdlm.data.fast_apply.exact_match` and `ast_equal`.

Token counts use the embedded SmolLM2 tokenizer, without special tokens; prompt tokens count the user message
(min / median / mean / max).

| split | records | modules | answer tokens | prompt tokens | edits |
|---|---|---|---|---|---|
{table}
"""


def write_jsonl(records: list[dict], path: pathlib.Path) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def build(out_dir: pathlib.Path, root: pathlib.Path | None = None, log=print) -> dict:
    """Build the dataset from the running interpreter's standard library into `out_dir`; returns the statistics."""
    root = root or stdlib_dir()
    version = ".".join(map(str, sys.version_info[:3]))
    functions, skipped = collect_functions(root, log)
    offset = random.Random(f"{SEED}:offset").randrange(len(EDIT_KINDS))
    used = dict.fromkeys(EDIT_KINDS, 0)
    records = [r for i, f in enumerate(functions) if (r := make_record(f, i, offset, used, version)) is not None]
    log(f"{len(functions)} functions, {len(records)} records")
    train, heldout = split_records(records)
    stats = {"train": split_stats(train), "heldout": split_stats(heldout)}
    out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(train, out_dir / "train.jsonl")
    write_jsonl(heldout, out_dir / "heldout.jsonl")
    modules = sorted({r["module"] for r in records})
    (out_dir / "NOTICE").write_text(notice_text(root, version, modules, skipped), encoding="utf-8", newline="\n")
    (out_dir / "README.md").write_text(readme_text(version, stats), encoding="utf-8", newline="\n")
    return stats


def check_python_version(ok: bool) -> None:
    running = sys.version_info[:2]
    if running != PINNED_PYTHON and not ok:
        raise SystemExit(
            f"This builder is pinned to the standard library of Python {PINNED_PYTHON[0]}.{PINNED_PYTHON[1]}, but runs "
            f"on Python {running[0]}.{running[1]} ({sys.version.split()[0]}): another version's standard library gives "
            "other functions, so the shipped files would change. Run it with Python "
            f"{PINNED_PYTHON[0]}.{PINNED_PYTHON[1]}, or pass --python-version-ok to build from "
            f"{running[0]}.{running[1]}'s anyway.")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=pathlib.Path, default=FAST_APPLY_DIR)
    parser.add_argument("--python-version-ok", action="store_true",
                        help=f"build even when the interpreter is not Python {PINNED_PYTHON[0]}.{PINNED_PYTHON[1]}")
    args = parser.parse_args(argv)
    check_python_version(args.python_version_ok)
    start = time.perf_counter()
    stats = build(args.out_dir)
    print(json.dumps(stats, indent=1))
    print(f"wrote {args.out_dir} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
