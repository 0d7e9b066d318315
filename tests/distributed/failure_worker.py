"""Worker for tests/test_parallel_failures.py: disagreeing plans and hung collectives fail clearly.

    torchrun --nproc_per_node 2 tests/distributed/failure_worker.py --case disagree --out /tmp/f.json
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from hf_bdlm.attention.masks import MaskRule
from hf_bdlm.parallel.collectives import ByteMeter, CollectiveTimeout, start_gather
from hf_bdlm.parallel.plan import ParallelDims, PlanConfig
from hf_bdlm.parallel.groups import BlockParallelGroups
from hf_bdlm.parallel.sharded import ShardedLayout


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=["disagree", "timeout"], required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # A short timeout only where a peer is meant to hang; the agreement check must not race slow starters.
    timeout = timedelta(seconds=3 if args.case == "timeout" else 60)
    groups = BlockParallelGroups.create(2, 2, ByteMeter(), timeout=timeout)
    error = None
    if args.case == "disagree":
        seq_len = 64 if rank == 0 else 128  # rank 1 got a different batch
        try:
            ShardedLayout.build(PlanConfig(ParallelDims(2, mode="csbp"), seq_len=seq_len, block_size=4), groups,
                                MaskRule(4))
        except ValueError as err:
            error = str(err)
    else:
        groups.ring.meter.step = 5
        if rank == 0:  # rank 1 never joins the all-gather
            try:
                start_gather(torch.zeros(1, 1, 4, 2), groups.ring, "k").wait()
            except CollectiveTimeout as err:
                error = str(err)
        else:
            import time

            time.sleep(8)
    with open(f"{args.out}.{rank}", "w") as f:
        json.dump({"rank": rank, "error": error}, f)
    if args.case == "disagree":
        dist.barrier()  # both ranks have written their error
    # After a timed-out collective the group holds work that can never finish; tearing it down (even implicitly at
    # interpreter exit) may abort inside gloo. Teardown after the disagreement aborted there too, about once in a few
    # hundred runs ("terminate called without an active exception" in rank 0). The errors are what these cases
    # check; a real job stops here, so do we.
    os._exit(0)


if __name__ == "__main__":
    main()
