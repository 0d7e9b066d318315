"""How `hf-bdlm serve` decodes DiffusionGemma: transformers' own `generate`, one canvas at a time per request.

`DiffusionGemmaForBlockDiffusion.generate` has no per-block callback that can stop a row (its streamer only
receives tokens), and its sampler draws from the global random generator: the first canvas and every renoising are
uniform draws, every denoising step a multinomial one, for the whole batch at once. So a batch of requests would
change each one's draws, and a row that finished denoising early would still consume them. Instead, each request is
a batch of one driven through generate's own steps (``_prepare_encoder_inputs``, the encoder,
``_prepare_denoiser_inputs``, ``_denoising_step``, ``_finalize_canvas``, ``_prepare_kwargs_for_next_canvas``), in
generate's order, with the global generator set to the request's own state around its steps. The requests of a
batch take turns, one canvas each, so they all stream; a request answers token for token what

    torch.manual_seed(seed); model.generate(prompt_ids, max_new_tokens=max_tokens)

gives (cut at the first EOS and at ``max_tokens``), whatever else is being served. The price: the rows of a batch
do not share forward passes (their caches, canvases and adaptive stops are their own).

    decoder = DiffusionGemmaServingDecoder(model, tokenizer)
    settings = decoder.settings(request, prompt_len=12, max_tokens=64)
    decoder.decode([prompt_ids], [settings], [seed], on_block)   # on_block({row: ids}) after every canvas
"""

from __future__ import annotations

import logging
import math
import secrets
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation.configuration_utils import ALL_STATIC_CACHE_IMPLEMENTATIONS

from ....protocols.decoding import ServingDecoder

logger = logging.getLogger(__name__)

SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.manual_seed accepts


@dataclass(frozen=True)
class DiffusionGemmaServingSettings:
    """One request's `generate` arguments: ``max_new_tokens`` and ``overrides`` (other generation-config fields the
    request set), and the EOS ids that end its completion."""

    max_new_tokens: int
    overrides: tuple[tuple[str, Any], ...] = ()
    eos_token_ids: tuple[int, ...] = ()

    def generate_kwargs(self) -> dict[str, Any]:
        return {"max_new_tokens": self.max_new_tokens, **dict(self.overrides)}


