"""The package read from its source files, nothing imported: which modules it has.

Shared by tests/package/test_layering.py (the rooms, imports and module strings of the source) and
tests/package/test_installed_wheel.py (the wheel holds the same modules).
"""

from __future__ import annotations

from pathlib import Path

PACKAGE = "hf_bdlm"


def module_files(root: Path, package: str = PACKAGE) -> dict[str, tuple[Path, bool]]:
    """``{dotted name: (file, is_package)}`` of every module under ``root / package`` (folders with ``__init__.py``)."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if any(not (root.joinpath(*parts[:i]) / "__init__.py").is_file() for i in range(1, len(parts))):
            continue  # a file in package data, not a module
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return modules
