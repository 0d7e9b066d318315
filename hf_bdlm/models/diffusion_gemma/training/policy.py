"""DiffusionGemma as a GRPO policy: rollouts by its serving decoder, log-probabilities by ``coupled`` or ``one_step``.

Rollouts are :class:`~..inference.serving.DiffusionGemmaServingDecoder`'s: transformers' own ``generate`` steps, each
row on its own random stream (the round's seed plus the row), with the run's ``steps_per_block`` (denoising steps per
canvas), ``confidence_threshold`` (the adaptive stop's entropy threshold) and any other generation-config field in
``generation_kwargs``. Its sampler takes its temperatures from the generation config; the run's ``temperature`` only
divides the scored logits.

``trace`` is not available: ``generate`` renoises the canvas at every step (uniform-state noise, a sampler of its
own) and records no per-token commit, so no decoding step can be replayed. The two estimators, on the model's own
corruption (it has no ``[MASK]``: a "masked" token holds a token drawn uniformly from the vocabulary, the noise's end
state), each row laid out alone in the canvas frame of training (:func:`~..modeling.build_canvas_frame`: the encoder
over the clean prompt and completion, canvases from the completion's first token):

- ``coupled``: two decoder passes over the row's canvases, the completion noised by a draw ``M`` (per canvas ``l`` of
  ``n`` tokens, ``l`` uniform on ``1..n``) and by its complement; each token scored by the pass that noises it. One
  encoder pass, two decoder passes per row.
- ``one_step``: one decoder pass with every completion token noised, the encoder's prompt tokens noised with
  probability ``prompt_mask_ratio``.

Canvas slots past the completion hold noise in every pass (unknown, as when decoding). Rows are scored one at a time:
the MoE layers group a batch's tokens by expert, and a row's numbers would then depend on the rows beside it.
"""

from __future__ import annotations

import dataclasses

import torch

from ....protocols.decoding import DecodingRequest
from ....protocols.policy import Policy, PolicyBatch, PolicyScoring, Rollout
from ....rl.estimators import coupled_masks, noise_tokens, prompt_masks, sample_key, token_log_probs
from ..modeling import (
    DiffusionGemmaLayout,
    build_canvas_frame,
    decode,
    encode,
    softcapped_logits,
    unwrap_diffusion_gemma,
)

TRACE_UNAVAILABLE = ("DiffusionGemma's generate renoises its canvas at every step with a sampler of its own and "
                     "records no per-token commit, so there is no decoding step to replay")


