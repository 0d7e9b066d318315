"""The DFlash training objective: anchors, labels, weights and losses, splittable across ranks.

A DFlash drafter is trained on draft blocks cut from a sequence the target model has read. For each sample the
objective draws up to ``max_anchors`` *anchors*: positions whose token and the next one are supervised and in the same
document. The block of an anchor is ``[token at anchor, mask x (B-1)]``; with ``sample_from_anchor=False`` (the
default) its slot ``k >= 1`` predicts the token at ``anchor + k`` with weight ``exp(-(k-1)/gamma)`` and slot 0 is not
supervised; with ``sample_from_anchor=True`` slot ``k`` predicts the token at ``anchor + k + 1`` with weight
``exp(-k/gamma)``. A label outside the sequence, outside the anchor's document or not in ``loss_mask`` is not
supervised.

Losses (``DFlashObjectiveConfig.loss``):

- ``"ce"``: cross entropy with the labels; ``"kl"``: forward KL from the target's next-token distribution at the
  position before each label (its *teacher positions*). Both: per sample, the sum of weighted token losses over the
  sample's number of supervised tokens in the whole batch (:attr:`DFlashBatch.normalizer`), then the mean over samples.
- ``"dpace"`` (DFlash2): cross entropy weighted by D-PACE, the expected accepted length each token still controls
  (from the detached probabilities of the block's labels), optionally mixed with a total-variation term
  (``lk_loss_type``), plus the candidate selector's loss; divided by the sum of the D-PACE weights over all
  ranks that hold anchors of the batch.

Anchors are a pure function of ``(seed, step)`` and the batch, so the ranks that share a batch draw the same ones
without communicating, and a resumed run redraws them. Ranks can split a batch's anchors (block parallelism):
``deal_anchors(anchor_costs(batch), world)`` gives each rank a cost-balanced set, ``select_anchors(batch, mine)`` its
sub-batch, and the ranks' losses add up to the loss of the whole batch. Tiny CPU example::

    import torch
    from hf_bdlm.models.dflash.training.objectives import DFlashObjective, DFlashObjectiveConfig
    objective = DFlashObjective(DFlashObjectiveConfig(mask_token_id=31, block_size=4, max_anchors=8, loss="ce"))
    ids = torch.randint(0, 31, (2, 32))
    batch = objective.prepare(ids, torch.ones_like(ids), step=0)
    logits = torch.randn(2, batch.supervised_mask.shape[1], 32, requires_grad=True)   # the drafter's logits
    objective.loss(logits, batch).backward()
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .....attention.rows import document_starts
from .....objectives.noise import hash_uniform

LOSSES = ("ce", "kl", "dpace")
ANCHOR_SAMPLINGS = ("uniform", "locality")
LK_LOSS_TYPES = (None, "lambda", "tv")
STATE_KIND = "dflash_objective"
STATE_VERSION = 1
# Salt of the anchor draw in the project's counter-based hash (any constant distinct from the other objectives').
SALT_ANCHORS = 0x5EED_DF1A
# Added to each sample's supervised count so that a sample without supervised tokens contributes 0, not NaN.
NORMALIZER_EPS = 1.0e-5
# Settings a checkpoint's objective state must share with the run that loads it: they decide anchors and labels.
_RESUME_FIELDS = ("block_size", "max_anchors", "anchor_sampling", "mask_token_id", "decay_gamma", "sample_from_anchor")
# How `select_anchors` cuts each field of a `DFlashBatch`; every other field is per token ([b, A * B]).
_PER_ANCHOR_FIELDS = ("anchor_positions", "anchor_valid", "document_starts", "context_stops")
_PER_SAMPLE_FIELDS = ("normalizer", "block_size", "sequence_length")


@dataclass
class DFlashObjectiveConfig:
    """Settings of the DFlash objective; the defaults are the DFlash2 production recipe's.

    Parameters:
        mask_token_id (`int`): id filling the draft block after its anchor token.
        block_size (`int`, defaults to 8): tokens per draft block, the anchor included (at least 2).
        max_anchors (`int`, defaults to 2048): anchor slots per sample (the ``A`` of every ``[b, A]`` tensor).
        anchor_sampling (`str`, defaults to `"locality"`): `"uniform"` draws distinct valid anchors uniformly;
            `"locality"` takes every ``s``-th valid anchor from a uniformly random start, ``s`` the smallest stride
            ``>= block_size`` coprime with the number of valid anchors (distinct anchors, uniform marginals, blocks
            that rarely overlap, contexts that share keys).
        anchor_group_size (`int`, defaults to 0): kept for recipe compatibility, in ``[0, max_anchors]``; it does not
            change the draw.
        decay_gamma (`float`, defaults to 7.0): ``gamma`` of the position weights ``exp(-(k-1)/gamma)``.
        sample_from_anchor (`bool`, defaults to `False`): slot ``k`` predicts ``anchor + k + 1`` (slot 0 supervised)
            instead of ``anchor + k``.
        loss (`str`, defaults to `"dpace"`): `"ce"`, `"kl"` or `"dpace"` (see the module docstring).
        dpace_alpha (`float`, defaults to 0.5): D-PACE smoothing in ``[0, 1]``: a token's acceptance is taken as
            ``(1 - alpha) * p + alpha``.
        lk_loss_type (`str` or `None`, defaults to `"lambda"`): `"dpace"` only. `None`: CE; `"tv"`: the total
            variation ``1 - p``; `"lambda"`: ``c * CE + (1 - c) * TV`` with ``c = kl_scale * exp(-kl_decay * a)``,
            ``a`` the mean probability of the labels over the batch (detached).
        kl_scale (`float`, defaults to 1.0), kl_decay (`float`, defaults to 1.0): the ``lambda`` mix.
        selector_loss_alpha (`float`, defaults to 1.0): weight of the candidate selector's loss (`"dpace"` with a
            selector).
        selector_warmup_ratio (`float`, defaults to 0.0), selector_ramp_ratio (`float`, defaults to 0.0): fractions
            of training with the selector loss off, then ramping linearly to ``selector_loss_alpha``
            (:meth:`DFlashObjective.selector_alpha`).
        selector_stop_gradient (`bool`, defaults to `False`): the selector loss does not reach the drafter.
        seed (`int`, defaults to 0): anchor seed. Equal on the ranks that share a batch (context and block
            parallelism), different across data-parallel ranks (e.g. ``seed + data_parallel_rank``).
        chunk_rows (`int`, defaults to 4096): supervised rows per vocabulary projection in
            :meth:`DFlashObjective.loss_from_hidden` (memory ``chunk_rows x vocabulary``).
    """

    mask_token_id: int
    block_size: int = 8
    max_anchors: int = 2048
    anchor_sampling: str = "locality"
    anchor_group_size: int = 0
    decay_gamma: float = 7.0
    sample_from_anchor: bool = False
    loss: str = "dpace"
    dpace_alpha: float = 0.5
    lk_loss_type: str | None = "lambda"
    kl_scale: float = 1.0
    kl_decay: float = 1.0
    selector_loss_alpha: float = 1.0
    selector_warmup_ratio: float = 0.0
    selector_ramp_ratio: float = 0.0
    selector_stop_gradient: bool = False
    seed: int = 0
    chunk_rows: int = 4096

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(f"DFlashObjectiveConfig: {message}")

        for name in ("mask_token_id", "block_size", "max_anchors", "anchor_group_size", "seed", "chunk_rows"):
            need(isinstance(getattr(self, name), int), f"{name} must be an int, got {getattr(self, name)!r}")
        need(self.mask_token_id >= 0, f"mask_token_id must be a token id >= 0, got {self.mask_token_id}")
        need(self.block_size >= 2, f"block_size must be >= 2 (an anchor and a token to draft), got {self.block_size}")
        need(self.max_anchors >= 1, f"max_anchors must be >= 1, got {self.max_anchors}")
        need(
            self.anchor_sampling in ANCHOR_SAMPLINGS,
            f"anchor_sampling must be one of {ANCHOR_SAMPLINGS}, got {self.anchor_sampling!r}",
        )
        need(
            0 <= self.anchor_group_size <= self.max_anchors,
            f"anchor_group_size must be in [0, max_anchors={self.max_anchors}], got {self.anchor_group_size}",
        )
        need(
            math.isfinite(self.decay_gamma) and self.decay_gamma > 0,
            f"decay_gamma must be a positive number, got {self.decay_gamma!r}",
        )
        need(self.loss in LOSSES, f"loss must be one of {LOSSES}, got {self.loss!r}")
        need(0.0 <= self.dpace_alpha <= 1.0, f"dpace_alpha must be in [0, 1], got {self.dpace_alpha!r}")
        need(
            self.lk_loss_type in LK_LOSS_TYPES,
            f"lk_loss_type must be one of {LK_LOSS_TYPES} (None for plain cross entropy), got {self.lk_loss_type!r}",
        )
        for name in ("kl_scale", "kl_decay", "selector_loss_alpha"):
            value = getattr(self, name)
            need(math.isfinite(value) and value >= 0, f"{name} must be a finite number >= 0, got {value!r}")
        for name in ("selector_warmup_ratio", "selector_ramp_ratio"):
            value = getattr(self, name)
            need(0.0 <= value <= 1.0, f"{name} must be in [0, 1], got {value!r}")
        need(self.chunk_rows >= 1, f"chunk_rows must be >= 1, got {self.chunk_rows}")


@dataclass(frozen=True)
class DFlashBatch:
    """The anchors of a batch and everything the drafter and the loss need about them.

    ``A`` anchor slots per sample, ``B = block_size``; token tensors are ``[b, A * B]``, block ``a`` at
    ``[a * B, (a + 1) * B)``. An invalid slot (a sample with fewer valid anchors) has position 0, no supervised token,
    and document start and context stop equal to the sequence length (it sees no context).

    Parameters:
        anchor_positions (`torch.LongTensor` of shape `(b, A)`): valid anchors first, ascending.
        anchor_valid (`torch.BoolTensor` of shape `(b, A)`).
        draft_input_ids (`torch.LongTensor` of shape `(b, A * B)`): the anchor's token, then ``mask_token_id``.
        label_positions (`torch.LongTensor` of shape `(b, A * B)`): position of each slot's label (clamped into the
            sequence; a clamped label is not supervised).
        target_token_ids (`torch.LongTensor` of shape `(b, A * B)`): the labels.
        teacher_positions (`torch.LongTensor` of shape `(b, A * B)`): the target position whose next-token
            distribution is the teacher of the slot (``label_positions - 1``): gather the target's states there
            with :func:`gather_positions`.
        predecessor_ids (`torch.LongTensor` of shape `(b, A * B)`): the token before each label (the candidate
            selector's predecessor).
        supervised_mask (`torch.BoolTensor` of shape `(b, A * B)`).
        position_weights (`torch.FloatTensor` of shape `(b, A * B)`).
        document_starts (`torch.LongTensor` of shape `(b, A)`): first position of the anchor's document.
        context_stops (`torch.LongTensor` of shape `(b, A)`): the block sees context ``[document_start, stop)``.
        normalizer (`torch.FloatTensor` of shape `(b,)`): supervised tokens per sample over ALL anchors of the batch;
            kept by :func:`select_anchors`, so a rank holding some anchors divides by the global count.
        block_size (`int`), sequence_length (`int`).
    """

    anchor_positions: torch.Tensor
    anchor_valid: torch.Tensor
    draft_input_ids: torch.Tensor
    label_positions: torch.Tensor
    target_token_ids: torch.Tensor
    teacher_positions: torch.Tensor
    predecessor_ids: torch.Tensor
    supervised_mask: torch.Tensor
    position_weights: torch.Tensor
    document_starts: torch.Tensor
    context_stops: torch.Tensor
    normalizer: torch.Tensor
    block_size: int
    sequence_length: int

    @property
    def num_anchors(self) -> int:
        return int(self.anchor_positions.shape[1])

    def select_anchors(self, index: torch.Tensor) -> "DFlashBatch":
        """See :func:`select_anchors`."""
        return select_anchors(self, index)


class CandidateSelector(Protocol):
    """What the loss needs of the drafter's candidate selector: its width ``top_k`` and its scores of candidates."""

    top_k: int

    def score_candidates(
        self,
        *,
        candidate_ids: torch.Tensor,
        unary_logits: torch.Tensor,
        hidden_states: torch.Tensor,
        predecessor_ids: torch.Tensor,
    ) -> torch.Tensor: ...


# A process group, where this torch build has torch.distributed.
_ProcessGroup = dist.ProcessGroup if dist.is_available() else type(None)
GlobalSum = Callable[[torch.Tensor], torch.Tensor] | _ProcessGroup


# ---------------------------------------------------------------- anchors, labels and weights (pure functions)


def valid_anchor_mask(loss_mask: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Positions that can anchor a block: supervised, not padding (document ``-1``), and followed by a supervised
    token of the same document.

    Args:
        loss_mask (`torch.Tensor` of shape `(b, T)`): nonzero where a token is supervised.
        document_ids (`torch.LongTensor` of shape `(b, T)`, *optional*): packed documents; ``-1`` marks padding.

    Returns:
        `torch.BoolTensor` of shape `(b, T)`.
    """
    supervised = loss_mask.bool()
    if document_ids is None:
        document_ids = torch.zeros_like(supervised, dtype=torch.int64)
    valid = torch.zeros_like(supervised)
    same_document = document_starts(document_ids)[:, 1:] == document_starts(document_ids)[:, :-1]
    valid[:, :-1] = supervised[:, :-1] & supervised[:, 1:] & same_document & (document_ids[:, :-1] != -1)
    return valid


def anchor_generator(seed: int, step: int) -> torch.Generator:
    """The CPU generator of step ``step``'s anchor draw: seeded by the project's counter-based hash of
    ``(seed, step)``, so any rank and any resumed run recreates it."""
    zero = torch.zeros((), dtype=torch.int64)
    bits = int(hash_uniform(seed, step, zero, zero, salt=SALT_ANCHORS).item() * 2.0**53)
    return torch.Generator(device="cpu").manual_seed(bits)


def sample_uniform_anchors(
    valid: torch.Tensor, max_anchors: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``max_anchors`` distinct valid positions per sample, uniformly at random, ascending.

    Args:
        valid (`torch.BoolTensor` of shape `(b, T)`, on the CPU): :func:`valid_anchor_mask`.
        max_anchors (`int`): anchor slots per sample.
        generator (`torch.Generator`): a CPU generator; one ``rand`` of shape ``(b, T)`` is drawn from it.

    Returns:
        `(positions, anchor_valid)`, `torch.LongTensor` and `torch.BoolTensor` of shape `(b, max_anchors)`; unused
        slots hold position 0 and are invalid.
    """
    batch, length = valid.shape
    # Every valid position gets a score in [0, 1); invalid ones 2, so the smallest scores are a uniform subset.
    scores = torch.rand(valid.shape, generator=generator).masked_fill(~valid, 2.0)
    taken = min(max_anchors, length)
    smallest, chosen = scores.topk(taken, dim=1, largest=False)
    chosen_valid = smallest < 2.0
    chosen, order = torch.where(chosen_valid, chosen, length).sort(dim=1)  # valid ones first, ascending
    chosen_valid = chosen_valid.gather(1, order)
    positions = torch.zeros(batch, max_anchors, dtype=torch.int64)
    anchor_valid = torch.zeros(batch, max_anchors, dtype=torch.bool)
    positions[:, :taken] = chosen.masked_fill(~chosen_valid, 0)
    anchor_valid[:, :taken] = chosen_valid
    return positions, anchor_valid


def sample_locality_anchors(
    valid: torch.Tensor, max_anchors: int, stride: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to ``max_anchors`` valid positions per sample, every ``s``-th valid one from a uniformly random start.

    With ``n`` valid positions, ``s`` is the smallest stride ``>= stride`` coprime with ``n``: the walk
    ``start + i * s (mod n)`` visits distinct positions, and each slot is uniform over the valid positions (what a
    uniform draw gives per slot; only the correlation between slots differs).

    Args:
        valid (`torch.BoolTensor` of shape `(b, T)`, on the CPU), max_anchors (`int`): as for
            :func:`sample_uniform_anchors`.
        stride (`int`): the stride before the coprime adjustment (the block size).
        generator (`torch.Generator`): one ``randint(n)`` is drawn per sample with a valid position, in sample order.

    Returns:
        `(positions, anchor_valid)` as :func:`sample_uniform_anchors`.
    """
    batch = valid.shape[0]
    positions = torch.zeros(batch, max_anchors, dtype=torch.int64)
    anchor_valid = torch.zeros(batch, max_anchors, dtype=torch.bool)
    for sample in range(batch):
        candidates = valid[sample].nonzero().flatten()
        n = int(candidates.numel())
        if n == 0:
            continue
        step = max(1, int(stride))
        while math.gcd(step, n) != 1:
            step += 1
        start = torch.randint(n, (1,), generator=generator)
        taken = min(max_anchors, n)
        walk = (start + torch.arange(taken) * step) % n
        positions[sample, :taken] = candidates[walk].sort().values
        anchor_valid[sample, :taken] = True
    return positions, anchor_valid


def position_weights(block_size: int, decay_gamma: float, sample_from_anchor: bool) -> torch.Tensor:
    """Loss weight of each slot of a block (`torch.FloatTensor` of shape `(block_size,)`).

    ``exp(-k/gamma)`` when every slot predicts (``sample_from_anchor``), else ``exp(-(k-1)/gamma)`` for ``k >= 1``
    and 0 for the anchor's own slot.
    """
    slots = torch.arange(block_size, dtype=torch.float32)
    if sample_from_anchor:
        return torch.exp(-slots / decay_gamma)
    weights = torch.exp(-(slots - 1) / decay_gamma)
    weights[0] = 0.0
    return weights


def dpace_weights(probability: torch.Tensor, mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE weights: the expected number of accepted tokens from each slot on.

    A slot's acceptance is ``q = (1 - alpha) * p + alpha`` (``p``: the drafter's probability of the label; 1 on
    unsupervised slots); the weight of slot ``k`` is ``sum_{j >= k} mask_j * prod_{i <= j} q_i``: the accepted length
    that a mistake at ``k`` would lose. The caller masks the weights of unsupervised slots.

    Args:
        probability (`torch.Tensor` of shape `(..., B)`), mask (`torch.Tensor` of shape `(..., B)`, 0/1): per block.
        alpha (`float`): smoothing in ``[0, 1]``.
    """
    acceptance = torch.where(mask > 0, (1.0 - alpha) * probability + alpha, torch.ones_like(probability))
    reach = acceptance.cumprod(dim=-1) * mask
    return reach.flip(-1).cumsum(dim=-1).flip(-1)


# ---------------------------------------------------------------- splitting a batch's anchors across ranks


def select_anchors(batch: DFlashBatch, index: torch.Tensor) -> DFlashBatch:
    """The sub-batch of anchor slots ``index`` (of every sample), keeping the global ``normalizer``.

    Args:
        batch (`DFlashBatch`): a batch from :meth:`DFlashObjective.prepare`.
        index (`torch.LongTensor` of shape `(k,)`): slots in ``[0, A)``; e.g. a rank's share from :func:`deal_anchors`.
    """
    index = torch.as_tensor(index, dtype=torch.int64, device=batch.anchor_positions.device)
    if index.ndim != 1:
        raise ValueError(f"select_anchors: index must be 1-D (anchor slots), got shape {tuple(index.shape)}")
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= batch.num_anchors):
        raise ValueError(
            f"select_anchors: slots must be in [0, {batch.num_anchors}), got {int(index.min())}..{int(index.max())}"
        )
    size, block = batch.anchor_positions.shape[0], batch.block_size

    def per_token(values: torch.Tensor) -> torch.Tensor:
        return values.view(size, -1, block).index_select(1, index).reshape(size, -1)

    fields = {}
    for field in dataclasses.fields(batch):
        value = getattr(batch, field.name)
        if field.name in _PER_ANCHOR_FIELDS:
            fields[field.name] = value.index_select(1, index)
        elif field.name in _PER_SAMPLE_FIELDS:
            fields[field.name] = value
        else:
            fields[field.name] = per_token(value)
    return DFlashBatch(**fields)


def active_anchor_slots(batch: DFlashBatch) -> torch.Tensor:
    """Slots valid in at least one sample (`torch.LongTensor`): the others carry no loss and need not be run."""
    return batch.anchor_valid.any(dim=0).nonzero().flatten()


def anchor_costs(batch: DFlashBatch, *, sliding_window: int | None = None) -> torch.Tensor:
    """Attention cost of each anchor slot: the context keys its block's queries see, summed over the samples.

    The block of an anchor at ``a`` in a document starting at ``s`` sees context ``[s, a)``; each of its ``B`` queries
    sees all of it, or with a sliding window ``W`` the query at ``a + k`` sees ``min(a - s, W - 1 - k)`` keys (the
    keys ``p`` with ``a + k - p < W``). A model mixing full and sliding layers sums the costs of its layers.

    Returns:
        `torch.LongTensor` of shape `(A,)`.
    """
    width = (batch.context_stops - batch.document_starts).clamp_min(0) * batch.anchor_valid
    if sliding_window is None:
        keys = width * batch.block_size
    else:
        if sliding_window < 1:
            raise ValueError(f"anchor_costs: sliding_window must be >= 1 or None, got {sliding_window}")
        per_query = (sliding_window - 1 - torch.arange(batch.block_size, device=width.device)).clamp_min(0)
        keys = torch.minimum(width.unsqueeze(-1), per_query).sum(dim=-1)
    return keys.sum(dim=0)


def deal_anchors(costs: torch.Tensor, world: int) -> list[torch.Tensor]:
    """Deal anchor slots to ``world`` ranks so that their costs balance.

    Slots are ordered heaviest, lightest, second heaviest, second lightest, ...; consecutive (heavy, light) pairs go
    to the ranks in turn (single slots in turn when there are fewer than ``2 * world``). A rank may get no slot when
    there are fewer slots than ranks.

    Args:
        costs (`torch.Tensor` of shape `(n,)`): e.g. :func:`anchor_costs`.
        world (`int`): number of ranks.

    Returns:
        `list[torch.LongTensor]`: rank ``r``'s slots (indices into ``costs``), ascending; every slot exactly once.
    """
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"deal_anchors: world must be an int >= 1, got {world!r}")
    if costs.ndim != 1:
        raise ValueError(f"deal_anchors: costs must be 1-D (one per slot), got shape {tuple(costs.shape)}")
    n = costs.numel()
    by_cost = torch.argsort(costs, stable=True)
    turn = torch.arange(n, device=costs.device)
    pair = turn // 2
    dealt = by_cost[torch.where(turn % 2 == 0, n - 1 - pair, pair)]
    owner = (pair if n >= 2 * world else turn) % world
    return [dealt[owner == rank].sort().values for rank in range(world)]


def gather_positions(states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``states[i, positions[i, j]]``: ``[b, T, ...]`` and ``[b, N]`` -> ``[b, N, ...]`` (e.g. the target's last
    hidden states at :attr:`DFlashBatch.teacher_positions`)."""
    index = positions.reshape(*positions.shape, *([1] * (states.ndim - 2)))
    return states.gather(1, index.expand(*positions.shape, *states.shape[2:]))


# ---------------------------------------------------------------- the objective


class DFlashObjective:
    """Draws anchors (:meth:`prepare`) and scores the drafter on them (:meth:`loss`, :meth:`loss_from_hidden`).

    Args:
        config (`DFlashObjectiveConfig`): the settings; keyword arguments build one when it is omitted.
    """

    def __init__(self, config: DFlashObjectiveConfig | None = None, **kwargs: Any) -> None:
        if config is not None and kwargs:
            raise ValueError(f"DFlashObjective: give a config or keyword settings, not both (got {sorted(kwargs)})")
        self.config = config if config is not None else DFlashObjectiveConfig(**kwargs)
        self.seed = self.config.seed
        self.batches_prepared = 0
        self.anchors_sampled = 0
        self.supervised_tokens = 0
        self.last_step: int | None = None

    # ------------------------------------------------------------ anchors

    def prepare(
        self,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        *,
        step: int,
    ) -> DFlashBatch:
        """Draw the anchors of a batch and build their blocks, labels and weights.

        Args:
            input_ids (`torch.LongTensor` of shape `(b, T)`).
            loss_mask (`torch.Tensor` of shape `(b, T)`): nonzero on supervised tokens.
            document_ids (`torch.LongTensor` of shape `(b, T)`, *optional*): packed documents, ``-1`` for padding.
            step (`int`): the training step; the draw depends only on ``(seed, step)`` and the batch.

        Returns:
            `DFlashBatch` with ``A = max_anchors`` slots, on ``input_ids``' device.
        """
        if input_ids.ndim != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"prepare: input_ids must be [batch, sequence>0], got shape {tuple(input_ids.shape)}")
        for name, value in (("loss_mask", loss_mask), ("document_ids", document_ids)):
            if value is not None and value.shape != input_ids.shape:
                raise ValueError(f"prepare: {name} has shape {tuple(value.shape)}, input_ids {tuple(input_ids.shape)}")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"prepare: step must be an int >= 0, got {step!r}")
        config, device = self.config, input_ids.device
        size, length = input_ids.shape
        if document_ids is None:
            document_ids = torch.zeros_like(input_ids)
        document_ids = document_ids.to(torch.int64)
        valid = valid_anchor_mask(loss_mask, document_ids).cpu()
        generator = anchor_generator(self.seed, step)
        if config.anchor_sampling == "uniform":
            anchors, anchor_valid = sample_uniform_anchors(valid, config.max_anchors, generator)
        else:
            anchors, anchor_valid = sample_locality_anchors(valid, config.max_anchors, config.block_size, generator)
        anchors, anchor_valid = anchors.to(device), anchor_valid.to(device)

        block = config.block_size
        slots = torch.arange(block, device=device)
        shift = 1 if config.sample_from_anchor else 0
        labels = (anchors.unsqueeze(-1) + slots + shift).reshape(size, -1)  # [b, A*B]
        in_sequence = labels < length
        labels = labels.clamp_max(length - 1)
        before_label = (labels - 1).clamp_min(0)
        starts = document_starts(document_ids)
        anchor_starts = starts.gather(1, anchors)
        supervised = (
            loss_mask.bool().gather(1, labels)
            & in_sequence
            & (starts.gather(1, labels).view(size, -1, block) == anchor_starts.unsqueeze(-1)).reshape(size, -1)
            & anchor_valid.repeat_interleave(block, dim=1)
        )
        if not config.sample_from_anchor:
            supervised.view(size, -1, block)[:, :, 0] = False
        draft = torch.full((size, config.max_anchors, block), config.mask_token_id, dtype=input_ids.dtype,
                           device=device)
        draft[:, :, 0] = input_ids.gather(1, anchors)
        weights = position_weights(block, config.decay_gamma, config.sample_from_anchor).to(device)
        no_context = torch.full_like(anchors, length)

        self.batches_prepared += 1
        self.anchors_sampled += int(anchor_valid.sum())
        self.supervised_tokens += int(supervised.sum())
        self.last_step = step
        return DFlashBatch(
            anchor_positions=anchors,
            anchor_valid=anchor_valid,
            draft_input_ids=draft.reshape(size, -1),
            label_positions=labels,
            target_token_ids=input_ids.gather(1, labels),
            teacher_positions=before_label,
            predecessor_ids=input_ids.gather(1, before_label),
            supervised_mask=supervised,
            position_weights=weights.repeat(config.max_anchors).expand(size, -1).contiguous(),
            document_starts=torch.where(anchor_valid, anchor_starts, no_context),
            context_stops=torch.where(anchor_valid, anchors, no_context),
            normalizer=supervised.sum(dim=1, dtype=torch.float32),
            block_size=block,
            sequence_length=length,
        )

    # ------------------------------------------------------------ losses

    def loss(
        self,
        logits: torch.Tensor,
        batch: DFlashBatch,
        *,
        teacher_logits: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        selector: CandidateSelector | None = None,
        selector_alpha: float | None = None,
        global_sum: GlobalSum | None = None,
    ) -> torch.Tensor:
        """The loss of the drafter's logits on ``batch`` (this rank's share of a split batch: the shares add up).

        Args:
            logits (`torch.Tensor` of shape `(b, A * B, V)`): the drafter's final logits (any logit scaling or
                softcapping already applied).
            batch (`DFlashBatch`): from :meth:`prepare`, or a rank's share (:func:`select_anchors`).
            teacher_logits (`torch.Tensor` of shape `(b, A * B, V)`, *optional*): the target's logits at
                ``batch.teacher_positions``; `"kl"` only, and required there.
            hidden_states (`torch.Tensor` of shape `(b, A * B, H)`, *optional*): the drafter's final hidden states,
                needed with a ``selector``.
            selector (`CandidateSelector`, *optional*): `"dpace"` only: adds ``selector_alpha`` times the selector's
                cross entropy over the ``top_k`` candidates, on rows whose label is a candidate.
            selector_alpha (`float`, *optional*): defaults to ``config.selector_loss_alpha``
                (see :meth:`selector_alpha`).
            global_sum (`Callable` or `ProcessGroup`, *optional*): `"dpace"` only, with the batch's anchors split over
                ranks: sums a small detached tensor over the ranks holding disjoint anchor shares of the same samples
                (the block-parallel peers), e.g. the process group of those ranks. Ranks holding the same anchors
                (context-parallel replicas) must not be summed twice. Every rank must call the loss, even with no
                anchor. Not needed for `"ce"` and `"kl"`, whose normaliser travels in the batch.

        Returns:
            `torch.Tensor`: a scalar in ``logits``' dtype promoted to at least float32.
        """
        mask = batch.supervised_mask
        if logits.ndim != 3 or logits.shape[:2] != mask.shape:
            raise ValueError(
                f"loss: logits must be [batch, anchors*block={mask.shape[1]}, vocab], got shape {tuple(logits.shape)}"
            )
        self._check_teacher(teacher_logits is not None, "teacher_logits")
        if teacher_logits is not None and teacher_logits.shape != logits.shape:
            raise ValueError(f"loss: teacher_logits {tuple(teacher_logits.shape)} != logits {tuple(logits.shape)}")
        rows = mask.reshape(-1).nonzero().flatten()
        hidden_rows = self._selector_rows(selector, hidden_states, mask, rows)
        top_k = selector.top_k if self._uses_selector(selector) else 0
        teacher = None if teacher_logits is None else teacher_logits.reshape(-1, logits.shape[-1])[rows]
        stats = _row_statistics(logits.reshape(-1, logits.shape[-1])[rows], batch.target_token_ids.reshape(-1)[rows],
                                teacher, top_k)
        anchor = _graph_anchor(logits, hidden_states, selector)
        return self._reduce(stats, rows, batch, hidden_rows, selector, selector_alpha, global_sum, anchor)

    def loss_from_hidden(
        self,
        hidden_states: torch.Tensor,
        head_weight: torch.Tensor,
        batch: DFlashBatch,
        *,
        output_multiplier: float = 1.0,
        logit_softcap: float | None = None,
        teacher_hidden_states: torch.Tensor | None = None,
        teacher_head: Callable[[torch.Tensor], torch.Tensor] | None = None,
        selector: CandidateSelector | None = None,
        selector_alpha: float | None = None,
        global_sum: GlobalSum | None = None,
    ) -> torch.Tensor:
        """:meth:`loss` from the drafter's final hidden states and the (frozen) head, without ``[b, A*B, V]`` logits.

        Only supervised rows are projected, ``config.chunk_rows`` at a time; each chunk's logits are recomputed in
        the backward pass instead of kept. Logits are ``softcap * tanh(multiplier * h @ W.T / softcap)``.

        Args:
            hidden_states (`torch.Tensor` of shape `(b, A * B, H)`), head_weight (`torch.Tensor` of shape `(V, H)`).
            output_multiplier (`float`), logit_softcap (`float`, *optional*): the drafter's logit transform.
            teacher_hidden_states (`torch.Tensor` of shape `(b, A * B, H_t)`, *optional*), teacher_head (`Callable`,
                *optional*): `"kl"`: the target's states at ``batch.teacher_positions`` and the map from them to its
                logits (run under ``no_grad``): ``target.lm_head`` for transformers' ``hidden_states[-1]``, which is
                already after the final norm; ``lambda h: target.lm_head(target.model.norm(h))`` for states before it.
            Other arguments as :meth:`loss`.
        """
        mask = batch.supervised_mask
        if hidden_states.ndim != 3 or hidden_states.shape[:2] != mask.shape:
            raise ValueError(
                f"loss_from_hidden: hidden_states must be [batch, anchors*block={mask.shape[1]}, hidden], "
                f"got shape {tuple(hidden_states.shape)}"
            )
        if head_weight.ndim != 2 or head_weight.shape[1] != hidden_states.shape[-1]:
            raise ValueError(
                f"loss_from_hidden: head_weight must be [vocab, {hidden_states.shape[-1]}], "
                f"got {tuple(head_weight.shape)}"
            )
        if logit_softcap is not None and not logit_softcap > 0:
            raise ValueError(f"loss_from_hidden: logit_softcap must be positive or None, got {logit_softcap!r}")
        self._check_teacher(teacher_hidden_states is not None, "teacher_hidden_states")
        if (teacher_hidden_states is None) != (teacher_head is None):
            raise ValueError("loss_from_hidden: give teacher_hidden_states and teacher_head together")
        rows = mask.reshape(-1).nonzero().flatten()
        flat_hidden = hidden_states.reshape(-1, hidden_states.shape[-1])[rows]
        top_k = selector.top_k if self._uses_selector(selector) else 0
        labels = batch.target_token_ids.reshape(-1)[rows]
        teacher = None
        if teacher_hidden_states is not None:
            if teacher_hidden_states.shape[:2] != mask.shape:
                raise ValueError(
                    f"loss_from_hidden: teacher_hidden_states must be [batch, {mask.shape[1]}, hidden], "
                    f"got shape {tuple(teacher_hidden_states.shape)}"
                )
            teacher = teacher_hidden_states.reshape(-1, teacher_hidden_states.shape[-1])[rows].detach()

        def chunk_statistics(hidden: torch.Tensor, chunk_labels: torch.Tensor, chunk_teacher: torch.Tensor | None):
            logits = F.linear(hidden, head_weight)
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) * output_multiplier
            if logit_softcap is not None:
                logits = torch.tanh(logits / logit_softcap) * logit_softcap
            teacher_logits = None
            if chunk_teacher is not None:
                with torch.no_grad():
                    teacher_logits = teacher_head(chunk_teacher)
            return _row_statistics(logits, chunk_labels, teacher_logits, top_k)

        chunks = []
        for start in range(0, rows.numel(), self.config.chunk_rows):
            part = slice(start, start + self.config.chunk_rows)
            args = (flat_hidden[part], labels[part], None if teacher is None else teacher[part])
            if torch.is_grad_enabled() and (flat_hidden.requires_grad or head_weight.requires_grad):
                chunks.append(checkpoint(chunk_statistics, *args, use_reentrant=False))
            else:
                chunks.append(chunk_statistics(*args))
        if chunks:
            stats = {key: torch.cat([chunk[key] for chunk in chunks]) for key in chunks[0]}
        else:  # no supervised row: empty statistics of the right dtypes
            stats = chunk_statistics(flat_hidden, labels, teacher)
        hidden_rows = flat_hidden if self._uses_selector(selector) else None
        anchor = _graph_anchor(hidden_states, None, selector)
        return self._reduce(stats, rows, batch, hidden_rows, selector, selector_alpha, global_sum, anchor)

    def selector_alpha(self, step: int, total_steps: int) -> float:
        """Weight of the selector loss at optimizer step ``step`` of ``total_steps``: 0 during the warmup
        (``selector_warmup_ratio``), then a linear ramp over ``selector_ramp_ratio`` to ``selector_loss_alpha``."""
        config = self.config
        warmup = int(max(1, total_steps) * config.selector_warmup_ratio)
        if step < warmup:
            return 0.0
        ramp = int(max(1, total_steps) * config.selector_ramp_ratio)
        factor = 1.0 if ramp <= 0 else min(max((step - warmup + 1) / ramp, 0.0), 1.0)
        return config.selector_loss_alpha * factor

    # ------------------------------------------------------------ checkpoint state

    def state_dict(self) -> dict[str, Any]:
        """The seed, the counters and the settings that decide anchors and labels."""
        return {
            "kind": STATE_KIND,
            "version": STATE_VERSION,
            "seed": self.seed,
            "batches_prepared": self.batches_prepared,
            "anchors_sampled": self.anchors_sampled,
            "supervised_tokens": self.supervised_tokens,
            "last_step": self.last_step,
            **{name: getattr(self.config, name) for name in _RESUME_FIELDS},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the checkpoint's seed and counters replace this objective's.

        Raises:
            ValueError: the state is not a DFlash objective's, or its anchor and label settings differ from this run's.
        """
        if state.get("kind") != STATE_KIND or state.get("version") != STATE_VERSION:
            raise ValueError(
                f"load_state_dict: expected {STATE_KIND!r} state version {STATE_VERSION}, got kind "
                f"{state.get('kind')!r} version {state.get('version')!r}"
            )
        for name in _RESUME_FIELDS:
            if state.get(name) != getattr(self.config, name):
                raise ValueError(
                    f"load_state_dict: the checkpoint was trained with {name}={state.get(name)!r}, this run has "
                    f"{getattr(self.config, name)!r}; resume with the checkpoint's setting"
                )
        self.seed = int(state["seed"])
        self.batches_prepared = int(state["batches_prepared"])
        self.anchors_sampled = int(state["anchors_sampled"])
        self.supervised_tokens = int(state["supervised_tokens"])
        self.last_step = state["last_step"]

    # ------------------------------------------------------------ internals

    def _check_teacher(self, given: bool, name: str) -> None:
        if self.config.loss == "kl" and not given:
            raise ValueError(f"loss='kl' needs {name} (the target's next-token distribution at teacher_positions)")
        if self.config.loss != "kl" and given:
            raise ValueError(f"{name} is only used by loss='kl'; this objective has loss={self.config.loss!r}")

    def _uses_selector(self, selector: CandidateSelector | None) -> bool:
        if selector is not None and self.config.loss != "dpace":
            raise ValueError(f"a candidate selector is trained with loss='dpace' only, not {self.config.loss!r}")
        return selector is not None

    def _selector_rows(self, selector, hidden_states, mask, rows) -> torch.Tensor | None:
        if not self._uses_selector(selector):
            return None
        if hidden_states is None or hidden_states.shape[:2] != mask.shape:
            raise ValueError(
                f"loss: a selector needs hidden_states of shape [batch, {mask.shape[1]}, hidden], got "
                f"{None if hidden_states is None else tuple(hidden_states.shape)}"
            )
        return hidden_states.reshape(-1, hidden_states.shape[-1])[rows]

    def _reduce(self, stats, rows, batch, hidden_rows, selector, selector_alpha, global_sum, anchor) -> torch.Tensor:
        config, mask = self.config, batch.supervised_mask
        dtype = stats["ce"].dtype
        weights = batch.position_weights.reshape(-1)[rows].to(dtype)
        if config.loss in ("ce", "kl"):
            token_loss = stats["kl"] if config.loss == "kl" else stats["ce"]
            sample = rows // mask.shape[1]
            per_sample = torch.zeros(mask.shape[0], dtype=dtype, device=mask.device)
            per_sample = per_sample.index_add(0, sample, token_loss * weights)
            return (per_sample / (batch.normalizer.to(dtype) + NORMALIZER_EPS)).mean() + anchor

        # D-PACE: weights from the detached probabilities of each block's labels.
        probability = stats["ce"].neg().exp()
        blocks = torch.zeros(mask.numel(), dtype=dtype, device=mask.device)
        blocks = blocks.index_copy(0, rows, probability.detach())
        blocks = blocks.view(mask.shape[0], mask.shape[1] // batch.block_size, batch.block_size)
        block_mask = mask.view_as(blocks).to(dtype)
        with torch.no_grad():
            weights = (block_mask * dpace_weights(blocks, block_mask, config.dpace_alpha)).reshape(-1)[rows]
        totals = _sum_over_ranks(
            torch.stack((weights.sum(), (blocks * block_mask).sum(), block_mask.sum())), global_sum
        )
        ce_sum = (stats["ce"] * weights).sum()
        tv_sum = ((1.0 - probability) * weights).sum()
        if config.lk_loss_type == "tv":
            numerator = tv_sum
        elif config.lk_loss_type == "lambda":
            acceptance = totals[1] / totals[2].clamp_min(1.0)
            ce_share = config.kl_scale * torch.exp(-config.kl_decay * acceptance)
            numerator = ce_share * ce_sum + (1.0 - ce_share) * tv_sum
        else:
            numerator = ce_sum
        if selector is not None:
            alpha = config.selector_loss_alpha if selector_alpha is None else float(selector_alpha)
            numerator = numerator + alpha * self._selector_sum(stats, rows, batch, hidden_rows, selector, weights)
        return numerator / totals[0].clamp_min(torch.finfo(dtype).tiny) + anchor

    def _selector_sum(self, stats, rows, batch, hidden_rows, selector, weights) -> torch.Tensor:
        labels = batch.target_token_ids.reshape(-1)[rows]
        hits = stats["top_ids"] == labels.unsqueeze(-1)
        covered = hits.any(dim=-1)
        unary = stats["top_values"]
        if self.config.selector_stop_gradient:
            hidden_rows, unary = hidden_rows.detach(), unary.detach()
        scores = selector.score_candidates(
            candidate_ids=stats["top_ids"],
            unary_logits=unary,
            hidden_states=hidden_rows,
            predecessor_ids=batch.predecessor_ids.reshape(-1)[rows],
        )
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
        token_loss = F.cross_entropy(scores, hits.long().argmax(dim=-1), reduction="none")
        return (token_loss * weights * covered).sum()


def _row_statistics(
    logits: torch.Tensor, labels: torch.Tensor, teacher_logits: torch.Tensor | None, top_k: int
) -> dict[str, torch.Tensor]:
    """Per row: cross entropy with the label, forward KL from the teacher, the top-k logits and their ids."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    log_z = torch.logsumexp(logits, dim=-1)
    stats = {"ce": log_z - logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)}
    if teacher_logits is not None:
        teacher_log_p = F.log_softmax(teacher_logits.to(logits.dtype), dim=-1)
        teacher_p = teacher_log_p.exp()
        stats["kl"] = (torch.xlogy(teacher_p, teacher_p) - teacher_p * (logits - log_z.unsqueeze(-1))).sum(dim=-1)
    if top_k:
        stats["top_values"], stats["top_ids"] = logits.topk(top_k, dim=-1)
    return stats


def _graph_anchor(states: torch.Tensor, hidden_states: torch.Tensor | None, selector: Any) -> torch.Tensor:
    """An exact zero that depends on the inputs and the selector's parameters.

    A rank with no supervised token still returns a loss whose backward reaches every trainable tensor, so
    data-parallel gradient reduction sees the same parameters on every rank. (The sum of an empty slice: unlike
    ``x * 0`` it stays 0 when ``x`` holds an infinity.)
    """
    anchor = states.reshape(-1)[:0].sum()
    if hidden_states is not None:
        anchor = anchor + hidden_states.reshape(-1)[:0].sum()
    if isinstance(selector, torch.nn.Module):
        for parameter in selector.parameters():
            if parameter.requires_grad:
                anchor = anchor + parameter.reshape(-1)[:0].sum()
    return anchor.to(torch.promote_types(anchor.dtype, torch.float32))


def _sum_over_ranks(value: torch.Tensor, global_sum: GlobalSum | None) -> torch.Tensor:
    value = value.detach().clone()
    if global_sum is None:
        return value
    if dist.is_available() and isinstance(global_sum, dist.ProcessGroup):
        dist.all_reduce(value, group=global_sum)
        return value
    summed = global_sum(value)
    if not isinstance(summed, torch.Tensor) or summed.shape != value.shape:
        raise ValueError(f"global_sum must return a tensor of shape {tuple(value.shape)}, got {summed!r}")
    return summed.detach()


__all__ = [
    "CandidateSelector",
    "DFlashBatch",
    "DFlashObjective",
    "DFlashObjectiveConfig",
    "active_anchor_slots",
    "anchor_costs",
    "anchor_generator",
    "deal_anchors",
    "dpace_weights",
    "gather_positions",
    "position_weights",
    "sample_locality_anchors",
    "sample_uniform_anchors",
    "select_anchors",
    "valid_anchor_mask",
]
