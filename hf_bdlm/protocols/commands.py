"""The tables a model family declares its command line in: `hf-bdlm` commands (`Command`, their options `Argument`),
`hf-bdlm export --format` formats (`ExportFormat`) and `hf-bdlm bench` studies (`Study`).

A family keeps its tables in one module of its folder, ``commands.py``, named by its registry line
(``FamilyEntry.commands``); that module holds data only (``COMMANDS``, ``EXPORT_FORMATS``, ``STUDIES``: tuples of the
types below), so reading it imports neither torch, transformers nor argparse. The `hf-bdlm` command (``hf_bdlm/cli.py``)
builds its argparse parsers from the tables; what runs a command is named as ``"module:function"`` and imported only
when the command runs, called with the parsed namespace (it returns the exit code).

    COMMANDS = (Command("toy", help="a family's own commands", commands=(
        Command("check", help="check an exported folder", arguments=(Argument("folder"),),
                run="hf_bdlm.models.toy.inference.export:run_check"),)),)
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

# `Argument.type` by name: the builtins argparse converts with; any other type is a "module:function" reference.
TYPES = {"int": int, "float": float, "str": str}


@dataclass(frozen=True)
class Argument:
    """One option or positional argument, as argparse's ``add_argument`` takes it; a field left ``None`` is not passed
    (argparse's own default applies: ``False`` for ``action="store_true"``).

    ``flags``: the option strings (``"--target"``, or ``("--max-batch-size", "--max-num-seqs")``) or a positional's
    name. ``type``: ``"int"``, ``"float"``, ``"str"`` or a ``"module:function"`` reference (imported when the parser is
    built: it must be light). ``exclusive``: the name of a mutually exclusive group of the command (at most one of
    the arguments naming it is given; `Command.required_groups` makes one of them required).
    """

    flags: str | tuple[str, ...]
    type: str | None = None
    choices: tuple[Any, ...] | None = None
    default: Any = None
    nargs: int | str | None = None
    action: str | None = None
    required: bool | None = None
    help: str | None = None
    metavar: str | None = None
    dest: str | None = None
    exclusive: str | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return (self.flags,) if isinstance(self.flags, str) else tuple(self.flags)

    def keywords(self) -> dict[str, Any]:
        """The keywords of argparse's ``add_argument`` (``type`` resolved to a callable, unset fields left out)."""
        found = {name: getattr(self, name) for name in ("choices", "default", "nargs", "action", "required", "help",
                                                        "metavar", "dest") if getattr(self, name) is not None}
        if "choices" in found:
            found["choices"] = list(found["choices"])
        if self.type is not None:
            found["type"] = TYPES.get(self.type) or resolve(self.type)
        return found


@dataclass(frozen=True)
class Command:
    """An `hf-bdlm` command: ``hf-bdlm NAME [arguments]``, or a group of subcommands (``hf-bdlm NAME COMMAND ...``,
    ``commands``; the chosen one's name lands in ``args.<name>_command``).

    ``run``: ``"module:function"``, called with the parsed namespace, returning the exit code (a command with
    ``commands`` runs the chosen one's). ``required_groups``: the ``exclusive`` groups of ``arguments`` one of whose
    arguments must be given.
    """

    name: str
    help: str | None = None
    description: str | None = None
    arguments: tuple[Argument, ...] = ()
    run: str | None = None
    commands: tuple[Command, ...] = ()
    required_groups: tuple[str, ...] = ()


@dataclass(frozen=True)
class ExportFormat:
    """``hf-bdlm export --format NAME``: a format a family writes for serving engines. Its ``arguments`` join the
    command's (one group, ``--format NAME``); ``run`` (``"module:function"``) gets the parsed namespace with
    ``source``, ``output``, ``push_to_hub``, ``private``, ``overwrite`` and those arguments, and returns the exit code.
    """

    name: str
    arguments: tuple[Argument, ...] = ()
    run: str = ""


@dataclass(frozen=True)
class Study:
    """An `hf-bdlm bench` study a family owns (``--only NAME``): ``module`` holds ``add_arguments(group)`` (its options,
    argparse only at import), ``run(cfg, args, path)`` (the records), ``report(records) -> str`` (its summary section)
    and optionally ``check_arguments(cfg, args)`` and ``plot(records, path)`` (:mod:`hf_bdlm.benchmarks.suite`)."""

    name: str
    module: str


def resolve(reference: str):
    """The object a ``"module:function"`` reference names (the module imported now)."""
    module, _, name = reference.partition(":")
    if not module or not name:
        raise ValueError(f"{reference!r} is not a 'module:function' reference.")
    return getattr(importlib.import_module(module), name)


__all__ = ["Argument", "Command", "ExportFormat", "Study", "TYPES", "resolve"]
