"""The verifiable rewards (hf_bdlm/rl/rewards.py): each a TRL reward function, called as TRL calls it (``prompts``,
``completions``, ``completion_ids`` and the dataset's other columns as keywords) and by TRL's own `GRPOTrainer`.

- arithmetic exact match: right and wrong answers, plain and conversational completions;
- fast-apply exact match and AST match: a reformatted reply matches by AST only, a changed one by neither;
- code execution: a passing program, a failing one, one that raises, one that runs past the timeout (each checked by
  HumanEval's check in a fresh interpreter).
"""

from __future__ import annotations

import time

import pytest
import torch
from datasets import Dataset

from hf_bdlm.data import load_arith
from hf_bdlm.rl.rewards import arith_exact_match, code_execution, fast_apply_ast_match, fast_apply_exact_match


def trl_keywords(completions, **columns):
    """The keywords TRL's ``_calculate_rewards`` passes besides the columns."""
    return dict(completion_ids=[[0]] * len(completions), trainer_state=None, log_extra=lambda *a: None,
                log_metric=lambda *a: None, **columns)


def test_arith_exact_match_on_the_shipped_records():
    records = load_arith("test").select(range(3))
    answers = list(records["answer"])
    right = [f" {a}.\n" for a in answers]
    wrong = [[{"role": "assistant", "content": f"The answer is {a}"}] for a in answers]
    prompts = list(records["prompt"])
    keywords = trl_keywords(right, answer=answers, task=list(records["task"]))
    assert arith_exact_match(prompts=prompts, completions=right, **keywords) == [1.0] * 3
    assert arith_exact_match(prompts=prompts, completions=wrong, **trl_keywords(wrong, answer=answers)) == [0.0] * 3
    chat = [[{"role": "assistant", "content": a}] for a in answers]
    assert arith_exact_match(prompts=prompts, completions=chat, **trl_keywords(chat, answer=answers)) == [1.0] * 3


ANSWER = "def f(x):\n    # double it\n    return x * 2\n"


def test_fast_apply_exact_and_ast_match():
    completions = [ANSWER, "```python\n" + ANSWER + "```", "def f(x):\n    return (x*2)\n",
                   "def f(x):\n    return x * 3\n", "def f(x:\n"]
    keywords = trl_keywords(completions, answer=[ANSWER] * len(completions))
    assert fast_apply_exact_match(prompts=[""] * 5, completions=completions, **keywords) == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert fast_apply_ast_match(prompts=[""] * 5, completions=completions, **keywords) == [1.0, 1.0, 1.0, 0.0, 0.0]


PROMPT = 'def add(a, b):\n    """The sum of a and b."""\n'
TEST = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"


def test_code_execution_passes_fails_and_times_out():
    completions = ["    return a + b\n", "    return a - b\n", "    raise ValueError('no')\n",
                   "    while True:\n        pass\n"]
    start = time.perf_counter()
    rewards = code_execution(prompts=[PROMPT] * 4, completions=completions, timeout=1.0,
                             **trl_keywords(completions, test=[TEST] * 4, entry_point=["add"] * 4))
    assert rewards == [1.0, 0.0, 0.0, 0.0]
    assert time.perf_counter() - start < 60
    # A conversational reply is the whole program (one code fence removed).
    chat = [[{"role": "assistant", "content": "```python\ndef add(a, b):\n    return a + b\n```"}]]
    assert code_execution(prompts=[[{"role": "user", "content": "Write add."}]], completions=chat, timeout=1.0,
                          **trl_keywords(chat, test=[TEST], entry_point=["add"])) == [1.0]


def test_trls_own_grpo_trainer_takes_them():
    from fixtures import tiny_target
    from tiny_bdlm import tiny_tokenizer
    from trl import GRPOConfig, GRPOTrainer

    records = load_arith("train").select(range(4))
    data = Dataset.from_dict({"prompt": [r[0]["content"] for r in records["prompt"]], "answer": records["answer"]})
    trainer = GRPOTrainer(tiny_target("llama", vocab_size=64, max_position_embeddings=256, eos_token_id=3,
                                      pad_token_id=1, bos_token_id=2),
                          reward_funcs=[arith_exact_match, fast_apply_ast_match], train_dataset=data,
                          processing_class=tiny_tokenizer(),
                          args=GRPOConfig(output_dir="unused", per_device_train_batch_size=4, num_generations=2,
                                          max_completion_length=4, max_steps=1, report_to=[], use_cpu=True, bf16=False,
                                          gradient_checkpointing=False, save_strategy="no", disable_tqdm=True,
                                          logging_steps=1))
    trainer.train()
    logged = trainer.state.log_history[0]
    assert "rewards/arith_exact_match/mean" in logged and "rewards/fast_apply_ast_match/mean" in logged
    assert torch.isfinite(torch.tensor(logged["loss"]))


@pytest.mark.parametrize("column", ["answer", "test"])
def test_a_column_of_the_wrong_length_is_refused(column):
    with pytest.raises(ValueError, match=f"2 completions but 1 values of the column '{column}'"):
        if column == "answer":
            arith_exact_match(prompts=["a", "b"], completions=["1", "2"], answer=["1"])
        else:
            code_execution(prompts=["a", "b"], completions=["1", "2"], test=[TEST], entry_point="add")
