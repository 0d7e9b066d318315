"""`BDLMGRPOTrainer`: TRL's `GRPOTrainer` for block-diffusion policies (docs/rl.md).

Everything a GRPO user configures stays TRL's: reward functions and weights, `num_generations`, `beta` and the
reference model, `epsilon` clipping, `loss_type`, `num_iterations`, tools and `environment_factory`, PEFT, logging.
Two things differ, each a narrow override of TRL's trainer:

- **rollouts** (`_generate_single_turn`, the hook TRL's `generate` path and its tool loop call with tokenized
  prompts): the model's family decodes them with its serving decoder (``family.role("policy").policy(...)``: the
  ragged block decoder of a converted BDLM, with the run's threshold, steps and techniques), batched and seeded by the
  round (``draw_seed(seed, round, process)``); with ``logp_estimator="trace"`` the decoder records its trace, whose
  rows travel with the completions (keys ``policy.*`` of the batch, through TRL's shuffles and splits);
- **per-token log-probabilities** (`_get_per_token_logps_and_entropies`, which TRL calls for the old, reference and
  current policy): the family's estimator named by ``logp_estimator``. Every call on a round's rows lays them out in
  the round's frame, so a row's numbers do not depend on the batch it is scored in: the importance ratios of the first
  iteration are exactly 1. ``coupled`` and ``one_step`` draw new masks at every iteration; their old and reference
  log-probabilities are computed at the rollout for every iteration (``[rows, num_iterations, C]``) and
  `_compute_loss` takes the current iteration's, so the ratio and the KL term compare the same masks.

**Parallel** (docs/rl.md): one data-parallel group, DDP or FSDP2 (``fsdp="full_shard"``, ``fsdp_config={"fsdp_version":
2}``, or an accelerate FSDP2 config; applied here with ``fully_shard`` as `BDLMSFTTrainer` applies it, CPU and GPU
alike). Each rank decodes and scores its own prompts. Under FSDP2 a training step (rollouts, scoring, loss and
backward) runs on the whole model gathered on every rank, gradients and optimizer state sharded: the decoder's
forwards make no collective, however many each rank's prompts need. Every log-probability call whose forwards reach the
sharded or DDP-wrapped model passes the group to the estimator (``PolicyScoring.group``): ``trace`` agrees on its
number of step forwards over it, so the backward's reduce-scatters (FSDP2) and the forwards' buffer broadcasts (DDP)
match on every rank. DDP runs with
``find_unused_parameters=False`` (the estimators apply the LM head outside the model's forward). The log records
``time/rollout_s`` and ``time/scoring_s`` per optimizer step (per round in evaluation): the seconds spent decoding the
rollouts and computing log-probabilities (old, reference and, in the loss, the current policy's forward).

**Block parallelism** (``block_parallel_size=P``, BDLMSFTConfig's fields): the world is cut into groups of ``P``
consecutive ranks by the same plugin as SFT's (:class:`~hf_bdlm.parallel.BlockParallelPlugin`). The ranks of a group
pool their shares of the generation batch (an all-gather of TRL's rows, in rank order), so every rank of the group
holds the group's rows: the group's first rank decodes them and broadcasts the rollout, the rewards every rank of the
group computes are replaced by the first rank's, and the CPU random state (TRL's shuffle of the round) is the first
rank's: the ranks hold the same rows in the same order by construction. Every log-probability call scores them sharded
over the group (``PolicyScoring.block_parallel``: the training form's rows split as SFT splits them, each token scored
on one rank, the values summed over the group), so each rank's loss is the loss of the group's rows on one process and
its gradient that loss's share of its rows; the loss is scaled by ``P`` for the backward (DDP averages over the world,
``P`` ranks per group), not in the log (FSDP2 with block parallelism is refused: untested). ``trace`` runs each step's forward in the training form.

TRL builds the reference model from the policy's checkpoint path with transformers' Auto classes, which do not load
these families; here the reference is a frozen copy of the policy as the run starts (``beta != 0`` without PEFT).

    from hf_bdlm.rl import BDLMGRPOConfig, BDLMGRPOTrainer, arith_exact_match
    from hf_bdlm.data import load_arith
    trainer = BDLMGRPOTrainer("outputs/smollm2-135m-bdlm", reward_funcs=arith_exact_match,
                              args=BDLMGRPOConfig(output_dir="out", logp_estimator="trace", num_generations=4,
                                                  max_completion_length=32, confidence_threshold=0.9),
                              train_dataset=load_arith("train"))
    trainer.train()
"""

