"""The launches of the distributed tests (tests/torchrun.py).

Shared launches: one launch per world size runs every declared job in order, a job's folder is handed out only once
the job finished (from a launch in the background, while the jobs after it still run), and a failing job reports in
its own tests while the jobs after it run in a fresh launch (torchrun itself is replaced by a fake that plays the jobs
of a spec). A launch whose rank crashes in native code runs once more, with a warning; a second crash or a Python
error fails (real torchrun launches)."""

import json
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest

import torchrun
from torchrun import SharedJob, SharedLaunches


@pytest.fixture
def launches(monkeypatch):
    """Fake launches: each "runs" its spec's jobs in order (writing DONE), failing at a job named ``fail*``."""
    calls = []

    def fake_run_torchrun(script, nproc, *args, timeout=600):
        jobs = json.loads(Path(args[args.index("--jobs") + 1]).read_text())
        calls.append((script, nproc, [job["name"] for job in jobs], timeout))
        for job in jobs:
            if job["name"].startswith("fail"):
                raise AssertionError(f"torchrun {script} failed: Traceback ... in {job['name']}")
            assert job["args"][-1] == job["folder"]  # "{out}" became the job's own folder
            Path(job["folder"]).mkdir(parents=True)
            (Path(job["folder"]) / "DONE").touch()

    monkeypatch.setattr(torchrun, "run_torchrun", fake_run_torchrun)
    return calls


def test_one_launch_per_world_size_runs_its_jobs_in_the_declared_order(launches, tmp_path):
    jobs = [SharedJob("a", "a_worker.py", 2, timeout=60), SharedJob("b", "b_worker.py", 4),
            SharedJob("c", "c_worker.py", 2, timeout=30)]
    shared = SharedLaunches(jobs, tmp_path)
    assert shared.folder("c", 2) == tmp_path / "world2" / "c"
    assert shared.folder("a", 2) == tmp_path / "world2" / "a"
    assert launches == [("shared_launch.py", 2, ["a", "c"], 90)]  # one launch, its timeout the jobs' sum
    shared.folder("b", 4)
    assert launches[1:] == [("shared_launch.py", 4, ["b"], 600)]


def test_a_failing_job_fails_its_tests_only_and_the_jobs_after_it_run_in_a_fresh_launch(launches, tmp_path):
    jobs = [SharedJob(name, "worker.py", 2) for name in ("a", "fail_b", "c", "fail_d")]
    shared = SharedLaunches(jobs, tmp_path)
    assert shared.folder("a", 2).name == "a"
    assert shared.folder("c", 2).name == "c"
    for name in ("fail_b", "fail_d"):
        with pytest.raises(AssertionError, match=f"failed in '{name}':\ntorchrun shared_launch.py failed: .* {name}"):
            shared.folder(name, 2)
    assert [names for _, _, names, _ in launches] == [["a", "fail_b", "c", "fail_d"], ["c", "fail_d"]]


def test_a_background_launchs_job_is_handed_out_once_done_while_the_jobs_after_it_still_run(monkeypatch, tmp_path):
    release = threading.Event()

    def fake_run_torchrun(script, nproc, *args, timeout=600):
        for job in json.loads(Path(args[args.index("--jobs") + 1]).read_text()):
            if job["name"] == "b":
                assert release.wait(60)  # b runs until the test has read a
            Path(job["folder"]).mkdir(parents=True)
            (Path(job["folder"]) / "DONE").touch()

    monkeypatch.setattr(torchrun, "run_torchrun", fake_run_torchrun)
    shared = SharedLaunches([SharedJob("a", "worker.py", 1), SharedJob("b", "worker.py", 1)], tmp_path)
    shared.start_in_background()
    assert shared.folder("a", 1) == tmp_path / "world1" / "a"
    assert not (tmp_path / "world1" / "b").exists()  # the launch is still on b
    release.set()
    assert shared.folder("b", 1) == tmp_path / "world1" / "b"


def test_a_job_no_module_declared_is_refused(launches, tmp_path):
    with pytest.raises(KeyError, match="no shared job 'x' of 2 processes; declare it in the module's SHARED_JOBS"):
        SharedLaunches([SharedJob("x", "worker.py", 4)], tmp_path).folder("x", 2)
    assert launches == []


