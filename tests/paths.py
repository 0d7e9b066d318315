"""Where the tests find the repository's files.

The test files sit in folders that mirror the package (tests/attention/, tests/models/dflash/, ...), at different
depths; each names the repository's folders through these constants, never through its own ``__file__``, so that a
test file can move without its paths breaking. The torchrun workers and their helpers stay in one folder,
:data:`DISTRIBUTED`, which tests/conftest.py puts on ``sys.path`` (with this folder) for the tests that import them.
"""

import os
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent  # the repository
DISTRIBUTED = TESTS / "distributed"  # the torchrun workers and the helpers they share with the tests
DATA = TESTS / "data"  # the tests' data files (lm-eval tasks, planner records)
LM_EVAL_TASKS = DATA / "lm_eval_tasks"
# The import path of every process a test launches (torchrun, accelerate launch): the checkout (hf_bdlm, recipes/) and
# tests/ (fixtures.py, paths.py; a worker's own folder, tests/distributed/, is on its path as the script's folder).
PYTHONPATH = os.pathsep.join([str(ROOT), str(TESTS)])