from __future__ import annotations

import copy
import dataclasses
import os
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
from accelerate.utils import is_peft_model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoConfig, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer
from trl.trainer import grpo_trainer as trl_grpo

from ..embedded import resolve_model_path
from ..parallel.plugin import BlockParallelPlugin
from ..protocols.policy import PolicyBatch, PolicyScoring
from ..protocols.registry import family_for_config, family_for_model
from ..protocols.step import unwrap_model
from ..trainer.fsdp import fsdp_request, hidden_from_accelerate, shard_model
from .config import BDLMGRPOConfig
from .estimators import check_estimator, draw_seed

ROWS = "policy."  # prefix of the batch keys the trainer adds: the family's rollout rows, the round and its frame
WIDTH, ROUND = ROWS + "width", ROWS + "round"
RANDOM_ESTIMATORS = ("coupled", "one_step")  # estimators whose masks are drawn afresh at every iteration


def load_policy_model(model, processing_class, args: BDLMGRPOConfig):
    """``(model, processing_class, family, subject)``: ``model`` (a folder, a hub id, ``embedded:smollm2``, or a model
    object) resolved to a model of a family with a policy role; a family without one (a drafter) is refused by its
    role's message, a causal LM by the family that would convert it."""
    if isinstance(model, (str, os.PathLike)):
        path = resolve_model_path(os.fspath(model))
        config = AutoConfig.from_pretrained(path, trust_remote_code=args.trust_remote_code)
        family = family_for_config(config)
        role = family.role("policy", path)
        loaded, tokenizer = role.load(path, config, dict(args.model_init_kwargs or {}))
        return loaded, processing_class if processing_class is not None else tokenizer, family, path
    family = family_for_model(model)
    subject = type(unwrap_model(model)).__name__
    if family is None:
        raise TypeError(f"{subject} is no model of a family hf_bdlm trains with GRPO (a causal LM?): train a causal LM "
                        "with TRL's GRPOTrainer, or pass a model of a family with a policy role.")
    family.role("policy", subject)
    if processing_class is None:
        folder = getattr(getattr(model, "config", None), "_name_or_path", "")
        if not folder or not os.path.isdir(folder):
            raise ValueError(f"no processing_class was given and the model's config names no local folder to load a "
                             f"tokenizer from (_name_or_path={folder!r}); pass processing_class=<its tokenizer>.")
        processing_class = AutoTokenizer.from_pretrained(folder)
    return model, processing_class, family, subject


@contextmanager
def reference_from(policy):
    """While TRL's ``GRPOTrainer.__init__`` runs, its reference model (``beta != 0`` without PEFT) is a frozen copy of
    ``policy`` (TRL would load the policy's checkpoint path with transformers' Auto classes)."""
    def frozen_copy(model_id, **kwargs):
        reference = copy.deepcopy(policy).eval()
        reference.requires_grad_(False)
        return reference

    original = trl_grpo.create_model_from_path
    trl_grpo.create_model_from_path = frozen_copy
    try:
        yield
    finally:
        trl_grpo.create_model_from_path = original


def as_bdlm_config(args) -> BDLMGRPOConfig:
    """``args`` as a :class:`BDLMGRPOConfig` (a plain ``GRPOConfig`` keeps its fields; the new ones take defaults)."""
    if args is None or isinstance(args, BDLMGRPOConfig):
        return args if args is not None else BDLMGRPOConfig(output_dir="bdlm-grpo")
    if isinstance(args, GRPOConfig):
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
        return BDLMGRPOConfig(**values)
    raise TypeError(f"args must be a BDLMGRPOConfig (or a GRPOConfig), got {type(args).__name__}.")


