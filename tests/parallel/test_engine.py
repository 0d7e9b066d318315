"""The K/V exchange (hf_bdlm/parallel/exchange.py) as both layouts use it, without processes.

The collectives are not run: ``attend`` and ``ring_attention`` are replaced by recorders, so the tests see the sources,
rows and names a layer hands to the kernels. The distributed exactness tests run the same code under torchrun.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import hf_bdlm.parallel.exchange as exchange
from hf_bdlm.attention.masks import MaskRule
from hf_bdlm.attention.rows import RowMeta
from hf_bdlm.parallel.collectives import ExchangedKV, GatheredKV
from hf_bdlm.parallel.dims import ParallelDims
from hf_bdlm.parallel.exchange import ExchangePass
from hf_bdlm.parallel.plan import PlanConfig, make_plan, window_exchange
from hf_bdlm.parallel.sharded import ShardedLayout


L, B = 64, 4


class _Comm:
    def __init__(self, size, rank):
        self.size, self.rank = size, rank


def _groups(dims, rank):
    comm = _Comm(dims.block_parallel_size, rank) if dims.mode != "bp" else _Comm(1, 0)
    return SimpleNamespace(dims=dims, group_rank=rank, group=comm, ring=comm, kv_exchange=lambda mode: comm)


def _layout(mode, P=2, rank=0, window=None, doc=None, transport="allgather", backend="blockwise"):
    dims = ParallelDims(P, mode=mode)
    plan = make_plan(PlanConfig.from_dims(dims, L, B))
    return ShardedLayout(plan, _groups(dims, rank), MaskRule(B, "block_causal", sliding_window=window), backend, doc,
                         transport)


@pytest.fixture
def seen(monkeypatch):
    seen = {}
    monkeypatch.setattr(exchange, "attend", lambda backend, q, sources, q_rows, rows, rule, scale, cache: seen.update(
        sources=sources, q_rows=q_rows, rows=rows, cache=cache) or q)
    return seen


def _kv(rows: int, b: int = 1):
    key = torch.randn(b, 2, rows, 8)
    return key, torch.randn(b, 2, rows, 8)


@pytest.mark.parametrize("mode", ["cp", "csbp"])
def test_the_layout_sends_its_tail_with_the_collectives_default_names(seen, mode):
    layout = _layout(mode)
    p = layout.exchange
    n = layout.num_noisy if mode == "csbp" else 0
    assert p.queries is p.keys is layout.q_rows and p.sent == slice(n, layout.q_rows.num_rows)
    assert p.unsent.stop - p.unsent.start == n and p.cache is layout.cache  # csbp: the noisy head stays local
    key, value = _kv(layout.q_rows.num_rows)
    layout.attend(None, torch.zeros(1, 4, key.shape[2], 8), key, value, layout.base_rule, 1.0)
    (local, gathered), (local_rows, peer_rows) = seen["sources"], seen["rows"]
    assert local[0] is key and local_rows is layout.q_rows
    assert isinstance(gathered, GatheredKV) and gathered.peers_only and gathered.names == ("k", "v")
    assert torch.equal(gathered.k, key[:, :, n:])
    expect = layout.plan.sent_rows(1)
    assert torch.equal(peer_rows.pos, expect.pos) and torch.equal(peer_rows.stream, expect.stream)


def test_a_window_layer_exchanges_the_halo_with_default_names(seen):
    layout = _layout("csbp", window=5)
    key, value = _kv(layout.q_rows.num_rows)
    layout.attend(None, torch.zeros(1, 4, key.shape[2], 8), key, value, layout.base_rule.with_window(5), 1.0)
    (local, halo), (_, halo_rows) = seen["sources"], seen["rows"]
    assert local[0] is key and isinstance(halo, ExchangedKV) and halo.names == ("k_window", "v_window")
    assert halo.num_rows == halo_rows.num_rows > 0 and halo.send_counts[0] == halo.recv_counts[0] == 0


def test_bp_attends_its_own_rows_only(seen):
    layout = _layout("bp")
    key, value = _kv(layout.q_rows.num_rows)
    layout.attend(None, torch.zeros(1, 4, key.shape[2], 8), key, value, layout.base_rule, 1.0)
    assert seen["sources"] == [(key, value)] and seen["rows"] == [layout.q_rows]


def test_packed_window_rows_carry_their_documents():
    """The window lists depend on positions and streams only: rows carrying their document ids receive the ids of
    the senders' rows, as attaching ``doc[:, pos]`` to the rows received without ids does."""
    doc = torch.zeros(2, L, dtype=torch.long)
    doc[0, 24:], doc[1, 40:] = 1, 2
    rule = MaskRule(B, "block_causal", sliding_window=7)
    for mode in ("cp", "csbp"):
        for rank in (0, 1):
            layout = _layout(mode, rank=rank, doc=doc)
            *_, rows = layout.exchange._window_exchange(rule, torch.device("cpu"))
            members = layout.plan.ring_members(rank)
            *_, bare = window_exchange(members.index(rank), [layout.plan.ranks[m].rows() for m in members],
                                       [layout.plan.sent_rows(m) for m in members], rule)
            assert torch.equal(rows.pos, bare.pos) and torch.equal(rows.stream, bare.stream)
            assert torch.equal(rows.doc, doc[:, bare.pos])


@pytest.mark.parametrize("dims", [ParallelDims(2, mode="cp"), ParallelDims(4, mode="cp"), ParallelDims(4, 2, "csbp"),
                                  ParallelDims(4, 4, "csbp"), ParallelDims(4, 2, "csbp", schedule="contiguous")],
                         ids=str)
