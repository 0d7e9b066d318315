"""The decoding loop: a clean KV cache across blocks, parallel denoising inside a block.

The sequence is cut into absolute blocks (position ``i`` is in block ``i // B``). The prompt's
full blocks are run once as clean rows and cached. The current block is the prompt's tail (if
the prompt ends mid-block; never changed) followed by ``[MASK]`` tokens; each denoising step
(:func:`denoise_block`) runs it as noisy rows over the cache and unmasks the positions whose
confidence reaches a threshold (at least one; :func:`choose_tokens`, :func:`tokens_to_unmask`).
A finished block is appended to the cache as clean rows, and the next block starts fully masked.
Noisy K/V never enter the cache.

Batches: prompts of equal length decode together in lock step. Prompts of different lengths (a
left-padded batch, or :func:`decode_ragged`) also decode in one batch: each row is laid out in
common columns behind a whole number of padding *blocks*, so its blocks still start at its own
first token; padding columns are a separate document that the row never attends to, and RoPE
positions count from each row's first token. Rows that finish (EOS, their own token budget) leave
the batch. The output keeps HF's layout (input columns, then the generated tokens, right-padded
with ``pad_token_id``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from .kv_cache import StepWindow
from .config import BLOCK_DIFFUSION_FIELDS, BlockDiffusionGenerationConfig, as_block_diffusion_config
from .context import CachedContext, LeftPadding, RecomputedContext
from .settings import DecodeSettings, resolve_settings
from .trace import BlockRecord, DecodingTrace


# --- choosing tokens ---------------------------------------------------------------------------


def choose_tokens(logits: torch.Tensor, settings: DecodeSettings, generator: torch.Generator | None):
    """Tokens and their confidences (probability of the chosen token) for ``logits [n, vocab]``."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # softmax and the threshold comparison in half precision are too coarse
    logits = logits.clone()
    if settings.unmasking == "hf_bdlm":
        logits[:, settings.mask_token_id] = -math.inf  # [MASK] is never a prediction
    # (The engines' rules take the argmax / sample over the whole vocabulary, [MASK] included.)
    if not settings.do_sample:
        probs = logits.softmax(-1)
        confidence, tokens = probs.max(-1)
        return tokens, confidence
    # The same warpers as transformers' sampling, so temperature/top-k/top-p mean what users expect.
    if settings.temperature != 1.0:
        logits = TemperatureLogitsWarper(settings.temperature)(None, logits)
    scaled = logits
    if settings.top_k:
        logits = TopKLogitsWarper(settings.top_k)(None, logits)
    if settings.top_p < 1.0:
        logits = TopPLogitsWarper(settings.top_p)(None, logits)
    probs = logits.softmax(-1)
    tokens = torch.multinomial(probs, 1, generator=generator)
    if settings.unmasking == "lmdeploy_low_confidence_dynamic":
        # LMDeploy scores the sampled token under the temperature-scaled softmax, before top-k / top-p filtering.
        probs = scaled.softmax(-1)
    return tokens[:, 0], probs.gather(1, tokens)[:, 0]