class DiffusionGemmaPolicy(Policy):
    """One GRPO run's policy over a ``DiffusionGemmaForBlockDiffusion`` (module docstring)."""

    estimators = ("coupled", "one_step")
    single_process_reason = ("its estimators run the encoder and decoder of the model directly, outside the DDP or "
                             "FSDP2 wrapper that reduces the gradients over the processes")

    def __init__(self, decoder, settings, pad_token_id: int, attention_backend: str = "auto"):
        self.decoder, self.settings = decoder, settings
        self.pad_token_id, self.backend = pad_token_id, attention_backend
        config = decoder.model.config
        self.block_size = int(config.canvas_length)
        self.vocab_size = int(config.get_text_config().vocab_size)

    def rollout(self, model, prompts, seed, trace=False) -> Rollout:
        if trace:
            raise ValueError(f"no decoding trace: {TRACE_UNAVAILABLE}; use logp_estimator='coupled' or 'one_step'.")
        completions: list[list[int]] = [[] for _ in prompts]

        def on_block(new):
            for row, tokens in new.items():
                completions[row] += [int(t) for t in tokens]
            return set()

        was_training = model.training
        model.eval()
        try:
            self.decoder.decode([list(p) for p in prompts], [self.settings] * len(prompts),
                                [seed + row for row in range(len(prompts))], on_block)
        finally:
            model.train(was_training)
        return Rollout(completions)

    def log_probs(self, runner, batch: PolicyBatch, scoring: PolicyScoring, entropy=False):
        if scoring.estimator not in self.estimators:
            raise ValueError(f"logp_estimator={scoring.estimator!r} is not available for DiffusionGemma: "
                             f"{TRACE_UNAVAILABLE}; use one of {list(self.estimators)}.")
        dg = unwrap_diffusion_gemma(runner)
        C = batch.completion_ids.shape[1]
        log_probs, entropies = [], []
        for i in range(batch.completion_ids.shape[0]):
            prompt = batch.prompt_ids[i][batch.prompt_mask[i].bool()]
            n = int(batch.completion_mask[i].bool().sum())
            lp, ent, _ = self.row_scores(dg, prompt, batch.completion_ids[i, :n], scoring, entropy)
            log_probs.append(torch.nn.functional.pad(lp, (0, C - n)))
            if entropy:
                entropies.append(torch.nn.functional.pad(ent, (0, C - n)))
        return torch.stack(log_probs), (torch.stack(entropies) if entropy else None)

    def row_scores(self, model, prompt: torch.Tensor, completion: torch.Tensor, scoring: PolicyScoring,
                   entropy: bool = False):
        """One row's ``(log_probs [n], entropies [n] or None, forward [n])``: ``forward`` says which decoder pass scored
        each completion token (``coupled``: 0 the draw's, 1 its complement's; ``one_step``: 0)."""
        dg = unwrap_diffusion_gemma(model)
        device, P, n = completion.device, prompt.numel(), completion.numel()
        if n == 0:
            empty = torch.zeros(0, dtype=torch.float32, device=device)
            return empty, (empty if entropy else None), torch.zeros(0, dtype=torch.long, device=device)
        ids = torch.cat([prompt, completion])[None]
        supervised = torch.zeros_like(ids, dtype=torch.bool)
        supervised[0, P:] = True
        frame = build_canvas_frame(ids, torch.ones_like(supervised), supervised, block_size=self.block_size,
                                   fill_token_id=self.pad_token_id, pad_token_id=self.pad_token_id,
                                   truncated=torch.ones(1, dtype=torch.bool))
        key = sample_key(prompt.tolist(), completion.tolist())
        source, target = frame.canvas_source[0], frame.canvas_target[0]
        slots = frame.canvas_supervised[0]  # the completion's canvas slots (the rest: fill past its end)
        index = (source - P).clamp(min=0)  # completion index of each slot
        noise = noise_tokens(scoring.seed, key, source.clamp(min=0).cpu(), self.vocab_size).to(device)
        if scoring.estimator == "coupled":
            first = coupled_masks(scoring.seed, key, torch.arange(n), self.block_size).to(device)
            passes = [slots & first[index.clamp(max=n - 1)], slots & ~first[index.clamp(max=n - 1)]]
        else:
            passes = [slots]
            prompt_columns = (frame.clean_source[0] >= 0) & (frame.clean_source[0] < P)
            drawn = prompt_masks(scoring.seed, key, frame.clean_source[0].clamp(min=0).cpu(),
                                 scoring.prompt_mask_ratio).to(device) & prompt_columns
            prompt_noise = noise_tokens(scoring.seed, key, frame.clean_source[0].clamp(min=0).cpu() + (1 << 40),
                                        self.vocab_size).to(device)
            frame = dataclasses.replace(frame, clean_ids=torch.where(drawn[None], prompt_noise[None],
                                                                     frame.clean_ids))
        _, cache = encode(dg, frame, DiffusionGemmaLayout.local(frame, self.backend))
        log_probs = torch.zeros(n, dtype=torch.float32, device=device)
        entropies = torch.zeros(n, dtype=torch.float32, device=device) if entropy else None
        forward = torch.full((n,), -1, dtype=torch.long, device=device)
        for k, noised in enumerate(passes):
            canvas = torch.where(noised | ~slots, noise, target)
            hidden = decode(dg, frame, DiffusionGemmaLayout.local(frame, self.backend), canvas[None], cache)[0]
            lp, ent = token_log_probs(softcapped_logits(dg, hidden[noised]), target[noised], scoring.temperature,
                                      None, entropy)
            log_probs = log_probs.to(lp.dtype).index_put((index[noised],), lp)
            if entropy:
                entropies = entropies.to(ent.dtype).index_put((index[noised],), ent)
            forward[index[noised]] = k
        return log_probs, entropies, forward


def rollout_settings(decoder, args, prompt_len: int = 1):
    """The serving decoder's settings of a GRPO run's rollouts (``generation_kwargs`` applied to the decoder first)."""
    request = DecodingRequest(top_p=args.top_p if args.top_p < 1 else None, steps_per_block=args.steps_per_block,
                              confidence_threshold=args.confidence_threshold)
    return decoder.settings(request, prompt_len, args.max_completion_length)


__all__ = ["TRACE_UNAVAILABLE", "DiffusionGemmaPolicy", "rollout_settings"]
