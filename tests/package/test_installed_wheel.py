"""The installed wheel is self-contained (the rooms and imports of the source: tests/package/test_layering.py).

The wheel is built from a copy of this checkout and installed (not editable) into a folder of its own; every command
then runs with this interpreter (which has the dependencies), that folder on ``PYTHONPATH`` and a temporary working
folder outside the checkout: the package imports from the wheel, every module of it imports, every ``hf-bdlm``
subcommand answers ``--help``, ``hf-bdlm bench`` runs its smallest real configuration (torchrun at P = 2 and the single
process) and writes its records and plots, and ``hf-bdlm plan --validate`` predicts the committed records.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from package_source import PACKAGE, module_files
from paths import DATA, ROOT

RECORDS = DATA / "parallel_modes_cpu_2k4k.json"


# --- the wheel --------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The wheel built from a copy of the checkout (pip, offline, this environment's setuptools), installed with
    ``pip install --target``: a folder holding ``hf_bdlm`` and nothing of the checkout."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / PACKAGE, src / PACKAGE, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    pip = [sys.executable, "-m", "pip", "--no-cache-dir"]
    build = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", str(src),
                            "-w", str(tmp / "dist")], capture_output=True, text=True, env=env, cwd=tmp, timeout=300)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("hf_bdlm-*.whl")
    install = subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(tmp / "site"), str(wheel)],
                             capture_output=True, text=True, env=env, cwd=tmp, timeout=300)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    return tmp / "site"


@pytest.fixture
def work(tmp_path) -> Path:
    assert ROOT not in tmp_path.resolve().parents
    return tmp_path


def run_installed(site: Path, cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python ARGS`` with the wheel's folder as the only ``PYTHONPATH``, in ``cwd`` (outside the checkout)."""
    env = dict(os.environ, PYTHONPATH=str(site), HF_BDLM_HOME=str(cwd / "hf_bdlm_home"), HF_HUB_OFFLINE="1",
               HF_HUB_DISABLE_TELEMETRY="1", OMP_NUM_THREADS="1", MPLBACKEND="Agg")
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def subcommands() -> list[str]:
    from hf_bdlm.cli import build_parser

    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(action.choices)


# One process on the wheel (each start imports torch and transformers: seconds): where hf_bdlm imports from, every
# module imported, `python -m hf_bdlm.cli --help` (run as -m runs it) and every subcommand's --help.
PROBE = """
import contextlib, importlib, io, json, runpy, sys
import hf_bdlm

def help_of(argv, main):
    out, code = io.StringIO(), None
    sys.argv = argv
    try:
        with contextlib.redirect_stdout(out):
            main()
    except SystemExit as exit:
        code = exit.code
    return [code, out.getvalue()]

modules, failed = sys.argv[1].split(","), {}
for name in modules:
    try:
        importlib.import_module(name)
    except Exception as err:
        failed[name] = f"{type(err).__name__}: {err}"
files = {name: getattr(sys.modules.get(name), "__file__", None) for name in modules}
commands = sys.argv[2].split(",")
top = help_of(["hf-bdlm", "--help"], lambda: runpy.run_module("hf_bdlm.cli", run_name="__main__", alter_sys=True))
from hf_bdlm.cli import main
helps = {c: help_of(["hf-bdlm", c, "--help"], lambda: sys.exit(main())) for c in commands}
print(json.dumps(dict(file=hf_bdlm.__file__, files=files, failed=failed, help=top, helps=helps)))
"""


