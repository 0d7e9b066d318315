"""How a measurement starts its fresh processes: ``python -m hf_bdlm.benchmarks.<module>``, importing the same
``hf_bdlm`` as the process that starts it, from any working directory.

The children run in a temporary folder (the caller's ``cwd``), so a folder named ``hf_bdlm`` where the user stands
cannot shadow the package; and when this ``hf_bdlm`` is not in a site directory (a source checkout, a
``--target`` install on ``PYTHONPATH``), the folder that holds it goes first on the children's ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import site
import sys
from pathlib import Path

# The folder holding the hf_bdlm package: a site-packages directory, a --target folder or a source checkout.
PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def module_name(module: str) -> str:
    """``hf_bdlm.benchmarks.<module>``, what ``python -m`` (and ``torchrun -m``) runs."""
    return f"{__package__}.{module}"


def module_command(module: str) -> list[str]:
    """``[python, -m, hf_bdlm.benchmarks.<module>]`` with this interpreter."""
    return [sys.executable, "-m", module_name(module)]


def _site_dirs() -> set[Path]:
    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return {Path(d).resolve() for d in dirs}


def child_env(**variables: str) -> dict[str, str]:
    """This process's environment with ``variables`` set, and ``PYTHONPATH`` led by :data:`PACKAGE_ROOT` unless
    the interpreter finds the package there by itself (a site directory)."""
    env = dict(os.environ, **variables)
    if PACKAGE_ROOT not in _site_dirs():
        env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env
