"""Lossless speculative decoding with a DFlash drafter: the target verifies a whole drafted block per forward.

Each step, the *anchor* is the last token the target produced (not yet run through it). The drafter reads the
target's hidden states at its ``target_layer_ids`` for every token before the anchor and proposes the ``B - 1``
tokens after it in one forward. The target runs ``[anchor, proposals]`` in one forward, keeps the longest prefix of
proposals equal to its own greedy choice, plus its own next token (the next anchor). Every kept token is the
target's argmax after the tokens before it, so the output is the target's greedy decoding whatever the drafter
proposes; the drafter only decides how many tokens one target forward yields (1 to ``B``). The target's features
for the drafter come from that same verification forward (``output_hidden_states=[ids]`` keeps only the drafter's
layers): the target never runs twice. The drafter keeps its projected context in a
:class:`~.modeling.DFlashContextCache`: each committed row is projected once, when the target keeps it, and a draft
step runs only the block itself and the head over its ``B - 1`` drafted rows.

Both verify ``num_speculative_tokens`` proposals per step (``1 .. B - 1``, default ``B - 1``, vLLM's name for the
same knob): the drafter always drafts its whole block, and the target verifies the first ``num_speculative_tokens``
of it. Where a target forward costs more with more rows (a CPU), fewer proposals can decode faster.

Two entry points, both greedy and token for token ``target.generate(input_ids, do_sample=False, ...)``:

* transformers' own assisted-generation loop, batch size 1, through ``custom_generate`` (any ``generate`` argument
  works as usual: ``max_new_tokens``, ``eos_token_id``, ``stopping_criteria``, ``return_dict_in_generate``...)::

      from hf_bdlm.models.dflash.inference.speculative import dflash_assisted_decoding
      out = target.generate(input_ids, custom_generate=dflash_assisted_decoding, drafter=drafter, max_new_tokens=64)

  (:class:`DFlashCandidateGenerator` is the ``CandidateGenerator`` it plugs into ``_assisted_decoding``.)
* :func:`speculative_generate`, this project's loop: batches of prompts of different lengths (left padding), and
  statistics (target / draft forwards, mean acceptance length, wall time)::

      sequences, stats = speculative_generate(target, drafter, input_ids, attention_mask, max_new_tokens=64)

A tiny CPU example (a random drafter proposes poorly, but the output is still the target's own)::

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from hf_bdlm.models.dflash.modeling import DFlash2DraftModel
    from hf_bdlm.models.dflash.inference.speculative import speculative_generate
    target = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=64)).eval()
    drafter = DFlash2DraftModel.from_target(target, init="scratch", block_size=4, mask_token_id=63).eval()
    ids = torch.tensor([[1, 5, 7, 9]])
    sequences, stats = speculative_generate(target, drafter, ids, max_new_tokens=12)
    assert torch.equal(sequences, target.generate(ids, do_sample=False, max_new_tokens=12))

Sampling: :func:`speculative_generate` is greedy only. Through ``generate``, ``do_sample=True`` is accepted and stays
exactly distributed as the target's own sampling (transformers keeps a draft token only when the target's sample
at that position equals it), but it is not sample-for-sample reproducible against plain ``generate``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache, GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList

from ..modeling import DFlashContextCache

if TYPE_CHECKING:
    from ..modeling import DFlashDraftModel

__all__ = [
    "DFlashCandidateGenerator",
    "SpeculativeSession",
    "SpeculativeStats",
    "check_drafter_for_target",
    "dflash_assisted_decoding",
    "draft_block",
    "draft_from_cache",
    "speculative_generate",
    "target_features",
]


# --- shared pieces --------------------------------------------------------------------------------------------------


def check_drafter_for_target(target: PreTrainedModel, drafter: "DFlashDraftModel") -> tuple[int, ...]:
    """Check that `drafter` can draft for `target` and return its canonical target layer ids.

    Raises:
        `ValueError`: a layer id outside the target's hidden states, a vocabulary or width mismatch, or a block size
            below 2, with the values found and what to do.
    """
    text = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    dconfig = drafter.config
    layer_ids = tuple(int(i) for i in dconfig.target_layer_ids)
    depth = int(text.num_hidden_layers)
    bad = [i for i in layer_ids if not 0 <= i <= depth]
    if bad:
        raise ValueError(
            f"drafter target_layer_ids {list(layer_ids)} include {bad}, outside the target's hidden states 0..{depth} "
            f"(canonical ids: 0 = embeddings, i = output of decoder layer i - 1; the target has {depth} layers). "
            "This drafter was built for a deeper target: use the target it was trained on.")
    built_for = getattr(dconfig, "num_target_layers", None)
    if built_for is not None and int(built_for) != depth:
        raise ValueError(f"the drafter was built for a target with {built_for} decoder layers; this target has "
                         f"{depth}. Use the target it was trained on.")
    if int(dconfig.vocab_size) != int(text.vocab_size):
        raise ValueError(
            f"drafter vocab_size {dconfig.vocab_size} != target vocab_size {text.vocab_size}: the drafter embeds and "
            "reads out through the target's own embedding and LM head, so it needs the target it was built for "
            "(`DFlashDraftModel.from_target(target)` / `drafter.bind_target(target)`).")
    width = int(getattr(dconfig, "target_hidden_size", None) or text.hidden_size)
    if width != int(text.hidden_size):
        raise ValueError(
            f"drafter target_hidden_size {width} != target hidden_size {text.hidden_size}: the drafter's `fc` reads "
            f"{len(layer_ids)} x {width} features; use the target it was built for.")
    if int(dconfig.block_size) < 2:
        raise ValueError(f"drafter block_size {dconfig.block_size} < 2: a block needs the anchor and one proposal.")
    return layer_ids


def target_features(hidden_states: Sequence[torch.Tensor | None], layer_ids: Sequence[int]) -> torch.Tensor:
    """The drafter's input features: ``hidden_states[i]`` for ``i`` in `layer_ids`, concatenated on the last dim.

    `hidden_states` is the tuple of a target forward run with ``output_hidden_states=list(layer_ids)`` (transformers
    then fills only those entries) or ``True``; the ids are canonical (0 = embeddings).
    """
    missing = [i for i in layer_ids if i >= len(hidden_states) or hidden_states[i] is None]
    if missing:
        raise ValueError(f"the target forward returned no hidden state for layer ids {missing}; run it with "
                         f"output_hidden_states={list(layer_ids)}.")
    return torch.cat([hidden_states[i] for i in layer_ids], dim=-1)


def draft_block(drafter: "DFlashDraftModel", features: torch.Tensor, tokens: torch.Tensor,
                anchors: torch.Tensor) -> torch.LongTensor:
    """The drafter's greedy proposals for the ``B - 1`` positions after each row's anchor, from the whole context's
    features (projected again at each call: the decoding loops draft from a context cache, :func:`draft_from_cache`).

    Args:
        drafter (`DFlashDraftModel`):
            The drafter, bound to the target.
        features (`torch.Tensor` of shape `(batch_size, T, n_layers * target_hidden)`):
            Target features of positions ``0 .. T-1``; a row's entries at or after its anchor are never read (the
            block sees the context strictly before its anchor), so rows of different lengths share one padded tensor.
        tokens (`torch.LongTensor` of shape `(batch_size, L)`):
            The committed tokens (position ``i`` at column ``i``).
        anchors (`torch.LongTensor` of shape `(batch_size,)`):
            Each row's anchor position (``< L``).

    Returns:
        `torch.LongTensor` of shape `(batch_size, B - 1)`: the proposed tokens for positions ``anchor + 1 ..
        anchor + B - 1``. A drafter with a candidate selector (DFlash2) picks them by its greedy path over each
        position's top-k candidates, conditioned on the previous pick; otherwise each is the argmax of its logits.
    """
    dtype = next(drafter.parameters()).dtype
    out = drafter(target_hidden_states=features.to(dtype), input_ids=tokens, anchor_positions=anchors[:, None],
                  return_logits=False)
    # Block slot k (k >= 1) predicts the token at anchor + k; slot 0 holds the anchor itself: no head over it.
    hidden = out.hidden_states[:, 1:]
    return _propose(drafter, drafter.compute_logits(hidden), hidden, tokens.gather(1, anchors[:, None])[:, 0])


def draft_from_cache(drafter: "DFlashDraftModel", context_cache: DFlashContextCache,
                     anchor_token_ids: torch.LongTensor, count: int | None = None) -> torch.LongTensor:
    """:func:`draft_block` from the drafter's context cache: the proposals for the first ``count`` positions after
    each row's anchor, which sits right after the row's cached context (``context_cache.lengths[r]``).

    Args:
        drafter (`DFlashDraftModel`):
            The drafter, bound to the target.
        context_cache ([`~.modeling.DFlashContextCache`]):
            The drafter's projected context of every row (the target's features of the tokens before the anchor).
        anchor_token_ids (`torch.LongTensor` of shape `(batch_size,)`):
            Each row's anchor token.
        count (`int`, *optional*):
            Proposals per row, ``1 .. B - 1`` (`None`: ``B - 1``). The block is drafted whole; only the head and the
            candidate selector stop after ``count`` positions, and the first ``count`` proposals are those of the
            whole block (each position's pick depends on the ones before it only).

    Returns:
        `torch.LongTensor` of shape `(batch_size, count)`: the first ``count`` of what :func:`draft_block` proposes
        from the same context.
    """
    count = speculative_token_count(count, int(drafter.config.block_size))
    out = drafter.draft_from_cache(context_cache, anchor_token_ids, return_logits=False)
    hidden = out.hidden_states[:, :count]
    return _propose(drafter, drafter.compute_logits(hidden), hidden, anchor_token_ids)


def speculative_token_count(value: int | None, block_size: int) -> int:
    """The proposals a step verifies: `value` (``1 .. block_size - 1``), or ``block_size - 1`` for `None`; any other
    value is an error that names it."""
    if value is None:
        return block_size - 1
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= block_size - 1:
        raise ValueError(f"num_speculative_tokens must be an integer in [1, {block_size - 1}] (the drafter's block "
                         f"size {block_size} minus its anchor), got {value!r}; leave it unset for {block_size - 1}.")
    return value


def _propose(drafter: "DFlashDraftModel", logits: torch.Tensor, hidden: torch.Tensor,
             anchor_token_ids: torch.Tensor) -> torch.LongTensor:
    """Proposals from the drafted rows' logits and states (``[b, B - 1, ...]``): the candidate selector's greedy path
    over each row's top-k (DFlash2), else the argmax."""
    selector = getattr(drafter, "candidate_selector", None)
    if selector is None:
        return logits.argmax(dim=-1)
    top = logits.topk(min(int(selector.top_k), logits.shape[-1]), dim=-1)
    return selector.greedy_path(candidate_ids=top.indices, unary_logits=top.values, hidden_states=hidden,
                                anchor_token_ids=anchor_token_ids)


# --- transformers' assisted generation ------------------------------------------------------------------------------


class DFlashCandidateGenerator(CandidateGenerator):
    """A transformers `CandidateGenerator` drafting a block per step with a DFlash drafter (batch size 1).

    `_assisted_decoding` hands it the target's outputs of the previous verification forward
    (``requires_model_outputs``) run with ``output_hidden_states=list(target_layer_ids)``
    (``model_kwargs_overrides``): the generator appends the features of the tokens the target accepted to the
    drafter's context cache and drafts after the anchor (the target's newest token). The first call returns no
    candidates, so the target's prefill produces the first anchor. Use it through :func:`dflash_assisted_decoding`.

    Args:
        drafter (`DFlashDraftModel`):
            The drafter, bound to `target`.
        target (`PreTrainedModel`):
            The target causal LM running `generate`.
        generation_config (`GenerationConfig`):
            The generation config of the call (its `max_length` caps the proposals).
        num_speculative_tokens (`int`, *optional*):
            Proposals per step, ``1 .. B - 1`` (`None`: ``B - 1``).

    Attributes:
        context_cache ([`~.modeling.DFlashContextCache`] or `None`): the drafter's projected context (every token
            the target has run and kept), from the first verification on.
        draft_forwards (`int`): drafter forwards run so far.
        acceptance_lengths (`list[int]`): per target forward after the prefill, the tokens the target kept
            (accepted proposals + its own token, before `generate` cuts at EOS or `max_length`).
    """

    requires_model_outputs = True

    def __init__(self, drafter: "DFlashDraftModel", target: PreTrainedModel, generation_config: GenerationConfig,
                 num_speculative_tokens: int | None = None):
        self.drafter = drafter
        self.layer_ids = check_drafter_for_target(target, drafter)
        self.block_size = int(drafter.config.block_size)
        self.num_speculative_tokens = speculative_token_count(num_speculative_tokens, self.block_size)
        self.max_length = generation_config.max_length
        self.model_kwargs_overrides = {"output_hidden_states": list(self.layer_ids)}
        self.context_cache: DFlashContextCache | None = None
        self.draft_forwards = 0
        self.acceptance_lengths: list[int] = []

    def get_candidates(self, input_ids: torch.LongTensor, model_kwargs: dict | None = None, model_outputs=None,
                       is_first_iteration: bool = False, n_last_matches: int = 0, **kwargs):
        """`input_ids` followed by up to ``num_speculative_tokens`` proposals, and no candidate logits (the target
        verifies greedily)."""
        if is_first_iteration:
            return input_ids, None
        # The last target forward ran the prompt (prefill) or [anchor, proposals]; of the latter, the anchor and the
        # accepted proposals are now context.
        if self.context_cache is None:
            self.context_cache = DFlashContextCache(self.drafter, batch_size=1, capacity=self.max_length or 256)
            fresh = input_ids.shape[1] - 1
        else:
            fresh = int(n_last_matches) + 1
        self.context_cache.append(target_features(model_outputs.hidden_states, self.layer_ids)[:, :fresh])
        budget = min(self.num_speculative_tokens, self.max_length - input_ids.shape[1] - 1)
        if budget <= 0:
            return input_ids, None
        proposals = draft_from_cache(self.drafter, self.context_cache,
                                     input_ids[:, -1].to(self.context_cache.lengths.device), budget)
        self.draft_forwards += 1
        return torch.cat([input_ids, proposals.to(input_ids.device, input_ids.dtype)], dim=1), None

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        """Records the acceptance length of the step (the strategy itself is fixed: ``num_speculative_tokens``
        proposals per step)."""
        if self.context_cache is not None:  # the prefill step verifies nothing
            self.acceptance_lengths.append(int(num_matches) + 1)


def dflash_assisted_decoding(model: PreTrainedModel, input_ids: torch.LongTensor,
                             logits_processor: LogitsProcessorList, stopping_criteria: StoppingCriteriaList,
                             generation_config: GenerationConfig, synced_gpus: bool = False, streamer=None,
                             drafter: "DFlashDraftModel | None" = None, num_speculative_tokens: int | None = None,
                             **model_kwargs):
    """transformers' assisted decoding with a DFlash drafter, to pass as ``custom_generate`` to `generate`.

    ``target.generate(input_ids, custom_generate=dflash_assisted_decoding, drafter=drafter, max_new_tokens=N)``
    returns what ``target.generate(input_ids, do_sample=False, max_new_tokens=N)`` returns, token for token, in
    fewer target forwards. `generate` prepares the inputs, logits processors, stopping criteria and cache as usual
    and calls this function with them; it runs transformers' `_assisted_decoding` with a
    :class:`DFlashCandidateGenerator`. Batch size 1 (a transformers limit of assisted decoding); for batches use
    :func:`speculative_generate`. `generate` does not forward `streamer` to a ``custom_generate`` callable.

    Args:
        drafter (`DFlashDraftModel`):
            The drafter, bound to `model` (passed to `generate` as the ``drafter=`` keyword).
        num_speculative_tokens (`int`, *optional*):
            Proposals verified per target forward, ``1 .. B - 1`` (`None`: ``B - 1``). Fewer proposals make each
            verification cheaper where the target's forward grows with its rows (a CPU), at some acceptance length.

    Returns:
        What `generate` returns (a `torch.LongTensor`, or a `GenerateDecoderOnlyOutput` with
        ``return_dict_in_generate=True``).
    """
    if drafter is None:
        raise ValueError("dflash_assisted_decoding drafts with a DFlash drafter: call "
                         "target.generate(input_ids, custom_generate=dflash_assisted_decoding, drafter=drafter, ...).")
    if input_ids.shape[0] != 1:
        raise ValueError(f"assisted decoding through generate takes one sequence, got a batch of {input_ids.shape[0]}; "
                         "use hf_bdlm.models.dflash.inference.speculative.speculative_generate for batches.")
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError("dflash_assisted_decoding takes an unpadded prompt (the attention_mask has zeros); drop the "
                         "padding, or use speculative_generate, which handles left-padded batches.")
    generator = DFlashCandidateGenerator(drafter, model, generation_config, num_speculative_tokens)
    # `_assisted_decoding` asks `self._get_candidate_generator` for its generator: an instance attribute shadows the
    # class method for this one call.
    model._get_candidate_generator = lambda *args, **kwargs: generator
    try:
        return GenerationMixin._assisted_decoding(model, input_ids, logits_processor, stopping_criteria,
                                                  generation_config, synced_gpus=synced_gpus, streamer=streamer,
                                                  **model_kwargs)
    finally:
        del model._get_candidate_generator


# --- this project's batched loop ------------------------------------------------------------------------------------


@dataclass
class SpeculativeStats:
    """What a :func:`speculative_generate` call did.

    Attributes:
        target_forwards (`int`): target forwards, the prefill included (each runs the whole batch).
        draft_forwards (`int`): drafter forwards (each drafts one block for every row).
        mean_acceptance_length (`float`): tokens committed per verification forward and row, averaged over the
            (forward, unfinished row) pairs: accepted proposals + the target's own token, in ``[1, B]``, cut where
            the row ends (its EOS, its token budget), as the server and `DFlashTrainer`'s eval count it
            (``AcceptanceCounts``; 0.0 when nothing was verified).
        generated_tokens (`int`): new tokens over all rows (EOS included, padding excluded).
        wall_time_s (`float`): seconds for the whole call.
    """

    target_forwards: int = 0
    draft_forwards: int = 0
    mean_acceptance_length: float = 0.0
    generated_tokens: int = 0
    wall_time_s: float = 0.0


def _token_list(value, name: str) -> list[int]:
    if value is None:
        return []
    values = [value] if isinstance(value, int) else list(value.tolist() if torch.is_tensor(value) else value)
    if not all(isinstance(v, int) and v >= 0 for v in values):
        raise ValueError(f"{name} must be a token id or a list of them, got {value!r}.")
    return values


def _uses_sliding_window(text_config) -> bool:
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is not None:
        return "sliding_attention" in layer_types
    return getattr(text_config, "sliding_window", None) is not None and getattr(text_config, "use_sliding_window", True)


def _check_left_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [batch, prompt_len] with prompt_len >= 1, got {tuple(input_ids.shape)}.")
    if attention_mask is None:
        return torch.ones_like(input_ids, dtype=torch.bool)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} does not match input_ids "
                         f"{tuple(input_ids.shape)}.")
    mask = attention_mask.to(input_ids.device)
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (token).")
    mask = mask.bool()
    if not bool(mask.any(1).all()):
        raise ValueError(f"attention_mask row {int((~mask.any(1)).nonzero()[0, 0])} has no token; every prompt needs "
                         "at least one.")
    if not bool(mask[:, -1].all()) or bool((mask[:, 1:].long() < mask[:, :-1].long()).any()):
        bad = int(((mask[:, 1:].long() < mask[:, :-1].long()).any(1) | ~mask[:, -1]).nonzero()[0, 0])
        raise ValueError(f"attention_mask row {bad} is not left padded ({mask[bad].long().tolist()}): speculative "
                         "decoding takes padding before the prompt only (tokenize with padding_side='left').")
    return mask


