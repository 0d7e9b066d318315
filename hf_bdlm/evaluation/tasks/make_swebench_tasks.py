"""Builds `swebench_offline.jsonl`: tiny repositories with a bug, in SWE-bench's instance format.

Each task is written here as three file sets: the repository before the fix (`base`), the fix (`gold`: the files
the fix changes) and the new tests (`tests`). The builder commits `base` (deterministic hash: `base_commit`), takes
`patch` and `test_patch` from `git diff`, and validates the instance the way SWE-bench does: FAIL_TO_PASS are the
tests that fail before the gold patch and pass after it, PASS_TO_PASS those that pass both times. Besides the
standard fields each line carries `repo_files` (the base snapshot) so a local sandbox can check it out offline.

    python -m hf_bdlm.evaluation.tasks.make_swebench_tasks      # rewrites swebench_offline.jsonl next to this file
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from swebench.harness.log_parsers import parse_log_pytest

from ..sandbox import diff_worktree, git, init_repo, run_instance_tests, write_files

OUT = Path(__file__).resolve().parent / "swebench_offline.jsonl"
CREATED_AT = "2025-01-01T00:00:00Z"

TASKS = [
    {
        "name": "textkit",
        "problem": "slugify() keeps upper-case letters: slugify('Hello World') returns 'Hello-World'. URL slugs "
                   "must be lower case, so it should return 'hello-world'.",
        "base": {
            "textkit/__init__.py": "from .slug import slugify\n",
            "textkit/slug.py": 'import re\n\n\ndef slugify(text: str) -> str:\n'
                               '    """Turn text into a URL slug: its words joined by hyphens."""\n'
                               '    words = re.findall(r"[A-Za-z0-9]+", text)\n    return "-".join(words)\n',
            "tests/test_slug.py": "from textkit import slugify\n\n\ndef test_slugify_joins_words():\n"
                                  '    assert slugify("a b  c") == "a-b-c"\n',
        },
        "gold": {
            "textkit/slug.py": 'import re\n\n\ndef slugify(text: str) -> str:\n'
                               '    """Turn text into a URL slug: its words joined by hyphens."""\n'
                               '    words = re.findall(r"[A-Za-z0-9]+", text)\n'
                               '    return "-".join(word.lower() for word in words)\n',
        },
        "tests": {
            "tests/test_slug.py": "from textkit import slugify\n\n\ndef test_slugify_joins_words():\n"
                                  '    assert slugify("a b  c") == "a-b-c"\n\n\ndef test_slugify_lowercases():\n'
                                  '    assert slugify("Hello World") == "hello-world"\n',
        },
    },
    {
        "name": "mathkit",
        "problem": "mean([]) raises ZeroDivisionError. An empty sequence has no mean: it should raise "
                   "ValueError('mean() of an empty sequence') instead.",
        "base": {
            "mathkit/__init__.py": "from .stats import mean\n",
            "mathkit/stats.py": "def mean(values):\n    \"\"\"Arithmetic mean of a sequence of numbers.\"\"\"\n"
                                "    return sum(values) / len(values)\n",
            "tests/test_stats.py": "from mathkit import mean\n\n\ndef test_mean_of_numbers():\n"
                                   "    assert mean([1, 2, 3, 6]) == 3\n",
        },
        "gold": {
            "mathkit/stats.py": "def mean(values):\n    \"\"\"Arithmetic mean of a sequence of numbers.\"\"\"\n"
                                "    if not values:\n        raise ValueError(\"mean() of an empty sequence\")\n"
                                "    return sum(values) / len(values)\n",
        },
        "tests": {
            "tests/test_stats.py": "import pytest\n\nfrom mathkit import mean\n\n\ndef test_mean_of_numbers():\n"
                                   "    assert mean([1, 2, 3, 6]) == 3\n\n\ndef test_mean_of_empty_raises():\n"
                                   "    with pytest.raises(ValueError, match=\"empty\"):\n        mean([])\n",
        },
    },
    {
        "name": "calendar",
        "problem": "is_leap_year(1900) returns True, but 1900 was not a leap year: century years are leap years "
                   "only when divisible by 400 (2000 was, 1900 and 2100 are not).",
        "base": {
            "calendarkit/__init__.py": "from .leap import is_leap_year\n",
            "calendarkit/leap.py": "def is_leap_year(year: int) -> bool:\n"
                                   "    \"\"\"Whether `year` has a 29th of February (Gregorian calendar).\"\"\"\n"
                                   "    return year % 4 == 0\n",
            "tests/test_leap.py": "from calendarkit import is_leap_year\n\n\ndef test_2024_is_leap():\n"
                                  "    assert is_leap_year(2024)\n\n\ndef test_2023_is_not_leap():\n"
                                  "    assert not is_leap_year(2023)\n",
        },
        "gold": {
            "calendarkit/leap.py": "def is_leap_year(year: int) -> bool:\n"
                                   "    \"\"\"Whether `year` has a 29th of February (Gregorian calendar).\"\"\"\n"
                                   "    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)\n",
        },
        "tests": {
            "tests/test_leap.py": "from calendarkit import is_leap_year\n\n\ndef test_2024_is_leap():\n"
                                  "    assert is_leap_year(2024)\n\n\ndef test_2023_is_not_leap():\n"
                                  "    assert not is_leap_year(2023)\n\n\ndef test_1900_is_not_leap():\n"
                                  "    assert not is_leap_year(1900)\n\n\ndef test_2000_is_leap():\n"
                                  "    assert is_leap_year(2000)\n",
        },
    },
    {
        "name": "stack",
        "problem": "Stack.peek() on an empty stack returns None, which hides bugs. It should raise "
                   "IndexError('peek from empty stack'), like pop() does.",
        "base": {
            "stackkit/__init__.py": "from .stack import Stack\n",
            "stackkit/stack.py": "class Stack:\n    \"\"\"A last-in first-out stack.\"\"\"\n\n"
                                 "    def __init__(self):\n        self._items = []\n\n"
                                 "    def push(self, item):\n        self._items.append(item)\n\n"
                                 "    def pop(self):\n        if not self._items:\n"
                                 "            raise IndexError(\"pop from empty stack\")\n"
                                 "        return self._items.pop()\n\n"
                                 "    def peek(self):\n        return self._items[-1] if self._items else None\n",
            "tests/test_stack.py": "from stackkit import Stack\n\n\ndef test_push_then_pop():\n    s = Stack()\n"
                                   "    s.push(1)\n    s.push(2)\n    assert s.pop() == 2 and s.peek() == 1\n",
        },
        "gold": {
            "stackkit/stack.py": "class Stack:\n    \"\"\"A last-in first-out stack.\"\"\"\n\n"
                                 "    def __init__(self):\n        self._items = []\n\n"
                                 "    def push(self, item):\n        self._items.append(item)\n\n"
                                 "    def pop(self):\n        if not self._items:\n"
                                 "            raise IndexError(\"pop from empty stack\")\n"
                                 "        return self._items.pop()\n\n"
                                 "    def peek(self):\n        if not self._items:\n"
                                 "            raise IndexError(\"peek from empty stack\")\n"
                                 "        return self._items[-1]\n",
        },
        "tests": {
            "tests/test_stack.py": "import pytest\n\nfrom stackkit import Stack\n\n\ndef test_push_then_pop():\n"
                                   "    s = Stack()\n    s.push(1)\n    s.push(2)\n"
                                   "    assert s.pop() == 2 and s.peek() == 1\n\n\n"
                                   "def test_peek_empty_raises():\n    with pytest.raises(IndexError):\n"
                                   "        Stack().peek()\n",
        },
    },
    {
        "name": "romans",
        "problem": "to_roman(4) returns 'IIII' and to_roman(1994) returns 'MDCCCCLXXXXIIII'. Roman numerals use "
                   "subtractive pairs: 4 is 'IV', 9 is 'IX', 40 'XL', 90 'XC', 400 'CD', 900 'CM' "
                   "(1994 is 'MCMXCIV').",
        "base": {
            "romans/__init__.py": "from .convert import to_roman\n",
            "romans/convert.py": "SYMBOLS = [(1000, \"M\"), (500, \"D\"), (100, \"C\"), (50, \"L\"), (10, \"X\"), "
                                 "(5, \"V\"), (1, \"I\")]\n\n\ndef to_roman(number: int) -> str:\n"
                                 "    \"\"\"Roman numeral of a positive integer.\"\"\"\n    out = \"\"\n"
                                 "    for value, symbol in SYMBOLS:\n        while number >= value:\n"
                                 "            out += symbol\n            number -= value\n    return out\n",
            "tests/test_convert.py": "from romans import to_roman\n\n\ndef test_additive_numbers():\n"
                                     "    assert to_roman(3) == \"III\" and to_roman(2025) == \"MMXXV\"\n",
        },
        "gold": {
            "romans/convert.py": "SYMBOLS = [(1000, \"M\"), (900, \"CM\"), (500, \"D\"), (400, \"CD\"), (100, \"C\"), "
                                 "(90, \"XC\"), (50, \"L\"), (40, \"XL\"), (10, \"X\"), (9, \"IX\"), (5, \"V\"), "
                                 "(4, \"IV\"), (1, \"I\")]\n\n\ndef to_roman(number: int) -> str:\n"
                                 "    \"\"\"Roman numeral of a positive integer.\"\"\"\n    out = \"\"\n"
                                 "    for value, symbol in SYMBOLS:\n        while number >= value:\n"
                                 "            out += symbol\n            number -= value\n    return out\n",
        },
        "tests": {
            "tests/test_convert.py": "from romans import to_roman\n\n\ndef test_additive_numbers():\n"
                                     "    assert to_roman(3) == \"III\" and to_roman(2025) == \"MMXXV\"\n\n\n"
                                     "def test_subtractive_pairs():\n    assert to_roman(4) == \"IV\"\n"
                                     "    assert to_roman(1994) == \"MCMXCIV\"\n",
        },
    },
]


def build_instance(task: dict, workdir: Path) -> dict:
    repo = workdir / task["name"]
    base_commit = init_repo(repo, task["base"])
    write_files(repo, task["gold"])
    patch = diff_worktree(repo)
    _restore(repo)
    write_files(repo, task["tests"])
    test_patch = diff_worktree(repo)
    _restore(repo)
    instance = {
        "repo": f"hf-bdlm/{task['name']}", "instance_id": f"hf-bdlm__{task['name']}-1", "base_commit": base_commit,
        "patch": patch, "test_patch": test_patch, "problem_statement": task["problem"], "hints_text": "",
        "created_at": CREATED_AT, "version": "0.1", "environment_setup_commit": base_commit,
        "repo_files": task["base"],
    }
    status = {}
    for label, model_patch in (("before", ""), ("after", patch)):
        _restore(repo)
        status[label] = _pytest_status(run_instance_tests(instance, repo, model_patch))
    fail_to_pass = [t for t, s in status["after"].items() if s == "PASSED" and status["before"].get(t) != "PASSED"]
    pass_to_pass = [t for t, s in status["after"].items() if s == "PASSED" and status["before"].get(t) == "PASSED"]
    if not fail_to_pass:
        raise RuntimeError(f"task {task['name']}: no test fails before the gold patch and passes after it")
    instance["FAIL_TO_PASS"] = json.dumps(fail_to_pass)
    instance["PASS_TO_PASS"] = json.dumps(pass_to_pass)
    return instance


def _restore(repo: Path) -> None:
    git(repo, "reset", "-q", "--hard")
    git(repo, "clean", "-qfdx")


def _pytest_status(log: str) -> dict[str, str]:
    return parse_log_pytest(log, None)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        instances = [build_instance(task, Path(tmp)) for task in TASKS]
    OUT.write_text("".join(json.dumps(instance) + "\n" for instance in instances))
    for instance in instances:
        print(f"{instance['instance_id']}: FAIL_TO_PASS {instance['FAIL_TO_PASS']}, "
              f"PASS_TO_PASS {instance['PASS_TO_PASS']}")
    print(f"wrote {len(instances)} instances to {OUT}")


if __name__ == "__main__":
    main()
