"""Specifications of the CUDA attention path on this CPU: block masks built from the block structure
(hf_bdlm/attention/block_mask.py), the flex backend's sources and merge (hf_bdlm/attention/flex.py), unmasked decoding
steps and layouts kept across steps.

FlexAttention has no CPU backward: forward equality is checked here (compiled where torch compiles it on CPU), the
backward on a GPU (tests/attention/test_attention.py, benchmarks/gpu).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask
from torch.utils._python_dispatch import TorchDispatchMode

from hf_bdlm.attention import LocalLayout, MaskRule, attend, dense_mask, vectorized_rows
from hf_bdlm.attention import backends, flex
from hf_bdlm.attention.block_mask import build_block_mask, tile_matrix, transposed_tile_matrix
from hf_bdlm.attention.masks import all_pairs_allowed
from hf_bdlm.attention.masks import CLEAN, NOISY
from hf_bdlm.attention.rows import RowMeta, stream_rows
from hf_bdlm.parallel.plan import ParallelDims, PlanConfig, make_plan

RULES = [
    MaskRule(16),
    MaskRule(16, "causal"),
    MaskRule(16, "block_causal", 40, "per_query"),
    MaskRule(16, "causal", 40, "block_start"),
    MaskRule(32, "block_causal", 100, "block_start"),
]


@pytest.fixture(autouse=True, scope="module")
def _few_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _docs(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]


def _true_tiles(q_rows, k_rows, rule, tile):
    """``(any, all)`` per tile pair from the dense mask (padding past the rows allows nothing)."""
    m = dense_mask(q_rows, k_rows, rule)
    b, tq, tk = m.shape
    qt, kt = -(-tq // tile), -(-tk // tile)
    padded = torch.zeros(b, qt * tile, kt * tile, dtype=torch.bool)
    padded[:, :tq, :tk] = m
    t = padded.view(b, qt, tile, kt, tile)
    return t.any(4).any(2), t.all(4).all(2)


def _assert_cover(mask, q_rows, k_rows, rule, tile):
    """Every allowed pair lies in a listed tile; a full tile allows every pair; both sides agree on full tiles."""
    anyv, allv = _true_tiles(q_rows, k_rows, rule, tile)
    kv, q = tile_matrix(mask), transposed_tile_matrix(mask)
    if kv.shape[0] == 1:
        anyv, allv = anyv.any(0, keepdim=True), allv.all(0, keepdim=True)
    for side in (kv, q):
        assert not bool((anyv & (side == 0)).any()), "an allowed pair lies in an unlisted tile"
        assert not bool(((side == 2) & ~allv).any()), "a tile marked full masks some pair"
    assert torch.equal(kv == 2, q == 2)
    return kv, anyv, allv


# --- block masks -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", RULES, ids=str)
def test_block_mask_of_the_single_device_layout_equals_create_block_mask(rule):
    rows = vectorized_rows(256)
    ours = build_block_mask(rows, rows, rule, tile=16)

    def mask_mod(b, h, qi, ki):
        return dense_mask(rows, rows, rule)[0][qi, ki]

    theirs = create_block_mask(mask_mod, 1, 1, 512, 512, device="cpu", BLOCK_SIZE=16)
    assert torch.equal(tile_matrix(ours), tile_matrix(theirs))
    assert torch.equal(transposed_tile_matrix(ours), tile_matrix(theirs))


@pytest.mark.parametrize("rule", RULES, ids=str)
def test_block_mask_covers_packed_documents_exactly_on_full_tiles(rule):
    doc = torch.cat([_docs([64, 96, 96]), _docs([256])])  # two items with different documents: a batch of masks
    rows = vectorized_rows(256, doc)
    mask = build_block_mask(rows, rows, rule, tile=16)
    assert mask.kv_indices.shape[0] == 2
    kv, anyv, allv = _assert_cover(mask, rows, rows, rule, 16)
    # Documents and streams aligned to tiles: the tiles are exactly the rule's.
    assert torch.equal(kv == 2, allv) and torch.equal(kv > 0, anyv)


@pytest.mark.parametrize("rule", RULES[:3], ids=str)
def test_block_mask_covers_a_document_id_used_for_two_runs(rule):
    # The rule's same-document test is equality of ids: an id labelling two runs joins them, and the masks follow it.
    doc = torch.cat([torch.full((64,), 0), torch.full((64,), 1), torch.full((128,), 0)])[None]
    rows = vectorized_rows(256, doc)
    _assert_cover(build_block_mask(rows, rows, rule, tile=16), rows, rows, rule, 16)


@pytest.mark.parametrize("rule", RULES, ids=str)
@pytest.mark.parametrize("mode,P", [("csbp", 2), ("csbp", 4), ("cp", 2), ("bp", 2)])
def test_block_mask_covers_every_sharded_source(rule, mode, P):
    plan = make_plan(PlanConfig(ParallelDims(P, mode=mode), seq_len=512, block_size=rule.block_size))
    for me in range(P):
        q_rows = plan.ranks[me].rows()
        peers = [plan.sent_rows(m) for m in plan.ring_members(me) if m != me]
        for k_rows in [q_rows] + ([RowMeta.cat(peers)] if peers else []):
            for tile in (16, 128):
                _assert_cover(build_block_mask(q_rows, k_rows, rule, tile=tile), q_rows, k_rows, rule, tile)


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("window", [None, 1024])
def test_building_a_block_mask_allocates_nothing_quadratic_in_rows(window):
    L = 32768  # 65,536 rows: a per-element mask would be 4.3e9 elements
    rows = vectorized_rows(L, _docs([L // 2, L // 2]))
    with _LargestTensor() as seen:
        mask = build_block_mask(rows, rows, MaskRule(32, sliding_window=window))
    rows_n, tiles = 2 * L, (2 * L) // 128
    # The largest tensors are per-row metadata (2L) and the index arrays (tiles^2), measured 2L: far below (2L)^2/64.
    assert seen.largest <= max(4 * rows_n, tiles * tiles), seen.largest
    assert mask.kv_indices.shape == (1, 1, tiles, tiles)


# --- the flex backend --------------------------------------------------------------------------------------------


def _qkv(L, heads=4, kv_heads=2, dim=32, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, heads, 2 * L, dim, generator=g, dtype=dtype),
            torch.randn(1, kv_heads, 2 * L, dim, generator=g, dtype=dtype),
            torch.randn(1, kv_heads, 2 * L, dim, generator=g, dtype=dtype))


@pytest.mark.parametrize("rule", [MaskRule(32), MaskRule(16, "causal", 40)], ids=str)
def test_compiled_flex_forward_equals_dense_on_cpu_with_gqa_and_documents(rule):
    rows = vectorized_rows(256, _docs([128, 128]))
    q, k, v = _qkv(256)
    calls = []
    real = flex.compiled_flex_attention

    def compiled(dynamic=False):
        def counting(*args, **kwargs):
            calls.append(kwargs["enable_gqa"])
            return real(dynamic)(*args, **kwargs)
        return counting

    flex.compiled_flex_attention.cache_clear()
    try:
        with pytest.MonkeyPatch.context() as mp, torch.no_grad():  # inference: the graph flex uses for it
            mp.setattr(flex, "compiled_flex_attention", compiled)
            got = attend("flex", q, [(k, v)], rows, [rows], rule, 0.2, {})
    finally:
        flex.compiled_flex_attention.cache_clear()
    want = attend("dense", q, [(k, v)], rows, [rows], rule, 0.2, {})
    assert calls == [True]  # one compiled call, K/V handed over unrepeated (GQA in the kernel)
    assert (got - want).abs().max() <= 1e-5


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("rule", RULES, ids=str)
@pytest.mark.parametrize("mode", ["csbp", "cp"])
def test_flex_over_a_rank_sources_equals_dense(rule, mode):
    plan = make_plan(PlanConfig(ParallelDims(2, mode=mode), seq_len=256, block_size=rule.block_size))
    full = vectorized_rows(256)
    q_all, k_all, v_all = _qkv(256, dtype=torch.float64)
    want = attend("dense", q_all, [(k_all, v_all)], full, [full], rule, 0.3, {})
    for me in range(2):
        mine = plan.ranks[me].rows()
        peer = plan.sent_rows(1 - me)
        q = q_all[:, :, _global(mine)]
        sources = [(k_all[:, :, _global(r)], v_all[:, :, _global(r)]) for r in (mine, peer)]
        with torch.no_grad():
            got = attend("flex", q, sources, mine, [mine, peer], rule, 0.3, {})
        assert (got - want[:, :, _global(mine)]).abs().max() <= 1e-12


def _global(rows: RowMeta) -> torch.Tensor:
    """Rows' indices among the single-device layout's ``2L`` rows (noisy first)."""
    return torch.where(rows.stream == NOISY, rows.pos, rows.pos + 256)


class _IdentityTransfer:
    """A deferred source whose 'transfer' hands back this rank's own rows, logging when each step happens."""

    def __init__(self, k, v, log):
        self.k, self.v, self.log = k, v, log

    def start_forward(self, k, v):
        self.log.append("send")
        return _Done((k.detach(), v.detach()), self.log, "received")

    def start_backward(self, dk, dv):
        self.log.append("send grads")
        return _Done((dk, dv), self.log, "grads received")


