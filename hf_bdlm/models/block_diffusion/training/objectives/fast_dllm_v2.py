"""`fast_dllm_v2`: AR -> BDLM conversion as in Fast-dLLM v2 (token shift, complementary masks).

The reference is Fast-dLLM v2's training forward (``Fast_dLLM_QwenForCausalLM.forward`` in its model code):

- rates: one ``t ~ U[0, 1)`` per (sample, block), drawn independently, ``p = eps + (1 - eps) t``; a supervised
  token is masked in view 0 iff its own draw is below ``p`` and in view 1 otherwise, so every supervised token
  is masked in exactly one of the two views. Here ``t`` and the draws are layout-invariant hashes
  (:func:`~hf_bdlm.objectives.noise.independent_block_t`, ``eps = noise_eps_min``, ``noise_eps_max = 1``).
- attention: the model runs ``[x_t, x]`` under BD3-LM's mask with a **block-causal** clean stream.
- loss: a causal-LM loss on the noisy half: labels shifted by one, so the **noisy** row ``i - 1`` predicts a
  masked token ``i``, also at a block start (the row is then the last one of the previous noisy block); a
  cross-entropy over the whole vocabulary ([MASK] included), unit weights, divided by the number of scored
  tokens (each supervised token with a predecessor, once over both views).

Position 0 and the first token of every packed document have no predecessor in their document: they are
corrupted like any supervised token (the reference masks position 0 too) but never scored.

Complementary views double the batch to ``2b`` rows, **view-major** (rows ``0..b-1`` are view 0 of samples
``0..b-1``, rows ``b..2b-1`` view 1 of the same samples).

`fast_dllm_v2_causal_clean` is the variant that keeps the converted model's clean stream *identical to the source
causal LM*: a token-causal clean stream, and a block's first token scored from the clean row before it, which is
then exactly the causal LM's next-token prediction. The reason is inference: the K/V cache of the prompt and of
every finished block is the causal LM's own cache (any autoregressive engine's prefill computes it, and the
causal LM can share it), and ``generate`` unmasks each block's first token from that clean row in the block's
first step. Tiny CPU example::

    import torch
    from hf_bdlm.objectives import get_objective
    obj = get_objective("fast_dllm_v2", dict(block_size=4, mask_token_id=63))
    batch = {"input_ids": torch.randint(0, 63, (2, 16)), "completion_mask": torch.ones(2, 16)}
    corrupted = obj.corrupt(batch, seed=0, step=0)     # corrupted.noisy_ids: [4, 16]
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import torch

from .....attention.masks import CLEAN, NOISY
from .....objectives.base import CorruptedBatch, Objective


class FastDLLMv2Objective(Objective):
    """Fast-dLLM v2 conversion objective. Same parameters as :class:`~hf_bdlm.objectives.base.Objective`,
    except that the weighting is always `"unit"` (complementary views have no `1/t` ELBO weight). Train it on a
    model whose `clean_attention` is `"block_causal"` (the config enforces it for `objective="fast_dllm_v2"`)."""

    name = "fast_dllm_v2"
    block_rate_sampling = "independent"
    exclude_mask_logit = False
    # Stream of the row that predicts a block's first token (the row before it, in the previous block).
    block_start_stream: ClassVar[int] = NOISY

    def __init__(self, *, loss_weighting: str = "unit", **kwargs: Any):
        super().__init__(loss_weighting=loss_weighting, **kwargs)  # the validator refuses any weighting but "unit"

    @classmethod
    def config_kwargs(cls, config: Any) -> dict[str, Any]:
        # The config's loss_weighting (default inverse_t) is the standard objective's; not used here.
        kwargs = super().config_kwargs(config)
        kwargs.pop("loss_weighting")
        return kwargs

    def corrupt(self, batch: Mapping[str, torch.Tensor], *, seed: int, step: int) -> CorruptedBatch:
        checked = self.check_batch(batch)
        clean = checked.input_ids
        has_predecessor = torch.ones_like(checked.supervised)
        has_predecessor[:, 0] = False
        if checked.document_ids is not None:
            has_predecessor[:, 1:] &= checked.document_ids[:, 1:] == checked.document_ids[:, :-1]
        scored = checked.supervised & has_predecessor
        if not scored.any():
            raise ValueError(
                "the batch has no supervised token after the token shift: only the first token of a sequence or "
                "document is supervised, and it has no predecessor to predict it from."
            )
        block_t = self.block_rates(checked, seed=seed, step=step)
        in_view0 = self.token_draws(checked, seed=seed, step=step) < self.per_token(block_t)
        supervised = checked.supervised
        masked = torch.cat([supervised & in_view0, supervised & ~in_view0], dim=0)  # [2b, L], view-major
        clean2 = clean.repeat(2, 1)
        noisy = clean2.masked_fill(masked, self.mask_token_id)

        sample, pos = (masked & has_predecessor.repeat(2, 1)).nonzero(as_tuple=True)
        stream = torch.full_like(pos, NOISY)
        if self.block_start_stream == CLEAN:
            stream[pos % self.block_size == 0] = CLEAN
        doc = None if checked.document_ids is None else checked.document_ids.repeat(2, 1)
        return CorruptedBatch(
            noisy_ids=noisy,
            clean_ids=clean2,
            position_ids=checked.position_ids.repeat(2, 1),
            document_ids=doc,
            target_sample=sample,
            target_stream=stream,
            target_row_pos=pos - 1,
            target_token=clean2[sample, pos],
            target_weight=torch.ones(sample.shape[0], dtype=torch.float64, device=clean.device),
            normalizer=float(scored.sum()),
            masked=masked,
            sample_ids=checked.sample_ids.repeat(2),
            block_t=block_t.repeat(2, 1),
        )


class FastDLLMv2CausalCleanObjective(FastDLLMv2Objective):
    """`fast_dllm_v2_causal_clean`: Fast-dLLM v2 with the clean stream kept identical to the source causal LM.

    Differs from :class:`FastDLLMv2Objective` in two documented ways (see the module docstring for the inference
    reason): the model's clean stream is token-causal (`clean_attention="causal"`, enforced by the config), and
    a block's first token is scored from the clean row before it (the causal LM's next-token prediction).
    """

    name = "fast_dllm_v2_causal_clean"
    block_start_stream = CLEAN
