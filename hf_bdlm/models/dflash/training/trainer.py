"""`DFlashTrainer`: train a DFlash / DFlash2 drafter on a frozen target's captured features, with `BDLMSFTTrainer`'s
machinery (TRL's loop, Accelerate launches, DDP, block parallelism, logging, checkpoints and resume, model card).

What differs from SFT, each in one place:

- **data**: a capture folder (:class:`~.capture.FeatureStore`) is the dataset, one sequence per record; the
  collator (:class:`DFlashFeatureCollator`) reads each record's tokens and, with ``P = 1``, its features; under block
  parallelism it defers them (:class:`~.objectives.DeferredFeatures`) and the step reads only the rows its plan has
  this rank project, once the step's anchors are drawn (a compacted context's rows depend on them);
- **anchors** (:class:`~.objectives.DFlashTrainingObjective`): the draft blocks of sequence ``s`` at step ``t`` are
  drawn by the `DFlashObjective` from ``(seed, s, t)``, whatever the layout, accumulation or resume;
- **step**: the drafter's forward over the rank's anchors and context rows (:func:`draft_layout`; ``P > 1``: the
  sharded forward of :mod:`.sharded`) and the objective's loss of that share, scaled so that the ranks' losses add
  up to the loss of the whole optimizer step: ``"ce"`` / ``"kl"`` the mean over every sequence of the step,
  ``"dpace"`` the D-PACE-normalised loss of each micro-batch (its weight totals summed over every rank holding a
  distinct share), averaged over the step's micro-batches;
- **evaluation**: besides the loss at the objective's anchors, the acceptance `hf-bdlm serve --draft` would count on
  the eval records (:meth:`DFlashTrainer.served_acceptance`, ``eval_acceptance_length``): greedy speculative decoding
  replayed from each record's prompt over its answer, with the server's anchors, proposals and counting
  (:mod:`.acceptance`);
- **saving**: the drafter's folder (its own tensors only: ``DFlash2DraftModel.from_pretrained`` loads it, ``hf-bdlm
  dflash export`` and vLLM / SGLang take it, with its ``training_export.json`` and card), and the objective's state
  in each checkpoint (``dflash_objective.json``), restored on resume.

Tiny CPU example (features captured first with `capture_features` or `hf-bdlm dflash capture`)::

    from hf_bdlm.models.dflash.modeling import DFlash2DraftModel
    from hf_bdlm.models.dflash.training.trainer import DFlashTrainer
    from hf_bdlm.models.dflash.training.config import DFlashTrainingConfig
    drafter = DFlash2DraftModel.from_target(target, init="scratch", num_hidden_layers=1, block_size=4)
    args = DFlashTrainingConfig("out", features_dir="feats", max_anchors=16, max_steps=20, report_to="none")
    DFlashTrainer(drafter, args, target=target, processing_class=tokenizer).train()

or the recipe: ``accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml recipes/dflash.py --config
recipes/configs/dflash_smollm2_cpu.yaml``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import torch
from safetensors import safe_open
from transformers import AutoTokenizer, TrainingArguments

from ....checkpoints.files import file_sha256
from ....hub.exports import serving_model_id
from ....protocols.decoding import AcceptanceCounts
from ....protocols.step import unwrap_model
from ....trainer.collator import SAMPLE_ID_COLUMN, round_up
from ....trainer.trainer import BDLMSFTTrainer
from ....version import __version__
from ..configuration import DFlashConfig
from ..inference.export import PROVENANCE, PROVENANCE_FORMAT, WEIGHTS
from .acceptance import replay_acceptance, served_requests
from .capture import FeatureStore
from ..inference.speculative import speculative_token_count
from ..target import TargetHeads, decoder_of, drafter_class, load_target_heads, resolve_target_path
from .objectives import DeferredFeatures, DFlashBatch, DFlashTrainingBatch
from .config import DFlashTrainingConfig
from .sharded import DFlashShardPlan, sharded_draft_forward

logger = logging.getLogger(__name__)

OBJECTIVE_STATE_FILE = "dflash_objective.json"
RECORD_COLUMN, STORE_COLUMN = "dflash_record", "dflash_store"


# --- the data ---------------------------------------------------------------------------------------------------------
def feature_dataset(store: FeatureStore, *, store_index: int = 0, max_length: int | None = None,
                    overlong_samples: str = "error", name: str = "train") -> tuple[datasets.Dataset, dict]:
    """The records of a capture as a map-style dataset for the trainer, with the trainer's length policy.

    Args:
        store ([`FeatureStore`]): the capture.
        store_index (`int`, defaults to 0): which of the collator's stores the rows name.
        max_length (`int`, *optional*): longest sequence (`None`: no limit).
        overlong_samples (`str`, defaults to `"error"`): `"error"`, `"truncate"` (keep the first ``max_length``
            tokens and feature rows: a causal target's features of a prefix do not depend on what follows) or
            `"drop"`.
        name (`str`): the dataset's name in messages.

    Returns:
        `(dataset, report)`: rows with ``input_ids``, ``completion_mask`` (the capture's loss mask), the record
        index, the store index and the global sample id (the record index); the report counts what the policy did
        (the keys of the SFT trainer's `data_report`).
    """
    lengths = store.lengths
    overlong = [i for i, n in enumerate(lengths) if max_length is not None and n > max_length]
    if overlong and overlong_samples == "error":
        raise ValueError(
            f"{len(overlong)} of {len(lengths)} records of the {name} features ({store.root}) are longer than "
            f"max_length={max_length} tokens (longest {max(lengths[i] for i in overlong)}; first at indices "
            f"{overlong[:5]}). Raise max_length, or set overlong_samples='truncate' or 'drop'."
        )
    report = {"samples": len(lengths), "overlong": len(overlong), "truncated_samples": 0, "truncated_tokens": 0,
              "dropped_overlong": 0, "dropped_unsupervised": 0}
    rows: dict[str, list] = {"input_ids": [], "completion_mask": [], RECORD_COLUMN: [], STORE_COLUMN: [],
                             SAMPLE_ID_COLUMN: []}
    too_long = set(overlong)
    for index in range(len(store)):
        if index in too_long and overlong_samples == "drop":
            report["dropped_overlong"] += 1
            continue
        ids, mask = store.record(index)
        if index in too_long:
            report["truncated_samples"] += 1
            report["truncated_tokens"] += len(ids) - max_length
            ids, mask = ids[:max_length], mask[:max_length]
        if not bool(mask.any()):
            report["dropped_unsupervised"] += 1
            continue
        rows["input_ids"].append(ids.tolist())
        rows["completion_mask"].append(mask.int().tolist())
        rows[RECORD_COLUMN].append(index)
        rows[STORE_COLUMN].append(store_index)
        rows[SAMPLE_ID_COLUMN].append(index)
    if not rows["input_ids"]:
        raise ValueError(f"the {name} features ({store.root}) hold no record to train on ({report}).")
    changed = {k: v for k, v in report.items() if k not in ("samples", "overlong") and v}
    if changed:
        logger.warning("%s features: %s (of %d records; max_length=%s, overlong_samples=%r)", name, changed,
                       len(lengths), max_length, overlong_samples)
    return datasets.Dataset.from_dict(rows), report


@dataclass
class DFlashFeatureCollator:
    r"""
    Collate capture records into a drafter batch: tokens, loss mask and the target features of this rank's context
    rows.

    Args:
        stores (`Sequence[FeatureStore]`): the captures the rows name (``dflash_store`` column).
        pad_token_id (`int`): fills sequences up to the batch length (never supervised, never attended).
        pad_to_multiple_of (`int`, defaults to 1): the batch length's multiple (the layout's).
        teacher (`bool`, defaults to `False`): also read the teacher states (whole records: labels anywhere).
        defer_features (`bool`, defaults to `False`): read no features; name each row's record instead
            (``feature_records``), for the step to read the rows its block-parallel plan gives this rank
            (:class:`~.objectives.DeferredFeatures`).

    A batch holds ``input_ids``, ``attention_mask``, ``completion_mask``, ``sample_ids`` (``[b, L]`` / ``[b]``),
    ``features`` ``[b, L, feature_width]`` (zero past a record's end) or, deferred, ``feature_records`` ``[b, 2]``
    (store and record of each row, ``-1`` for none), and, with ``teacher``, ``teacher`` ``[b, L, hidden]``. No rows
    (a data-parallel replica's empty share): one unsupervised row with ``sample_ids = -1``.
    """

    stores: Sequence[FeatureStore]
    pad_token_id: int
    pad_to_multiple_of: int = 1
    teacher: bool = False
    defer_features: bool = False

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        multiple = max(1, int(self.pad_to_multiple_of))
        length = round_up(max((len(ex["input_ids"]) for ex in examples), default=1), multiple)
        b = max(1, len(examples))
        store0 = self.stores[0]
        dtype = getattr(torch, store0.manifest["dtype"])
        batch = {
            "input_ids": torch.full((b, length), self.pad_token_id, dtype=torch.long),
            "attention_mask": torch.zeros(b, length, dtype=torch.long),
            "completion_mask": torch.zeros(b, length, dtype=torch.long),
            "sample_ids": torch.full((b,), -1, dtype=torch.long),
        }
        if self.defer_features:
            batch["feature_records"] = torch.full((b, 2), -1, dtype=torch.long)
        else:
            batch["features"] = torch.zeros(b, length, store0.feature_width, dtype=dtype)
        if self.teacher:
            batch["teacher"] = torch.zeros(b, length, store0.hidden_size, dtype=dtype)
        for i, ex in enumerate(examples):
            store, record, n = self.stores[int(ex[STORE_COLUMN])], int(ex[RECORD_COLUMN]), len(ex["input_ids"])
            batch["input_ids"][i, :n] = torch.as_tensor(ex["input_ids"])
            batch["attention_mask"][i, :n] = 1
            batch["completion_mask"][i, :n] = torch.as_tensor(ex["completion_mask"])
            batch["sample_ids"][i] = int(ex[SAMPLE_ID_COLUMN])
            if self.defer_features:
                batch["feature_records"][i] = torch.tensor([int(ex[STORE_COLUMN]), record])
            else:
                batch["features"][i, :n] = store.features(record, 0, n)
            if self.teacher:
                batch["teacher"][i, :n] = store.teacher(record, 0, n)
        return batch


# --- what this rank drafts --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LocalDraftLayout:
    """``P = 1``: this rank drafts every anchor of its batch over every context row.

    Attributes:
        global_sum (`Callable`, *optional*): `"dpace"`: sums the D-PACE totals over the data-parallel replicas (each
            holds other sequences of the step's global batch), so that they normalise like one process's batch.
        loss_scale (`float`): this rank's share of its batch's loss (1: nothing is replicated).
    """

    global_sum: Callable[[torch.Tensor], torch.Tensor] | None = None
    loss_scale: float = 1.0

    def draft(self, drafter, corrupted: "DFlashTrainingBatch") -> tuple[DFlashBatch, torch.Tensor]:
        """``(anchors drafted here, the drafter's final hidden states of their blocks)``."""
        share = corrupted.anchors
        features = corrupted.features
        if isinstance(features, DeferredFeatures):
            features = features.rows([(0, corrupted.input_ids.shape[1])])
        hidden = drafter(features, corrupted.input_ids, anchor_positions=share.anchor_positions,
                         anchor_valid=share.anchor_valid, return_logits=False).hidden_states
        return share, hidden


@dataclass(frozen=True)
class ShardedDraftLayout:
    """``P > 1``: this rank's context rows and anchors under the batch's :class:`~.sharded.DFlashShardPlan`, and the
    sharded forward (:func:`~.sharded.sharded_draft_forward`) that exchanges the context K/V with its group.

    Attributes:
        plan (`DFlashShardPlan`), comm (`CommContext`): the group's plan of the batch and its communicator.
        global_sum (`Callable`, *optional*): `"dpace"`: the D-PACE totals summed over every rank holding a distinct
            share (the world; ``cp``'s replicated shares counted once).
        loss_scale (`float`): the plan's (``cp``: ``1 / P``, every rank drafting every anchor).
    """

    plan: Any
    comm: Any
    global_sum: Callable[[torch.Tensor], torch.Tensor] | None
    loss_scale: float

    def draft(self, drafter, corrupted: "DFlashTrainingBatch") -> tuple[DFlashBatch, torch.Tensor]:
        features = corrupted.features
        if isinstance(features, DeferredFeatures):  # read only the rows the plan has this rank project
            features = features.rows(self.plan.projected_runs)
        elif features.shape[1] == self.plan.sequence_length:  # every row collated: keep this rank's
            features = features[:, self.plan.projected_rows.to(features.device)]
        share = self.plan.select(corrupted.anchors)
        out = sharded_draft_forward(drafter, features, corrupted.input_ids, share, self.plan, self.comm)
        return share, out.hidden_states


def _world_sum(plugin, scale: float) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A detached sum over every rank of the world, times ``scale`` (``None`` in a single process)."""
    if plugin.world_size == 1:
        return None

    def total(value: torch.Tensor) -> torch.Tensor:
        return plugin.sum_over_world(value).mul_(scale)

    return total


def draft_layout(plugin, drafter, corrupted: "DFlashTrainingBatch"):
    """The context rows and anchors this rank runs for one batch: the whole batch with ``P = 1``
    (:class:`LocalDraftLayout`), else its share under the block-parallel plan (:class:`ShardedDraftLayout`)."""
    if not plugin.is_active:
        return LocalDraftLayout(global_sum=_world_sum(plugin, 1.0))
    drafter = unwrap_model(drafter)
    groups = plugin.sharding_groups()
    windows = [drafter.config.layer_window(i) for i in range(drafter.config.num_hidden_layers)]
    plan = DFlashShardPlan.build(corrupted.anchors, mode=str(plugin.mode), world=plugin.block_parallel_size,
                                 rank=plugin.group_rank, layer_windows=windows)
    return ShardedDraftLayout(plan, groups.group, _world_sum(plugin, plan.loss_scale), plan.loss_scale)


# --- the trainer ------------------------------------------------------------------------------------------------------
class DFlashTrainer(BDLMSFTTrainer):
    r"""
    Train a DFlash / DFlash2 speculative drafter on captured target features (see the module docstring).

    Args:
        model (`str`, `os.PathLike` or [`DFlashDraftModel`]):
            The drafter: an object (bound to its target or not) or a saved drafter folder (`hf-bdlm dflash init`,
            a checkpoint of this trainer).
        args ([`DFlashTrainingConfig`], *optional*):
            The configuration; a `BDLMSFTConfig` / `TrainingArguments` is converted.
        train_dataset ([`FeatureStore`], `str` or `os.PathLike`, *optional*):
            The captured features (a store or its folder); defaults to `args.features_dir`.
        eval_dataset ([`FeatureStore`], `str` or `os.PathLike`, *optional*):
            Held-out captured features; defaults to `args.eval_features_dir`. Evaluation logs the loss and, with
            `args.eval_acceptance`, the served acceptance on them (:meth:`served_acceptance`).
        processing_class ([`~transformers.PreTrainedTokenizerBase`], *optional*):
            The target's tokenizer (saved beside the drafter); defaults to the target folder's.
        target ([`~transformers.PreTrainedModel`] or `str`, *optional*):
            The target: a loaded causal LM (the drafter is bound to it), or its folder / Hub id, whose embedding and
            head alone are read (:func:`~.target.load_target_heads`). Defaults to `args.target_model`; not needed
            for a drafter already bound (then pass `processing_class`).
        callbacks, optimizers, optimizer_cls_and_kwargs, block_parallel_plugin:
            As in [`BDLMSFTTrainer`].
    """

    _tag_names = ["trl", "hf_bdlm", "dflash", "speculative-decoding"]
    _name = "DFlash"

    def __init__(
        self,
        model,
        args: DFlashTrainingConfig | TrainingArguments | None = None,
        train_dataset: FeatureStore | str | os.PathLike | None = None,
        eval_dataset: FeatureStore | str | os.PathLike | None = None,
        processing_class=None,
        target=None,
        callbacks=None,
        optimizers=(None, None),
        optimizer_cls_and_kwargs=None,
        block_parallel_plugin=None,
    ):
        args = _as_dflash_config(args)
        source = train_dataset if train_dataset is not None else args.features_dir
        if source is None:
            raise ValueError("no training features: pass train_dataset (a FeatureStore or a capture folder) or set "
                             "features_dir (capture them with `hf-bdlm dflash capture` or capture_features).")
        if eval_dataset is None:
            eval_dataset = args.eval_features_dir
        stores = [_as_store(source, "train")] + ([_as_store(eval_dataset, "eval")] if eval_dataset is not None else [])
        drafter, heads, target_name = _bound_drafter(model, target, args)
        speculative_token_count(args.eval_num_speculative_tokens, int(drafter.config.block_size))  # before any work
        if processing_class is None:
            processing_class = _target_tokenizer(target_name, args.target_revision)
        for store in stores:
            # Every record's size always (a copy cut short); its sha256 too with verify_features="sha256".
            store.verify(sha256=args.verify_features == "sha256")
            _check_features(store, drafter, heads, target_name)
            if args.dflash_loss == "kl" and not store.has_teacher:
                raise ValueError(f"dflash_loss='kl' needs the target's teacher states, which the features in "
                                 f"{store.root} lack: capture with teacher=True (`hf-bdlm dflash capture --teacher`).")
        self.target_name = target_name
        self._feature_reports = {}
        sets = []
        for index, (store, name) in enumerate(zip(stores, ("train", "eval"))):
            dataset, self._feature_reports[name] = feature_dataset(
                store, store_index=index, max_length=args.max_length, overlong_samples=args.overlong_samples, name=name)
            sets.append(dataset)
        tokenizer = getattr(processing_class, "tokenizer", processing_class)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        kl = args.dflash_loss == "kl"
        collator = DFlashFeatureCollator(stores, pad, teacher=kl)
        super().__init__(drafter, args=args, data_collator=collator, train_dataset=sets[0],
                         eval_dataset=sets[1] if len(sets) > 1 else None, processing_class=processing_class,
                         callbacks=callbacks, optimizers=optimizers, optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
                         block_parallel_plugin=block_parallel_plugin)
        collator.pad_token_id = self._pad_token_id
        # cp / csbp cut the context into P shards (equal ones unless compacted): sequences padded to a multiple of P.
        collator.pad_to_multiple_of = self.plugin.block_parallel_size
        # Under block parallelism a rank reads only the feature rows of its step's plan (DeferredFeatures).
        collator.defer_features = self.plugin.is_active
        self.objective.feature_stores = stores
        self.feature_stores = stores
        self.target_heads = heads.to(self.args.device) if heads is not None else None
        if kl:
            self.objective.teacher_head = _teacher_head(heads, target)
        self.model_card_info["dataset"] = stores[0].manifest.get("dataset") or str(stores[0].root)
        self.model_card_info["target"] = target_name

    # --- data ------------------------------------------------------------------------------------------------------
    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name):
        # The rows come tokenised and length-checked from the capture (feature_dataset).
        self.data_report[dataset_name] = self._feature_reports.get(dataset_name, {})
        return dataset

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = ["input_ids", "completion_mask", RECORD_COLUMN, STORE_COLUMN, SAMPLE_ID_COLUMN]

    # --- anchors ---------------------------------------------------------------------------------------------------
    def _corrupt(self, batch, step: int):
        # Never None: a batch without a supervised token still runs the step (an invalid anchor, a zero loss), so
        # every rank takes part in the same collectives.
        total = self.state.max_steps if self.model.training else None
        return self.objective.corrupt(batch, seed=self.objective.seed, step=step, total_steps=total)

    # --- evaluation ------------------------------------------------------------------------------------------------
    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix: str = "eval"):
        """The eval batches' loss (at the objective's anchors), then with ``eval_acceptance`` the served acceptance
        on the same records (:meth:`served_acceptance`): ``{prefix}_acceptance_length`` and
        ``{prefix}_verification_steps``, logged with the loss (``trainer_state.json``, the drafter's card)."""
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        if self.args.eval_acceptance:
            counts = self.served_acceptance(dataloader.dataset)
            output.metrics[f"{metric_key_prefix}_acceptance_length"] = counts.acceptance_length
            output.metrics[f"{metric_key_prefix}_verification_steps"] = counts.verification_steps
        return output

    @torch.no_grad()
    def served_acceptance(self, dataset: datasets.Dataset | None = None) -> AcceptanceCounts:
        """The acceptance ``hf-bdlm serve --draft`` would count on the records of ``dataset`` (default: the eval
        set), each request being a record's prompt and its answer as the target's greedy completion
        (:func:`~.acceptance.served_requests`, :func:`~.acceptance.replay_acceptance`), verifying
        ``args.eval_num_speculative_tokens`` proposals per step.

        Every process replays its share of the records (every ``world``-th), ``per_device_eval_batch_size``
        requests per drafter forward, and the counts are summed over the world (a collective: every process calls
        it). It equals the server's count where the records are the target's own greedy answers (self-distilled).
        """
        dataset = self.eval_dataset if dataset is None else dataset
        if dataset is None:
            raise ValueError("served_acceptance needs eval records: pass eval_dataset or set eval_features_dir.")
        drafter = unwrap_model(self.model)
        world, rank = self.plugin.world_size, self.args.process_index
        requests = []  # (store, record, input ids, start, stop): features are read batch by batch
        for row in range(rank, len(dataset), world):
            example = dataset[row]
            ids = torch.as_tensor(example["input_ids"])
            store = self.feature_stores[int(example[STORE_COLUMN])]
            for start, stop in served_requests(ids, torch.as_tensor(example["completion_mask"])):
                requests.append((store, int(example[RECORD_COLUMN]), ids, start, stop))
        counts = AcceptanceCounts()
        size = max(1, int(self.args.per_device_eval_batch_size))
        training = drafter.training
        drafter.eval()
        try:
            for first in range(0, len(requests), size):
                batch = [(ids, store.features(record, 0, stop - 1), start, stop)
                         for store, record, ids, start, stop in requests[first:first + size]]
                for part in replay_acceptance(drafter, batch, self.args.eval_num_speculative_tokens):
                    counts.merge(part)
        finally:
            drafter.train(training)
        total = self.plugin.sum_over_world(torch.tensor([counts.verification_steps, counts.accepted_tokens],
                                                        dtype=torch.long, device=self.args.device))
        return AcceptanceCounts(int(total[0]), int(total[1]))

    # --- checkpoints -----------------------------------------------------------------------------------------------
    def _save_extra_state(self, checkpoint_dir: str) -> None:
        # Inside the checkpoint's atomic save (hf_bdlm/checkpoints/atomic.py): committed with the rest, or not at all.
        if self.args.should_save:
            folder = Path(checkpoint_dir)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / OBJECTIVE_STATE_FILE).write_text(json.dumps(self.objective.state_dict(), indent=1))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        path = Path(resume_from_checkpoint) / OBJECTIVE_STATE_FILE
        if path.is_file():
            self.objective.load_state_dict(json.loads(path.read_text()))
        else:
            logger.warning("%s holds no %s: the anchors are redrawn from this run's seed %d.", resume_from_checkpoint,
                           OBJECTIVE_STATE_FILE, self.objective.seed)

    # --- saving ----------------------------------------------------------------------------------------------------
    def _write_model_card(self, output_dir: str) -> None:
        """``training_export.json`` (the provenance a served drafter carries) and ``README.md`` of a saved drafter."""
        root = Path(output_dir)
        if not (root / "config.json").is_file() or not (root / WEIGHTS).is_file():
            return
        with safe_open(str(root / WEIGHTS), framework="pt") as f:
            tensor_count = len(list(f.keys()))
        info = self.model_card_metadata()
        last = info.get("metrics", {})
        evaluated = next((h for h in reversed(self.state.log_history) if "eval_acceptance_length" in h), {})
        training = {"dataset": info.get("dataset"), "steps": self.state.global_step, "loss": last.get("loss"),
                    "objective": f"dflash ({self.objective.config.loss})",
                    "learning_rate": self.args.learning_rate,
                    "features": f"layers {list(self.feature_stores[0].layer_ids)} of {self.target_name}",
                    "eval_acceptance_length": (round(evaluated["eval_acceptance_length"], 3) if evaluated else None),
                    "eval_verification_steps": evaluated.get("eval_verification_steps"),
                    **{k: v for k, v in self.model_card_info.get("results", {}).items()}}
        config = json.loads((root / "config.json").read_text())
        provenance = {
            "format": PROVENANCE_FORMAT, "exported_by": f"hf_bdlm {__version__} (DFlashTrainer)",
            "model_id": serving_model_id(self.target_name or ""),
            "model_revision": self.args.target_revision, "architecture": config["architectures"][0],
            "block_size": config["dflash_config"]["block_size"],
            "weights": {"path": WEIGHTS, "bytes": (root / WEIGHTS).stat().st_size,
                        "sha256": file_sha256(root / WEIGHTS), "tensor_count": tensor_count},
            "training": {k: v for k, v in training.items() if v is not None},
            "parallel": info.get("parallel"),
        }
        (root / PROVENANCE).write_text(json.dumps(provenance, indent=2, sort_keys=True, default=str) + "\n")
        card = self.family.render_card(root, config, {"model_name": root.resolve().name})
        (root / "README.md").write_text(card, encoding="utf-8")


# --- helpers ----------------------------------------------------------------------------------------------------------
def _as_dflash_config(args) -> DFlashTrainingConfig:
    if isinstance(args, DFlashTrainingConfig):
        return args
    if args is None:
        return DFlashTrainingConfig("dflash-drafter", report_to="none")
    if isinstance(args, TrainingArguments):
        values = args.to_dict()
        values["hub_token"] = args.hub_token
        values.pop("parallel_dims", None)
        if values.get("objective") is None:
            values["objective"] = "dflash"
        return DFlashTrainingConfig(**{k: v for k, v in values.items()
                                       if k in {f.name for f in dataclasses.fields(DFlashTrainingConfig)}})
    raise TypeError(f"args must be a DFlashTrainingConfig (or TrainingArguments), got {type(args).__name__}.")


def _as_store(value, name: str) -> FeatureStore:
    if isinstance(value, FeatureStore):
        return value
    if isinstance(value, (str, os.PathLike)):
        return FeatureStore(value)
    raise TypeError(f"the {name} data of a DFlash drafter is captured target features: a FeatureStore or its folder, "
                    f"got {type(value).__name__}. Capture them with `hf-bdlm dflash capture` or capture_features.")


def _bound_drafter(model, target, args: DFlashTrainingConfig):
    """``(drafter, target heads or None, target name)``: the drafter bound to its target."""
    if isinstance(model, (str, os.PathLike)):
        dtype = (args.model_init_kwargs or {}).get("dtype")
        kwargs = {"dtype": getattr(torch, dtype) if isinstance(dtype, str) else dtype} if dtype else {}
        model = drafter_class(DFlashConfig.from_pretrained(model)).from_pretrained(model, **kwargs)
    if not hasattr(model, "bind_target"):
        raise TypeError(f"model must be a DFlash drafter (DFlash2DraftModel / DFlashDraftModel) or its folder, got "
                        f"{type(model).__name__}.")
    name = os.fspath(target) if isinstance(target, (str, os.PathLike)) else args.target_model
    heads = None
    if target is not None and not isinstance(target, (str, os.PathLike)):
        model.bind_target(target)
        name = getattr(target.config, "_name_or_path", None) or args.target_model
    elif name is not None:
        heads = load_target_heads(name, revision=args.target_revision, dtype=model.fc.weight.dtype,
                                  with_norm=args.dflash_loss == "kl")
        model.bind_target(heads)
    elif model.embed_tokens is None:
        raise ValueError("the drafter has no target bound: pass target= (the target model or its folder / Hub id), "
                         "set target_model, or pass a drafter bound with bind_target(target).")
    return model, heads, name


def _target_tokenizer(name: str | None, revision: str | None):
    if name is None:
        raise ValueError("no processing_class given and no target to read a tokenizer from: pass processing_class "
                         "(the target's tokenizer) or target / target_model.")
    path = resolve_target_path(name)
    try:
        return AutoTokenizer.from_pretrained(path, revision=revision)
    except (OSError, ValueError) as err:
        raise ValueError(f"could not read the target's tokenizer from {name!r} ({err}); pass "
                         "processing_class.") from None


def _check_features(store: FeatureStore, drafter, heads: TargetHeads | None, target_name: str | None) -> None:
    """Features that do not fit the drafter (layer ids, width) or were captured from another target raise."""
    store.check_drafter(drafter.config)
    captured = store.manifest.get("target") or {}
    built_for = getattr(drafter.config, "num_target_layers", None)
    depth = captured.get("num_hidden_layers")
    if built_for is not None and depth is not None and int(built_for) != int(depth):
        raise ValueError(f"the features in {store.root} were captured from a target of {depth} layers "
                         f"({captured.get('id')!r}); the drafter drafts for a target of {built_for}. Capture the "
                         "drafter's own target.")
    if heads is not None:
        text = heads.config
        if depth is not None and int(text.num_hidden_layers) != int(depth) or (
                captured.get("model_type") not in (None, getattr(text, "model_type", None))):
            raise ValueError(f"the features in {store.root} were captured from {captured.get('id')!r} "
                             f"({captured.get('model_type')}, {depth} layers), not from the target {target_name!r} "
                             f"({getattr(text, 'model_type', None)}, {text.num_hidden_layers} layers).")
    if target_name and captured.get("id") and captured["id"] != target_name:
        logger.warning("the features in %s name the target %r, the trainer's is %r: make sure they are the same model.",
                       store.root, captured["id"], target_name)


def _teacher_head(heads: TargetHeads | None, target) -> Callable[[torch.Tensor], torch.Tensor]:
    if heads is not None and heads.norm is not None:
        return heads.teacher_logits
    norm = getattr(decoder_of(target)[0], "norm", None) if target is not None else None
    if norm is None:
        raise ValueError("dflash_loss='kl' needs the target's final norm: pass target= or set target_model.")
    head = target.get_output_embeddings()
    return lambda states: head(norm(states.to(head.weight.dtype)))


__all__ = ["DFlashFeatureCollator", "DFlashTrainer", "LocalDraftLayout", "ShardedDraftLayout", "draft_layout",
           "feature_dataset"]
