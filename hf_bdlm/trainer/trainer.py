"""`BDLMSFTTrainer`: TRL's `SFTTrainer` for block diffusion LMs, with block parallelism.

The few hooks that change are overridden; the rest (dataset formats and chat templates, PEFT,
gradient accumulation and checkpointing, mixed precision, logging, checkpoints) is TRL's and
transformers' own. One optimizer step:

1. ``get_batch_samples``: each micro-batch is corrupted by the objective with noise keyed by
   (seed, optimizer step, sample id, position). A sample occurs once per step, so the noise does not
   depend on how the step's global batch is split over block-parallel ranks, data-parallel replicas or
   accumulation micro-batches. The supervised-token count of the whole optimizer step becomes the loss
   normalizer (as TRL does with ``num_items_in_batch``): the step's gradient is that of one big batch.
2. ``compute_loss``: the run's step, built once by the model's family (``step = family.role("training").step(model,
   args, tokenizer, plugin)``, :class:`~hf_bdlm.protocols.roles.LossStep`), is called with the corrupted batch: it
   lays out the rows this rank runs (sharded by the block-parallel plugin) and returns the loss of the targets it owns;
   the loss is scaled by the world size so that DDP's / FSDP2's mean over ranks is the single-device gradient. A family
   whose objective drives the model's parts itself (``TrainingSpec.owns_step``) runs as the forward of a
   :class:`~hf_bdlm.protocols.step.TrainingStep`, which is what Accelerate prepares (DDP, autocast) in its place, and
   under FSDP2 the root unit (the family's own units below it: ``TrainingSpec.shard_fsdp``).
3. Logged ``loss`` and ``mean_token_accuracy`` are those of the whole global batch: the same numbers
   whatever the parallel layout.

    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml recipes/sft.py \\
        --config recipes/configs/smollm2_cpu_csbp.yaml

    from hf_bdlm import BDLMSFTConfig, BDLMSFTTrainer
    trainer = BDLMSFTTrainer("path/to/causal-lm", args=BDLMSFTConfig("out", block_size=16), train_dataset=ds)
    trainer.train()
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from collections import deque
from dataclasses import replace
from typing import Any

import datasets
import torch
from accelerate.utils import is_peft_model
from torch.utils.data import DataLoader
from transformers import ProcessorMixin, TrainingArguments
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME
from transformers.trainer_utils import has_length, rotate_checkpoints
from trl import SFTTrainer
from trl.trainer.utils import global_then_local_main_first

from ..checkpoints.files import check_weight_files
from ..hub import hub_repo_id, write_model_card
from ..planner.link import link_for_this_machine
from ..planner.model import spec_from_config
from ..protocols.entry import ModelFamily
from ..protocols.roles import LossStep, TrainingSpec
from ..protocols.step import TrainingStep
from ..objectives import Objective, supervised_mask
from ..parallel.plugin import BlockParallelPlugin
from ..parallel.tensor import apply_tensor_parallel
from .collator import SAMPLE_ID_COLUMN, BlockAlignedCollator, apply_length_policy, pack_block_aligned
from ..checkpoints.atomic import TRAINER_STATE_NAME, CheckpointCommit, check_resumable, last_complete_checkpoint
from .config import ACCELERATE_PARALLELISM_ENV, BDLMSFTConfig
from .fsdp import (
    fsdp_request,
    full_model_state_dict,
    full_optimizer_state_dict,
    fully_shard_kwargs,
    hidden_from_accelerate,
    is_sharded_checkpoint,
    load_full_checkpoint,
    load_full_optimizer_state_dict,
    load_sharded_model,
    load_sharded_optimizer,
    save_sharded_model,
    save_sharded_optimizer,
    shard_model,
    state_dict_type,
)
from .inputs import (
    add_sample_ids,
    check_dataset_format,
    check_lora_targets,
    check_peft_config,
    dataset_name,
    load_diffusion_model,
)

logger = logging.getLogger(__name__)



class BDLMSFTTrainer(SFTTrainer):
    r"""
    Supervised fine-tuning of block diffusion LMs (and AR -> BDLM conversion) with block parallelism.

    Args:
        model (`str`, `os.PathLike`, [`~transformers.PreTrainedModel`] or [`~peft.PeftModel`]):
            A [`BlockDiffusionForMaskedLM`] (object or local checkpoint folder), or a causal LM (object, local
            folder or `"embedded:smollm2"`) that is converted with [`convert_causal_lm`] (a `[MASK]` token is added
            to the tokenizer).
            `args.model_init_kwargs` go to `from_pretrained` (dtype defaults to float32, as in TRL).
        args ([`BDLMSFTConfig`], *optional*):
            The configuration; a plain `SFTConfig` / `TrainingArguments` is converted.
        data_collator (*optional*):
            Defaults to [`~hf_bdlm.trainer.collator.BlockAlignedCollator`] (block-aligned padding).
        train_dataset ([`~datasets.Dataset`]):
            Any TRL SFT format: language modeling (`text`), prompt-completion (standard or conversational),
            conversational (`messages`), or pre-tokenized (`input_ids`). A map-style dataset is required: the
            global sample index keys the diffusion noise.
        eval_dataset (*optional*), processing_class (*optional*), callbacks (*optional*), optimizers (*optional*),
        optimizer_cls_and_kwargs (*optional*), formatting_func (*optional*):
            As in [`~trl.SFTTrainer`].
        peft_config ([`~peft.PeftConfig`], *optional*):
            LoRA and friends; `target_modules` must be given (PEFT cannot infer them for this model type), and
            `task_type` is ignored (a block-diffusion model is not a causal LM).
        block_parallel_plugin ([`BlockParallelPlugin`], *optional*):
            Defaults to `BlockParallelPlugin.from_config(args)`.
    """

    _tag_names = ["trl", "sft", "hf_bdlm", "block-diffusion"]
    _name = "BDLM SFT"
    # compute_loss divides by the supervised tokens of the whole optimizer step; no further 1/accumulation.
    loss_is_scaled_for_ga = True

    def __init__(
        self,
        model,
        args: BDLMSFTConfig | TrainingArguments | None = None,
        data_collator=None,
        train_dataset: datasets.Dataset | None = None,
        eval_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        optimizer_cls_and_kwargs=None,
        peft_config=None,
        formatting_func=None,
        block_parallel_plugin: BlockParallelPlugin | None = None,
    ):
        args = _as_bdlm_config(args, model)
        if train_dataset is None:
            raise ValueError("`train_dataset` is required.")
        # Everything the user gave is checked before anything is loaded, converted or written.
        eval_sets = eval_dataset if isinstance(eval_dataset, dict) else {"eval": eval_dataset} if eval_dataset else {}
        for name, dataset in {"train": train_dataset, **eval_sets}.items():
            check_dataset_format(dataset, args, formatting_func, name)
        peft_config = check_peft_config(peft_config)

        model, processing_class, self._base_model_name, family = load_diffusion_model(model, processing_class, args)
        self.family: ModelFamily = family
        self.training_role: TrainingSpec = family.role("training")
        if peft_config is not None:
            check_lora_targets(peft_config, model)
        self.plugin = block_parallel_plugin or BlockParallelPlugin.from_config(args, _emulated_link(args, model))
        self.plugin.setup(args.device.type)
        # The run's loss, built once: the objective from the arguments, the model's settings applied.
        self.step: LossStep = self.training_role.step(model, args, getattr(processing_class, "tokenizer",
                                                                           processing_class), self.plugin)
        self.objective: Objective = self.step.objective
        self.block_size = family.block_size(model)
        if (args.packing or args.eval_packing) and args.max_length % self.block_size:
            raise ValueError(
                f"with packing=True, max_length={args.max_length} must be a multiple of the block size "
                f"{self.block_size} (packed documents are aligned to block boundaries)."
            )

        tokenizer = processing_class.tokenizer if isinstance(processing_class, ProcessorMixin) else processing_class
        if tokenizer.pad_token is None:
            if tokenizer.eos_token is None:
                raise ValueError("the tokenizer has neither a pad token nor an EOS token to pad with; set pad_token.")
            tokenizer.pad_token = tokenizer.eos_token
        self._pad_token_id = tokenizer.pad_token_id

        if self.plugin.dims.is_tensor_parallel:
            self._split_tensor_parallel(model, args, peft_config)
        if data_collator is None:
            data_collator = BlockAlignedCollator(
                self._pad_token_id, self.block_size, self.plugin.pad_multiple(self.block_size)
            )
        train_dataset = add_sample_ids(train_dataset, "train")
        if isinstance(eval_dataset, dict):
            eval_dataset = {k: add_sample_ids(v, k) for k, v in eval_dataset.items()}
        elif eval_dataset is not None:
            eval_dataset = add_sample_ids(eval_dataset, "eval")

        self._fsdp_step: TrainingStep | None = None  # a family owning its step, under FSDP2: the root unit
        self._corrupted = PendingBatches(())
        self.data_report: dict[str, dict] = {}
        self.model_card_info: dict[str, Any] = {"dataset": dataset_name(train_dataset)}
        if self.objective.card_settings():  # settings the saved config does not record
            self.model_card_info["training"] = self.objective.card_settings()
        self._pack = {"train": args.packing, "eval": args.packing if args.eval_packing is None else args.eval_packing}
        # TRL's packing is token-level (documents not block-aligned) and forces its padding-free collator; ours
        # runs in _prepare_dataset instead, so TRL must see packing off while it builds the trainer.
        packing, eval_packing, init_kwargs = args.packing, args.eval_packing, args.model_init_kwargs
        args.packing, args.eval_packing, args.model_init_kwargs = False, False, None  # kwargs used by the loader
        try:
            super().__init__(
                model=model,
                args=args,
                data_collator=data_collator,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
                processing_class=processing_class,
                callbacks=callbacks,
                optimizers=optimizers,
                optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
                peft_config=peft_config,
                formatting_func=formatting_func,
            )
        finally:
            args.packing, args.eval_packing, args.model_init_kwargs = packing, eval_packing, init_kwargs

        # Sums over the logging window of [loss_sum, correct, masked tokens, tokens, certainty entropy], whole global
        # batch.
        self._window = {"train": torch.zeros(5, dtype=torch.float64), "eval": torch.zeros(5, dtype=torch.float64)}
        self._tokens_seen = 0.0
        if self.fsdp2 is not None:
            self._shard_with_fsdp2()

    # --- tensor parallelism ----------------------------------------------------------------------
    def _split_tensor_parallel(self, model, args, peft_config) -> None:
        """Split ``model`` over the mesh's ``tp`` dim (``parallelism_config.tp_size``; hf_bdlm.parallel.tensor)."""
        T = self.plugin.tensor_parallel_size
        if peft_config is not None:
            raise ValueError(
                f"parallelism_config.tp_size={T} with a peft_config is not supported: LoRA adapters would wrap the "
                "split projections. Train LoRA without tensor parallelism (block parallelism shards the sequence)."
            )
        if fsdp_request(args) is None:
            raise ValueError(
                f"parallelism_config.tp_size={T} needs FSDP2 (fsdp='full_shard', fsdp_config={{'fsdp_version': 2}}): "
                "the split weights are DTensors, which DDP cannot average; FSDP2 shards them over the data-parallel "
                "and block-parallel ranks, as Accelerate composes dp_shard with tp."
            )
        apply_tensor_parallel(model, self.plugin.groups.tp_mesh)

    # --- FSDP2 -----------------------------------------------------------------------------------
    def create_accelerator_and_postprocess(self):
        # A requested FSDP is applied by the trainer itself (hf_bdlm.trainer.fsdp): Accelerate would train plain DDP
        # on a CPU world, and shard over a mesh of its own on GPUs. Tensor parallelism too: the trainer splits the model
        # over its own mesh, and Accelerate would build another one from parallelism_config.
        self.fsdp2 = fsdp_request(self.args)
        parallelism, self.args.parallelism_config = self.args.parallelism_config, None
        from_launcher = os.environ.pop(ACCELERATE_PARALLELISM_ENV, None)
        try:
            if self.fsdp2 is None:
                return super().create_accelerator_and_postprocess()
            with hidden_from_accelerate(self.args):
                return super().create_accelerator_and_postprocess()
        finally:
            self.args.parallelism_config = parallelism
            if from_launcher is not None:
                os.environ[ACCELERATE_PARALLELISM_ENV] = from_launcher

    def _shard_with_fsdp2(self) -> None:
        plugin = self.plugin
        if plugin.world_size < 2:
            raise ValueError(
                "FSDP2 was requested (fsdp / fsdp_config, or an accelerate FSDP config) but this is a single process: "
                "launch at least 2 processes with torchrun or accelerate launch, or remove the FSDP setting."
            )
        kwargs = fully_shard_kwargs(self.model, plugin.groups.world_mesh, self.fsdp2)
        own = self.training_role.shard_fsdp(self.model, kwargs, self.fsdp2)
        if own is not None:
            # The family's own units; the FSDP2 root is the TrainingStep its objective runs through.
            self._fsdp_step, units = own
            self.model_wrapped = self._fsdp_step
            described = f"{len(units)} units ({', '.join(units[:2])}{', ...' if len(units) > 2 else ''})"
        else:
            units = shard_model(self.model, plugin.groups.world_mesh, self.fsdp2)
            self.model_wrapped = self.model
            described = f"{len(units)} units ({', '.join(sorted(set(units.values())))})"
        # transformers' own path for a model that owns its sharding and gradient reduction: Accelerate prepares mixed
        # precision only (no DDP wrapper), the optimizer is built from the sharded parameters.
        self.is_distributed_loading_by_transformers = True
        if self.fsdp2.activation_checkpointing:
            self.args.activation_checkpointing = True  # the model's own per-layer checkpointing: the same units
        if self.is_world_process_zero():
            T = plugin.tensor_parallel_size
            tp = f", each of its ranks one of {T} tensor-parallel ranks" if T > 1 else ""
            logger.warning(
                f"FSDP2: BDLMSFTTrainer shards the model itself with torch.distributed.fsdp.fully_shard over the dp x bp "
                f"world ({plugin.data_world_size} ranks: {plugin.data_parallel_size} data-parallel x "
                f"{plugin.block_parallel_size} block-parallel{tp}): {described} and the root; Accelerate prepares mixed "
                f"precision only. Checkpoints: "
                f"{state_dict_type(self.fsdp2)}."
            )

    @contextlib.contextmanager
    def _defer_fsdp_gradient_reduction(self):
        # Gradient accumulation: the micro-batches before the last keep their gradients unsharded, one reduce-scatter
        # follows the last. (transformers' version reads the DistributedConfig of a model sharded at load time.)
        root = self._step_runner(self.model)  # the root FSDP2 module
        root.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            root.set_requires_gradient_sync(True)

    def create_optimizer(self, model=None):
        if self._fsdp_step is not None:
            # A forward before training (evaluate) leaves the root gathered (it is not resharded after forward): the
            # optimizer must get the sharded parameters. (transformers reshards the units inside the model itself.)
            self._fsdp_step.reshard()
        return super().create_optimizer(model)

    # --- checkpoints: atomic saves (hf_bdlm/checkpoints/atomic.py) ---------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, ignore_keys_for_eval=None, **kwargs):
        # True: the last *complete* checkpoint; unfinished saves are reported and skipped. A path: refused if unfinished.
        # A recipe's `--resume_from_checkpoint True` arrives as a string (TrainingArguments types it `str`).
        if isinstance(resume_from_checkpoint, str) and resume_from_checkpoint.lower() == "true" and \
                not os.path.isdir(resume_from_checkpoint):
            resume_from_checkpoint = True
        if resume_from_checkpoint is True:
            found = last_complete_checkpoint(self.args.output_dir, report=self.is_world_process_zero())
            if found is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
            resume_from_checkpoint = found
        elif isinstance(resume_from_checkpoint, (str, os.PathLike)):
            check_resumable(resume_from_checkpoint)
        try:
            return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)
        except Exception as err:
            # A lost peer fails a collective with "connection reset" at best: say which rank is gone.
            explained = self.plugin.explain_failure(err)
            if explained is None:
                raise
            raise explained from err

    def _get_output_dir(self, trial) -> str:
        # While a checkpoint is saved, the Trainer writes it into the staging folder (see _save_checkpoint).
        staging = getattr(self, "_checkpoint_commit", None)
        return str(staging.staging_run_dir) if staging is not None else super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial):
        """transformers' save, written into a staging folder and renamed into place once every rank has written its
        part: a process killed during the save leaves no ``checkpoint-N`` that a resume would take."""
        run_dir = super()._get_output_dir(trial)
        commit = CheckpointCommit(run_dir, self.state.global_step, self.args.should_save,
                                  self.accelerator.wait_for_everyone)
        commit.prepare()
        self._checkpoint_commit = commit
        try:
            super()._save_checkpoint(model, trial)
            self._save_extra_state(str(commit.staged))
            published = commit.published(self.state.best_model_checkpoint)
            if published != self.state.best_model_checkpoint:  # the Trainer recorded the staging path as the best
                self.state.best_model_checkpoint = published
                if self.args.should_save:
                    self.state.save_to_json(os.path.join(commit.staged, TRAINER_STATE_NAME))
        finally:
            self._checkpoint_commit = None
        commit.commit()
        if self.args.should_save:  # the Trainer rotated the staging folder; the checkpoints are here
            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

    def _save_extra_state(self, checkpoint_dir: str) -> None:
        """Write what a model family's trainer keeps beyond transformers' checkpoint (its objective's state) into
        ``checkpoint_dir``, before the checkpoint is committed. Nothing by default."""

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if self.fsdp2 is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir or self.args.output_dir
        saving_checkpoint = getattr(self, "_checkpoint_commit", None) is not None
        if saving_checkpoint and state_dict_type(self.fsdp2) == "SHARDED_STATE_DICT":
            save_sharded_model(self.model, output_dir)
        else:
            # Gathered on rank 0 and written as an ordinary transformers checkpoint (a PEFT model: its adapter).
            state = full_model_state_dict(self.model, trainable_only=is_peft_model(self.model))
            if self.args.should_save:
                self._save(output_dir, state_dict=state)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.fsdp2 is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        optimizer = _torch_optimizer(self.optimizer)
        if state_dict_type(self.fsdp2) == "SHARDED_STATE_DICT":
            save_sharded_optimizer(self.model, optimizer, output_dir)
        else:
            state = full_optimizer_state_dict(self.model, optimizer)
            if self.args.should_save:
                torch.save(state, os.path.join(output_dir, OPTIMIZER_NAME))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        check_weight_files(resume_from_checkpoint)  # a weights file cut short: its name and the fix, not a parse error
        if isinstance(model, TrainingStep):
            model = model.module
        # A sharded (DCP) checkpoint loads into any run, FSDP2 or not, on any world size: DCP reshards.
        if is_sharded_checkpoint(resume_from_checkpoint):
            load_sharded_model(model or self.model, resume_from_checkpoint)
        elif self.fsdp2 is not None:
            load_full_checkpoint(model or self.model, resume_from_checkpoint)
        else:
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or (self.fsdp2 is None and not is_sharded_checkpoint(checkpoint)):
            return super()._load_optimizer_and_scheduler(checkpoint)
        optimizer = _torch_optimizer(self.optimizer)
        if not os.path.isfile(os.path.join(checkpoint, SCHEDULER_NAME)):
            return  # a checkpoint without optimizer state (save_only_model): as transformers, start a fresh one
        if is_sharded_checkpoint(checkpoint):
            load_sharded_optimizer(self.model, optimizer, checkpoint)
        else:  # an ordinary checkpoint (FSDP2 FULL_STATE_DICT, DDP, one process): torch.optim's own format
            state = torch.load(os.path.join(checkpoint, OPTIMIZER_NAME), map_location="cpu", weights_only=True)
            load_full_optimizer_state_dict(self.model, optimizer, state)
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))

    def _load_best_model(self) -> None:
        if self.fsdp2 is None:
            return super()._load_best_model()
        self._load_from_checkpoint(self.state.best_model_checkpoint)

    # --- data ------------------------------------------------------------------------------------
    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name):
        if isinstance(dataset, datasets.IterableDataset):
            raise NotImplementedError(
                "BDLMSFTTrainer needs a map-style datasets.Dataset: the global sample index keys the diffusion noise "
                "and the block-parallel sampler shards by index. Materialise the stream first (e.g. "
                "Dataset.from_generator)."
            )
        dataset = add_sample_ids(dataset, dataset_name)
        # TRL tokenizes, applies chat templates and builds labels; truncation and packing are done below, with
        # the length policy and block alignment.
        unlimited = copy.copy(args)
        unlimited.max_length = None
        unlimited.shuffle_dataset = False  # the sampler shuffles, by sample id, the same on every layout
        dataset = super()._prepare_dataset(dataset, processing_class, unlimited, False, formatting_func, dataset_name)
        # As TRL's tokenization above: the maps (cached next to a file-backed dataset) run on the main process first,
        # the others then read its cache files.
        with global_then_local_main_first():
            dataset, report = apply_length_policy(dataset, args.max_length, args.overlong_samples, dataset_name)
            if self._pack["train" if dataset_name == "train" else "eval"]:
                dataset = pack_block_aligned(dataset, args.max_length, self.block_size, self._pad_token_id,
                                             dataset_name)
                report["packed_rows"] = len(dataset)
        self.data_report[dataset_name] = report
        return dataset

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = ["input_ids", "labels", "attention_mask", "completion_mask", "assistant_masks",
                                       "seq_lengths", SAMPLE_ID_COLUMN]

    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        return self._sharded_dataloader(self.train_dataset, self._train_batch_size, "training", shuffle=True)

    def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
        if eval_dataset is None and self.eval_dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        elif eval_dataset is None:
            eval_dataset = self.eval_dataset
        return self._sharded_dataloader(eval_dataset, self.args.eval_batch_size, "evaluation", shuffle=False)

    def _sharded_dataloader(self, dataset, batch_size: int, description: str, shuffle: bool) -> DataLoader:
        """Every rank of a block-parallel group gets the same batches; replicas get disjoint ones.

        Not passed through ``accelerator.prepare``, which would shard by global rank.
        """
        if isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description=description)
        if not has_length(dataset):
            raise NotImplementedError("BDLMSFTTrainer needs a dataset with a length (a map-style dataset).")
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        sampler = self.plugin.batch_sampler(len(dataset), batch_size, shuffle=shuffle, seed=seed,
                                            drop_last=self.args.dataloader_drop_last)
        workers = self.args.dataloader_num_workers
        return EpochDataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=self.data_collator,
            num_workers=workers,
            pin_memory=self.args.dataloader_pin_memory and torch.cuda.is_available(),
            persistent_workers=self.args.dataloader_persistent_workers and workers > 0,
            prefetch_factor=self.args.dataloader_prefetch_factor if workers > 0 else None,
        )

    def get_total_train_batch_size(self, args) -> int:
        # Ranks of a block-parallel group share their batch: only the data-parallel replicas add samples.
        return self._train_batch_size * args.gradient_accumulation_steps * self.plugin.data_parallel_size

    # --- the loss --------------------------------------------------------------------------------
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The optimizer step's micro-batches, each corrupted here, once: the supervised-token count of the whole step
        (summed over data-parallel replicas) is every batch's loss normalizer. The corrupted batches wait in
        ``self._corrupted``, in the order the training loop hands their batches to ``compute_loss``."""
        self.plugin.begin_step(self.state.global_step + 1)
        batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        corrupted = []
        for batch in batches:
            batch.update(self._prepare_input({k: v for k, v in batch.items() if torch.is_tensor(v)}))
            corrupted.append(self._corrupt(batch, step=self.state.global_step))
        held = [c for c in corrupted if c is not None]
        local = torch.tensor(sum(c.normalizer for c in held), dtype=torch.float64, device=self.args.device)
        normalizer = self.plugin.sum_over_replicas(local).item()
        # Objectives with a second loss term normalized over the step (an encoder's next-token loss) sum it too.
        self.objective.set_step_normalizers(held, lambda value: self.plugin.sum_over_replicas(
            torch.tensor(value, dtype=torch.float64, device=self.args.device)).item())
        self._corrupted = PendingBatches(
            (batch["input_ids"], None if c is None else replace(c, normalizer=max(normalizer, 1.0)))
            for batch, c in zip(batches, corrupted))
        return batches, normalizer

    def _corrupt(self, batch, step: int):
        """The corrupted batch, or ``None`` when it supervises nothing (e.g. a replica's empty share)."""
        if not bool(supervised_mask(batch).any()):
            return None
        return self.objective.corrupt(batch, seed=self.args.seed, step=step)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """A training batch's loss, with the batch corrupted (and normalized over the whole step) by
        ``get_batch_samples``; an evaluation batch is corrupted here (step 0), normalized by its own count."""
        if self.model.training:
            loss = self._loss(model, inputs, self._corrupted.take(inputs["input_ids"]), "train")
        else:
            loss = self._loss(model, inputs, self._corrupt(inputs, step=0), "eval")
        return (loss, None) if return_outputs else loss

    def _loss(self, model, inputs, corrupted, mode: str):
        """This rank's loss of one batch: the run's step on this rank's rows (the same step on every rank, P = 1
        included), or a zero reaching every trained parameter when the batch supervises nothing here."""
        runner = self._step_runner(model)
        optional_pass = self._agreed_optional_pass(corrupted)
        if corrupted is None:
            # The step first, then the metrics: every rank runs its collectives in the same order (the step's FSDP2
            # gathers, then _record's sum), whether its share supervises anything or not.
            loss = self.step.zero(runner, inputs, optional_pass=optional_pass)
            self._record(mode, None, inputs)
            return loss
        loss, metrics = self.step(runner, corrupted, optional_pass=optional_pass)
        self._record(mode, metrics, inputs)
        if mode == "train":
            # Each rank holds the loss of its own rows of the global batch; DDP / FSDP2 average over the ranks of the
            # data world (every rank, or the D x P of one tensor-parallel rank: tensor-parallel peers share rows).
            return loss * self.plugin.data_world_size
        return self.plugin.sum_over_group(loss.detach().clone())

    def _step_runner(self, model):
        """What the step runs through: under FSDP2 with a family's own root, always that TrainingStep (its forward
        gathers the root's parameters; evaluation too), else the model the Trainer passes (DDP-wrapped, or not)."""
        return self._fsdp_step if self._fsdp_step is not None else model

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        # A family owning its step does not train through the model's forward: the forward Accelerate prepares (DDP,
        # autocast) is a TrainingStep around the model (hf_bdlm/protocols/step.py); the model itself is still what is
        # saved. Under FSDP2 that TrainingStep is the root unit, built when the model was sharded.
        if training and self._fsdp_step is not None:
            return self._fsdp_step
        unwrapped = self.accelerator.unwrap_model(model, keep_torch_compile=False)
        if training and self.training_role.owns_step and unwrapped is model:
            if not isinstance(model, TrainingStep):
                return self.accelerator.prepare_model(TrainingStep(model))
        return super()._wrap_model(model, training, dataloader)

    def _agreed_optional_pass(self, corrupted) -> bool | None:
        """Whether the step runs its objective's optional pass (e.g. a self-conditioning decoder pass), when
        every rank must agree: under FSDP2 each call of a layer gathers its unit over the whole world, so data-parallel
        replicas (each its own batch, the pass drawn per sample) run it when any of them needs it. ``None``: each batch
        decides (DDP; FSDP2 with one block-parallel group, whose ranks share the batch; no optional pass)."""
        if self._fsdp_step is None or self.plugin.data_parallel_size == 1 or not self.objective.has_optional_pass:
            return None
        local = corrupted is not None and self.objective.needs_optional_pass(corrupted)
        flag = torch.tensor([float(local)], device=self.args.device)
        return bool(self.plugin.sum_over_world(flag).item() > 0)

    def _record(self, mode: str, metrics, inputs) -> None:
        """Add this micro-batch's metric sums, summed over every rank, to the logging window."""
        device = self.args.device
        local = torch.zeros(5, dtype=torch.float64, device=device)
        if metrics is not None:
            local[0] = metrics["loss_sum"].double()
            local[1] = metrics["correct"].double()
            local[2] = metrics["count"].double()
            if "certainty_sum" in metrics:
                local[4] = metrics["certainty_sum"].double()
        # Every rank of a group holds the whole batch: count its tokens once per group.
        local[3] = inputs["attention_mask"].sum().double() / self.plugin.block_parallel_size
        self._window[mode] += self.plugin.sum_over_world(local).cpu()

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        window = self._window[mode]
        if window[2] > 0:
            self._metrics[mode]["mean_token_accuracy"] = [float(window[1] / window[2])]
            self._metrics[mode]["masked_tokens"] = [float(window[2])]
        if window[1] > 0 and getattr(self.objective, "certainty_weight", 0.0) > 0 and mode == "train":
            # The certainty term's entropy per target predicted right (nats): what it drives toward 0.
            self._metrics[mode]["certainty_entropy"] = [float(window[4] / window[1])]
        if mode == "train":
            self._tokens_seen += float(window[3])
            self._metrics[mode]["num_tokens"] = [self._tokens_seen]
        window.zero_()
        super().log(logs, start_time)

    # --- saving ----------------------------------------------------------------------------------
    def _save(self, output_dir: str | None = None, state_dict=None):
        # A config that records its training (BlockDiffusionConfig.bdlm_trained_steps: 0 when converted, so generate
        # warns) is saved with this run's steps added.
        config = getattr(self.accelerator.unwrap_model(self.model), "config", None)
        if config is not None and hasattr(config, "bdlm_trained_steps"):
            if not hasattr(self, "_bdlm_steps_before"):
                self._bdlm_steps_before = int(config.bdlm_trained_steps or 0)
            config.bdlm_trained_steps = self._bdlm_steps_before + int(self.state.global_step)
        super()._save(output_dir, state_dict)
        if self.args.should_save:
            self._write_model_card(output_dir or self.args.output_dir)

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        # TRL calls this at every checkpoint for the output folder, which holds a model only after save_model.
        if self.is_world_process_zero():
            self._write_model_card(self.args.output_dir)

    def model_card_metadata(self) -> dict[str, Any]:
        """What the model card says about this run (see ``hf_bdlm.hub.CARD_INFO_KEYS``).

        Extra entries (e.g. an exact-match score, a dataset name) can be put in ``trainer.model_card_info``.
        """
        plugin = self.plugin
        last: dict[str, float] = {}
        for entry in self.state.log_history:
            last.update({k: v for k, v in entry.items() if isinstance(v, (int, float))})
        metrics = {"loss": last.get("loss"), "masked_token_accuracy": last.get("mean_token_accuracy"),
                   "eval_loss": last.get("eval_loss")}
        info: dict[str, Any] = {
            "objective": self.objective.name,
            # Plain strings: the card's YAML header knows no enum members.
            "parallel": {"mode": str(plugin.mode), "P": plugin.block_parallel_size, "C": plugin.clean_ring_size,
                         "transport": str(plugin.transport), "world": plugin.world_size,
                         "schedule": str(plugin.schedule),
                         **({"cp_layout": str(plugin.cp_layout)} if plugin.dims.is_paper_cp else {}),
                         **({"T": plugin.tensor_parallel_size} if plugin.dims.is_tensor_parallel else {})},
            "metrics": {k: v for k, v in metrics.items() if v is not None},
            "training": {
                "steps": self.state.global_step,
                "learning_rate": self.args.learning_rate,
                "per_device_train_batch_size": self.args.per_device_train_batch_size,
                "gradient_accumulation_steps": self.args.gradient_accumulation_steps,
                "data_parallel_size": plugin.data_parallel_size,
                "max_length": self.args.max_length,
                "packing": self.args.packing,
                "peft": type(self.model.peft_config["default"]).__name__ if is_peft_model(self.model) else None,
                "seed": self.args.seed,
            },
        }
        base = self._base_model_name
        if hub_repo_id(base):
            info["base_model"] = base
        elif base:
            info["description"] = f"Fine-tuned with hf_bdlm's BDLMSFTTrainer from `{base}`."
        for key, value in self.model_card_info.items():
            if isinstance(value, dict) and isinstance(info.get(key), dict):
                info[key] = {**info[key], **value}
            else:
                info[key] = value
        return info

    def _write_model_card(self, output_dir: str) -> None:
        # The card is rendered by hf_bdlm.hub.write_model_card (the model family's template). A PEFT checkpoint holds
        # only the adapter (no config.json): the card describes full models.
        if os.path.isfile(os.path.join(output_dir, "config.json")):
            write_model_card(output_dir, self.model_card_metadata())


class EpochDataLoader(DataLoader):
    """A DataLoader whose ``set_epoch`` reaches its batch sampler (the Trainer calls it every epoch)."""

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.batch_sampler, "set_epoch"):
            self.batch_sampler.set_epoch(epoch)


