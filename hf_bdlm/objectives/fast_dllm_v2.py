"""`fast_dllm_v2`: AR -> BDLM conversion (Fast-dLLM v2) with token shift and complementary masks.

Token shift: the target at position ``i`` is predicted by the row at ``i - 1``, as in next-token
prediction, so a converted causal LM keeps the meaning of its head. Inside a block that row is
the noisy row ``i - 1`` (which may itself be masked: by design); at a block start (``i - 1`` in
the previous block, which a noisy row cannot see) it is the clean row ``i - 1``, the last clean
token of the previous block. Position 0 and the first token of every packed document have no
predecessor in their document: they are neither supervised nor corrupted.

Complementary views: the batch doubles to ``2b`` rows, **view-major** (rows ``0..b-1`` are view
0 of samples ``0..b-1``, rows ``b..2b-1`` view 1 of the same samples). View 0 masks a supervised
token iff its draw is below its block's ``t``; view 1 masks exactly the supervised tokens view 0
kept. Every supervised token is thus a target exactly once; weights are 1 and the normalizer
counts each supervised token once. Tiny CPU example::

    import torch
    from hf_bdlm.objectives import get_objective
    obj = get_objective("fast_dllm_v2", dict(block_size=4, mask_token_id=63))
    batch = {"input_ids": torch.randint(0, 63, (2, 16)), "completion_mask": torch.ones(2, 16)}
    corrupted = obj.corrupt(batch, seed=0, step=0)     # corrupted.noisy_ids: [4, 16]
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ..attention.masks import CLEAN, NOISY
from .base import CorruptedBatch, Objective


class FastDLLMv2Objective(Objective):
    """Fast-dLLM v2 conversion objective. Same parameters as :class:`~hf_bdlm.objectives.base.Objective`,
    except that the weighting is always `"unit"` (complementary views have no `1/t` ELBO weight)."""

    name = "fast_dllm_v2"

    def __init__(self, *, loss_weighting: str = "unit", **kwargs: Any):
        if loss_weighting != "unit":
            raise ValueError(
                f"fast_dllm_v2 uses unit weights (every supervised token is masked in exactly one of two "
                f"complementary views), got loss_weighting={loss_weighting!r}; drop the argument or pass 'unit'."
            )
        super().__init__(loss_weighting="unit", **kwargs)

    @classmethod
    def config_kwargs(cls, config: Any) -> dict[str, Any]:
        # The config's loss_weighting (default inverse_t) is the standard objective's; not used here.
        kwargs = super().config_kwargs(config)
        kwargs.pop("loss_weighting")
        return kwargs

    def corrupt(self, batch: Mapping[str, torch.Tensor], *, seed: int, step: int) -> CorruptedBatch:
        checked = self.check_batch(batch)
        clean = checked.input_ids
        b, length = clean.shape
        has_predecessor = torch.ones_like(checked.supervised)
        has_predecessor[:, 0] = False
        if checked.document_ids is not None:
            has_predecessor[:, 1:] &= checked.document_ids[:, 1:] == checked.document_ids[:, :-1]
        supervised = checked.supervised & has_predecessor
        if not supervised.any():
            raise ValueError(
                "the batch has no supervised token after the token shift: only the first token of a sequence or "
                "document is supervised, and it has no predecessor to predict it from."
            )
        block_t = self.block_rates(checked, seed=seed, step=step)
        in_view0 = self.token_draws(checked, seed=seed, step=step) < self.per_token(block_t)
        masked = torch.cat([supervised & in_view0, supervised & ~in_view0], dim=0)  # [2b, L], view-major
        clean2 = clean.repeat(2, 1)
        noisy = clean2.masked_fill(masked, self.mask_token_id)

        sample, pos = masked.nonzero(as_tuple=True)
        prev = pos - 1
        starts_block = pos % self.block_size == 0
        stream = torch.where(starts_block, torch.full_like(pos, CLEAN), torch.full_like(pos, NOISY))
        doc = None if checked.document_ids is None else checked.document_ids.repeat(2, 1)
        return CorruptedBatch(
            noisy_ids=noisy,
            clean_ids=clean2,
            position_ids=checked.position_ids.repeat(2, 1),
            document_ids=doc,
            target_sample=sample,
            target_stream=stream,
            target_row_pos=prev,
            target_token=clean2[sample, pos],
            target_weight=torch.ones(sample.shape[0], dtype=torch.float32, device=clean.device),
            normalizer=float(supervised.sum()),
            masked=masked,
            sample_ids=checked.sample_ids.repeat(2),
            block_t=block_t.repeat(2, 1),
        )
