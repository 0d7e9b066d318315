"""The emulated link (hf_bdlm.parallel.emulated_link): a transfer through it takes the modelled time (latency + bytes /
bandwidth) within 10 %, transfers share the link, overlap with computation is real, and the data is unchanged; a bf16
cluster's link charges 2 bytes per element of the float32 moved here; a named link is stretched by the compute rate
the launch's ranks measure at once (shared cores included), so that its time relative to compute is the cluster's."""

import json

import pytest

from hf_bdlm.parallel.emulated_link import LinkModel
from torchrun import SharedJob

SHARED_JOBS = [SharedJob("link", "link_worker.py", 2, ("--out", "{out}/link.json"), timeout=300),
               SharedJob("link_shared_cores", "link_worker.py", 4, ("--scenario", "shared_cores", "--out",
                                                                   "{out}/shared_cores.json"), timeout=300)]


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
def test_a_bf16_clusters_link_charges_two_bytes_per_element_of_the_float32_moved_here(shared_launch):
    for rank in json.loads((shared_launch.folder("link", 2) / "link.json").read_text()):
        moved, charged = rank["cluster_bytes"]
        assert moved == 2 * rank["bytes"] and charged == rank["bytes"]  # twice the float32 rows, at 2 bytes each
        assert rank["cluster_s"] == pytest.approx(rank["cluster_model_s"], rel=0.10)  # 5 ms + 4.0 MB / 50 MB/s


@pytest.mark.distributed
def test_a_named_link_keeps_the_clusters_communication_to_compute_ratio_on_shared_cores(shared_launch):
    """Four ranks on this machine's cores (two here, each rank then gets half a core or less): the rate that stretches
    the link is what each rank computes at while all compute, so a matmul workload and a bare gather take, relative
    to each other, what they would on the cluster. A rate measured by one process alone would leave the workload
    about twice its modelled time here. The rate is the pace of equal work on every rank (what a group meeting at
    collectives keeps), and the workload is timed the same way; each is the fastest of 3 rounds (other jobs only slow
    a window down). Measured in three runs on 2 idle cores: the gather +0.1 % to +0.2 %; the workload -7 % to +8 %
    of what the rate predicts; the gather over the workload 0.94-1.09x the cluster's ratio; the shared rate
    0.43-0.48x the rate of one process alone. (The slowest rank's median run, the rule before, once left a CI
    workload 1.8x faster than its rate predicted.)"""
    ranks = json.loads((shared_launch.folder("link_shared_cores", 4) / "shared_cores.json").read_text())
    rate = ranks[0]["rate"]
    assert rate["processes"] == len(rate["per_rank"]) == 4 and rate["flops_per_s"] == min(rate["per_rank"])
    assert rate["processes_per_core"] == pytest.approx(4 / rate["cores"])
    if rate["cores"] < 4:  # sharing cores slows every rank, and the rate says so
        assert rate["flops_per_s"] < 0.85 * ranks[0]["alone"]
    for rank in ranks:
        link = rank["link"]
        assert link["compute_rate"] == rate and link["element_bytes"] == 2 and link["cluster_dtype"] == "bfloat16"
        assert link["scale"] == pytest.approx(link["gpu_matmul_flops"] / rate["flops_per_s"])
        moved, charged = rank["bytes"]
        assert charged * 2 == moved == 3 * 2 * 2048 * 32 * 4  # three peers' float32 rows, charged at 2 bytes
        assert rank["transfer_s"] == pytest.approx(rank["transfer_model_s"], rel=0.10)
        assert rank["workload_s"] == pytest.approx(rank["workload_model_s"], rel=0.30)
        # Hence the gather's time over the workload's is the cluster's (the link's scale is F_gpu / F_cpu).
        emulated = rank["transfer_s"] / rank["workload_s"]
        assert emulated == pytest.approx(rank["cluster_transfer_s"] / rank["cluster_workload_s"], rel=0.30)


