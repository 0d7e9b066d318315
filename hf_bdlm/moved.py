"""Old module paths and where they moved: importing an old path (a documented module that moved when the package
was reorganised) gives the module at its new path, with a `DeprecationWarning` naming it. The aliases last one
release. ``hf_bdlm/__init__.py`` installs the finder (:func:`install`), so any ``import hf_bdlm.<old path>`` finds it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings


MOVED_MODULES: dict[str, str] = {
    "hf_bdlm.checkpoint_files": "hf_bdlm.checkpoints.files",
    "hf_bdlm.trainer.checkpoints": "hf_bdlm.checkpoints.atomic",
    "hf_bdlm.benchmarks.cli": "hf_bdlm.benchmarks.bench_command",
    "hf_bdlm.planner.cli": "hf_bdlm.planner.plan_command",
    "hf_bdlm.parallel.engine": "hf_bdlm.parallel.exchange",
    "hf_bdlm.parallel.link": "hf_bdlm.parallel.emulated_link",
    "hf_bdlm.benchmarks.decoding": "hf_bdlm.benchmarks.decoding_study",
    "hf_bdlm.benchmarks.planning": "hf_bdlm.benchmarks.planning_study",
    "hf_bdlm.matched_comparison": "hf_bdlm.benchmarks.matched_comparison",
}


class MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module path of :data:`MOVED_MODULES` (after the ordinary finders, which no longer find its file)
    and loads it as the module at its new path: one module object under both names."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = MOVED_MODULES[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; import it from there (the old path goes away in the next "
                      "release).", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module) -> None:
        """Nothing to run: the module at the new path is loaded already."""


def install() -> None:
    """Put the finder at the end of ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
