"""`ModelFamily`: a family's entry — how hf_bdlm recognises and builds its models, and the roles it plays.

A family is one kind of model the project trains (the registry, :mod:`hf_bdlm.protocols.registry`, lists them by
name). Everything specific to a family lives in its folder under ``hf_bdlm/models/``; the trainer, the plugin, the
planner, the server and the hub reach it through its entry, found in the registry, and never name a family.

The entry is small: it recognises a model, builds a configuration and a model from fields, reads a model's block
size and renders its card. Everything else is a *role* (:mod:`hf_bdlm.protocols.roles`), handed out by
:meth:`ModelFamily.role` — ``"training"`` (`TrainingSpec`), ``"serving"`` (`ServingSpec`), ``"drafting"``
(`DraftingSpec`), ``"evaluation"`` (`EvaluationSpec`), ``"planning"`` (`PlanningSpec`), ``"policy"`` (`PolicySpec`:
the GRPO trainer's rollouts and log-probabilities). A family implements only the
roles it has (as vLLM's models implement the capability protocols they support); asking a family for a role it lacks
raises :class:`RoleUnavailable`, whose message says what to do instead::

    family = family_for_config(config)
    step = family.role("training").step(model, args, tokenizer, plugin)   # once per run (the trainer)
    loss, metrics = step(runner, corrupted)                                 # per batch
    decoder = family.role("serving", path).decoder(model, tokenizer)       # hf-bdlm serve

A new family is a folder with a subclass of `ModelFamily` and its role classes, plus one line in the registry
(``docs/design.md``, "Adding a model family").
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

ROLE_KINDS = ("training", "serving", "drafting", "evaluation", "planning", "policy")


class RoleUnavailable(ValueError):
    """A family was asked for a role it does not play (its message names the family, the role and what to do)."""


class ModelFamily:
    """One model family's entry (see the module docstring). Subclasses set the class attributes and override what
    differs.

    Attributes:
        name (`str`): the registry name.
        converts_causal_lms (`bool`): any causal LM checkpoint can be turned into this family (the family of last
            resort when loading).
        roles (`dict[str, type]`): the roles the family plays, kind -> role class (built with the family).
        refusals (`dict[str, str]`): for a role the family lacks, what to do instead (``{subject}`` is replaced by
            what was asked about, e.g. the checkpoint folder).
    """

    name: ClassVar[str] = ""
    converts_causal_lms: ClassVar[bool] = False
    roles: ClassVar[dict[str, type]] = {}
    refusals: ClassVar[dict[str, str]] = {}

    def role(self, kind: str, subject: Any = None):
        """The family's role ``kind`` (one of :data:`ROLE_KINDS`), built once; :class:`RoleUnavailable` naming what
        to do instead when the family lacks it (``subject``, e.g. a checkpoint folder, goes into that message)."""
        if kind not in ROLE_KINDS:
            raise ValueError(f"unknown role {kind!r}; the roles are {ROLE_KINDS}.")
        built = self.__dict__.setdefault("_built_roles", {})
        if kind not in built:
            cls = self.roles.get(kind)
            if cls is None:
                hint = self.refusals.get(kind, "")
                what = f"{subject} holds a {self.name!r} checkpoint" if subject is not None else \
                    f"the {self.name!r} family"
                raise RoleUnavailable(f"{what}: this family has no {kind} role."
                                      + (" " + hint.format(subject=subject) if hint else ""))
            built[kind] = cls(self)
        return built[kind]

    def has_role(self, kind: str) -> bool:
        return kind in self.roles

    def claims_model(self, model) -> bool:
        """Whether ``model`` (inside any training wrapper) is one of this family's models."""
        raise NotImplementedError

    def block_size(self, model) -> int:
        """Tokens per block (a canvas, a draft block) of one of this family's models."""
        raise NotImplementedError

    def new_config(self, **fields):
        """A configuration of this family's models from its fields (the keyword arguments of its config class)."""
        raise NotImplementedError(f"the {self.name!r} family builds no configuration from fields.")

    def new_model(self, config):
        """A freshly initialised model of this family from one of its configurations (the model a benchmark
        measures)."""
        raise NotImplementedError(f"the {self.name!r} family builds no model from a configuration.")

    def render_card(self, directory: os.PathLike, config: dict, info: dict | None) -> str:
        """The model card (``README.md``) of a saved folder whose parsed ``config.json`` is ``config``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<model family {self.name!r}>"


__all__ = ["ROLE_KINDS", "ModelFamily", "RoleUnavailable"]
