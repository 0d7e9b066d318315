"""Fast-apply code edits: a shipped task with long answers taken from real code.

Each prompt holds a Python function from the standard library's own source (human-written, PSF licence; the
interpreter version is pinned in `build.py` and recorded in every record and in `NOTICE`) and an edit written the way
code-editing tools write one: only the changed region with two lines of context, every elided part replaced by a
`# ... existing code ...` line. The answer is the whole edited function, bare (no code fence): most of it is copied
from the prompt, which is where decoding many tokens per step should pay.

The records follow the shipped arithmetic dataset's schema (TRL's conversational prompt/completion format plus the
bare `answer` and the `task`), so the SFT recipe and the held-out exact-match scorer take them as they are:

    {"prompt": [{"role": "user", "content": "Apply the edit below to the function from ..."}],
     "completion": [{"role": "assistant", "content": "def _munge_whitespace(self, text):\\n    ..."}],
     "answer": "def _munge_whitespace(self, text):\\n    ...", "task": "fast_apply",
     "edit": "inserted_statement", "edit_detail": "log of text", "module": "textwrap",
     "qualname": "TextWrapper._munge_whitespace", "source": "Lib/textwrap.py:143-154", "python_version": "3.11.7",
     "original": "def _munge_whitespace(self, text):\\n    ...", "snippet": "...", "answer_tokens": 148}

`train.jsonl` and `heldout.jsonl` share no source module (nor top-level package). Loading:

    from hf_bdlm.data.fast_apply import load_fast_apply, exact_match, ast_equal
    heldout = load_fast_apply("heldout")                  # list of dicts (json, no `datasets`)
    exact_match(model_text, heldout[0]["answer"]), ast_equal(model_text, heldout[0]["answer"])

or, through `datasets`, `load_fast_apply_dataset("heldout")`, or `load_splits(str(FAST_APPLY_DIR))` from
`hf_bdlm.data` (the folder's `README.md` maps `train.jsonl` to the split `train` and `heldout.jsonl` to `test`, the
held-out split name the recipes read by default). Rebuild the files with `python -m hf_bdlm.data.fast_apply.build`.

The scorers live in :mod:`.scoring` (re-exported here): `exact_match`, `ast_equal`, `score` (both on one reply)
and the TRL reward functions `exact_match_reward` and `ast_equal_reward`; the decoding study scores with them
(``hf-bdlm bench --only decoding --decoding-task fast_apply``). Through `hf_bdlm.data`, ``load_splits(
"hf_bdlm:fast_apply")`` gives `(train, heldout)` as `datasets.Dataset`s, the name the SFT recipe and ``hf-bdlm
train --dataset`` take. `hf_bdlm.evaluation.exact_match.held_out_exact_match` scores with `hf_bdlm.data.exact_match`
(the arithmetic rule: surrounding whitespace ignored, the rest identical, so a little stricter than this task's
`exact_match`); give it `max_new_tokens` of at least `build.MAX_TOKENS` (320) for these answers, and score the
answers it returns with `exact_match` / `ast_equal` from here for this task's rules.
"""

from __future__ import annotations

import json
import pathlib

from tokenizers import Tokenizer

from ...cache import cache_home
from .scoring import ast_equal, exact_match, normalize_code  # noqa: F401  (the scorers, re-exported)

FAST_APPLY_DIR = pathlib.Path(__file__).resolve().parent
SPLITS = ("train", "heldout")
MARKER = "# ... existing code ..."
EDIT_KINDS = ("inserted_statement", "changed_literal", "changed_condition", "renamed_local", "removed_line",
              "new_argument")
INSTRUCTION = (
    "Apply the edit below to the function from the Python standard library module `{module}`. In the edit, the "
    f"lines `{MARKER}` stand for unchanged lines of the function. Reply with the whole edited function and nothing "
    "else: no code fence, no explanation."
)


def fast_apply_path(split: str) -> pathlib.Path:
    """Path of the packaged jsonl file of `split` (`"train"` or `"heldout"`; `"test"` is accepted for `"heldout"`)."""
    split = "heldout" if split == "test" else split
    if split not in SPLITS:
        raise ValueError(f"Unknown split {split!r}: the fast-apply dataset has the splits {SPLITS}.")
    return FAST_APPLY_DIR / f"{split}.jsonl"


def load_fast_apply(split: str) -> list[dict]:
    """The records of one split, in file order, as a list of dicts (standard library only)."""
    with open(fast_apply_path(split), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_fast_apply_dataset(split: str):
    """One split as a `datasets.Dataset` (columns as in the jsonl file), like `hf_bdlm.data.load_arith`."""
    # lazy: keeps hf-bdlm --help and make_dataset.py free of datasets (tests/package/test_cli_help.py)
    import datasets

    path = fast_apply_path(split)
    return datasets.load_dataset("json", data_files={path.stem: str(path)}, split=path.stem)


def format_prompt(module: str, original: str, snippet: str) -> str:
    """The user message of a record: the instruction, the original function and the edit, each in a fenced block."""
    return (f"{INSTRUCTION.format(module=module)}\n\n"
            f"Function:\n```python\n{original}\n```\n\n"
            f"Edit:\n```python\n{snippet}\n```")


def prompt_text(record: dict) -> str:
    """The user message of a record (the text a plain completion model would be given)."""
    return record["prompt"][0]["content"]


def chat_messages(record: dict, with_answer: bool = False) -> list[dict]:
    """The record's chat messages: the user turn, and the assistant's answer too with `with_answer=True` (SFT)."""
    messages = [dict(m) for m in record["prompt"]]
    if with_answer:
        messages += [dict(m) for m in record["completion"]]
    return messages


# The folder of the exported embedded model under the cache root: `hf_bdlm.embedded.DEFAULT_MODEL_NAME`, named here
# because the data room does not import `embedded` (tests/package/test_layering.py LAYERS); a test checks they agree.
EMBEDDED_MODEL_FOLDER = "smollm2-135m-instruct"
_TOKENIZER = None


def embedded_tokenizer():
    """The embedded SmolLM2 tokenizer (a `tokenizers.Tokenizer`), read from the exported model folder
    (`$HF_BDLM_HOME` or `~/.cache/hf_bdlm`, then `smollm2-135m-instruct/tokenizer.json`); cached.

    Raises:
        FileNotFoundError: when the model was never exported (`python -m hf_bdlm.embedded` exports it).
    """
    global _TOKENIZER
    if _TOKENIZER is None:
        path = cache_home() / EMBEDDED_MODEL_FOLDER / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing: the fast-apply token counts use the embedded SmolLM2 tokenizer. Export the "
                "embedded model once with: python -m hf_bdlm.embedded")
        _TOKENIZER = Tokenizer.from_file(str(path))
    return _TOKENIZER


def count_tokens(text: str) -> int:
    """Number of tokens of `text` for the embedded SmolLM2 tokenizer, special tokens excluded (the same count as
    `AutoTokenizer.from_pretrained(hf_bdlm.embedded.default_model_dir())(text, add_special_tokens=False)`)."""
    return len(embedded_tokenizer().encode(text, add_special_tokens=False).ids)
