"""Communication overlaps computation by construction (single process, no collectives run).

- The block-sparse kernel starts a deferred source's transfer, computes every local source, and only then waits;
  in backward it computes the deferred source's gradients, starts returning them, computes the local gradients,
  and only then waits. The result is the attention over all keys.
- The sharded layouts give it work to overlap: in ``cp`` and ``csbp`` the rank's own rows are a local source and
  only the peers' rows are deferred (an all-gather without the own slot); sliding-window layers exchange only the
  peers' halo rows (all-to-all), deferred the same way.
- The paper's CP baseline runs a layer as its reference code does: its noisy rows' gather completes first, then its
  clean rows' gather starts and the block-diagonal part computes while it travels; backward computes every gradient
  before the clean rows' reduce-scatter starts, then the noisy rows'.
The collectives themselves run under torchrun in tests/parallel/test_exactness.py (loss, gradients, bytes).
"""

from types import SimpleNamespace

import pytest
import torch

import hf_bdlm.parallel.collectives as collectives
import hf_bdlm.parallel.exchange as exchange
import hf_bdlm.parallel.sharded as sharded
from hf_bdlm.attention import kernels
from hf_bdlm.attention.masks import MaskRule
from hf_bdlm.attention.rows import vectorized_rows
from hf_bdlm.attention.tiles import plan_attention
from hf_bdlm.parallel.collectives import ExchangedKV, GatheredKV
from hf_bdlm.parallel.dims import ParallelDims
from hf_bdlm.parallel.plan import PlanConfig, make_plan

L, B = 16, 4


class _Handle:
    def __init__(self, log, event, result):
        self.log, self.event, self.result = log, event, result

    def wait(self):
        self.log.append(self.event)
        return self.result


class _Deferred:
    """A deferred key source whose 'transfer' is a log entry."""

    def __init__(self, k, v, log):
        self.k, self.v, self.log = k, v, log

    @property
    def num_rows(self):
        return self.k.shape[2]

    def with_kv(self, k, v):
        return _Deferred(k, v, self.log)

    def start_forward(self, k, v):
        self.log.append("start")
        return _Handle(self.log, "wait", (k, v))

    def start_backward(self, dk, dv):
        self.log.append("start_grad")
        return _Handle(self.log, "wait_grad", (dk, dv))


class _LoggingKernel:
    """The SDPA kernel, logging which source each call attends to."""

    expands_gqa, group_rows = kernels.SDPA_KERNEL.expands_gqa, kernels.SDPA_KERNEL.group_rows

    def __init__(self, log):
        self.log = log

    def prepare(self, plan):
        return kernels.SDPA_KERNEL.prepare(plan)

    def forward(self, call, *args):
        self.log.append(f"forward[{call.source}]")
        return kernels.SDPA_KERNEL.forward(call, *args)

    def backward(self, call, *args):
        self.log.append(f"backward[{call.source}]")
        return kernels.SDPA_KERNEL.backward(call, *args)


def _compress(log):
    """Consecutive repeats collapsed: ['forward[0]', 'forward[0]', 'start'] -> ['forward[0]', 'start']."""
    return [e for i, e in enumerate(log) if i == 0 or log[i - 1] != e]


