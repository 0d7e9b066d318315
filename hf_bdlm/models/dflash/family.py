"""The DFlash family: speculative drafters (`DFlashDraftModel`, `DFlash2DraftModel`) trained on a frozen target.

A drafter folder says ``model_type: "qwen3"`` (the serving engines' contract) and ``architectures:
["DFlash2DraftModel"]``: the registry finds this family by the architecture. Its roles are training, drafting
(``hf-bdlm serve TARGET --draft DIR``) and planning (the paper's drafter setting); it has no serving or evaluation role
of its own (a drafter does not generate alone: the refusals say what to do). Its training role
(:class:`~hf_bdlm.models.dflash.training.trainer.DFlashTrainer`, `BDLMSFTTrainer` with the capture's data and collator):

- loading: the drafter (object or folder) bound to its target's frozen input embedding and LM head, read alone from
  the target's weights files (:func:`load_target_heads`: the whole target is never loaded to train from features);
- the `dflash` objective (:class:`~hf_bdlm.models.dflash.training.objectives.DFlashTrainingObjective`) from the run's fields;
- the step: the drafter's forward over this rank's context rows and anchors, and the loss of its share of the batch
  (the objective drives the drafter's parts, so the step runs as a :class:`~hf_bdlm.protocols.step.TrainingStep`);
The entry renders the model card (the exported drafter's, :mod:`.inference.export`).

    from transformers import AutoConfig
    from hf_bdlm.models import family_for_config
    from hf_bdlm.models.dflash.target import load_target_heads
    from hf_bdlm.models.dflash.modeling import DFlash2DraftModel
    family_for_config(AutoConfig.from_pretrained("runs/drafter")).name        # 'dflash'
    heads = load_target_heads("embedded:smollm2")                              # embedding + head only
    drafter = DFlash2DraftModel.from_pretrained("runs/drafter").bind_target(heads)
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ...checkpoints.files import load_pretrained
from ...planner.hardware import device_spec
from ...protocols.decoding import DecodingVariant
from ...protocols.entry import ModelFamily
from ...protocols.roles import DraftingSpec, LossStep, PlanningSpec, TrainingSpec
from ...protocols.step import run_step, unwrap_model
from .inference.export import PROVENANCE, render_card
from .inference.serving import load_speculative
from .modeling import DFlashDraftModel
from .studies.projection import (format_projection, format_reference_readings, project_drafter_training,
                                 reference_readings)
from .target import TargetHeads, drafter_class, load_target_heads, resolve_target_path
from .training.config import OBJECTIVE_FIELDS
from .training.objectives import DFlashObjectiveConfig, DFlashTrainingObjective
from .training.trainer import draft_layout

logger = logging.getLogger(__name__)

# BDLMSFTConfig fields of the block-diffusion objectives, meaningless for a drafter (refused when set).
_DIFFUSION_FIELDS = ("loss_weighting", "noise_eps_min", "noise_eps_max", "attention_backend", "certainty_weight")


class DFlashTraining(TrainingSpec):
    """Trains a drafter on its frozen target's captured features (:class:`~.training.trainer.DFlashTrainer`), the
    step driving the drafter's parts itself; DDP and block parallelism (not FSDP2, DeepSpeed, tensor parallelism or
    packing)."""

    owns_step = True

    def load(self, path, config, args, processing_class, init_kwargs):
        """The drafter saved at ``path``, bound to the heads of ``args.target_model``."""
        kwargs = {k: v for k, v in init_kwargs.items() if k in ("dtype", "revision")}
        drafter = load_pretrained(drafter_class(config).from_pretrained, path, **kwargs)
        return self.adopt(drafter, processing_class, args)

    def adopt(self, model, processing_class, args):
        """A drafter object: bound to ``args.target_model``'s heads unless a target is bound already."""
        drafter = unwrap_model(model)
        if drafter.embed_tokens is None:
            target = getattr(args, "target_model", None)
            if not target:
                raise ValueError(
                    "the DFlash drafter has no target bound and the config names none: pass a drafter bound to its "
                    "target (DFlash2DraftModel.from_target(target) or drafter.bind_target(target)), or set "
                    "target_model (DFlashTrainingConfig) to the target's folder or Hub id."
                )
            heads = load_target_heads(target, revision=getattr(args, "target_revision", None),
                                      dtype=drafter.fc.weight.dtype)
            drafter.bind_target(heads)
        return model, processing_class

    def objective_class(self, name: str):
        return DFlashTrainingObjective

    def check_args(self, args) -> None:
        """The objective's options (built once into a `DFlashObjectiveConfig`, which names a bad value), and the
        distribution a drafter trains with (DDP and block parallelism; not FSDP2, DeepSpeed, tensor parallelism or
        packing)."""
        if args.objective not in self.objectives:
            return
        given = [name for name in _DIFFUSION_FIELDS if getattr(args, name, None) is not None]
        if given:
            raise ValueError(f"{given} are block-diffusion settings and do not apply to objective='dflash' (a drafter "
                             "is trained on draft blocks after anchors); leave them unset.")
        options = {option: getattr(args, name) for option, name in OBJECTIVE_FIELDS.items() if hasattr(args, name)}
        try:
            DFlashObjectiveConfig(mask_token_id=0, block_size=args.block_size or 8, seed=int(args.seed), **options)
        except ValueError as err:
            raise ValueError(f"{err} (DFlashTrainingConfig.{_field_of(str(err))})") from None
        if args.packing or args.eval_packing:
            raise ValueError("packing=True is not supported for DFlash drafters: each captured record is one sequence "
                             "(its features were computed alone); set packing=False.")
        deepspeed = bool(args.deepspeed) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in ("1", "true")
        fsdp = bool(args.fsdp) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true")
        if deepspeed or fsdp:
            raise NotImplementedError(
                "objective='dflash' trains with DDP (any world size, with block parallelism), not with FSDP or "
                "DeepSpeed: a drafter is a few layers, its frozen embedding and head are the target's and live outside "
                "its parameters. Launch without the FSDP / DeepSpeed setting."
            )

    def step(self, model, args, tokenizer, plugin):
        """The `dflash` objective for the drafter: its block size and mask id, the run's options and seed. The
        candidate selector is frozen unless the D-PACE loss trains it (an untouched parameter would stall DDP)."""
        drafter = unwrap_model(model)
        block = drafter.config.block_size
        if args.block_size is not None and args.block_size != block:
            raise ValueError(f"block_size={args.block_size} differs from the drafter's block size {block} (its "
                             "config.json's dflash_config.block_size); leave block_size unset.")
        options = {option: getattr(args, name) for option, name in OBJECTIVE_FIELDS.items() if hasattr(args, name)}
        config = DFlashObjectiveConfig(mask_token_id=drafter.config.mask_token_id, block_size=block,
                                       seed=int(args.seed), **options)
        selector = getattr(drafter, "candidate_selector", None)
        if selector is not None and config.loss != "dpace":
            selector.requires_grad_(False)
        dims = getattr(args, "parallel_dims", None)
        if dims is not None and dims.is_tensor_parallel:
            raise NotImplementedError("objective='dflash' does not support tensor parallelism (parallelism_config."
                                      "tp_size > 1): shard the context with block parallelism instead.")
        objective = DFlashTrainingObjective(config, token_accuracy=getattr(args, "draft_token_accuracy", True))
        return DFlashLossStep(model, objective, plugin)