class BDLMGRPOTrainer(GRPOTrainer):
    """TRL's GRPO for a model of a family with a policy role (module docstring). Arguments as `GRPOTrainer`'s; ``model``
    is a folder, hub id or model object of a family with a policy role; ``args`` a
    :class:`BDLMGRPOConfig`."""

    _tag_names = ["trl", "grpo", "hf_bdlm", "block-diffusion"]

    def __init__(self, model, reward_funcs=None, args=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None),
                 peft_config=None, tools=None, rollout_func=None, environment_factory=None):
        args = as_bdlm_config(args)
        model, processing_class, family, subject = load_policy_model(model, processing_class, args)
        role = family.role("policy", subject)
        role.check_args(args)
        check_estimator(args.logp_estimator, role.estimators, f"the {family.name!r} family",
                        "its decoder records no trace" if args.logp_estimator == "trace" else "")
        if args.logp_estimator == "trace" and (tools or environment_factory or rollout_func):
            which = "tools" if tools else "environment_factory" if environment_factory else "rollout_func"
            raise ValueError(f"logp_estimator='trace' scores each token from the decoding step that committed it, and "
                             f"with {which} a completion holds tokens no decoding step of the policy committed (tool "
                             "output, other turns); use logp_estimator='coupled' or 'one_step'.")
        if args.parallelism_config is not None:
            raise ValueError("parallelism_config: BDLMGRPOTrainer trains one data-parallel group (DDP, or FSDP2 with "
                             "fsdp='full_shard', fsdp_config={'fsdp_version': 2}) of block-parallel groups "
                             "(block_parallel_size); context and tensor parallelism are not supported; remove "
                             "parallelism_config.")
        check_block_parallel(args, peft_config, tools, environment_factory, rollout_func)
        if args.ddp_find_unused_parameters:
            raise ValueError("ddp_find_unused_parameters=True: the estimators apply the LM head outside the model's "
                             "forward, which DDP then marks ready twice (as unused, then by its gradient); leave it "
                             "unset (BDLMGRPOTrainer runs DDP with find_unused_parameters=False).")
        args.ddp_find_unused_parameters = False
        self.family = family
        self.fsdp2 = None  # the FSDP2 request (hf_bdlm.trainer.fsdp), taken from Accelerate in create_accelerator...
        self._fsdp_units: list[tuple[FSDPModule, bool]] = []  # every FSDP2 module and its reshard_after_forward
        self._is_gathered = False  # inside _gathered
        self._seconds = {"train": {"rollout": 0.0, "scoring": 0.0}, "eval": {"rollout": 0.0, "scoring": 0.0}}
        self._round = 0  # the generation round in hand (its seeds), see _next_round
        self._rounds_at: tuple[int, bool, int] = (-1, True, 0)  # (global step, training, rounds made at it)
        self._rows: dict | None = None  # the rows being scored: the round's at the rollout, a micro-batch's in the loss
        self._rollout: dict = {}
        self._iteration = 0
        # The block-parallel plugin of a run with P > 1 (its groups built now: the world exists once args.device does).
        self.block_parallel: BlockParallelPlugin | None = None
        if args.block_parallel_size > 1:
            self.block_parallel = BlockParallelPlugin.from_config(args).setup(args.device.type)
        with reference_from(model):
            super().__init__(model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
                             eval_dataset=eval_dataset, processing_class=processing_class,
                             reward_processing_classes=reward_processing_classes, callbacks=callbacks,
                             optimizers=optimizers, peft_config=peft_config, tools=tools, rollout_func=rollout_func,
                             environment_factory=environment_factory)
        if self.aux_loss_enabled:
            raise ValueError("router_aux_loss_coef != 0: the estimators return no MoE load-balancing loss; set "
                             "router_aux_loss_coef=0.")
        self.policy = role.policy(self.model, self._tokenizer, self.args)
        if self.block_parallel is not None:
            self._check_block_parallel_run(subject, family.name)
        if self.accelerator.num_processes > 1 and not self.policy.data_parallel:
            raise ValueError(f"{subject} ({family.name!r} family) trains with GRPO on one process only: "
                             f"{self.policy.single_process_reason}; launch a single process.")
        if self.fsdp2 is not None:
            self._shard_with_fsdp2(peft_config)

    # --- parallel ---------------------------------------------------------------------------------------------------
    def _check_block_parallel_run(self, subject: str, family: str) -> None:
        """Refuse, once the trainer is built, what block parallelism does not run: a policy whose estimators do not
        shard, FSDP2, and generation groups a block-parallel group would cut."""
        P, args = self.block_parallel.block_parallel_size, self.args
        if args.logp_estimator not in self.policy.block_parallel_estimators:
            which = (f"its estimators {list(self.policy.block_parallel_estimators)} do"
                     if self.policy.block_parallel_estimators else "none of its estimators does")
            raise ValueError(f"block_parallel_size={P} with {subject} ({family!r} family) and logp_estimator="
                             f"{args.logp_estimator!r}: the scoring forward is sharded over a block-parallel group "
                             f"only where the family's policy shards it, and {which}; set block_parallel_size=1.")
        if self.fsdp2 is not None:
            raise ValueError(f"block_parallel_size={P} with FSDP2: untested with BDLMGRPOTrainer; train block-parallel "
                             "groups under DDP (remove fsdp / fsdp_config), or FSDP2 with block_parallel_size=1.")
        pooled = P * args.per_device_train_batch_size * args.steps_per_generation
        if pooled % self.num_generations:
            raise ValueError(f"block_parallel_size={P}: a block-parallel group pools {P} x "
                             f"per_device_train_batch_size ({args.per_device_train_batch_size}) x steps_per_generation "
                             f"({args.steps_per_generation}) = {pooled} rows per round, which must hold whole "
                             f"groups of num_generations={self.num_generations} (the advantages are normalized per "
                             "group); change per_device_train_batch_size or num_generations.")
        pooled_eval = P * args.per_device_eval_batch_size
        if args.eval_strategy != "no" and pooled_eval % self.num_generations_eval:
            raise ValueError(f"block_parallel_size={P}: an evaluation round of a block-parallel group pools {P} x "
                             f"per_device_eval_batch_size ({args.per_device_eval_batch_size}) = {pooled_eval} rows, "
                             f"which must hold whole groups of num_generations_eval={self.num_generations_eval}.")

    @property
    def _group(self):
        """The block-parallel group's process group and the global rank of its first rank."""
        group = self.block_parallel.groups.group.group
        return group, dist.get_global_rank(group, 0)

    def _from_group_first(self, value):
        """``value`` (any picklable object) as the block-parallel group's first rank holds it, on every rank of it."""
        group, first = self._group
        box = [value]
        dist.broadcast_object_list(box, src=first, group=group)
        return box[0]

    def create_accelerator_and_postprocess(self):
        # A requested FSDP is applied by the trainer itself (hf_bdlm.trainer.fsdp, as BDLMSFTTrainer does): Accelerate
        # would train plain DDP on a CPU world and shard over a mesh of its own on GPUs.
        try:
            self.fsdp2 = fsdp_request(self.args)
        except ValueError as error:
            raise ValueError(str(error).replace("BDLMSFTTrainer", type(self).__name__)) from None
        if self.fsdp2 is None:
            return super().create_accelerator_and_postprocess()
        with hidden_from_accelerate(self.args):
            return super().create_accelerator_and_postprocess()

    def _shard_with_fsdp2(self, peft_config) -> None:
        world = self.accelerator.num_processes
        if world < 2:
            raise ValueError("FSDP2 was requested (fsdp / fsdp_config, or an accelerate FSDP config) but this is a single "
                             "process: launch at least 2 processes with torchrun or accelerate launch, or remove the "
                             "FSDP setting.")
        if peft_config is not None or is_peft_model(self.model):
            raise ValueError("FSDP2 with a peft_config: BDLMGRPOTrainer does not shard LoRA runs yet; train LoRA under "
                             "DDP (remove fsdp / fsdp_config), or train the full model under FSDP2.")
        if self.fsdp2.activation_checkpointing:
            raise ValueError("fsdp_config activation_checkpointing: BDLMGRPOTrainer reads gradient_checkpointing "
                             "instead; remove activation_checkpointing from the FSDP config.")
        mesh = init_device_mesh(self.accelerator.device.type, (world,), mesh_dim_names=("dp",))
        shard_model(self.model, mesh, self.fsdp2)
        units = bool(self.fsdp2.reshard_after_forward)
        self._fsdp_units = [(m, units and m is not self.model) for m in self.model.modules()
                            if isinstance(m, FSDPModule)]  # the root keeps its parameters (shard_model)
        self.model_wrapped = self.model
        # transformers' path for a model that owns its sharding: Accelerate prepares mixed precision only, the
        # optimizer is built from the sharded parameters.
        self.is_distributed_loading_by_transformers = True

    @contextmanager
    def _defer_fsdp_gradient_reduction(self):
        # Gradient accumulation under FSDP2: one reduce-scatter after the last micro-batch.
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    @contextmanager
    def _gathered(self):
        """Under FSDP2, the whole model gathered on every rank (each unit all-gathered once, in the same order on every
        rank) and kept gathered through forwards and backward, then sharded again; re-entrant.

        The rollouts then decode with no collective in their forwards, however many each rank's prompts need; the
        loss's forwards too, and its backward makes one reduce-scatter per unit and forward, the same on every rank
        (``trace`` agrees on its number of forwards). Kept gathered through the backward because ``trace``'s step
        forwards read the clean forward's cached K/V: their gradient reaches the clean forward's projections without
        passing its outputs, where FSDP2 would gather the parameters again."""
        if not self._fsdp_units or self._is_gathered:
            yield
            return
        units = self._fsdp_units
        for module, _ in units:
            module.set_reshard_after_forward(False, recurse=False)
            module.set_reshard_after_backward(False, recurse=False)
        for module, _ in units:
            module.unshard()
        self._is_gathered = True
        try:
            yield
        finally:
            self._is_gathered = False
            for module, reshard in units:
                module.reshard()
                module.set_reshard_after_forward(reshard, recurse=False)
                module.set_reshard_after_backward(True, recurse=False)

    def _forward_group(self, model):
        """The process group whose ranks must run the same forwards through ``model`` (FSDP2: every forward
        all-gathers; DDP with gradients: every forward broadcasts the buffers), else ``None``."""
        if self.accelerator.num_processes == 1:
            return None
        if isinstance(model, FSDPModule) or (isinstance(model, DistributedDataParallel) and torch.is_grad_enabled()):
            return dist.group.WORLD
        return None

    def _clock(self, mode: str, name: str, start: float) -> float:
        """Add the seconds since ``start`` to ``name``'s count of ``mode`` (the device's queue drained first); now."""
        if self.accelerator.device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        self._seconds[mode][name] += now - start
        return now

    def _report_seconds(self, mode: str) -> None:
        for name, seconds in self._seconds[mode].items():
            self._metrics[mode][f"time/{name}_s"].append(seconds)
            self._seconds[mode][name] = 0.0

    def training_step(self, model, inputs, num_items_in_batch):
        with self._gathered():  # FSDP2: rollouts, scoring, loss and backward over the whole model
            output = super().training_step(model, inputs, num_items_in_batch)
        if self.block_parallel is not None:  # the loss as logged: compute_loss scaled it for the backward
            output = output / self.block_parallel.block_parallel_size
        if self._step % self.current_gradient_accumulation_steps == 0:  # an optimizer step (TRL's step_time too)
            self._report_seconds("train")
        return output

    # --- rollouts ---------------------------------------------------------------------------------------------------
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """The prompts decoded by the family's serving decoder, seeded by the round (TRL: ``generate`` or vLLM)."""
        if (images is not None and any(images)) or multimodal_fields:
            raise ValueError("images: the block-diffusion policies decode text only.")
        model = unwrap_model(self.accelerator.unwrap_model(self.model_wrapped))
        plugin = self.block_parallel
        # One seed per data-parallel replica: a block-parallel group's rows are decoded once, by its first rank.
        replica = self.accelerator.process_index if plugin is None else plugin.data_parallel_rank
        seed = draw_seed(self.args.seed, self._round, replica)
        start = time.perf_counter()
        rollout = None
        if plugin is None or plugin.group_rank == 0:
            with torch.no_grad(), self._gathered():
                rollout = self.policy.rollout(model, [list(p) for p in prompt_ids], seed,
                                              trace=self.args.logp_estimator == "trace")
        if plugin is not None:
            rollout = self._from_group_first(rollout)
        self._clock("train" if self.model.training else "eval", "rollout", start)
        width = max(len(p) + len(c) for p, c in zip(prompt_ids, rollout.completions))
        self._rollout = {"rows": rollout.rows, "width": max(width, self._rollout.get("width", 0))}
        return rollout.completions, rollout.log_probs

    def _generate_and_score_completions(self, inputs):
        self._round = self._next_round()
        self._rollout = {}
        self._rows = None
        plugin = self.block_parallel
        if plugin is not None:  # the group's rows on every rank of it, in rank order
            shares = [None] * plugin.block_parallel_size
            dist.all_gather_object(shares, inputs, group=self._group[0])
            inputs = [row for share in shares for row in share]
        tokens_seen = self.state.num_input_tokens_seen
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._rows = None
        if plugin is not None:
            # TRL counts the world's rows, each of a group's rows once per rank of it; TRL's shuffle of the round
            # (the CPU generator, next) is the group's first rank's.
            self.state.num_input_tokens_seen = tokens_seen + (self.state.num_input_tokens_seen - tokens_seen) / \
                plugin.block_parallel_size
            self._metrics["train" if self.model.training else "eval"]["num_tokens"] = [self.state.num_input_tokens_seen]
            torch.set_rng_state(self._from_group_first(torch.get_rng_state()))
        output.update(self._round_rows(output["prompt_mask"], output["completion_mask"]))
        if not self.model.training:  # an evaluation round: its seconds reported with it
            self._report_seconds("eval")
        return output

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # TRL's rewards of the world's rows ([W * rows, functions]); under block parallelism every rank of a group
        # holds the group's rows, and every rank takes the group's first rank's rewards for them (a reward function
        # need not be deterministic).
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        plugin = self.block_parallel
        if plugin is None:
            return rewards
        P = plugin.block_parallel_size
        by_rank = rewards.view(-1, P, rewards.shape[0] // self.accelerator.num_processes, rewards.shape[1])
        return by_rank[:, :1].expand_as(by_rank).reshape(rewards.shape)

    def _next_round(self) -> int:
        """The id of the generation round about to start, a function of the optimizer step (restored on resume) and
        of the rounds already made at it, so a resumed run draws the seeds the uninterrupted run drew; evaluation
        rounds count apart (negative ids)."""
        step, training, made = self._rounds_at
        now = (self.state.global_step, self.model.training)
        made = made + 1 if now == (step, training) else 0
        self._rounds_at = (*now, made)
        round_ = now[0] * 4096 + made
        return round_ if now[1] else -1 - round_

    def _round_rows(self, prompt_mask, completion_mask) -> dict:
        """The round's per-row extras: the family's rollout rows (``policy.<key>``), the round and its frame width."""
        n = prompt_mask.shape[0]
        longest = int((prompt_mask.sum(1) + completion_mask.sum(1)).max())
        width = max(self._rollout.get("width", 0), longest)
        device = prompt_mask.device
        rows = {ROWS + key: value.to(device) for key, value in self._rollout.get("rows", {}).items()
                if value.shape[0] == n}
        rows[WIDTH] = torch.full((n,), width, dtype=torch.long, device=device)
        rows[ROUND] = torch.full((n,), self._round, dtype=torch.long, device=device)
        return rows

    # --- log-probabilities ------------------------------------------------------------------------------------------
    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        """The completion tokens' log-probabilities by the run's estimator (and entropies), ``batch_size`` rows at a
        time: ``[rows, C]``, or ``[rows, num_iterations, C]`` for a random estimator's old and reference
        log-probabilities computed at the rollout (module docstring)."""
        if any(value is not None for value in multimodal.values()):
            raise ValueError("images: the block-diffusion policies score text only.")
        began = time.perf_counter()
        group = self._forward_group(model)
        at_rollout = self._rows is None
        rows = self._rows if not at_rollout else self._round_rows(attention_mask[:, :-logits_to_keep],
                                                                 attention_mask[:, -logits_to_keep:])
        rounds = rows[ROUND]
        if bool((rounds != rounds[0]).any()):
            raise RuntimeError("rows of several generation rounds in one log-probability call.")
        random = self.args.logp_estimator in RANDOM_ESTIMATORS
        iterations = range(self.num_iterations) if at_rollout and random and self.num_iterations > 1 else \
            [self._iteration]
        family_rows = {key[len(ROWS):]: value for key, value in rows.items() if key not in (WIDTH, ROUND)}
        width = int(rows[WIDTH].max())
        n, P = input_ids.shape[0], input_ids.shape[1] - logits_to_keep
        batch_size = batch_size or n
        log_probs, entropies = [], []
        for start in range(0, n, batch_size):
            part = slice(start, start + batch_size)
            batch = PolicyBatch(input_ids[part, :P], attention_mask[part, :P], input_ids[part, P:],
                                attention_mask[part, P:], {k: v[part] for k, v in family_rows.items()}, width)
            per_iteration = []
            for iteration in iterations:
                scoring = PolicyScoring(self.args.logp_estimator, self.temperature,
                                        draw_seed(self.args.seed, int(rounds[0]), iteration),
                                        self.args.prompt_mask_ratio,
                                        cache_clean_rows=not self.args.gradient_checkpointing and
                                        self.block_parallel is None, group=group,
                                        block_parallel=self.block_parallel)
                with self.accelerator.autocast():
                    per_iteration.append(self.policy.log_probs(model, batch, scoring, entropy=compute_entropy))
            stack = (lambda xs: torch.stack(xs, 1)) if len(iterations) > 1 else (lambda xs: xs[0])
            log_probs.append(stack([lp for lp, _ in per_iteration]))
            if compute_entropy:
                entropies.append(stack([e for _, e in per_iteration]))
        self._clock("train" if self.model.training else "eval", "scoring", began)
        return torch.cat(log_probs), (torch.cat(entropies) if compute_entropy else None), None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.block_parallel is not None and self.model.training:
            # Every rank of a group holds its loss, and its gradient is its rows' share: DDP averages over the world,
            # P ranks per group, so the backward takes P x the loss (training_step logs it unscaled).
            loss = loss * self.block_parallel.block_parallel_size
        return loss

    def _compute_loss(self, model, inputs):
        """TRL's loss over the current iteration's log-probabilities (the rows' extras and the iteration in hand)."""
        training = self.model.training
        iteration = (self._step // self.args.steps_per_generation) % self.num_iterations if training else 0
        inputs = dict(inputs)
        for key in ("old_per_token_logps", "ref_per_token_logps"):
            value = inputs.get(key)
            if value is not None and value.dim() == 3:
                inputs[key] = value[:, iteration]
        self._rows = {key: value for key, value in inputs.items() if key.startswith(ROWS)}
        self._iteration = iteration
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._rows, self._iteration = None, 0


def check_block_parallel(args: BDLMGRPOConfig, peft_config, tools, environment_factory, rollout_func) -> None:
    """Refuse, before anything is built, what block parallelism (``block_parallel_size > 1``) does not run yet."""
    P = args.block_parallel_size
    if P == 1:
        return
    if tools or environment_factory or rollout_func:
        which = "tools" if tools else "environment_factory" if environment_factory else "rollout_func"
        raise ValueError(f"block_parallel_size={P} with {which}: untested (every rank of a group would run the tool "
                         f"calls of the group's rows); remove {which}, or set block_parallel_size=1.")
    if peft_config is not None:
        raise ValueError(f"block_parallel_size={P} with a peft_config: untested with BDLMGRPOTrainer; train LoRA with "
                         "block_parallel_size=1, or the full model with block parallelism.")


__all__ = ["BDLMGRPOTrainer", "check_block_parallel", "load_policy_model", "reference_from"]
