"""The families' command line as tables (hf_bdlm/protocols/commands.py): each family's ``commands.py`` is read without
importing torch, transformers or argparse, every ``run`` it names resolves to a function, the parsers built from the
tables behave as argparse's own (mutually exclusive groups, defaults), and an unknown export format is refused naming
the known ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hf_bdlm.cli import add_table_command, main
from hf_bdlm.protocols.commands import Argument, Command, resolve
from hf_bdlm.protocols.registry import REGISTRY, export_format, export_formats, family_commands, family_studies

READ_TABLES = r"""
import importlib, json, sys
from hf_bdlm.protocols.registry import REGISTRY

modules = [e.commands for e in REGISTRY if e.commands]
tables = {m: {name: len(getattr(importlib.import_module(m), name))
              for name in ("COMMANDS", "EXPORT_FORMATS", "STUDIES")} for m in modules}
heavy = sorted(m for m in ("torch", "transformers", "argparse") if m in sys.modules)
print(json.dumps({"tables": tables, "heavy": heavy}))
"""


def test_a_familys_command_table_is_read_without_importing_torch():
    done = subprocess.run([sys.executable, "-c", READ_TABLES], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["heavy"] == [], f"reading the command tables imported {found['heavy']}"
    assert found["tables"]["hf_bdlm.models.dflash.commands"] == {"COMMANDS": 1, "EXPORT_FORMATS": 0, "STUDIES": 1}
    assert found["tables"]["hf_bdlm.models.block_diffusion.commands"] == {"COMMANDS": 0, "EXPORT_FORMATS": 1,
                                                                          "STUDIES": 0}


def _runs(command: Command):
    if command.run:
        yield command.run
    for sub in command.commands:
        yield from _runs(sub)


def test_every_table_names_a_runner_in_its_familys_folder():
    entries = {e.name: e for e in REGISTRY}
    assert entries["dflash"].commands == "hf_bdlm.models.dflash.commands"
    assert entries["block_diffusion"].commands == "hf_bdlm.models.block_diffusion.commands"
    [dflash] = family_commands()
    assert dflash.name == "dflash" and [c.name for c in dflash.commands] == ["init", "capture", "export", "check"]
    references = [*_runs(dflash), *(f.run for f in export_formats().values())]
    assert references == ["hf_bdlm.models.dflash.inference.export:run_init",
                          "hf_bdlm.models.dflash.training.capture:run_capture",
                          "hf_bdlm.models.dflash.inference.export:run_export",
                          "hf_bdlm.models.dflash.inference.export:run_check",
                          "hf_bdlm.models.block_diffusion.inference.export_sdar:run_export"]
    assert all(callable(resolve(reference)) for reference in references)
    assert {name: study.module for name, study in family_studies().items()} == {
        "drafter": "hf_bdlm.models.dflash.studies.benchmark"}
    assert callable(resolve("hf_bdlm.models.dflash.studies.benchmark:add_arguments"))


def test_a_parser_built_from_a_table_keeps_argparses_rules():
    import argparse

    table = Command("toy", help="a toy", commands=(
        Command("go", run="json:dumps", required_groups=("source",), arguments=(
            Argument("folder"),
            Argument("--ids", type="int", nargs="+", exclusive="source"),
            Argument("--from", dest="origin", exclusive="source"),
            Argument(("--size", "--length"), type="float", default=1.5, metavar="S"),
            Argument("--mode", choices=("a", "b"), default="a"),
            Argument("--force", action="store_true"),
        )),))
    parser = argparse.ArgumentParser(prog="t")
    add_table_command(parser.add_subparsers(dest="command", required=True), table)
    args = parser.parse_args(["toy", "go", "dir", "--ids", "1", "2", "--length", "3"])
    assert (args.toy_command, args.folder, args.ids, args.origin, args.size, args.mode, args.force) == \
        ("go", "dir", [1, 2], None, 3.0, "a", False)
    assert args.func.__name__ == "dumps" and args.func.reference == "json:dumps"
    for bad in (["toy", "go", "dir"], ["toy", "go", "dir", "--ids", "1", "--from", "x"],
                ["toy", "go", "dir", "--from", "x", "--mode", "c"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_an_unknown_export_format_is_refused_naming_the_known_ones(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        main(["export", str(tmp_path), str(tmp_path / "out"), "--format", "gguf"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'gguf'" in err and "'sdar'" in err
    with pytest.raises(ValueError, match=r"unknown export format 'gguf'; the formats are \['sdar'\]"):
        export_format("gguf")
