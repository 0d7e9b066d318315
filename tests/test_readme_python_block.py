"""The README's "From Python" block runs as printed, on the embedded model, in a fresh interpreter and an empty folder
(issue 43, item 5, for this block; the embedded model's export is cached under HF_BDLM_HOME as the quickstart's)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _from_python_block() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### From Python", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_from_python_block_runs_as_printed(tmp_path):
    block = _from_python_block()
    assert "embedded:smollm2" in block and "prompt_ids =" in block  # runnable as printed: nothing left to fill in
    check = block + "\nassert out.shape[0] == 1 and out.shape[1] > prompt_ids.shape[1], out.shape\nprint('ran')\n"
    proc = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ran")
    assert (tmp_path / "out" / "config.json").is_file() and (tmp_path / "out" / "tokenizer.json").is_file()
