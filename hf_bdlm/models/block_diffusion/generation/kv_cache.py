"""The KV cache of decoding (`DecodingCache`): the clean prefix's K/V, appended block by block, and the current block's
noisy K/V, which never enter the prefix; `StepWindow` and `StepPlan` say what one denoising forward runs and keeps."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache


@dataclass(frozen=True)
class StepWindow:
    """The block positions one denoising forward runs, ``[lo, hi)`` for every row in it, and the part of them each row
    takes as it is: row ``r`` uses the K/V of ``[own_lo[r], own_hi[r])`` computed in this forward, and for the block's
    other positions the K/V its previous forward of the block left (the block cache). Without the block cache every
    row's window is the whole block."""

    lo: int
    hi: int
    own_lo: torch.Tensor  # [rows]
    own_hi: torch.Tensor  # [rows]

    @classmethod
    def whole(cls, rows: int, block_size: int, device) -> "StepWindow":
        return cls(0, block_size, torch.zeros(rows, dtype=torch.long, device=device),
                   torch.full((rows,), block_size, dtype=torch.long, device=device))


@dataclass(frozen=True)
class StepPlan:
    """How :class:`DecodingCache` treats the K/V of one denoising forward (its input: ``clean`` clean rows to commit,
    then the noisy rows of ``window``)."""

    clean: int
    rows: torch.Tensor | None  # the batch rows in the forward (None: all)
    window: StepWindow
    block_cache: bool
    batch: int
    block_size: int


class DecodingCache(DynamicCache):
    """The clean prefix's K/V (a `DynamicCache`: clean rows are appended) and the current block's K/V.

    A denoising forward sets :attr:`plan`; the backbone's attention layers then call :meth:`update` with the K/V of the
    forward's input: ``plan.clean`` clean rows (a finished block committed in this forward) are appended to the prefix,
    and the noisy rows are returned after it but never stored in it. With the block cache they are merged into the
    block's kept K/V (each row takes its own window fresh, the rest kept) and kept for the next step. The layout the
    forward runs with describes the returned keys: the prefix rows, then the whole block (or the window alone without
    the block cache, where the window is the whole block)."""

    def __init__(self):
        # No config, so every layer keeps all its keys: transformers' sliding-window layers keep only the last
        # W - 1 keys (enough for one new token, not for a block whose first query looks W - 1 back) and refuse
        # the per-step crop once full. The attention rule applies the window instead, in the model's convention.
        super().__init__()
        self.plan: StepPlan | None = None
        self.block_kv: dict[int, list[torch.Tensor]] = {}  # layer -> [keys, values], each [batch, H_kv, B, d]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        plan = self.plan
        if plan is None:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        n = plan.clean
        if n:
            keys, values = super().update(key_states[:, :, :n], value_states[:, :, :n], layer_idx, *args, **kwargs)
        else:
            keys, values = self._prefix(layer_idx, plan.rows, key_states)
        new_keys, new_values = key_states[:, :, n:], value_states[:, :, n:]
        if plan.block_cache:
            new_keys = self._merge(layer_idx, 0, new_keys, plan)
            new_values = self._merge(layer_idx, 1, new_values, plan)
        return torch.cat([keys, new_keys], dim=-2), torch.cat([values, new_values], dim=-2)

    def _prefix(self, layer_idx: int, rows, like: torch.Tensor):
        if layer_idx >= len(self.layers) or not self.layers[layer_idx].is_initialized or \
                self.layers[layer_idx].get_seq_length() == 0:
            empty = like.new_zeros((like.shape[0], like.shape[1], 0, like.shape[3]))
            return empty, empty
        layer = self.layers[layer_idx]
        if rows is None:
            return layer.keys, layer.values
        return layer.keys[rows], layer.values[rows]

    def _merge(self, layer_idx: int, which: int, fresh: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """The block's K (``which`` 0) or V (1) for the forward's rows: this forward's inside each row's own window,
        the kept ones elsewhere; kept for the next step."""
        window = plan.window
        kept = self.block_kv.get(layer_idx)
        if kept is None:
            shape = (plan.batch, fresh.shape[1], plan.block_size, fresh.shape[3])
            kept = self.block_kv[layer_idx] = [fresh.new_zeros(shape), fresh.new_zeros(shape)]
        block = kept[which] if plan.rows is None else kept[which][plan.rows]
        block = block.clone() if plan.rows is None else block
        columns = torch.arange(window.lo, window.hi, device=fresh.device)
        own = (columns[None] >= window.own_lo[:, None]) & (columns[None] < window.own_hi[:, None])
        block[:, :, window.lo:window.hi] = torch.where(own[:, None, :, None], fresh, block[:, :, window.lo:window.hi])
        if plan.rows is None:
            kept[which] = block
        else:
            kept[which][plan.rows] = block
        return block

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        for kept in self.block_kv.values():
            kept[0], kept[1] = kept[0][indices], kept[1][indices]