def test_kernel_computes_local_sources_while_the_deferred_one_travels():
    torch.manual_seed(0)
    rows = vectorized_rows(L)
    noisy, clean = rows.slice(0, L), rows.slice(L, 2 * L)
    q = torch.randn(1, 4, 2 * L, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 2 * L, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 2 * L, 8, dtype=torch.float64, requires_grad=True)
    rule = MaskRule(B, "block_causal")
    log = []
    plan = plan_attention(rows, [noisy, clean], rule)
    out, _ = kernels.block_sparse_attention(plan, q, [(k[:, :, :L], v[:, :, :L]), _Deferred(k[:, :, L:], v[:, :, L:], log)],
                                            0.3, _LoggingKernel(log))
    out.sum().backward()
    assert _compress(log) == ["start", "forward[0]", "wait", "forward[1]",
                              "backward[1]", "start_grad", "backward[0]", "wait_grad"]
    # And it is the attention over all keys.
    ref_grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref, _ = kernels.block_sparse_attention(plan_attention(rows, [rows], rule), q, [(k, v)], 0.3)
    ref.sum().backward()
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-13)
    for got, want in zip(ref_grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


class _Comm:
    def __init__(self, size, rank):
        self.size, self.rank = size, rank

    def hold(self, ready_at):  # no emulated link
        assert ready_at is None


def _layout(mode, P=2, rank=0, window=None, cp_layout="balanced"):
    dims = ParallelDims(P, mode=mode, cp_layout=cp_layout)
    comm = _Comm(P, rank)
    groups = SimpleNamespace(dims=dims, group_rank=rank, group=comm, ring=comm, kv_exchange=lambda mode: comm)
    plan = make_plan(PlanConfig.from_dims(dims, L, B))
    return sharded.ShardedLayout(plan, groups, MaskRule(B, "block_causal", sliding_window=window))


@pytest.mark.parametrize("mode", ["cp", "csbp"])
@pytest.mark.parametrize("rank", [0, 1])
def test_own_rows_are_local_and_only_the_peers_rows_are_gathered(monkeypatch, mode, rank):
    seen = {}
    monkeypatch.setattr(exchange, "attend", lambda backend, q, sources, q_rows, rows, *a: seen.update(
        sources=sources, rows=rows) or q)
    layout = _layout(mode, rank=rank)
    n, held = layout.num_noisy if mode == "csbp" else 0, layout.q_rows.num_rows
    key = torch.zeros(1, 2, held, 8)
    layout.attend(None, torch.zeros(1, 4, held, 8), key, key.clone(), layout.base_rule, 1.0)
    (local, gathered), (local_rows, peer_rows) = seen["sources"], seen["rows"]
    assert local[0] is key and local_rows is layout.q_rows  # every row this rank holds, noisy and sent
    assert isinstance(gathered, GatheredKV) and gathered.peers_only
    assert gathered.k.shape[2] == held - n  # it sends its clean rows (csbp) or all its rows (cp)
    assert gathered.num_rows == peer_rows.num_rows == layout.plan.ranks[1 - rank].rows().num_rows - (
        layout.plan.ranks[1 - rank].local_noisy_rows if mode == "csbp" else 0)
    assert peer_rows.num_rows + gathered.k.shape[2] == layout.gathered_rows.num_rows


def test_window_layers_exchange_only_the_peers_halo(monkeypatch):
    seen = {}
    monkeypatch.setattr(exchange, "attend", lambda backend, q, sources, q_rows, rows, *a: seen.update(
        sources=sources, rows=rows) or q)
    layout = _layout("csbp", window=5)
    held = layout.q_rows.num_rows
    key = torch.zeros(1, 2, held, 8)
    layout.attend(None, torch.zeros(1, 4, held, 8), key, key.clone(), layout.base_rule.with_window(5), 1.0)
    (local, halo), (local_rows, halo_rows) = seen["sources"], seen["rows"]
    assert local[0] is key and local_rows is layout.q_rows
    assert isinstance(halo, ExchangedKV)
    assert halo.send_counts[0] == halo.recv_counts[0] == 0  # nothing to or from itself
    assert 0 < halo.num_rows == halo_rows.num_rows < layout.gathered_rows.num_rows - key.shape[2] + layout.num_noisy


class _LoggedCollective:
    """A started collective whose transfer is a log entry; ``wait`` logs and returns ``result``."""

    def __init__(self, log, what, result):
        self.log, self.what, self.result = log, what, result

    def wait(self):
        self.log.append(f"wait {self.what}")
        return self.result


@pytest.mark.parametrize("window", [None, 5], ids=["full", "sliding"])
def test_the_papers_cp_overlaps_its_clean_gather_with_the_block_diagonal_part_only(monkeypatch, window):
    # Its reference (turbo-dllm 0.1.6) runs _GatherPureCPActiveKV (the noisy rows, synchronous), then in
    # _PureContextShardedActiveAttentionImpl starts the clean gather, computes the block-diagonal part, waits, attends
    # to the clean rows; backward every gradient, then the clean reduce-scatter; then the noisy rows' reduce-scatter.
    log = []

    def start_gather(x, comm, name, peers_only=False):
        log.append(f"gather {name}")
        return _LoggedCollective(log, f"gather {name}", x.repeat(1, 1, comm.size - peers_only, 1))

    def start_reduce_scatter(full, comm, name, peers_only=False):
        log.append(f"reduce_scatter {name}")
        return _LoggedCollective(log, f"reduce_scatter {name}", full[:, :, : full.shape[2] // comm.size])

    def logged(calls_fn, label):
        def run(calls, *args, **kw):
            if calls:
                log.append(f"{label}[{calls[0].source}]")
            return calls_fn(calls, *args, **kw)
        return run

    monkeypatch.setattr(collectives, "start_gather", start_gather)
    monkeypatch.setattr(collectives, "start_reduce_scatter", start_reduce_scatter)
    monkeypatch.setattr(kernels, "forward_calls", logged(kernels.forward_calls, "forward"))
    monkeypatch.setattr(kernels, "backward_calls", logged(kernels.backward_calls, "backward"))
    layout = _layout("cp", cp_layout="paper")
    rows = layout.q_rows.num_rows
    q = torch.randn(1, 4, rows, 8, requires_grad=True)
    k, v = (torch.randn(1, 2, rows, 8, requires_grad=True) for _ in range(2))
    rule = layout.base_rule.with_window(window)
    layout.attend(None, q, k, v, rule, 0.3).sum().backward()
    forward = ["gather k", "wait gather k", "gather v", "wait gather v",  # the noisy rows, complete
               "gather k", "gather v", "forward[0]",  # the clean rows start; the block-diagonal part meanwhile
               "wait gather k", "wait gather v", "forward[1]"]  # every clean key after the wait
    backward = ["backward[1]", "backward[0]",  # every gradient first
                "reduce_scatter k", "reduce_scatter v", "wait reduce_scatter k", "wait reduce_scatter v"]  # clean
    got = _compress(log)
    assert got[:len(forward) + len(backward)] == forward + backward
    noisy = got[len(forward) + len(backward):]  # the noisy rows' gradients return last (K and V in either order)
    assert sorted(noisy) == sorted(["reduce_scatter k", "wait reduce_scatter k", "reduce_scatter v",
                                    "wait reduce_scatter v"])
    assert all(noisy[i + 1] == "wait " + noisy[i] for i in (0, 2))  # each returns before the next starts
