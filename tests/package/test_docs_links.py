"""The README's and the docs' links to files of the repository name files that are committed.

Records live under ``benchmarks/results/``, which git ignores (each record is added by hand with ``git add -f``): a
record a page cites but nobody added exists on the machine that made it and nowhere else. The check reads every
markdown link of README.md, docs/ and the records' own pages and resolves the relative ones against ``git ls-files``.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path, PurePosixPath

import pytest
from paths import ROOT

LINK = re.compile(r"\]\(([^)\s]+)\)")


def _committed() -> tuple[set[str], set[str]]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as error:
        pytest.skip(f"not a git checkout ({error}): nothing to resolve the links against")
    files = set(out.split())
    folders = {str(parent) for f in files for parent in PurePosixPath(f).parents}
    return files, folders


def _pages(files: set[str]) -> list[str]:
    return ["README.md"] + sorted(f for f in files if f.endswith(".md") and f.startswith(("docs/", "benchmarks/")))


def broken_links(files: set[str], folders: set[str], read=lambda page: (ROOT / page).read_text()) -> list[str]:
    """``page -> target`` for every relative link whose target is neither a committed file nor a folder holding one."""
    broken = []
    for page in _pages(files):
        for target in LINK.findall(read(page)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL or an anchor on the same page
            path = os.path.normpath(str(PurePosixPath(page).parent / target.split("#")[0]))
            if path not in files and path not in folders:
                broken.append(f"{page} -> {target}")
    return broken


def test_every_link_of_the_readme_and_the_docs_names_a_committed_file():
    files, folders = _committed()
    assert broken_links(files, folders) == [], "commit the record (git add -f under benchmarks/results/) or fix the link"


def test_a_link_to_a_record_nobody_committed_is_found():
    pages = {"README.md": "[ok](docs/a.md), [web](https://x.org/y), [here](#z)",
             "docs/a.md": "[rec](../benchmarks/results/r/summary.md) [dir](../benchmarks/results/s/)"}
    files = {"README.md", "docs/a.md", "benchmarks/results/s/x.json"}
    folders = {str(p) for f in files for p in PurePosixPath(f).parents}
    assert broken_links(files, folders, read=pages.__getitem__) == ["docs/a.md -> ../benchmarks/results/r/summary.md"]
