"""Worker of tests/trainer/test_faults.py (a job of the shared launch of 2 processes): dead ranks, then exact resumes.

    torchrun --nproc_per_node 2 tests/distributed/faults_worker.py --out /tmp/f

1. Rank 0 launches every case of :data:`KILLS` as its own torchrun launch of tests/distributed/dead_rank_worker.py
   (``--at-once`` of them at a time, default 2, the other rank waiting) and records for each: the launcher's exit
   status and the seconds from the kill to its exit, its failure summary, the survivors' own last error lines, which
   of the launch's processes outlived it, and the checkpoints left. ``two_nodes`` cases start one torchrun agent per
   rank (``--nnodes 2`` on this machine), as two nodes would: the agent of the survivor does not see the dead rank,
   the survivor has to notice it itself.
2. Both ranks then run, for each case of :data:`RESUMES`, the uninterrupted run and the resume of the killed run from
   its last complete checkpoint, on the same layout; rank 0 writes ``OUT/<case>/{resumed,uninterrupted}`` weights.

Results: ``OUT/kills.json`` (rank 0).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dead_rank_worker import train  # noqa: E402
from paths import DISTRIBUTED, PYTHONPATH, ROOT  # noqa: E402

WORKER = DISTRIBUTED / "dead_rank_worker.py"


@dataclass(frozen=True)
class Kill:
    name: str
    family: str = "converted"
    mode: str = "csbp"
    wrapper: str = "ddp"
    where: str = "exchange"
    world: int = 2
    rank: int = 1
    step: int = 3
    two_nodes: bool = False


# Each launch costs its processes' start-up (about 15 s of 2 cores), so the cases are chosen, not multiplied out. On
# one node the launcher's agent ends every rank once it sees one die, wherever that rank died: the time to exit
# depends on the agent, not on the mode or the point. So: csbp at P = 2 with DDP at each point (a family each) and
# FSDP2 in backward; cp inside the exchange and bp during a save (rank 0, the writer, killed); the survivor on its own
# (two agents, as two nodes: it must notice the dead peer itself); P = 4: csbp under FSDP2 inside the exchange.
KILLS = [
    Kill("csbp_ddp_exchange"),
    Kill("csbp_ddp_forward", family="diffusion_gemma", where="forward"),
    Kill("csbp_ddp_backward", family="dflash", where="backward"),
    Kill("csbp_fsdp2_backward", wrapper="fsdp2", where="backward"),
    Kill("cp_ddp_exchange", mode="cp", rank=0),
    Kill("bp_fsdp2_save", mode="bp", wrapper="fsdp2", where="save", rank=0, step=4),
    Kill("two_nodes_csbp_ddp_exchange", two_nodes=True),
    Kill("p4_csbp_fsdp2_exchange", wrapper="fsdp2", world=4, rank=2),
]
# Resumed after the kill and compared with the uninterrupted run: DDP and FSDP2, every family, the killed save.
RESUMES = ["csbp_ddp_exchange", "csbp_fsdp2_backward", "csbp_ddp_forward", "csbp_ddp_backward", "bp_fsdp2_save"]
LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
              "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _env() -> dict:
    """This process's environment without what its own launcher set (the nested launches set their own)."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCH_ENV and not k.startswith(("TORCHELASTIC_", "PET_", "TORCH_ELASTIC"))}
    return dict(env, OMP_NUM_THREADS="1", PYTHONPATH=PYTHONPATH, HF_HUB_OFFLINE="1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def _worker_args(kill: Kill, out: Path, features: Path) -> list[str]:
    return [str(WORKER), "--out", str(out), "--family", kill.family, "--mode", kill.mode, "--wrapper", kill.wrapper,
            "--features", str(features), "--where", kill.where, "--kill-rank", str(kill.rank), "--kill-step",
            str(kill.step)]


def launch(kill: Kill, out: Path, features: Path, timeout: float = 300) -> dict:
    """Run one killed launch; what it did, as seen from outside."""
    run = [sys.executable, "-m", "torch.distributed.run"]
    if kill.two_nodes:
        port = _free_port()
        commands = [run + ["--nnodes", str(kill.world), "--node-rank", str(n), "--nproc_per_node", "1",
                           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", kill.name,
                           *_worker_args(kill, out, features)] for n in range(kill.world)]
    else:
        commands = [run + ["--nproc_per_node", str(kill.world), "--standalone", *_worker_args(kill, out, features)]]
    start = time.time()
    procs = []
    for command in commands:
        procs.append(subprocess.Popen(command, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
        if kill.two_nodes and len(procs) == 1:
            _wait_listening(port)  # the first node's agent hosts the store, as the first node of a cluster does
    logs, ended = [], []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=max(1.0, start + timeout - time.time()))[0])
        except subprocess.TimeoutExpired:
            proc.kill()
            logs.append(proc.communicate()[0] + "\n[killed by faults_worker: the launch hung]")
        ended.append(time.time())
    for i, log in enumerate(logs):
        (out / f"launcher.{i}.log").write_text(log)
    killed = json.loads((out / "killed.json").read_text()) if (out / "killed.json").is_file() else None
    pids = {int(p.name.split(".")[1]): int(p.read_text()) for p in out.glob("pid.*")}
    return {
        "kill": asdict(kill),
        "returncodes": [p.returncode for p in procs],
        "killed": killed,
        # Per launcher (one, or one per node): seconds from the kill to its exit.
        "seconds_to_exit": [round(t - killed["time"], 2) for t in ended] if killed else None,
        "startup_seconds": round(killed["time"] - start, 1) if killed else None,
        "outlived": [r for r, pid in pids.items() if _alive(pid)],
        "checkpoints": sorted(p.name for p in out.iterdir() if "checkpoint" in p.name),
        # What each launcher printed last: its failure summary; and the ranks' own final error lines.
        "summaries": [log[log.rfind("Root Cause"):] if "Root Cause" in log else log[-1500:] for log in logs],
        "rank_errors": [line for log in logs for line in log.splitlines()
                        if re.match(r"\[rank\d+\]: [\w.]*(Error|Exception|Timeout)\b", line)],
    }


def _wait_listening(port: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)


def compare(resumed: Path, uninterrupted: Path) -> dict:
    """The resumed run's final weights against the uninterrupted run's."""
    import torch

    a, b = torch.load(resumed), torch.load(uninterrupted)
    if a.keys() != b.keys():
        return {"error": f"different parameters: {sorted(set(a) ^ set(b))[:4]}"}
    return {"parameters": len(a), "identical": all(torch.equal(a[k], b[k]) for k in a),
            "max_abs_difference": max((a[k] - b[k]).abs().max().item() for k in a),
            "max_abs_weight": max(b[k].abs().max().item() for k in b)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", nargs="*", default=None, help="names of KILLS to run (default: all)")
    parser.add_argument("--record", default=None, help="also write the time-to-exit table (JSON) here")
    parser.add_argument("--at-once", type=int, default=2,
                        help="killed launches running at the same time (benchmarks/results/faults/dead_rank.json: 1)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo")
    kills = [k for k in KILLS if args.only is None or k.name in args.only]
    features = out / "features"
    if dist.get_rank() == 0:
        from dflash_trainer_worker import capture

        capture(out)  # the drafter's data, once
        # Two at a time: a launch spends much of its time in rendezvous, in the agent's polling and, on its own node,
        # in the survivor's heartbeat reads; what one kill measures (seconds from the kill to the exit) is bounded in
        # tests/trainer/test_faults.py with room for a neighbour's start-up.
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.at_once) as pool:
            done = pool.map(lambda k: launch(k, out / "killed" / k.name, features), kills)
            results = {k.name: result for k, result in zip(kills, done)}
        (out / "kills.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    by_name = {k.name: k for k in kills}
    resumed = [n for n in RESUMES if n in by_name]
    for name in resumed:
        kill = by_name[name]
        train(kill.family, out / "killed" / name, kill.mode, kill.wrapper, str(features), resume=True)
        train(kill.family, out / "uninterrupted" / name, kill.mode, kill.wrapper, str(features))
    dist.barrier()
    if dist.get_rank() == 0:
        comparison = {name: compare(out / "killed" / name / "final_weights.pt",
                                    out / "uninterrupted" / name / "final_weights.pt") for name in resumed}
        (out / "resumes.json").write_text(json.dumps(comparison, indent=1))
        if args.record:
            keep = ("kill", "returncodes", "seconds_to_exit", "startup_seconds", "outlived", "checkpoints",
                    "rank_errors")
            Path(args.record).write_text(json.dumps(
                {"kills": {name: {k: r[k] for k in keep} for name, r in results.items()}, "resumes": comparison},
                indent=1))
    if started:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
