"""The fast-apply task's scorers: one implementation for the decoding study, evaluations and reward functions.

Two rules, both on the decoded text (special tokens skipped):

- **exact match** (:func:`exact_match`): line for line, after :func:`normalize_code` (trailing whitespace of each
  line, blank lines around the function and one code fence around the whole reply ignored);
- **AST match** (:func:`ast_equal`): ``ast.dump(ast.parse(...))`` equality, so formatting and comments do not count
  while any change of code does; a reply that does not parse fails it.

    from hf_bdlm.data.fast_apply.scoring import score, exact_match_reward, ast_equal_reward
    score(model_text, record["answer"])             # {"exact_match": True, "ast_equal": True}
    # TRL reward functions (the dataset's `answer` column arrives as a keyword):
    GRPOTrainer(..., reward_funcs=[exact_match_reward, ast_equal_reward])
"""

from __future__ import annotations

import ast

SCORERS = ("exact_match", "ast_equal")


def _unfence(text: str) -> str:
    """The body of `text` when the whole of it (surrounding whitespace aside) is one fenced code block."""
    lines = text.strip().split("\n")
    if len(lines) >= 2 and lines[0].startswith("```") and lines[-1].strip() == "```":
        return "\n".join(lines[1:-1])
    return text


def normalize_code(text: str) -> str:
    """The text exact match compares: `text` with one enclosing code fence removed (if the whole text is one fenced
    block), trailing whitespace removed from every line, and blank lines at the start and the end dropped. Leading
    indentation, inner blank lines and everything else are kept."""
    lines = [line.rstrip() for line in _unfence(text).replace("\r\n", "\n").split("\n")]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return "\n".join(lines)


def exact_match(pred: str, ref: str) -> bool:
    """Whether a generated function equals the expected one, line for line.

    The rule: both sides go through :func:`normalize_code` (trailing whitespace of each line and blank lines around the
    function are ignored, and so is one code fence around the whole reply); everything else, indentation, comments,
    inner blank lines and quotes included, must be identical. Decode with `skip_special_tokens=True` first.
    """
    return normalize_code(pred) == normalize_code(ref)


def ast_equal(pred: str, ref: str) -> bool:
    """Whether a generated function parses to the same syntax tree as the expected one: `ast.dump` equality of the
    parsed modules (after the same fence removal as :func:`exact_match`), so formatting and comments do not count
    while any change of code, docstrings included, does. False when either side does not parse."""
    try:
        return ast.dump(ast.parse(normalize_code(pred))) == ast.dump(ast.parse(normalize_code(ref)))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False


def score(completion: str, answer: str) -> dict[str, bool]:
    """Both rules on one reply: ``{"exact_match": ..., "ast_equal": ...}`` (exact match implies AST match whenever the
    answer parses, as every shipped answer does)."""
    return {"exact_match": exact_match(completion, answer), "ast_equal": ast_equal(completion, answer)}


def completion_text(completion) -> str:
    """The text of one completion as TRL hands it to a reward function: a string, or (conversational datasets) a list
    of messages whose last one is the assistant's reply."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content", ""))
    return completion_text(completion[-1]) if completion else ""


def _reward(rule, completions, answer) -> list[float]:
    if isinstance(answer, str):
        answer = [answer] * len(completions)
    if len(answer) != len(completions):
        raise ValueError(f"{len(completions)} completions but {len(answer)} answers")
    return [float(rule(completion_text(c), a)) for c, a in zip(completions, answer)]


def exact_match_reward(completions, answer, **kwargs) -> list[float]:
    """A TRL reward function: 1.0 for each completion that matches its `answer` exactly (:func:`exact_match`), else
    0.0. ``completions``: strings or conversational message lists; ``answer``: the dataset's column (one per
    completion); other keywords (``prompts``, the other columns) are ignored."""
    return _reward(exact_match, completions, answer)


def ast_equal_reward(completions, answer, **kwargs) -> list[float]:
    """A TRL reward function: 1.0 for each completion whose syntax tree equals its `answer`'s (:func:`ast_equal`),
    else 0.0 (a completion that does not parse gets 0.0). Arguments as :func:`exact_match_reward`."""
    return _reward(ast_equal, completions, answer)
