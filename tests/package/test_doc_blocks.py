"""The runnable code blocks of README.md and docs/usage.md run as printed, on the embedded model.

Marker convention: an HTML comment as the last non-blank line above a fenced ``bash`` or ``python`` block marks it
runnable:

    <!-- runnable -->                                  the block starts a chain in a fresh temporary folder
    <!-- runnable: needs out/bdlm -->                  it continues the file's previous chain (same folder, in order);
                                                       the paths must exist when it starts
    <!-- runnable: makes out/config.json; expect "UntrainedModelWarning" -->
                                                       after it: the paths exist, the text is in its output

(clauses after the colon, separated by ``;``). A chain is one test, named by its file and its blocks' fence lines. A
shell block runs with ``bash -e`` (each line must succeed), a Python block in a fresh interpreter; both in the chain's
folder, with the venv's bin first on PATH, the usual caches (``HF_BDLM_HOME``, ``HF_HOME``), ``HF_HUB_OFFLINE=1`` and
``OMP_NUM_THREADS=1`` (as conftest.py: on a busy 2-core machine a second intra-op thread saves little wall time and
doubles the CPU time); nothing else is changed. Every ``bash`` / ``python`` block of the two files is either marked or
named in ``SKIPPED`` below with the reason it cannot run here, so a new block cannot escape unnoticed; a marked block
must need no GPU, no Hub and no server, and take seconds to a minute or two on 2 CPU cores (the whole file: about 2
minutes on a quiet machine).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hf_bdlm.cache import cache_home
from paths import ROOT

FILES = ("README.md", "docs/usage.md")
LANGUAGES = ("bash", "python")
CHAIN_TIMEOUT_S = 900

# Blocks that stay unmarked: (file, the block's first line without its comment) -> why it cannot run here as
# printed.
SKIPPED = {
    ("README.md", "bash recipes/quickstart.sh"):
        "set-up, then 90 training steps (12.6 minutes cold) and the whole test suite (about 19 minutes)",
    ("docs/usage.md", "bash recipes/quickstart.sh"):
        "the README's two commands: 12.6 minutes of quickstart and the whole test suite",
    ("README.md", "from hf_bdlm import BDLMSFTConfig, BDLMSFTTrainer"):
        "a sketch of the TRL API: block_parallel_size=2 needs two processes (accelerate launch), `dataset` is the "
        "reader's, and trainer.train() runs the full default schedule",
    ("README.md", "accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml recipes/sft.py --config "
                  "recipes/configs/smollm2_cpu_csbp.yaml"):
        "the quickstart recipe's 90 training steps, twice (about 10 minutes each)",
    ("README.md", "hf-bdlm train --nproc 2 --config recipes/configs/smollm2_cpu_csbp.yaml --max_steps 20"):
        "20 training steps at 6.6 s plus held-out scoring before and after: over 3 minutes on 2 cores",
    ("docs/usage.md", "hf-bdlm train --nproc 2 --config recipes/configs/smollm2_cpu_csbp.yaml --max_steps 20"):
        "20 training steps at 6.6 s plus held-out scoring before and after: over 3 minutes on 2 cores",
    ("README.md", "hf-bdlm serve out/bdlm --port 8000"):
        "servers run until stopped (both serve lines); eval swebench runs an agent over five tasks (minutes); "
        "lm-eval's arc_easy and gsm8k come from the Hub; bench --quick takes 3 minutes idle; plan over 82 layouts at "
        "256K takes minutes; dflash init only feeds the served drafter after it",
    ("docs/usage.md", "hf-bdlm export --format sdar out/bdlm out/sdar"):
        "SDAR export needs a Qwen3 backbone converted with --objective standard and trained (the embedded model is a "
        "Llama); the server runs until stopped; eval swebench runs an agent over five tasks and bench --quick takes 3 "
        "minutes; plan over 82 layouts at 256K takes minutes",
    ("README.md", "vllm serve Qwen/Qwen3-8B --speculative-config '{\"method\": \"dflash\", \"model\": \"DIR\", "
                  "\"num_speculative_tokens\": 7}'"):
        "vLLM and SGLang need a GPU and the Hub model",
    ("README.md", "accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml recipes/sft.py --config "
                  "recipes/configs/smollm2_cpu_fast_apply.yaml"):
        "the fast-apply comparison: three recipes of up to an hour each on 2 cores, then days of decoding study",
}

_FENCE = re.compile(r"^```(\w*)\s*$")
_MARKER = re.compile(r"^<!--\s*runnable\s*(?::\s*(.*?))?\s*-->\s*$")


@dataclass
class Block:
    file: str
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    section: str  # the heading above it
    marker: str | None  # the marker's clauses ("" for a bare marker), None if unmarked
    needs: list[str] = field(default_factory=list)
    makes: list[str] = field(default_factory=list)
    expect: list[str] = field(default_factory=list)

    @property
    def first_line(self) -> str:
        """The first line of code, without a trailing ``  # comment``."""
        line = next(line for line in self.code.splitlines() if line.strip())
        return re.sub(r"\s{2,}#.*$", "", line).strip()

    @property
    def name(self) -> str:
        return f"{self.file}:{self.line}"


def _parse_clauses(block: Block) -> None:
    for clause in filter(None, (c.strip() for c in block.marker.split(";"))):
        word, _, rest = clause.partition(" ")
        values = shlex.split(rest)
        if word in ("needs", "makes", "expect") and values:
            getattr(block, word).extend(values)
        else:
            raise ValueError(f"{block.name}: unknown or empty clause {clause!r} in the runnable marker "
                             "(needs PATH..., makes PATH..., expect \"TEXT\"...).")


