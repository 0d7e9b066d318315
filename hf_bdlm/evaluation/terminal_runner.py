"""`hf-bdlm eval terminal-bench`: Terminal-Bench tasks with our server as the model endpoint.

- **local** (default for the shipped set and any folder of Harbor-format tasks): each task's `environment/app`
  files are copied into a sandbox folder, mini-swe-agent (text-based mode) follows `instruction.md` there, and the
  task's own `tests/test.sh` grades it (reward 1 = resolved). No Docker.
- **harbor** / **tb**: the official harnesses (`harbor run`, or the older `tb run`), which build each task's Docker
  image; the agent is Terminus talking to our server through litellm (`openai/<model>`, `api_base`). Both need
  Docker, and `harbor` needs Python >= 3.12; when something is missing the run stops with a message naming it.

    hf-bdlm eval terminal-bench --model-dir outputs/bdlm --output-dir out/tb                # offline, local
    hf-bdlm eval terminal-bench --base-url http://127.0.0.1:8000/v1 --tasks terminal-bench@2.0 --harness harbor
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .agent import TERMINAL_CONFIG, AgentSettings, run_agent
from .endpoint import Endpoint, docker_available
from .grading import run_terminal_tests
from .results import Progress, TaskResult, summary_table, write_results
from .tasksets import OFFLINE_TERMINAL, terminal_task_dirs

HARNESSES = ("auto", "local", "harbor", "tb")


@dataclass
class TerminalRun:
    results: list[TaskResult]
    results_path: Path | None
    table: str
    message: str = ""

    @property
    def pass_rate(self) -> float:
        return sum(r.resolved for r in self.results) / len(self.results) if self.results else 0.0


def prepare_sandbox(task_dir: Path, root: Path) -> Path:
    """The task's starting files (`environment/app`) in a fresh `root/app`; returns that folder."""
    app = root / "app"
    if app.exists():
        shutil.rmtree(app)
    source = task_dir / "environment" / "app"
    if source.is_dir():
        shutil.copytree(source, app)
    else:
        app.mkdir(parents=True)
    return app


def task_prompt(task_dir: Path) -> str:
    return (task_dir / "instruction.md").read_text().strip() + (
        "\n\nWork in the current directory. When the task is done, finish with the submit command.")


def run_local(task_dirs: list[Path], output_dir: Path, endpoint: Endpoint | None, settings: AgentSettings | None,
              mode: str = "agent", label: str = "terminal-bench-offline", progress: bool = True) -> TerminalRun:
    """Run each task in a sandbox (`mode`: `agent`, or `gold` / `empty` for grader sanity) and grade it."""
    results = []
    bar = Progress(len(task_dirs), label, enabled=progress)
    for task_dir in task_dirs:
        start = time.perf_counter()
        root = output_dir / "sandbox" / task_dir.name
        app = prepare_sandbox(task_dir, root)
        result = TaskResult(task_dir.name)
        if mode == "agent":
            outcome = run_agent(task_prompt(task_dir), app, settings, TERMINAL_CONFIG,
                                trajectory_path=output_dir / "trajectories" / f"{task_dir.name}.traj.json")
            result.exit_status, result.steps = outcome.exit_status, outcome.steps
            result.prompt_tokens, result.completion_tokens = outcome.prompt_tokens, outcome.completion_tokens
        elif mode == "gold":
            subprocess.run(["bash", str(task_dir / "solution" / "solve.sh")], cwd=app, capture_output=True,
                           env={**os.environ, "APP_DIR": str(app.resolve())}, timeout=120)
            result.exit_status = "gold"
        else:
            result.exit_status = "empty"
        reward = run_terminal_tests(task_dir, app, root / "logs")
        result.resolved = reward >= 1.0
        result.detail = {"reward": reward}
        result.wall_time_s = time.perf_counter() - start
        results.append(result)
        bar.update(result)
    model = endpoint.model if endpoint else mode
    meta = {"model": model, "tasks": str(task_dirs[0].parent), "grader": "each task's tests/test.sh (local)"}
    results_path = write_results(output_dir, label, results, meta)
    return TerminalRun(results, results_path, summary_table(f"{label}: {model}", results))


def harness_command(harness: str, tasks: str, endpoint: Endpoint, output_dir: Path) -> list[str]:
    """The official harness's command line with our server as the model (Terminus agent, litellm `openai/...`)."""
    model = f"openai/{endpoint.model}"
    if harness == "harbor":
        source = ["-p", tasks] if Path(tasks).exists() else ["-d", tasks]
        return ["harbor", "run", *source, "-a", "terminus-2", "-m", model, "--ak", f"api_base={endpoint.base_url}",
                "-o", str(output_dir / "jobs"), "--n-concurrent", "1"]
    name, _, version = tasks.partition("==")
    source = ["--dataset-path", tasks] if Path(tasks).exists() else ["--dataset-name", name] + (
        ["--dataset-version", version] if version else [])
    return ["tb", "run", *source, "--agent", "terminus", "--model-name", model, "--output-path",
            str(output_dir / "runs"), "--n-concurrent", "1"]


def missing_for(harness: str) -> list[str]:
    """What the official harness lacks here, in words ([] when it can run)."""
    missing = []
    if harness == "harbor":
        if shutil.which("harbor") is None:
            missing.append("the `harbor` command (pip install harbor; it needs Python >= 3.12, this is "
                           f"{sys.version_info.major}.{sys.version_info.minor})")
    elif shutil.which("tb") is None:
        missing.append("the `tb` command (pip install terminal-bench)")
    if not docker_available():
        missing.append("a Docker daemon (both harnesses build each task's image)")
    return missing


def run_terminal_bench(endpoint: Endpoint | None, output_dir: str | Path, settings: AgentSettings | None = None,
                       tasks: str = "offline", names: list[str] | None = None, harness: str = "auto",
                       progress: bool = True) -> TerminalRun:
    """Evaluate on `tasks` (`offline`, a folder of Harbor tasks, or a dataset name such as `terminal-bench@2.0`)."""
    if harness not in HARNESSES:
        raise ValueError(f"harness must be one of {HARNESSES}, got {harness!r}.")
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    local_tasks = tasks == "offline" or Path(tasks).is_dir()
    if harness == "local" or (harness == "auto" and local_tasks):
        return run_local(terminal_task_dirs(tasks, names), output_dir, endpoint, settings, progress=progress)
    candidates = [harness] if harness != "auto" else ["harbor", "tb"]
    problems = {}
    for candidate in candidates:
        problems[candidate] = missing_for(candidate)
        if not problems[candidate]:
            command = harness_command(candidate, str(OFFLINE_TERMINAL if tasks == "offline" else tasks), endpoint,
                                      output_dir)
            env = {**os.environ, "OPENAI_API_KEY": endpoint.api_key, "OPENAI_API_BASE": endpoint.base_url,
                   "OPENAI_BASE_URL": endpoint.base_url}
            code = subprocess.run(command, env=env).returncode
            message = (f"{candidate} finished with exit code {code}; its results are under {output_dir} "
                       "(the harness's own result files).")
            return TerminalRun([], None, "", message=message)
    lines = [f"cannot run Terminal-Bench tasks {tasks!r} with the official harness here:"]
    lines += [f"  {name}: missing {', '.join(what)}" for name, what in problems.items()]
    lines.append("The shipped offline tasks run without Docker: --tasks offline (or --harness local for a folder "
                 "of Harbor-format tasks).")
    return TerminalRun([], None, "", message="\n".join(lines))
