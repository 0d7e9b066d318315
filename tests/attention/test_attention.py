"""Specifications of block-diffusion attention (hf_bdlm/attention): the rule, the block-sparse
planner and every backend against the dense reference.

Fast and CPU-only (CUDA tests skip with a reason): ``python -m pytest tests/attention/test_attention.py -q``.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

from hf_bdlm.attention import BackendUnavailable, MaskRule, attend, dense_mask, vectorized_rows
from hf_bdlm.attention.kernels import block_sparse_attention
from hf_bdlm.attention.masks import (
    CLEAN,
    NOISY,
    TILE_FULL,
    TILE_NONE,
    TILE_PARTIAL,
    count_allowed_pairs,
    tile_classes,
)
from hf_bdlm.attention.rows import RowMeta, stream_rows
from hf_bdlm.attention.tiles import DEFAULT_GROUP_ROWS, plan_attention, split_chunks

KINDS = ("block_causal", "causal")
CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True, scope="module")
def _few_threads():
    # Tensors here are tiny: extra intra-op threads only add overhead on a loaded machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- layouts ---------------------------------------------------------------------------------


def _docs(lengths_in_blocks: list[int], block_size: int) -> torch.Tensor:
    """Document ids ``[1, L]`` of block-aligned packed documents."""
    return torch.cat([torch.full((n * block_size,), i) for i, n in enumerate(lengths_in_blocks)])[None]


def _block_shuffled(rows: RowMeta, block_size: int, seed: int) -> RowMeta:
    """The rows permuted by whole blocks (how a sharded layout reorders them)."""
    n = rows.num_rows // block_size
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    index = (perm[:, None] * block_size + torch.arange(block_size)).flatten()
    return rows.select(index)


def _rank_subset(rows: RowMeta, block_size: int, blocks: list[int]) -> RowMeta:
    """The rows of some whole row blocks (what one rank of a group holds as queries)."""
    index = torch.cat([torch.arange(b * block_size, (b + 1) * block_size) for b in blocks])
    return rows.select(index)


def _chunk_onehot(rows: RowMeta, block_size: int) -> tuple[torch.Tensor, int]:
    chunks = split_chunks(rows, block_size)
    onehot = torch.zeros(chunks.count, rows.num_rows)
    for i, (s, e) in enumerate(zip(chunks.start.tolist(), chunks.end.tolist())):
        onehot[i, s:e] = 1
    return onehot, chunks


def _assert_tiles_match_dense(q_rows: RowMeta, k_rows: RowMeta, rule: MaskRule):
    q_onehot, qc = _chunk_onehot(q_rows, rule.block_size)
    k_onehot, kc = _chunk_onehot(k_rows, rule.block_size)
    dense = dense_mask(q_rows, k_rows, rule)[0].double()
    allowed_in_tile = q_onehot.double() @ dense @ k_onehot.double().T
    tile_size = q_onehot.sum(1, keepdim=True).double() * k_onehot.sum(1)[None].double()
    expected = torch.full(allowed_in_tile.shape, TILE_PARTIAL, dtype=torch.int8)
    expected[allowed_in_tile == 0] = TILE_NONE
    expected[allowed_in_tile == tile_size] = TILE_FULL
    got = tile_classes(qc, kc, rule)
    bad = (got != expected).nonzero()
    assert bad.numel() == 0, (
        f"{rule}: tile (query chunk {bad[0, 0].item()}, key chunk {bad[0, 1].item()}) classified "
        f"{got[tuple(bad[0])].item()}, dense mask says {expected[tuple(bad[0])].item()}"
    )


def _small_rules(block_size: int, length: int):
    windows = (None, 1, block_size // 2 + 1, block_size, block_size + 1, 2 * block_size + 1, length + 1)
    return [MaskRule(block_size, kind, w) for kind in KINDS for w in windows]


# --- tile classes against the dense mask -----------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 2, 4])
@pytest.mark.parametrize("packed", [False, True], ids=["one_doc", "packed"])
def test_tile_classes_agree_with_dense_mask_on_vectorized_rows(block_size, packed):
    length = 6 * block_size
    doc = _docs([1, 3, 2], block_size) if packed else None
    rows = vectorized_rows(length, doc)
    for rule in _small_rules(block_size, length):
        _assert_tiles_match_dense(rows, rows, rule)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("packed", [False, True], ids=["one_doc", "packed"])
def test_tile_classes_agree_with_dense_mask_on_block_shuffled_rows(seed, packed):
    block_size, length = 4, 32
    doc = _docs([3, 1, 4], block_size) if packed else None
    rows = _block_shuffled(vectorized_rows(length, doc), block_size, seed)
    for rule in _small_rules(block_size, length):
        _assert_tiles_match_dense(rows, rows, rule)


@pytest.mark.parametrize("packed", [False, True], ids=["one_doc", "packed"])
def test_tile_classes_agree_with_dense_mask_for_a_subset_of_query_rows(packed):
    block_size, length = 4, 32
    doc = _docs([2, 2, 4], block_size) if packed else None
    keys = vectorized_rows(length, doc)
    # A rank holding noisy blocks 0 and 7 (dual-end pair) and clean blocks 3..4, plus half blocks.
    queries = [
        _rank_subset(keys, block_size, [0, 7, 8 + 3, 8 + 4]),
        keys.select(torch.cat([torch.arange(2, 6), torch.arange(40, 47)])),
    ]
    for q_rows, rule in itertools.product(queries, _small_rules(block_size, length)):
        _assert_tiles_match_dense(q_rows, keys, rule)


# --- blockwise equals dense ------------------------------------------------------------------


def _qkv(batch, heads, kv_heads, q_len, k_lens, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, q_len, dim, dtype=torch.float64, generator=g, requires_grad=True)
    sources = [
        tuple(torch.randn(batch, kv_heads, n, dim, dtype=torch.float64, generator=g, requires_grad=True) for _ in "kv")
        for n in k_lens
    ]
    return q, sources


def _run(backend, q, sources, q_rows, k_rows, rule, grad_out):
    q = q.detach().requires_grad_()
    sources = [(k.detach().requires_grad_(), v.detach().requires_grad_()) for k, v in sources]
    out = attend(backend, q, sources, q_rows, k_rows, rule, q.shape[-1] ** -0.5, {})
    out.backward(grad_out)
    return out.detach(), [q.grad] + [t.grad for kv in sources for t in kv]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _assert_close(got, want, what=""):
    out_g, grads_g = got
    out_w, grads_w = want
    assert _rel_err(out_g, out_w) <= 1e-12, f"{what}: output differs"
    names = ["dq"] + [f"d{t}{i}" for i in range(len(grads_w) // 2) for t in "kv"]
    for name, a, b in zip(names, grads_g, grads_w):
        assert _rel_err(a, b) <= 1e-12, f"{what}: {name} differs by {_rel_err(a, b):.2e}"


def _assert_blockwise_equals_dense(q_rows, k_rows, rule, batch=1, heads=4, kv_heads=2, seed=0):
    q, sources = _qkv(batch, heads, kv_heads, q_rows.num_rows, [r.num_rows for r in k_rows], seed=seed)
    grad_out = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    want = _run("dense", q, sources, q_rows, k_rows, rule, grad_out)
    got = _run("blockwise", q, sources, q_rows, k_rows, rule, grad_out)
    _assert_close(got, want, str(rule))
    # The planner's other granularities: block-sized tiles only, and small groups of blocks.
    for group_rows in (0, 2 * rule.block_size):
        _assert_close(_run_plans(group_rows, q, sources, q_rows, k_rows, rule, grad_out), want,
                      f"{rule}, group_rows={group_rows}")  # fmt: skip
    return got


def _run_plans(group_rows, q, sources, q_rows, k_rows, rule, grad_out):
    q = q.detach().requires_grad_()
    sources = [(k.detach().requires_grad_(), v.detach().requires_grad_()) for k, v in sources]
    outs = []
    for i in range(q.shape[0]):
        def item_rows(r):
            return r.batch_item(i if r.doc is not None and r.doc.shape[0] > 1 else 0)

        plan = plan_attention(item_rows(q_rows), [item_rows(r) for r in k_rows], rule, group_rows)
        item = [(k[i : i + 1], v[i : i + 1]) for k, v in sources]
        outs.append(block_sparse_attention(plan, q[i : i + 1], item, q.shape[-1] ** -0.5)[0])
    out = torch.cat(outs)
    out.backward(grad_out)
    return out.detach(), [q.grad] + [t.grad for kv in sources for t in kv]


def _windows(block_size, length):
    # None, smaller than the block, between one and two blocks, longer than the sequence.
    return (None, block_size // 2, block_size + block_size // 2, length + 5)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("window_index", range(4), ids=["no_window", "w<B", "B<w<2B", "w>L"])
def test_blockwise_equals_dense_on_vectorized_rows(kind, window_index):
    block_size, length = 4, 24
    rule = MaskRule(block_size, kind, _windows(block_size, length)[window_index])
    rows = vectorized_rows(length)
    _assert_blockwise_equals_dense(rows, [rows], rule, batch=2)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("window", [None, 3], ids=["no_window", "w<B"])
def test_blockwise_equals_dense_with_packed_documents_shared_by_the_batch(kind, window):
    block_size = 4
    doc = _docs([2, 1, 3], block_size).expand(2, -1)
    rows = vectorized_rows(doc.shape[1], doc)
    _assert_blockwise_equals_dense(rows, [rows], MaskRule(block_size, kind, window), batch=2)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("window", [None, 6], ids=["no_window", "B<w<2B"])
def test_blockwise_equals_dense_with_packed_documents_differing_per_batch_item(kind, window):
    block_size = 4
    doc = torch.cat([_docs([2, 1, 3], block_size), _docs([4, 2], block_size), _docs([6], block_size)])
    rows = vectorized_rows(doc.shape[1], doc)
    _assert_blockwise_equals_dense(rows, [rows], MaskRule(block_size, kind, window), batch=3)


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_blockwise_equals_dense_with_grouped_query_attention(kv_heads):
    rows = vectorized_rows(16)
    _assert_blockwise_equals_dense(rows, [rows], MaskRule(4, "causal"), heads=4, kv_heads=kv_heads)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("window", [None, 2, 6], ids=["no_window", "w<B", "B<w<2B"])
def test_blockwise_with_keys_split_into_two_sources_equals_one_source(kind, window):
    block_size, length = 4, 20
    rule = MaskRule(block_size, kind, window)
    rows = vectorized_rows(length)
    noisy, clean = rows.slice(0, length), rows.slice(length, 2 * length)
    q, (source,) = _qkv(2, 4, 2, 2 * length, [2 * length], seed=3)
    grad_out = torch.randn(q.shape, dtype=torch.float64)
    one = _run("blockwise", q, [source], rows, [rows], rule, grad_out)
    k, v = source
    split = [(k[:, :, :length], v[:, :, :length]), (k[:, :, length:], v[:, :, length:])]
    two = _run("blockwise", q, split, rows, [noisy, clean], rule, grad_out)
    dense = _run("dense", q, split, rows, [noisy, clean], rule, grad_out)
    _assert_close(two, dense, f"two sources vs dense, {rule}")
    # Per-source gradients are the two halves of the single-source gradient.
    dq, dk0, dv0, dk1, dv1 = two[1]
    _assert_close(
        (two[0], [dq, torch.cat([dk0, dk1], 2), torch.cat([dv0, dv1], 2)]), one, f"two sources vs one, {rule}"
    )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("window", [None, 2, 6], ids=["no_window", "w<B", "B<w<2B"])
def test_blockwise_equals_dense_for_a_rank_holding_some_blocks(kind, window):
    block_size, length = 4, 32
    keys = vectorized_rows(length)
    # Noisy blocks 1 and 6 (a dual-end pair) and clean blocks 2..3, in local order.
    queries = _rank_subset(keys, block_size, [1, 6, 8 + 2, 8 + 3])
    _assert_blockwise_equals_dense(queries, [keys], MaskRule(block_size, kind, window), batch=2)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("window", [None, 2, 6], ids=["no_window", "w<B", "B<w<2B"])
def test_blockwise_equals_dense_on_block_shuffled_rows(kind, window):
    rows = _block_shuffled(vectorized_rows(24, _docs([2, 4], 4)), 4, seed=1)
    _assert_blockwise_equals_dense(rows, [rows], MaskRule(4, kind, window))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block", [0, 3])
@pytest.mark.parametrize("window", [None, 2, 6], ids=["no_window", "w<B", "B<w<2B"])
def test_blockwise_equals_dense_in_inference_form(kind, block, window):
    # Generation: one noisy block attends to the cached clean prefix and to itself.
    block_size = 4
    positions = torch.arange(block * block_size, (block + 1) * block_size)
    q_rows = stream_rows(NOISY, positions)
    keys = RowMeta.cat([stream_rows(CLEAN, torch.arange(block * block_size)), q_rows])
    _assert_blockwise_equals_dense(q_rows, [keys], MaskRule(block_size, kind, window), batch=2)


# --- the plan stays block-sized --------------------------------------------------------------


@pytest.mark.parametrize("group_rows", [0, 256, DEFAULT_GROUP_ROWS], ids=lambda g: f"group{g}")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("window", [None, 100], ids=["no_window", "window"])
def test_plan_never_builds_a_sequence_sized_object(kind, window, group_rows):
    length, block_size = 2048, 64
    rule = MaskRule(block_size, kind, window)
    rows = vectorized_rows(length)
    plan = plan_attention(rows, [rows], rule, group_rows)
    side = max(block_size, group_rows)  # group tiles are bounded by group_rows, whatever the length
    for call in plan.calls:
        if call.mask is not None:
            assert call.mask.numel() <= side * side, f"mask of shape {tuple(call.mask.shape)}"
        for spec in (call.q_rows, call.k_rows):
            if not isinstance(spec, tuple):  # index tensors list rows, never pairs
                assert spec.numel() <= 2 * length
    assert plan.allowed_pairs() == count_allowed_pairs(rows, rows, rule)


@pytest.mark.parametrize("kind", KINDS)
def test_group_tiles_cut_the_calls_and_waste_little(kind):
    # Grouping dense regions into group_rows-sized masked tiles trades a few computed-but-masked
    # pairs for far fewer, larger kernel calls; the exact pairs stay the rule's (tested above).
    length, block_size = 4096, 64
    rule = MaskRule(block_size, kind)
    rows = vectorized_rows(length)
    fine, grouped = plan_attention(rows, [rows], rule, 0), plan_attention(rows, [rows], rule)

    def computed(plan):  # pairs the kernels evaluate, masked ones included
        total = 0
        for c in plan.calls:
            nq = c.q_rows[1] - c.q_rows[0] if isinstance(c.q_rows, tuple) else c.q_rows.numel()
            nk = c.k_rows[1] - c.k_rows[0] if isinstance(c.k_rows, tuple) else c.k_rows.shape[-1]
            total += nq * nk
        return total

    assert len(grouped.calls) * 4 <= len(fine.calls)
    assert computed(grouped) <= 1.15 * grouped.allowed_pairs()


# --- flex ------------------------------------------------------------------------------------


def _flex_runs_eagerly_here() -> str | None:
    try:
        rows = vectorized_rows(8)
        q = torch.randn(1, 2, 16, 8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "called without torch.compile": eager is the point
            attend("flex", q, [(q, q)], rows, [rows], MaskRule(4), 0.5, {})
    except Exception as exc:  # noqa: BLE001 - any failure means "not on this torch"
        return f"FlexAttention does not run eagerly on this torch: {exc!r}"
    return None


_FLEX_SKIP = _flex_runs_eagerly_here()


@pytest.mark.skipif(_FLEX_SKIP is not None, reason=_FLEX_SKIP or "")
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("window,convention", [(None, "per_query"), (3, "per_query"), (6, "block_start")],
                         ids=["no_window", "w<B", "block_start"])
def test_flex_forward_equals_dense_on_cpu(kind, window, convention):
    doc = torch.cat([_docs([2, 1, 3], 4), _docs([6], 4)])
    rows = vectorized_rows(24, doc)
    rule = MaskRule(4, kind, window, convention)
    q, sources = _qkv(2, 4, 2, rows.num_rows, [rows.num_rows])
    with torch.no_grad():
        flex = attend("flex", q, sources, rows, [rows], rule, 0.3, {})
        dense = attend("dense", q, sources, rows, [rows], rule, 0.3, {})
    assert _rel_err(flex, dense) <= 1e-12


def test_flex_training_on_cpu_raises_backend_unavailable_naming_blockwise():
    rows = vectorized_rows(8)
    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    with pytest.raises(BackendUnavailable, match="blockwise"):
        attend("flex", q, [(q, q)], rows, [rows], MaskRule(4), 0.5, {})


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("kind", KINDS)
def test_flex_backward_equals_dense_on_cuda(kind):
    rows = vectorized_rows(256, _docs([4, 12], 16).cuda())
    rule = MaskRule(16, kind, 40)
    q, (source,) = _qkv(1, 4, 2, rows.num_rows, [rows.num_rows], dim=16)
    q, source = q.detach().cuda(), tuple(t.detach().cuda() for t in source)
    grad_out = torch.randn_like(q)
    got = _run("flex", q.float(), [tuple(t.float() for t in source)], rows, [rows], rule, grad_out.float())
    want = _run("dense", q, [source], rows, [rows], rule, grad_out)
    for a, b in zip([got[0]] + got[1], [want[0]] + want[1]):
        assert _rel_err(a.double(), b) <= 1e-4


# --- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(block_size=0), "block_size"),
        (dict(block_size=-4), "block_size"),
        (dict(block_size=4, clean_attention="bidirectional"), "clean_attention"),
        (dict(block_size=4, sliding_window=0), "sliding_window"),
    ],
)
def test_mask_rule_rejects_invalid_parameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MaskRule(**kwargs)


def test_unknown_backend_is_an_error_listing_the_backends():
    rows = vectorized_rows(8)
    q = torch.randn(1, 2, 16, 8)
    with pytest.raises(ValueError, match="Unknown attention backend 'sparse'.*blockwise"):
        attend("sparse", q, [(q, q)], rows, [rows], MaskRule(4), 0.5, {})


def test_row_count_mismatch_is_an_error():
    rows = vectorized_rows(8)
    q = torch.randn(1, 2, 12, 8)
    with pytest.raises(ValueError, match="12 query rows for 16 described"):
        attend("blockwise", q, [(q, q)], rows, [rows], MaskRule(4), 0.5, {})


def test_equally_spaced_batched_rows_are_read_in_place_on_cpu():
    from hf_bdlm.attention.kernels import select_rows

    x = torch.randn(1, 3, 40, 8)
    regular = torch.arange(4)[None, :] + torch.tensor([2, 12, 22])[:, None]  # three runs of 4 rows, 10 apart
    irregular = torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8], [20, 21, 22, 23]])
    for rows in (regular, irregular):
        want = x[0][:, rows].permute(1, 0, 2, 3)  # [n, H, c, d]
        assert torch.equal(select_rows(x, rows), want)
    assert select_rows(x, regular).untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert select_rows(x, irregular).untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