def tokens_to_unmask(masked: torch.Tensor, confidence: torch.Tensor, step: int, settings: DecodeSettings):
    """Boolean ``[b, B]``: the masked positions to fix this step (the most confident first)."""
    remaining = masked.sum(1)
    conf = confidence.masked_fill(~masked, -math.inf)
    count = torch.ones_like(remaining)
    if settings.confidence_threshold is not None:
        # SGLang's LowConfidence compares strictly; LMDeploy and this project's rule include the threshold.
        above = conf > settings.confidence_threshold if settings.unmasking == "sglang_low_confidence" else \
            conf >= settings.confidence_threshold
        count = torch.maximum(count, (masked & above).sum(1))
    if settings.steps_per_block is not None:
        steps_left = settings.steps_per_block - step
        needed = remaining if steps_left <= 1 else -torch.div(-remaining, steps_left, rounding_mode="floor")  # ceil
        count = torch.maximum(count, needed)
    count = torch.maximum(count, torch.full_like(count, settings.min_tokens_per_step))
    count = torch.minimum(count, remaining)
    order = conf.argsort(dim=1, descending=True, stable=True)
    positions = torch.arange(order.shape[1], device=order.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(1, order, positions)
    return masked & (rank < count[:, None])


def denoise_block(model, context, block, masked, start, settings, generator, done=None,
                  record: BlockRecord | None = None, trace: DecodingTrace | None = None):
    """Denoise ``block`` (``[b, B]``) until every row is done with it; returns the finished block.

    A row is done when none of its ``masked`` positions is left, when (``settings.eos_early_exit``) an EOS is fixed
    with no masked position before it, when an engine rule's step changes nothing (SGLang), or from the start
    (``done``, e.g. rows that ended in an earlier block). Each step fixes positions of the first sub-block that still
    holds a masked one (the whole block without sub-blocks); with ``settings.compact_batch`` only the rows not done
    run in it. Every row's tokens depend on its own rows only, so a row decodes the same alone or in any batch.
    ``record`` (with the run's ``trace``) notes the step and log-probability of every commit; it changes nothing."""
    block, masked = block.clone(), masked.clone()
    batch, B = block.shape
    device = block.device
    S = settings.sub_block_size or B
    shift = int(settings.token_shift)
    generated = masked.clone()  # the positions this block decodes (a prompt tail is never an end)
    done = torch.zeros(batch, dtype=torch.bool, device=device) if done is None else done.clone()
    eos = torch.tensor(settings.eos_token_ids, dtype=block.dtype, device=device)
    columns = torch.arange(B, device=device)
    last_sub = torch.full((batch,), -1, dtype=torch.long, device=device)
    step = 0
    while True:
        done |= ~masked.any(1)
        if settings.eos_early_exit and eos.numel():
            done |= _eos_settled(block, masked, generated, eos)
        if bool(done.all()):
            return block
        running = ~done
        rows = running.nonzero()[:, 0] if settings.compact_batch and not bool(running.all()) else None
        # Each row's sub-block: the first one holding a masked position.
        sub = torch.where(masked, columns, B).min(1).values.clamp(max=B - 1) // S
        refresh = (sub != last_sub) if settings.block_cache else torch.ones_like(running)
        own_lo = torch.where(refresh, 0, (sub * S - shift).clamp(min=0))
        own_hi = torch.where(refresh, B, sub * S + S)
        own_lo, own_hi = own_lo.masked_fill(done, 0), own_hi.masked_fill(done, 0)  # a done row takes nothing fresh
        lo, hi = int(own_lo[running].min()), int(own_hi[running].max())
        take = slice(None) if rows is None else rows
        window = StepWindow(lo, hi, own_lo[take], own_hi[take])
        hidden, clean_last = context.step(block, start, rows, window)

        # The positions a step may fix, and the row predicting each (its own, or with token shift the one before;
        # the block's first position then comes from the clean stream's last row).
        in_sub = (columns[None] // S) == sub[take][:, None]
        candidates = masked[take] & in_sub & running[take][:, None]
        row_index, column = candidates.nonzero(as_tuple=True)
        source = hidden[row_index, (column - shift - lo).clamp(min=0)]
        from_clean = (column == 0) & bool(shift)
        if bool(from_clean.any()):
            first = clean_last if clean_last is not None else torch.zeros_like(hidden[:, 0])
            source = torch.where(from_clean[:, None], first[row_index], source)
        logits = model.lm_logits(source)
        tokens, conf = choose_tokens(logits, settings, generator)
        if clean_last is not None:
            # The clean prediction of the block's first token does not change with the block's content: fix it at
            # once, so the rest of the block is denoised knowing it.
            conf = torch.where(from_clean, math.inf, conf)
        full_tokens = block[take].clone()
        full_tokens[row_index, column] = tokens
        full_conf = torch.zeros(candidates.shape, dtype=conf.dtype, device=device)
        full_conf[row_index, column] = conf
        unmask = tokens_to_unmask(candidates, full_conf, step, settings)
        if settings.unmasking == "sglang_low_confidence":
            # SGLang reads the masked positions off the ids: a position whose argmax is [MASK] stays masked. A step
            # that fixes nothing else leaves the ids, hence the next forward and step, unchanged: the row's block
            # ends with its masks (SGLang runs out its step budget, block size + 1, the same way).
            unmask &= full_tokens != settings.mask_token_id
            stalled = candidates.any(1) & ~unmask.any(1)
            done[take] = done[take] | stalled
        if record is not None:
            full_log_probs = torch.zeros(candidates.shape, dtype=torch.float64, device=device)
            full_log_probs[row_index, column] = trace.scored(logits, tokens).double()
            record.commit(take, unmask, step, full_log_probs)
        block[take] = torch.where(unmask, full_tokens, block[take])
        masked[take] = masked[take] & ~unmask
        last_sub[take] = torch.where(running[take], sub[take], last_sub[take])
        step += 1


def _eos_settled(block, masked, generated, eos) -> torch.Tensor:
    """Rows with a generated EOS fixed and no masked position before it: nothing after it can reach the output."""
    settled_eos = generated & ~masked & torch.isin(block, eos)
    first_eos = torch.where(settled_eos, torch.arange(block.shape[1], device=block.device), block.shape[1]).min(1)
    first_masked = torch.where(masked, torch.arange(block.shape[1], device=block.device), block.shape[1]).min(1)
    return (first_eos.values < block.shape[1]) & (first_masked.values > first_eos.values)


# --- the decoding loop -------------------------------------------------------------------------


def _check_inputs(model, input_ids, attention_mask) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a LongTensor of shape [batch, prompt_len], got {shape} "
                         "(use input_ids[None] for a single prompt).")
    if input_ids.shape[0] == 0:
        raise ValueError(f"input_ids is an empty batch (shape {tuple(input_ids.shape)}); pass at least one prompt.")
    if input_ids.shape[1] == 0:
        raise ValueError(
            f"input_ids has empty prompts (shape {tuple(input_ids.shape)}); block diffusion decoding needs at least "
            "one prompt token (e.g. the BOS token)."
        )
    model.config.check_token_ids(input_ids)
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask {tuple(attention_mask.shape)} must have the shape of input_ids "
                f"{tuple(input_ids.shape)}."
            )
        mask = attention_mask.bool()
        if (mask[:, :-1] & ~mask[:, 1:]).any():
            raise ValueError(
                "attention_mask must be left padding (zeros, then ones) for generation; right-padded prompts would "
                "put pad tokens between the prompt and the generated text: tokenize with padding_side='left'."
            )
        if not mask[:, -1].all():
            raise ValueError("attention_mask has a row with no prompt token; every prompt needs at least one token.")


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    generation_config: GenerationConfig | None = None,
    use_cache: bool = True,
    **kwargs,
) -> torch.LongTensor:
    r"""
    Block-wise diffusion decoding with a [`BlockDiffusionForMaskedLM`].

    Args:
        model ([`BlockDiffusionForMaskedLM`]):
            The model.
        input_ids (`torch.LongTensor` of shape `[batch, prompt_len]`):
            Prompts. Rows of a batch have the same length unless `attention_mask` marks left padding.
        generation_config ([`~transformers.GenerationConfig`], *optional*):
            Defaults to `model.generation_config` (or one made from the model config); a plain `GenerationConfig`
            is converted to a [`BlockDiffusionGenerationConfig`].
        use_cache (`bool`, defaults to `True`):
            Keep the clean prefix as a KV cache. `False` recomputes the prefix at every step (same tokens; slower).
        kwargs:
            `attention_mask` (left padding), `generator` (a `torch.Generator` for sampling), `streamer` (as in
            transformers: `put` gets the prompt, then each decoded block's new tokens, `end` follows the last; one
            prompt only, e.g. a `TextStreamer`), and any field of [`BlockDiffusionGenerationConfig`] (e.g.
            `max_new_tokens=64, confidence_threshold=0.9`).

    Returns:
        `torch.LongTensor` of shape `[batch, prompt_len + n]`, `n <= max_new_tokens`: the prompts followed by the
        generated tokens, each row cut after its first generated EOS and right-padded with `pad_token_id`.
    """
    attention_mask = kwargs.pop("attention_mask", None)
    generator = kwargs.pop("generator", None)
    streamer = kwargs.pop("streamer", None)
    if generation_config is None:
        generation_config = getattr(model, "generation_config", None)
        if generation_config is None:
            generation_config = BlockDiffusionGenerationConfig.from_model_config(model.config)
    config = as_block_diffusion_config(generation_config)
    unused = config.update(**kwargs)
    if unused:
        raise TypeError(
            f"generate() got unexpected arguments {sorted(unused)}: pass attention_mask, generator, streamer or "
            f"fields of BlockDiffusionGenerationConfig ({', '.join(BLOCK_DIFFUSION_FIELDS)}, max_new_tokens, "
            "do_sample, ...)."
        )
    config.validate()
    _check_inputs(model, input_ids, attention_mask)
    if streamer is not None and input_ids.shape[0] != 1:
        raise ValueError(f"a streamer streams one prompt (as transformers' streamers do), got a batch of "
                         f"{input_ids.shape[0]}; generate the prompts one at a time to stream them.")
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    return _decode_left_padded(model, input_ids, mask, config, use_cache, generator, streamer)


