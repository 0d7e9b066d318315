"""First use of the project's cache (``hf_bdlm.cache``) by several processes at once, and after a killed writer.

The way a newcomer meets it: an empty ``$HF_BDLM_HOME``, every rank of a launch asking for the embedded model at the
same moment. One process exports, the others wait and load the same files; nothing temporary is left behind; an
export killed half way is rebuilt by the next start.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from embedded_model import needs_embedded_model
import pytest

from hf_bdlm.cache import _umask, install_dir, leftovers, update_json
from paths import ROOT


# Each process: the default model's folder (exporting it if needed), loaded, and a digest of all its weights.
LOAD_AND_DIGEST = """
import hashlib, json
from transformers import AutoModelForCausalLM
from hf_bdlm.embedded import default_model_dir
path = default_model_dir()
model = AutoModelForCausalLM.from_pretrained(path)
digest = hashlib.sha256()
for name, tensor in sorted(model.state_dict().items()):
    digest.update(name.encode()); digest.update(tensor.numpy().tobytes())
print(json.dumps({"path": str(path), "sha256": digest.hexdigest()}))
"""
EXPORT_LINE = "One-time export of the embedded SmolLM2-135M-Instruct"


def _env(home: Path) -> dict:
    return dict(os.environ, HF_BDLM_HOME=str(home), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))


def _start(home: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", LOAD_AND_DIGEST], env=_env(home), cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1]), err


def _entries(home: Path) -> list[str]:
    """What the cache root holds, lock files aside."""
    return sorted(p.name for p in home.iterdir() if not p.name.endswith(".lock"))


# ---- the cache's own contract, on a cheap entry ------------------------------------------------------------------


def _slow_install(root: str, counter: str) -> str:
    def build(tmp: Path) -> None:
        with open(counter, "a") as f:
            f.write("built\n")
        time.sleep(0.5)  # long enough that every other process arrives while this one builds
        (tmp / "part.txt").write_text("first half")
        (tmp / "done.txt").write_text("second half")

    path, _ = install_dir(Path(root) / "entry", build, lambda p: (p / "done.txt").is_file())
    return (path / "part.txt").read_text()


def test_install_dir_builds_once_for_processes_starting_together(tmp_path):
    counter = tmp_path / "builds.txt"
    with multiprocessing.get_context("fork").Pool(4) as pool:
        reads = pool.starmap(_slow_install, [(str(tmp_path / "home"), str(counter))] * 4)
    assert reads == ["first half"] * 4
    assert counter.read_text() == "built\n"
    assert _entries(tmp_path / "home") == ["entry"]


def test_install_dir_replaces_an_interrupted_build_and_its_leftovers(tmp_path):
    entry = tmp_path / "entry"
    entry.mkdir()
    (entry / "part.txt").write_text("stale")  # an incomplete entry (no done.txt)
    (tmp_path / ".entry.tmp-killed").mkdir()  # what a killed writer leaves
    assert leftovers(entry) == [tmp_path / ".entry.tmp-killed"]

    def build(tmp):
        (tmp / "part.txt").write_text("new")
        (tmp / "done.txt").write_text("")

    path, built = install_dir(entry, build, lambda p: (p / "done.txt").is_file())
    assert built and (path / "part.txt").read_text() == "new"
    assert path.stat().st_mode & 0o777 == 0o777 & ~_umask()  # an ordinary folder, not mkdtemp's private one
    assert _entries(tmp_path) == ["entry"]
    assert install_dir(entry, build, lambda p: (p / "done.txt").is_file()) == (entry, False)


def test_install_dir_leaves_nothing_when_the_build_fails(tmp_path):
    def build(tmp):
        (tmp / "part.txt").write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        install_dir(tmp_path / "entry", build, lambda p: (p / "done.txt").is_file())
    assert _entries(tmp_path) == []


def test_install_dir_refuses_a_build_that_does_not_complete_the_entry(tmp_path):
    with pytest.raises(RuntimeError, match="incomplete folder"):
        install_dir(tmp_path / "entry", lambda tmp: (tmp / "part.txt").write_text(""), lambda p: (p / "x").is_file())
    assert _entries(tmp_path) == []


def _add_key(path: str, key: str) -> None:
    update_json(path, lambda content: {**content, key: True})


def test_update_json_keeps_every_concurrent_writer(tmp_path):
    path = tmp_path / "rates.json"
    with multiprocessing.get_context("fork").Pool(4) as pool:
        pool.starmap(_add_key, [(str(path), f"k{i}") for i in range(8)])
    assert json.loads(path.read_text()) == {f"k{i}": True for i in range(8)}
    assert _entries(tmp_path) == ["rates.json"]


# ---- the embedded model, as the ranks of a launch meet it ------------------------------------------------------


@pytest.mark.slow
@needs_embedded_model
def test_four_processes_on_an_empty_home_export_once_and_load_the_same_model(tmp_path):
    home = tmp_path / "empty_home"  # not even created: HF_BDLM_HOME may point at a missing folder
    procs = [_start(home) for _ in range(4)]
    results = [_finish(proc) for proc in procs]
    assert sum(err.count(EXPORT_LINE) for _, err in results) == 1, [err[-2000:] for _, err in results]
    assert len({json.dumps(result, sort_keys=True) for result, _ in results}) == 1
    assert results[0][0]["path"] == str(home / "smollm2-135m-instruct")
    assert _entries(home) == ["smollm2-135m-instruct"]  # no temporary folder left


@pytest.mark.slow
@needs_embedded_model
def test_an_export_killed_half_way_is_rebuilt_by_the_next_start(tmp_path):
    home = tmp_path / "home"
    proc = _start(home)
    deadline = time.monotonic() + 240
    # Half way: the process holds the entry's lock and is building into its temporary folder (the GGUF read and
    # the saves, ~15 s, lie ahead of it: waiting for them adds nothing the rebuild below does not check).
    while not (list(home.glob(".smollm2-135m-instruct.tmp-*")) if home.is_dir() else []):
        assert proc.poll() is None, "the export finished before it could be interrupted"
        assert time.monotonic() < deadline, "no export started"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (home / "smollm2-135m-instruct").exists()
    assert len(leftovers(home / "smollm2-135m-instruct")) == 1

    result, err = _finish(_start(home))
    assert err.count(EXPORT_LINE) == 1
    assert result["path"] == str(home / "smollm2-135m-instruct")
    assert _entries(home) == ["smollm2-135m-instruct"]
