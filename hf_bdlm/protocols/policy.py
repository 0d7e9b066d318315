"""What the GRPO trainer (:class:`hf_bdlm.rl.trainer.BDLMGRPOTrainer`) needs of a family's model as a policy: rollouts
decoded by the family's serving decoder, and per-token log-probabilities by a named estimator. A family's policy role
(:class:`hf_bdlm.protocols.roles.PolicySpec`) builds the run's :class:`Policy` once.

    policy = family.role("policy").policy(model, tokenizer, args)    # once per run
    rollout = policy.rollout(model, prompts, seed)                      # per generation round
    logps, entropies = policy.log_probs(runner, batch, scoring)         # old, reference and current log-probs
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The estimators by name (BDLMGRPOConfig.logp_estimator; docs/rl.md): the decoding trace recomputed, complementary mask
# pairs, d1's one-step estimate.
LOGP_ESTIMATORS = ("trace", "coupled", "one_step")


@dataclass
class Rollout:
    """One generation round's completions, in the order of its prompts.

    Attributes:
        completions (`list[list[int]]`): each prompt's completion tokens (through its first EOS, at most the budget).
        log_probs (`list[list[float]] | None`): the log-probability each completion token was sampled with (the
            decoder's own, before top-k / top-p), when the decoder records it.
        rows (`dict[str, Any]`): per-row records the family's estimators read back (its decoding trace), each a tensor
            whose first dimension is the rows: they travel with the rows through the trainer's shuffles and splits.
    """

    completions: list[list[int]]
    log_probs: list[list[float]] | None = None
    rows: dict[str, Any] = field(default_factory=dict)


@dataclass
class PolicyBatch:
    """The rows one log-probability call scores (TRL's layout: prompts left-padded, completions right-padded).

    Attributes:
        prompt_ids, prompt_mask (`torch.LongTensor` of shape `[b, P]`): left-padded prompts and their mask.
        completion_ids, completion_mask (`torch.LongTensor` of shape `[b, C]`): right-padded completions and their
            mask (a truncated completion's mask may be all zeros: it is not scored by the loss).
        rows (`dict[str, torch.Tensor]`): the family's per-row records of these rows (:attr:`Rollout.rows`).
        width (`int`): the longest prompt + completion of the generation round these rows belong to: every call on
            the round's rows lays them out in the same frame, so a row's numbers do not depend on its batch.
    """

    prompt_ids: Any
    prompt_mask: Any
    completion_ids: Any
    completion_mask: Any
    rows: dict[str, Any]
    width: int


@dataclass(frozen=True)
class PolicyScoring:
    """How one log-probability call scores its rows.

    Attributes:
        estimator (`str`): one of :data:`LOGP_ESTIMATORS`.
        temperature (`float`): the logits are divided by it (the sampling temperature, as TRL scores).
        seed (`int`): the seed of this round's and iteration's draws (``coupled``'s and ``one_step``'s masks).
        prompt_mask_ratio (`float`): ``one_step``'s share of prompt tokens masked.
        cache_clean_rows (`bool`): ``trace``: run the clean rows once and keep their K/V for every step's forward
            (off under activation checkpointing, whose layers keep no cache: each step's forward runs them again).
        group (`torch.distributed.ProcessGroup | None`): the ranks whose forwards must match one for one (under
            FSDP2 every forward all-gathers the layers' parameters; under DDP every forward with gradients broadcasts
            the buffers): an estimator whose number of forwards depends on the rows agrees on it over this group (an
            all-reduce) and runs the same forwards on every rank, the extra ones joined to the result with weight
            zero. ``None``: the forwards make no collective (one process, or a model no wrapper reduces).
        block_parallel (`hf_bdlm.parallel.BlockParallelPlugin | None`): a block-parallel plugin whose group (``P > 1``
            ranks) holds these same rows on every rank: the training form's forward is sharded over the group as SFT
            shards it (the plugin's layout: its mode, schedule and transport), each token is scored on the one rank
            that counts its predicting row, and the values are summed over the group, so every rank returns the
            single-process numbers; in backward each rank's gradient is its rows' share (the group's gradients add
            up to the single-process gradient). ``None``: every row on this process.
    """

    estimator: str
    temperature: float = 1.0
    seed: int = 0
    prompt_mask_ratio: float = 0.15
    cache_clean_rows: bool = True
    group: Any = None
    block_parallel: Any = None


class Policy:
    """One run's policy, built once by :meth:`~hf_bdlm.protocols.roles.PolicySpec.policy` from the run's arguments (the
    decoding settings of its rollouts, the estimator).

    Attributes:
        estimators (`tuple[str, ...]`): the estimators it implements.
        data_parallel (`bool`): whether several processes may train it (DDP, FSDP2): its estimators run every forward
            through the runner they are given (the wrapper that reduces the gradients) and run the same forwards on
            every rank of :attr:`PolicyScoring.group`.
        single_process_reason (`str`): why not, when ``data_parallel`` is false (the trainer's refusal says it).
        block_parallel_estimators (`tuple[str, ...]`): the estimators whose scoring forward shards over a
            block-parallel group (:attr:`PolicyScoring.block_parallel`); none by default.
    """

    estimators: tuple[str, ...] = ()
    data_parallel: bool = False
    block_parallel_estimators: tuple[str, ...] = ()
    single_process_reason: str = "its estimators are not verified under data parallelism"

    def rollout(self, model, prompts: list[list[int]], seed: int, trace: bool = False) -> Rollout:
        """Decode ``prompts`` (token lists) together with the family's serving decoder, seeded by ``seed``; with
        ``trace`` the rows carry what ``log_probs`` needs to recompute each token's decoding step."""
        raise NotImplementedError

    def log_probs(self, runner, batch: PolicyBatch, scoring: PolicyScoring, entropy: bool = False):
        """``(log_probs [b, C], entropies [b, C] or None)`` of ``batch``'s completion tokens under ``runner`` (the
        model, or its training wrapper), with gradients when enabled; positions past a completion are 0."""
        raise NotImplementedError


__all__ = ["LOGP_ESTIMATORS", "Policy", "PolicyBatch", "PolicyScoring", "Rollout"]
