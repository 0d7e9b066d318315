"""`hf-bdlm eval swebench`: mini-swe-agent on SWE-bench instances, predictions in the harness's format, grading.

Two paths, chosen by the instances:

- **offline / local instances** (they carry `repo_files`, like the shipped set): each instance is checked out in a
  sandbox folder, the agent works there, its patch (the submitted diff, else the working tree's diff outside the
  test files) becomes the prediction, and `swebench`'s own report functions grade it (`grading.py`). No Docker.
- **real SWE-bench** (hub name or file): mini-swe-agent's batch runner works in each instance's Docker image and
  `swebench.harness.run_evaluation` grades in Docker. Without Docker this stops with a message (predictions given
  with `--predictions` are kept in the output folder).

    hf-bdlm eval swebench --model-dir outputs/bdlm --output-dir out/swe            # the offline set
    hf-bdlm eval swebench --sanity                                                 # gold 100 %, empty 0 %
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from .agent import SWEBENCH_CONFIG, AgentSettings, run_agent
from .endpoint import Endpoint, docker_available
from .grading import grade_prediction
from .results import Progress, TaskResult, summary_table, write_results
from .sandbox import checkout_instance, diff_worktree, patched_files
from .tasksets import is_local_instance, load_swebench_instances


@dataclass
class SWEbenchRun:
    """The outcome of an evaluation: per-task results, files written, the printed table."""

    results: list[TaskResult]
    results_path: Path | None
    predictions_path: Path | None
    table: str
    message: str = ""

    @property
    def pass_rate(self) -> float:
        return sum(r.resolved for r in self.results) / len(self.results) if self.results else 0.0


def write_predictions(path: Path, predictions: dict[str, str], model: str) -> Path:
    """The harness's predictions file: one `{instance_id, model_name_or_path, model_patch}` per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"instance_id": iid, "model_name_or_path": model, "model_patch": patch}) + "\n"
                            for iid, patch in predictions.items()))
    return path


def read_predictions(path: str | Path) -> dict[str, str]:
    """Predictions from a harness file (`.jsonl` lines, a `.json` list, or mini-swe-agent's `preds.json` dict)."""
    text = Path(path).read_text()
    if str(path).endswith(".jsonl"):
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        data = json.loads(text)
        rows = list(data.values()) if isinstance(data, dict) else data
    return {row["instance_id"]: row.get("model_patch") for row in rows}


def extract_patch(submission: str, repo: Path, instance: dict) -> tuple[str, str]:
    """The agent's prediction: its submitted diff, else the working tree's changes outside the test files."""
    if "diff --git" in submission or ("--- a/" in submission and "+++ b/" in submission):
        start = min(i for i in (submission.find("diff --git"), submission.find("--- a/")) if i >= 0)
        patch = submission[start:]
        return (patch if patch.endswith("\n") else patch + "\n"), "submission"
    return diff_worktree(repo, exclude=patched_files(instance["test_patch"])), "worktree"


def run_offline(instances: list[dict], output_dir: Path, endpoint: Endpoint | None, settings: AgentSettings | None,
                predictions: dict[str, str] | None = None, label: str = "swebench", progress: bool = True,
                ) -> SWEbenchRun:
    """Agent (unless `predictions` are given) and local grading of instances that carry their repository."""
    output_dir.mkdir(parents=True, exist_ok=True)
    results, made = [], {}
    bar = Progress(len(instances), label, enabled=progress)
    for instance in instances:
        iid = instance["instance_id"]
        start = time.perf_counter()
        result = TaskResult(iid)
        if predictions is not None:
            patch, source = predictions.get(iid), "predictions file"
            result.exit_status = "given" if iid in predictions else "missing"
        else:
            repo = checkout_instance(instance, output_dir / "sandbox" / iid)
            outcome = run_agent(instance["problem_statement"], repo, settings, SWEBENCH_CONFIG,
                                trajectory_path=output_dir / "trajectories" / f"{iid}.traj.json")
            patch, source = extract_patch(outcome.submission, repo, instance)
            result.exit_status, result.steps = outcome.exit_status, outcome.steps
            result.prompt_tokens, result.completion_tokens = outcome.prompt_tokens, outcome.completion_tokens
        made[iid] = patch
        report = grade_prediction(instance, patch, output_dir / "logs")
        result.resolved = bool(report["resolved"])
        result.detail = {"patch_source": source, "patch_applied": report["patch_successfully_applied"],
                         "tests_status": report.get("tests_status"), "log": report.get("log")}
        result.wall_time_s = time.perf_counter() - start
        results.append(result)
        bar.update(result)
    model = endpoint.model if endpoint else "predictions"
    preds_path = write_predictions(output_dir / "preds.jsonl", made, model)
    meta = {"model": model, "dataset": label, "grader": "swebench.harness.grading (local, no Docker)",
            "agent": "mini-swe-agent " + _version("mini-swe-agent"), "swebench": _version("swebench")}
    if settings is not None:
        meta["agent_settings"] = {k: v for k, v in vars(settings).items() if k != "api_key"}
    results_path = write_results(output_dir, label, results, meta)
    table = summary_table(f"{label}: {model}", results)
    return SWEbenchRun(results, results_path, preds_path, table)


