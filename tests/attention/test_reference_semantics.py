"""The mask rule and each objective against transcriptions of their published references.

Written independently of ``hf_bdlm/attention/masks.py``, so that a change to the rule fails here at once:

- the rule as a per-pair predicate transcribed from BD3-LM's ``block_diff_mask`` (kuleshov-group/bd3lms, also the
  training mask of Fast-dLLM v2's model code), with the token-causal clean stream, packed documents and both
  sliding-window conventions; checked for ``dense_mask``, ``tile_classes`` and the block-sparse plans;
- Turbo-dLLM's own mask predicates (PyPI ``turbo-dllm==0.1.6``, test-only; skipped when absent);
- ``standard``: BD3-LM's loss (``_forward_pass_diffusion`` / ``_loss`` with the SUBS parameterization) and its
  resampling under a clipped range (``_resample_q_xt``), fed with the same random numbers; its per-sample
  stratified rates are marginally uniform and the loss is an unbiased estimate of the ELBO (measured);
- ``fast_dllm_v2``: Fast-dLLM v2's training forward (complementary views, ``[x_t, x]`` under the block-diffusion
  mask, a causal-LM loss over the noisy half with labels shifted by one), and its causal-clean variant.

The reference forwards run transformers' own Llama with a custom 4D mask (SDPA, float64), not hf_bdlm's attention.
Run: ``python -m pytest tests/attention/test_reference_semantics.py -q`` (about a minute on one core).
"""

from __future__ import annotations

import copy
import itertools
import types

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from hf_bdlm import BlockDiffusionConfig, BlockDiffusionForMaskedLM
from hf_bdlm.attention import MaskRule, dense_mask, vectorized_rows
from hf_bdlm.attention.masks import CLEAN, NOISY, TILE_FULL, TILE_NONE, TILE_PARTIAL, tile_classes
from hf_bdlm.attention.rows import RowMeta, stream_rows
from hf_bdlm.attention.tiles import plan_attention, split_chunks
from hf_bdlm.models.block_diffusion.training.objectives import StandardObjective
from hf_bdlm.objectives import get_objective, hash_uniform
from hf_bdlm.objectives.noise import SALT_BLOCK_T, SALT_TOKEN_MASK, stratified_block_t, token_uniform

KINDS = ("block_causal", "causal")
CONVENTIONS = ("per_query", "block_start")


# --- the rule, transcribed ---------------------------------------------------------------------------------------


def published_rule(q, k, *, block: int, clean: str, window: int | None = None, convention: str = "per_query"):
    """Whether query ``q`` may attend to key ``k``; each is ``(stream, position, document)``.

    BD3-LM's ``block_diff_mask``: noisy -> noisy in the same block (M_BD), noisy -> clean in strictly earlier
    blocks (M_OBC), clean -> clean block-causal (M_BC); or token-causal clean (a causal LM, DiffusionGemma's
    encoder). Packed documents never see each other. Windows: ``per_query`` is transformers' ``|q - k| < W``;
    ``block_start`` is DiffusionGemma / Turbo-dLLM's: a block-level query (noisy, or clean under ``block_causal``)
    sees keys from ``s_b - W + 1`` on (the ``W - 1`` a sliding cache holds before its block), a token-causal
    clean query ``[q - W + 1, q]``.
    """
    (q_stream, q_pos, q_doc), (k_stream, k_pos, k_doc) = q, k
    q_blk, k_blk = q_pos // block, k_pos // block
    if q_doc != k_doc:
        return False
    if q_stream == NOISY:
        ok = (k_stream == NOISY and k_blk == q_blk) or (k_stream == CLEAN and k_blk < q_blk)
    else:
        ok = k_stream == CLEAN and (k_blk <= q_blk if clean == "block_causal" else k_pos <= q_pos)
    if not ok or window is None:
        return ok
    if convention == "per_query":
        return abs(q_pos - k_pos) < window
    if q_stream == NOISY or clean == "block_causal":
        return k_pos >= q_blk * block - window + 1
    return q_pos - window + 1 <= k_pos <= q_pos


def reference_mask(q_rows: RowMeta, k_rows: RowMeta, item: int = 0, **rule) -> torch.Tensor:
    def row(rows, i):
        doc = None if rows.doc is None else int(rows.doc[item, i])
        return int(rows.stream[i]), int(rows.pos[i]), doc

    qs = [row(q_rows, i) for i in range(q_rows.num_rows)]
    ks = [row(k_rows, j) for j in range(k_rows.num_rows)]
    return torch.tensor([[published_rule(q, k, **rule) for k in ks] for q in qs], dtype=torch.bool)


