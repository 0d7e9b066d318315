import sys
from pathlib import Path

import pytest
import torch

# Helpers such as tests/torchrun.py, tests/paths.py and tests/fixtures.py import as top-level modules, and so do the
# workers' helpers of tests/distributed/ (trainer_common.py, ...). The test files themselves import by path
# (pyproject.toml: --import-mode=importlib), so files of the same name in two folders stay apart.
_TESTS = Path(__file__).resolve().parent
for _folder in (_TESTS / "distributed", _TESTS):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))
# Tiny models and masks: intra-op threads only add overhead (10x on a loaded 2-core machine).
torch.set_num_threads(1)

from torchrun import SharedJob, SharedLaunches, in_background  # noqa: E402

_SHARED_JOBS = pytest.StashKey[list]()


def _shared_order(module) -> int:
    """0: the module declares no shared job; 1: only jobs of launches that run in the background; 2: a job of a launch
    that runs alone, in the foreground."""
    jobs = getattr(module, "SHARED_JOBS", None) or ()
    return 0 if not jobs else 1 if all(in_background(job.world) for job in jobs) else 2


def pytest_collection_modifyitems(config, items):
    """The shared launches run the ``SHARED_JOBS`` of the modules that have a selected test, in the order the modules
    run; the modules that declare them run last (each module's tests stay together and in order), so that the launches
    run in the background while the other tests run (``shared_launch``). Of those, the modules whose jobs all run in
    the background go first: each reads its job as soon as it is done, while the launch goes on with the next; the
    first module that needs the launch that runs alone waits for the background one to end."""
    items.sort(key=lambda item: _shared_order(getattr(item, "module", None)))  # stable: the order within each group
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
