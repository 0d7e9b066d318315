"""Verifiable rewards, each a TRL reward function: ``reward(prompts, completions, **columns) -> list[float]`` (TRL
passes the dataset's other columns as keywords, one value per completion), usable by `BDLMGRPOTrainer` and by TRL's own
`GRPOTrainer` alike.

- :func:`arith_exact_match`: the shipped arithmetic tasks (``hf_bdlm:arith``, column ``answer``), scored by their
  exact-match rule (:func:`hf_bdlm.data.exact_match`);
- :func:`fast_apply_exact_match`, :func:`fast_apply_ast_match`: the fast-apply task (``hf_bdlm:fast_apply``, column
  ``answer``), scored by the task's own scorers (:mod:`hf_bdlm.data.fast_apply.scoring`: line-for-line exact match,
  syntax-tree equality);
- :func:`code_execution`: the completion's program run against the record's tests (columns ``test`` and
  ``entry_point``, HumanEval's form: ``def check(candidate): ...``) by HumanEval's check, in a fresh interpreter per
  completion under a timeout (:func:`hf_bdlm.evaluation.humaneval.check_completion`: ``python -I``, a bare
  environment, no sockets but ``AF_UNIX``, no new programs, an address-space limit); 1.0 when every test passes.

A completion is a string, or (conversational datasets) a list of messages whose last one is the reply.

    GRPOTrainer(model, reward_funcs=[arith_exact_match], train_dataset=load_arith("train"), ...)
"""

from __future__ import annotations

import concurrent.futures

from ..data import exact_match
from ..data.fast_apply.scoring import ast_equal, completion_text
from ..data.fast_apply.scoring import exact_match as fast_apply_rule
from ..evaluation.humaneval import MEMORY_BYTES, TIMEOUT_S, check_completion, cut_completion

CODE_WORKERS = 4  # completions checked at once (each in its own interpreter)


def _per_completion(column, completions, name: str) -> list:
    """A dataset column as TRL passes it (one value per completion), or one value for all."""
    values = [column] * len(completions) if isinstance(column, str) or column is None else list(column)
    if len(values) != len(completions):
        raise ValueError(f"{len(completions)} completions but {len(values)} values of the column {name!r}.")
    return values


def _rule_reward(rule, completions, answer) -> list[float]:
    answers = _per_completion(answer, completions, "answer")
    return [float(bool(rule(completion_text(c), a))) for c, a in zip(completions, answers)]


def arith_exact_match(completions, answer, **kwargs) -> list[float]:
    """1.0 for each completion whose text equals its record's ``answer`` by the arithmetic tasks' rule (surrounding
    whitespace and one trailing period ignored, case kept), else 0.0."""
    return _rule_reward(exact_match, completions, answer)


def fast_apply_exact_match(completions, answer, **kwargs) -> list[float]:
    """1.0 for each completion equal to its record's ``answer`` line for line (trailing whitespace, blank lines around
    the function and one code fence ignored), else 0.0."""
    return _rule_reward(fast_apply_rule, completions, answer)


def fast_apply_ast_match(completions, answer, **kwargs) -> list[float]:
    """1.0 for each completion that parses to the syntax tree of its record's ``answer`` (formatting and comments do
    not count), else 0.0 (a completion that does not parse: 0.0)."""
    return _rule_reward(ast_equal, completions, answer)


def _program(prompt, completion) -> tuple[str, str]:
    """``(prompt code, completion code)`` of one sample: a plain-text prompt is the code the completion continues
    (HumanEval's form; the completion is cut at HumanEval's stop sequences); a conversational one is not code, and
    the reply is the whole program (one enclosing code fence removed)."""
    text = completion_text(completion)
    if isinstance(prompt, str):
        return prompt, cut_completion(text)
    lines = text.strip().split("\n")
    if len(lines) >= 2 and lines[0].startswith("```") and lines[-1].strip() == "```":
        text = "\n".join(lines[1:-1])
    return "", text


def code_execution(prompts, completions, test, entry_point, task_id=None, timeout: float = TIMEOUT_S,
                   memory_bytes: int | None = MEMORY_BYTES, **kwargs) -> list[float]:
    """1.0 for each completion whose program passes its record's tests, 0.0 when a test fails, it raises or it runs
    past ``timeout`` seconds (module docstring). Columns: ``test`` (the tests, defining ``check(candidate)``),
    ``entry_point`` (the function they check), optionally ``task_id`` (named in the check's result)."""
    tests = _per_completion(test, completions, "test")
    entries = _per_completion(entry_point, completions, "entry_point")
    ids = _per_completion(task_id, completions, "task_id")
    problems, programs = [], []
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        code_prompt, code = _program(prompt, completion)
        problems.append({"task_id": ids[i] if ids[i] is not None else f"sample/{i}", "prompt": code_prompt,
                         "test": tests[i], "entry_point": entries[i]})
        programs.append(code)
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(CODE_WORKERS, len(problems) or 1)) as pool:
        results = list(pool.map(lambda pc: check_completion(pc[0], pc[1], timeout, None, memory_bytes),
                                zip(problems, programs)))
    return [1.0 if r["passed"] else 0.0 for r in results]


__all__ = ["arith_exact_match", "code_execution", "fast_apply_ast_match", "fast_apply_exact_match"]
