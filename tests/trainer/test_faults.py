"""A rank SIGKILLed mid-step ends the whole job promptly, naming the lost rank; resuming is exact.

tests/distributed/faults_worker.py (a job of the shared launch of 2 processes) starts each case of its ``KILLS`` as a
real torchrun launch of tests/distributed/dead_rank_worker.py (tiny models, 4 AdamW steps, a checkpoint every 2) and
kills one rank at step 3: in forward, in backward, inside an in-flight K/V all-gather, or while it writes
``checkpoint-4``; csbp at P = 2 under DDP (one family per point) and FSDP2, cp, bp, P = 4 under FSDP2, and a survivor
on a node of its own (one torchrun agent per rank). Then it resumes five of the killed runs from their last complete
checkpoint and trains the same runs uninterrupted (DDP and FSDP2; converted, DiffusionGemma, DFlash drafter).

Bounds (docs/troubleshooting.md, "Faults"; benchmarks/results/faults/dead_rank.json, two runs on the shared 2-core
machine: 1.6-7.8 s on one node, 9.5-10.4 s for the survivor on its own node, which spends 3 s reading heartbeats to
name the lost rank): every launcher exits within ``ONE_NODE_S`` / ``OWN_NODE_S`` of the kill, and no process of the
launch outlives it.
"""

import json

import pytest

from torchrun import SharedJob

pytestmark = pytest.mark.distributed

ONE_NODE_S = 20.0
OWN_NODE_S = 30.0
# FSDP2 resumes of the same layout reduce in the same order as the uninterrupted run: measured identical (0.0); the
# bound is the float32 exactness bound of tests/trainer/test_fsdp.py's resumes (relative 1e-5 of the largest weight).
FSDP2_REL = 1e-5

SHARED_JOBS = [SharedJob("faults", "faults_worker.py", 2, ("--out", "{out}"), timeout=1500)]
KILLED = ["csbp_ddp_exchange", "csbp_ddp_forward", "csbp_ddp_backward", "csbp_fsdp2_backward", "cp_ddp_exchange",
          "bp_fsdp2_save", "two_nodes_csbp_ddp_exchange", "p4_csbp_fsdp2_exchange"]
RESUMED = ["csbp_ddp_exchange", "csbp_ddp_forward", "csbp_ddp_backward", "csbp_fsdp2_backward", "bp_fsdp2_save"]


@pytest.fixture(scope="module")
def folder(shared_launch):
    return shared_launch.folder("faults", 2)


@pytest.fixture(scope="module")
def kills(folder):
    return json.loads((folder / "kills.json").read_text())


@pytest.fixture(scope="module")
def resumes(folder):
    return json.loads((folder / "resumes.json").read_text())


@pytest.mark.parametrize("case", KILLED)
def test_a_killed_rank_ends_every_process_of_the_launch_promptly(kills, case):
    result = kills[case]
    assert result["killed"] is not None, result["summaries"]  # the rank did reach its kill point
    assert all(code != 0 for code in result["returncodes"])  # every launcher reports the failure
    bound = OWN_NODE_S if result["kill"]["two_nodes"] else ONE_NODE_S
    assert max(result["seconds_to_exit"]) <= bound, result["seconds_to_exit"]
    assert result["outlived"] == []


@pytest.mark.parametrize("case", [c for c in KILLED if not c.startswith("two_nodes")])
def test_the_launcher_names_the_lost_rank_as_the_root_cause(kills, case):
    result = kills[case]
    rank = result["kill"]["rank"]
    summary = result["summaries"][0]
    assert summary.startswith("Root Cause (first observed failure)")
    assert f"rank      : {rank} (local_rank: {rank})" in summary and "(SIGKILL)" in summary, summary


def test_a_survivor_on_its_own_node_names_the_lost_rank_itself(kills):
    result = kills["two_nodes_csbp_ddp_exchange"]
    own = result["summaries"][1]  # the dead rank's node: its launcher saw its worker die
    assert "rank      : 1 (local_rank: 0)" in own and "(SIGKILL)" in own
    survivor = result["rank_errors"][-1]
    assert survivor.startswith("[rank0]: RuntimeError: rank 0: a collective failed at step 3 (")
    assert "on process group 'clean_ring[0.0]' (ranks 0, 1) failed after" in survivor
    assert "Of the 2 ranks, rank 1 stopped (no heartbeat for 3 s)" in survivor
    assert "resume from the last checkpoint" in survivor


def test_a_rank_killed_while_saving_leaves_only_complete_checkpoints(kills):
    result = kills["bp_fsdp2_save"]
    assert result["kill"]["where"] == "save" and result["kill"]["rank"] == 0  # the writer, during checkpoint-4
    assert result["checkpoints"] == [".checkpoint-4.tmp-staging", "checkpoint-2"]


@pytest.mark.parametrize("case", RESUMED)
def test_resuming_after_the_kill_reaches_the_uninterrupted_weights(kills, resumes, folder, case):
    assert kills[case]["checkpoints"][-1] == "checkpoint-2"  # what the killed run left: steps 3 and 4 are redone
    assert (folder / "killed" / case / "checkpoint-4" / "trainer_state.json").is_file()
    comparison = resumes[case]
    if kills[case]["kill"]["wrapper"] == "ddp":
        assert comparison["identical"], comparison  # float32 DDP: bit for bit
    else:
        assert comparison["max_abs_difference"] <= FSDP2_REL * comparison["max_abs_weight"], comparison