class DFlashLossStep(LossStep):
    """Which context rows and anchors this rank runs for one batch (:func:`.training.trainer.draft_layout`), and the
    drafter's loss on them through the step."""

    def __init__(self, model, objective, plugin):
        self.model, self.objective, self.plugin = model, objective, plugin

    def __call__(self, runner, corrupted, optional_pass=None):
        return run_step(runner, self.objective.loss, corrupted, draft_layout(self.plugin, self.model, corrupted))

    def zero(self, runner, inputs, optional_pass=None):
        return run_step(runner, self.objective.zero_loss)


class DFlashDrafting(DraftingSpec):
    """A causal target decoded greedily, sped up by the drafter (``hf-bdlm serve TARGET --draft DIR``)."""

    def load_pair(self, target_path, draft_path, init_kwargs, device=None, num_speculative_tokens=None):
        return load_speculative(target_path, draft_path, init_kwargs, device, num_speculative_tokens)

    def decoding_variants(self, decoder):
        """Greedy speculative decoding verifying the drafter's whole block (``B - 1`` proposals) and 3 of them; the
        output is the target's own greedy text either way (its agreement is measured against the target's)."""
        block = int(decoder.drafter.config.block_size)
        counts = [block - 1] + [n for n in (3,) if n < block - 1]
        return {f"{n} proposals": DecodingVariant(decoder.with_proposals(n), description=f"block {block}, the target "
                                                  f"verifies {n} proposals per forward") for n in counts}


