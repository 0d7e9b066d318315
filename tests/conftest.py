import sys
from pathlib import Path

import pytest
import torch

# Helpers such as tests/torchrun.py import as top-level modules.
sys.path.insert(0, str(Path(__file__).resolve().parent))
# Tiny models and masks: intra-op threads only add overhead (10x on a loaded 2-core machine).
torch.set_num_threads(1)

from torchrun import SharedJob, SharedLaunches  # noqa: E402

_SHARED_JOBS = pytest.StashKey[list]()


def pytest_collection_modifyitems(config, items):
    """The shared launches run the ``SHARED_JOBS`` of the modules that have a selected test, in collection order."""
    jobs: dict[tuple[int, str], SharedJob] = {}
    for module in dict.fromkeys(item.module for item in items if getattr(item, "module", None)):
        for job in getattr(module, "SHARED_JOBS", ()):
            if jobs.setdefault((job.world, job.name), job) != job:
                raise pytest.UsageError(f"two modules declare different shared jobs named {job.name!r}")
    config.stash[_SHARED_JOBS] = list(jobs.values())


@pytest.fixture(scope="session")
def shared_launch(request, tmp_path_factory) -> SharedLaunches:
    return SharedLaunches(request.config.stash.get(_SHARED_JOBS, []), tmp_path_factory.mktemp("shared_launch"))