def bd3lm_block_diff_mask(n: int, block_size: int) -> torch.Tensor:
    """BD3-LM's ``block_diff_mask`` over the ``[x_t, x_0]`` index space of ``2n`` rows, as published."""
    q_idx, kv_idx = torch.arange(2 * n)[:, None], torch.arange(2 * n)[None, :]
    x0_q, x0_kv = q_idx >= n, kv_idx >= n
    block_q = torch.where(x0_q, (q_idx - n) // block_size, q_idx // block_size)
    block_kv = torch.where(x0_kv, (kv_idx - n) // block_size, kv_idx // block_size)
    block_diagonal = (block_q == block_kv) & (x0_q == x0_kv)
    offset_block_causal = (block_q > block_kv) & x0_kv & ~x0_q
    block_causal = (block_q >= block_kv) & x0_kv & x0_q
    return block_diagonal | offset_block_causal | block_causal


def _rules(block: int, length: int):
    for kind, convention in itertools.product(KINDS, CONVENTIONS):
        for window in (None, 1, 2, block, block + 1, 2 * block + 1, length + 1):
            if window is None and convention == "block_start":
                continue
            yield dict(block=block, clean=kind, window=window, convention=convention)


def _mask_rule(block, clean, window, convention) -> MaskRule:
    return MaskRule(block, clean, window, convention)


def _docs(blocks_per_doc: list[int], block: int) -> torch.Tensor:
    return torch.cat([torch.full((n * block,), d) for d, n in enumerate(blocks_per_doc)])[None]


def _layouts(block: int, length: int):
    """Row sets a forward runs over: the training form, a rank's share (shuffled whole blocks, some halves) and the
    inference form (a noisy block over cached clean rows)."""
    plain = vectorized_rows(length)
    packed = vectorized_rows(length, _docs([1, length // block - 3, 2], block))
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(2 * length // block, generator=g)[: length // block]
    shuffled = plain.select((perm[:, None] * block + torch.arange(block)).flatten())
    half = block // 2
    noisy_part, clean_part = torch.arange(half, block + half), torch.arange(length + half, length + 3 * block - 1)
    halves = packed.select(torch.cat([noisy_part, clean_part]))
    start = length - block
    inference = RowMeta.cat([stream_rows(CLEAN, torch.arange(start)), stream_rows(NOISY, torch.arange(start, length))])
    noisy_block = stream_rows(NOISY, torch.arange(start, length))
    return [("plain", plain, plain), ("packed", packed, packed), ("rank", shuffled, plain),
            ("halves", halves, packed), ("inference", noisy_block, inference)]


@pytest.mark.parametrize("block", [1, 2, 4])
def test_dense_mask_is_the_published_rule(block):
    length = 6 * block
    for (name, q_rows, k_rows), rule in itertools.product(_layouts(block, length), _rules(block, length)):
        got = dense_mask(q_rows, k_rows, _mask_rule(**rule))[0]
        assert torch.equal(got, reference_mask(q_rows, k_rows, **rule)), (name, rule)


@pytest.mark.parametrize("block", [1, 3, 4])
def test_training_mask_is_bd3lm_block_diff_mask(block):
    n = 5 * block
    got = dense_mask(vectorized_rows(n), vectorized_rows(n), MaskRule(block, "block_causal"))[0]
    assert torch.equal(got, bd3lm_block_diff_mask(n, block))


def test_the_two_window_conventions_differ_only_where_documented():
    block, window, length = 4, 6, 24
    rows = vectorized_rows(length)
    per_query = dense_mask(rows, rows, MaskRule(block, "block_causal", window, "per_query"))[0]
    block_start = dense_mask(rows, rows, MaskRule(block, "block_causal", window, "block_start"))[0]
    diff = (per_query != block_start).nonzero().tolist()
    assert diff
    for qi, ki in diff:
        q_pos, k_pos = qi % length, ki % length
        # block_start sees more of the earlier blocks; per_query cuts its own block by distance (w > B: never).
        assert block_start[qi, ki] and k_pos // block < q_pos // block and q_pos - k_pos >= window


def _chunk_classes_from(mask: torch.Tensor, q_rows: RowMeta, k_rows: RowMeta, block: int) -> torch.Tensor:
    qc, kc = split_chunks(q_rows, block), split_chunks(k_rows, block)
    out = torch.empty(qc.count, kc.count, dtype=torch.int8)
    for i, j in itertools.product(range(qc.count), range(kc.count)):
        tile = mask[qc.start[i] : qc.end[i], kc.start[j] : kc.end[j]]
        out[i, j] = TILE_FULL if tile.all() else TILE_PARTIAL if tile.any() else TILE_NONE
    return out


@pytest.mark.parametrize("block", [2, 4])
def test_tile_classes_are_the_published_rule(block):
    length = 6 * block
    for (name, q_rows, k_rows), rule in itertools.product(_layouts(block, length), _rules(block, length)):
        expected = _chunk_classes_from(reference_mask(q_rows, k_rows, **rule), q_rows, k_rows, block)
        got = tile_classes(split_chunks(q_rows, block), split_chunks(k_rows, block), _mask_rule(**rule))
        assert torch.equal(got, expected), (name, rule)


def _plan_coverage(plan, num_q: int, num_k: int) -> torch.Tensor:
    """How many times the plan computes each (query row, key row) pair."""
    cover = torch.zeros(num_q, num_k, dtype=torch.long)
    for call in plan.calls:
        q_sets = [torch.arange(*call.q_rows)] if isinstance(call.q_rows, tuple) else list(call.q_rows)
        k_sets = [torch.arange(*call.k_rows)] if isinstance(call.k_rows, tuple) else list(call.k_rows)
        for q_idx, k_idx in zip(q_sets, k_sets):
            pairs = torch.ones(q_idx.numel(), k_idx.numel(), dtype=torch.long) if call.mask is None else call.mask
            cover[q_idx[:, None], k_idx[None, :]] += pairs.long()
    return cover


@pytest.mark.parametrize("group_rows", [0, 512], ids=["block_tiles", "groups"])
def test_block_sparse_plans_compute_exactly_the_published_rule(group_rows):
    block, length = 4, 24
    for (name, q_rows, k_rows), rule in itertools.product(_layouts(block, length), _rules(block, length)):
        plan = plan_attention(q_rows, [k_rows], _mask_rule(**rule), group_rows)
        cover = _plan_coverage(plan, q_rows.num_rows, k_rows.num_rows)
        assert torch.equal(cover, reference_mask(q_rows, k_rows, **rule).long()), (name, rule)


# --- Turbo-dLLM's reference predicates (test-only dependency) ------------------------------------------------------


def _turbo_mask(n: int, block: int, clean: str, window: int | None) -> torch.Tensor:
    """Turbo-dLLM's full ``[noisy; clean]`` mask: its per-pair predicate, with its encoder-causal clean bounds."""
    pytest.importorskip("dllm_parallel")
    from dllm_parallel.core.attention.context_parallel_attention import _block_denoising_mask_spec_allowed
    from dllm_parallel.core.attention.masks import BlockDenoisingFullMask
    from dllm_parallel.core.models.backbones.nemotron.model import NemotronLabsDiffusionPackedBlockDiffusionModel

    positions = torch.cat([torch.arange(n), torch.arange(n)])
    is_clean = torch.arange(2 * n) >= n
    bounds = None
    if clean == "causal":  # Turbo-dLLM's causal encoder (DiffusionGemma-style) with its sliding-window history
        owner = types.SimpleNamespace(encoder_causal_attention=True, block_size=block)
        layer = types.SimpleNamespace(layer_type="sliding_attention" if window else "full_attention",
                                      attention=types.SimpleNamespace(sliding_window=window))
        bounds = NemotronLabsDiffusionPackedBlockDiffusionModel._clean_attention_bounds(
            owner, query_positions=positions, query_is_clean=is_clean, layer_ops=layer)
    elif window is not None:
        raise ValueError("Turbo-dLLM applies windows to its causal encoder only")
    spec = BlockDenoisingFullMask(query_blocks=(positions // block).to(torch.int32), query_is_clean=is_clean,
                                  block_size=block, clean_offset=n, query_clean_bounds=bounds)
    q_idx, kv_idx = torch.arange(2 * n)[:, None], torch.arange(2 * n)[None, :]
    return _block_denoising_mask_spec_allowed(spec, q_idx, kv_idx, 0)


@pytest.mark.parametrize("block", [1, 4])
@pytest.mark.parametrize(
    "clean,window", [("block_causal", None), ("causal", None), ("causal", 1), ("causal", 3), ("causal", 6)]
)
def test_dense_mask_matches_turbo_dllm(block, clean, window):
    n = 6 * block
    expected = _turbo_mask(n, block, clean, window)
    rows = vectorized_rows(n)
    convention = "block_start" if window else "per_query"  # Turbo-dLLM's canvas reads its W - 1 cached states
    assert torch.equal(dense_mask(rows, rows, MaskRule(block, clean, window, convention))[0], expected)


# --- objectives: a tiny model, and the reference forward on transformers' own attention ----------------------------

B, MASK, VOCAB, L = 4, 63, 64, 16


def _faithful_rms_norm(self, x):
    # transformers' RMSNorm upcasts to float32; in float64 that would round away the 1e-12 agreement checked here.
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


@pytest.fixture(scope="module")
def models():
    patch = pytest.MonkeyPatch()
    patch.setattr(LlamaRMSNorm, "forward", _faithful_rms_norm)
    torch.manual_seed(0)
    backbone = LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=64)
    made = {}
    for clean in KINDS:
        torch.manual_seed(0)
        cfg = BlockDiffusionConfig(backbone_config=backbone, block_size=B, mask_token_id=MASK, clean_attention=clean)
        model = BlockDiffusionForMaskedLM(cfg).double().eval()
        plain_config = copy.deepcopy(model.config.backbone_config)
        reference = LlamaForCausalLM._from_config(plain_config, attn_implementation="sdpa").double().eval()
        reference.load_state_dict(model.backbone.state_dict())
        made[clean] = (model, reference)
    yield made
    patch.undo()


def _reference_hidden(reference: LlamaForCausalLM, noisy: torch.Tensor, clean: torch.Tensor, kind: str):
    """Last hidden states of ``[x_t, x]`` under the published mask, on transformers' SDPA attention."""
    n = clean.shape[1]
    rule = dict(block=B, clean=kind)
    rows = vectorized_rows(n)
    mask = bd3lm_block_diff_mask(n, B) if kind == "block_causal" else reference_mask(rows, rows, **rule)
    positions = torch.arange(n).repeat(2)[None].expand(clean.shape[0], -1)
    with torch.no_grad():
        out = reference.model(input_ids=torch.cat([noisy, clean], 1), position_ids=positions,
                              attention_mask=mask[None, None].expand(clean.shape[0], 1, -1, -1))
    return out.last_hidden_state


def _batch(b=3, prompt=0, seed=0):
    ids = torch.randint(0, MASK, (b, L), generator=torch.Generator().manual_seed(seed))
    completion = torch.ones(b, L, dtype=torch.long)
    completion[:, :prompt] = 0
    return {"input_ids": ids, "completion_mask": completion, "sample_ids": torch.arange(b) + 10}


def test_standard_loss_is_bd3lms_loss(models):
    """BD3-LM: logits of x_t over [x_t, x_0]; SUBS (the [MASK] logit at -1e6, unmasked tokens scored 0);
    ``loss = sum(-1/t * log p(x_0)) / attention_mask.sum()``."""
    model, reference = models["block_causal"]
    obj = get_objective("standard", model.config)
    batch = _batch()
    for step in range(3):
        c = obj.corrupt(batch, seed=0, step=step)
        x0, xt = c.clean_ids, c.noisy_ids
        t = obj.per_token(c.block_t)
        logits = reference.lm_head(_reference_hidden(reference, xt, x0, "block_causal")[:, :L])
        logits[:, :, MASK] += -1000000.0
        log_p = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
        unmasked = xt != MASK
        log_p[unmasked] = -1000000.0
        log_p[unmasked, xt[unmasked]] = 0
        loss_scale = -1 / t
        nll = loss_scale * log_p.gather(-1, x0[:, :, None])[:, :, 0]
        attention_mask = torch.ones_like(x0, dtype=torch.float64)
        expected = (nll * attention_mask).sum() / attention_mask.sum()
        with torch.no_grad():
            got, _ = obj.loss(model, c)
        assert got.item() == pytest.approx(expected.item(), rel=1e-12, abs=0)


def _bd3lm_resample(x, move_indices, p, block_size, eps_min, eps_max, rand):
    """BD3-LM's ``_resample_q_xt``, with ``rand(r)`` standing for its ``r``-th ``torch.rand(*x.shape)``."""
    mask_index = MASK
    xt = torch.where(move_indices, mask_index, x).reshape(x.shape[0], -1, block_size)
    perc_masked = (xt == mask_index).float().sum(-1) / block_size
    r = 0
    while (perc_masked < eps_min).any() or (perc_masked > eps_max).any():
        if eps_min == 1e-3 and eps_max != 1:
            regen_idx = perc_masked > eps_max
            if regen_idx.max() == 0:
                break
        elif eps_min != 1e-3 and eps_max == 1:
            regen_idx = perc_masked < eps_min
            if regen_idx.max() == 0:
                break
        elif eps_min != 1e-3 and eps_max != 1:
            regen_idx = (perc_masked < eps_min) | (perc_masked > eps_max)
        regen_idx = regen_idx.repeat_interleave(block_size, dim=-1)
        r += 1
        move_indices[regen_idx] = (rand(r) < p)[regen_idx]
        xt = torch.where(move_indices, mask_index, x)
        xt = xt.reshape(xt.shape[0], -1, block_size)
        perc_masked = (xt == mask_index).float().sum(-1) / block_size
    return xt.reshape(x.shape[0], -1)


@pytest.mark.parametrize("eps", [(0.3, 0.8), (0.5, 1.0), (1e-3, 0.4)])
def test_clipped_range_resamples_like_bd3lm(eps):
    obj = StandardObjective(block_size=B, mask_token_id=MASK, noise_eps_min=eps[0], noise_eps_max=eps[1])
    batch = {"input_ids": torch.randint(0, MASK, (64, L), generator=torch.Generator().manual_seed(1)),
             "sample_ids": torch.arange(64)}
    c = obj.corrupt(batch, seed=3, step=5)
    x, samples, positions = batch["input_ids"], batch["sample_ids"][:, None], torch.arange(L)[None]
    p = obj.per_token(c.block_t)
    first = token_uniform(3, 5, samples, positions) < p
    expected = _bd3lm_resample(x, first.clone(), p, B, *eps, rand=lambda r: token_uniform(3, 5, samples, positions, r))
    assert torch.equal(c.noisy_ids, expected)
    assert not torch.equal(c.masked, first)  # some block was redrawn
    frac = c.masked.view(64, -1, B).double().mean(-1)
    assert ((frac >= eps[0]) | (eps[0] == 1e-3)).all() and ((frac <= eps[1]) | (eps[1] == 1.0)).all()


def test_stratified_block_rates_are_marginally_uniform():
    lo, hi, samples = 1e-3, 1.0, 20000
    for n in (3, 8):
        t = stratified_block_t(0, 0, torch.arange(samples), torch.full((samples,), n), n, lo, hi)
        grid = torch.linspace(lo, hi, 201, dtype=torch.float64)
        for j in range(n):
            cdf = (t[:, j, None] <= grid[None]).double().mean(0)
            ks = (cdf - (grid - lo) / (hi - lo)).abs().max().item()
            assert ks < 1.95 / samples**0.5, (n, j, ks)  # Kolmogorov-Smirnov at the 0.001 level
        stratum = ((t - lo) / (hi - lo) * n).floor().long().sort(1).values
        assert torch.equal(stratum, torch.arange(n).expand(samples, n))  # every sample covers every stratum


def _synthetic_estimates(obj, samples: int, c_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample loss under a synthetic model whose CE of a masked token is ``a[token] + c_j m^2`` (``m``: masked
    tokens of its block ``j``, ``c_j = c_coef (1 + j)``), and its exact expectation over t ~ U[eps_min, eps_max]
    and the mask draws (the ELBO). The block-dependent ``c_j`` exposes a sampler whose rates depend on the block."""
    ids = torch.randint(0, MASK, (samples, L), generator=torch.Generator().manual_seed(5))
    c = obj.corrupt({"input_ids": ids, "sample_ids": torch.arange(samples)}, seed=11, step=0)
    a = torch.linspace(0.5, 2.0, VOCAB, dtype=torch.float64)
    m = c.masked.view(samples, -1, B).sum(-1, dtype=torch.float64).repeat_interleave(B, 1)
    c_j = c_coef * (1 + torch.arange(L, dtype=torch.float64) // B)
    ce = (a[ids] + c_j * m**2) * c.masked
    weights = torch.zeros(samples, L, dtype=torch.float64)
    weights[c.target_sample, c.target_row_pos] = c.target_weight.double()
    estimates = (weights * ce).sum(1) / L
    lo, hi = obj.noise_eps_min, obj.noise_eps_max
    mu1, mu2 = (lo + hi) / 2, (lo * lo + lo * hi + hi * hi) / 3
    # E[(1 + M)^2 | t], M ~ Binomial(B - 1, t): 1 + 2(B-1)t + (B-1)t(1-t) + (B-1)^2 t^2; weight 1/t cancels P(masked).
    k = B - 1
    per_token_extra = c_j * (1 + 2 * k * mu1 + k * (mu1 - mu2) + k * k * mu2)
    expected = (a[ids].sum(1) + per_token_extra.sum()) / L
    return estimates, expected


def test_standard_loss_is_an_unbiased_estimate_of_the_elbo():
    samples = 40000
    estimates, expected = _synthetic_estimates(StandardObjective(block_size=B, mask_token_id=MASK), samples, 0.05)
    err = estimates - expected
    se = err.std().item() / samples**0.5
    assert se < 0.01 * expected.mean().item()  # the bound below is tight: 1% of the loss
    assert abs(err.mean().item()) < 4 * se, (err.mean().item(), se)


def _fast_dllm_v2_reference_corruption(x, labels, seed, step, sample_ids, eps=1e-3):
    """Fast-dLLM v2's training corruption, its ``torch.rand`` calls replaced by hf_bdlm's hashes (t per block of
    each sample, then one draw per token)."""
    b, length = x.shape
    t = hash_uniform(seed, step, sample_ids[:, None], torch.arange(length // B)[None], SALT_BLOCK_T).reshape(-1)
    p_mask = ((1 - eps) * t + eps)[:, None].repeat(1, B)
    mask_indices = (hash_uniform(seed, step, sample_ids[:, None], torch.arange(length)[None], SALT_TOKEN_MASK)
                    .reshape(-1, B) < p_mask)
    views, view_labels = [], []
    for indices in (mask_indices, ~mask_indices):
        x_t = torch.where(indices, MASK, x.reshape(-1, B)).reshape(labels.shape)
        noisy = x.clone()
        noisy[labels != -100] = x_t[labels != -100]
        lab = labels.clone()
        lab[noisy != MASK] = -100
        views.append(noisy)
        view_labels.append(lab)
    return torch.cat(views), torch.cat(view_labels)


@pytest.mark.parametrize("name", ["fast_dllm_v2", "fast_dllm_v2_causal_clean"])
@pytest.mark.parametrize("prompt", [0, 5])
def test_fast_dllm_v2_is_the_reference_training_forward(models, name, prompt):
    """Fast-dLLM v2: ``[x_t, x]`` of both views under the block-diffusion mask, logits of the noisy half, labels
    shifted by one (row i - 1 predicts token i, block starts included), CE over the whole vocabulary, the mean over
    the scored labels. The causal-clean variant changes exactly two things: a token-causal clean stream, and a
    block's first token scored from the clean row before it."""
    clean_kind = "block_causal" if name == "fast_dllm_v2" else "causal"
    model, reference = models[clean_kind]
    obj = get_objective(name, model.config)
    batch = _batch(prompt=prompt, seed=prompt)
    x = batch["input_ids"]
    labels = torch.where(batch["completion_mask"].bool(), x, -100)
    noisy, view_labels = _fast_dllm_v2_reference_corruption(x, labels, 7, 2, batch["sample_ids"])
    c = obj.corrupt(batch, seed=7, step=2)
    assert torch.equal(c.noisy_ids, noisy) and torch.equal(c.clean_ids, x.repeat(2, 1))

    hidden = _reference_hidden(reference, noisy, x.repeat(2, 1), clean_kind)
    predicting = hidden[:, : L - 1].clone()  # noisy row i - 1 predicts label i
    if name == "fast_dllm_v2_causal_clean":
        starts = torch.arange(B, L, B)
        predicting[:, starts - 1] = hidden[:, L + starts - 1]  # the clean row before a block start
    logits = reference.lm_head(predicting)
    shifted = view_labels[:, 1:]
    scored = shifted != -100
    expected = F.cross_entropy(logits[scored], shifted[scored], reduction="sum") / scored.sum()
    with torch.no_grad():
        got, metrics = obj.loss(model, c)
    assert c.normalizer == scored.sum().item() == metrics["count"].item()
    assert got.item() == pytest.approx(expected.item(), rel=1e-12, abs=0)
