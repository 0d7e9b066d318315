"""The ``"bdlm"`` attention implementation registered with transformers.

Backbones (Llama, Qwen, Gemma, Mistral, ...) run unmodified: their attention modules call
``ALL_ATTENTION_FUNCTIONS["bdlm"]`` with the projected, rotated ``query/key/value``. The
function reads an :class:`AttentionLayout` from the forward kwargs (``bdlm_layout``) and lets it
do the work: the single-device :class:`LocalLayout` attends over the rows it describes; the
sharded layouts of ``hf_bdlm.parallel`` communicate K/V first. Transformers' own mask is
not built: ``"bdlm"`` has no entry in transformers' mask interface, so its mask builders return
``None`` early; the rule lives in :mod:`.masks`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .backends import attend
from .masks import MaskRule
from .rows import RowMeta, vectorized_rows

ATTENTION_NAME = "bdlm"


class AttentionLayout(Protocol):
    """What the attention function needs for one forward pass."""

    def attend(self, module, query, key, value, rule: MaskRule, scale: float) -> torch.Tensor: ...


class TrainingLayout(AttentionLayout, Protocol):
    """The rows one rank runs in a training step (one device: :meth:`LocalLayout.vectorized`; a rank of a
    block-parallel group: :class:`hf_bdlm.parallel.ShardedLayout`)."""

    def local_inputs(self, noisy: torch.Tensor, clean: torch.Tensor, position_ids: torch.Tensor): ...

    def loss_row_index(self, corrupted) -> torch.Tensor: ...


# Single-device training layouts kept across steps (least recently used first out): a run has one shape, or a few
# under packing, and each kept layout holds its plans (a few MB at 128K tokens).
KEPT_LAYOUTS = 4
_VECTORIZED: OrderedDict = OrderedDict()


def forget_kept_layouts() -> None:
    """Drop the single-device layouts kept across steps (and their plans): the next step plans anew."""
    _VECTORIZED.clear()


def documents_key(document_ids: torch.Tensor | None):
    """A hashable key of a batch's document ids (``None`` without packing): equal ids, equal key."""
    if document_ids is None:
        return None
    ids = document_ids.detach().cpu()
    return (tuple(ids.shape), str(ids.dtype), ids.numpy().tobytes())


@dataclass
class LocalLayout:
    """All rows on this device: ``query`` rows described by ``q_rows``, ``key`` rows by ``k_rows``.

    ``k_rows`` differs from ``q_rows`` during generation, where the keys are the cached clean
    rows followed by the current block. :meth:`vectorized` is the training layout of one device:
    the ``2L`` rows of both streams, which a training step uses through the same interface as a
    rank of a sharded layout (``local_inputs``, ``loss_row_index``).
    """

    q_rows: RowMeta
    k_rows: RowMeta
    base_rule: MaskRule
    backend: str = "auto"
    cache: dict = field(default_factory=dict)

    @classmethod
    def vectorized(cls, seq_len: int, rule: MaskRule, backend: str = "auto",
                   document_ids: torch.Tensor | None = None) -> "LocalLayout":
        """The single-device training layout: noisy rows ``0..L-1``, then clean rows ``0..L-1``.

        Layouts are kept (the last :data:`KEPT_LAYOUTS`, keyed by length, rule, backend and the batch's document ids)
        with the tile plans and block masks their cache fills on the first forward: a later step of the same shape
        and documents plans nothing."""
        key = (seq_len, rule, backend, documents_key(document_ids))
        found = _VECTORIZED.get(key)
        if found is None:
            rows = vectorized_rows(seq_len, document_ids,
                                   device=None if document_ids is None else document_ids.device)
            found = cls(rows, rows, rule, backend)
            _VECTORIZED[key] = found
            while len(_VECTORIZED) > KEPT_LAYOUTS:
                _VECTORIZED.popitem(last=False)
        else:
            _VECTORIZED.move_to_end(key)
        return found

    def local_inputs(self, noisy: torch.Tensor, clean: torch.Tensor, position_ids: torch.Tensor):
        """The rows' ``(input_ids [b, R], position_ids [b, R])``: here both streams, noisy first."""
        return torch.cat([noisy, clean], 1), torch.cat([position_ids, position_ids], 1)

    def loss_row_index(self, corrupted) -> torch.Tensor:
        """Row predicting each target of ``corrupted`` (all are held here)."""
        return self.q_rows.index_of(corrupted.target_stream, corrupted.target_row_pos, corrupted.seq_len)

    def attend(self, module, query, key, value, rule, scale):
        return attend(self.backend, query, [(key, value)], self.q_rows, [self.k_rows], rule, scale, self.cache)


def bdlm_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
):
    layout = kwargs.get("bdlm_layout")
    if layout is None:
        raise ValueError(
            "The 'bdlm' attention implementation needs a block-diffusion layout: run the backbone through "
            "BlockDiffusionForMaskedLM (which passes `bdlm_layout`), not on its own."
        )
    if dropout and module.training:
        raise ValueError(f"attention dropout={dropout} is not supported by block-diffusion attention; set it to 0.")
    if softcap is not None:
        raise ValueError(
            f"attention logit soft-capping (softcap={softcap}) is not supported by block-diffusion attention."
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    rule = layout.base_rule.with_window(sliding_window)
    out = layout.attend(module, query, key, value, rule, scale)
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    """Register ``"bdlm"`` with transformers' attention interface (idempotent)."""
    # lazy: import cost measured: +9 s (transformers and the model hf_bdlm registers with it) on the room's 3.5 s
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, bdlm_attention_forward)
