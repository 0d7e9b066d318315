"""The DFlash family: speculative drafters (`DFlashDraftModel`, `DFlash2DraftModel`) trained on a frozen target.

A drafter folder says ``model_type: "qwen3"`` (the serving engines' contract) and ``architectures:
["DFlash2DraftModel"]``: the registry finds this family by the architecture. What the family brings to the trainer
(:class:`~hf_bdlm.models.dflash.trainer.DFlashTrainer`, `BDLMSFTTrainer` with the capture's data and collator):

- loading: the drafter (object or folder) bound to its target's frozen input embedding and LM head, read alone from
  the target's weights files (:func:`load_target_heads`: the whole target is never loaded to train from features);
- the `dflash` objective (:class:`~hf_bdlm.models.dflash.trainer.DFlashTrainingObjective`) from the run's fields;
- the step: the drafter's forward over this rank's context rows and anchors, and the loss of its share of the batch
  (the objective drives the drafter's parts, so the step runs as a :class:`~hf_bdlm.models.step.TrainingStep`);
- the model card (the exported drafter's, :mod:`.export`), and ``hf-bdlm serve TARGET --draft DIR``.

    from transformers import AutoConfig
    from hf_bdlm.models import family_for_config
    from hf_bdlm.models.dflash.family import load_target_heads
    from hf_bdlm.models.dflash.modeling import DFlash2DraftModel
    family_for_config(AutoConfig.from_pretrained("runs/drafter")).name        # 'dflash'
    heads = load_target_heads("embedded:smollm2")                              # embedding + head only
    drafter = DFlash2DraftModel.from_pretrained("runs/drafter").bind_target(heads)
"""

from __future__ import annotations

import json
import logging
import os
from typing import ClassVar

import torch
from torch import nn

from ..family import ModelFamily
from ..step import run_step

logger = logging.getLogger(__name__)

# BDLMSFTConfig fields of the block-diffusion objectives, meaningless for a drafter (refused when set).
_DIFFUSION_FIELDS = ("loss_weighting", "noise_eps_min", "noise_eps_max", "attention_backend")