class DiffusionGemmaServingDecoder(ServingDecoder):
    """Serves a `DiffusionGemmaForBlockDiffusion` with its own `generate` semantics (module docstring).

    Request fields: ``steps_per_block`` sets ``max_denoising_steps`` and ``confidence_threshold`` the adaptive stop's
    entropy threshold; ``ignore_eos`` drops the EOS ids; ``seed`` seeds the request's random stream. ``temperature``
    does not change the sampler (its temperature schedule ``t_max`` -> ``t_min`` comes from the generation config),
    and ``top_p`` below 1 is refused (the entropy-bound sampler has no nucleus); ``block_size`` must be the
    checkpoint's canvas length.
    """

    def __init__(self, model, tokenizer=None):
        self.model = model.eval()
        text = model.config.get_text_config()
        self.context_length = int(getattr(text, "max_position_embeddings", 0) or 1 << 30)
        self.device = next(model.parameters()).device
        self.base_overrides: dict[str, Any] = {}
        cache = getattr(model.generation_config, "cache_implementation", None)
        if cache in ALL_STATIC_CACHE_IMPLEMENTATIONS:
            # generate keeps one static cache on the model; requests taking turns need a cache each.
            logger.warning("serving with a dynamic cache instead of the generation config's %r (requests take "
                           "turns, each with its own cache)", cache)
            self.base_overrides["cache_implementation"] = None

    def with_overrides(self, **fields) -> "DiffusionGemmaServingDecoder":
        """The same model decoded with these generation-config fields (e.g. ``max_denoising_steps``) by default."""
        other = DiffusionGemmaServingDecoder.__new__(DiffusionGemmaServingDecoder)
        other.__dict__.update(self.__dict__)
        other.base_overrides = {**self.base_overrides, **fields}
        return other

    def counted_modules(self):
        # generate's denoising steps call the model's bound forward (no module hook fires there), which runs the
        # decoder over one canvas: the decoder is what counts; the encoder runs the tokens not cached yet, once per
        # canvas.
        return {"model": self.model.model.decoder, "encoder": self.model.model.encoder,
                "head": self.model.get_output_embeddings()}

    # --- settings -----------------------------------------------------------------------------------------------
    def settings(self, request, prompt_len: int, max_tokens: int) -> DiffusionGemmaServingSettings:
        if request.top_p is not None and request.top_p < 1:
            raise ValueError(f"top_p={request.top_p} is not supported: DiffusionGemma's entropy-bound sampler keeps "
                             "the whole distribution; leave top_p unset.")
        if request.seed is not None and not SEED_RANGE[0] <= request.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed={request.seed} is outside [-2**63, 2**64 - 1].")
        canvas = self.model.config.canvas_length
        if request.block_size is not None and request.block_size != canvas:
            raise ValueError(f"block_size={request.block_size}: DiffusionGemma decodes canvases of {canvas} tokens, "
                             "the checkpoint's canvas_length; leave block_size unset.")
        overrides = dict(self.base_overrides)
        if request.steps_per_block is not None:
            overrides["max_denoising_steps"] = int(request.steps_per_block)
        if request.confidence_threshold is not None:
            overrides["confidence_threshold"] = float(request.confidence_threshold)
        if request.ignore_eos:
            overrides["eos_token_id"] = None
        settings = DiffusionGemmaServingSettings(max_tokens, tuple(sorted(overrides.items())))
        config, _ = self.model._prepare_generation_config(None, **settings.generate_kwargs())  # raises on bad values
        eos = config.eos_token_id
        eos = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        return DiffusionGemmaServingSettings(max_tokens, settings.overrides, eos)

    def batch_key(self, settings, seed):
        return ()  # every request decodes on its own random stream: any requests may share a batch

    def padding_free_key(self, prompt_len: int, settings):
        return ()  # each request runs as a batch of one: nothing is ever padded

    def eos_token_ids(self, settings) -> set[int]:
        return set(settings.eos_token_ids)

    # --- decoding -----------------------------------------------------------------------------------------------
    def decode(self, prompts, settings, seeds, on_block) -> None:
        rows = {}
        for i, (prompt, s, seed) in enumerate(zip(prompts, settings, seeds)):
            seed = secrets.randbits(63) if seed is None else seed
            rows[i] = _Request(self.model, torch.tensor([prompt], dtype=torch.long, device=self.device), s,
                               self._seeded_state(seed))
        while rows:
            for i in list(rows):
                row = rows[i]
                with self._random_state(row):
                    tokens = row.next_canvas()
                stop = (on_block({i: tokens}) or set()) if tokens else set()
                if row.finished or i in stop:
                    del rows[i]

    def _rng_devices(self) -> list[int]:
        return [self.device.index or 0] if self.device.type == "cuda" else []

    def _seeded_state(self, seed: int) -> tuple:
        """The global generators' states right after ``torch.manual_seed(seed)`` (a fresh generator seeded alike has
        the same state), without touching the global ones."""
        cuda = [torch.Generator(device=f"cuda:{d}").manual_seed(seed).get_state() for d in self._rng_devices()]
        return torch.Generator().manual_seed(seed).get_state(), cuda

    def _get_state(self) -> tuple:
        cuda = [torch.cuda.get_rng_state(d) for d in self._rng_devices()]
        return torch.get_rng_state(), cuda

    @contextmanager
    def _random_state(self, row: "_Request"):
        """Run a request's steps on its own random stream; the caller's generators are left as they were."""
        with torch.random.fork_rng(devices=self._rng_devices()):
            cpu, cuda = row.random_state
            torch.set_rng_state(cpu)
            for device, state in zip(self._rng_devices(), cuda):
                torch.cuda.set_rng_state(state, device)
            yield
            row.random_state = self._get_state()


