"""The model side of the server: tokenization, per-request decoding settings, and decoding one batch of jobs.

    from hf_bdlm.serving.engine import Engine
    engine = Engine.from_pretrained("outputs/smollm2-135m-bdlm-csbp")   # or a causal LM folder (converted)
    ids = engine.chat_prompt([{"role": "user", "content": "Compute 2 + 2."}])

`Engine.run_batch` is what the scheduler's worker thread calls; it streams each job's text back block by block.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import torch

from ..generation import BlockDiffusionGenerationConfig, as_block_diffusion_config, decode_ragged, resolve_settings
from .protocol import APIError
from .scheduler import Job, TextStream

logger = logging.getLogger(__name__)


class Engine:
    """A block-diffusion model and its tokenizer, ready to decode batches of jobs.

    Args:
        model ([`BlockDiffusionForMaskedLM`]): the model (put in eval mode here).
        tokenizer: its tokenizer; chat requests need a chat template.
        name (`str`): the model id clients must send.
    """

    def __init__(self, model, tokenizer, name: str):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        backbone = model.config.backbone_config
        self.context_length = int(getattr(backbone, "max_position_embeddings", 0) or 1 << 30)
        config = getattr(model, "generation_config", None)
        self.generation_config = as_block_diffusion_config(config) if config is not None else \
            BlockDiffusionGenerationConfig.from_model_config(model.config)
        self.device = next(model.parameters()).device

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, name: str | None = None, dtype: torch.dtype | None = None,
                        device: str | None = None, block_size: int = 32) -> "Engine":
        """Load a checkpoint folder through its model family (``hf_bdlm.models``); a causal-LM folder (or
        `embedded:smollm2`) is converted on the fly."""
        from transformers import AutoConfig

        import hf_bdlm  # noqa: F401  (registers the Auto classes)

        from ..models import family_for_config

        path = str(path)
        if path == "embedded:smollm2":
            from ..embedded import default_model_dir

            path = str(default_model_dir())
        if not Path(path).is_dir():
            raise FileNotFoundError(f"model folder {path!r} does not exist (pass a saved checkpoint folder).")
        kwargs = {"dtype": dtype} if dtype is not None else {}
        config = AutoConfig.from_pretrained(path)
        model, tokenizer = family_for_config(config).load_for_serving(path, config, kwargs, block_size)
        if device:
            model = model.to(device)
        return cls(model, tokenizer, name or Path(path).name)

    # --- prompts ----------------------------------------------------------------------------

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, f"model {self.name!r} has no chat template: use /v1/completions.", param="messages")
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True)["input_ids"]
        except Exception as err:  # a template that rejects the conversation (roles, order) is the client's error
            raise APIError(400, f"the chat template rejected the messages: {err}", param="messages") from None
        return list(ids)

    def text_prompt(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    # --- settings ---------------------------------------------------------------------------

    def decode_settings(self, request, prompt_len: int, max_tokens: int):
        """The request's decoding settings (checkpoint defaults + the fields it set); bad values are a 400."""
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
        if request.ignore_eos:
            updates["eos_token_id"] = None
        try:
            config.update(**updates)
            config.validate()
            return resolve_settings(self.model, config, prompt_len)
        except ValueError as err:
            raise APIError(400, f"invalid decoding settings: {err}") from None

    def make_job(self, request, prompt_ids: list[int], max_tokens_limit: int, default_max_tokens: int,
                 max_prompt_tokens: int) -> Job:
        """Check the limits and build the job (no event loop attached yet)."""
        n = len(prompt_ids)
        if n == 0:
            raise APIError(400, "the prompt is empty after tokenization.", param="prompt")
        if n > max_prompt_tokens:
            raise APIError(400, f"the prompt has {n} tokens; this server accepts at most {max_prompt_tokens}.",
                           param="messages", code="context_length_exceeded")
        room = self.context_length - n
        if room < 1:
            raise APIError(400, f"the prompt has {n} tokens and fills the model's context of {self.context_length}.",
                           param="messages", code="context_length_exceeded")
        budget = request.token_budget
        if budget is None:
            budget = min(default_max_tokens, room)
        elif budget > max_tokens_limit:
            raise APIError(400, f"max_tokens={budget} exceeds this server's limit of {max_tokens_limit}.",
                           param="max_tokens")
        elif budget > room:
            raise APIError(400, f"this model's context is {self.context_length} tokens; the prompt has {n} and "
                                f"max_tokens={budget} asks for more than the {room} left.", param="max_tokens",
                           code="context_length_exceeded")
        settings = self.decode_settings(request, n, budget)
        key_settings = dataclasses.replace(settings, max_new_tokens=0)
        # Seeded sampling runs alone, so that the same seed gives the same text whatever else is being served.
        seeded = settings.do_sample and request.seed is not None
        key = (key_settings, object()) if seeded else (key_settings,)
        return Job(prompt_ids=prompt_ids, max_tokens=budget, settings=settings,
                   stream=TextStream(self.tokenizer, request.stop), batch_key=key, seed=request.seed)

    # --- decoding ---------------------------------------------------------------------------

    def run_batch(self, jobs: list[Job]) -> None:
        """Decode `jobs` (same batch key) in one ragged batch, sending each job's text after every block."""
        settings = dataclasses.replace(jobs[0].settings, max_new_tokens=max(j.max_tokens for j in jobs))
        eos = set(settings.eos_token_ids)
        generator = None
        if settings.do_sample and jobs[0].seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(jobs[0].seed)

        def on_block(new: dict[int, torch.Tensor]) -> set[int]:
            stop = set()
            for row, tokens in new.items():
                job = jobs[row]
                if job.cancelled.is_set():
                    stop.add(row)
                    continue
                ids = tokens.tolist()
                job.completion_tokens += len(ids)
                delta, stopped = job.stream.add(ids)
                if delta:
                    job.emit("text", delta)
                if stopped or (ids and ids[-1] in eos):
                    job.finish("stop")
                    stop.add(row)
                elif job.completion_tokens >= job.max_tokens:
                    job.finish("length")
            return stop

        prompts = [torch.tensor(j.prompt_ids, dtype=torch.long, device=self.device) for j in jobs]
        with torch.no_grad():
            decode_ragged(self.model, prompts, settings, generator=generator,
                          max_new_tokens=[j.max_tokens for j in jobs], on_block=on_block)
        for job in jobs:
            job.finish("length")  # no-op for jobs that finished already
