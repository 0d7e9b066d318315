"""The shipped lm-eval task ``fast_apply`` (``hf_bdlm/data/fast_apply/lm_eval_task``), run by lm-eval's own code.

lm-eval builds the task from the YAML (400 held-out docs, the chat prompt the recipes train on, 384 new tokens), sends
its ``generate_until`` requests to a model and scores the replies with the task's rules: the gold answers score 1 on
both metrics, a commented copy scores an AST match and no exact match, an empty reply neither. ``hf-bdlm lm-eval``
finds the task without ``--include_path``.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.api.model import LM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from hf_bdlm.cli import LM_EVAL_TASKS  # noqa: E402
from hf_bdlm.data.fast_apply import load_fast_apply  # noqa: E402


class Replies(LM):
    """Answers each request from the held-out answer of its prompt, changed by ``how``; logs the requests."""

    def __init__(self, how):
        super().__init__()
        self.how, self.requests = how, []
        self.answers = {r["prompt"][0]["content"]: r["answer"] for r in load_fast_apply("heldout")}

    def generate_until(self, requests, disable_tqdm=False):
        self.requests += requests
        return [self.how(self.answers[r.args[0]]) for r in requests]

    def loglikelihood(self, requests, disable_tqdm=False):
        raise AssertionError("fast_apply is a generation task")

    loglikelihood_rolling = loglikelihood


def evaluate(how, limit=None):
    model = Replies(how)
    results = lm_eval.simple_evaluate(model=model, tasks=["fast_apply"], limit=limit,
                                      task_manager=TaskManager(include_path=str(LM_EVAL_TASKS)))
    return model, results["results"]["fast_apply"]


def test_the_gold_answers_score_one_on_both_metrics_over_all_400_prompts():
    model, scores = evaluate(lambda answer: answer)
    assert len(model.requests) == 400
    assert (scores["exact_match,none"], scores["ast_match,none"]) == (1.0, 1.0)
    until, kwargs = model.requests[0].args[1]["until"], model.requests[0].args[1]
    assert until == [] and kwargs["max_gen_toks"] == 384 and kwargs["do_sample"] is False
    assert model.requests[0].args[0].startswith("Apply the edit below to the function from the Python standard library")


def test_a_comment_is_an_ast_match_and_no_exact_match_and_an_empty_reply_is_neither():
    def commented(answer):
        first, _, rest = answer.partition("\n")
        return f"{first}  # edited\n{rest}"

    _, scores = evaluate(commented, limit=20)
    assert (scores["exact_match,none"], scores["ast_match,none"]) == (0.0, 1.0)
    _, scores = evaluate(lambda answer: "", limit=20)
    assert (scores["exact_match,none"], scores["ast_match,none"]) == (0.0, 0.0)


def test_hf_bdlm_lm_eval_finds_the_shipped_task_without_include_path():
    listed = subprocess.run([sys.executable, "-m", "hf_bdlm.cli", "lm-eval", "ls", "tasks"], capture_output=True,
                            text=True, timeout=300)
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert "fast_apply" in listed.stdout
