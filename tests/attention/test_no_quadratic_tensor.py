"""No ``L x L`` tensor on the path CUDA takes (issue 42): every allocation of a layer's attention, forward and backward.

The flex backend (``auto`` on CUDA) runs for every layout (one device, one device with packed documents, one rank of
``cp``, the paper's CP, ``bp`` and ``csbp`` at P = 8), on a full and a sliding-window layer, under
``FakeTensorMode`` with the FlexAttention kernel replaced by a stand-in that allocates its outputs and gradients
(:mod:`hf_bdlm.benchmarks.fake_memory`: the K/V exchange, the log-sum-exp merge and autograd are the library's own
code; the block masks are built on the host for real). No tensor may reach ``(2L)^2 / 64`` elements, the block masks'
index arrays included. The heads are narrow (4 query heads, 2 K/V heads, head dim 16) so that every tensor a row
owns is far below the bound (q: ``2L x 64`` elements, 1/64 of it at L = 128K); ``dense`` at the same L builds the
``2L x 2L`` mask and trips it, so the check can fail. The Gemma-3-27B-shaped study at 128K-512K is
``python -m hf_bdlm.benchmarks.fake_memory`` (docs/benchmarks.md, "Memory at the paper's lengths").
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from hf_bdlm.benchmarks.fake_memory import (
    KINDS,
    LAYOUTS,
    AllocationRecorder,
    LayerShape,
    add_growth,
    measure_attention,
    threshold,
)

L = 131072  # the paper's shortest length: the bound is 64x q's size here; the host builds the 12 block masks in ~10 s
SHAPE = LayerShape(heads=4, kv_heads=2, head_dim=16, window=1024, block_size=32)


def test_the_recorder_counts_new_storages_and_their_peak():
    with FakeTensorMode(), AllocationRecorder() as rec:
        a = torch.empty(1000)
        b = torch.empty(2000)
        view = b[:10].view(2, 5)  # a view: no allocation
        del a
        c = torch.empty(500)  # fits where a was: the peak stays a + b
        b.add_(1)  # in place: no allocation
    assert rec.count == 3 and rec.largest.elements == 2000
    assert rec.peak_bytes == 3000 * 4
    del view, c


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_flex_allocates_no_quadratic_tensor(layout, kind):
    r = measure_attention(layout, "flex", L, kind, SHAPE)
    assert r.error is None, r.error
    rows = r.query_rows
    # The CUDA path ran: the kernel (stand-in) once per key source forward and backward, and the recorder saw q.
    assert r.flex_calls == len(r.key_sources) == r.flex_backward_calls >= 1
    assert r.largest["elements"] >= SHAPE.heads * rows * SHAPE.head_dim
    bound = threshold(L)
    assert r.largest["elements"] < bound, (r.largest, bound)
    assert 0 < r.mask_largest_elements < bound  # the block masks' tile arrays: (2L / 128)^2 at most
    assert r.passed


@pytest.mark.parametrize("layout", ["single", "cp"])
def test_dense_trips_the_bound(layout):
    r = measure_attention(layout, "dense", L, "full", SHAPE)
    assert r.error is None and r.passed is False
    assert r.largest["elements"] >= threshold(L)
    assert r.largest["dtype"] == "bool"  # the rule's mask: [1, rows, keys]


def test_flex_grows_linearly_and_dense_quadratically():
    """Every allocation of the flex step at 2L is at most about twice its counterpart at L; dense's mask is 4x."""
    records = [measure_attention(layout, backend, n, "full", SHAPE)
               for layout, backend in (("single", "flex"), ("csbp", "flex"), ("single", "dense")) for n in (4096, 8192)]
    add_growth(records)
    growth = {(r.layout, r.backend): (r.growth, r.growth_basis) for r in records}
    assert growth[("single", "flex")][1] == growth[("csbp", "flex")][1] == "every allocation"
    assert growth[("single", "flex")][0] <= 1.05 and growth[("csbp", "flex")][0] <= 1.05
    assert growth[("single", "dense")][0] == pytest.approx(2.0, abs=0.01)
