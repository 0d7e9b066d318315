"""``hf-bdlm train --help``: the SFT recipe's fields, grouped by the dataclass that declares each, without importing
the recipe.

The recipe (:mod:`hf_bdlm.train`) parses its arguments with TRL's ``TrlParser`` over three dataclasses (its script
arguments, ``BDLMSFTConfig`` and TRL's ``ModelConfig``), some 190 fields. Building that parser imports TRL,
transformers and torch (seconds), too slow for a help page; so the help reads the options as that parser shows them
from :data:`RECORDS` (``hf_bdlm/data/train_help.jsonl``, one JSON object per line, written from the dataclasses by
:func:`hf_bdlm.train.write_recipe_help`) and lays them out with argparse, one argument group per dataclass.
``tests/package/test_cli_help.py`` checks that the file equals what the installed TRL and transformers give, so it
cannot go stale unnoticed; the recipe itself always parses with the live ``TrlParser`` (``python -m hf_bdlm.train
--help`` shows those options as they are).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RECORDS = Path(__file__).parent / "data" / "train_help.jsonl"  # package data beside the shipped tasks
REGENERATE = 'python -c "from hf_bdlm.train import write_recipe_help; write_recipe_help()"'


def read_records(path: Path = RECORDS) -> tuple[dict, list[dict], list[dict]]:
    """``(versions, groups, options)`` of the help file: the package versions it was written with, one record per
    argument group (``title``, ``description``) and one per option (``group``, ``field``, ``options``, ``args``,
    ``help``), in the parser's order."""
    versions, groups, options = {}, [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        kind = record.pop("kind")
        if kind == "versions":
            versions = record
        elif kind == "group":
            groups.append(record)
        elif kind == "option":
            options.append(record)
        else:
            raise ValueError(f"{path}: unknown record kind {kind!r}; regenerate the file with {REGENERATE}.")
    return versions, groups, options


def add_recipe_fields(parser: argparse.ArgumentParser, path: Path = RECORDS) -> None:
    """Add the recipe's options to ``parser`` for its help only (they are never parsed there: ``hf-bdlm train``
    hands every option it does not know to the recipe)."""
    versions, groups, options = read_records(path)
    recipe = parser.add_argument_group(
        "the recipe (hf_bdlm.train)",
        "Every option below goes to the recipe, whose TrlParser reads a YAML file of field values (--config) and "
        "then the command line, which overrides it. The fields as TRL "
        f"{versions.get('trl', '?')} and transformers {versions.get('transformers', '?')} define them "
        "(python -m hf_bdlm.train --help: those of the installed versions).")
    recipe.add_argument("--config", metavar="YAML", help="a YAML file of field values; its 'env:' mapping sets "
                        "environment variables (e.g. recipes/configs/smollm2_cpu_csbp.yaml)")
    titled = {}
    for group in groups:
        titled[group["name"]] = parser.add_argument_group(group["title"], group["description"] or None)
    for option in options:
        group = titled.get(option["group"])
        if group is None:
            raise ValueError(f"{path}: the option {option['options'][0]} names the group {option['group']!r}, which "
                             f"the file does not hold; regenerate it with {REGENERATE}.")
        text = option["help"].replace("%", "%%")
        if option["args"]:
            group.add_argument(*option["options"], metavar=option["args"], help=text, default=argparse.SUPPRESS)
        else:
            group.add_argument(*option["options"], action="store_true", help=text, default=argparse.SUPPRESS)


class RecipeHelp(argparse.Action):
    """``-h`` / ``--help`` of ``hf-bdlm train``: the command's own options, then the recipe's
    (:func:`add_recipe_fields`)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        add_recipe_fields(parser)
        parser.print_help()
        parser.exit()


__all__ = ["RECORDS", "RecipeHelp", "add_recipe_fields", "read_records"]
