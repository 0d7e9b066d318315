"""The roles a model family plays, each a small contract a host reads (:meth:`ModelFamily.role`).

- `TrainingSpec` (the trainer): checks the run's arguments, loads or adopts the model, and builds the run's
  `LossStep` once — the objective and how one batch's loss is computed on this rank;
- `ServingSpec` (``hf-bdlm serve``, the decoding benchmark): loads a checkpoint and hands out its `ServingDecoder`;
- `DraftingSpec` (``hf-bdlm serve TARGET --draft DIR``): a drafter decoding a causal target;
- `EvaluationSpec` (lm-eval's ``--model bdlm``): what lm-eval loads and how it scores a likelihood;
- `PlanningSpec` (``hf-bdlm plan``): what the planner's cost model adds for this family, its presets and the paper's
  settings;
- `PolicySpec` (the GRPO trainer, :mod:`hf_bdlm.rl`): the family's model as a policy, its rollouts and its
  per-token log-probability estimators.

A role is built with its family (``role.family``) and holds no state of a run. Each default here either is the
common behaviour or raises, naming what the family must implement.
"""

from __future__ import annotations

from typing import Any, ClassVar

from .decoding import DecodingVariant
from .policy import Policy
from .registry import entry_named


class Role:
    """The base of every role: built once per family (``role.family``)."""

    def __init__(self, family):
        self.family = family


# --- training --------------------------------------------------------------------------------------------------------
class LossStep:
    """One run's loss on this rank, built once by :meth:`TrainingSpec.step` (the objective built from the run's
    arguments, the model's settings applied); the trainer calls it per batch with explicit arguments.

    ``runner`` is what the step runs through: the model (or its DDP wrapper) for a family whose objective calls the
    model's forward, a :class:`~hf_bdlm.protocols.step.TrainingStep` for one whose objective drives the model's parts
    itself (``TrainingSpec.owns_step``).

    Attributes:
        objective: the run's objective (``corrupt`` a batch, its normalizers, its state in checkpoints).
    """

    objective: Any

    def __call__(self, runner, corrupted, optional_pass: bool | None = None):
        """``(loss, metrics)`` of this rank's rows of one corrupted batch (``optional_pass``: whether the objective's
        optional pass runs, when every rank must agree; ``None``: the batch decides)."""
        raise NotImplementedError

    def zero(self, runner, inputs, optional_pass: bool | None = None):
        """A zero that reaches every trained parameter (a rank whose share supervises nothing still joins DDP's
        reduction)."""
        raise NotImplementedError


class TrainingSpec(Role):
    """What the trainer needs of a family.

    Attributes:
        objectives (`tuple[str, ...]`): the objectives it trains (``BDLMSFTConfig.objective``): its registry line's.
        config_fields (`tuple[str, ...]`): ``BDLMSFTConfig`` fields only this family's objectives read (refused with
            another objective).
        owns_step (`bool`): the objective runs the model's parts itself (not its forward): the trainer then prepares a
            TrainingStep around the model for DDP / autocast / FSDP2 to see the step.
    """

    config_fields: ClassVar[tuple[str, ...]] = ()
    owns_step: ClassVar[bool] = False

    @property
    def objectives(self) -> tuple[str, ...]:
        return entry_named(self.family.name).objectives

    def check_args(self, args) -> None:
        """Raise for training arguments this family cannot honour (before anything is loaded)."""

    def load(self, path: str, config, args, processing_class, init_kwargs: dict[str, Any]):
        """Load the checkpoint at ``path`` (its ``config`` read already); returns ``(model, processing_class)``."""
        raise NotImplementedError

    def adopt(self, model, processing_class, args):
        """A model object the user passed; returns ``(model, processing_class)`` (converted where needed)."""
        return model, processing_class

    def objective_class(self, name: str):
        """The class of objective ``name`` (one of :attr:`objectives`)."""
        raise NotImplementedError

    def default_lora_targets(self, model):
        """LoRA ``target_modules`` when the user names none, or ``None`` (PEFT must be told)."""
        return None

    def shard_fsdp(self, model, fully_shard_kwargs: dict, fsdp_plugin):
        """FSDP2 units of a family whose weights need their own grouping: ``(root step, unit names)``, or ``None``
        for the ordinary per-layer units (``hf_bdlm.trainer.fsdp.shard_model``)."""
        return None

    def step(self, model, args, tokenizer, plugin) -> LossStep:
        """The run's :class:`LossStep`, built once: the objective from ``args``, what the run changes in the model
        (its config's diffusion fields, frozen parameters, the attention routing) applied, and the block-parallel
        ``plugin`` whose layout shards each batch."""
        raise NotImplementedError


# --- serving, drafting, evaluation -----------------------------------------------------------------------------------
class ServingSpec(Role):
    """What ``hf-bdlm serve`` and the decoding benchmark need of a family that generates on its own."""

    def load(self, path: str, config, init_kwargs: dict[str, Any], block_size: int):
        """``(model, tokenizer)`` served from ``path`` (``block_size``: the conversion's, for a causal LM)."""
        raise NotImplementedError

    def decoder(self, model, tokenizer):
        """How ``model`` (one of this family's, unwrapped) is decoded: a
        :class:`~hf_bdlm.protocols.decoding.ServingDecoder`."""
        raise NotImplementedError

    def decoding_variants(self, decoder) -> dict:
        """The named ways of decoding ``decoder``'s model that ``hf-bdlm bench --only decoding`` measures side by
        side (each a :class:`~hf_bdlm.protocols.decoding.DecodingVariant` over the same model), in the order of its
        table. Default: the decoder as it is, its own reference."""
        return {"default": DecodingVariant(decoder, reference=True)}


