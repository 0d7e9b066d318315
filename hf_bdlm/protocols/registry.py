"""The model families hf_bdlm trains, one folder each, and the registry the rest of the package finds them by.

- ``block_diffusion/``: causal LMs converted into block-diffusion models (`BlockDiffusionForMaskedLM`);
- ``diffusion_gemma/``: transformers' `DiffusionGemmaForBlockDiffusion`, fine-tuned as it is;
- ``dflash/``: DFlash / DFlash2 speculative drafters, trained on a frozen target's captured features;
- ``family.py``: the interface (`ModelFamily`); ``step.py``: the training step of a family that drives its model's
  parts itself; ``card_parts.py``: what every family's model card shares.

Each registry line names a family, the ``model_type`` values (or, for a family whose checkpoints reuse another
family's model type, the ``architectures``) and objectives it owns, and the module of its `ModelFamily` subclass,
imported on first use (as transformers' auto mappings do), so that reading the registry (the trainer config checking
an objective name, the planner reading a config) loads no model code. A new family is one
folder plus one line here (``docs/design.md``, "Adding a model family").

    from hf_bdlm.models import family_for_config, family_for_model
    family_for_config(AutoConfig.from_pretrained(path)).name    # 'diffusion_gemma', 'dflash' or 'block_diffusion'
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from .commands import Command, ExportFormat, Study
from .entry import ModelFamily, RoleUnavailable


@dataclass(frozen=True)
class FamilyEntry:
    """One registry line: the family's name, what it owns, and where its `ModelFamily` subclass lives.

    ``architectures``: ``config.architectures`` values that make a checkpoint this family's whatever its model type
    (a DFlash drafter's ``config.json`` says ``model_type: "qwen3"``, the serving engines' contract, and
    ``architectures: ["DFlash2DraftModel"]``); they are looked at before the model type.

    ``planner_presets``: the names of the presets the family's ``planner_presets()`` returns, so that ``hf-bdlm plan
    --help`` lists them without importing the family's module (tests/package/test_cli_help.py checks they agree).

    ``commands``: the module of the family's command-line tables (``COMMANDS``, ``EXPORT_FORMATS``, ``STUDIES``:
    :mod:`hf_bdlm.protocols.commands`), data only, read without importing torch; ``None``: the family has none.
    """

    name: str
    model_types: tuple[str, ...]
    objectives: tuple[str, ...]
    module: str
    class_name: str
    architectures: tuple[str, ...] = ()
    planner_presets: tuple[str, ...] = ()
    commands: str | None = None


# The families, in the order hosts try them; `register_family` appends one (a family outside this package).
REGISTRY: list[FamilyEntry] = [
    FamilyEntry("block_diffusion", ("block_diffusion",), ("standard", "fast_dllm_v2", "fast_dllm_v2_causal_clean"),
                "hf_bdlm.models.block_diffusion.family", "BlockDiffusionFamily",
                commands="hf_bdlm.models.block_diffusion.commands"),
    FamilyEntry("diffusion_gemma", ("diffusion_gemma",), ("diffusion_gemma",),
                "hf_bdlm.models.diffusion_gemma.family", "DiffusionGemmaFamily",
                planner_presets=("diffusiongemma-26b-a4b",)),
    FamilyEntry("dflash", (), ("dflash",), "hf_bdlm.models.dflash.family", "DFlashFamily",
                architectures=("DFlashDraftModel", "DFlash2DraftModel"), commands="hf_bdlm.models.dflash.commands"),
]
# Objectives announced but not built yet (a clear NotImplementedError instead of "unknown").
PLANNED_OBJECTIVES: tuple[str, ...] = ()
_LOADED: dict[str, ModelFamily] = {}


def family_named(name: str) -> ModelFamily:
    """The family registered as ``name`` (its module imported on first use)."""
    found = _LOADED.get(name)
    if found is not None:
        return found
    entry = entry_named(name)
    family = getattr(importlib.import_module(entry.module), entry.class_name)()
    _LOADED[name] = family
    return family


def register_family(entry: FamilyEntry) -> None:
    """Add a family from outside this package (its folder anywhere importable): one registry line, as the built-in
    families' above. A name, model type, architecture or objective another family owns is refused."""
    taken = {
        "name": {e.name for e in REGISTRY} & {entry.name},
        "model type": {t for e in REGISTRY for t in e.model_types} & set(entry.model_types),
        "architecture": {a for e in REGISTRY for a in e.architectures} & set(entry.architectures),
        "objective": set(all_objectives()) & set(entry.objectives),
    }
    clashes = [f"{what} {sorted(values)}" for what, values in taken.items() if values]
    if clashes:
        raise ValueError(f"cannot register the {entry.name!r} family: {', '.join(clashes)} already registered "
                         f"({family_names()}); choose other names.")
    REGISTRY.append(entry)


def unregister_family(name: str) -> None:
    """Remove a family :func:`register_family` added (a plugin's tests clean up with it)."""
    REGISTRY.remove(entry_named(name))
    _LOADED.pop(name, None)


