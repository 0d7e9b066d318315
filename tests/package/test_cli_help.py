"""`hf-bdlm --help` and every subcommand's help: all of them print in a fresh interpreter that never imports torch,
transformers, trl, datasets, accelerate or peft (the parsers import light modules only, so help is quick), and each
exits 0. `hf-bdlm train --help` lists every field of the recipe's dataclasses, one group per declaring dataclass,
from a file (hf_bdlm/data/train_help.jsonl) that equals what TRL's parser of the recipe gives.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys

from hf_bdlm.protocols.registry import REGISTRY, family_commands

HEAVY = ("torch", "transformers", "trl", "datasets", "accelerate", "peft")

# Every command and subcommand (found by walking the parser), its help printed through `main`, and the heavy
# modules that appeared while it was built and printed.
PROBE = r"""
import argparse, contextlib, io, json, sys
from hf_bdlm.cli import build_parser, main

HEAVY = %r


def commands(parser, prefix=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield prefix + (name,)
                yield from commands(sub, prefix + (name,))


def loaded():
    return sorted(m for m in HEAVY if m in sys.modules)


after_parser = loaded()
helps = {}
for command in [()] + list(commands(build_parser())):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            code = main([*command, "--help"])
        except SystemExit as done:
            code = done.code
    helps[" ".join(command)] = {"code": code, "text": out.getvalue(), "heavy": loaded()}
print(json.dumps({"after_parser": after_parser, "helps": helps}))
""" % (HEAVY,)


def probe() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", COLUMNS="120")
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


_PROBED: dict = {}


def probed() -> dict:
    if not _PROBED:
        _PROBED.update(probe())
    return _PROBED


def test_every_help_exits_0_without_importing_a_heavy_library():
    result = probed()
    assert result["after_parser"] == [], f"building the parser imported {result['after_parser']}"
    helps = result["helps"]
    expected = {"", "train", "convert", "generate", "export", "serve", "eval", "eval swebench", "eval terminal-bench",
                "lm-eval", "bench", "plan", *family_command_names()}
    assert expected <= set(helps), sorted(expected - set(helps))
    lm_eval = importlib.util.find_spec("lm_eval") is not None
    for command, help_ in helps.items():
        # Without the lmeval extra, `hf-bdlm lm-eval` names the extra to install (exit 2).
        assert help_["code"] == (0 if command != "lm-eval" or lm_eval else 2), (command, help_["code"])
        assert help_["heavy"] == [], f"`hf-bdlm {command} --help` imported {help_['heavy']}"
        assert help_["text"].startswith("usage:") or command == "lm-eval", (command, help_["text"][:200])
    assert "COMMAND" in helps[""]["text"] and all(c.name in helps[""]["text"] for c in family_commands())
    presets = [p for entry in REGISTRY for p in entry.planner_presets]
    assert presets and all(p in helps["plan"]["text"] for p in presets)  # listed without importing the families


def family_command_names() -> list[str]:
    """Every command the registered families own (``dflash``, ``dflash init``, ...), read from their tables."""
    def walk(command, prefix=""):
        name = f"{prefix} {command.name}".strip()
        return [name, *(n for sub in command.commands for n in walk(sub, name))]

    return [name for command in family_commands() for name in walk(command)]


# --- train --help ----------------------------------------------------------------------------------------------------
GROUPS = ("SFTScriptArguments (hf_bdlm.train)", "ScriptArguments (trl.", "BDLMSFTConfig (hf_bdlm.trainer.config)",
          "SFTConfig (trl.", "TrainingArguments (transformers.", "ModelConfig (trl.")
OWN_OPTIONS = {"help", "nproc", "num_processes", "accelerate-config", "config_file", "config"}


def listed_options(text: str) -> dict[str, list[str]]:
    """``{group title: first option name of each action in it}`` of an argparse help text."""
    groups: dict[str, list[str]] = {}
    title = None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            title = line[:-1]
            groups[title] = []
        found = re.match(r"^  --([\w-]+)(?=[ ,]|$)", line)
        if found and title is not None:
            groups[title].append(found.group(1))
    return groups


def recipe_fields() -> set[str]:
    from hf_bdlm.train import make_parser

    return {f.name for dataclass_type in make_parser().dataclass_types for f in dataclasses.fields(dataclass_type)
            if f.init}


def test_train_help_lists_every_field_of_the_recipe_grouped_by_dataclass():
    text = probed()["helps"]["train"]["text"]
    groups = listed_options(text)
    titles = [t for t in groups if any(t.startswith(g) for g in GROUPS)]
    assert [next(g for g in GROUPS if t.startswith(g)) for t in titles] == list(GROUPS), list(groups)
    for title, field in (("BDLMSFTConfig", "block_size"), ("BDLMSFTConfig", "block_parallel_mode"),
                         ("SFTConfig", "max_length"), ("TrainingArguments", "max_steps"),
                         ("ModelConfig", "model_name_or_path"), ("SFTScriptArguments", "exact_match_examples")):
        [options] = [v for t, v in groups.items() if t.startswith(title + " ")]
        assert field in options, (title, field)
    assert "--learning_rate" in text  # TRL's SFTConfig declares it again (its own default)
    listed = {name for options in groups.values() for name in options} - OWN_OPTIONS
    # `--no_x`: the negative of a boolean field x that defaults to True (as TRL's parser adds it).
    listed = {n for n in listed if not (n.startswith("no_") and n[3:] in listed)}
    assert listed == recipe_fields()


def test_the_train_help_file_equals_what_the_recipes_parser_gives():
    from hf_bdlm.train import recipe_help_records
    from hf_bdlm.train_help import REGENERATE, RECORDS

    stored = [json.loads(line) for line in RECORDS.read_text().splitlines()]
    live = recipe_help_records()
    assert stored[0]["kind"] == live[0]["kind"] == "versions"
    assert stored[1:] == live[1:], (
        f"{RECORDS} no longer matches the recipe's dataclasses (TRL / transformers {live[0]}, the file was written "
        f"with {stored[0]}); regenerate it: {REGENERATE}")


def test_the_plan_parser_lists_the_presets_the_families_define():
    from hf_bdlm.planner.model import preset_names, presets

    assert preset_names() == tuple(presets())


# --- the package face ------------------------------------------------------------------------------------------------
REGISTRATION = r"""
import sys
import hf_bdlm
assert "transformers" not in sys.modules and "torch" not in sys.modules, "import hf_bdlm imported them"
if sys.argv[1] == "user":  # a user's script: transformers imported after the package, nothing else of it used
    from transformers import AutoConfig, AutoModelForMaskedLM
elif sys.argv[1] == "inside":  # transformers first imported from inside one of the package's modules
    import hf_bdlm.models.block_diffusion.configuration
    from transformers import AutoConfig, AutoModelForMaskedLM
elif sys.argv[1] == "library":  # through a library that imports transformers itself
    import peft
    from transformers import AutoConfig, AutoModelForMaskedLM
from transformers import AttentionInterface
config = AutoConfig.for_model("block_diffusion")
print(type(config).__name__, AutoModelForMaskedLM._model_mapping[type(config)].__name__,
      "bdlm" in AttentionInterface._global_mapping)
"""


def test_importing_transformers_after_the_package_registers_its_classes():
    for case in ("user", "inside", "library"):
        done = subprocess.run([sys.executable, "-c", REGISTRATION, case], capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, HF_HUB_OFFLINE="1"))
        assert done.returncode == 0, (case, done.stderr[-3000:])
        assert done.stdout.split() == ["BlockDiffusionConfig", "BlockDiffusionForMaskedLM", "True"], case