@pytest.mark.distributed
def test_the_modes_benchmark_runs_through_the_link_and_records_it(tmp_path):
    """csbp at P = 2, L = 512, 1 layer through a 1 MB/s link: its 256 KiB of K/V (gathers and dK/dV returns) take
    0.26 s, of which the rank's own attention hides a little, more when other jobs slow the rank (measured: 0.249 s
    waited, one step on an idle machine; 0.206 s, the median of 3 steps under load 8). Without the link the waits are
    milliseconds. The benchmark's driver runs in this process; the measurement is its own torchrun launch."""
    from hf_bdlm.benchmarks import parallel_modes

    out = tmp_path / "modes.json"
    parallel_modes.main(["--lengths", "512", "--nprocs", "2", "--modes", "csbp", "--transports", "allgather",
                         "--no-single", "--layers", "1", "--steps", "3", "--link-bytes-per-s", "1e6", "--link-name",
                         "slow", "--out", str(out)])
    rec = json.loads(out.read_text())[0]
    assert "error" not in rec, rec["error"]
    assert rec["link"] == {"name": "slow", "bytes_per_s": 1e6, "latency_s": 0.0, "element_bytes": None}
    modelled = rec["bytes_per_step"] / 1e6
    assert rec["bytes_per_step"] == rec["wire_bytes_per_step"] == 4 * 65536
    assert 0.7 * modelled <= rec["comm_wait_s"] <= 1.1 * modelled
    assert len(rec["step_times"]) == 3 and rec["step_spread"]["low"] <= rec["step_s"] <= rec["step_spread"]["high"]


def test_named_links_are_stretched_by_the_compute_ratio():
    from hf_bdlm.planner.hardware import device_spec
    from hf_bdlm.planner.link import emulated_link

    h200 = device_spec("h200")
    link = emulated_link("h200-ib", h200.matmul_flops / 1000)  # a machine computing 1000x slower
    assert link.bytes_per_s == pytest.approx(h200.inter_node_bytes_per_s / 1000)
    assert link.latency_s == pytest.approx(h200.link_latency_s * 1000)
    # The cluster trains in bf16: the link charges 2 bytes per element whatever the run here moves.
    assert link.element_bytes == 2 and link.details["cluster_dtype"] == "bfloat16"
    assert link.wire_bytes(4000, 4) == 2000 and link.wire_bytes(2000, 2) == 2000
    assert link.as_record()["scale"] == pytest.approx(1000)
    assert emulated_link("h200-nvlink", h200.matmul_flops).bytes_per_s == pytest.approx(h200.intra_node_bytes_per_s)
    with pytest.raises(ValueError, match="unknown link 'nvlink'; the named links are h100-nvlink"):
        emulated_link("nvlink", 1e9)


def test_a_link_without_its_own_element_size_charges_the_bytes_moved():
    link = LinkModel(bytes_per_s=1e6)
    assert link.wire_bytes(4000, 4) == 4000
    with pytest.raises(ValueError, match="element_bytes is the size of one element"):
        LinkModel(bytes_per_s=1e6, element_bytes=3)
    with pytest.raises(ValueError, match="not whole elements"):
        LinkModel(bytes_per_s=1e6, element_bytes=2).wire_bytes(6, 4)


def test_the_rate_of_a_process_alone_is_measured_and_recorded():
    """One process, no group: the rate of its matmul runs, with what the records need to judge it."""
    from hf_bdlm.benchmarks.calibrate import benchmark_model
    from hf_bdlm.planner.link import emulated_link
    from hf_bdlm.planner.rank_rate import measure_rank_rate

    rate = measure_rank_rate(benchmark_model(2), window_s=0.3)
    assert rate.processes == 1 and rate.per_rank == (rate.flops_per_s,) and rate.runs >= 1
    assert rate.dtype == "float32" and rate.processes_per_core == pytest.approx(rate.threads / rate.cores)
    record = emulated_link("h100-nvlink", rate).as_record()
    assert record["compute_rate"]["flops_per_s"] == rate.flops_per_s and "method" in record["compute_rate"]
    with pytest.raises(ValueError, match="window_s must be positive"):
        measure_rank_rate(benchmark_model(2), window_s=0)
