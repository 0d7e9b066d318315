"""Worker of tests/models/diffusion_gemma/test_matched_recipe.py (a job of the shared launch of 2 processes): the recipe
recipes/dg_matched.py, its ``main(argv)`` run on the launch's ranks as ``torchrun ... recipes/dg_matched.py ARGS``
would run it (the trainers join the launch's process group, as Accelerate joins an existing one).

    torchrun --nproc_per_node 2 tests/distributed/dg_matched_worker.py --config recipes/configs/dg_matched_cpu.yaml ...
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch.distributed as dist

from shared_launch import leave_process_group

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def main(argv: list[str] | None = None) -> None:
    shared = dist.is_initialized()  # inside tests/distributed/shared_launch.py: its process group
    saved = dict(os.environ)
    os.environ["HF_HUB_OFFLINE"] = "1"
    if str(RECIPES) not in sys.path:
        sys.path.insert(0, str(RECIPES))
    try:
        import dg_matched

        dg_matched.main(sys.argv[1:] if argv is None else argv)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    leave_process_group(started=not shared)  # the trainer's arguments started it, or the launch


if __name__ == "__main__":
    main()