@torch.no_grad()
def speculative_generate(target: PreTrainedModel, drafter: "DFlashDraftModel", input_ids: torch.LongTensor,
                         attention_mask: torch.Tensor | None = None, *,
                         max_new_tokens: int, eos_token_id: int | Sequence[int] | None = None,
                         pad_token_id: int | None = None, num_speculative_tokens: int | None = None
                         ) -> tuple[torch.LongTensor, SpeculativeStats]:
    """Greedy speculative decoding of a batch with a DFlash drafter: exactly the target's greedy output.

    Returns what ``target.generate(input_ids, attention_mask=attention_mask, do_sample=False,
    max_new_tokens=max_new_tokens, eos_token_id=eos_token_id)`` returns, token for token: the input columns, then
    the new tokens, each row stopping after its first EOS or `max_new_tokens` and right-padded with `pad_token_id`
    until the longest row ends.

    Batching: each row keeps its own anchor and accepts its own number of tokens per step. The target's KV cache
    is shared: every verification forward appends ``B`` slots (the anchor and its proposals) to every row, the
    cache is cropped to the most slots any row kept, and a row's rejected slots stay behind as holes that its
    attention mask hides; RoPE positions are passed per row (the count of its real tokens before), so every kept
    token sees exactly its row's tokens at their true positions, as in a left-padded `generate`. The drafter sees
    each row compact from column 0: its tokens, and its context in a :class:`~.modeling.DFlashContextCache` with the
    row's own length, appended with the features of the tokens the row kept. Finished rows ride along until the
    last row ends, their results unused.

    Args:
        target (`PreTrainedModel`):
            The causal LM whose greedy decoding is reproduced (full attention; a sliding-window target is refused
            because cache holes would shift its window).
        drafter (`DFlashDraftModel`):
            A drafter bound to `target`.
        input_ids (`torch.LongTensor` of shape `(batch_size, prompt_len)`):
            The prompts, left padded.
        attention_mask (`torch.Tensor` of shape `(batch_size, prompt_len)`, *optional*):
            1 for tokens, 0 for the left padding. `None`: no padding.
        max_new_tokens (`int`):
            The most new tokens per row (>= 1).
        eos_token_id (`int` or `list[int]`, *optional*):
            Tokens that end a row (kept in the output). `None` uses ``target.generation_config.eos_token_id``, as
            `generate` does; ``[]`` disables EOS.
        pad_token_id (`int`, *optional*):
            Fills a row after its EOS. `None` uses ``target.generation_config.pad_token_id``, else the first EOS id.
        num_speculative_tokens (`int`, *optional*):
            Proposals verified per target forward, ``1 .. B - 1`` (`None`: ``B - 1``, the whole drafted block). A
            verification runs ``num_speculative_tokens + 1`` rows; where that costs more than one row (a CPU), fewer
            proposals can decode faster at a lower acceptance length. The output does not depend on it.

    Returns:
        `tuple(torch.LongTensor, SpeculativeStats)`: the sequences (`(batch_size, prompt_len + new)`) and the
        statistics of the call.
    """
    session = SpeculativeSession(target, drafter, input_ids, attention_mask, max_new_tokens=max_new_tokens,
                                 eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                                 num_speculative_tokens=num_speculative_tokens)
    while not session.done:
        session.step()
    return session.result()


