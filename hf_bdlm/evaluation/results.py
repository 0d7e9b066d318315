"""Evaluation results: one record per task, the results JSON every evaluation writes, a summary table.

    from hf_bdlm.evaluation.results import TaskResult, write_results
    path = write_results("out/eval", "swebench-offline", [TaskResult("task-1", resolved=True)], {"model": "m"})
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class TaskResult:
    """What one task run produced.

    Attributes:
        task_id: instance id (SWE-bench) or task name (Terminal-Bench).
        resolved: graded as solved.
        steps: model calls the agent made.
        prompt_tokens / completion_tokens: summed over the agent's model calls (the server's `usage`).
        wall_time_s: agent plus grading.
        exit_status: how the agent stopped (`Submitted`, `LimitsExceeded`, `RepeatedFormatError`, an exception...).
        detail: grader output (SWE-bench report, reward), patch source, error text.
    """

    task_id: str
    resolved: bool = False
    steps: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_time_s: float = 0.0
    exit_status: str = ""
    detail: dict = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def pass_rate(results: list[TaskResult]) -> float:
    return sum(r.resolved for r in results) / len(results) if results else 0.0


def summary_table(title: str, results: list[TaskResult]) -> str:
    """A plain-text table: one row per task, then the pass rate."""
    rows = [("task", "resolved", "steps", "tokens", "time s", "exit")]
    rows += [(r.task_id, "yes" if r.resolved else "no", str(r.steps), str(r.tokens), f"{r.wall_time_s:.1f}",
              r.exit_status) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [title] + ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(2, "  ".join("-" * w for w in widths))
    resolved = sum(r.resolved for r in results)
    lines.append(f"pass rate: {pass_rate(results):.1%} ({resolved}/{len(results)})")
    return "\n".join(lines)


def write_results(output_dir: str | Path, name: str, results: list[TaskResult], meta: dict) -> Path:
    """Write `<output_dir>/<name>_results.json`: meta, pass rate and every task's record."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / f"{name}_results.json"
    payload = {
        "evaluation": name, "finished": time.strftime("%Y-%m-%dT%H:%M:%S"), **meta,
        "pass_rate": pass_rate(results), "resolved": sum(r.resolved for r in results), "total": len(results),
        "tasks": [{**asdict(r), "tokens": r.tokens} for r in results],
    }
    path.write_text(json.dumps(payload, indent=2))
    return path


class Progress:
    """One line per finished task (long runs show where they are)."""

    def __init__(self, total: int, label: str, enabled: bool = True):
        self.total, self.label, self.enabled = total, label, enabled
        self.done = self.resolved = 0
        self.start = time.perf_counter()

    def update(self, result: TaskResult) -> None:
        self.done += 1
        self.resolved += result.resolved
        if self.enabled:
            elapsed = time.perf_counter() - self.start
            print(f"[{self.label} {self.done}/{self.total}] {result.task_id}: "
                  f"{'resolved' if result.resolved else 'not resolved'} ({result.exit_status}, {result.steps} steps, "
                  f"{result.wall_time_s:.1f}s); {self.resolved}/{self.done} so far, {elapsed:.0f}s elapsed",
                  flush=True)
