"""`standard`: the BD3-LM objective (absorbing [MASK] noise, block-wise masking rates).

Each (sample, block) draws a masking rate ``t`` in ``[eps_min, eps_max]`` (stratified over the blocks of a
sample: :func:`~hf_bdlm.objectives.noise.stratified_block_t`, BD3-LM's antithetic sampling made per sample);
each supervised token is replaced by ``[MASK]`` iff its own uniform draw is below its block's ``t``. With a
clipped range (``eps_min != 1e-3`` or ``eps_max != 1``, BD3-LM's defaults) a block whose masked fraction falls
outside it is redrawn, as BD3-LM's ``_resample_q_xt`` does (``training.resample=True`` in its training scripts).
A masked token is predicted by the noisy row at its own position, with weight ``1/t`` (``inverse_t``, the ELBO)
or ``1`` (``unit``); the ``[MASK]`` logit is left out of the softmax (BD3-LM's SUBS parameterization); the loss
is divided by the number of supervised tokens of the batch. Tiny CPU example::

    import torch
    from hf_bdlm.objectives import get_objective
    obj = get_objective("standard", dict(block_size=4, mask_token_id=63))
    batch = {"input_ids": torch.randint(0, 63, (2, 16)), "completion_mask": torch.ones(2, 16)}
    corrupted = obj.corrupt(batch, seed=0, step=0)     # then: loss, metrics = obj.loss(model, corrupted)
"""

from __future__ import annotations

from typing import Mapping

import torch

from .....attention.masks import NOISY
from .....objectives.base import CheckedBatch, CorruptedBatch, Objective
from .....objectives.noise import token_uniform

# BD3-LM's default range: a bound equal to its default is not enforced by resampling (as in `_resample_q_xt`).
UNCLIPPED_EPS_MIN, UNCLIPPED_EPS_MAX = 1e-3, 1.0
# A block still outside the range after this many redraws keeps its last draw. A block is redrawn only when some
# masked count lies in the range, and its rate lies in the range too, so each redraw succeeds with probability
# about 1 / sqrt(block size) or more: reaching the cap is beyond any practical chance.
MAX_REDRAWS = 1000


class StandardObjective(Objective):
    """BD3-LM. See :class:`~hf_bdlm.objectives.base.Objective` for the parameters."""

    name = "standard"

    def corrupt(self, batch: Mapping[str, torch.Tensor], *, seed: int, step: int) -> CorruptedBatch:
        checked = self.check_batch(batch)
        block_t = self.block_rates(checked, seed=seed, step=step)
        token_t = self.per_token(block_t)
        # Prompt and pad tokens are not supervised, hence never masked.
        masked = checked.supervised & (self.token_draws(checked, seed=seed, step=step) < token_t)
        masked = self.resample_clipped(checked, masked, token_t, seed=seed, step=step)
        clean = checked.input_ids
        noisy = clean.masked_fill(masked, self.mask_token_id)
        sample, pos = masked.nonzero(as_tuple=True)
        # float64 weights, cast to the cross-entropy's dtype where it is computed: a float32 1/t would cost a float64
        # model half its digits.
        if self.loss_weighting == "inverse_t":
            weight = 1.0 / token_t[sample, pos]
        else:
            weight = torch.ones(sample.shape[0], dtype=torch.float64, device=clean.device)
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

    def resample_clipped(
        self, checked: CheckedBatch, masked: torch.Tensor, token_t: torch.Tensor, *, seed: int, step: int
    ) -> torch.Tensor:
        """BD3-LM's resampling under a clipped range: redraw the blocks whose masked fraction is outside it.

        The fraction is over the block's supervised tokens (all of them in BD3-LM, which has no prompt). Only the
        bounds that differ from BD3-LM's defaults (``1e-3``, ``1``) are enforced, and only blocks for which some
        masked count satisfies them are redrawn. Redraw ``r`` of a block uses
        ``token_uniform(seed, step, sample, position, redraw=r)``, so the result stays layout invariant.
        """
        check_min = self.noise_eps_min != UNCLIPPED_EPS_MIN
        check_max = self.noise_eps_max != UNCLIPPED_EPS_MAX
        if not (check_min or check_max):
            return masked
        b, length = masked.shape
        B = self.block_size
        supervised = checked.supervised.view(b, -1, B)
        count = supervised.sum(-1)

        def outside(masked_count: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
            frac = masked_count / total.clamp(min=1)
            bad = torch.zeros_like(frac, dtype=torch.bool)
            if check_min:
                bad |= frac < self.noise_eps_min
            if check_max:
                bad |= frac > self.noise_eps_max
            return bad

        ks = torch.arange(B + 1, device=masked.device)
        satisfiable = (~outside(ks[None, :], ks[:, None]) & (ks[None, :] <= ks[:, None])).any(-1)  # [B + 1]
        redraw = (count > 0) & satisfiable[count]
        masked = masked.clone()
        bad = redraw & outside(masked.view(b, -1, B).sum(-1), count)
        for r in range(1, MAX_REDRAWS + 1):
            if not bad.any():
                break
            row, block = bad.nonzero(as_tuple=True)
            pos = block[:, None] * B + torch.arange(B, device=masked.device)
            draws = token_uniform(seed, step, checked.sample_ids[row][:, None], pos, redraw=r)
            fresh = supervised[row, block] & (draws < token_t[row[:, None], pos])
            masked.view(b, -1, B)[row, block] = fresh
            bad[row, block] = outside(fresh.sum(-1), count[row, block])
        return masked
