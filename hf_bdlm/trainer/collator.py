"""Block alignment of SFT data: the length policy, block-aligned packing and the collator.

The rule (docs/design.md §2): a sequence, and with packing each packed document, is padded to
a multiple of the block size with the pad token; pad tokens are never supervised and nothing is
truncated unless the config says so (``overlong_samples="truncate"``), in which case the number
of samples and tokens cut is reported.

Input rows are what TRL's SFT preparation produces (``input_ids`` and ``labels`` with ``-100`` on
tokens outside the loss: prompt, non-assistant turns) plus the global sample id column
:data:`SAMPLE_ID_COLUMN` the trainer adds before tokenization, so the diffusion noise of a sample
depends on its place in the dataset and never on the rank that holds it. A collated batch has
``input_ids``, ``attention_mask`` (0 on pads), ``completion_mask`` (1 on supervised tokens),
``sample_ids`` and, for packed rows, ``document_ids`` (positions restart per document in the model).

    from hf_bdlm.trainer.collator import BlockAlignedCollator
    collate = BlockAlignedCollator(pad_token_id=0, block_size=4)
    collate([{"input_ids": [5, 6, 7, 8, 9], "labels": [-100, -100, 7, 8, 9], "bdlm_sample_id": 3}])
    # input_ids [[5, 6, 7, 8, 9, 0, 0, 0]], completion_mask [[0, 0, 1, 1, 1, 0, 0, 0]], sample_ids [3]
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import Any

import datasets
import torch

logger = logging.getLogger(__name__)

SAMPLE_ID_COLUMN = "bdlm_sample_id"
IGNORE_INDEX = -100


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def supervision(example: dict[str, Any]) -> list[int]:
    """Per-token 1/0: supervised or not, from ``labels`` (TRL's preparation) or the raw mask columns."""
    ids = example["input_ids"]
    if "labels" in example and example["labels"] is not None:
        return [int(label != IGNORE_INDEX) for label in example["labels"]]
    mask = [1] * len(ids)
    for key in ("completion_mask", "assistant_masks"):
        if example.get(key) is not None:
            mask = [m & int(bool(v)) for m, v in zip(mask, example[key])]
    return mask


# --- the length policy -------------------------------------------------------------------------
def apply_length_policy(dataset, max_length: int | None, policy: str, name: str = "train"):
    """Enforce ``max_length`` on a tokenized dataset and drop samples left without any supervised token.

    Args:
        dataset (`datasets.Dataset`): rows with ``input_ids`` and ``labels``.
        max_length (`int` or `None`): longest allowed sample (`None`: no limit).
        policy (`str`): ``"error"`` (raise, naming how many samples are too long and which), ``"truncate"`` (keep
            the first ``max_length`` tokens) or ``"drop"``.
        name (`str`): the dataset's name in messages.

    Returns:
        `(dataset, report)`: the dataset and a dict with ``samples``, ``overlong``, ``truncated_samples``,
        ``truncated_tokens``, ``dropped_overlong`` and ``dropped_unsupervised``.
    """
    stats = dataset.map(
        lambda batch: {
            "_len": [len(ids) for ids in batch["input_ids"]],
            "_sup": [sum(supervision({"input_ids": ids, "labels": lab}))
                     for ids, lab in zip(batch["input_ids"], batch["labels"])],
        },
        batched=True,
        remove_columns=dataset.column_names,
        desc=f"Measuring {name} samples",
    )
    lengths, supervised = stats["_len"], stats["_sup"]
    report = {"samples": len(lengths), "overlong": 0, "truncated_samples": 0, "truncated_tokens": 0,
              "dropped_overlong": 0, "dropped_unsupervised": 0}
    overlong = [i for i, n in enumerate(lengths) if max_length is not None and n > max_length]
    report["overlong"] = len(overlong)
    if overlong and policy == "error":
        longest = max(lengths[i] for i in overlong)
        raise ValueError(
            f"{len(overlong)} of {len(lengths)} samples of the {name} dataset are longer than max_length="
            f"{max_length} tokens (longest: {longest} tokens; first ones at indices {overlong[:5]}). Nothing was "
            "truncated. Raise max_length, or set overlong_samples='truncate' (keep the first max_length tokens) or "
            "overlong_samples='drop' (skip those samples); either is counted and reported."
        )
    keep = set(range(len(lengths)))
    if overlong and policy == "drop":
        keep -= set(overlong)
        report["dropped_overlong"] = len(overlong)
    if overlong and policy == "truncate":
        report["truncated_samples"] = len(overlong)
        report["truncated_tokens"] = sum(lengths[i] - max_length for i in overlong)
        dataset = dataset.map(
            lambda ex: {key: ex[key][:max_length] for key in ("input_ids", "labels")},
            desc=f"Truncating {name} samples to max_length={max_length}",
        )
        supervised = [
            s if n <= max_length else sum(supervision(dataset[i]))
            for i, (n, s) in enumerate(zip(lengths, supervised))
        ]
    unsupervised = [i for i in keep if supervised[i] == 0]
    if unsupervised:
        keep -= set(unsupervised)
        report["dropped_unsupervised"] = len(unsupervised)
    if len(keep) < len(lengths):
        dataset = dataset.select(sorted(keep))
    if not len(dataset):
        raise ValueError(
            f"the {name} dataset has no sample left to train on ({report}); check max_length and that completions "
            "or assistant turns are not empty."
        )
    changed = {k: v for k, v in report.items() if k != "samples" and k != "overlong" and v}
    if changed:
        logger.warning("%s dataset: %s (of %d samples; max_length=%s, overlong_samples=%r)", name, changed,
                       report["samples"], max_length, policy)
    return dataset, report


# --- block-aligned packing ---------------------------------------------------------------------
def pack_block_aligned(dataset, max_length: int, block_size: int, pad_token_id: int, name: str = "train"):
    """Pack whole documents into rows of at most ``max_length`` tokens, each document padded to a block multiple.

    Best-fit decreasing on the block-aligned lengths: documents are placed longest first, each into the
    open row with the least room that still fits it (a new row when none does); inside a row they keep
    placement order. A row's ``seq_lengths`` are the aligned document lengths (what the collator turns into
    ``document_ids``), ``attention_mask`` is 0 on alignment pads, and ``bdlm_sample_id`` is the packed row's
    index: packing is deterministic, so the ids (and the noise) do not depend on the parallel layout.

    Every document must fit (``apply_length_policy`` runs first); ``max_length`` must be a block multiple.
    """
    if max_length % block_size:
        raise ValueError(
            f"packed rows of max_length={max_length} cannot hold block-aligned documents of block_size={block_size}; "
            f"use a multiple of {block_size}."
        )
    columns = dataset.select_columns(["input_ids", "labels"])
    docs = columns["input_ids"]
    labels = columns["labels"]
    aligned = [round_up(len(ids), block_size) for ids in docs]
    too_long = [i for i, n in enumerate(aligned) if n > max_length]
    if too_long:
        raise ValueError(
            f"{len(too_long)} documents of the {name} dataset do not fit a packed row of max_length={max_length} "
            f"once aligned to block_size={block_size}; apply the length policy first."
        )
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # sorted (free tokens, row index)
    for i in sorted(range(len(docs)), key=lambda i: (-aligned[i], i)):
        at = bisect.bisect_left(room, (aligned[i], -1))
        if at == len(room):
            rows.append([i])
            free, row = max_length - aligned[i], len(rows) - 1
        else:
            free, row = room.pop(at)
            rows[row].append(i)
            free -= aligned[i]
        if free >= block_size:
            bisect.insort(room, (free, row))
    out = {"input_ids": [], "labels": [], "attention_mask": [], "seq_lengths": [], SAMPLE_ID_COLUMN: []}
    for row_index, members in enumerate(rows):
        ids, lab, att, lens = [], [], [], []
        for i in members:
            pad = aligned[i] - len(docs[i])
            ids += list(docs[i]) + [pad_token_id] * pad
            lab += list(labels[i]) + [IGNORE_INDEX] * pad
            att += [1] * len(docs[i]) + [0] * pad
            lens.append(aligned[i])
        out["input_ids"].append(ids)
        out["labels"].append(lab)
        out["attention_mask"].append(att)
        out["seq_lengths"].append(lens)
        out[SAMPLE_ID_COLUMN].append(row_index)
    packed = datasets.Dataset.from_dict(out)
    used = sum(aligned)
    logger.info("%s dataset: packed %d documents into %d rows of %d tokens (%.1f%% filled, block-aligned)", name,
                len(docs), len(rows), max_length, 100.0 * used / max(1, len(rows) * max_length))
    return packed


# --- the collator ------------------------------------------------------------------------------
@dataclass
class BlockAlignedCollator:
    r"""
    Collate SFT rows into a block-aligned diffusion batch.

    Args:
        pad_token_id (`int`):
            Token written into padding (never supervised, `attention_mask` 0).
        block_size (`int`):
            Diffusion block size; each sequence is right-padded to a multiple of it.
        pad_to_multiple_of (`int`, *optional*):
            Pad the batch length to a multiple of this instead (a multiple of `block_size`): block-parallel layouts
            need `P * B` or `2 * P * B` (see `hf_bdlm.parallel.dims.ParallelDims.required_multiple`).

    An empty list of rows (a data-parallel replica whose share of the last global batch is empty) gives a batch of
    one all-pad row with `sample_ids = -1` and nothing supervised: the trainer runs it for a zero contribution, so
    every rank keeps taking part in the same collectives.
    """

    pad_token_id: int
    block_size: int
    pad_to_multiple_of: int | None = None
    return_tensors: str = "pt"

    def __post_init__(self):
        multiple = self.pad_to_multiple_of or self.block_size
        if multiple % self.block_size:
            raise ValueError(
                f"pad_to_multiple_of={multiple} must be a multiple of block_size={self.block_size}."
            )
        self.multiple = multiple

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if not examples:
            return self.empty_batch()
        for i, ex in enumerate(examples):
            if SAMPLE_ID_COLUMN not in ex:
                raise KeyError(
                    f"row {i} of the batch has no {SAMPLE_ID_COLUMN!r} (keys: {sorted(ex)}); the trainer adds this "
                    "global sample index before tokenization so the noise does not depend on the layout."
                )
        length = round_up(max(len(ex["input_ids"]) for ex in examples), self.multiple)
        b = len(examples)
        input_ids = torch.full((b, length), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((b, length), dtype=torch.long)
        completion = torch.zeros((b, length), dtype=torch.long)
        packed = any("seq_lengths" in ex and ex["seq_lengths"] is not None for ex in examples)
        documents = torch.zeros((b, length), dtype=torch.long) if packed else None
        for i, ex in enumerate(examples):
            ids = ex["input_ids"]
            n = len(ids)
            input_ids[i, :n] = torch.as_tensor(ids, dtype=torch.long)
            attention[i, :n] = torch.as_tensor(ex["attention_mask"]) if ex.get("attention_mask") is not None else 1
            completion[i, :n] = torch.as_tensor(supervision(ex), dtype=torch.long)
            if documents is not None:
                lens = ex.get("seq_lengths") or [round_up(n, self.block_size)]
                if any(m % self.block_size for m in lens) or sum(lens) < n:
                    raise ValueError(
                        f"row {i}: packed document lengths {lens} are not block-aligned (block_size={self.block_size})"
                        f" or do not cover its {n} tokens; pack with hf_bdlm.trainer.collator.pack_block_aligned."
                    )
                starts = torch.tensor([0] + lens[:-1]).cumsum(0)
                for d, (s, m) in enumerate(zip(starts.tolist(), lens)):
                    documents[i, s : s + m] = d
                # The padding after the last document is a document of its own (it attends to nothing real).
                documents[i, sum(lens) :] = len(lens)
        completion &= attention
        sample_ids = torch.tensor([int(ex[SAMPLE_ID_COLUMN]) for ex in examples], dtype=torch.long)
        batch = {"input_ids": input_ids, "attention_mask": attention, "completion_mask": completion,
                 "sample_ids": sample_ids}
        if documents is not None:
            batch["document_ids"] = documents
        return batch

    def empty_batch(self) -> dict[str, torch.Tensor]:
        """One all-pad row, nothing supervised, ``sample_ids = -1``."""
        zeros = torch.zeros((1, self.multiple), dtype=torch.long)
        return {"input_ids": torch.full_like(zeros, self.pad_token_id), "attention_mask": zeros,
                "completion_mask": zeros.clone(), "sample_ids": torch.tensor([-1])}
