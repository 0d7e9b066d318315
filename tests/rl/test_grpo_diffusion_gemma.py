"""BDLMGRPOTrainer on a tiny DiffusionGemma (tests/distributed/tiny_diffusion_gemma.py): rollouts by its serving
decoder, ``coupled`` (each completion token scored by exactly one of two decoder passes) and ``one_step``; ``trace``
refused, naming the two; the first iteration's ratios exactly 1 (rows scored one at a time); a 2-step run trains."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from tiny_diffusion_gemma import tiny_model, tiny_tokenizer
from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

from hf_bdlm.models import family_named
from hf_bdlm.protocols.policy import PolicyScoring
from hf_bdlm.rl import BDLMGRPOConfig, BDLMGRPOTrainer
from hf_bdlm.rl.trainer import ROWS

DATA = Dataset.from_dict({"prompt": ["w9 w10 w11", "w12 w13"] * 4})


def reward_count_w1(completions, **kwargs):
    return [float(text.count("w1")) for text in completions]


def args_for(**fields) -> BDLMGRPOConfig:
    defaults = dict(output_dir="unused", per_device_train_batch_size=2, num_generations=2, max_completion_length=6,
                    learning_rate=1e-2, report_to=[], use_cpu=True, bf16=False, gradient_checkpointing=False,
                    save_strategy="no", seed=0, beta=0.0, logging_steps=1, disable_tqdm=True,
                    logp_estimator="coupled")
    return BDLMGRPOConfig(**{**defaults, **fields})


def test_coupled_scores_each_token_once_and_one_step_noises_the_whole_completion():
    model = tiny_model()
    policy = family_named("diffusion_gemma").role("policy").policy(model, tiny_tokenizer(), args_for())
    prompt, completion = torch.tensor([2, 10, 11, 12, 13]), torch.tensor([20, 21, 22, 23, 24, 25])
    log_probs, entropies, forward = policy.row_scores(model, prompt, completion, PolicyScoring("coupled", seed=3),
                                                      entropy=True)
    assert set(forward.tolist()) == {0, 1} and log_probs.requires_grad
    assert bool(torch.isfinite(log_probs).all() & (log_probs < 0).all() & (entropies > 0).all())
    again, _, _ = policy.row_scores(model, prompt, completion, PolicyScoring("coupled", seed=3))
    other, _, _ = policy.row_scores(model, prompt, completion, PolicyScoring("coupled", seed=4))
    assert torch.equal(log_probs, again) and not torch.equal(log_probs, other)  # seeded draws
    _, _, forward = policy.row_scores(model, prompt, completion, PolicyScoring("one_step", seed=3))
    assert set(forward.tolist()) == {0}


def test_trace_is_refused_naming_the_estimators_that_work():
    with pytest.raises(ValueError, match=r"not available for the 'diffusion_gemma' family.*\['coupled', 'one_step'\]"):
        BDLMGRPOTrainer(tiny_model(), reward_funcs=reward_count_w1, args=args_for(logp_estimator="trace"),
                        train_dataset=DATA, processing_class=tiny_tokenizer())


def test_a_two_step_run_trains_and_its_first_ratios_are_exactly_one():
    model = tiny_model()
    trainer = BDLMGRPOTrainer(model, reward_funcs=reward_count_w1, train_dataset=DATA,
                              processing_class=tiny_tokenizer(),
                              args=args_for(max_steps=2, num_iterations=2, steps_per_generation=2, beta=0.05))
    model.train()  # as in training: the old log-probabilities in chunks of per_device_train_batch_size
    inputs = [DATA[i] for i in range(2) for _ in range(2)]
    batch = trainer._generate_and_score_completions(inputs)
    assert batch["old_per_token_logps"].shape[:2] == (4, 2)  # every iteration's masks, at the rollout
    for part in split_tensor_dict(shuffle_sequence_dict(batch), 2):
        ids = torch.cat([part["prompt_ids"], part["completion_ids"]], 1)
        mask = torch.cat([part["prompt_mask"], part["completion_mask"]], 1)
        trainer._rows = {k: v for k, v in part.items() if k.startswith(ROWS)}
        with torch.no_grad():
            now = trainer._get_per_token_logps_and_entropies(model, ids, mask, part["completion_ids"].shape[1])[0]
        trainer._rows = None
        scored = part["completion_mask"].bool()
        assert torch.equal(now[scored], part["old_per_token_logps"][:, 0][scored])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
