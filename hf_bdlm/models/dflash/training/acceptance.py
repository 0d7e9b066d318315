"""A drafter's acceptance on held-out captured features, as ``hf-bdlm serve --draft`` would count it.

Serving decodes greedily: after the prefill yields a request's first token, each verification step drafts from the
anchor (the newest token), the target keeps the longest run of proposals equal to its own greedy choice, then its
own next token (the next anchor), and the drafter's context grows by the features of what was kept. On a held-out
record that is the target's own greedy answer to its prompt (self-distilled, as ``recipes/dflash.py`` makes its
data), the record *is* that greedy continuation and the captured features *are* the target's hidden states there, so
the steps serving would run can be replayed without the target: the same anchors (each right after the last
committed token, from the first answer token on), the same proposals (the decoding loops' own
:class:`~.modeling.DFlashContextCache` and :func:`~.speculative.draft_from_cache`), the same cut at the request's end,
counted by the server's rule (:class:`~hf_bdlm.protocols.decoding.AcceptanceCounts`). Training's anchors (drawn at
random positions, each scored with the true context before it) measure something else: how often a block's tokens
are right, not how far a decoding chain of blocks gets.

    from hf_bdlm.models.dflash.training.acceptance import replay_acceptance, served_requests
    requests = [r for i in range(len(store)) for r in served_requests(*store.record(i))]
    counts = replay_acceptance(drafter, [(ids, store.features(i), start, stop) ...])

A record stands for one request per run of supervised tokens (the answers of a conversation): the prompt is every
token before the run, the expected completion the run itself. On other text (not the target's own greedy output)
the replay measures acceptance against that text, which serving reaches only where the target would have written it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ....protocols.decoding import AcceptanceCounts
from ..modeling import DFlashContextCache
from ..inference.speculative import draft_from_cache, speculative_token_count

if TYPE_CHECKING:
    from ..modeling import DFlashDraftModel

__all__ = ["replay_acceptance", "served_requests"]


def served_requests(input_ids: torch.Tensor, loss_mask: torch.Tensor) -> list[tuple[int, int]]:
    """The requests a captured record stands for: each maximal run ``[start, stop)`` of supervised positions, as the
    request whose prompt is ``input_ids[:start]`` and whose greedy completion is ``input_ids[start:stop]``.

    A run from position 0 has no prompt to prefill: its first token becomes the prompt (``start = 1``).
    """
    mask = torch.as_tensor(loss_mask).bool().tolist()
    runs, start = [], None
    for i, supervised in enumerate(mask + [False]):
        if supervised and start is None:
            start = i
        elif not supervised and start is not None:
            runs.append((max(start, 1), i))
            start = None
    return [(a, b) for a, b in runs if b > a]


@torch.no_grad()
def replay_acceptance(drafter: "DFlashDraftModel", requests: Sequence[tuple[torch.Tensor, torch.Tensor, int, int]],
                      num_speculative_tokens: int | None = None) -> list[AcceptanceCounts]:
    """Replay, as one batch, the verification steps greedy speculative decoding runs on each request, and count them.

    Args:
        drafter (`DFlashDraftModel`):
            The drafter, bound to its target's embedding and head.
        requests (`Sequence` of `(input_ids, features, start, stop)`):
            Per request: the record's tokens (`torch.LongTensor` of shape `(n,)`), the target's captured features of
            them (`torch.Tensor` of shape `(>= stop - 1, feature_width)`), and the completion's range (from
            :func:`served_requests`): the prompt is ``input_ids[:start]``, the completion ``input_ids[start:stop]``.
        num_speculative_tokens (`int`, *optional*):
            Proposals verified per step, ``1 .. B - 1`` (`None`: ``B - 1``, the server's default).

    Returns:
        `list[AcceptanceCounts]`: per request, its verification steps and accepted tokens: what the server reports
        in that request's ``usage.speculative`` when the target's greedy completion is ``input_ids[start:stop]`` and
        the request asks for it (its length, or the EOS that ends it).
    """
    count = speculative_token_count(num_speculative_tokens, int(drafter.config.block_size))
    device = drafter.fc.weight.device
    rows = len(requests)
    if rows == 0:
        return []
    starts = torch.tensor([int(r[2]) for r in requests], device=device)
    stops = torch.tensor([int(r[3]) for r in requests], device=device)
    if bool((starts < 1).any()) or bool((stops <= starts).any()):
        raise ValueError(f"each request needs a prompt and a completion (1 <= start < stop), got "
                         f"{list(zip(starts.tolist(), stops.tolist()))}.")
    width = int(stops.max())
    # Tokens past a completion's end are -1: no proposal equals them, so no step accepts beyond the end.
    tokens = torch.full((rows, width + count + 1), -1, dtype=torch.long, device=device)
    features = torch.zeros(rows, width, requests[0][1].shape[-1], dtype=requests[0][1].dtype, device=device)
    for row, (ids, feats, _, stop) in enumerate(requests):
        tokens[row, :stop] = torch.as_tensor(ids[:stop], device=device)
        features[row, :stop - 1] = feats[:stop - 1].to(device)  # the last token's features are never context
    index = torch.arange(rows, device=device)
    offsets = torch.arange(count + 1, device=device)
    cache = DFlashContextCache(drafter, rows, capacity=width)
    cache.append(features[:, :int(starts.max())], counts=starts)    # the prompt: what the prefill hands the drafter
    anchors = starts.clone()                                       # the prefill's token: the first anchor
    counts = [AcceptanceCounts() for _ in range(rows)]
    while True:
        remaining = stops - 1 - anchors        # tokens after the anchor the request still returns
        active = remaining > 0
        if not bool(active.any()):
            return counts
        proposals = draft_from_cache(drafter, cache, tokens[index, anchors], count)
        expected = tokens.gather(1, anchors[:, None] + 1 + offsets[:count])
        accepted = (proposals == expected).long().cumprod(dim=1).sum(dim=1)
        # The accepted proposals and the target's own token, cut at the request's end (as the server sends them).
        keep = torch.minimum(accepted + 1, remaining).masked_fill(~active, 0)
        block = (anchors[:, None] + offsets).clamp_max(width - 1)
        cache.append(features.gather(1, block[..., None].expand(-1, -1, features.shape[-1])), counts=keep)
        for row, kept in enumerate(keep.tolist()):
            if kept:
                counts[row].add(kept)
        anchors = anchors + keep
