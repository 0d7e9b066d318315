"""How `hf-bdlm serve TARGET --draft DIR` decodes: the causal target's own greedy decoding, sped up by a DFlash drafter.

Each batch of requests runs one :class:`~.speculative.SpeculativeSession` (left-padded prompts, one shared target
cache): every target forward verifies a drafted block for every row and commits 1 to ``B`` tokens per row, which
stream as one chunk. Whatever the drafter proposes, every committed token is the target's argmax after the tokens
before it, so a completion is token for token ``target.generate(prompt_ids, do_sample=False, max_new_tokens=...)``,
alone or batched. ``--num-speculative-tokens N`` verifies the first ``N`` proposals of each drafted block (default
``B - 1``). Sampling is refused (``temperature`` above 0, ``top_p`` below 1): serve without ``--draft`` to
sample. The diffusion fields (``steps_per_block``, ``confidence_threshold``) do not apply and are refused too.
A row's first block is the prefill's token and each later one what a verification forward committed, so the server
counts each request's acceptance (``usage.speculative``, ``/health``): the number `DFlashTrainer`'s eval replays
on held-out captured features (:mod:`.acceptance`).

    engine = Engine.from_pretrained("path/to/causal-lm", draft="runs/drafter")   # what serve --draft builds
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ....checkpoints.files import load_pretrained
from ....protocols.decoding import ServingDecoder
from ..configuration import DFlashConfig
from ..target import drafter_class
from .speculative import SpeculativeSession, check_drafter_for_target, speculative_token_count


@dataclass(frozen=True)
class SpeculativeSettings:
    """One request's budget and the EOS ids that end it."""

    max_new_tokens: int
    eos_token_ids: tuple[int, ...] = ()


class SpeculativeServingDecoder(ServingDecoder):
    """Serves a causal LM ``target`` with greedy speculative decoding through ``drafter`` (module docstring). Each
    block after a request's first is one verification forward: the server counts its acceptance from them."""

    speculative = True

    def __init__(self, target, drafter, tokenizer=None, num_speculative_tokens: int | None = None):
        check_drafter_for_target(target, drafter)
        self.num_speculative_tokens = speculative_token_count(num_speculative_tokens, int(drafter.config.block_size))
        self.model, self.drafter = target.eval(), drafter.eval()
        text = target.config.get_text_config()
        self.context_length = int(getattr(text, "max_position_embeddings", 0) or 1 << 30)
        eos = target.generation_config.eos_token_id
        self.default_eos = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        pad = target.generation_config.pad_token_id
        if pad is None and tokenizer is not None:
            pad = tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else (self.default_eos[0] if self.default_eos else 0)

    def with_proposals(self, num_speculative_tokens: int) -> "SpeculativeServingDecoder":
        """The same target and drafter, verifying ``num_speculative_tokens`` proposals per step."""
        other = SpeculativeServingDecoder.__new__(SpeculativeServingDecoder)
        other.__dict__.update(self.__dict__)
        other.num_speculative_tokens = speculative_token_count(num_speculative_tokens,
                                                               int(self.drafter.config.block_size))
        return other

    def counted_modules(self):
        # The target's body (one forward per verification, and the prefill); its head, called as a module by the
        # verifications and by the drafter's proposals alike (DFlashDraftModel.compute_logits), so each call counts;
        # the drafter's layers (its first: one call per drafted block, the others each a part of their own) and its
        # context projection `fc` (one call per append of the target's features to its context cache).
        parts = {"model": self.model.get_decoder(), "head": self.model.get_output_embeddings()}
        for i, layer in enumerate(self.drafter.layers):
            parts["drafter" if i == 0 else f"drafter layer {i}"] = layer
        parts["drafter context"] = self.drafter.fc
        return parts

    def settings(self, request, prompt_len: int, max_tokens: int) -> SpeculativeSettings:
        if request.temperature is not None and request.temperature > 0:
            raise ValueError(f"temperature={request.temperature}: a server with a drafter decodes greedily (the "
                             "target's own greedy output, sped up); send temperature 0 or serve without --draft to "
                             "sample.")
        if request.top_p is not None and request.top_p < 1:
            raise ValueError(f"top_p={request.top_p}: a server with a drafter decodes greedily; leave top_p unset.")
        for field in ("steps_per_block", "confidence_threshold", "block_size"):
            if getattr(request, field) is not None:
                raise ValueError(f"{field} is a block-diffusion decoding setting; this server decodes a causal LM "
                                 "with a drafter. Leave it unset.")
        return SpeculativeSettings(max_tokens, () if request.ignore_eos else self.default_eos)

    def batch_key(self, settings, seed):
        return (settings.eos_token_ids,)  # greedy: the seed changes nothing; rows of a batch share the EOS ids

    def eos_token_ids(self, settings) -> set[int]:
        return set(settings.eos_token_ids)

    @torch.no_grad()
    def decode(self, prompts, settings, seeds, on_block) -> None:
        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), int(self.pad_token_id), dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long, device=device)
            mask[row, width - len(prompt):] = 1
        budgets = [s.max_new_tokens for s in settings]
        session = SpeculativeSession(self.model, self.drafter, ids, mask, max_new_tokens=max(budgets),
                                     eos_token_id=list(settings[0].eos_token_ids), pad_token_id=int(self.pad_token_id),
                                     num_speculative_tokens=self.num_speculative_tokens)
        sent = [0] * len(prompts)
        new = session.new_tokens
        while True:
            chunk, ended = {}, set()
            for row, tokens in new.items():
                tokens = tokens[:budgets[row] - sent[row]]  # a row's own budget (the session runs to the largest)
                if tokens:
                    chunk[row] = tokens
                    sent[row] += len(tokens)
                if sent[row] >= budgets[row]:
                    ended.add(row)
            stop = set((on_block(chunk) or ()) if chunk else ()) | ended
            session.stop(stop)
            if session.done:
                return
            new = session.step()


def load_speculative(target_path: str, draft_path: str, init_kwargs: dict, device: str | None = None,
                     num_speculative_tokens: int | None = None):
    """The causal ``target_path`` and the drafter at ``draft_path`` bound to it, on ``device``; returns ``(target,
    tokenizer, decoder)``. ``init_kwargs`` go to both ``from_pretrained`` calls (``dtype``); the decoder verifies
    ``num_speculative_tokens`` proposals per step (`None`: the drafter's ``B - 1``)."""
    config = DFlashConfig.from_pretrained(draft_path)
    speculative_token_count(num_speculative_tokens, int(config.block_size))  # before loading anything
    target = load_pretrained(AutoModelForCausalLM.from_pretrained, target_path, **init_kwargs)
    target = target.eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    drafter = load_pretrained(drafter_class(config).from_pretrained, draft_path, **init_kwargs)
    if device:
        target, drafter = target.to(device), drafter.to(device)
    drafter.bind_target(target)
    return target, tokenizer, SpeculativeServingDecoder(target, drafter, tokenizer, num_speculative_tokens)
