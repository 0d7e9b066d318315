"""A converted block-diffusion LM as a GRPO policy: rollouts by its serving decoder, log-probabilities by estimator.

Rollouts are :class:`~..inference.serving.BlockDiffusionServingDecoder`'s ragged batch (``decode_ragged``), seeded
by the round's seed, with the run's sampling fields and decoding techniques; with ``trace`` the decoder records how
it committed every token (:class:`~..generation.trace.DecodingTrace`), and the rows carry it.

The three estimators (``hf_bdlm.rl.estimators``; docs/rl.md), each a prediction of a completion token ``x_j`` by the
model, scored by ``token_log_probs`` (logits over the temperature, ``[MASK]`` left out as the decoder leaves it out).
Every row is laid out in its own columns (its prompt, its completion, ``[MASK]``/pad up to a frame of whole blocks
common to the generation round), with RoPE positions from its first token, as the decoder runs it alone:

- ``trace``: one clean forward over the frame (block-causal clean rows, their K/V kept in a
  :class:`~..generation.kv_cache.DecodingCache` with gradients), then one forward per decoding step ``k``: every
  completion block as it was at step ``k`` (the tokens committed before ``k``, ``[MASK]`` elsewhere) as noisy rows
  over the cached clean K/V of the blocks before it; the tokens committed at step ``k`` are scored from it. Forwards:
  ``1 + (steps of the longest block)``, whatever the number of tokens. Each step's noisy block sees exactly what the
  decoder's step saw (its clean prefix, its own block's state), so the numbers are the decoder's. Under activation
  checkpointing (whose layers keep no cache; ``PolicyScoring.cache_clean_rows`` off) each step's forward is the
  training form instead, the clean rows computed again with the step's noisy ones: ``steps`` forwards of twice the
  rows. Across the ranks of ``PolicyScoring.group`` (FSDP2, DDP) every rank runs as many step forwards as the rank
  whose rows took most steps (an all-reduce), a step with no token of its own joined to the result with weight zero
  (``0 * hidden.sum()``): the same forwards and backward everywhere, the same numbers as alone.
- ``coupled``: the training form (noisy and clean streams, prompt clean), twice, the completion masked by a draw
  ``M`` (per block ``l`` of ``n`` tokens, ``l`` uniform on ``1..n``) and by its complement; each token is scored by the
  forward that masks it. Positions past the completion stay ``[MASK]``.
- ``one_step``: the training form once, the completion fully masked, each prompt token masked with probability
  ``prompt_mask_ratio`` (in both streams: the context every block is predicted from).

With a token shift (``fast_dllm_v2`` checkpoints) position ``j`` is predicted by row ``j - 1``, a block's first
position by the clean row before the block, as the decoder predicts it.

**Block parallelism** (``PolicyScoring.block_parallel``, a plugin whose group of ``P`` ranks holds the same rows): every
training-form forward (``coupled``, ``one_step``, and ``trace`` in its training form: the clean rows run again with each
step's noisy ones, as under activation checkpointing) runs sharded as SFT runs it: the frame padded to the layout's
multiple (:meth:`BlockParallelPlugin.pad_multiple`), each rank's rows of the plugin's layout
(:class:`~hf_bdlm.parallel.ShardedLayout`: its mode, schedule and K/V transport), each token scored on the one rank that
counts the row predicting it (``loss_row_mask``), and the scores summed over the group: every rank returns the numbers
of one process, and the group's gradients add up to its gradient. ``trace``'s cached form (noisy rows over the clean
rows' cached K/V) is not sharded.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ....attention import CLEAN, NOISY, LocalLayout, RowMeta, vectorized_rows
from ....attention.rows import stream_rows
from ....protocols.decoding import DecodingRequest
from ....protocols.policy import Policy, PolicyBatch, PolicyScoring, Rollout
from ....protocols.step import unwrap_model
from ....rl.estimators import coupled_masks, prompt_masks, sample_key, token_log_probs
from ..generation.kv_cache import DecodingCache, StepPlan, StepWindow
from ..generation.trace import NEVER, DecodingTrace


def rollout_fields(args, eos_token_ids: list[int], pad_token_id: int | None) -> dict:
    """The decoder's generation fields of a GRPO run: TRL's sampling fields, the threshold and steps, then
    ``generation_kwargs`` (any other field of the decoder)."""
    fields = dict(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                  max_new_tokens=args.max_completion_length, eos_token_id=list(eos_token_ids) or None,
                  pad_token_id=pad_token_id)
    if args.confidence_threshold is not None:
        fields["confidence_threshold"] = args.confidence_threshold
    if args.steps_per_block is not None:
        fields["steps_per_block"] = args.steps_per_block
    fields.update(args.generation_kwargs or {})
    return fields


class BlockDiffusionPolicy(Policy):
    """One GRPO run's policy over a [`BlockDiffusionForMaskedLM`] (module docstring)."""

    estimators = ("trace", "coupled", "one_step")
    data_parallel = True
    block_parallel_estimators = ("trace", "coupled", "one_step")  # trace in its training form (module docstring)

    def __init__(self, decoder):
        self.decoder = decoder
        self.settings = decoder.settings(DecodingRequest(), 1, decoder.generation_config.max_new_tokens)
        if self.settings.block_cache:
            raise ValueError("block_cache=True decodes a sub-block's later steps over K/V its earlier steps left, "
                             "which no block state reproduces; GRPO rollouts decode without it (leave block_cache "
                             "unset in generation_kwargs).")
        self.excluded = self.settings.mask_token_id if self.settings.unmasking == "hf_bdlm" else None

    # --- rollouts ---------------------------------------------------------------------------------------------------
    def rollout(self, model, prompts, seed, trace=False) -> Rollout:
        completions: list[list[int]] = [[] for _ in prompts]

        def on_block(new):
            for row, tokens in new.items():
                completions[row] += [int(t) for t in tokens]

        recorder = DecodingTrace() if trace else None
        was_training = model.training
        model.eval()  # the decoder's forwards are inference ones (no dropout); the run's mode is restored below
        try:
            self.decoder.decode([list(p) for p in prompts], [self.settings] * len(prompts), [seed] * len(prompts),
                                on_block, trace=recorder)
        finally:
            model.train(was_training)
        if recorder is None:
            return Rollout(completions)
        log_probs = [recorder.completion_log_probs(i, len(p), len(c))
                     for i, (p, c) in enumerate(zip(prompts, completions))]
        return Rollout(completions, log_probs, recorder.as_rows([len(p) for p in prompts],
                                                                self.settings.mask_token_id))

    # --- log-probabilities ------------------------------------------------------------------------------------------
    def log_probs(self, runner, batch: PolicyBatch, scoring: PolicyScoring, entropy=False):
        if scoring.estimator == "coupled":
            return self.coupled(runner, batch, scoring, entropy)[:2]
        inner = unwrap_model(runner)
        rows = self._rows(batch, scoring)
        if scoring.estimator == "trace":
            return self._trace(runner, inner, rows, batch, scoring, entropy)
        if scoring.estimator == "one_step":
            return self._one_step(runner, inner, rows, scoring, entropy)
        raise ValueError(f"logp_estimator={scoring.estimator!r} is not one of {list(self.estimators)}.")

    def _rows(self, batch: PolicyBatch, scoring: PolicyScoring) -> "_Rows":
        """``batch`` laid out in whole blocks, or under block parallelism in the layout's multiple of them."""
        B = self.settings.block_size
        multiple = B if scoring.block_parallel is None else scoring.block_parallel.pad_multiple(B)
        return _Rows(batch, B, self.settings.mask_token_id, multiple)

    def _score(self, inner, hidden, clean_hidden, row, pos, targets, scoring, entropy, offset=0):
        """``(log_probs, entropies)`` of ``targets`` at positions ``pos``, predicted by rows ``row`` of ``hidden``
        (noisy rows from column ``offset`` on) or, for a block's first position under a token shift, of
        ``clean_hidden``. Under block parallelism (:meth:`_forward`'s sharded form) ``hidden`` holds this rank's rows
        and ``clean_hidden`` is their layout (:meth:`_score_sharded`)."""
        if scoring.block_parallel is not None:
            return self._score_sharded(inner, hidden, clean_hidden, row, pos, targets, scoring, entropy)
        if self.settings.token_shift:
            first = pos % self.settings.block_size == 0
            source = hidden[row, (pos - 1 - offset).clamp(min=0)]
            if bool(first.any()):
                source = torch.where(first[:, None], clean_hidden[row, (pos - 1).clamp(min=0)], source)
        else:
            source = hidden[row, pos - offset]
        return token_log_probs(inner.lm_logits(source), targets, scoring.temperature, self.excluded, entropy)

    def _score_sharded(self, inner, hidden, layout, row, pos, targets, scoring, entropy):
        """:meth:`_score` over a block-parallel group: each target scored on the rank that counts the row predicting it
        (the noisy row at its position; under a token shift the row before it, the clean one for a block's first
        position), 0 on the others, then summed over the group (:class:`_SumOverGroup`): every rank gets every
        target's numbers."""
        at, stream = pos, torch.full_like(pos, NOISY)
        if self.settings.token_shift:
            first = pos % self.settings.block_size == 0
            at, stream = (pos - 1).clamp(min=0), torch.where(first, CLEAN, NOISY)
        index = layout.q_rows.index_of(stream, at, layout.plan.config.seq_len)
        counted = layout.rank_plan.loss_row_mask().to(index.device)
        held = (index >= 0) & counted[index.clamp(min=0)]
        lp, ent = token_log_probs(inner.lm_logits(hidden[row[held], index[held]]), targets[held], scoring.temperature,
                                  self.excluded, entropy)
        group = scoring.block_parallel.groups.group.group
        where = held.nonzero(as_tuple=True)
        share = lp.new_zeros(pos.shape).index_put(where, lp)
        log_probs = _SumOverGroup.apply(share, group)
        if ent is None:
            return log_probs, None
        return log_probs, _SumOverGroup.apply(ent.new_zeros(pos.shape).index_put(where, ent), group)

    def _place(self, values, rows: "_Rows", index, pos, out=None):
        """``values`` at the completion slots of ``(index, pos)`` in a ``[b, C]`` tensor (0 elsewhere)."""
        if values is None:
            return out
        out = values.new_zeros(rows.shape) if out is None else out
        return out.index_put((index, pos - rows.prompt_len[index]), values)

    def _forward(self, runner, rows: "_Rows", noisy, clean, scoring: PolicyScoring):
        """The training form of ``noisy`` / ``clean`` (``[n, L]``) under the decoding's block size: hidden states of the
        noisy rows and of the clean rows; under block parallelism, of this rank's rows of the plugin's layout, and the
        layout (what :meth:`_score` reads them with)."""
        L = rows.L
        plugin = scoring.block_parallel
        if plugin is not None:
            inner = unwrap_model(runner)
            layout = plugin.layout(L, self.settings.block_size, self.settings.rule, inner.config.attention_backend)
            positions = torch.arange(L, device=noisy.device).expand(noisy.shape[0], L)
            ids, pos = layout.local_inputs(noisy, clean, positions)
            hidden = runner(input_ids=ids, position_ids=pos, bdlm_layout=layout, return_logits=False).hidden_states
            return hidden, layout
        layout = LocalLayout(*(vectorized_rows(L, device=noisy.device),) * 2, self.settings.rule,
                             unwrap_model(runner).config.attention_backend)
        hidden = runner(input_ids=noisy, clean_input_ids=clean, bdlm_layout=layout, return_logits=False).hidden_states
        return hidden[:, :L], hidden[:, L:]

    def coupled(self, runner, batch: PolicyBatch, scoring: PolicyScoring, entropy: bool = False):
        """``coupled``'s ``(log_probs, entropies, forward)``: ``forward [b, C]`` says which of the two forwards scored
        each token (0: the draw's, 1: its complement's; -1 past the completion)."""
        inner = unwrap_model(runner)
        rows = self._rows(batch, scoring)
        first = torch.zeros_like(rows.scored)
        for i in range(rows.b):
            positions = rows.positions(i)
            if positions.numel():
                key = sample_key(rows.prompt(i), rows.completion(i))
                first[i, positions] = coupled_masks(scoring.seed, key, positions, rows.B).to(first.device)
        noisy = []
        for masked in (first, rows.scored & ~first):
            noisy.append(torch.where(masked | rows.beyond, rows.mask, rows.ids))
        hidden, clean_hidden = self._forward(runner, rows, torch.cat(noisy), torch.cat([rows.ids, rows.ids]), scoring)
        index, pos = rows.scored.nonzero(as_tuple=True)
        which = (~first[index, pos]).long()
        log_probs, entropies = self._score(inner, hidden, clean_hidden, which * rows.b + index, pos,
                                           rows.ids[index, pos], scoring, entropy)
        forward = self._place(which, rows, index, pos, torch.full(rows.shape, -1, dtype=torch.long,
                                                                  device=rows.device))
        return (self._place(log_probs, rows, index, pos), self._place(entropies, rows, index, pos), forward)

    def _one_step(self, runner, inner, rows: "_Rows", scoring, entropy):
        context = rows.ids.clone()
        for i in range(rows.b):
            prompt = torch.arange(rows.prompt_len[i], device=rows.device)
            key = sample_key(rows.prompt(i), rows.completion(i))
            drawn = prompt_masks(scoring.seed, key, prompt, scoring.prompt_mask_ratio).to(rows.device)
            context[i, prompt] = torch.where(drawn, rows.mask, context[i, prompt])
        noisy = torch.where(rows.scored | rows.beyond, rows.mask, context)
        hidden, clean_hidden = self._forward(runner, rows, noisy, context, scoring)
        index, pos = rows.scored.nonzero(as_tuple=True)
        log_probs, entropies = self._score(inner, hidden, clean_hidden, index, pos, rows.ids[index, pos], scoring,
                                           entropy)
        return self._place(log_probs, rows, index, pos), self._place(entropies, rows, index, pos)

    def _trace(self, runner, inner, rows: "_Rows", batch, scoring, entropy):
        if "trace_steps" not in batch.rows:
            raise ValueError("logp_estimator='trace' scores completions from their decoding trace, and these rows "
                             "carry none (completions not decoded by this policy's rollouts, or changed after it: "
                             "tool calls); use logp_estimator='coupled' or 'one_step'.")
        if scoring.block_parallel is not None and scoring.cache_clean_rows:
            raise ValueError("logp_estimator='trace' under block parallelism runs each step's forward in the training "
                             "form (its cached form, noisy rows over the clean rows' cached K/V, is not sharded): "
                             "score with PolicyScoring.cache_clean_rows=False.")
        steps, ids = rows.with_trace(batch.rows)
        device, L, b = rows.device, rows.L, rows.b
        clean_rows = stream_rows(CLEAN, torch.arange(L, device=device))
        backend = inner.config.attention_backend
        positions = torch.arange(L, device=device)
        cache = clean_hidden = None
        if scoring.cache_clean_rows:
            cache = DecodingCache()
            clean_hidden = runner(input_ids=ids, position_ids=positions.expand(b, -1),
                                  bdlm_layout=LocalLayout(clean_rows, clean_rows, self.settings.rule, backend),
                                  past_key_values=cache, use_cache=True, return_logits=False).hidden_states
        index, pos = rows.scored.nonzero(as_tuple=True)
        step = steps[index, pos]
        if bool((step < 0).any() | (step >= NEVER).any()):
            raise ValueError("a completion token the trace does not record as committed by a decoding step: the rows' "
                             "completions are not the ones their trace decoded.")
        # Noisy rows from the round's first decoded column on (the same columns for every batch of the round's rows,
        # and every row in every step's forward: a row's numbers do not depend on the rows beside it).
        c0 = int(batch.rows["trace_from"][0]) if "trace_from" in batch.rows else int(batch.rows["trace_start"].min())
        noisy_rows = stream_rows(NOISY, positions[c0:])
        k_rows = RowMeta.cat([clean_rows, noisy_rows])
        log_probs = entropies = joined = None
        for k in range(self._step_count(step, scoring.group, device)):
            at = step == k
            if not bool(at.any()) and scoring.group is None:
                continue
            state = torch.where(steps < k, ids, rows.mask)  # the blocks as they were at step k
            if cache is None:  # the clean rows run again in every step's forward (the training form)
                hidden, clean_step = self._forward(runner, rows, state, ids, scoring)
                offset = 0
            else:  # the step's noisy rows over the clean rows' cached K/V (never stored in the cache)
                cache.plan = StepPlan(0, None, StepWindow.whole(b, L - c0, device), False, b, L - c0)
                try:
                    hidden = runner(input_ids=state[:, c0:], position_ids=positions[c0:].expand(b, -1),
                                    bdlm_layout=LocalLayout(noisy_rows, k_rows, self.settings.rule, backend),
                                    past_key_values=cache, use_cache=True, return_logits=False).hidden_states
                finally:
                    cache.plan = None
                clean_step, offset = clean_hidden, c0
            if not bool(at.any()):  # a step only other ranks' rows took: its forward joins with weight zero
                joined = 0 * hidden.sum() if joined is None else joined + 0 * hidden.sum()
                continue
            lp, ent = self._score(inner, hidden, clean_step, index[at], pos[at], ids[index[at], pos[at]], scoring,
                                  entropy, offset=offset)
            log_probs = self._place(lp, rows, index[at], pos[at], log_probs)
            entropies = self._place(ent, rows, index[at], pos[at], entropies)
        if log_probs is None:  # nothing to score (every completion empty or masked out)
            log_probs = torch.zeros(rows.shape, dtype=torch.float32, device=device)
            entropies = log_probs.clone() if entropy else None
        if joined is not None:
            log_probs = log_probs + joined.to(log_probs.dtype)  # + 0: the same values, the step forwards in the graph
        return log_probs, entropies

    @staticmethod
    def _step_count(step: torch.Tensor, group, device) -> int:
        """The decoding steps to replay: the rows' (the last step that committed one of their tokens, plus one), or
        over ``group`` the most any rank's rows need."""
        count = int(step.max()) + 1 if step.numel() else 0
        if group is None:
            return count
        agreed = torch.tensor([count], dtype=torch.long, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
        return int(agreed)


class _SumOverGroup(torch.autograd.Function):
    """The sum over a block-parallel group of its ranks' shares (each target scored on one rank, 0 on the others):
    every rank gets the whole. In backward each rank's share takes the gradient of the whole as it comes: every rank of
    the group computes the same loss from the same whole, so the ranks' gradients add up to the single-process one."""

    @staticmethod
    def forward(ctx, share, group):
        whole = share.clone()
        dist.all_reduce(whole, group=group)
        return whole

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Rows:
    """A batch's rows laid out for scoring: row ``i`` holds its prompt, then its completion, from column 0, in a frame
    of ``L`` columns (whole blocks, or a ``multiple`` of columns; at least the round's ``width``). ``scored`` marks the
    completion tokens, ``beyond`` the columns after them."""

    def __init__(self, batch: PolicyBatch, block_size: int, mask_token_id: int, multiple: int | None = None):
        device = batch.completion_ids.device
        self.device, self.B, self.mask = device, block_size, mask_token_id
        self.b, C = batch.completion_ids.shape
        self.shape = (self.b, C)
        prompt_mask = batch.prompt_mask.bool()
        self.prompt_len = prompt_mask.sum(1)
        self.completion_len = batch.completion_mask.bool().sum(1)
        longest = int((self.prompt_len + self.completion_len).max())
        multiple = multiple or block_size
        self.L = math.ceil(max(longest, int(batch.width)) / multiple) * multiple
        columns = torch.arange(self.L, device=device)
        self.ids = torch.full((self.b, self.L), mask_token_id, dtype=torch.long, device=device)
        for i in range(self.b):
            p, c = int(self.prompt_len[i]), int(self.completion_len[i])
            self.ids[i, :p] = batch.prompt_ids[i][prompt_mask[i]]
            self.ids[i, p:p + c] = batch.completion_ids[i, :c]
        end = (self.prompt_len + self.completion_len)[:, None]
        self.scored = (columns[None] >= self.prompt_len[:, None]) & (columns[None] < end)
        self.beyond = columns[None] >= end

    def positions(self, i: int) -> torch.Tensor:
        return self.scored[i].nonzero().flatten()

    def prompt(self, i: int) -> list[int]:
        return self.ids[i, :int(self.prompt_len[i])].tolist()

    def completion(self, i: int) -> list[int]:
        p = int(self.prompt_len[i])
        return self.ids[i, p:p + int(self.completion_len[i])].tolist()

    def with_trace(self, rows: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """``(steps, ids)`` ``[b, L]``: each position's commit step (prompt: given) and the tokens the decoder left,
        from the rows' trace (the decoded blocks from ``trace_start`` on, the completion's tail block included)."""
        if int(rows["trace_block"][0]) != self.B:
            raise ValueError(f"the rows were decoded with blocks of {int(rows['trace_block'][0])} tokens and are "
                             f"scored with blocks of {self.B}.")
        steps = torch.full((self.b, self.L), -1, dtype=torch.long, device=self.device)
        ids = self.ids.clone()
        for i in range(self.b):
            start = int(rows["trace_start"][i])
            width = min(rows["trace_steps"].shape[1], self.L - start)
            steps[i, start:start + width] = rows["trace_steps"][i, :width].to(self.device)
            ids[i, start:start + width] = rows["trace_tokens"][i, :width].to(self.device)
            if not torch.equal(ids[i][self.scored[i]], self.ids[i][self.scored[i]]):
                raise ValueError("a row's completion differs from the tokens its decoding trace committed (completions "
                                 "changed after decoding: tool calls, a rollout_func); use logp_estimator='coupled' or "
                                 "'one_step'.")
        return steps, ids


__all__ = ["BlockDiffusionPolicy", "rollout_fields"]