def _decode_left_padded(model, input_ids, mask, config, use_cache, generator, streamer=None) -> torch.Tensor:
    """Decode the rows together (each row's blocks start at its first real token), re-assemble HF-style."""
    width = input_ids.shape[1]
    # max_length counts the padded width, as in transformers, so every row gets the same budget.
    settings = resolve_settings(model, config, width)
    prompts = [input_ids[i][mask[i]] for i in range(input_ids.shape[0])]
    on_block = None
    if streamer is not None:
        streamer.put(input_ids.cpu())  # the prompt first, as transformers' generate does

        def on_block(new: dict[int, torch.Tensor]) -> None:
            for tokens in new.values():
                streamer.put(tokens.cpu())

    rows = decode_ragged(model, prompts, settings, use_cache, generator, on_block=on_block)
    if streamer is not None:
        streamer.end()
    longest = max(r.shape[0] for r in rows)
    # Rows only differ in length when EOS ended some, and then pad_token_id is set (it defaults to EOS).
    out = input_ids.new_full((input_ids.shape[0], width + longest), settings.pad_token_id or 0)
    out[:, :width] = input_ids
    for i, r in enumerate(rows):
        out[i, width : width + r.shape[0]] = r
    return out


BlockCallback = Callable[[dict[int, torch.Tensor]], "set[int] | None"]