# --- a rank that crashes in native code (real torchrun launches of tests/distributed/crash_worker.py) ----------------
@pytest.mark.distributed
def test_a_native_crash_launches_once_more_with_a_warning_that_carries_the_crash(tmp_path):
    marker = tmp_path / "launches"
    with pytest.warns(UserWarning, match=r"crashed in native code \(SIGABRT\)") as caught:
        torchrun.run_torchrun("crash_worker.py", 2, "--marker", str(marker), "--mode", "abort_first_launch",
                              timeout=120)
    assert marker.read_text() == "2"
    assert "Fatal Python error: Aborted" in str(caught[0].message)  # the faulthandler's stack of the crashed rank


@pytest.mark.distributed
def test_a_second_native_crash_fails_with_the_crashed_ranks_python_stack(tmp_path):
    marker = tmp_path / "launches"
    with pytest.warns(UserWarning), pytest.raises(AssertionError, match="Fatal Python error: Aborted"):
        torchrun.run_torchrun("crash_worker.py", 2, "--marker", str(marker), "--mode", "abort_every_launch",
                              timeout=120)
    assert marker.read_text() == "2"


@pytest.mark.distributed
def test_a_python_error_fails_at_once(tmp_path):
    marker = tmp_path / "launches"
    with pytest.raises(AssertionError, match="the worker's own error"):
        torchrun.run_torchrun("crash_worker.py", 2, "--marker", str(marker), "--mode", "raise", timeout=120)
    assert marker.read_text() == "1"


@pytest.mark.distributed
def test_killing_a_launch_leaves_none_of_its_ranks_behind(tmp_path):
    # A launch past its timeout is killed; torchrun starts its ranks in sessions of their own, so this is the case where
    # killing only the launcher's process group left both ranks running for the rest of the suite.
    with pytest.raises(subprocess.TimeoutExpired):
        torchrun.run_torchrun("crash_worker.py", 2, "--marker", str(tmp_path / "launches"), "--mode", "hang", timeout=30)
    pids = [int((tmp_path / f"rank{rank}.pid").read_text()) for rank in range(2)]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.1)
    assert [pid for pid in pids if _alive(pid)] == []


def test_a_shared_launch_ends_when_its_test_session_is_killed(tmp_path):
    # A session killed without its clean-up (a CI timeout, kill -9) used to leave its shared launch computing for
    # minutes on the cores the next run needs: its ranks watch the session's pid and end the launch when it is gone.
    import os
    import sys

    from paths import DISTRIBUTED, PYTHONPATH, ROOT

    session = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    jobs = tmp_path / "jobs.json"
    jobs.write_text(json.dumps([{"name": "hang", "script": "crash_worker.py", "folder": str(tmp_path / "hang"),
                                 "args": ["--marker", str(tmp_path / "launches"), "--mode", "hang"]}]))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=PYTHONPATH, HF_BDLM_TEST_SESSION_PID=str(session.pid))
    launch = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                               str(DISTRIBUTED / "shared_launch.py"), "--jobs", str(jobs)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all((tmp_path / f"rank{r}.pid").exists() for r in range(2)):
            assert launch.poll() is None, launch.communicate()[0][-3000:]
            time.sleep(0.2)
        pids = [int((tmp_path / f"rank{r}.pid").read_text()) for r in range(2)]
        session.kill()
        session.wait()
        out, _ = launch.communicate(timeout=60)
        assert "the test session (pid" in out and launch.returncode != 0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
            time.sleep(0.1)
        assert [pid for pid in pids if _alive(pid)] == []
    finally:
        session.kill()
        torchrun._kill_group(launch)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_native_crash_reads_the_signal_from_torchruns_summary():
    summary = ("rank      : 0 (local_rank: 0)\n  exitcode  : -15 (pid: 1)  (SIGTERM)\n"
               "rank      : 3 (local_rank: 3)\n  exitcode  : -6 (pid: 2)  (SIGABRT)\n")
    assert torchrun.native_crash(summary) == "SIGABRT"
    assert torchrun.native_crash(summary.replace("-6 (pid", "1 (pid")) is None  # a Python error exits with 1
    assert torchrun.native_crash("exitcode  : -11 (pid: 2)") == "SIGSEGV"
