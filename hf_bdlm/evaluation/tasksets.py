"""Task sets: the offline ones shipped with the package, local files, and hub datasets.

    from hf_bdlm.evaluation.tasksets import load_swebench_instances, terminal_task_dirs
    instances = load_swebench_instances("offline")            # 5 tiny repositories, SWE-bench instance format
    tasks = terminal_task_dirs("offline")                      # 4 Harbor-format terminal tasks
"""

from __future__ import annotations

import json
from pathlib import Path

from datasets import load_dataset

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
OFFLINE_SWEBENCH = TASKS_DIR / "swebench_offline.jsonl"
OFFLINE_TERMINAL = TASKS_DIR / "terminal"


def load_swebench_instances(dataset: str = "offline", split: str = "test",
                            instance_ids: list[str] | None = None) -> list[dict]:
    """SWE-bench instances: `"offline"`, a local `.json` / `.jsonl` file, or a hub dataset name (needs the hub)."""
    if dataset == "offline":
        dataset = str(OFFLINE_SWEBENCH)
    path = Path(dataset)
    if path.suffix in (".json", ".jsonl") or path.is_file():
        if not path.is_file():
            raise FileNotFoundError(f"SWE-bench dataset file {dataset!r} does not exist.")
        text = path.read_text()
        instances = json.loads(text) if path.suffix == ".json" else [json.loads(l) for l in text.splitlines() if l]
    else:
        instances = [dict(row) for row in load_dataset(dataset, split=split)]
    if instance_ids:
        known = {i["instance_id"] for i in instances}
        missing = sorted(set(instance_ids) - known)
        if missing:
            raise ValueError(f"instances {missing} are not in {dataset!r}.")
        instances = [i for i in instances if i["instance_id"] in instance_ids]
    return instances


def is_local_instance(instance: dict) -> bool:
    """Whether the instance carries its repository (`repo_files`) and so runs in a local sandbox without Docker."""
    return "repo_files" in instance


def terminal_task_dirs(tasks: str = "offline", names: list[str] | None = None) -> list[Path]:
    """Harbor-format task folders (`instruction.md`, `tests/test.sh`) under `tasks` (`"offline"`: the shipped set)."""
    root = OFFLINE_TERMINAL if tasks == "offline" else Path(tasks)
    if (root / "instruction.md").is_file():
        dirs = [root]
    else:
        dirs = sorted(p for p in root.iterdir() if (p / "instruction.md").is_file()) if root.is_dir() else []
    if not dirs:
        raise FileNotFoundError(f"no Harbor-format tasks (folders with instruction.md) under {root}.")
    if names:
        missing = sorted(set(names) - {d.name for d in dirs})
        if missing:
            raise ValueError(f"tasks {missing} are not in {root}.")
        dirs = [d for d in dirs if d.name in names]
    return dirs
