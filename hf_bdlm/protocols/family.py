"""`ModelFamily`: what the rest of hf_bdlm needs from a model family, and nothing more.

A family is one kind of model the project trains (the registry, :mod:`hf_bdlm.protocols.registry`, lists them by
name). Everything specific to a family lives in its folder under ``hf_bdlm/models/``
(its batch layout, objectives, sharded attention layout, FSDP units, model card); the trainer, the plugin, the
planner, the server and the hub talk to it through this interface, found in the registry
(:mod:`hf_bdlm.models`), and never name a family. A new family is a new folder with a subclass of
`ModelFamily`, plus one line in the registry (``docs/design.md``, "Adding a model family").

The trainer's step with a family ``f`` (``model``: the family's model inside wrappers such as PEFT)::

    objective = f.configure(model, args, tokenizer)          # once: settings written, frozen parts frozen
    layout = f.layout(plugin, model, objective, corrupted)   # per batch: the rows this rank runs
    loss, metrics = f.loss(runner, model, objective, corrupted, layout)

``runner`` is what the step runs through: the model (or its DDP wrapper) for a family whose objective calls the
model's forward, a :class:`~hf_bdlm.protocols.step.TrainingStep` for one whose objective drives the model's parts
itself (``owns_step``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence


class ModelFamily:
    """One model family (see the module docstring). Subclasses set the class attributes and override what differs."""

    name: ClassVar[str] = ""
    # ``config.model_type`` values whose checkpoints belong to this family.
    model_types: ClassVar[tuple[str, ...]] = ()
    # Objectives this family trains (``BDLMSFTConfig.objective``); ``None`` in the config means the model's own.
    objectives: ClassVar[tuple[str, ...]] = ()
    # Whether the objective runs the model's parts itself (not its forward): the trainer then prepares a
    # TrainingStep around the model for DDP / autocast / FSDP2 to see the step.
    owns_step: ClassVar[bool] = False
    # BDLMSFTConfig fields only this family's objectives read (rejected with another objective).
    config_fields: ClassVar[tuple[str, ...]] = ()
    # Whether any causal LM checkpoint can be turned into this family (the family of last resort when loading).
    converts_causal_lms: ClassVar[bool] = False

    # --- recognising and loading -------------------------------------------------------------------------------
    def claims_model(self, model) -> bool:
        """Whether ``model`` (already unwrapped from PEFT / DDP) is one of this family's models."""
        raise NotImplementedError

    def load(self, path: str, config, args, processing_class, init_kwargs: dict[str, Any]):
        """Load the checkpoint at ``path`` (its ``config`` read already); returns ``(model, processing_class)``."""
        raise NotImplementedError

    def adopt(self, model, processing_class, args):
        """A model object the user passed; returns ``(model, processing_class)`` (converted where needed)."""
        return model, processing_class

    def new_config(self, **fields):
        """A configuration of this family's models from its fields (the keyword arguments of its config class)."""
        raise NotImplementedError(f"the {self.name!r} family builds no configuration from fields.")

    def new_model(self, config):
        """A freshly initialised model of this family from one of its configurations (the model a benchmark
        measures)."""
        raise NotImplementedError(f"the {self.name!r} family builds no model from a configuration.")

    def objective_class(self, name: str):
        """The class of objective ``name`` (one of :attr:`objectives`)."""
        raise NotImplementedError

    def check_args(self, args) -> None:
        """Raise for training arguments this family cannot honour (before anything is loaded)."""

    def load_for_serving(self, path: str, config, init_kwargs: dict[str, Any], block_size: int):
        """``(model, tokenizer)`` for ``hf-bdlm serve`` (``block_size``: the conversion's, for a causal LM)."""
        raise NotImplementedError(f"hf-bdlm serve does not serve {self.name!r} checkpoints yet ({path}).")

    def load_speculative_for_serving(self, target_path: str, draft_path: str, init_kwargs: dict[str, Any],
                                     device: str | None = None, num_speculative_tokens: int | None = None):
        """A causal LM at ``target_path`` decoded with this family's drafter at ``draft_path`` (``hf-bdlm serve
        TARGET --draft DIR``), both on ``device``, verifying ``num_speculative_tokens`` proposals per step (`None`:
        the drafter's default); returns ``(target, tokenizer, decoder)``. Only a family of drafters implements it."""
        raise ValueError(f"--draft takes a drafter folder; {draft_path} holds a {self.name!r} checkpoint, which does "
                         "not draft for another model. Pass a drafter folder, or serve it without --draft.")

    def serving_decoder(self, model, tokenizer) -> "ServingDecoder":
        """How ``hf-bdlm serve`` decodes ``model`` (one of this family's, unwrapped): a :class:`ServingDecoder`."""
        raise NotImplementedError(f"hf-bdlm serve does not decode {self.name!r} models yet.")

    def decoding_variants(self, decoder: "ServingDecoder") -> dict[str, "DecodingVariant"]:
        """The named ways of decoding ``decoder``'s model that ``hf-bdlm bench --only decoding`` measures side by
        side (each a :class:`DecodingVariant` over the same model), in the order of its table. Default: the decoder
        as it is, its own reference."""
        return {"default": DecodingVariant(decoder, reference=True)}

    # --- evaluation (lm-eval's `--model bdlm`) ---------------------------------------------------------------------
    def load_for_evaluation(self, path: str, config, init_kwargs: dict[str, Any], block_size: int):
        """``(model, tokenizer)`` scored by lm-eval's ``--model bdlm``: by default what ``hf-bdlm serve`` loads. A
        family whose checkpoints are no language model of their own raises, naming what to evaluate instead."""
        return self.load_for_serving(path, config, init_kwargs, block_size)

    def likelihood_scorer(self, model, tokenizer) -> "LikelihoodScorer":
        """How lm-eval's ``loglikelihood`` scores ``model``: a :class:`LikelihoodScorer` (a Monte-Carlo estimate of
        the family's likelihood bound). A family without a defined likelihood raises, naming what to use instead."""
        raise NotImplementedError(f"{self.name!r} models define no likelihood to score; evaluate them on generation "
                                  "tasks (generate_until) instead.")

    # --- training ---------------------------------------------------------------------------------------------
    def block_size(self, model) -> int:
        raise NotImplementedError

    def configure(self, model, args, tokenizer):
        """The objective this run trains ``model`` with, built from ``args``; applies what the run changes in the
        model (its config's diffusion fields, frozen parameters, the attention routing)."""
        raise NotImplementedError

    def default_lora_targets(self, model):
        """LoRA ``target_modules`` when the user names none, or ``None`` (PEFT must be told)."""
        return None

    def layout(self, plugin, model, objective, corrupted):
        """The rows this rank runs for one corrupted batch, and how its attention reaches the other ranks' rows."""
        raise NotImplementedError

    def loss(self, runner, model, objective, corrupted, layout, **step_kwargs):
        """``(loss, metrics)`` of this rank's rows; ``runner`` as in the module docstring."""
        raise NotImplementedError

    def zero_loss(self, runner, model, objective, inputs, **step_kwargs):
        """A zero that reaches every trained parameter (a rank whose share supervises nothing still joins DDP's
        reduction)."""
        raise NotImplementedError

    def shard_fsdp(self, model, fully_shard_kwargs: dict, fsdp_plugin):
        """FSDP2 units of a family whose weights need their own grouping: ``(root step, unit names)``, or ``None``
        for the ordinary per-layer units (``hf_bdlm.trainer.fsdp.shard_model``)."""
        return None

    # --- the planner -------------------------------------------------------------------------------------------
    def cost_traits(self, text_config: dict) -> dict:
        """What the planner's cost model (``hf_bdlm.planner.model``) adds to a decoder config (``text_config``: the
        parsed config of the language model) for this family's models: ``k_eq_v`` (global layers share K and V when
        the config does not say), the default ``clean_attention`` and ``window_convention``, ``head_on_clean``
        (the LM head also scores the clean rows) and ``extra_params`` (parameters outside the layers and
        embeddings)."""
        return {"k_eq_v": False, "clean_attention": "block_causal", "window_convention": "per_query",
                "head_on_clean": False, "extra_params": 0}

    def planner_presets(self) -> dict[str, dict]:
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

    # --- the hub ----------------------------------------------------------------------------------------------
    def render_card(self, directory: os.PathLike, config: dict, info: dict | None) -> str:
        """The model card (``README.md``) of a saved folder whose parsed ``config.json`` is ``config``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<model family {self.name!r}>"


class ServingDecoder:
    """What the server (``hf_bdlm.serving.engine.Engine``) needs to decode one family's model; it never names a family.

    The engine owns tokenization, limits, the job queue and streaming; the decoder owns the request's decoding
    settings and the decoding loop. Per request, the engine calls :meth:`settings`, groups jobs whose
    :meth:`batch_key` is equal, and hands each group to :meth:`decode`, which reports every decoded block through
    ``on_block`` and drops the rows ``on_block`` stops (end of text, stop string, cancelled client).

    Attributes:
        model: the model (in eval mode).
        context_length (`int`): most tokens (prompt + completion) the model takes.
        speculative (`bool`): the decoder is greedy speculative decoding: a row's first block is the prefill's
            token, and each later block is what one target forward, verifying drafted tokens, committed. The server
            then counts each row's acceptance (:class:`AcceptanceCounts`) and reports it in the usage.
    """

    model: Any
    context_length: int
    speculative: ClassVar[bool] = False

    def settings(self, request, prompt_len: int, max_tokens: int):
        """The settings of one request (the checkpoint's generation config + the fields the request sets, the
        attributes of :class:`DecodingRequest`), with ``settings.max_new_tokens == max_tokens``; a ``ValueError``
        names what the client must change (a 400)."""
        raise NotImplementedError

    def batch_key(self, settings, seed: int | None):
        """Jobs with equal keys may be decoded together (a hashable value)."""
        raise NotImplementedError

    def eos_token_ids(self, settings) -> set[int]:
        """Token ids that end a completion under ``settings`` (empty when the request ignores EOS)."""
        raise NotImplementedError

    def padding_free_key(self, prompt_len: int, settings):
        """Jobs of equal batch keys *and* equal padding-free keys decode together without padding, so that each
        one's tokens do not depend on the others (lm-eval's batch invariance). Default: every job decodes apart."""
        return object()

    def decode(self, prompts: list[list[int]], settings: list, seeds: list[int | None], on_block) -> None:
        """Decode ``prompts`` (one row each, up to ``settings[row].max_new_tokens`` tokens) together.

        After every block it calls ``on_block({row: new_token_ids})`` (a list or 1-D tensor per row that produced
        tokens); ``on_block`` returns the rows to stop, which are decoded no further. A row ends by itself at EOS or
        at its token budget."""
        raise NotImplementedError

    def counted_modules(self) -> dict[str, Any]:
        """The modules whose forward calls are this decoder's model passes, by role: ``"model"`` (the forwards that
        produce tokens: tokens per forward count these), ``"head"`` (the LM head, over the rows it scores), and any
        other the family runs (a drafter, an encoder). ``hf-bdlm bench --only decoding`` counts their calls and rows
        and times them, for its cost model."""
        return {"model": self.model}


@dataclass
class AcceptanceCounts:
    """The acceptance of greedy speculative decoding, counted one way wherever it is measured: by the server per
    request (``hf-bdlm serve --draft``, in the usage and ``/health``) and by a drafter's trainer on held-out data
    (its eval replays the verification steps serving would run).

    A verification step is one target forward after the prefill, for one request; it commits ``n >= 1`` tokens
    (the proposals it accepted, then the target's own token), cut where the request ends (its EOS or its token
    budget): only tokens the request returns count.

    Attributes:
        verification_steps (`int`): verification steps.
        accepted_tokens (`int`): committed tokens beyond each step's first (accepted proposals).
    """

    verification_steps: int = 0
    accepted_tokens: int = 0

    def add(self, committed: int) -> None:
        """Count one verification step that committed ``committed`` tokens (>= 1)."""
        if committed < 1:
            raise ValueError(f"a verification step commits at least one token (the target's own), got {committed}.")
        self.verification_steps += 1
        self.accepted_tokens += committed - 1

    def merge(self, other: "AcceptanceCounts") -> None:
        """Add the counts of ``other`` (another request, another rank's share)."""
        self.verification_steps += other.verification_steps
        self.accepted_tokens += other.accepted_tokens

    @property
    def acceptance_length(self) -> float:
        """Tokens committed per verification step, in ``[1, B]`` (0.0 before any step): ``1 + accepted /
        steps``, the acceptance length vLLM and SGLang report."""
        steps = self.verification_steps
        return (steps + self.accepted_tokens) / steps if steps else 0.0

    def as_dict(self) -> dict:
        return {"verification_steps": self.verification_steps, "accepted_tokens": self.accepted_tokens,
                "acceptance_length": self.acceptance_length}


@dataclass(frozen=True)
class DecodingVariant:
    """One named way of decoding a model, measured by ``hf-bdlm bench --only decoding``.

    Attributes:
        decoder (`ServingDecoder`): decodes the model with this variant's settings.
        ignore_eos (`bool`): decode every request's whole token budget, then cut the text at its first EOS (what a
            decoder that does not stop at EOS delivers, at that decoder's cost).
        reference (`bool`): the family's most careful setting (one token per step); every variant's agreement is
            measured against its outputs.
        baseline (`str`): the variant this one adds one technique to (its gain is measured against it), or ``""``.
        description (`str`): what it does, for the table.
    """

    decoder: "ServingDecoder"
    ignore_eos: bool = False
    reference: bool = False
    baseline: str = ""
    description: str = ""



@dataclass(frozen=True)
class DecodingRequest:
    """The decoding fields of one request that :meth:`ServingDecoder.settings` reads (the server's parsed request
    carries the same attributes; lm-eval's ``--model bdlm`` builds this one). ``None``: the checkpoint's default."""

    temperature: float | None = None
    top_p: float | None = None
    confidence_threshold: float | None = None
    steps_per_block: int | None = None
    block_size: int | None = None
    ignore_eos: bool = False
    seed: int | None = None


@dataclass(frozen=True)
class ScoreRequest:
    """One likelihood request in tokens: score ``continuation`` given ``context`` (at least one token each)."""

    context: tuple[int, ...]
    continuation: tuple[int, ...]


@dataclass(frozen=True)
class BoundEstimate:
    """A Monte-Carlo estimate of a likelihood bound.

    Attributes:
        log_likelihood (`float`): the mean of the per-sample estimates of the bound on ``log p(continuation |
            context)`` (nats).
        stderr (`float`): its standard error (``nan`` with a single sample).
        greedy (`bool`): whether one parallel denoising step from the prior (every continuation token at the noise's
            end state) predicts the whole continuation by argmax.
    """

    log_likelihood: float
    stderr: float
    greedy: bool


class LikelihoodScorer:
    """What lm-eval's ``loglikelihood`` needs from a family: a seeded Monte-Carlo estimate of its likelihood bound.

    ``score`` draws every random number as a pure function of ``(seed, request tokens, sample, position)``
    (:mod:`hf_bdlm.objectives.likelihood`), so a request scores the same alone, in any batch and in any run.

    Attributes:
        bound (`str`): what is estimated, in words (logged with the scores).
    """

    bound: str = ""

    def score(self, requests: Sequence[ScoreRequest], *, mc_num: int, seed: int, batch_size: int,
              on_batch: Callable[[int], None] | None = None) -> list[BoundEstimate]:
        """One estimate per request, ``mc_num`` samples each, ``batch_size`` requests per forward pass; ``on_batch``
        is called after each forward pass with the number of requests it scored (a progress bar)."""
        raise NotImplementedError
