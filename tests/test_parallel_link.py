"""The emulated link (hf_bdlm.parallel.link): a transfer through it takes the modelled time (latency + bytes /
bandwidth) within 10 %, transfers share the link, overlap with computation is real, and the data is unchanged."""

import json

import pytest

from hf_bdlm.parallel.link import LinkModel
from torchrun import SharedJob

SHARED_JOBS = [SharedJob("link", "link_worker.py", 2, ("--out", "{out}/link.json"), timeout=300)]


def test_the_link_serializes_transfers_and_adds_latency_to_each():
    link = LinkModel(bytes_per_s=1e6, latency_s=0.01)
    assert link.schedule(500_000, now=100.0) == pytest.approx(100.51)  # 0.5 s of bytes + 10 ms
    assert link.schedule(250_000, now=100.1) == pytest.approx(100.76)  # starts when the first one's bytes are through
    assert link.schedule(0, now=200.0) == pytest.approx(200.01)  # an idle link: only the latency
    with pytest.raises(ValueError, match="bytes_per_s > 0"):
        LinkModel(bytes_per_s=0)
    with pytest.raises(ValueError, match="latency_s >= 0"):
        LinkModel(bytes_per_s=1.0, latency_s=-1.0)


@pytest.mark.distributed
def test_a_bare_all_gather_takes_the_modelled_time(shared_launch):
    for rank in json.loads((shared_launch.folder("link", 2) / "link.json").read_text()):
        model = rank["model_s"]  # 5 ms + 4.0 MB / 50 MB/s = 0.085 s
        assert rank["equal"]
        assert rank["plain_s"] < 0.5 * model  # the machine's own copy is much faster: the model decides
        assert rank["one_s"] == pytest.approx(model, rel=0.10)
        assert rank["two_s"] == pytest.approx(model + rank["bytes"] / 50e6, rel=0.10)  # K then V on one link
        # 50 ms of computation while the transfer travels: only the rest is waited for.
        assert rank["overlapped_s"] == pytest.approx(model, rel=0.10)
        assert rank["overlapped_wait_s"] == pytest.approx(model - 0.05, abs=0.015)


@pytest.mark.distributed
def test_the_modes_benchmark_runs_through_the_link_and_records_it(tmp_path):
    """csbp at P = 2, L = 512, 1 layer through a 1 MB/s link: its 256 KiB of K/V (gathers and dK/dV returns) take
    0.26 s, of which the rank's own attention hides a little (measured: 0.249 s waited). The benchmark's driver runs
    in this process; the measurement is its own torchrun launch."""
    from hf_bdlm.benchmarks import parallel_modes

    out = tmp_path / "modes.json"
    parallel_modes.main(["--lengths", "512", "--nprocs", "2", "--modes", "csbp", "--transports", "allgather",
                         "--no-single", "--layers", "1", "--steps", "1", "--link-bytes-per-s", "1e6", "--link-name",
                         "slow", "--out", str(out)])
    rec = json.loads(out.read_text())[0]
    assert "error" not in rec, rec["error"]
    assert rec["link"] == {"name": "slow", "bytes_per_s": 1e6, "latency_s": 0.0}
    modelled = rec["bytes_per_step"] / 1e6
    assert rec["bytes_per_step"] == 4 * 65536
    assert 0.8 * modelled <= rec["comm_wait_s"] <= 1.1 * modelled


def test_named_links_are_stretched_by_the_compute_ratio():
    from hf_bdlm.planner.hardware import device_spec
    from hf_bdlm.planner.link import emulated_link

    h200 = device_spec("h200")
    link = emulated_link("h200-ib", h200.matmul_flops / 1000)  # a machine computing 1000x slower
    assert link.bytes_per_s == pytest.approx(h200.inter_node_bytes_per_s / 1000)
    assert link.latency_s == pytest.approx(h200.link_latency_s * 1000)
    assert emulated_link("h200-nvlink", h200.matmul_flops).bytes_per_s == pytest.approx(h200.intra_node_bytes_per_s)
    with pytest.raises(ValueError, match="unknown link 'nvlink'; the named links are h100-nvlink"):
        emulated_link("nvlink", 1e9)
