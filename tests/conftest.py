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
    """The shared launches run the ``SHARED_JOBS`` of the modules that have a selected test, in collection order; the
    modules that declare them run last (each module's tests stay together and in order), so that the launches run in
    the background while the other tests run (``shared_launch``)."""
    declares = {item.module for item in items if getattr(getattr(item, "module", None), "SHARED_JOBS", None)}
    items.sort(key=lambda item: getattr(item, "module", None) in declares)  # stable: the order within each group
    jobs: dict[tuple[int, str], SharedJob] = {}
    for module in dict.fromkeys(item.module for item in items if getattr(item, "module", None)):
        for job in getattr(module, "SHARED_JOBS", ()):
            if jobs.setdefault((job.world, job.name), job) != job:
                raise pytest.UsageError(f"two modules declare different shared jobs named {job.name!r}")
    config.stash[_SHARED_JOBS] = list(jobs.values())


@pytest.fixture(scope="session", autouse=True)
def shared_launch(request, tmp_path_factory) -> SharedLaunches:
    """The session's shared launches, started in the background before the first test (they take minutes; most tests
    need none of them) and killed if the session ends before their tests ran."""
    launches = SharedLaunches(request.config.stash.get(_SHARED_JOBS, []), tmp_path_factory.mktemp("shared_launch"))
    launches.start_in_background()
    yield launches
    launches.stop()
