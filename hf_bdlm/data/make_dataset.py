"""Generator of the shipped toy dataset: short prompts with answers checkable by exact match.

Eight task families (two-digit addition and subtraction, the larger of two numbers, reversing,
upper-casing and counting the letters of a word, sorting digits, the day or month before or
after another), each with a few phrasings. Answers are a few tokens long, so one diffusion
block of 16 tokens holds the whole completion. The output is TRL's conversational
prompt/completion format plus the bare `answer` (for exact match) and the `task` family:

    {"prompt": [{"role": "user", "content": "What is 37 + 45? Answer with the number only."}],
     "completion": [{"role": "assistant", "content": "82"}], "answer": "82", "task": "add"}

Deterministic (seeded, standard library only); the two splits share no prompt. Regenerate the
packaged files with:

    python -m hf_bdlm.data.make_dataset            # writes arith_train.jsonl, arith_test.jsonl here
    python hf_bdlm/data/make_dataset.py            # the same without importing hf_bdlm (no torch)
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import re
import string
from dataclasses import dataclass
from typing import Callable

SEED = 20240917
N_TRAIN = 2000
N_TEST = 200
DATA_DIR = pathlib.Path(__file__).resolve().parent

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]
# Common lowercase English words of 3-7 letters, no palindromes (their reversal would be a no-op).
WORDS = """
able acid aged also area army away baby back ball band bank base bath bear beat bell belt
bird blue boat body bone book boot born boss both bowl bread brick brown build burn busy
cake call calm camp card care cart case cash cast chair chalk cheap chess chest child city
clay clean clock cloud coat cold cook cool copy corn cost crowd cup dance dark date dish
door down draw dream dress drink drop dust early earth east easy edge empty enemy event
face fact fair farm fast field film fire fish flag flat floor flow food foot forest fork
fresh frog fruit full game garden gate gift girl glass glove goat gold grass green ground
group hair half hall hand happy hard hat head heart heavy high hill home honey horse hotel
house huge hunt idea iron island jacket jump key kind king kitchen knife lake lamp land large
leaf left lemon light lion list lunch magic map market metal milk mind money month moon
morning mother mouse mouth music nail name near neck night north nose note number ocean
office orange paint paper park party pencil people piano picture pillow plane plant plate
pocket queen quick quiet rabbit rain river road rock roof room rope round salt sand school
screen sea seed sheep shelf ship shirt shoe short silver sister skin sky sleep small smile
snake snow soft song soup south space spoon spring square star stone storm street sugar
summer sun table teacher tent thin ticket tiger tired today tooth tower town train tree
truck ugly uncle under valley voice wall warm watch water west wheel white wind window
winter wolf woman wood world yellow young zebra apple banana candle dinner doctor finger
flower guitar hammer ladder letter mirror monkey needle orbit parrot planet pepper
pirate pizza puzzle robot rocket saddle silk spider sweet thunder tomato turtle violin
wallet whale yard basket bottle butter carpet circle cookie cotton desert forest button
""".split()
WORDS = sorted({w for w in WORDS if 3 <= len(w) <= 7 and w != w[::-1]})

# What each template placeholder may look like, for parsing a prompt back into its fields.
FIELD_PATTERNS = {
    "a": r"\d+", "b": r"\d+", "word": r"[a-z]+", "digits": r"\d(?: \d)+",
    "order": r"ascending|descending", "unit": r"day|month", "direction": r"after|before",
    "name": r"[A-Z][a-z]+",
}


@dataclass(frozen=True)
class Task:
    """One family: phrasings, a sampler of template fields, and the rule giving the answer."""

    name: str
    templates: tuple[str, ...]
    sample_fields: Callable[[random.Random], dict]
    answer: Callable[..., str]
    weight: float = 1.0  # share of the examples; small for families with few distinct prompts


def _two_numbers(rng: random.Random) -> dict:
    return {"a": rng.randint(10, 99), "b": rng.randint(10, 99)}


def _ordered_numbers(rng: random.Random) -> dict:
    a, b = rng.sample(range(10, 100), 2)  # distinct, so the difference is positive
    return {"a": max(a, b), "b": min(a, b)}


def _distinct_numbers(rng: random.Random) -> dict:
    a, b = rng.sample(range(10, 1000), 2)
    return {"a": a, "b": b}


def _word(rng: random.Random) -> dict:
    return {"word": rng.choice(WORDS)}


def _digits(rng: random.Random) -> dict:
    digits = [rng.randint(0, 9) for _ in range(rng.choice((3, 4)))]
    return {"digits": " ".join(map(str, digits)), "order": rng.choice(("ascending", "descending"))}


def _calendar(rng: random.Random) -> dict:
    unit = rng.choice(("day", "month"))
    return {"unit": unit, "direction": rng.choice(("after", "before")),
            "name": rng.choice(DAYS if unit == "day" else MONTHS)}


def _sort_digits(digits: str, order: str) -> str:
    return " ".join(sorted(digits.split(), reverse=order == "descending"))


def _neighbour(unit: str, direction: str, name: str) -> str:
    names = DAYS if unit == "day" else MONTHS
    step = 1 if direction == "after" else -1
    return names[(names.index(name) + step) % len(names)]


TASKS = (
    Task("add", ("What is {a} + {b}? Answer with the number only.",
                 "Compute {a} + {b}. Reply with just the number."),
         _two_numbers, lambda a, b: str(int(a) + int(b))),
    Task("subtract", ("What is {a} - {b}? Answer with the number only.",
                      "Compute {a} - {b}. Reply with just the number."),
         _ordered_numbers, lambda a, b: str(int(a) - int(b))),
    Task("larger", ("Which number is larger, {a} or {b}? Answer with the number only.",
                    "Which is bigger: {a} or {b}? Reply with just the number."),
         _distinct_numbers, lambda a, b: str(max(int(a), int(b)))),
    Task("reverse", ("Reverse the word '{word}'. Answer with the reversed word only.",
                     "Spell the word '{word}' backwards. Reply with just the result."),
         _word, lambda word: word[::-1]),
    Task("uppercase", ("Write the word '{word}' in capital letters. Answer with the word only.",
                       "Convert '{word}' to uppercase. Reply with just the result."),
         _word, lambda word: word.upper()),
    Task("count_letters", ("How many letters are in the word '{word}'? Answer with the number only.",
                           "Count the letters in '{word}'. Reply with just the number."),
         _word, lambda word: str(len(word))),
    Task("sort_digits", ("Sort these digits in {order} order: {digits}. Answer with the sorted digits only.",
                         "Put the digits {digits} in {order} order. Reply with just the digits."),
         _digits, _sort_digits),
    Task("calendar", ("What {unit} comes {direction} {name}? Answer with the {unit} only.",
                      "Name the {unit} that comes {direction} {name}. Reply with just the {unit}.",
                      "Which {unit} is {direction} {name}? Answer with one word."),
         _calendar, _neighbour, weight=0.25),
)


def _template_regex(template: str) -> re.Pattern:
    """Regex matching exactly the prompts a template produces; a repeated field must repeat."""
    parts, seen = [], set()
    for literal, field, _, _ in string.Formatter().parse(template):
        parts.append(re.escape(literal))
        if field is None:
            continue
        parts.append(f"(?P={field})" if field in seen else f"(?P<{field}>{FIELD_PATTERNS[field]})")
        seen.add(field)
    return re.compile("".join(parts))


_PARSERS = [(task, _template_regex(t)) for task in TASKS for t in task.templates]


def solve(prompt: str) -> tuple[str, str]:
    """Recompute `(task name, answer)` from a prompt's text alone.

    Raises:
        ValueError: if the prompt matches no template, or more than one.
    """
    matches = [(task, m) for task, regex in _PARSERS if (m := regex.fullmatch(prompt))]
    if len(matches) != 1:
        raise ValueError(f"Expected exactly one template to match {prompt!r}, got {len(matches)}.")
    task, match = matches[0]
    return task.name, task.answer(**match.groupdict())


def _example(task: Task, rng: random.Random) -> dict:
    # As strings, exactly as solve() will parse them back out of the prompt.
    fields = {k: str(v) for k, v in task.sample_fields(rng).items()}
    prompt = rng.choice(task.templates).format(**fields)
    answer = task.answer(**fields)
    return {
        "prompt": [{"role": "user", "content": prompt}],
        "completion": [{"role": "assistant", "content": answer}],
        "answer": answer,
        "task": task.name,
    }


def _quotas(total: int) -> list[int]:
    """Split `total` over the tasks in proportion to their weights (largest remainder)."""
    weight_sum = sum(t.weight for t in TASKS)
    exact = [total * t.weight / weight_sum for t in TASKS]
    quotas = [int(x) for x in exact]
    by_remainder = sorted(range(len(TASKS)), key=lambda i: exact[i] - quotas[i], reverse=True)
    for i in by_remainder[: total - sum(quotas)]:
        quotas[i] += 1
    return quotas


def make_splits(seed: int = SEED, n_train: int = N_TRAIN, n_test: int = N_TEST) -> tuple[list[dict], list[dict]]:
    """Build the `(train, test)` example lists; no prompt occurs twice, in a split or across."""
    rng = random.Random(seed)
    train, test = [], []
    for task, k_train, k_test in zip(TASKS, _quotas(n_train), _quotas(n_test)):
        examples, prompts = [], set()
        attempts = 0
        while len(examples) < k_train + k_test:
            attempts += 1
            if attempts > 100 * (k_train + k_test):
                raise RuntimeError(f"Task {task.name!r} has too few distinct prompts for {k_train + k_test} examples.")
            example = _example(task, rng)
            prompt = example["prompt"][0]["content"]
            if prompt not in prompts:
                prompts.add(prompt)
                examples.append(example)
        test += examples[:k_test]
        train += examples[k_test:]
    # Mix the families, so that any prefix (e.g. the first 100 test examples) covers them all.
    rng.shuffle(train)
    rng.shuffle(test)
    return train, test


def write_jsonl(examples: list[dict], path: pathlib.Path) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for example in examples:
            f.write(json.dumps(example, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--n-train", type=int, default=N_TRAIN)
    parser.add_argument("--n-test", type=int, default=N_TEST)
    parser.add_argument("--out-dir", type=pathlib.Path, default=DATA_DIR)
    args = parser.parse_args(argv)
    train, test = make_splits(args.seed, args.n_train, args.n_test)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(train, args.out_dir / "arith_train.jsonl")
    write_jsonl(test, args.out_dir / "arith_test.jsonl")
    print(f"wrote {len(train)} train and {len(test)} test examples to {args.out_dir}")


if __name__ == "__main__":
    main()