class TargetHeads(nn.Module):
    """The parts of a target causal LM a drafter uses in training: its input embedding and LM head (frozen), and its
    final norm (for a KL objective's teacher). Binds to a drafter like the target itself
    (``drafter.bind_target(heads)``).

    Attributes:
        embed_tokens (`nn.Embedding`), lm_head (`nn.Linear`), norm (`nn.Module` or `None`).
        config (`PretrainedConfig`): the target's config (its text config for a multimodal target).
        source (`str`): where the weights were read.
    """

    def __init__(self, embed_tokens: nn.Embedding, lm_head: nn.Linear, norm: nn.Module | None, config,
                 source: str = ""):
        super().__init__()
        self.embed_tokens, self.lm_head, self.norm = embed_tokens, lm_head, norm
        self.config, self.source = config, source
        self.requires_grad_(False)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def teacher_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The target's logits of its last decoder layer's output before the final norm (a capture's teacher
        state)."""
        if self.norm is None:
            raise ValueError("these target heads were read without the final norm; load them with with_norm=True "
                             "(the KL objective's teacher needs it).")
        return self.lm_head(self.norm(hidden_states.to(self.lm_head.weight.dtype)))


def resolve_target_path(name: str) -> str:
    """``embedded:smollm2`` -> the exported SmolLM2 folder; a folder or a Hub id as it is."""
    from ...train import resolve_model_path

    return resolve_model_path(name)


def load_target_heads(name_or_path: str, *, revision: str | None = None, dtype: torch.dtype | None = None,
                      with_norm: bool = False) -> TargetHeads:
    """Read a target's input embedding and LM head (and, ``with_norm``, its final norm) from its weights files alone.

    The target is built on the meta device to learn the names of those modules; only their tensors are read from
    the (possibly sharded) safetensors files. A tied head is the embedding. A checkpoint whose tensor names differ
    from its modules' (an older layout transformers renames on load) is loaded whole instead, with a warning.

    Args:
        name_or_path (`str`): a folder, a Hub id or ``embedded:smollm2``.
        revision (`str`, *optional*): the Hub revision.
        dtype (`torch.dtype`, *optional*): the dtype to hold them in (default: as stored).
        with_norm (`bool`, defaults to `False`): also read the final norm (the KL objective's teacher).

    Returns:
        [`TargetHeads`].
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from .capture import _decoder_of

    path = resolve_target_path(name_or_path)
    config = AutoConfig.from_pretrained(path, revision=revision)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    names = {id(module): name for name, module in skeleton.named_modules()}
    embed, head = skeleton.get_input_embeddings(), skeleton.get_output_embeddings()
    norm = getattr(_decoder_of(skeleton)[0], "norm", None) if with_norm else None
    if with_norm and not isinstance(norm, nn.Module):
        raise ValueError(f"{name_or_path}: the target has no final norm (`get_decoder().norm`) to read.")
    wanted = {"embed": names[id(embed)], "head": names[id(head)]}
    if norm is not None:
        wanted["norm"] = names[id(norm)]
    tensors = _read_tensors(path, revision, [f"{prefix}.{p}" for prefix in wanted.values()
                                             for p in ("weight", "bias")])
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    embed_weight = tensors.get(f"{wanted['embed']}.weight")
    head_weight = tensors.get(f"{wanted['head']}.weight")
    if head_weight is None and getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)):
        head_weight = embed_weight
    if embed_weight is None or head_weight is None or (norm is not None and f"{wanted['norm']}.weight" not in tensors):
        logger.warning("%s: the embedding / head tensors are not stored under their module names; loading the whole "
                       "target to read them.", name_or_path)
        full = AutoModelForCausalLM.from_pretrained(path, revision=revision, dtype=dtype)
        norm_module = getattr(_decoder_of(full)[0], "norm", None) if with_norm else None
        return TargetHeads(full.get_input_embeddings(), full.get_output_embeddings(), norm_module, text, path)
    dtype = dtype or embed_weight.dtype
    embedding = nn.Embedding(*embed_weight.shape, dtype=dtype)
    embedding.weight.data.copy_(embed_weight)
    head_bias = tensors.get(f"{wanted['head']}.bias")
    lm_head = nn.Linear(head_weight.shape[1], head_weight.shape[0], bias=head_bias is not None, dtype=dtype)
    lm_head.weight.data.copy_(head_weight)
    if head_bias is not None:
        lm_head.bias.data.copy_(head_bias)
    if norm is not None:
        norm = norm.to_empty(device="cpu").to(dtype)
        norm.load_state_dict({k.split(".")[-1]: v for k, v in tensors.items() if k.startswith(wanted["norm"] + ".")})
    return TargetHeads(embedding, lm_head, norm, text, path)


def _read_tensors(path: str, revision: str | None, keys: list[str]) -> dict[str, torch.Tensor]:
    """The tensors named ``keys`` that the checkpoint holds, read from its safetensors file(s) alone."""
    from safetensors import safe_open
    from transformers.utils import cached_file

    def fetch(filename: str) -> str | None:
        return cached_file(path, filename, revision=revision, _raise_exceptions_for_missing_entries=False)

    index = fetch("model.safetensors.index.json")
    if index is not None:
        weight_map = json.loads(open(index, encoding="utf-8").read())["weight_map"]
        files: dict[str, list[str]] = {}
        for key in keys:
            if key in weight_map:
                files.setdefault(weight_map[key], []).append(key)
    else:
        files = {"model.safetensors": keys}
    found = {}
    for filename, names in files.items():
        local = fetch(filename)
        if local is None:
            raise FileNotFoundError(f"{path} holds no {filename}: the target's weights must be safetensors files.")
        with safe_open(local, framework="pt") as f:
            present = set(f.keys())
            found.update({name: f.get_tensor(name) for name in names if name in present})
    return found


def unwrap_drafter(model):
    """The drafter inside DDP / `TrainingStep` wrappers (or ``model`` itself)."""
    inner = model
    while isinstance(getattr(inner, "module", None), nn.Module):
        inner = inner.module
    return inner


def drafter_class(config):
    """`DFlash2DraftModel` or `DFlashDraftModel`, as a drafter config (or its ``architectures``) names."""
    from . import modeling

    architectures = list(getattr(config, "architectures", None) or [])
    name = architectures[0] if architectures else ("DFlash2DraftModel" if getattr(config, "is_dflash2", False)
                                                   else "DFlashDraftModel")
    if name not in ("DFlashDraftModel", "DFlash2DraftModel"):
        raise ValueError(f"config.architectures names {name!r}; a DFlash drafter is a 'DFlash2DraftModel' or a "
                         "'DFlashDraftModel'.")
    return getattr(modeling, name)


