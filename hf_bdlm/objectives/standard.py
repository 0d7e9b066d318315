"""`standard`: the BD3-LM objective (absorbing [MASK] noise, block-wise masking rates).

Each (sample, block) draws a masking rate ``t`` (antithetic across the blocks of a sample, in
``[eps_min, eps_max]``); each supervised token is replaced by ``[MASK]`` iff its own uniform draw
is below its block's ``t``. A masked token is predicted by the noisy row at its own position,
with weight ``1/t`` (``inverse_t``, the ELBO) or ``1`` (``unit``); the loss is divided by the
number of supervised tokens of the batch. Tiny CPU example::

    import torch
    from hf_bdlm.objectives import get_objective
    obj = get_objective("standard", dict(block_size=4, mask_token_id=63))
    batch = {"input_ids": torch.randint(0, 63, (2, 16)), "completion_mask": torch.ones(2, 16)}
    corrupted = obj.corrupt(batch, seed=0, step=0)     # then: loss, metrics = obj.loss(model, corrupted)
"""

from __future__ import annotations

from typing import Mapping

import torch

from ..attention.masks import NOISY
from .base import CorruptedBatch, Objective


class StandardObjective(Objective):
    """BD3-LM. See :class:`~hf_bdlm.objectives.base.Objective` for the parameters."""

    name = "standard"

    def corrupt(self, batch: Mapping[str, torch.Tensor], *, seed: int, step: int) -> CorruptedBatch:
        checked = self.check_batch(batch)
        block_t = self.block_rates(checked, seed=seed, step=step)
        token_t = self.per_token(block_t)
        # Prompt and pad tokens are not supervised, hence never masked.
        masked = checked.supervised & (self.token_draws(checked, seed=seed, step=step) < token_t)
        clean = checked.input_ids
        noisy = clean.masked_fill(masked, self.mask_token_id)
        sample, pos = masked.nonzero(as_tuple=True)
        if self.loss_weighting == "inverse_t":
            weight = (1.0 / token_t[sample, pos]).to(torch.float32)
        else:
            weight = torch.ones(sample.shape[0], dtype=torch.float32, device=clean.device)
        return CorruptedBatch(
            noisy_ids=noisy,
            clean_ids=clean,
            position_ids=checked.position_ids,
            document_ids=checked.document_ids,
            target_sample=sample,
            target_stream=torch.full_like(pos, NOISY),
            target_row_pos=pos,
            target_token=clean[sample, pos],
            target_weight=weight,
            normalizer=float(checked.supervised.sum()),
            masked=masked,
            sample_ids=checked.sample_ids,
            block_t=block_t,
        )