class DraftingSpec(Role):
    """What ``hf-bdlm serve TARGET --draft DIR`` needs of a family of drafters."""

    def load_pair(self, target_path: str, draft_path: str, init_kwargs: dict[str, Any], device: str | None = None,
                  num_speculative_tokens: int | None = None):
        """The causal LM at ``target_path`` decoded with the drafter at ``draft_path``, both on ``device``, verifying
        ``num_speculative_tokens`` proposals per step (`None`: the drafter's default); ``(target, tokenizer,
        decoder)``."""
        raise NotImplementedError

    def decoding_variants(self, decoder) -> dict:
        """As :meth:`ServingSpec.decoding_variants`, for the speculative decoder ``load_pair`` returned."""
        return {"default": DecodingVariant(decoder, reference=True)}


class EvaluationSpec(Role):
    """What lm-eval's ``--model bdlm`` needs of a family: the model it scores and its likelihood bound."""

    def load(self, path: str, config, init_kwargs: dict[str, Any], block_size: int):
        """``(model, tokenizer)`` scored by lm-eval: by default what the family's serving role loads."""
        return self.family.role("serving", path).load(path, config, init_kwargs, block_size)

    def likelihood_scorer(self, model, tokenizer):
        """How lm-eval's ``loglikelihood`` scores ``model``: a :class:`~hf_bdlm.protocols.likelihood.LikelihoodScorer`
        (a Monte-Carlo estimate of the family's likelihood bound)."""
        raise NotImplementedError(f"{self.family.name!r} models define no likelihood to score; evaluate them on "
                                  "generation tasks (generate_until) instead.")


# --- the planner -----------------------------------------------------------------------------------------------------
class PlanningSpec(Role):
    """What ``hf-bdlm plan`` reads of a family beyond a decoder config."""

    def cost_traits(self, text_config: dict) -> dict:
        """What the planner's cost model (``hf_bdlm.planner.model``) adds to a decoder config (``text_config``: the
        parsed config of the language model) for this family's models: ``k_eq_v`` (global layers share K and V when
        the config does not say), the default ``clean_attention`` and ``window_convention``, ``head_on_clean``
        (the LM head also scores the clean rows) and ``extra_params`` (parameters outside the layers and
        embeddings)."""
        return {"k_eq_v": False, "clean_attention": "block_causal", "window_convention": "per_query",
                "head_on_clean": False, "extra_params": 0}

    def presets(self) -> dict[str, dict]:
        """Named configs (``config.json`` dicts) of this family's models that ``hf-bdlm plan --model`` accepts."""
        return {}

    def paper_settings(self) -> tuple[tuple[str, str, int, str, str], ...]:
        """The paper's settings of this family that ``hf-bdlm plan --paper`` prices on its 16-GPU topology: ``(setting,
        preset, L, published figure, model parallelism inside a GPU pair ("tp" or "ep"))``."""
        return ()

    def paper_projection(self, efficiency: dict[str, float]) -> str | None:
        """A section of ``hf-bdlm plan --paper`` this family prices itself (``efficiency``: the achievable fractions
        of the datasheet figures the user set), or ``None``."""
        return None


# --- reinforcement learning ------------------------------------------------------------------------------------------
class PolicySpec(Role):
    """What the GRPO trainer (:class:`hf_bdlm.rl.trainer.BDLMGRPOTrainer`) needs of a family: the run's
    :class:`~hf_bdlm.protocols.policy.Policy` (rollouts by the family's serving decoder, log-probabilities by a named
    estimator).

    Attributes:
        estimators (`tuple[str, ...]`): the log-probability estimators the family implements
            (:data:`hf_bdlm.protocols.policy.LOGP_ESTIMATORS`).
    """

    estimators: ClassVar[tuple[str, ...]] = ()

    def load(self, path: str, config, init_kwargs: dict[str, Any]):
        """``(model, tokenizer)`` trained from ``path`` (its ``config`` read already): by default what the family's
        serving role loads."""
        return self.family.role("serving", path).load(path, config, init_kwargs, None)

    def check_args(self, args) -> None:
        """Raise for GRPO arguments this family cannot honour (an estimator it lacks, a sampling setting its decoder
        does not apply), before the trainer is built."""

    def policy(self, model, tokenizer, args) -> Policy:
        """The run's :class:`~hf_bdlm.protocols.policy.Policy`, built once from ``args`` (a
        :class:`~hf_bdlm.rl.config.BDLMGRPOConfig`)."""
        raise NotImplementedError


__all__ = ["DraftingSpec", "EvaluationSpec", "LossStep", "PlanningSpec", "PolicySpec", "Role", "ServingSpec",
           "TrainingSpec"]