class _Request:
    """One request in the middle of ``generate``: its state between two canvases, for a batch of one.

    `next_canvas` is one iteration of the outer loop of ``DiffusionGemmaGenerationMixin.generate`` (steps 1.a to
    1.f of its docstring), written with the same calls in the same order; keep the two in step."""

    def __init__(self, model, input_ids: torch.Tensor, settings: DiffusionGemmaServingSettings, random_state):
        self.model, self.input_ids, self.random_state = model, input_ids, random_state
        self.budget, self.eos, self.sent = settings.max_new_tokens, set(settings.eos_token_ids), 0
        config, self.model_kwargs = model._prepare_generation_config(None, **settings.generate_kwargs())
        self.config = config
        batch_size, self.cur_len = input_ids.shape
        max_length, max_new_tokens = model._prepare_generated_length(config, self.cur_len)
        self.canvases_left = math.ceil(max_new_tokens / model.config.canvas_length)
        device = input_ids.device
        self.canvas_length = model.config.canvas_length
        self.finished_sequences = torch.zeros(batch_size, dtype=torch.bool, device=device)
        self.cache = model._prepare_cache_for_generation(generation_config=config, batch_size=batch_size,
                                                         max_length=max_length)
        if self.cache.is_compileable and not config.disable_compile:
            raise ValueError("a compiled (static) cache cannot serve requests that take turns; unset the "
                             "generation config's cache_implementation.")
        self.eos_tensor = None if config.eos_token_id is None else torch.tensor(config.eos_token_id, device=device)
        self.encoder_position_ids = torch.arange(0, self.cur_len, dtype=torch.int32, device=device).unsqueeze(0)
        self.decoder_position_ids = torch.arange(self.cur_len, self.cur_len + self.canvas_length, dtype=torch.int32,
                                                 device=device).unsqueeze(0)
        self.attention_mask = torch.ones((batch_size, self.cur_len), dtype=torch.bool, device=device)
        self.decoder_attention_mask = torch.nn.functional.pad(self.attention_mask, (0, self.canvas_length),
                                                              value=True)
        self.sampler = model._prepare_sampler(config)
        self.logits_processor = model._prepare_logits_processor(config, None)
        self.stopping_criteria = model._prepare_ar_stopping_criteria(config, None)
        self.diffusion_stopping_criteria = model._prepare_diffusion_stopping_criteria(config)
        self.is_prefill = True
        self.finished = False

    @torch.no_grad()
    def next_canvas(self) -> list[int]:
        """Denoise the next canvas; returns its tokens that belong to the completion (up to the first EOS and the
        token budget) and sets `finished` when the request needs no further canvas."""
        model, batch_size = self.model, self.input_ids.shape[0]
        # 1.a. Encode the tokens not cached yet.
        unprocessed_input_ids, encoder_mask_mapping = model._prepare_encoder_inputs(
            input_ids=self.input_ids, attention_mask=self.attention_mask,
            encoder_position_ids=self.encoder_position_ids, cache=self.cache, is_prefill=self.is_prefill,
            canvas_length=self.canvas_length, batch_size=batch_size, **self.model_kwargs)
        encoder_outputs = model.model.encoder(input_ids=unprocessed_input_ids, attention_mask=encoder_mask_mapping,
                                              cache=self.cache, position_ids=self.encoder_position_ids,
                                              **self.model_kwargs)
        self.cache = encoder_outputs.cache
        self.is_prefill = False
        # 1.b. A random canvas (the first draw of this canvas from the request's stream).
        current_canvas, self_conditioning_logits, mask_mapping, finished_denoising = model._prepare_denoiser_inputs(
            decoder_attention_mask=self.decoder_attention_mask, cache=self.cache, sampler=self.sampler,
            diffusion_stopping_criteria=self.diffusion_stopping_criteria, batch_size=batch_size,
            device=self.input_ids.device, model_kwargs=self.model_kwargs)
        argmax_canvas = current_canvas
        # 1.c. Denoising steps, N down to 1, until the adaptive stop.
        for cur_step in reversed(range(1, self.config.max_denoising_steps + 1)):
            current_canvas, argmax_canvas, self_conditioning_logits, finished_denoising = model._denoising_step(
                decoder_forward=model.forward, current_canvas=current_canvas, argmax_canvas=argmax_canvas,
                input_ids=self.input_ids, decoder_position_ids=self.decoder_position_ids,
                self_conditioning_logits=self_conditioning_logits, mask_mapping=mask_mapping, cache=self.cache,
                finished_denoising=finished_denoising, cur_step=cur_step, sampler=self.sampler,
                logits_processor=self.logits_processor, diffusion_stopping_criteria=self.diffusion_stopping_criteria,
                **self.model_kwargs)
            if torch.all(finished_denoising):
                break
        # 1.d. / 1.e. Append the canvas; EOS and length criteria.
        self.input_ids = torch.cat([self.input_ids, argmax_canvas], dim=-1)
        self.input_ids, self.finished_sequences = model._finalize_canvas(
            input_ids=self.input_ids, finished_sequences=self.finished_sequences, generation_config=self.config,
            stopping_criteria=self.stopping_criteria, canvas_length=self.canvas_length, eos_tensor=self.eos_tensor)
        self.canvases_left -= 1
        tokens = self._completion_part(self.input_ids[0, -self.canvas_length:].tolist())
        if self.finished or torch.all(self.finished_sequences) or self.canvases_left == 0:
            self.finished = True
            return tokens
        # 1.f. Inputs of the next canvas.
        (self.cur_len, self.decoder_attention_mask, self.attention_mask, self.encoder_position_ids,
         self.decoder_position_ids) = model._prepare_kwargs_for_next_canvas(
            attention_mask=self.attention_mask, decoder_attention_mask=self.decoder_attention_mask,
            decoder_position_ids=self.decoder_position_ids, canvas_length=self.canvas_length, cur_len=self.cur_len)
        return tokens

    def _completion_part(self, canvas: list[int]) -> list[int]:
        """The canvas's tokens up to the first EOS (kept) and the budget left; sets `finished` at either."""
        for at, token in enumerate(canvas):
            if token in self.eos:
                canvas = canvas[: at + 1]
                self.finished = True
                break
        if self.sent + len(canvas) >= self.budget:
            canvas = canvas[: self.budget - self.sent]
            self.finished = True
        self.sent += len(canvas)
        return canvas