@pytest.fixture(scope="module")
def probe(site, tmp_path_factory) -> dict:
    """The results of :data:`PROBE`."""
    cwd = tmp_path_factory.mktemp("probe")
    proc = run_installed(site, cwd, "-c", PROBE, ",".join(module_files(ROOT)), ",".join(subcommands()), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_wheel_holds_every_module_and_imports_from_its_own_folder(site, probe):
    assert set(module_files(site)) == set(module_files(ROOT))
    assert Path(probe["file"]).resolve() == (site / PACKAGE / "__init__.py").resolve()
    assert not probe["failed"], probe["failed"]
    outside = {n: f for n, f in probe["files"].items() if f is None or site.resolve() not in Path(f).resolve().parents}
    assert not outside, f"modules not imported from the wheel: {outside}"
    # Package data the commands read.
    for data in ("data/arith_train.jsonl", "models/block_diffusion/model_card.md",
                 "models/diffusion_gemma/model_card.md", "evaluation/tasks/swebench_offline.jsonl"):
        assert (site / PACKAGE / data).is_file(), data


def test_every_subcommand_answers_help(probe):
    commands = subcommands()
    assert {"train", "convert", "generate", "serve", "eval", "bench", "plan"} <= set(commands)
    code, text = probe["help"]
    assert code == 0 and text.startswith("usage: hf-bdlm "), text
    listed = text.split("positional arguments:")[-1]
    assert all(f"    {c} " in listed for c in commands), (commands, text)
    for command in commands:
        code, text = probe["helps"][command]
        usage = text.splitlines()[0] if text else ""
        assert code == 0 and usage.startswith(f"usage: hf-bdlm {command} "), (command, code, text[:500])


@pytest.mark.distributed
def test_bench_runs_its_smallest_configuration_from_the_wheel(site, work):
    """csbp (all-gather) at P = 2 under torchrun and the single process, L = 256, 1 layer, 3 steps (the fewest a timed
    study takes): the command end to end (the entry point's main; the console script itself answers in
    tests/package/test_cli.py), each measurement its own launch, writing the planner's records and the plots."""
    out = work / "bench"
    proc = run_installed(site, work, "-m", "hf_bdlm.cli", "bench", "--only", "modes", "--lengths", "256",
                         "--nprocs", "2", "--modes", "csbp", "--transports", "allgather", "--layers", "1",
                         "--steps", "3", "--min-time", "0", "--no-calibrate", "--out", "bench", timeout=240)
    if proc.returncode and (out / "parallel_modes.json").exists():
        failed = [r["error"] for r in json.loads((out / "parallel_modes.json").read_text()) if "error" in r]
        pytest.fail("a measurement failed:\n" + "\n".join(failed) + proc.stdout[-1000:])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "[modes 2/2," in proc.stdout
    records = json.loads((out / "parallel_modes.json").read_text())
    assert isinstance(records, list)
    assert {(r["mode"], r["P"], r["L"]) for r in records} == {("single", 1, 256), ("csbp", 2, 256)}
    assert {(r["mode"], r["transport"]) for r in records} == {("single", None), ("csbp", "allgather")}
    for r in records:
        for key in ("mode", "transport", "schedule", "P", "C", "L", "layers", "window", "step_s", "tokens_per_s",
                    "peak_mem_bytes", "bytes_per_step", "bytes_by_name", "comm_wait_s"):
            assert key in r, key
        assert r["step_s"] > 0 and r["peak_mem_bytes"] > 0
        assert r["steps"] == len(r["step_times"]) == 3  # --steps 3 and no --min-time
        assert r["step_spread"]["values"] == r["step_times"] and r["step_spread"]["median"] == r["step_s"]
    gather = next(r for r in records if r["mode"] == "csbp")
    # docs/design.md §3: csbp receives (C - 1) / C * 2 (K, V) * L * H_kv * d * 4 bytes per layer forward, as much
    # backward.
    assert gather["bytes_per_step"] == 2 * (1 / 2 * 2 * 256 * 2 * 32 * 4)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["studies"]["modes"]["failed"] == 0 and summary["machine"]["cpus"] >= 1
    assert len(summary["plots"]) == 4
    assert all((out / name).stat().st_size > 5000 and (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
               for name in summary["plots"])
    assert "CSBP's speed-up over each mode" in (out / "summary.md").read_text()


def test_plan_validate_predicts_the_committed_records_from_the_wheel(site, work):
    # The committed records at L = 2K (those at 4K take most of the time: their tile plans are 4x larger).
    records = [r for r in json.loads(RECORDS.read_text()) if r["L"] == 2048 and "error" not in r]
    assert len(records) >= 5
    (work / "parallel_modes.json").write_text(json.dumps(records))
    one = dict(matmul_flops=5e10, attention_flops=4e10, hbm_bytes_per_s=1e10, intra_node_bytes_per_s=3e8,
               inter_node_bytes_per_s=3e8, sync_cost_s=1e-3, benchmark_layers=2, benchmark_step_s=2.0)
    (work / "rates.json").write_text(json.dumps({"processes": {"1": one, "2": dict(one, matmul_flops=4e10)}}))
    proc = run_installed(site, work, "-m", "hf_bdlm.cli", "plan", "--validate", "parallel_modes.json",
                         "--rates-cache", "rates.json", "--cores", "2")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    n = len(records)
    assert f"bytes equal for {n}/{n}" in proc.stdout and "DIFFER" not in proc.stdout
    assert "CPU figures: rates.json" in proc.stdout and "pred_s" in proc.stdout