def entry_named(name: str) -> FamilyEntry:
    """The registry line of the family ``name``."""
    entry = next((e for e in REGISTRY if e.name == name), None)
    if entry is None:
        raise ValueError(f"no model family named {name!r}; the registered ones are {family_names()}.")
    return entry


def family_names() -> list[str]:
    return [e.name for e in REGISTRY]


def all_objectives() -> tuple[str, ...]:
    """Every objective some family trains, in registry order."""
    return tuple(o for e in REGISTRY for o in e.objectives)


def entry_for_model_type(model_type: str | None, architectures=None) -> FamilyEntry | None:
    """The registry line owning a checkpoint of ``model_type`` whose config lists ``architectures`` (an architecture a
    family claims wins over the model type), or ``None`` (a causal LM to convert, or an unknown model)."""
    for architecture in architectures or ():
        found = next((e for e in REGISTRY if architecture in e.architectures), None)
        if found is not None:
            return found
    return next((e for e in REGISTRY if model_type in e.model_types), None)


def family_for_objective(objective: str) -> FamilyEntry:
    """The registry line of the family that trains ``objective``; a clear error naming them all otherwise."""
    found = next((e for e in REGISTRY if objective in e.objectives), None)
    if found is None:
        raise ValueError(f"unknown objective {objective!r}; the model families train {list(all_objectives())}.")
    return found


def get_objective(name: str, config_or_kwargs):
    """Build the objective called ``name``, of whichever model family trains it.

    Args:
        name (`str`): `"standard"`, `"fast_dllm_v2"`, `"fast_dllm_v2_causal_clean"`, or an objective of another
            family (:func:`all_objectives`).
        config_or_kwargs: the model's config (e.g. a `BlockDiffusionConfig`: block size, mask token, noise range and
            weighting are read from it) or a mapping of constructor arguments (`block_size`, `mask_token_id`, ...).
    """
    if name in PLANNED_OBJECTIVES:
        raise NotImplementedError(
            f"objective {name!r} is planned but not implemented yet; available now: {sorted(all_objectives())}."
        )
    if not any(name in e.objectives for e in REGISTRY):
        valid = sorted(all_objectives()) + list(PLANNED_OBJECTIVES)
        raise ValueError(f"unknown objective {name!r}; valid names: {valid}.")
    family = family_named(family_for_objective(name).name)
    return family.role("training").objective_class(name).build(config_or_kwargs)


def family_for_config(config) -> ModelFamily:
    """The family of a checkpoint's config: the one claiming one of its ``architectures``, else the one owning its
    ``model_type``, else the family that converts causal LMs (which raises its own clear error for a model that is
    not one)."""
    entry = entry_for_model_type(getattr(config, "model_type", None), getattr(config, "architectures", None))
    if entry is not None:
        return family_named(entry.name)
    return converting_family()


def family_for_model_type(model_type: str | None, architectures=None) -> ModelFamily:
    """As :func:`family_for_config`, from a parsed ``config.json``'s ``model_type`` (and ``architectures``)."""
    entry = entry_for_model_type(model_type, architectures)
    return family_named(entry.name) if entry is not None else converting_family()


def converting_family() -> ModelFamily:
    for entry in REGISTRY:
        family = family_named(entry.name)
        if family.converts_causal_lms:
            return family
    raise RuntimeError("no registered model family converts causal LMs.")


def _family_tables(name: str) -> tuple:
    """The table ``name`` (``COMMANDS``, ``EXPORT_FORMATS`` or ``STUDIES``) of every family's commands module, joined in
    registry order."""
    return tuple(row for e in REGISTRY if e.commands for row in getattr(importlib.import_module(e.commands), name, ()))


def family_commands() -> tuple[Command, ...]:
    """The `hf-bdlm` commands the families own (``hf-bdlm dflash ...``), as tables: no model code imported."""
    return _family_tables("COMMANDS")


def export_formats() -> dict[str, ExportFormat]:
    """``hf-bdlm export --format NAME``: name -> the format's table, for every format a family writes."""
    return {f.name: f for f in _family_tables("EXPORT_FORMATS")}


def export_format(name: str) -> ExportFormat:
    """The export format ``name``; an unknown one is refused naming the known ones."""
    formats = export_formats()
    if name not in formats:
        raise ValueError(f"unknown export format {name!r}; the formats are {sorted(formats)}.")
    return formats[name]


def family_studies() -> dict[str, Study]:
    """``hf-bdlm bench --only NAME``: name -> the study's table, for every study a family owns."""
    return {s.name: s for s in _family_tables("STUDIES")}


def family_for_model(model) -> ModelFamily | None:
    """The family whose model ``model`` is (wrappers such as PEFT and DDP looked through), or ``None``."""
    for entry in REGISTRY:
        family = family_named(entry.name)
        if family.claims_model(model):
            return family
    return None


__all__ = ["PLANNED_OBJECTIVES", "export_format", "export_formats", "family_commands", "family_studies", "REGISTRY", "FamilyEntry", "ModelFamily", "RoleUnavailable", "entry_named", "register_family", "unregister_family", "all_objectives", "converting_family",
           "entry_for_model_type", "family_for_config", "family_for_model", "family_for_model_type",
           "family_for_objective", "family_named", "family_names", "get_objective"]
