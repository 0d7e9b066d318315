"""Row metadata: which stream, global position and document each attention row belongs to.

A forward pass of a block-diffusion model runs over *rows*. In the single-device training
form there are ``2L`` of them (the noisy copy then the clean copy, :func:`vectorized_rows`);
during generation the rows are one noisy block over a cache of clean rows; a rank of a
parallel layout holds some subset. :class:`RowMeta` describes any of these, and the mask
rule (:mod:`hf_bdlm.attention.masks`) is a function of it.

``pos`` is the position in the (packed) sequence, which defines blocks and causality; RoPE
position ids are separate (they may restart per packed document).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .masks import CLEAN, NOISY


@dataclass(frozen=True)
class RowMeta:
    """Per-row stream (``[T]``), sequence position (``[T]``) and optional document id (``[batch, T]``)."""

    stream: torch.Tensor
    pos: torch.Tensor
    doc: torch.Tensor | None = None

    def __post_init__(self):
        if self.stream.shape != self.pos.shape or self.stream.dim() != 1:
            raise ValueError(
                f"stream and pos must be 1-D tensors of equal length, got {tuple(self.stream.shape)} "
                f"and {tuple(self.pos.shape)}."
            )
        if self.doc is not None and (self.doc.dim() != 2 or self.doc.shape[1] != self.stream.shape[0]):
            raise ValueError(f"doc must have shape [batch, {self.stream.shape[0]}], got {tuple(self.doc.shape)}.")

    @property
    def num_rows(self) -> int:
        return int(self.stream.shape[0])

    def slice(self, start: int, end: int) -> "RowMeta":
        doc = None if self.doc is None else self.doc[:, start:end]
        return RowMeta(self.stream[start:end], self.pos[start:end], doc)

    def select(self, index: torch.Tensor) -> "RowMeta":
        doc = None if self.doc is None else self.doc[:, index]
        return RowMeta(self.stream[index], self.pos[index], doc)

    def batch_item(self, i: int) -> "RowMeta":
        return self if self.doc is None else RowMeta(self.stream, self.pos, self.doc[i : i + 1])

    def to(self, device) -> "RowMeta":
        doc = None if self.doc is None else self.doc.to(device)
        return RowMeta(self.stream.to(device), self.pos.to(device), doc)

    def index_of(self, stream: torch.Tensor, pos: torch.Tensor, seq_len: int) -> torch.Tensor:
        """Index among these rows of each ``(stream, pos)`` pair, ``-1`` where these rows do not hold it."""
        device = pos.device
        # A [2, L] lookup table (stream, position) -> row; streams are CLEAN=0 / NOISY=1.
        table = torch.full((2, seq_len), -1, dtype=torch.long, device=device)
        table[self.stream.to(device), self.pos.to(device)] = torch.arange(self.num_rows, device=device)
        return table[stream, pos]

    @staticmethod
    def cat(parts: list["RowMeta"]) -> "RowMeta":
        docs = [p.doc for p in parts]
        if any(d is None for d in docs) and not all(d is None for d in docs):
            raise ValueError("Cannot concatenate rows with and without document ids.")
        doc = None if docs[0] is None else torch.cat(docs, dim=1)
        return RowMeta(torch.cat([p.stream for p in parts]), torch.cat([p.pos for p in parts]), doc)


def stream_rows(stream: int, positions: torch.Tensor, doc: torch.Tensor | None = None) -> RowMeta:
    """Rows of one stream at the given global positions."""
    return RowMeta(torch.full_like(positions, stream), positions, doc)


def vectorized_rows(seq_len: int, doc: torch.Tensor | None = None, device=None) -> RowMeta:
    """The ``2L`` rows of the single-device training form: noisy ``x_t`` first, then clean ``x``.

    ``doc`` (``[batch, L]``) holds per-position document ids of a packed batch.
    """
    pos = torch.arange(seq_len, device=device)
    both_doc = None if doc is None else torch.cat([doc, doc], dim=1)
    return RowMeta(
        torch.cat([torch.full_like(pos, NOISY), torch.full_like(pos, CLEAN)]),
        torch.cat([pos, pos]),
        both_doc,
    )


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """For each token, the index of the first token of its document: a document is a maximal run of equal ids, so an
    id reused by two separate runs names two documents. The one start-of-document rule: RoPE positions restart there
    (:func:`document_positions`) and a drafter's anchor context begins there.

    Args:
        document_ids (`torch.LongTensor` of shape `[batch, L]`).

    Returns:
        `torch.LongTensor` of shape `[batch, L]`.
    """
    index = torch.arange(document_ids.shape[-1], device=document_ids.device).expand_as(document_ids)
    starts = torch.zeros_like(index)
    changed = document_ids[..., 1:] != document_ids[..., :-1]
    starts[..., 1:] = torch.where(changed, index[..., 1:], 0)
    return starts.cummax(dim=-1).values


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """RoPE position ids that restart at 0 at each packed document's first token."""
    index = torch.arange(document_ids.shape[-1], device=document_ids.device).expand_as(document_ids)
    return index - document_starts(document_ids)


def check_block_aligned_documents(doc: torch.Tensor, block_size: int) -> None:
    """Documents must start on block boundaries: every block holds tokens of one document."""
    if doc.shape[-1] % block_size:
        raise ValueError(
            f"document ids have length {doc.shape[-1]}, not a multiple of block_size={block_size}; "
            "pad each document to a multiple of the block size."
        )
    blocks = doc.reshape(*doc.shape[:-1], -1, block_size)
    bad = (blocks != blocks[..., :1]).any(-1)
    if bad.any():
        first = int(bad.nonzero()[0, -1])
        raise ValueError(
            f"block {first} (positions {first * block_size}..{(first + 1) * block_size - 1}) mixes documents; "
            f"packed documents must be aligned to block boundaries (block_size={block_size}): pad each "
            "document to a multiple of the block size before packing."
        )