# --- helpers ------------------------------------------------------------------------------------
def _as_bdlm_config(args, model) -> BDLMSFTConfig:
    if isinstance(args, BDLMSFTConfig):
        return args
    if args is None:
        # A folder's name, or an embedded model's ("embedded:smollm2" -> "smollm2").
        name = os.path.basename(os.fspath(model).rstrip("/")).removeprefix("embedded:") \
            if isinstance(model, (str, os.PathLike)) else "model"
        return BDLMSFTConfig(f"{name}-BDLM-SFT")
    if isinstance(args, TrainingArguments):
        values = args.to_dict()
        values["hub_token"] = args.hub_token  # to_dict hides it
        return BDLMSFTConfig(**values)
    raise TypeError(f"args must be a BDLMSFTConfig (or SFTConfig / TrainingArguments), got {type(args).__name__}.")


def _torch_optimizer(optimizer):
    """The ``torch.optim`` optimizer inside Accelerate's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


class PendingBatches:
    """The corrupted batches of one optimizer step, taken in the order their batches reach ``compute_loss``: each
    ``take`` checks that it is handed the batch whose corruption comes next (its ``input_ids`` tensor)."""

    def __init__(self, pairs):
        self._pairs = deque(pairs)

    def take(self, input_ids: torch.Tensor):
        if not self._pairs:
            raise RuntimeError("compute_loss was called in training mode on a batch get_batch_samples did not prepare: "
                               "train through trainer.train() (it corrupts each optimizer step's batches once, to "
                               "normalize the loss over the whole step), or call it with the model in eval mode.")
        ids, corrupted = self._pairs.popleft()
        if ids is not input_ids and not (ids.shape == input_ids.shape and torch.equal(ids, input_ids)):
            raise RuntimeError("compute_loss got the training batches in another order than get_batch_samples "
                               "prepared them; their corruption would not match.")
        return corrupted


def _emulated_link(args, model):
    """The emulated link ``args.block_parallel_link`` names (or ``None``), stretched by the rate every process of this
    launch gets now, all computing ``model``'s matmuls at once in the dtype the step computes in (a collective
    call)."""
    if args.block_parallel_link is None:
        return None
    try:
        spec = spec_from_config(model.config.to_dict(), type(model).__name__)
    except ValueError as err:
        raise ValueError(f"block_parallel_link={args.block_parallel_link!r} times this model's matmuls to stretch the "
                         f"link, and cannot read their sizes: {err} Leave block_parallel_link unset.") from err
    args.device  # sets up the launch's process group (Accelerate's state): every process then measures at once
    link = link_for_this_machine(args.block_parallel_link, spec, "bfloat16" if args.bf16 else "float32")
    rate = link.details["compute_rate"]
    logger.warning("block_parallel_link: every K/V transfer goes through the emulated link %s (this machine's rate "
                   "%.1f GFLOP/s per process, %g process(es) per core)", link.describe(), rate["flops_per_s"] / 1e9,
                   rate["processes_per_core"])
    return link
