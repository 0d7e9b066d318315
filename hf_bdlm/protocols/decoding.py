"""What the server needs to decode one family's model: `ServingDecoder`, the request fields it reads
(`DecodingRequest`), the named ways of decoding a benchmark compares (`DecodingVariant`), and speculative decoding's
`AcceptanceCounts`. A family's serving role (:class:`hf_bdlm.protocols.roles.ServingSpec`) hands out its decoder."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar


class ServingDecoder:
    """What the server (``hf_bdlm.serving.engine.Engine``) needs to decode one family's model; it never names a family.

    The engine owns tokenization, limits, the job queue and streaming; the decoder owns the request's decoding
    settings and the decoding loop. Per request, the engine calls :meth:`settings`, groups jobs whose
    :meth:`batch_key` is equal, and hands each group to :meth:`decode`, which reports every decoded block through
    ``on_block`` and drops the rows ``on_block`` stops (end of text, stop string, cancelled client).

    Attributes:
        model: the model (in eval mode).
        context_length (`int`): most tokens (prompt + completion) the model takes.
        speculative (`bool`): the decoder is greedy speculative decoding: a row's first block is the prefill's
            token, and each later block is what one target forward, verifying drafted tokens, committed. The server
            then counts each row's acceptance (:class:`AcceptanceCounts`) and reports it in the usage.
    """

    model: Any
    context_length: int
    speculative: ClassVar[bool] = False

    def settings(self, request, prompt_len: int, max_tokens: int):
        """The settings of one request (the checkpoint's generation config + the fields the request sets, the
        attributes of :class:`DecodingRequest`), with ``settings.max_new_tokens == max_tokens``; a ``ValueError``
        names what the client must change (a 400)."""
        raise NotImplementedError

    def batch_key(self, settings, seed: int | None):
        """Jobs with equal keys may be decoded together (a hashable value)."""
        raise NotImplementedError

    def eos_token_ids(self, settings) -> set[int]:
        """Token ids that end a completion under ``settings`` (empty when the request ignores EOS)."""
        raise NotImplementedError

    def padding_free_key(self, prompt_len: int, settings):
        """Jobs of equal batch keys *and* equal padding-free keys decode together without padding, so that each
        one's tokens do not depend on the others (lm-eval's batch invariance). Default: every job decodes apart."""
        return object()

    def decode(self, prompts: list[list[int]], settings: list, seeds: list[int | None], on_block) -> None:
        """Decode ``prompts`` (one row each, up to ``settings[row].max_new_tokens`` tokens) together.

        After every block it calls ``on_block({row: new_token_ids})`` (a list or 1-D tensor per row that produced
        tokens); ``on_block`` returns the rows to stop, which are decoded no further. A row ends by itself at EOS or
        at its token budget."""
        raise NotImplementedError

    def counted_modules(self) -> dict[str, Any]:
        """The modules whose forward calls are this decoder's model passes, by role: ``"model"`` (the forwards that
        produce tokens: tokens per forward count these), ``"head"`` (the LM head, over the rows it scores), and any
        other the family runs (a drafter, an encoder). ``hf-bdlm bench --only decoding`` counts their calls and rows
        and times them, for its cost model."""
        return {"model": self.model}


@dataclass
class AcceptanceCounts:
    """The acceptance of greedy speculative decoding, counted one way wherever it is measured: by the server per
    request (``hf-bdlm serve --draft``, in the usage and ``/health``) and by a drafter's trainer on held-out data
    (its eval replays the verification steps serving would run).

    A verification step is one target forward after the prefill, for one request; it commits ``n >= 1`` tokens
    (the proposals it accepted, then the target's own token), cut where the request ends (its EOS or its token
    budget): only tokens the request returns count.

    Attributes:
        verification_steps (`int`): verification steps.
        accepted_tokens (`int`): committed tokens beyond each step's first (accepted proposals).
    """

    verification_steps: int = 0
    accepted_tokens: int = 0

    def add(self, committed: int) -> None:
        """Count one verification step that committed ``committed`` tokens (>= 1)."""
        if committed < 1:
            raise ValueError(f"a verification step commits at least one token (the target's own), got {committed}.")
        self.verification_steps += 1
        self.accepted_tokens += committed - 1

    def merge(self, other: "AcceptanceCounts") -> None:
        """Add the counts of ``other`` (another request, another rank's share)."""
        self.verification_steps += other.verification_steps
        self.accepted_tokens += other.accepted_tokens

    @property
    def acceptance_length(self) -> float:
        """Tokens committed per verification step, in ``[1, B]`` (0.0 before any step): ``1 + accepted /
        steps``, the acceptance length vLLM and SGLang report."""
        steps = self.verification_steps
        return (steps + self.accepted_tokens) / steps if steps else 0.0

    def as_dict(self) -> dict:
        return {"verification_steps": self.verification_steps, "accepted_tokens": self.accepted_tokens,
                "acceptance_length": self.acceptance_length}


@dataclass(frozen=True)
class DecodingVariant:
    """One named way of decoding a model, measured by ``hf-bdlm bench --only decoding``.

    Attributes:
        decoder (`ServingDecoder`): decodes the model with this variant's settings.
        ignore_eos (`bool`): decode every request's whole token budget, then cut the text at its first EOS (what a
            decoder that does not stop at EOS delivers, at that decoder's cost).
        reference (`bool`): the family's most careful setting (one token per step); every variant's agreement is
            measured against its outputs.
        baseline (`str`): the variant this one adds one technique to (its gain is measured against it), or ``""``.
        description (`str`): what it does, for the table.
    """

    decoder: "ServingDecoder"
    ignore_eos: bool = False
    reference: bool = False
    baseline: str = ""
    description: str = ""



@dataclass(frozen=True)
class DecodingRequest:
    """The decoding fields of one request that :meth:`ServingDecoder.settings` reads (the server's parsed request
    carries the same attributes; lm-eval's ``--model bdlm`` builds this one). ``None``: the checkpoint's default."""

    temperature: float | None = None
    top_p: float | None = None
    confidence_threshold: float | None = None
    steps_per_block: int | None = None
    block_size: int | None = None
    ignore_eos: bool = False
    seed: int | None = None


__all__ = ["AcceptanceCounts", "DecodingRequest", "DecodingVariant", "ServingDecoder"]