def sanity_check(instances: list[dict], output_dir: Path, progress: bool = False) -> dict[str, SWEbenchRun]:
    """Grade the gold patches (must resolve every instance) and empty patches (must resolve none)."""
    runs = {}
    for name, patches in (("gold", {i["instance_id"]: i["patch"] for i in instances}),
                          ("empty", {i["instance_id"]: "" for i in instances})):
        runs[name] = run_offline(instances, output_dir / name, None, None, predictions=patches,
                                 label=f"swebench-sanity-{name}", progress=progress)
    return runs


def docker_commands(dataset: str, split: str, endpoint: Endpoint, output_dir: Path, settings: AgentSettings,
                    run_id: str, workers: int, instance_ids: list[str] | None) -> list[list[str]]:
    """The two commands of the Docker path: mini-swe-agent's SWE-bench batch runner, then the swebench harness."""
    agent = [
        sys.executable, "-m", "minisweagent.run.benchmarks.swebench", "--subset", dataset, "--split", split,
        "-o", str(output_dir / "agent"), "-w", str(workers), "-m", f"openai/{endpoint.model}",
        "--model-class", "litellm_textbased", "-c", SWEBENCH_CONFIG,
        "-c", f"model.model_kwargs.api_base={endpoint.base_url}", "-c", f"model.model_kwargs.api_key={endpoint.api_key}",
        "-c", f"model.model_kwargs.max_tokens={settings.max_tokens}",
        "-c", f"model.model_kwargs.temperature={settings.temperature}", "-c", "model.cost_tracking=ignore_errors",
        "-c", f"agent.step_limit={settings.step_limit}", "-c", "agent.cost_limit=0",
    ]
    if instance_ids:
        agent += ["--filter", "^(" + "|".join(instance_ids) + ")$"]
    harness = [
        sys.executable, "-m", "swebench.harness.run_evaluation", "--dataset_name", dataset, "--split", split,
        "--predictions_path", str(output_dir / "preds.jsonl"), "--run_id", run_id, "--max_workers", str(workers),
        "--report_dir", str(output_dir),
    ]
    if instance_ids:
        harness += ["--instance_ids", *instance_ids]
    return [agent, harness]


def run_docker(dataset: str, split: str, endpoint: Endpoint | None, output_dir: Path, settings: AgentSettings | None,
               predictions_path: str | None, run_id: str, workers: int, instance_ids: list[str] | None) -> SWEbenchRun:
    """The official path (Docker images per instance). Without Docker: a clear message; given predictions are kept."""
    output_dir.mkdir(parents=True, exist_ok=True)
    kept = None
    if predictions_path:
        kept = write_predictions(output_dir / "preds.jsonl", read_predictions(predictions_path), "predictions")
    if not docker_available():
        message = (f"SWE-bench dataset {dataset!r} needs the Docker harness (the agent works inside each instance's "
                   "image and grading runs in its container), but no Docker daemon answers here. Install Docker, "
                   "or run the shipped offline set with --dataset offline.")
        if kept:
            message += f" The predictions were kept in {kept}; grade them later with --predictions {kept}."
        return SWEbenchRun([], None, kept, "", message=message)
    agent_cmd, harness_cmd = docker_commands(dataset, split, endpoint, output_dir, settings, run_id, workers,
                                             instance_ids)
    env = {**os.environ, "MSWEA_COST_TRACKING": "ignore_errors", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
           "MSWEA_CONFIGURED": "true"}
    if not predictions_path:
        subprocess.run(agent_cmd, check=True, env=env)
        kept = write_predictions(output_dir / "preds.jsonl", read_predictions(output_dir / "agent" / "preds.json"),
                                 endpoint.model)
    subprocess.run(harness_cmd, check=True, env=env)
    reports = sorted(output_dir.glob(f"*.{run_id}.json"))
    resolved = set(json.loads(reports[-1].read_text()).get("resolved_ids", [])) if reports else set()
    results = [TaskResult(iid, resolved=iid in resolved, exit_status="graded")
               for iid in read_predictions(kept)]
    name = "swebench-docker"
    results_path = write_results(output_dir, name, results, {"model": endpoint.model if endpoint else "predictions",
                                                             "dataset": dataset, "split": split,
                                                             "grader": "swebench.harness.run_evaluation (Docker)"})
    return SWEbenchRun(results, results_path, kept, summary_table(f"{name}: {dataset}", results))


def run_swebench(endpoint: Endpoint | None, output_dir: str | Path, settings: AgentSettings | None = None,
                 dataset: str = "offline", split: str = "test", instance_ids: list[str] | None = None,
                 predictions_path: str | None = None, run_id: str = "hf-bdlm", workers: int = 1,
                 progress: bool = True) -> SWEbenchRun:
    """Evaluate on `dataset`; see the module docstring for the two paths."""
    output_dir = Path(output_dir)
    if dataset != "offline" and not Path(dataset).is_file():
        # hub datasets are real SWE-bench instances: Docker path (instances are loaded by the harness itself)
        return run_docker(dataset, split, endpoint, output_dir, settings, predictions_path, run_id, workers,
                          instance_ids)
    instances = load_swebench_instances(dataset, split, instance_ids)
    if not all(is_local_instance(i) for i in instances):
        return run_docker(dataset, split, endpoint, output_dir, settings, predictions_path, run_id, workers,
                          instance_ids)
    predictions = read_predictions(predictions_path) if predictions_path else None
    label = "swebench-offline" if dataset == "offline" else f"swebench-{Path(dataset).stem}"
    return run_offline(instances, output_dir, endpoint, settings, predictions, label, progress)


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"