class _Done:
    def __init__(self, value, log, what):
        self.value, self.log, self.what = value, log, what

    def wait(self):
        self.log.append(self.what)
        return self.value


def _dense_partial(log):
    def partial(i, q, k, v):
        log.append(f"attend {i}")
        scores = (q @ k.repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2)) * 0.3
        lse = scores.logsumexp(-1)
        out = torch.softmax(scores, -1) @ v.repeat_interleave(q.shape[1] // v.shape[1], 1)
        if q.requires_grad:
            out.register_hook(lambda g: log.append(f"backward {i}"))
        return out, lse
    return partial


def test_a_deferred_source_is_read_after_its_wait_and_its_gradients_leave_before_the_local_backward():
    log: list[str] = []
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 8, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k1, v1, k2, v2 = (torch.randn(1, 2, n, 16, generator=g, dtype=torch.float64, requires_grad=True)
                      for n in (8, 8, 12, 12))
    out = flex.attend_sources(q, [(k1, v1), _IdentityTransfer(k2, v2, log)], _dense_partial(log))
    out.sum().backward()
    assert log == ["send", "attend 0", "received", "attend 1", "backward 1", "send grads", "backward 0",
                   "grads received"]
    # Equal to one softmax over both key sets.
    got = [t.grad.clone() for t in (q, k1, v1, k2, v2)]
    for t in (q, k1, v1, k2, v2):
        t.grad = None
    both = _dense_partial([])(0, q, torch.cat([k1, k2], 2), torch.cat([v1, v2], 2))[0]
    assert (both - out).abs().max() <= 1e-12
    both.sum().backward()
    for a, t in zip(got, (q, k1, v1, k2, v2)):
        assert (a - t.grad).abs().max() <= 1e-12


def test_merge_gives_zero_to_rows_no_source_reaches():
    out = torch.ones(1, 1, 2, 4)
    lse = torch.tensor([[[0.5, float("-inf")]]])
    merged = flex.merge_by_lse([(out, lse), (2 * out, torch.full_like(lse, float("-inf")))], torch.float32)
    assert torch.equal(merged[0, 0, 1], torch.zeros(4)) and torch.allclose(merged[0, 0, 0], torch.ones(4))


# --- decoding without a mask -------------------------------------------------------------------------------------


def _decode_rows(prefix_blocks: int, block: int):
    clean = stream_rows(CLEAN, torch.arange(prefix_blocks * block))
    noisy = stream_rows(NOISY, torch.arange(prefix_blocks * block, (prefix_blocks + 1) * block))
    return noisy, RowMeta.cat([clean, noisy])


def test_a_decoding_step_runs_sdpa_without_any_mask(monkeypatch):
    q_rows, k_rows = _decode_rows(5, 16)
    rule = MaskRule(16)
    assert all_pairs_allowed(q_rows, k_rows, rule)
    seen = []
    real = F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append(kwargs.get("attn_mask"))
        return real(*args, **kwargs)

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 16, 8, generator=g), torch.randn(1, 2, 96, 8, generator=g), torch.randn(1, 2, 96, 8)
    want = attend("dense", q, [(k, v)], q_rows, [k_rows], rule.with_window(None), 0.3, {})
    monkeypatch.setattr(backends.F, "scaled_dot_product_attention", recording)
    for backend in ("auto", "blockwise", "flex"):
        seen.clear()
        got = attend(backend, q, [(k, v)], q_rows, [k_rows], rule, 0.3, {})
        assert seen == [None] and (got - want).abs().max() <= 1e-6