def parse_blocks(file: str, text: str | None = None) -> list[Block]:
    """Every fenced block of ``file`` (or of ``text``, named ``file``) with its language, opening line, heading and
    marker."""
    lines = ((ROOT / file).read_text() if text is None else text).splitlines()
    blocks, section, i = [], "", 0
    while i < len(lines):
        if lines[i].startswith("#"):
            section = lines[i].lstrip("#").strip()
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        above = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = _MARKER.match(above)
        block = Block(file, i + 1, fence.group(1), "\n".join(lines[i + 1:end]) + "\n", section,
                      (marker.group(1) or "") if marker else None)
        if marker:
            _parse_clauses(block)
        blocks.append(block)
        i = end + 1
    return blocks


def chains(blocks_of_files: list[list[Block]]) -> list[list[Block]]:
    """The marked blocks, grouped: a block with ``needs`` continues the previous chain of its file."""
    out: list[list[Block]] = []
    for blocks in blocks_of_files:
        previous = None
        for block in blocks:
            if block.marker is None:
                continue
            if block.needs:
                if previous is None:
                    raise ValueError(f"{block.name} needs {block.needs} but no marked block comes before it.")
                previous.append(block)
            else:
                previous = [block]
                out.append(previous)
    return out


def _chain_id(chain: list[Block]) -> str:
    return chain[0].file + ":" + "+".join(str(b.line) for b in chain)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
    env["HF_BDLM_HOME"] = str(cache_home())
    env["HF_HOME"] = env.get("HF_HOME") or str(Path("~/.cache/huggingface").expanduser())
    env["HF_HUB_OFFLINE"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(block: Block, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    command = ["bash", "-e", "-c", block.code] if block.language == "bash" else [sys.executable, "-c", block.code]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


CHAINS = chains([parse_blocks(file) for file in FILES])


@pytest.mark.parametrize("chain", CHAINS, ids=[_chain_id(c) for c in CHAINS])
def test_runnable_blocks_run_as_printed(chain, tmp_path):
    env, start = _env(), time.monotonic()
    for block in chain:
        for path in block.needs:
            assert (tmp_path / path).exists(), f"{block.name} needs {path}, which the blocks before it did not make"
        left = CHAIN_TIMEOUT_S - (time.monotonic() - start)
        proc = _run(block, tmp_path, env, max(left, 1))
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, (f"{block.name} ({block.first_line!r}) exited {proc.returncode}:\n"
                                      f"{output[-4000:]}")
        for text in block.expect:
            assert text in output, f"{block.name}: {text!r} not in its output:\n{output[-4000:]}"
        for path in block.makes:
            assert (tmp_path / path).exists(), f"{block.name} did not make {path}:\n{output[-2000:]}"


def test_every_block_is_marked_or_skipped_with_a_reason():
    blocks = [b for file in FILES for b in parse_blocks(file) if b.language in LANGUAGES]
    marked = [b for b in blocks if b.marker is not None]
    assert marked, "no runnable block in README.md or docs/usage.md"
    for block in marked:
        assert (block.file, block.first_line) not in SKIPPED, f"{block.name} is marked and also skipped"
    unlisted = [f"{b.name}: {b.first_line!r}" for b in blocks
                if b.marker is None and (b.file, b.first_line) not in SKIPPED]
    assert not unlisted, "blocks neither marked runnable nor in SKIPPED (with the reason):\n" + "\n".join(unlisted)
    stale = set(SKIPPED) - {(b.file, b.first_line) for b in blocks if b.marker is None}
    assert not stale, f"SKIPPED names blocks that no longer exist unmarked: {sorted(stale)}"


def test_the_readme_command_line_section_runs_or_says_why_not():
    section = [b for b in parse_blocks("README.md") if b.section == "From the command line"]
    with_cli = [b for b in section if re.search(r"^hf-bdlm ", b.code, re.M)]
    assert any(b.marker is not None for b in with_cli), "no hf-bdlm block of 'From the command line' runs"
    for block in with_cli:
        assert block.marker is not None or SKIPPED.get((block.file, block.first_line)), block.name


def test_the_marker_convention_parses_and_chains():
    text = """# T
<!-- runnable -->
```bash
echo a > a.txt   # first
```
Text.
<!-- runnable: needs a.txt; makes b.txt; expect "b made" "done" -->

```python
print("b made")
```
```bash
not run
```
<!-- runnable -->
```bash
echo c
```
"""
    blocks = parse_blocks("x.md", text)
    assert [(b.line, b.language, b.marker is not None) for b in blocks] == [
        (3, "bash", True), (9, "python", True), (12, "bash", False), (16, "bash", True)]
    assert blocks[0].first_line == "echo a > a.txt"
    assert (blocks[1].needs, blocks[1].makes, blocks[1].expect) == (["a.txt"], ["b.txt"], ["b made", "done"])
    assert [_chain_id(c) for c in chains([blocks])] == ["x.md:3+9", "x.md:16"]
    with pytest.raises(ValueError, match="unknown or empty clause 'need a.txt'"):
        parse_blocks("x.md", "<!-- runnable: need a.txt -->\n```bash\nls\n```\n")
    with pytest.raises(ValueError, match="no marked block comes before it"):
        chains([parse_blocks("x.md", "<!-- runnable: needs a.txt -->\n```bash\nls\n```\n")])