class DFlashFamily(ModelFamily):
    name = "dflash"
    model_types = ()
    objectives = ("dflash",)
    owns_step = True
    config_fields: ClassVar[tuple[str, ...]] = ()

    # --- recognising and loading -------------------------------------------------------------------------------
    def claims_model(self, model) -> bool:
        from .modeling import DFlashDraftModel

        return isinstance(unwrap_drafter(model), DFlashDraftModel)

    def load(self, path, config, args, processing_class, init_kwargs):
        """The drafter saved at ``path``, bound to the heads of ``args.target_model``."""
        kwargs = {k: v for k, v in init_kwargs.items() if k in ("dtype", "revision")}
        drafter = drafter_class(config).from_pretrained(path, **kwargs)
        return self.adopt(drafter, processing_class, args)

    def adopt(self, model, processing_class, args):
        """A drafter object: bound to ``args.target_model``'s heads unless a target is bound already."""
        drafter = unwrap_drafter(model)
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

    def load_for_serving(self, path, config, init_kwargs, block_size):
        raise ValueError(f"{path} is a DFlash drafter, which drafts for a target model and does not generate on its "
                         f"own: serve the target with it, `hf-bdlm serve TARGET --draft {path}`.")

    def load_speculative_for_serving(self, target_path, draft_path, init_kwargs, device=None):
        from .serving import load_speculative

        return load_speculative(target_path, draft_path, init_kwargs, device)

    def objective_class(self, name: str):
        from .trainer import DFlashTrainingObjective

        return DFlashTrainingObjective

    def check_args(self, args) -> None:
        """The objective's options (built once into a `DFlashObjectiveConfig`, which names a bad value), and the
        distribution a drafter trains with (DDP and block parallelism; not FSDP2, DeepSpeed, tensor parallelism or
        packing)."""
        from .objective import DFlashObjectiveConfig
        from .trainer_config import OBJECTIVE_FIELDS

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

    # --- training ---------------------------------------------------------------------------------------------
    def block_size(self, model) -> int:
        return int(unwrap_drafter(model).config.block_size)

    def configure(self, model, args, tokenizer):
        """The `dflash` objective for the drafter: its block size and mask id, the run's options and seed. The
        candidate selector is frozen unless the D-PACE loss trains it (an untouched parameter would stall DDP)."""
        from .objective import DFlashObjectiveConfig
        from .trainer import DFlashTrainingObjective
        from .trainer_config import OBJECTIVE_FIELDS

        drafter = unwrap_drafter(model)
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
        return DFlashTrainingObjective(config, token_accuracy=getattr(args, "draft_token_accuracy", True))

    def layout(self, plugin, model, objective, corrupted):
        """Which context rows and anchors this rank runs for one batch (:func:`draft_layout`)."""
        from .trainer import draft_layout

        return draft_layout(plugin, model, corrupted)

    def loss(self, runner, model, objective, corrupted, layout, optional_pass=None):
        return run_step(runner, objective.loss, corrupted, layout)

    def zero_loss(self, runner, model, objective, inputs, optional_pass=None):
        return run_step(runner, objective.zero_loss)

    # --- the hub ----------------------------------------------------------------------------------------------
    def render_card(self, directory: os.PathLike, config: dict, info: dict | None) -> str:
        """The drafter's card (:func:`.export.render_card`): the folder needs its ``training_export.json`` (written by
        the trainer on save, or by ``export_drafter``)."""
        from pathlib import Path

        from .export import PROVENANCE, render_card

        if not (Path(directory) / PROVENANCE).is_file():
            raise FileNotFoundError(f"{directory} has no {PROVENANCE}: save the drafter with DFlashTrainer or export "
                                    "it with export_drafter (`hf-bdlm dflash export`), which write it with the card.")
        info = info or {}
        return render_card(directory, model_name=info.get("model_name"), model_ref=info.get("repo_id"),
                           description=info.get("description"), license=info.get("license") or "unknown")


def _field_of(message: str) -> str:
    """The config field a `DFlashObjectiveConfig` message is about (its first word after the colon)."""
    from .trainer_config import OBJECTIVE_FIELDS

    word = message.split(":", 1)[-1].split()[0] if ":" in message else ""
    return OBJECTIVE_FIELDS.get(word, word) or "?"


__all__ = ["DFlashFamily", "TargetHeads", "drafter_class", "load_target_heads", "resolve_target_path",
           "unwrap_drafter"]