class SpeculativeSession:
    """:func:`speculative_generate` one target forward at a time, for a caller that streams (the server): the
    constructor runs the prefill, each :meth:`step` one draft + verification, and both leave in :attr:`new_tokens`
    the tokens each row committed (``{row: [ids]}``); :meth:`stop` ends rows early (a cancelled client), and
    :meth:`result` gives what :func:`speculative_generate` returns. Arguments as :func:`speculative_generate`."""

    @torch.no_grad()
    def __init__(self, target: PreTrainedModel, drafter: "DFlashDraftModel", input_ids: torch.LongTensor,
                 attention_mask: torch.Tensor | None = None, *, max_new_tokens: int,
                 eos_token_id: int | Sequence[int] | None = None, pad_token_id: int | None = None,
                 num_speculative_tokens: int | None = None):
        self.start = time.perf_counter()
        self.target, self.drafter = target, drafter
        self.layer_ids = layer_ids = check_drafter_for_target(target, drafter)
        text = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
        if _uses_sliding_window(text):
            raise ValueError(f"the target uses sliding-window attention (sliding_window={text.sliding_window}); "
                             "speculative_generate supports full-attention targets only. Use target.generate(..., "
                             "custom_generate=dflash_assisted_decoding, drafter=drafter) per prompt.")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}.")
        self.input_ids, self.max_new_tokens = input_ids, max_new_tokens
        self.mask = mask = _check_left_padding(input_ids, attention_mask)
        eos_ids = _token_list(target.generation_config.eos_token_id if eos_token_id is None else eos_token_id,
                              "eos_token_id")
        pad_id = pad_token_id if pad_token_id is not None else target.generation_config.pad_token_id
        self.pad_id = int(pad_id if pad_id is not None else eos_ids[0] if eos_ids else 0)
        device = self.device = input_ids.device
        self.eos = torch.tensor(eos_ids, dtype=torch.long, device=device)
        self.block = int(drafter.config.block_size)
        self.num_speculative_tokens = speculative_token_count(num_speculative_tokens, self.block)
        batch, prompt_len = input_ids.shape
        self.stats = SpeculativeStats()
        self.rows = torch.arange(batch, device=device)

        # Prefill, as generate runs it: left-padded prompts, positions counting each row's real tokens.
        positions = (mask.long().cumsum(-1) - 1).masked_fill(~mask, 0)
        self.cache = DynamicCache(config=target.config)
        extra = {"logits_to_keep": 1} if target._supports_logits_to_keep() else {}
        out = target(input_ids=input_ids, attention_mask=mask.long(), position_ids=positions, cache=self.cache,
                     use_cache=True, output_hidden_states=list(layer_ids), **extra)
        self.stats.target_forwards += 1
        features = target_features(out.hidden_states, layer_ids)

        # The drafter's view of each row, compact from column 0: its tokens (one spare column takes the writes of the
        # slots a row does not keep) and its context cache, holding the prompt's projected features (the first
        # anchor is the prefill's token).
        lengths = mask.sum(-1)                                                 # committed tokens per row
        self.capacity = prompt_len + max_new_tokens
        gather = (torch.arange(prompt_len, device=device)[None] + (prompt_len - lengths)[:, None]).clamp_max(
            prompt_len - 1)
        self.tokens = torch.full((batch, self.capacity + 1), self.pad_id, dtype=torch.long, device=device)
        self.tokens[:, :prompt_len] = input_ids.gather(1, gather)
        self.context_cache = DFlashContextCache(drafter, batch, capacity=self.capacity)
        self.context_cache.append(features.gather(1, gather[..., None].expand(-1, -1, features.shape[-1])),
                                  counts=lengths)

        first = out.logits[:, -1].argmax(dim=-1)
        self.tokens[self.rows, lengths] = first
        self.lengths = lengths + 1
        self.generated = torch.ones(batch, dtype=torch.long, device=device)
        self.finished = torch.isin(first, self.eos) | (self.generated >= max_new_tokens)
        # Which target cache slots are real, per row: the first `kv_used` columns of a buffer that grows by doubling
        # (each verification passes a view of it, not a new concatenation).
        self.kv_mask = torch.zeros(batch, prompt_len + max_new_tokens + self.block, dtype=torch.long, device=device)
        self.kv_mask[:, :prompt_len] = mask
        self.kv_used = prompt_len
        self.offsets = torch.arange(self.block, device=device)
        self.accepted_sum = torch.zeros((), dtype=torch.long, device=device)
        self.accepted_count = torch.zeros((), dtype=torch.long, device=device)
        self.new_tokens = {i: [int(t)] for i, t in enumerate(first.tolist())}

    @property
    def done(self) -> bool:
        return bool(self.finished.all())

    def stop(self, rows) -> None:
        """Decode ``rows`` no further (their tokens so far stay in the result)."""
        for row in rows:
            self.finished[row] = True

    @torch.no_grad()
    def step(self) -> dict[int, list[int]]:
        """One draft + verification forward; returns (and keeps in :attr:`new_tokens`) each row's committed tokens."""
        target, device, rows = self.target, self.device, self.rows
        batch, max_new_tokens, finished = rows.shape[0], self.max_new_tokens, self.finished
        anchors = self.lengths - 1                    # position of each row's newest token (not yet in the cache)
        anchor_tokens = self.tokens[rows, anchors]
        room = int((max_new_tokens - self.generated).masked_fill(finished, 0).max()) - 1
        k = min(self.num_speculative_tokens, room)
        if k > 0:
            proposals = draft_from_cache(self.drafter, self.context_cache, anchor_tokens, k).to(device)
            self.stats.draft_forwards += 1
        else:
            proposals = self.tokens.new_zeros(batch, 0)
        offsets, used = self.offsets[:k + 1], self.kv_used
        self._reserve_kv_mask(used + k + 1)
        self.kv_mask[:, used:used + k + 1] = 1
        out = target(input_ids=torch.cat([anchor_tokens[:, None], proposals], dim=1),
                     attention_mask=self.kv_mask[:, :used + k + 1], position_ids=anchors[:, None] + offsets,
                     cache=self.cache, use_cache=True, output_hidden_states=list(self.layer_ids))
        self.stats.target_forwards += 1
        choice = out.logits.argmax(dim=-1)                                      # the target's token after each slot
        accepted = (proposals == choice[:, :k]).long().cumprod(dim=1).sum(dim=1)
        keep = accepted + 1                               # accepted proposals + the target's own token
        # Cut at the token budget and after the first EOS; finished rows keep nothing.
        keep = torch.minimum(keep, max_new_tokens - self.generated)
        is_eos = torch.isin(choice, self.eos) & (offsets[None] < keep[:, None])
        ends = is_eos.any(1)
        keep = torch.where(ends, is_eos.long().argmax(1) + 1, keep).masked_fill(finished, 0)
        # Acceptance counts what each row commits (AcceptanceCounts: the server's and the trainer's eval's rule).
        self.accepted_sum += keep.sum()
        self.accepted_count += (~finished).sum()
        self.finished = finished | ends | (self.generated + keep >= max_new_tokens)

        # Slots 0 .. keep-1 ran the anchor and the accepted proposals: their K/V and features are context now; the
        # last kept token (the target's own) is the next anchor.
        kept = offsets[None] < keep[:, None]
        self.tokens.scatter_(1, torch.where(kept, self.lengths[:, None] + offsets, self.capacity), choice)
        self.context_cache.append(target_features(out.hidden_states, self.layer_ids), counts=keep)
        counts = keep.tolist()
        widest = max(counts)
        self.cache.crop(-(k + 1 - widest))            # drop the slots no row kept
        self.kv_mask[:, used:used + widest] = kept[:, :widest]
        self.kv_used = used + widest
        choices = choice.tolist()
        self.new_tokens = {i: choices[i][:n] for i, n in enumerate(counts) if n}
        self.lengths = self.lengths + keep
        self.generated = self.generated + keep
        return self.new_tokens

    def _reserve_kv_mask(self, width: int) -> None:
        if width > self.kv_mask.shape[1]:
            grown = self.kv_mask.new_zeros(self.kv_mask.shape[0], max(width, 2 * self.kv_mask.shape[1]))
            grown[:, :self.kv_used] = self.kv_mask[:, :self.kv_used]
            self.kv_mask = grown

    def result(self) -> tuple[torch.LongTensor, SpeculativeStats]:
        """The sequences so far (as :func:`speculative_generate` returns them) and the statistics."""
        stats, device, generated = self.stats, self.device, self.generated
        count = int(self.accepted_count)
        stats.mean_acceptance_length = int(self.accepted_sum) / count if count else 0.0
        stats.generated_tokens = int(generated.sum())
        new = int(generated.max())
        prompt_lengths = self.mask.sum(-1)
        cols = (prompt_lengths[:, None] + torch.arange(new, device=device)[None]).clamp_max(self.capacity - 1)
        continuation = self.tokens.gather(1, cols).masked_fill(
            torch.arange(new, device=device)[None] >= generated[:, None], self.pad_id)
        stats.wall_time_s = time.perf_counter() - self.start
        return torch.cat([self.input_ids, continuation], dim=1), stats