class DFlashPlanning(PlanningSpec):
    """The paper's drafter setting, priced by :mod:`.studies.projection`."""

    def paper_projection(self, efficiency):
        """Drafter training on 8 H100 at 512K and 1M beside the published 2.48x / 7.59x (:mod:`.projection`), then the
        reference recipe's constants switched in one after another."""
        device = device_spec("h100", None, efficiency)
        rows = project_drafter_training(device=device)
        return (format_projection(rows) + "\n\n"
                + format_reference_readings(reference_readings(rows, device=device), rows))




class DFlashFamily(ModelFamily):
    name = "dflash"
    roles = {"training": DFlashTraining, "drafting": DFlashDrafting, "planning": DFlashPlanning}
    refusals = {
        "serving": "A DFlash drafter drafts for a target model and does not generate on its own: serve the target "
                   "with it, `hf-bdlm serve TARGET --draft {subject}`.",
        "evaluation": "A DFlash drafter proposes tokens for a target model and is no language model of its own, so "
                      "lm-eval has nothing to score. Evaluate the target instead (its speculative decoding gives "
                      "exactly the target's greedy output): lm-eval --model hf --model_args pretrained=TARGET, or "
                      "serve the pair with `hf-bdlm serve TARGET --draft {subject}` and run lm-eval's "
                      "local-completions against it.",
        "policy": "A DFlash drafter proposes tokens for a target model and samples no completions of its own, so "
                  "there is no policy to train with GRPO. Train the target instead (a causal LM: TRL's "
                  "GRPOTrainer), then distil a drafter for it again.",
    }

    def claims_model(self, model) -> bool:
        return isinstance(unwrap_model(model), DFlashDraftModel)

    def block_size(self, model) -> int:
        return int(unwrap_model(model).config.block_size)

    def render_card(self, directory: os.PathLike, config: dict, info: dict | None) -> str:
        """The drafter's card (:func:`.export.render_card`): the folder needs its ``training_export.json`` (written by
        the trainer on save, or by ``export_drafter``)."""
        if not (Path(directory) / PROVENANCE).is_file():
            raise FileNotFoundError(f"{directory} has no {PROVENANCE}: save the drafter with DFlashTrainer or export "
                                    "it with export_drafter (`hf-bdlm dflash export`), which write it with the card.")
        info = info or {}
        return render_card(directory, model_name=info.get("model_name"), model_ref=info.get("repo_id"),
                           description=info.get("description"), license=info.get("license") or "unknown")


def _field_of(message: str) -> str:
    """The config field a `DFlashObjectiveConfig` message is about (its first word after the colon)."""
    word = message.split(":", 1)[-1].split()[0] if ":" in message else ""
    return OBJECTIVE_FIELDS.get(word, word) or "?"


__all__ = ["DFlashFamily", "TargetHeads", "drafter_class", "load_target_heads", "resolve_target_path"]
