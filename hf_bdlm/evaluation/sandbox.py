"""Local sandbox directories: a task's repository or files laid out in a fresh folder, patches, test runs.

A "sandbox" here is a working directory, not isolation: the agent's commands run as the current user with this
folder as their working directory (as mini-swe-agent's `LocalEnvironment` does). Run untrusted models inside a
container or VM; the Docker paths of `hf-bdlm eval` do that.

    from hf_bdlm.evaluation.sandbox import checkout_instance, run_instance_tests
    repo = checkout_instance(instance, "/tmp/sandbox/hf-bdlm__textkit-1")    # git repo at base_commit
    log = run_instance_tests(instance, repo, model_patch)                   # swebench-style eval log
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from swebench.harness.constants import (
    APPLY_PATCH_FAIL,
    APPLY_PATCH_PASS,
    END_TEST_OUTPUT,
    START_TEST_OUTPUT,
    TEST_EXIT_CODE,
)

# Fixed identity and dates make the base commit's hash a function of the files alone, so the shipped instances
# can name their `base_commit` and a checkout can be checked against it.
_GIT_ENV = {
    "GIT_AUTHOR_NAME": "hf-bdlm", "GIT_AUTHOR_EMAIL": "tasks@hf-bdlm.invalid", "GIT_AUTHOR_DATE": "2025-01-01T00:00:00Z",
    "GIT_COMMITTER_NAME": "hf-bdlm", "GIT_COMMITTER_EMAIL": "tasks@hf-bdlm.invalid",
    "GIT_COMMITTER_DATE": "2025-01-01T00:00:00Z", "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull,
}
TEST_TIMEOUT_S = 120


def git(repo: str | Path, *args: str, input: str | None = None, check: bool = True) -> str:
    result = subprocess.run(["git", *args], cwd=repo, input=input, capture_output=True, text=True,
                            env={**os.environ, **_GIT_ENV})
    if check and result.returncode:
        raise RuntimeError(f"git {' '.join(args)} failed in {repo}: {result.stderr.strip()}")
    return result.stdout


def write_files(root: str | Path, files: dict[str, str]) -> None:
    root = Path(root)
    for rel, text in files.items():
        path = root / rel
        if not path.resolve().is_relative_to(root.resolve()):
            raise ValueError(f"file {rel!r} lies outside the sandbox {root}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def init_repo(root: str | Path, files: dict[str, str]) -> str:
    """Create a git repository holding `files` in one commit; returns the commit hash (deterministic)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    write_files(root, files)
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "base")
    return git(root, "rev-parse", "HEAD").strip()


def checkout_instance(instance: dict, root: str | Path) -> Path:
    """Lay out an offline instance's repository (its `repo_files`) at its `base_commit` in `root` (must not exist)."""
    root = Path(root)
    if root.exists() and any(root.iterdir()):
        raise FileExistsError(f"sandbox {root} is not empty")
    if "repo_files" not in instance:
        raise ValueError(f"instance {instance.get('instance_id')!r} carries no repo_files: it needs the Docker "
                         "harness (a real SWE-bench instance) rather than a local sandbox.")
    commit = init_repo(root, instance["repo_files"])
    if instance.get("base_commit") and commit != instance["base_commit"]:
        raise RuntimeError(f"checkout of {instance['instance_id']} gave commit {commit}, the instance says "
                           f"{instance['base_commit']}: the shipped files and the instance disagree.")
    return root


def apply_patch(repo: str | Path, patch: str) -> tuple[bool, str]:
    """`git apply` a patch (empty: nothing to do); returns (applied, git's message)."""
    if not patch.strip():
        return True, ""
    text = patch if patch.endswith("\n") else patch + "\n"
    result = subprocess.run(["git", "apply", "--whitespace=nowarn", "-"], cwd=repo, input=text, capture_output=True,
                            text=True, env={**os.environ, **_GIT_ENV})
    return result.returncode == 0, result.stderr.strip()


def diff_worktree(repo: str | Path, exclude: list[str] = ()) -> str:
    """The working tree's changes against HEAD (new files included), leaving out `exclude` paths."""
    git(repo, "add", "-A")
    specs = ["--", "."] + [f":(exclude){path}" for path in exclude]
    out = git(repo, "diff", "--cached", "HEAD", *specs)
    git(repo, "reset", "-q")
    return out


def patched_files(patch: str) -> list[str]:
    """Paths a unified diff touches (its `+++ b/...` / `--- a/...` headers)."""
    paths = re.findall(r"^(?:\+\+\+ b/|--- a/)(\S+)", patch, flags=re.M)
    return list(dict.fromkeys(paths))


def run_instance_tests(instance: dict, repo: str | Path, model_patch: str | None) -> str:
    """Grade-time run of an offline instance, written as a SWE-bench evaluation log.

    Applies the model patch, then the test patch, runs pytest (`-rA`, as SWE-bench's Python specs do) on the files
    the test patch touches, and frames the output with the harness's markers so that `swebench`'s own log parser
    and report functions read it.
    """
    lines = []
    applied, message = apply_patch(repo, model_patch or "")
    if not applied:
        return f"{APPLY_PATCH_FAIL}\n{message}\n"
    lines.append(APPLY_PATCH_PASS)
    ok, message = apply_patch(repo, instance["test_patch"])
    if not ok:
        raise RuntimeError(f"the test patch of {instance['instance_id']} does not apply: {message}")
    test_files = patched_files(instance["test_patch"])
    command = [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "-o", "addopts=", *test_files]
    try:
        result = subprocess.run(command, cwd=repo, capture_output=True, text=True, timeout=TEST_TIMEOUT_S,
                                env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(repo)})
        output, code = result.stdout + result.stderr, result.returncode
    except subprocess.TimeoutExpired as err:
        output, code = (err.stdout or "") if isinstance(err.stdout, str) else "", 124
    lines += [START_TEST_OUTPUT, output, END_TEST_OUTPUT, f"{TEST_EXIT_CODE}: {code}"]
    return "\n".join(lines) + "\n"
