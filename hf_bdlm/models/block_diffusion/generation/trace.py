"""The decoding trace: how a decoding run committed each token, recorded on request (``decode_ragged(..., trace=...)``).

Per row, each block it decoded: where the block starts (the row's own position), its tokens as decoding left them, the
step of the block's denoising that committed each position, and the log-probability the committed token had under the
step's logits (``hf_bdlm.rl.estimators.token_log_probs``: temperature applied, ``[MASK]`` left out as the unmasking rule
leaves it out, before top-k / top-p). That is enough to recompute every step: the block at step ``k`` holds the tokens
committed before ``k`` (and the prompt's tail), ``[MASK]`` elsewhere, over the clean blocks before it; the policy's
``trace`` estimator (:mod:`hf_bdlm.models.block_diffusion.training.policy`) runs them again with gradients.

Recording changes nothing of the decoding (no random draw, no forward): a run decodes the same tokens with and without
a trace (``tests/rl/test_grpo.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ....rl.estimators import token_log_probs
from .settings import DecodeSettings

GIVEN = -1  # the step of a block position the prompt fills (never masked)
NEVER = 1 << 30  # the step of a position decoding never committed (it stays [MASK])


@dataclass
class TracedBlock:
    """One decoded block of one row.

    Attributes:
        start (`int`): the row's own position of the block's first column.
        tokens (`torch.LongTensor` of shape `[B]`): the block as decoding left it ([MASK] where nothing was committed).
        steps (`torch.LongTensor` of shape `[B]`): the step that committed each position (:data:`GIVEN`,
            :data:`NEVER`).
        log_probs (`torch.DoubleTensor` of shape `[B]`): each committed token's log-probability (0 elsewhere).
    """

    start: int
    tokens: torch.Tensor
    steps: torch.Tensor
    log_probs: torch.Tensor


class BlockRecord:
    """The commits of one block of the batch while :func:`~.loop.denoise_block` denoises it."""

    def __init__(self, masked: torch.Tensor):
        self.steps = torch.where(masked, NEVER, GIVEN).long()
        self.log_probs = torch.zeros(masked.shape, dtype=torch.float64, device=masked.device)

    def commit(self, take, unmask: torch.Tensor, step: int, log_probs: torch.Tensor) -> None:
        """Rows ``take`` (a slice or row indices) committed ``unmask`` at ``step``, with ``log_probs [rows, B]``."""
        self.steps[take] = torch.where(unmask, step, self.steps[take])
        self.log_probs[take] = torch.where(unmask, log_probs.double(), self.log_probs[take])


class DecodingTrace:
    """What :func:`~.loop.decode_ragged` records when given one: :attr:`blocks`, per row (the run's prompt order), the
    :class:`TracedBlock` list of its decoded blocks, and the :attr:`settings` of the run."""

    def __init__(self):
        self.blocks: list[list[TracedBlock]] = []
        self.settings: DecodeSettings | None = None

    def begin(self, rows: int, settings: DecodeSettings) -> None:
        self.blocks = [[] for _ in range(rows)]
        self.settings = settings

    def scored(self, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The log-probability of ``tokens`` under ``logits`` as the run samples them (see the module docstring)."""
        s = self.settings
        excluded = s.mask_token_id if s.unmasking == "hf_bdlm" else None
        return token_log_probs(logits, tokens, s.temperature if s.do_sample else 1.0, excluded)[0]

    def add(self, rows: list[int], starts: list[int], block: torch.Tensor, record: BlockRecord) -> None:
        """Block ``block`` (``[batch, B]``) of batch rows that are the run's rows ``rows``, starting at ``starts``."""
        for j, (row, start) in enumerate(zip(rows, starts)):
            self.blocks[row].append(TracedBlock(start, block[j].clone(), record.steps[j].clone(),
                                                record.log_probs[j].clone()))

    def completion_log_probs(self, row: int, prompt_length: int, count: int) -> list[float]:
        """The log-probabilities of row ``row``'s first ``count`` generated tokens (those after its ``prompt_length``
        prompt tokens)."""
        values = []
        for b in self.blocks[row]:
            for i in range(b.tokens.numel()):
                if b.start + i >= prompt_length and len(values) < count:
                    values.append(float(b.log_probs[i]))
        return values

    def as_rows(self, prompt_lengths: list[int], mask_token_id: int) -> dict[str, torch.Tensor]:
        """The trace as per-row tensors (rows first, padded): ``trace_tokens`` and ``trace_steps`` ``[rows, W]`` from
        each row's first decoded block on (padding: ``[MASK]``, :data:`NEVER`), ``trace_start`` ``[rows]`` (its first
        decoded block's position), ``trace_from`` ``[rows]`` (the run's first decoded position, the same in every row)
        and ``trace_block`` ``[rows]`` (the block size)."""
        B = self.settings.block_size
        width = max(len(blocks) for blocks in self.blocks) * B
        tokens = torch.full((len(self.blocks), width), mask_token_id, dtype=torch.long)
        steps = torch.full((len(self.blocks), width), NEVER, dtype=torch.long)
        start = torch.tensor([blocks[0].start if blocks else p // B * B
                              for blocks, p in zip(self.blocks, prompt_lengths)], dtype=torch.long)
        for r, blocks in enumerate(self.blocks):
            for i, b in enumerate(blocks):
                tokens[r, i * B:(i + 1) * B] = b.tokens.cpu()
                steps[r, i * B:(i + 1) * B] = b.steps.cpu()
        return {"trace_tokens": tokens, "trace_steps": steps, "trace_start": start,
                "trace_from": torch.full_like(start, int(start.min())),
                "trace_block": torch.full((len(self.blocks),), B, dtype=torch.long)}


__all__ = ["GIVEN", "NEVER", "BlockRecord", "DecodingTrace", "TracedBlock"]