@pytest.mark.parametrize("rule,why", [(MaskRule(16, sliding_window=20), "window shorter than the prefix"),
                                      (MaskRule(16, "causal"), "")])
def test_steps_that_need_a_mask_are_not_taken_for_unmasked(rule, why):
    q_rows, k_rows = _decode_rows(5, 16)
    expected = bool(dense_mask(q_rows, k_rows, rule).all())
    assert all_pairs_allowed(q_rows, k_rows, rule) == expected
    if why:
        assert not expected
    training = vectorized_rows(64)
    assert not all_pairs_allowed(training, training, rule)
    docs = vectorized_rows(64, _docs([32, 32]))
    assert not all_pairs_allowed(docs, docs, MaskRule(16))


# --- layouts kept across steps -----------------------------------------------------------------------------------


def test_single_device_layouts_are_kept_across_steps_and_replanned_when_documents_change(monkeypatch):
    rule = MaskRule(16)
    a = LocalLayout.vectorized(128, rule, "auto")
    assert LocalLayout.vectorized(128, rule, "auto") is a
    docs = _docs([64, 64])
    b = LocalLayout.vectorized(128, rule, "auto", docs)
    assert b is not a and LocalLayout.vectorized(128, rule, "auto", docs.clone()) is b
    assert LocalLayout.vectorized(128, rule, "auto", _docs([32, 96])) is not b
    builds = []
    real = flex.build_block_mask
    monkeypatch.setattr(flex, "build_block_mask", lambda *a, **k: builds.append(1) or real(*a, **k))
    q, k, v = _qkv(128)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        layout = LocalLayout.vectorized(128, MaskRule(16, "causal", 24), "flex", docs)
        for _step in range(2):
            for _layer in range(3):
                layout.attend(None, q.double(), k.double(), v.double(), layout.base_rule, 0.2)
            layout = LocalLayout.vectorized(128, MaskRule(16, "causal", 24), "flex", docs)
    assert len(builds) == 1  # one mask for six layers over two steps
