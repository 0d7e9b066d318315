"""One torchrun launch that runs several workers of tests/distributed/ in turn (the processes start once).

    torchrun --nproc_per_node 2 tests/distributed/shared_launch.py --jobs /tmp/jobs.json

Starting a launch costs its processes' imports of torch, transformers and hf_bdlm: about 11 s for 2 processes and
20 s for 4 on a 2-core machine, more than most workers' own cases. tests/conftest.py gathers the jobs that the
collected test modules declare (``SHARED_JOBS``, see tests/torchrun.py) and starts one launch per world size; this
script runs them in the listed order, each as ``<worker>.main(args)`` under the launch's default process group, and
writes ``<folder>/DONE`` after each job that finished on every rank. A job that raises ends the launch as it would
have ended its own (torchrun stops every rank); its tests report the error and the jobs after it run in a fresh
launch (tests/torchrun.py).

A worker takes part by accepting ``main(argv)`` and by joining the default process group through
:func:`join_process_group` / :func:`leave_process_group` (trainer workers: Accelerate joins an existing group).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist


def join_process_group(backend: str = "gloo") -> bool:
    """Join the default process group, starting it if this process has none yet (a worker launched alone).

    Returns:
        `bool`: True if this call started the group (the caller then ends it with :func:`leave_process_group`).
    """
    if dist.is_initialized():
        return False
    dist.init_process_group(backend)
    return True


def leave_process_group(started: bool) -> None:
    """Wait for every rank; end the default process group if :func:`join_process_group` started it."""
    if dist.is_initialized():
        dist.barrier()
        if started:
            dist.destroy_process_group()


def record_rank_result(out: Path, prefix: str, run: Callable[[], dict]) -> dict:
    """Run ``run`` and write what it returns to ``out/<prefix>rank<r>.json`` (``r``: this process's rank, 0 without a
    process group); if it raises, the file holds ``{"error": traceback}`` for the test to report, and the error
    propagates (the launch ends as it would without this call)."""
    try:
        result = run()
    except Exception:
        result = {"error": traceback.format_exc()}
        raise
    finally:
        rank = dist.get_rank() if dist.is_initialized() else 0
        (out / f"{prefix}rank{rank}.json").write_text(json.dumps(result, indent=1))
    return result


# The pid of the test session that started the launch (tests/torchrun.py sets it): a session killed without its
# clean-up (a CI timeout, kill -9) must not leave the launch computing on the cores the next run needs.
SESSION_PID_ENV = "HF_BDLM_TEST_SESSION_PID"


def end_with_the_session(poll_s: float = 2.0) -> None:
    """Exit this rank (and so the launch: torchrun stops the others) once the test session that started it is gone."""
    pid = int(os.environ.get(SESSION_PID_ENV, "0"))
    if pid <= 0:
        return

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                print(f"[shared launch] the test session (pid {pid}) is gone: ending the launch", flush=True)
                os._exit(3)

    threading.Thread(target=watch, name="session-watch", daemon=True).start()


def main() -> None:
    end_with_the_session()
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", required=True, help="JSON list of {name, script, args, folder}")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for job in json.loads(Path(args.jobs).read_text()):
        start, cpu = time.perf_counter(), time.process_time()
        Path(job["folder"]).mkdir(parents=True, exist_ok=True)
        importlib.import_module(Path(job["script"]).stem).main(job["args"])
        torch.set_num_threads(1)  # as every worker sets it: a job may not change it for the next
        cpu_s = [None] * dist.get_world_size()
        dist.all_gather_object(cpu_s, time.process_time() - cpu)
        line = (f"{job['name']}: {time.perf_counter() - start:.1f} s, CPU {sum(cpu_s):.1f} s over the ranks, "
                f"{threading.active_count()} threads on rank 0")
        if rank == 0:
            (Path(job["folder"]) / "DONE").write_text(line + "\n")
            print(f"[shared launch, {dist.get_world_size()} processes] {line}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
