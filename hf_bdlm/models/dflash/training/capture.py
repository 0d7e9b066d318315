"""Target feature capture for DFlash drafters: run the frozen target once over a tokenised dataset and store, per
record, its hidden states at the drafter's layers, so that training never runs the target again.

A capture folder holds one safetensors file per record (``records/00000012.safetensors``: ``input_ids`` int32,
``loss_mask`` bool, ``features`` ``[T, len(layer_ids) * hidden]`` in the target's dtype and, with ``teacher=True``,
``teacher`` ``[T, hidden]``) and a ``manifest.json`` (format version, target id / revision / config hash, layer ids,
dtype, widths, and per record its length, file name and sha256). safetensors reads a tensor's rows lazily from a
memory map, so a rank training on a context shard reads only its own token range (:meth:`FeatureStore.features`).

    from hf_bdlm.models.dflash.training.capture import capture_features, tokenize_records, FeatureStore
    records = tokenize_records(load_arith("train").select(range(8)), tokenizer, max_length=256)
    capture_features(target, records, layer_ids=(1, 3), out_dir="feats", batch_size=4, target_id="org/target")
    store = FeatureStore("feats")
    input_ids, loss_mask = store.record(0)
    shard = store.features(0, 128, 256)              # rows 128..255 of record 0, read from disk alone

or from the command line: ``hf-bdlm dflash capture --target embedded:smollm2 --dataset hf_bdlm:arith --out feats``.

Layer ids are canonical: ``i`` is ``hidden_states[i]`` of transformers' ``output_hidden_states`` (0: the embedding
output, ``i``: the output of decoder layer ``i - 1``; the tuple's last entry is the final norm's output). The teacher
state (for a KL objective against the target's distribution) is the last decoder layer's output *before* the final
norm: the objective applies the target's frozen final norm and head to it.

A capture is resumable: each record is written under a temporary name and renamed, then logged with its sha256 in
``progress.jsonl``; a rerun (``resume=True``) skips the logged records whose file still has that sha256 and whose
tokens are unchanged, and redoes every other one (missing, half-written, corrupted).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoTokenizer
from trl import SFTTrainer
from trl.chat_template_utils import get_training_chat_template, has_generation_markers
from trl.data_utils import is_conversational

from ....checkpoints.files import file_sha256
from ....data import load_splits
from ....progress import progress_bar
from ....trainer import BDLMSFTConfig
from ....trainer.collator import apply_length_policy, supervision
from ..configuration import DFlashConfig
from ..target import decoder_of, load_target, resolve_target_path

FEATURES_FORMAT = "hf_bdlm.dflash.features"
FEATURES_VERSION = 1
MANIFEST = "manifest.json"
PROGRESS = "progress.jsonl"
RECORDS_DIR = "records"
TEACHER_STATE = "last decoder layer output, before the final norm"
LAYER_ID_CONVENTION = "canonical: hidden_states[i] of output_hidden_states, 0 = embeddings"
# The settings a resumed capture must share with the one it continues (the number of records may change: a rerun
# over more records extends the capture).
_SETTING_KEYS = ("format", "format_version", "target", "layer_ids", "dtype", "hidden_size", "feature_width", "teacher")


# --- tokenisation: the trainer's own path ---------------------------------------------------------------------------
def tokenize_records(
    dataset,
    tokenizer,
    *,
    max_length: int | None = None,
    overlong_samples: str = "truncate",
    assistant_only_loss: bool = False,
    completion_only_loss: bool | None = None,
    dataset_text_field: str = "text",
):
    r"""
    Tokenise a dataset exactly as `BDLMSFTTrainer` does (TRL's SFT preparation: chat template, EOS, completion and
    assistant masks as ``labels``; then the trainer's length policy), so that the captured records are token for
    token the sequences a drafter trains on.

    Args:
        dataset (`datasets.Dataset`):
            Any SFT format the trainer takes: ``messages``, ``prompt``/``completion``, ``text`` or ``input_ids``.
        tokenizer ([`~transformers.PreTrainedTokenizerBase`]):
            The target's tokenizer.
        max_length (`int`, *optional*):
            Longest record in tokens (`None`: no limit).
        overlong_samples (`str`, defaults to `"truncate"`):
            What happens to a longer record: ``"truncate"``, ``"drop"`` or ``"error"`` (as the trainer's config).
        assistant_only_loss, completion_only_loss, dataset_text_field:
            As in [`~trl.SFTConfig`].

    Returns:
        `datasets.Dataset` with ``input_ids`` and ``labels`` (``-100`` outside the loss), the rows
        :func:`capture_features` takes.
    """
    if len(dataset) == 0:
        raise ValueError("the dataset to tokenise is empty.")
    first = dataset[0]
    if assistant_only_loss and not is_conversational(first):
        raise ValueError("assistant_only_loss=True needs a conversational dataset ('messages', or 'prompt'/"
                         "'completion' as lists of messages); the first record is not conversational.")
    args = BDLMSFTConfig(output_dir=os.devnull, report_to="none", max_length=None, packing=False,
                         shuffle_dataset=False, assistant_only_loss=assistant_only_loss,
                         completion_only_loss=completion_only_loss, dataset_text_field=dataset_text_field)

    class Preparation:
        # The three attributes SFTTrainer._prepare_dataset reads from its trainer, set as SFTTrainer.__init__ sets
        # them; calling it (rather than a tokeniser of our own) keeps one tokenisation path for training and capture.
        _tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
        chat_template = (get_training_chat_template(tokenizer)
                         if assistant_only_loss and not has_generation_markers(tokenizer.chat_template) else None)
        completion_only_loss = (("prompt" in first and "completion" in first) if args.completion_only_loss is None
                                else args.completion_only_loss)

    prepared = SFTTrainer._prepare_dataset(Preparation(), dataset, tokenizer, args, False, None, "capture")
    prepared, _ = apply_length_policy(prepared, max_length, overlong_samples, "capture")
    return prepared


def record_tokens(row: Mapping[str, Any]) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` of one row: ``loss_mask`` itself, else the trainer's rule (``labels`` != -100, or the
    ``completion_mask`` / ``assistant_masks`` columns; every token when the row has none)."""
    if "input_ids" not in row:
        raise ValueError(f"a capture record needs 'input_ids' (tokenise the dataset first: tokenize_records); got the "
                         f"keys {sorted(row)}.")
    ids = [int(t) for t in row["input_ids"]]
    if row.get("loss_mask") is not None:
        mask = [int(bool(m)) for m in row["loss_mask"]]
    else:
        mask = supervision(row)
    if len(mask) != len(ids):
        raise ValueError(f"a record's loss mask has {len(mask)} entries for {len(ids)} tokens.")
    return ids, mask


# --- capture --------------------------------------------------------------------------------------------------------
def capture_features(
    target,
    records: Sequence[Mapping[str, Any]],
    *,
    layer_ids: Sequence[int],
    out_dir: str | os.PathLike,
    batch_size: int = 1,
    teacher: bool = False,
    target_id: str | None = None,
    target_revision: str | None = None,
    resume: bool = True,
    progress: bool = True,
) -> dict:
    r"""
    Run the frozen target over ``records`` and write their features (see the module docstring for the folder).

    Args:
        target ([`~transformers.PreTrainedModel`]):
            The target causal LM (or its decoder), on any device and in the dtype the features should have; it is
            run in inference mode, in batches right-padded to their longest record.
        records (sequence of mappings):
            Rows with ``input_ids`` and a loss mask (``loss_mask``, or ``labels`` with -100 outside the loss, as
            :func:`tokenize_records` returns); a `datasets.Dataset` or a list of dicts.
        layer_ids (sequence of `int`):
            Canonical ids of the hidden states to store, concatenated in this order (0 = embeddings).
        out_dir (`str` or `os.PathLike`):
            The capture folder (created if needed).
        batch_size (`int`, defaults to 1):
            Records per forward pass (the pass holds every layer's hidden states of the batch, as
            ``output_hidden_states`` does: lower it for long records).
        teacher (`bool`, defaults to `False`):
            Also store the last decoder layer's output before the final norm (the KL teacher's input).
        target_id, target_revision (`str`, *optional*):
            What the manifest records as the target (default id: the config's ``_name_or_path``).
        resume (`bool`, defaults to `True`):
            Keep the records of an earlier run of the same capture whose sha256 still matches; `False` recomputes
            every record.
        progress (`bool`, defaults to `True`):
            Show a tqdm progress bar (:mod:`hf_bdlm.progress`: on standard error when it is a terminal, on rank 0).

    Returns:
        `dict`: the manifest written to ``out_dir/manifest.json``.
    """
    decoder, config = decoder_of(target)
    num_layers = int(config.num_hidden_layers)
    layer_ids = _check_layer_ids(layer_ids, num_layers)
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}.")
    if len(records) == 0:
        raise ValueError("there are no records to capture.")
    hidden = int(config.hidden_size)
    dtype = decoder.get_input_embeddings().weight.dtype
    settings = {
        "format": FEATURES_FORMAT,
        "format_version": FEATURES_VERSION,
        "target": {"id": target_id or getattr(config, "_name_or_path", None) or None, "revision": target_revision,
                   "config_sha256": config_sha256(config), "model_type": getattr(config, "model_type", None),
                   "num_hidden_layers": num_layers},
        "layer_ids": list(layer_ids),
        "layer_id_convention": LAYER_ID_CONVENTION,
        "dtype": str(dtype).removeprefix("torch."),
        "hidden_size": hidden,
        "feature_width": hidden * len(layer_ids),
        "teacher": bool(teacher),
        "teacher_state": TEACHER_STATE if teacher else None,
        "num_records": len(records),
        "tensors": ["input_ids", "loss_mask", "features"] + (["teacher"] if teacher else []),
    }
    root = Path(out_dir)
    (root / RECORDS_DIR).mkdir(parents=True, exist_ok=True)
    done = _resumable_records(root, settings, records, progress) if resume else {}
    _write_json(root / MANIFEST, {**settings, "complete": False, "records": []})
    # The log is rewritten with the entries kept, so that a stale line never vouches for a redone record.
    _write_lines(root / PROGRESS, [json.dumps(entry, sort_keys=True) for entry in done.values()])
    pending = [i for i in range(len(records)) if i not in done]

    # Moved once per batch (a forward of batch_size records); standard error, rank 0, a terminal (hf_bdlm.progress).
    bar = progress_bar(total=len(records), initial=len(done), desc="capturing target features", unit="record",
                       enabled=progress)
    device = decoder.get_input_embeddings().weight.device
    with open(root / PROGRESS, "a", encoding="utf-8") as log:
        for start in range(0, len(pending), batch_size):
            chunk = pending[start:start + batch_size]
            tokens = [record_tokens(records[i]) for i in chunk]
            features, last = _forward(decoder, [ids for ids, _ in tokens], layer_ids, teacher, device)
            for row, (index, (ids, mask)) in enumerate(zip(chunk, tokens)):
                n = len(ids)
                tensors = {"input_ids": torch.tensor(ids, dtype=torch.int32),
                           "loss_mask": torch.tensor(mask, dtype=torch.bool),
                           "features": features[row, :n]}
                if teacher:
                    tensors["teacher"] = last[row, :n]
                if not all(bool(torch.isfinite(t).all()) for k, t in tensors.items() if t.is_floating_point()):
                    raise RuntimeError(f"the target produced non-finite hidden states for record {index} ({n} tokens); "
                                       "check the target's dtype (float16 overflows on some models: use bfloat16).")
                entry = _write_record(root, index, tensors)
                done[index] = entry
                log.write(json.dumps(entry, sort_keys=True) + "\n")
            log.flush()
            os.fsync(log.fileno())
            bar.update(len(chunk))
    bar.close()
    ordered = [done[i] for i in range(len(records))]
    manifest = {**settings, "complete": True, "num_tokens": sum(e["length"] for e in ordered), "records": ordered}
    _write_json(root / MANIFEST, manifest)
    return manifest


def _check_layer_ids(layer_ids: Sequence[int], num_layers: int) -> tuple[int, ...]:
    ids = tuple(int(i) for i in layer_ids)
    if not ids:
        raise ValueError("layer_ids is empty; name the canonical hidden-state ids to capture (0 = embeddings).")
    if len(set(ids)) != len(ids):
        raise ValueError(f"layer_ids {list(ids)} repeat an id; each hidden state is captured once.")
    bad = [i for i in ids if not 0 <= i <= num_layers]
    if bad:
        raise ValueError(f"layer_ids {bad} are outside the target's hidden states 0..{num_layers} (canonical ids: 0 = "
                         f"embeddings, i = output of decoder layer i - 1; the target has {num_layers} layers).")
    return ids


@torch.inference_mode()
def _forward(decoder, batch: list[list[int]], layer_ids: tuple[int, ...], teacher: bool, device):
    """``(features [b, T, n * H], pre-norm last hidden state [b, T, H] or None)`` of right-padded ``batch``."""
    longest = max(len(ids) for ids in batch)
    if min(len(ids) for ids in batch) == 0:
        raise ValueError("a record has no tokens.")
    input_ids = torch.zeros(len(batch), longest, dtype=torch.long)
    attention = torch.zeros(len(batch), longest, dtype=torch.long)
    for row, ids in enumerate(batch):
        input_ids[row, :len(ids)] = torch.tensor(ids)
        attention[row, :len(ids)] = 1
    # Right padding leaves every real token's causal context and position unchanged; the mask is passed only when
    # there is padding, so a batch without it runs exactly as a plain forward.
    kwargs = {"attention_mask": attention.to(device)} if bool((attention == 0).any()) else {}
    captured = {}
    handle = None
    if teacher:
        norm = getattr(decoder, "norm", None)
        if not isinstance(norm, torch.nn.Module):
            raise ValueError(f"teacher=True needs the target's final norm (`{type(decoder).__name__}.norm`), which "
                             "this model does not have.")
        handle = norm.register_forward_pre_hook(lambda module, args: captured.__setitem__("last", args[0]))
    try:
        out = decoder(input_ids=input_ids.to(device), output_hidden_states=True, use_cache=False, **kwargs)
    finally:
        if handle is not None:
            handle.remove()
    states = out.hidden_states
    features = torch.cat([states[i] for i in layer_ids], dim=-1).to("cpu")
    last = captured["last"].to("cpu") if teacher else None
    return features, last


def _write_record(root: Path, index: int, tensors: dict[str, torch.Tensor]) -> dict:
    name = f"{RECORDS_DIR}/{index:08d}.safetensors"
    path = root / name
    temporary = path.with_name(f".{path.name}.tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(temporary), metadata={"index": str(index)})
    os.replace(temporary, path)
    ids, mask = tensors["input_ids"], tensors["loss_mask"]
    return {"index": index, "file": name, "length": int(ids.numel()), "supervised": int(mask.sum()),
            "bytes": path.stat().st_size, "sha256": file_sha256(path),
            "tokens_sha256": tokens_sha256(ids.tolist(), mask.int().tolist())}


def _resumable_records(root: Path, settings: dict, records, progress: bool) -> dict[int, dict]:
    """The logged records of an earlier run that need no work: same settings, same tokens, same file bytes."""
    manifest = _read_json(root / MANIFEST)
    if manifest is None:
        return {}
    differ = [k for k in _SETTING_KEYS if manifest.get(k) != settings[k]]
    if differ:
        shown = "; ".join(f"{k}: {manifest.get(k)!r} there, {settings[k]!r} now" for k in differ)
        raise ValueError(f"{root} holds a capture with other settings ({shown}). Capture into a new folder, or pass "
                         "resume=False to recompute every record here.")
    logged = {}
    for entry in [*manifest.get("records", []), *_read_log(root / PROGRESS)]:
        logged[int(entry["index"])] = entry  # the log is newer than a finished manifest
    kept = {}
    for index, entry in progress_bar(sorted(logged.items()), desc="checking captured records", unit="record",
                                     enabled=progress and bool(logged)):
        path = root / entry["file"]
        if not 0 <= index < len(records) or not path.is_file() or file_sha256(path) != entry["sha256"]:
            continue
        if tokens_sha256(*record_tokens(records[index])) != entry["tokens_sha256"]:
            continue
        kept[index] = entry
    return kept


def _read_log(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    entries = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # the last line of a run killed while writing it
    return entries


# --- reading --------------------------------------------------------------------------------------------------------
class FeatureStore:
    r"""
    Read a capture folder: tokens and loss mask per record, and any row range of its features from a memory map.

    Args:
        out_dir (`str` or `os.PathLike`):
            A folder :func:`capture_features` completed.

    Attributes:
        manifest (`dict`): the parsed ``manifest.json``.
        layer_ids (`tuple[int]`): canonical ids of the stored hidden states, in feature order.
        feature_width (`int`): ``len(layer_ids) * hidden_size``.
        lengths (`list[int]`): tokens per record.

    Example::

        store = FeatureStore("feats")
        store.check_drafter(drafter.config, target_id="org/target")
        input_ids, loss_mask = store.record(3)
        rows = store.features(3, 0, 512)
    """

    def __init__(self, out_dir: str | os.PathLike):
        self.root = Path(out_dir)
        manifest = _read_json(self.root / MANIFEST)
        if manifest is None:
            raise FileNotFoundError(f"{self.root} holds no {MANIFEST}: it is not a capture folder (write one with "
                                    "capture_features or `hf-bdlm dflash capture`).")
        if manifest.get("format") != FEATURES_FORMAT or manifest.get("format_version") != FEATURES_VERSION:
            raise ValueError(f"{self.root / MANIFEST} is format {manifest.get('format')!r} version "
                             f"{manifest.get('format_version')!r}; this reader reads {FEATURES_FORMAT!r} version "
                             f"{FEATURES_VERSION}. Capture the features again with this version of hf_bdlm.")
        if not manifest.get("complete"):
            done = len(_read_log(self.root / PROGRESS))
            raise ValueError(f"the capture in {self.root} is incomplete ({done} of {manifest.get('num_records')} "
                             "records written); rerun it (capture_features with resume=True) to finish it.")
        self.manifest = manifest
        self.layer_ids = tuple(manifest["layer_ids"])
        self.feature_width = int(manifest["feature_width"])
        self.hidden_size = int(manifest["hidden_size"])
        self.has_teacher = bool(manifest["teacher"])
        self.lengths = [int(e["length"]) for e in manifest["records"]]

    def __len__(self) -> int:
        return len(self.manifest["records"])

    @property
    def target_id(self) -> str | None:
        return self.manifest["target"].get("id")

    def _path(self, index: int) -> Path:
        if not -len(self) <= index < len(self):
            raise IndexError(f"record {index} is out of range: the capture holds {len(self)} records.")
        return self.root / self.manifest["records"][index]["file"]

    def record(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids [T] long, loss_mask [T] bool)`` of record ``index``."""
        with safe_open(self._path(index), framework="pt") as f:
            return f.get_tensor("input_ids").long(), f.get_tensor("loss_mask").bool()

    def features(self, index: int, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows ``start:stop`` of record ``index``'s features ``[stop - start, feature_width]`` (only those rows are
        read from disk)."""
        return self._rows(index, "features", start, stop)

    def feature_runs(self, index: int, runs: Sequence[tuple[int, int]]) -> torch.Tensor:
        """The feature rows of record ``index`` in ``runs`` (ascending ``[start, stop)`` within the record), one after
        the other: ``[sum of stop - start, feature_width]``; the file is opened once and only those rows are read."""
        length = self.lengths[index]
        if any(not 0 <= start <= stop <= length for start, stop in runs):
            raise ValueError(f"runs {list(runs)} reach outside record {index}, which has {length} tokens.")
        with safe_open(self._path(index), framework="pt") as f:
            rows = f.get_slice("features")
            parts = [rows[start:stop] for start, stop in runs if stop > start]
        if not parts:
            return torch.zeros(0, self.feature_width, dtype=getattr(torch, self.manifest["dtype"]))
        return torch.cat(parts)

    def teacher(self, index: int, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows ``start:stop`` of the teacher state (the last decoder layer's output before the final norm)."""
        if not self.has_teacher:
            raise ValueError(f"the capture in {self.root} has no teacher states; capture with teacher=True "
                             "(`hf-bdlm dflash capture --teacher`) for a KL objective.")
        return self._rows(index, "teacher", start, stop)

    def _rows(self, index: int, name: str, start: int, stop: int | None) -> torch.Tensor:
        path = self._path(index)
        length = self.lengths[index]
        stop = length if stop is None else stop
        if not 0 <= start <= stop <= length:
            raise ValueError(f"rows {start}:{stop} are outside record {index}, which has {length} tokens.")
        with safe_open(path, framework="pt") as f:
            return f.get_slice(name)[start:stop]

    def verify(self, progress: bool = False, sha256: bool = True) -> None:
        """Check every record file against the manifest: present, of its size, and (``sha256``, reading every byte)
        of its sha256; raises naming the files that differ or are missing, and the fix."""
        bad = []
        for entry in progress_bar(self.manifest["records"], desc="verifying", unit="record", enabled=progress):
            path = self.root / entry["file"]
            if not path.is_file():
                bad.append(f"{entry['file']} (missing)")
            elif path.stat().st_size != entry["bytes"]:
                bad.append(f"{entry['file']} ({path.stat().st_size} bytes, the manifest records {entry['bytes']})")
            elif sha256 and file_sha256(path) != entry["sha256"]:
                bad.append(f"{entry['file']} (sha256 differs)")
        if bad:
            raise ValueError(f"{len(bad)} of {len(self)} records of {self.root} fail verification: {bad}. Rerun the "
                             "capture with resume=True to redo them (or copy the folder again).")

    def check_drafter(self, config, *, target_id: str | None = None) -> None:
        """Raise when the features do not fit a drafter: its canonical ``target_layer_ids``, its feature width
        (``target_hidden_size`` per layer), and, when given, the target id."""
        problems = []
        layers = tuple(int(i) for i in config.target_layer_ids)
        if layers != self.layer_ids:
            problems.append(f"the drafter reads target layers {list(layers)}, the capture holds {list(self.layer_ids)}")
        width = getattr(config, "target_hidden_size", None) or self.hidden_size
        if int(width) * len(layers) != self.feature_width:
            problems.append(f"the drafter's fc takes {int(width) * len(layers)} features ({len(layers)} x "
                            f"{int(width)}), the capture's width is {self.feature_width}")
        if target_id is not None and self.target_id is not None and target_id != self.target_id:
            problems.append(f"the drafter is for target {target_id!r}, the features are of {self.target_id!r}")
        if problems:
            raise ValueError(f"the capture in {self.root} does not match the drafter: " + "; ".join(problems) + ". "
                             "Capture again with the drafter's layer ids (`--layer-ids`) and target.")


# --- small helpers --------------------------------------------------------------------------------------------------
def tokens_sha256(input_ids: Iterable[int], loss_mask: Iterable[int]) -> str:
    """Hex sha256 of a record's tokens and loss mask (what decides whether a captured record is still current)."""
    payload = json.dumps([list(map(int, input_ids)), list(map(int, loss_mask))], separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()


def config_sha256(config) -> str:
    """Hex sha256 of a model config's content (its name, path and library version left out)."""
    values = {k: v for k, v in config.to_dict().items()
              if k not in ("_name_or_path", "transformers_version", "_commit_hash") and not k.startswith("_attn")}
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def _write_json(path: Path, payload: dict) -> None:
    _write_lines(path, [json.dumps(payload, indent=1, sort_keys=True)])


def _write_lines(path: Path, lines: list[str]) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    os.replace(temporary, path)


# --- hf-bdlm dflash capture (the command of ..commands) --------------------------------------------------------------
def run_capture(args) -> int:
    """``hf-bdlm dflash capture``: the frozen target's features at the drafter's layers over a dataset, into
    ``args.out`` (a rerun resumes it)."""
    path = resolve_target_path(args.target)
    target = load_target(args.target, args.target_revision, dtype=args.dtype, device=args.device)
    if args.drafter:
        config = _drafter_config(args.drafter)
        layer_ids = list(config.target_layer_ids)
        width = getattr(config, "target_hidden_size", None)
        if width is not None and int(width) != int(target.config.get_text_config().hidden_size):
            raise ValueError(f"the drafter {args.drafter!r} reads features of width {width}, the target "
                             f"{args.target!r} has hidden size {target.config.get_text_config().hidden_size}: it "
                             "was made for another target.")
    else:
        layer_ids = args.layer_ids
    train, test = load_splits(args.dataset, args.dataset_config, train_split=args.split, test_split="test")
    dataset = test if args.split == "test" and test is not None else train
    if args.max_records is not None:
        dataset = dataset.select(range(min(args.max_records, len(dataset))))
    tokenizer = AutoTokenizer.from_pretrained(path, revision=args.target_revision)
    records = tokenize_records(dataset, tokenizer, max_length=args.max_length, overlong_samples=args.overlong,
                               assistant_only_loss=args.assistant_only_loss)
    manifest = capture_features(target, records, layer_ids=layer_ids, out_dir=args.out, batch_size=args.batch_size,
                                teacher=args.teacher, target_id=args.target, target_revision=args.target_revision,
                                resume=not args.no_resume, progress=not args.quiet)
    print(f"captured {manifest['num_records']} records ({manifest['num_tokens']} tokens) of {args.target}: layers "
          f"{manifest['layer_ids']}, width {manifest['feature_width']}, {manifest['dtype']}"
          f"{', with teacher states' if manifest['teacher'] else ''} -> {args.out}")
    return 0


def _drafter_config(folder: str):
    if not (Path(folder) / "config.json").is_file():
        raise FileNotFoundError(f"--drafter {folder!r} holds no config.json: pass a drafter folder (hf-bdlm dflash "
                                "init writes one).")
    return DFlashConfig.from_pretrained(folder)


__all__ = ["FEATURES_FORMAT", "FEATURES_VERSION", "FeatureStore", "capture_features", "config_sha256", "file_sha256",
           "record_tokens", "run_capture", "tokenize_records", "tokens_sha256"]