def test_the_rings_sent_rows_cover_every_position(dims):
    """Why checking the documents on the pass's rows (one set of ring plans) equals checking the whole batch: the
    members' sent rows hold every position."""
    plan = make_plan(PlanConfig.from_dims(dims, 2 * L, B))
    for me in range(dims.block_parallel_size):
        pos = torch.cat([plan.sent_rows(m).pos for m in plan.ring_members(me)])
        assert set(pos.tolist()) == set(range(2 * L))


def test_the_ring_rotates_the_sent_rows_and_keeps_the_rest_local(monkeypatch):
    calls = []
    monkeypatch.setattr(exchange, "ring_attention", lambda comm, q, shard, local, local_plans, shard_plans, scale: (
        calls.append((q, shard, local, local_plans, shard_plans)) or q))
    doc = torch.zeros(2, L, dtype=torch.long)
    layout = _layout("csbp", doc=doc, transport="ring")
    n, rows = layout.num_noisy, layout.q_rows.num_rows
    key, value = _kv(rows, b=2)
    out = layout.attend(None, torch.zeros(2, 4, rows, 8), key, value, layout.base_rule, 1.0)
    (q, shard, local, local_plans, shard_plans), = calls  # same documents: one call for the batch
    assert out.shape[0] == 2 and torch.equal(shard[0], key[:, :, n:]) and torch.equal(local[0][0], key[:, :, :n])
    assert len(local_plans) == 1 and len(shard_plans) == 2
    calls.clear()
    doc[1, 32:] = 1
    layout = _layout("csbp", doc=doc, transport="ring")
    out = layout.attend(None, torch.zeros(2, 4, rows, 8), key, value, layout.base_rule, 1.0)
    assert len(calls) == 2 and out.shape[0] == 2  # the items' documents differ: one call (and plan set) per item
    assert ("ring_plans", layout.base_rule, 1) in layout.cache
    calls.clear()
    _layout("cp", transport="ring").attend(None, torch.zeros(1, 4, rows, 8), *_kv(rows), layout.base_rule, 1.0)
    assert calls[0][2] == [] and calls[0][3] == []  # cp sends every row: nothing stays local


def test_a_pass_checks_its_transport_and_its_sent_rows():
    rows = RowMeta(torch.zeros(8, dtype=torch.long), torch.arange(8))
    args = (_Comm(2, 0), "allgather", "blockwise", rows, rows)
    members = ([rows, rows], [rows, rows], 0)
    assert ExchangePass(*args, slice(0, 8), *members).unsent == slice(8, 8)
    assert ExchangePass(*args, slice(3, None), *members).sent == slice(3, 8)
    with pytest.raises(ValueError, match="head or a tail"):
        ExchangePass(*args, slice(2, 5), *members)
    with pytest.raises(ValueError, match="ring transport runs the block-sparse kernels"):
        ExchangePass(_Comm(2, 0), "ring", "dense", rows, rows, slice(0, 8), *members)
    with pytest.raises(ValueError, match="ring transport runs the block-sparse kernels"):
        _layout("csbp", transport="ring", backend="dense")


@pytest.mark.parametrize("mode", ["cp", "csbp"])
def test_diffusion_gemma_passes_send_their_head_with_named_collectives(seen, mode):
    from tiny_diffusion_gemma import make_batch

    from hf_bdlm.models.diffusion_gemma.modeling import diffusion_gemma_rule
    from hf_bdlm.models.diffusion_gemma.training.sharded import ShardedDiffusionGemmaLayout, frame_padding
    from hf_bdlm.objectives import get_objective

    dims = ParallelDims(2, mode=mode)
    frame_multiple, canvas_multiple = frame_padding(dims, 4)
    objective = get_objective("diffusion_gemma", dict(
        block_size=4, vocab_size=64, fill_token_id=1, end_token_ids={1, 4}, pad_to_multiple_of=frame_multiple,
        canvas_blocks_multiple_of=canvas_multiple))
    frame = objective.corrupt(make_batch("plain", seed=0), seed=7, step=0).frame
    plan = make_plan(PlanConfig(dims, frame.frame_length, 4, noisy_blocks=tuple(frame.canvas_blocks.tolist())))
    layout = ShardedDiffusionGemmaLayout(plan, _groups(dims, 0), frame, diffusion_gemma_rule(4))
    n, canvas = layout.num_clean, layout.decoder.queries.num_rows
    enc, dec = layout.encoder, layout.decoder
    assert enc.sent == slice(0, n) and enc.unsent.start == enc.unsent.stop
    assert dec.sent == slice(0, n + canvas if mode == "cp" else n) and dec.keys.num_rows == n + canvas

    key, value = _kv(n, b=2)
    enc.attend(torch.zeros(2, 4, n, 8), key, value, diffusion_gemma_rule(4), 1.0)
    gathered = seen["sources"][1]
    assert gathered.names == ("encoder_k", "encoder_v") and gathered.k is key  # the encoder sends all its keys
    key, value = _kv(n + canvas, b=2)
    dec.attend(torch.zeros(2, 4, canvas, 8), key, value, diffusion_gemma_rule(4), 1.0)
    gathered = seen["sources"][1]
    assert gathered.names == ("decoder_k", "decoder_v") and seen["q_rows"] is dec.queries
    assert gathered.k is key if mode == "cp" else torch.equal(gathered.k, key[:, :, :n])
    dec.attend(torch.zeros(2, 4, canvas, 8), key, value, diffusion_gemma_rule(4).with_window(6), 1.0)
    assert seen["sources"][1].names == ("decoder_k_window", "decoder_v_window")
