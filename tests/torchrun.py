"""Launch worker scripts under ``torchrun`` with the gloo backend (used by the distributed tests).

``run_torchrun`` starts one launch of one worker. A test module can instead declare its workers as ``SHARED_JOBS``
(a list of :class:`SharedJob`): tests/conftest.py then runs the jobs of every collected module in one launch per
world size (tests/distributed/shared_launch.py), and the module's fixtures read their results from
``shared_launch.folder(name, world)``: the processes' start-up (most of a small worker's time) is paid once.
``run_in_process`` runs a single-process worker inside the test process.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

import psutil

from paths import DISTRIBUTED, PYTHONPATH, ROOT


# A rank that dies of one of these signals crashed in native code (torch, gloo), not in a Python error of the worker.
_NATIVE_CRASHES = {-6: "SIGABRT", -11: "SIGSEGV", -7: "SIGBUS"}


def native_crash(stderr: str) -> str | None:
    """The signal a rank of a failed launch died of, if one crashed in native code (torchrun's failure summary lists
    each rank's ``exitcode``; the ranks it stopped itself read -15), else ``None``."""
    for code in re.findall(r"exitcode\s*:\s*(-?\d+)", stderr):
        if int(code) in _NATIVE_CRASHES:
            return _NATIVE_CRASHES[int(code)]
    return None


RUNNING: set[subprocess.Popen] = set()  # the launches under way (each leads a process group of its own)


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill a launch: the launcher and every process below it.

    torchrun's agent starts each rank in a session of its own (torch's elastic ``SubprocessHandler`` passes
    ``start_new_session=True``), so killing the launcher's process group alone leaves the ranks running, orphaned,
    on the cores the rest of the suite needs. The ranks are found as the launcher's descendants before any is killed.
    """
    try:
        ranks = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        ranks = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for rank in ranks:
        try:
            rank.kill()
        except psutil.NoSuchProcess:
            pass


def run_torchrun(script: str, nproc: int, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """Launch ``script`` on ``nproc`` processes; raise with its output if the launch fails.

    Every rank runs with ``PYTHONFAULTHANDLER=1``, so a native crash prints each thread's Python stack. A launch
    whose rank crashed in native code (no Python error) runs once more, with a warning that carries the crash's
    output. Such a crash came once in CI (a rank of dflash_worker.py at 4 processes: "terminate called without an
    active exception", no Python error) and never in 86 launches of the same worker here, 80 of them six or eight
    launches at a time on 2 cores; the second launch must pass every assertion on its own. A Python error, a
    timeout or a second crash fails.
    """
    # HF_BDLM_TEST_SESSION_PID: a shared launch ends itself when this session is killed (shared_launch.py).
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=PYTHONPATH, PYTHONFAULTHANDLER="1",
               HF_BDLM_TEST_SESSION_PID=str(os.getpid()))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--standalone", str(DISTRIBUTED / script), *args]

    def launch() -> subprocess.CompletedProcess:
        # A session of its own, so that a session ended early kills the launch and every rank (`SharedLaunches.stop`).
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                                start_new_session=True)
        RUNNING.add(proc)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.communicate()
            raise
        finally:
            RUNNING.discard(proc)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    def failure(proc: subprocess.CompletedProcess) -> str:
        return f"torchrun {script} failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"

    proc = launch()
    crash = native_crash(proc.stderr) if proc.returncode != 0 else None
    if crash is not None:
        warnings.warn(f"a rank crashed in native code ({crash}); launching {script} once more.\n{failure(proc)}",
                      stacklevel=2)
        proc = launch()
    if proc.returncode != 0:
        raise AssertionError(failure(proc))
    return proc


def in_background(world: int) -> bool:
    """Whether the shared launch of ``world`` processes runs in the background
    (:meth:`SharedLaunches.start_in_background`): at most as many processes as the machine has cores."""
    return world <= (os.cpu_count() or 1)


@dataclass(frozen=True)
class SharedJob:
    """A worker of tests/distributed/ run inside the shared launch of ``world`` processes.

    Args:
        name (`str`): the job's name, unique among the jobs of its world size.
        script (`str`): the worker file; it must take part as tests/distributed/shared_launch.py describes.
        world (`int`): the number of processes.
        args (`tuple[str, ...]`): the worker's arguments; ``{out}`` stands for the job's own folder.
        timeout (`int`): seconds the job may take (the launch's limit is its jobs' sum).
    """

    name: str
    script: str
    world: int
    args: tuple[str, ...] = ("--out", "{out}")
    timeout: int = 600


class SharedLaunches:
    """The shared launches of a test session: one per world size, started when a fixture first asks for a job of it.

    A job that fails ends its launch; the jobs after it then run in a fresh launch, so that one failure reports in
    its own tests only.
    """

    def __init__(self, jobs: list[SharedJob], root: Path):
        self.jobs = list(jobs)
        self.root = root
        self.launched: set[int] = set()
        self.errors: dict[tuple[int, str], str] = {}
        self._background: threading.Thread | None = None
        # The launcher as it is now: a test that replaces the module's run_torchrun
        # (tests/distributed/test_shared_launch.py) must not reach the session's launches running on their thread
        # meanwhile.
        self._run_torchrun = run_torchrun
        self._done: dict[int, threading.Event] = {}

    def _folder(self, job: SharedJob) -> Path:
        return self.root / f"world{job.world}" / job.name

    def _launch(self, world: int) -> None:
        pending = [j for j in self.jobs if j.world == world]
        for attempt in range(len(pending)):
            spec = self.root / f"world{world}-{attempt}.json"
            spec.parent.mkdir(parents=True, exist_ok=True)
            spec.write_text(json.dumps([dict(name=j.name, script=j.script, folder=str(self._folder(j)),
                                             args=[a.replace("{out}", str(self._folder(j))) for a in j.args])
                                        for j in pending], indent=1))
            try:
                self._run_torchrun("shared_launch.py", world, "--jobs", str(spec),
                                   timeout=sum(j.timeout for j in pending))
                return
            except (AssertionError, subprocess.TimeoutExpired) as error:
                done = [(self._folder(j) / "DONE").is_file() for j in pending]
                failed = done.index(False) if False in done else len(done) - 1
                self.errors[(world, pending[failed].name)] = (
                    f"the shared launch of {world} processes ({', '.join(j.name for j in pending)}) failed in "
                    f"{pending[failed].name!r}:\n{error}")
                pending = pending[failed + 1:]
                if not pending:
                    return

    def start_in_background(self) -> None:
        """Run the launches of at most as many processes as the machine has cores, one after the other, on a background
        thread.

        The test process runs one test at a time on one core; the launches' ranks use the other core meanwhile
        (tests/conftest.py orders the modules that read shared results last, so they rarely wait). ``folder`` waits
        for the job it needs, not for the rest of its launch; ``stop`` ends what still runs when the session ends
        early.
        """
        # A launch of more processes than cores would starve the test process and itself (measured on 2 cores with the
        # 4-process launch beside the tests: the suite 27 min, the gloo tests that ran meanwhile up to 6x slower); it
        # runs when its tests ask for it, alone.
        worlds = [w for w in dict.fromkeys(j.world for j in self.jobs) if in_background(w)]
        if not worlds or self._background is not None:
            return
        self._done = {world: threading.Event() for world in worlds}

        def run() -> None:
            for world in worlds:
                self.launched.add(world)
                try:
                    self._launch(world)
                except BaseException as error:  # reported by folder() in the tests that need this launch
                    for job in self.jobs:
                        if job.world == world:
                            self.errors.setdefault((world, job.name), f"the shared launch of {world} processes "
                                                                      f"raised {error!r}")
                finally:
                    self._done[world].set()

        self._background = threading.Thread(target=run, name="shared-launches", daemon=True)
        self._background.start()

    def stop(self) -> None:
        """Kill the launches still running (the session ended before their tests)."""
        for proc in list(RUNNING):
            _kill_group(proc)

    def folder(self, name: str, world: int) -> Path:
        """The folder of the finished job ``name`` of the ``world``-process launch (launching it first if needed)."""
        job = next((j for j in self.jobs if (j.name, j.world) == (name, world)), None)
        if job is None:
            raise KeyError(f"no shared job {name!r} of {world} processes; declare it in the module's SHARED_JOBS")
        folder = self._folder(job)
        if world in self._done:  # in the background: the job's own end (its DONE), or its launch's
            while not (folder / "DONE").is_file() and not self._done[world].wait(0.2):
                pass
        elif world not in self.launched:
            if self._background is not None:  # never beside a background launch: each measures its ranks' rate
                self._background.join()
            self.launched.add(world)
            self._launch(world)
        if not (folder / "DONE").is_file():
            raise AssertionError(self.errors.get((world, name), f"job {name!r} of {world} processes did not run"))
        return folder


def run_in_process(script: str, *args: str) -> None:
    """Run the worker ``script`` of tests/distributed/ as ``main(args)`` in this process, its environment changes
    undone.

    A worker meant for one process (a single-process reference) gives what a 1-process launch gives, without the
    launch's start-up.
    """
    folder = str(DISTRIBUTED)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    saved = dict(os.environ)
    try:
        importlib.import_module(Path(script).stem).main(list(args))
    finally:
        os.environ.clear()
        os.environ.update(saved)
