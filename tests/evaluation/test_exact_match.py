"""The one held-out exact-match scorer, for both model families: the default budget is one block of the family, the
score counts exact answers, a seed makes a random-canvas family reproducible without touching the caller's stream."""

from __future__ import annotations


import torch


from hf_bdlm.evaluation.exact_match import held_out_exact_match  # noqa: E402
from tiny_bdlm import BLOCK, tiny_bdlm  # noqa: E402
from tiny_bdlm import tiny_tokenizer as bdlm_tokenizer  # noqa: E402


def _prompt(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_converted_model_answers_one_block_and_scores_exact_answers():
    model, tokenizer = tiny_bdlm(), bdlm_tokenizer()
    examples = [{"prompt": _prompt("a b"), "answer": "?"}, {"prompt": _prompt("b a"), "answer": "?"}]
    _, answers = held_out_exact_match(model, tokenizer, examples)
    for answer in answers:
        assert 0 < len(tokenizer(answer, add_special_tokens=False)["input_ids"]) <= BLOCK
    # The model's own answer to the first prompt is exact; a different one for the second is not.
    examples = [{"prompt": examples[0]["prompt"], "answer": answers[0]},
                {"prompt": examples[1]["prompt"], "answer": answers[1] + " extra"}]
    score, again = held_out_exact_match(model, tokenizer, examples)
    assert again == answers and score == 0.5
    assert not model.training


def test_seeded_diffusion_gemma_score_reproduces_and_leaves_the_global_stream_alone():
    from eval_callback_worker import servable_tiny_model
    from tiny_diffusion_gemma import tiny_tokenizer

    model, tokenizer = servable_tiny_model(), tiny_tokenizer()
    model.train()
    examples = [{"prompt": _prompt(f"question {i}"), "answer": "x"} for i in range(3)]
    torch.manual_seed(123)
    state = torch.get_rng_state()
    _, first = held_out_exact_match(model, tokenizer, examples, max_new_tokens=8, seed=7)
    assert torch.equal(torch.get_rng_state(), state)
    _, second = held_out_exact_match(model, tokenizer, examples, max_new_tokens=8, seed=7)
    assert first == second and model.training
    # The default budget is one canvas.
    _, one_canvas = held_out_exact_match(model, tokenizer, examples[:1], seed=7)
    assert len(tokenizer(one_canvas[0], add_special_tokens=False)["input_ids"]) <= model.config.canvas_length
