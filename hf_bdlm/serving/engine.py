"""The model side of the server: tokenization, limits, and decoding one batch of jobs through the model's family.

    from hf_bdlm.serving.engine import Engine
    engine = Engine.from_pretrained("outputs/smollm2-135m-bdlm-csbp")   # any family's checkpoint, or a causal LM
    ids = engine.chat_prompt([{"role": "user", "content": "Compute 2 + 2."}])

The checkpoint's family (found from its config's ``model_type``, ``hf_bdlm.models``) loads it and gives the
decoder (:class:`hf_bdlm.protocols.decoding.ServingDecoder`) that turns a request into settings and decodes batches;
`Engine.run_batch`, what the scheduler's worker thread calls, streams each job's text back block by block.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from transformers import AutoConfig

from ..embedded import default_model_dir
from ..protocols.decoding import AcceptanceCounts
from ..protocols.registry import REGISTRY, family_for_config, family_for_model
from .protocol import APIError
from .scheduler import Job, TextStream

logger = logging.getLogger(__name__)


class Engine:
    """A model, its tokenizer and its family's serving decoder, ready to decode batches of jobs.

    Args:
        model: a model of a registered family (``hf_bdlm.models``), put in eval mode.
        tokenizer: its tokenizer; chat requests need a chat template.
        name (`str`): the model id clients must send.
        decoder ([`ServingDecoder`], *optional*): how to decode; defaults to the model's family's.

    Attributes:
        acceptance ([`AcceptanceCounts`] or `None`): a speculative decoder's acceptance over every request served
            so far (`GET /health` reports it; each job counts its own); `None` for other decoders.
    """

    def __init__(self, model, tokenizer, name: str, decoder=None):
        if decoder is None:
            family = family_for_model(model)
            if family is None:
                raise TypeError(f"{type(model).__name__} is not a model of a family hf_bdlm serves; pass a model "
                                "of a registered family (hf_bdlm.models.family_names()).")
            decoder = family.role("serving").decoder(model, tokenizer)
        self.decoder = decoder
        self.model = decoder.model
        self.tokenizer = tokenizer
        self.name = name
        self.context_length = decoder.context_length
        self.acceptance = AcceptanceCounts() if decoder.speculative else None

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, name: str | None = None, dtype: torch.dtype | None = None,
                        device: str | None = None, block_size: int = 32, draft: str | os.PathLike | None = None,
                        num_speculative_tokens: int | None = None) -> "Engine":
        """Load a checkpoint folder through the family its config names (``hf_bdlm.models``); a causal-LM folder (or
        `embedded:smollm2`) is converted on the fly (``block_size``: the conversion's). With ``draft`` (a drafter
        folder), the folder is a causal LM served as it is, decoded greedily with the drafter's proposals (the
        drafter's family decides how: its drafting role, ``DraftingSpec.load_pair``), verifying
        ``num_speculative_tokens`` proposals per target forward (`None`: the drafter's default)."""
        path = str(path)
        if path == "embedded:smollm2":
            path = str(default_model_dir())
        if not Path(path).is_dir():
            raise FileNotFoundError(f"model folder {path!r} does not exist (pass a saved checkpoint folder).")
        kwargs = {"dtype": dtype} if dtype is not None else {}
        try:
            config = AutoConfig.from_pretrained(path)
        except (ValueError, KeyError) as err:
            reason = str(err).strip().split("\n")[0]
            raise ValueError(f"{path} holds a model_type={_declared_model_type(path)!r} checkpoint that transformers "
                             f"cannot read; hf-bdlm serve loads the model types {_family_model_types()} and converts "
                             f"decoder-only causal LMs. (transformers: {reason})") from None
        if num_speculative_tokens is not None and draft is None:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens} sets how many of a drafter's proposals "
                             "each target forward verifies; pass a drafter folder (--draft DIR) with it, or leave it "
                             "unset.")
        if draft is not None:
            draft = str(draft)
            if not (Path(draft) / "config.json").is_file():
                raise FileNotFoundError(f"draft folder {draft!r} holds no config.json (pass a saved drafter folder).")
            family = family_for_config(AutoConfig.from_pretrained(draft))
            model, tokenizer, decoder = family.role("drafting", draft).load_pair(path, draft, kwargs, device,
                                                                                 num_speculative_tokens)
            return cls(model, tokenizer, name or Path(path).name, decoder=decoder)
        serving = family_for_config(config).role("serving", path)
        model, tokenizer = serving.load(path, config, kwargs, block_size)
        if device:
            model = model.to(device)
        return cls(model, tokenizer, name or Path(path).name, decoder=serving.decoder(model, tokenizer))

    # --- prompts ----------------------------------------------------------------------------

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, f"model {self.name!r} has no chat template: use /v1/completions.", param="messages")
        try:
            ids = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                                     return_dict=True)["input_ids"]
        except Exception as err:  # a template that rejects the conversation (roles, order) is the client's error
            raise APIError(400, f"the chat template rejected the messages: {err}", param="messages") from None
        return list(ids)

    def text_prompt(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    @property
    def vocab_size(self) -> int:
        """Token ids the model embeds: ``0 .. vocab_size - 1``."""
        return int(self.model.get_input_embeddings().num_embeddings)

    def token_prompt(self, ids: list[int]) -> list[int]:
        """A prompt given as token ids (as lm-eval's local-completions sends it), checked against the vocabulary."""
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} in the prompt is outside the model's vocabulary of {self.vocab_size} "
                                "(0 .. vocab_size - 1): tokenize with this model's tokenizer (POST /tokenize).",
                           param="prompt")
        return list(ids)

    def tokenizer_info(self) -> dict:
        """What ``GET /tokenizer_info`` answers (vLLM's route; lm-eval's remote tokenizer reads it)."""
        tok = self.tokenizer
        template = getattr(tok, "chat_template", None)
        return {"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token, "bos_token": tok.bos_token,
                "pad_token": tok.pad_token, "unk_token": tok.unk_token, "chat_template": template,
                "model_max_length": self.context_length, "vocab_size": self.vocab_size}

    # --- settings ---------------------------------------------------------------------------

    def decode_settings(self, request, prompt_len: int, max_tokens: int):
        """The request's decoding settings (checkpoint defaults + the fields it set); bad values are a 400."""
        try:
            return self.decoder.settings(request, prompt_len, max_tokens)
        except ValueError as err:
            raise APIError(400, f"invalid decoding settings: {err}") from None

    def make_job(self, request, prompt_ids: list[int], max_tokens_limit: int, default_max_tokens: int,
                 max_prompt_tokens: int) -> Job:
        """Check the limits and build the job (no event loop attached yet)."""
        n = len(prompt_ids)
        if n == 0:
            raise APIError(400, "the prompt is empty after tokenization.", param="prompt")
        # OpenAI's wording ("This model's maximum context length is N tokens"): LiteLLM maps it to its
        # ContextWindowExceededError and agents (harbor's terminus-2) shorten their history on it.
        if n > max_prompt_tokens:
            raise APIError(400, f"This model's maximum context length is {self.context_length} tokens and this server "
                                f"accepts prompts of at most {max_prompt_tokens}; the prompt has {n} tokens.",
                           param="messages", code="context_length_exceeded")
        room = self.context_length - n
        if room < 1:
            raise APIError(400, f"This model's maximum context length is {self.context_length} tokens; the prompt has "
                                f"{n} tokens and fills it.", param="messages", code="context_length_exceeded")
        budget = request.token_budget
        if budget is None:
            budget = min(default_max_tokens, room)
        elif budget > max_tokens_limit:
            raise APIError(400, f"max_tokens={budget} exceeds this server's limit of {max_tokens_limit}.",
                           param="max_tokens")
        elif budget > room:
            raise APIError(400, f"This model's maximum context length is {self.context_length} tokens; the prompt has "
                                f"{n} and max_tokens={budget} asks for more than the {room} left.", param="max_tokens",
                           code="context_length_exceeded")
        settings = self.decode_settings(request, n, budget)
        key = self.decoder.batch_key(settings, request.seed)
        return Job(prompt_ids=prompt_ids, max_tokens=budget, settings=settings,
                   stream=TextStream(self.tokenizer, request.stop), batch_key=key, seed=request.seed)

    # --- decoding ---------------------------------------------------------------------------

    def run_batch(self, jobs: list[Job]) -> None:
        """Decode `jobs` (same batch key) together, sending each job's text after every block."""
        eos = [self.decoder.eos_token_ids(j.settings) for j in jobs]

        def on_block(new: dict) -> set[int]:
            stop = set()
            for row, tokens in new.items():
                job = jobs[row]
                if job.cancelled.is_set():
                    stop.add(row)
                    continue
                ids = tokens.tolist() if isinstance(tokens, torch.Tensor) else list(tokens)
                if self.acceptance is not None and job.completion_tokens and ids:
                    # A speculative decoder's blocks after a row's first (the prefill's token): one verification
                    # step each, committing these tokens.
                    job.acceptance.add(len(ids))
                    self.acceptance.add(len(ids))
                job.completion_tokens += len(ids)
                delta, stopped = job.stream.add(ids)
                if delta:
                    job.emit("text", delta)
                if stopped or (ids and ids[-1] in eos[row]):
                    job.finish("stop")
                    stop.add(row)
                elif job.completion_tokens >= job.max_tokens:
                    job.finish("length")
            return stop

        self.decoder.decode([j.prompt_ids for j in jobs], [j.settings for j in jobs], [j.seed for j in jobs],
                            on_block)
        for job in jobs:
            job.finish("length")  # no-op for jobs that finished already


def _declared_model_type(path: str):
    try:
        return json.loads((Path(path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def _family_model_types() -> list[str]:
    return sorted(t for entry in REGISTRY for t in entry.model_types)

