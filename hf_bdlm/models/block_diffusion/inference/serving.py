"""How `hf-bdlm serve` decodes a block-diffusion model: this project's ragged block decoder (`decode_ragged`).

    decoder = BlockDiffusionFamily().role("serving").decoder(model, tokenizer)
    settings = decoder.settings(request, prompt_len=12, max_tokens=64)   # checkpoint defaults + request fields
    decoder.decode([prompt_ids], [settings], [None], on_block)           # on_block({row: ids}) after every block

Jobs with the same decoding knobs share one ragged batch. A seeded sampling request decodes alone: its one
generator drives the whole batch, so the same seed gives the same text whatever else is being served.
"""

from __future__ import annotations

import dataclasses

import torch

from ..generation import BlockDiffusionGenerationConfig, as_block_diffusion_config, decode_ragged, resolve_settings
from ....protocols.decoding import ServingDecoder


class BlockDiffusionServingDecoder(ServingDecoder):
    """Serves a [`BlockDiffusionForMaskedLM`] with :func:`hf_bdlm.models.block_diffusion.generation.decode_ragged`."""

    def __init__(self, model, tokenizer=None, use_cache: bool = True):
        self.model = model.eval()
        self.use_cache = use_cache
        backbone = model.config.backbone_config
        self.context_length = int(getattr(backbone, "max_position_embeddings", 0) or 1 << 30)
        config = getattr(model, "generation_config", None)
        self.generation_config = as_block_diffusion_config(config) if config is not None else \
            BlockDiffusionGenerationConfig.from_model_config(model.config)
        self.device = next(model.parameters()).device

    def with_generation(self, use_cache: bool = True, **fields) -> "BlockDiffusionServingDecoder":
        """The same model decoded with ``fields`` of [`BlockDiffusionGenerationConfig`] changed (and the clean prefix
        cached or, ``use_cache=False``, recomputed at every step)."""
        other = BlockDiffusionServingDecoder.__new__(BlockDiffusionServingDecoder)
        other.__dict__.update(self.__dict__)
        other.generation_config = as_block_diffusion_config(self.generation_config)
        unused = other.generation_config.update(**fields)
        if unused:
            raise TypeError(f"not fields of BlockDiffusionGenerationConfig: {sorted(unused)}")
        other.generation_config.validate()
        other.use_cache = use_cache
        return other

    def counted_modules(self):
        return {"model": self.model.decoder, "head": self.model.get_output_embeddings()}

    def settings(self, request, prompt_len: int, max_tokens: int):
        config = as_block_diffusion_config(self.generation_config)
        updates = {"max_new_tokens": max_tokens}
        if request.temperature is not None:
            updates["do_sample"] = request.temperature > 0
            if request.temperature > 0:
                updates["temperature"] = request.temperature
        if request.top_p is not None:
            updates["top_p"] = request.top_p
        if request.confidence_threshold is not None:
            updates["confidence_threshold"] = request.confidence_threshold
        if request.steps_per_block is not None:
            updates["steps_per_block"] = request.steps_per_block
        if request.block_size is not None:
            updates["block_size"] = request.block_size
        if request.ignore_eos:
            updates["eos_token_id"] = None
        config.update(**updates)
        config.validate()
        return resolve_settings(self.model, config, prompt_len)

    def batch_key(self, settings, seed):
        key = dataclasses.replace(settings, max_new_tokens=0)
        # Seeded sampling runs alone, so that the same seed gives the same text whatever else is being served.
        return (key, object()) if settings.do_sample and seed is not None else (key,)

    def eos_token_ids(self, settings) -> set[int]:
        return set(settings.eos_token_ids)

    def padding_free_key(self, prompt_len: int, settings):
        # decode_ragged pads a row by whole blocks up to the batch's most full prompt blocks: rows with as many full
        # blocks get no padding, and their block steps have the same columns.
        return prompt_len // settings.block_size

    def decode(self, prompts, settings, seeds, on_block, trace=None) -> None:
        """As :meth:`ServingDecoder.decode`; ``trace``: a
        :class:`~hf_bdlm.models.block_diffusion.generation.trace.DecodingTrace` to record how every token was committed
        (the GRPO trainer's rollouts; the tokens are the same without it)."""
        batch = dataclasses.replace(settings[0], max_new_tokens=max(s.max_new_tokens for s in settings))
        generator = None
        if batch.do_sample and seeds[0] is not None:
            generator = torch.Generator(device=self.device).manual_seed(seeds[0])
        rows = [torch.tensor(p, dtype=torch.long, device=self.device) for p in prompts]
        with torch.no_grad():
            decode_ragged(self.model, rows, batch, use_cache=self.use_cache, generator=generator,
                          max_new_tokens=[s.max_new_tokens for s in settings], on_block=on_block, trace=trace)
