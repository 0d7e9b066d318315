"""The clean context a denoising step runs over: held as K/V in a `DecodingCache` (`CachedContext`) or recomputed at
every step (`RecomputedContext`, the reference); `LeftPadding` lays a ragged batch out in common columns."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ....attention import CLEAN, NOISY, LocalLayout, RowMeta
from ....attention.rows import stream_rows
from .kv_cache import DecodingCache, StepPlan, StepWindow
from .settings import DecodeSettings


@dataclass(frozen=True)
class LeftPadding:
    """A ragged batch in common columns: row ``i`` starts after ``pad[i]`` padding columns (a multiple of the block
    size, so each row's blocks start at its own first token). Padding is document 0, the row's tokens document 1."""

    pad: torch.Tensor  # [batch]

    def doc(self, columns: torch.Tensor) -> torch.Tensor:
        return (columns[None] >= self.pad[:, None]).long()

    def position_ids(self, columns: torch.Tensor) -> torch.Tensor:
        """RoPE positions counted from each row's first token (what the row would get decoded alone)."""
        return (columns[None] - self.pad[:, None]).clamp(min=0)

    def select(self, index: torch.Tensor) -> "LeftPadding":
        return LeftPadding(self.pad[index])


def _rows(stream: int, start: int, end: int, device, padding: LeftPadding | None) -> RowMeta:
    pos = torch.arange(start, end, device=device)
    return stream_rows(stream, pos, None if padding is None else padding.doc(pos))


def _run_rows(model, ids, q_rows, k_rows, settings, cache=None, padding: LeftPadding | None = None):
    """Hidden states of ``ids`` (rows ``q_rows``) attending to ``k_rows`` (the cache's rows, then ``q_rows``)."""
    if padding is None:
        positions = q_rows.pos[None].expand(ids.shape[0], -1)
    else:
        positions = padding.position_ids(q_rows.pos)
    backend = settings.backend
    if padding is not None and backend in ("auto", "blockwise") and ids.shape[1] <= 2 * settings.block_size:
        # A ragged batch's block step (with a committed block at most): rows differ in padding, so the block-sparse
        # planner would plan (and run) every row apart; the rule's dense mask over a few rows serves the batch at once.
        backend = "dense"
    layout = LocalLayout(q_rows, k_rows, settings.rule, backend)
    out = model(
        input_ids=ids,
        position_ids=positions,
        bdlm_layout=layout,
        past_key_values=cache,
        use_cache=cache is not None,
        return_logits=False,
    )
    return out.hidden_states


class CachedContext:
    """Clean prefix held as K/V in a :class:`DecodingCache`; noisy steps run over it and never enter it.

    With ``settings.fuse_block_commit`` the clean rows appended (the prompt's whole blocks, a finished block) wait
    for the next denoising forward and run in it, before the block's noisy rows."""

    def __init__(self, model, settings: DecodeSettings, device, padding: LeftPadding | None = None):
        self.model, self.settings, self.device, self.padding = model, settings, device, padding
        self.cache = DecodingCache()
        self.length = 0  # clean columns in the cache
        self.pending: torch.Tensor | None = None  # clean ids appended, not run yet
        self.last_hidden = None  # clean hidden state of the last cached position (token shift)

    def _cached_rows(self, end: int | None = None) -> RowMeta:
        return _rows(CLEAN, 0, self.length if end is None else end, self.device, self.padding)

    def append(self, ids: torch.Tensor) -> None:
        if self.settings.fuse_block_commit:
            self.pending = ids if self.pending is None else torch.cat([self.pending, ids], dim=1)
            return
        q_rows = _rows(CLEAN, self.length, self.length + ids.shape[1], self.device, self.padding)
        k_rows = RowMeta.cat([self._cached_rows(), q_rows]) if self.length else q_rows
        hidden = _run_rows(self.model, ids, q_rows, k_rows, self.settings, self.cache, self.padding)
        self.length += ids.shape[1]
        self.last_hidden = hidden[:, -1]

    def step(self, block: torch.Tensor, start: int, rows: torch.Tensor | None, window: StepWindow):
        """One denoising forward of block positions ``window.lo .. window.hi`` of the batch rows ``rows`` (``None``:
        all) of ``block`` (``[batch, B]``, the whole batch's ids); returns their hidden states ``[rows, hi - lo, d]``
        and the clean hidden state of the position before the block (``None`` when there is none)."""
        settings, (batch, B) = self.settings, block.shape
        clean = 0 if self.pending is None else self.pending.shape[1]
        if clean and rows is not None:
            raise RuntimeError("a block is committed in the first step of the next one, where every row runs.")
        padding = self.padding if self.padding is None or rows is None else self.padding.select(rows)
        ids = (block if rows is None else block[rows])[:, window.lo:window.hi]
        noisy = _rows(NOISY, start + window.lo, start + window.hi, self.device, padding)
        q_rows = noisy
        if clean:
            ids = torch.cat([self.pending, ids], dim=1)
            q_rows = RowMeta.cat([_rows(CLEAN, self.length, self.length + clean, self.device, padding), noisy])
        keys = _rows(NOISY, start, start + B, self.device, padding) if settings.block_cache else noisy
        prefix = _rows(CLEAN, 0, self.length + clean, self.device, padding)
        k_rows = RowMeta.cat([prefix, keys]) if self.length + clean else keys
        self.cache.plan = StepPlan(clean, rows, window, settings.block_cache, batch, B)
        try:
            hidden = _run_rows(self.model, ids, q_rows, k_rows, settings, self.cache, padding)
        finally:
            self.cache.plan = None
        if clean:
            self.length += clean
            self.pending = None
            self.last_hidden = hidden[:, clean - 1]
        last = self.last_hidden if self.last_hidden is None or rows is None else self.last_hidden[rows]
        return hidden[:, clean:], last

    def block_hidden(self, block: torch.Tensor, start: int):
        """Hidden states of the whole ``block`` (every row) over the clean prefix, and the prefix's last clean state."""
        return self.step(block, start, None, StepWindow.whole(block.shape[0], block.shape[1], block.device))

    def select(self, index: torch.Tensor) -> None:
        """Keep only the batch rows ``index`` (finished rows leave the batch)."""
        if self.length:
            self.cache.batch_select_indices(index)
            self.last_hidden = self.last_hidden[index]
        if self.pending is not None:
            self.pending = self.pending[index]
        if self.padding is not None:
            self.padding = self.padding.select(index)


class RecomputedContext:
    """No cache: every step runs the whole clean prefix plus the noisy block (the reference for the cache)."""

    def __init__(self, model, settings: DecodeSettings, device, padding: LeftPadding | None = None):
        if settings.block_cache:
            raise ValueError("block_cache=True keeps K/V across the steps of a block; it needs use_cache=True.")
        self.model, self.settings, self.device, self.padding = model, settings, device, padding
        self.prefix = None

    def append(self, ids: torch.Tensor) -> None:
        self.prefix = ids if self.prefix is None else torch.cat([self.prefix, ids], dim=1)

    def step(self, block: torch.Tensor, start: int, rows: torch.Tensor | None, window: StepWindow):
        if (window.lo, window.hi) != (0, block.shape[1]):
            raise RuntimeError("without a cache every step runs the whole block.")
        padding = self.padding if self.padding is None or rows is None else self.padding.select(rows)
        block = block if rows is None else block[rows]
        noisy = _rows(NOISY, start, start + block.shape[1], self.device, padding)
        if self.prefix is None:
            return _run_rows(self.model, block, noisy, noisy, self.settings, padding=padding), None
        prefix = self.prefix if rows is None else self.prefix[rows]
        q_rows = RowMeta.cat([_rows(CLEAN, 0, start, self.device, padding), noisy])
        hidden = _run_rows(self.model, torch.cat([prefix, block], dim=1), q_rows, q_rows, self.settings,
                           padding=padding)
        return hidden[:, start:], hidden[:, start - 1]

    def block_hidden(self, block: torch.Tensor, start: int):
        return self.step(block, start, None, StepWindow.whole(block.shape[0], block.shape[1], block.device))

    def select(self, index: torch.Tensor) -> None:
        """Keep only the batch rows ``index``."""
        if self.prefix is not None:
            self.prefix = self.prefix[index]
        if self.padding is not None:
            self.padding = self.padding.select(index)