def decode_ragged(
    model,
    prompts: Sequence[torch.Tensor],
    settings: DecodeSettings,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    max_new_tokens: Sequence[int] | None = None,
    on_block: BlockCallback | None = None,
    trace: DecodingTrace | None = None,
) -> list[torch.Tensor]:
    """Block-wise decoding of prompts of any lengths in one batch (see :class:`LeftPadding`).

    Args:
        prompts: 1-D token tensors, one per row (at least one token each).
        settings: the decoding settings shared by the batch (`resolve_settings`).
        max_new_tokens: a budget per row (default: `settings.max_new_tokens` for every row).
        on_block: called after every decoded block with `{row: new tokens}` of the rows still running (tokens after
            an EOS or past the row's budget already cut); returns the rows to stop now (e.g. a stop string was
            generated, or the client went away), or `None`.
        trace: a :class:`~.trace.DecodingTrace` to fill with how every token was committed (off by default; the
            tokens are the same either way).

    Returns:
        One 1-D tensor of generated tokens per row: up to and including its first EOS, at most its budget.
    """
    B = settings.block_size
    device = prompts[0].device
    budgets = list(max_new_tokens) if max_new_tokens is not None else [settings.max_new_tokens] * len(prompts)
    lengths = torch.tensor([int(p.numel()) for p in prompts])
    full = torch.div(lengths, B, rounding_mode="floor")
    start = int(full.max()) * B  # column of the first decoded block; every row's prompt blocks end there
    pad = (start - full * B).to(device)
    own_offset = (start - full * B).tolist()  # a row's own position = its column - its padding
    if trace is not None:
        trace.begin(len(prompts), settings)
    padding = LeftPadding(pad) if bool(pad.any()) else None
    context = (CachedContext if use_cache else RecomputedContext)(model, settings, device, padding)
    if start:
        prefix = torch.zeros((len(prompts), start), dtype=prompts[0].dtype, device=device)
        for i, p in enumerate(prompts):
            prefix[i, int(pad[i]) :] = p[: int(full[i]) * B]
        context.append(prefix)
    block = torch.full((len(prompts), B), settings.mask_token_id, dtype=prompts[0].dtype, device=device)
    masked = torch.ones((len(prompts), B), dtype=torch.bool, device=device)
    tails = []
    for i, p in enumerate(prompts):
        tail = p[int(full[i]) * B :]
        block[i, : tail.numel()] = tail
        masked[i, : tail.numel()] = False
        tails.append(tail.numel())
    eos = torch.tensor(settings.eos_token_ids, dtype=block.dtype, device=device)
    generated: list[list[torch.Tensor]] = [[] for _ in prompts]
    counts = [0] * len(prompts)
    active = list(range(len(prompts)))  # original row index of each batch row
    while True:
        record = BlockRecord(masked) if trace is not None else None
        block = denoise_block(model, context, block, masked, start, settings, generator, record=record, trace=trace)
        if trace is not None:
            trace.add(active, [start - own_offset[row] for row in active], block, record)
        new, finished = {}, set()
        for j, row in enumerate(active):
            tokens = block[j, tails[j] :][: budgets[row] - counts[row]]
            hits = torch.isin(tokens, eos).nonzero()
            if len(hits):
                tokens = tokens[: int(hits[0]) + 1]
                finished.add(row)
            generated[row].append(tokens)
            counts[row] += tokens.numel()
            new[row] = tokens
            if counts[row] >= budgets[row]:
                finished.add(row)
        if on_block is not None:
            finished |= set(on_block(new) or ())
        keep = [j for j, row in enumerate(active) if row not in finished]
        if not keep:
            break
        if len(keep) < len(active):
            index = torch.tensor(keep, device=device)
            context.select(index)
            block = block[index]
            active = [active[j] for j in keep]
        context.append(block)
        start += B
        tails = [0] * len(active)
        block = torch.full_like(block, settings.mask_token_id)
        masked = torch.ones_like(block, dtype=torch.bool)
    return [torch.cat(parts) if parts else prompts[0].new_empty(0) for parts in generated]
