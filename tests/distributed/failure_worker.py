"""Worker for tests/parallel/test_failures.py: disagreeing plans and hung collectives fail clearly.

    torchrun --nproc_per_node 2 tests/distributed/failure_worker.py --out /tmp/f

The cases run in one launch, in this order: ``disagree`` (the ranks build plans of different sequence lengths; each
writes the error it raised to ``OUT.disagree.<rank>``), ``mesh_timeouts`` (the timeout of each group of a mesh built
with a 7 s timeout, to ``OUT.mesh_timeouts.<rank>``), then ``timeout`` (rank 0 starts an all-gather that rank 1
never joins, on groups with a 3 s timeout; rank 0 writes the timeout's message to ``OUT.timeout.0``, rank 1 waits for
that file, so that it is alive, not gone, while rank 0 waits).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from hf_bdlm.attention.masks import MaskRule
from hf_bdlm.parallel.collectives import ByteMeter, CollectiveTimeout, start_gather
from hf_bdlm.parallel.plan import ParallelDims, PlanConfig
from hf_bdlm.parallel.groups import BlockParallelGroups
from hf_bdlm.parallel.sharded import ShardedLayout


def write(out: str, case: str, rank: int, error: str | None) -> None:
    path = Path(f"{out}.{case}.{rank}")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"rank": rank, "error": error}))
    tmp.rename(path)  # whole or absent: rank 1 reads rank 0's file as soon as it exists


def disagree(out: str, rank: int) -> None:
    # The agreement check must not race slow starters: a generous timeout.
    groups = BlockParallelGroups.create(2, 2, ByteMeter(), timeout=timedelta(seconds=60))
    seq_len = 64 if rank == 0 else 128  # rank 1 got a different batch
    error = None
    try:
        ShardedLayout.build(PlanConfig(ParallelDims(2, mode="csbp"), seq_len=seq_len, block_size=4), groups,
                            MaskRule(4))
    except ValueError as err:
        error = str(err)
    write(out, "disagree", rank, error)
    dist.barrier()  # both ranks have written their error


def mesh_timeouts(out: str, rank: int) -> None:
    # Groups smaller than the world are new groups (DeviceMesh would give them torch's 30-minute default); a dim that
    # spans the world is the default group, with its own timeout.
    groups = BlockParallelGroups.create(2, 2, ByteMeter(), timeout=timedelta(seconds=7))
    dims = {}
    for name in ("dp", "ring", "clean_ring", "tp"):
        group = groups.mesh.get_group(name)
        dims[name] = {"size": group.size(), "is_default_group": group is dist.group.WORLD,
                      "timeout_s": group._get_backend(torch.device("cpu")).options._timeout.total_seconds()}
    default = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    path = Path(f"{out}.mesh_timeouts.{rank}")
    path.write_text(json.dumps({"dims": dims, "default_group_timeout_s": default}))
    dist.barrier()


def timeout(out: str, rank: int) -> None:
    # A short timeout only where a peer is meant to hang.
    groups = BlockParallelGroups.create(2, 2, ByteMeter(), timeout=timedelta(seconds=3))
    groups.ring.meter.step = 5
    if rank == 0:  # rank 1 never joins the all-gather
        error = None
        try:
            start_gather(torch.zeros(1, 1, 4, 2), groups.ring, "k").wait()
        except CollectiveTimeout as err:
            error = str(err)
        write(out, "timeout", rank, error)
    else:
        deadline = time.monotonic() + 60
        while not Path(f"{out}.timeout.0").exists() and time.monotonic() < deadline:
            time.sleep(0.05)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    disagree(args.out, rank)
    mesh_timeouts(args.out, rank)
    timeout(args.out, rank)
    # After a timed-out collective the group holds work that can never finish; tearing it down (even implicitly at
    # interpreter exit) may abort inside gloo. Teardown after the disagreement aborted there too, about once in a few
    # hundred runs ("terminate called without an active exception" in rank 0). The errors are what these cases
    # check; a real job stops here, so do we.
    os._exit(0)


if __name__ == "__main__":
    main()
