"""Grading without Docker, with the harnesses' own rules.

- SWE-bench (offline instances): the prediction is applied in a fresh checkout, the tests run, and the log goes
  through `swebench`'s own `get_eval_report` (pytest log parser, FAIL_TO_PASS / PASS_TO_PASS report, resolution
  rule). Gold patches score 100 %, empty patches 0 % (`hf-bdlm eval swebench --sanity`).
- Terminal-Bench (Harbor-format tasks): the task's own `tests/test.sh` runs against the sandbox and writes its reward.

    from hf_bdlm.evaluation.grading import grade_prediction
    report = grade_prediction(instance, model_patch, workdir)     # {"resolved": ..., "tests_status": ...}
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from swebench.harness.grading import get_eval_report
from swebench.types import TestSpec

from .sandbox import checkout_instance, run_instance_tests


def test_spec(instance: dict) -> TestSpec:
    """The harness's `TestSpec` of an offline instance (pytest log parser, pass-and-fail evaluation)."""
    def tests(field: str) -> list[str]:
        value = instance[field]
        return json.loads(value) if isinstance(value, str) else list(value)

    return TestSpec(instance_id=instance["instance_id"], image="", eval_script_list=[], repo=instance["repo"],
                    version=instance.get("version", ""), FAIL_TO_PASS=tests("FAIL_TO_PASS"),
                    PASS_TO_PASS=tests("PASS_TO_PASS"), log_parser="parse_log_pytest", eval_type="pass_and_fail")


def grade_prediction(instance: dict, model_patch: str | None, workdir: str | Path | None = None) -> dict:
    """Grade one prediction of an offline instance; returns swebench's report entry plus the log's path."""
    if workdir is not None:
        Path(workdir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        repo = checkout_instance(instance, Path(tmp) / "repo")
        log = run_instance_tests(instance, repo, model_patch) if model_patch is not None else ""
        log_path = Path(tmp) / "test_output.txt"
        log_path.write_text(log)
        prediction = {"instance_id": instance["instance_id"], "model_name_or_path": "hf-bdlm",
                      "model_patch": model_patch}
        report = get_eval_report(test_spec(instance), prediction, str(log_path), include_tests_status=True)
        entry = report[instance["instance_id"]]
        if workdir is not None:  # keep the log beside the results
            kept = Path(workdir) / f"{instance['instance_id']}.test_output.txt"
            shutil.copy(log_path, kept)
            entry["log"] = str(kept)
    return entry


def run_terminal_tests(task_dir: str | Path, app_dir: str | Path, logs_dir: str | Path,
                       timeout_s: float = 60.0) -> float:
    """Run a Harbor task's `tests/test.sh` against a sandbox folder; returns its reward (0 when it wrote none)."""
    logs_dir = Path(logs_dir)
    (logs_dir / "verifier").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "APP_DIR": str(Path(app_dir).resolve()), "LOGS_DIR": str(logs_dir.resolve())}
    try:
        subprocess.run(["bash", str(Path(task_dir) / "tests" / "test.sh")], cwd=app_dir, env=env,
                       capture_output=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return 0.0
    reward = logs_dir / "verifier" / "reward.txt"
    try:
        return float(reward.read_text().strip() or 0)
    except (OSError, ValueError):
        return 0.0
