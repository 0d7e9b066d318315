"""BDLMGRPOTrainer and its log-probability estimators on a tiny float64 block-diffusion LM (docs/rl.md).

- the decoding trace is off by default and changes no token when on;
- ``trace`` reproduces the log-probabilities the decoder computed when it sampled, with one forward per decoding step
  (and one clean forward), not one per token;
- ``coupled`` scores each completion token exactly once and equals the likelihood estimator's ELBO at the same masks;
- the GRPO loss's gradient equals central finite differences, for every estimator;
- the importance ratios of the first iteration are exactly 1, the masks of a random estimator change per iteration;
- with a constant reward only the KL term moves the weights; a 2-step run trains (with activation checkpointing, LoRA,
  several iterations, a reference); a drafter is refused by name.
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from tiny_bdlm import BLOCK, MASK, padded_batch, tiny_bdlm, tiny_tokenizer
from transformers import LlamaConfig
from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict

from hf_bdlm import BlockDiffusionConfig, BlockDiffusionForMaskedLM
from hf_bdlm.models import family_named
from hf_bdlm.models.block_diffusion.generation import DecodingTrace, decode_ragged, resolve_settings
from hf_bdlm.models.block_diffusion.generation.config import as_block_diffusion_config
from hf_bdlm.models.block_diffusion.inference import likelihood
from hf_bdlm.objectives.likelihood import AbsorbingDraws
from hf_bdlm.protocols.entry import RoleUnavailable
from hf_bdlm.protocols.likelihood import ScoreRequest
from hf_bdlm.protocols.policy import PolicyScoring
from hf_bdlm.rl import BDLMGRPOConfig, BDLMGRPOTrainer
from hf_bdlm.rl.estimators import coupled_masks, draw_seed, sample_key
from hf_bdlm.rl.trainer import ROWS

PROMPTS = [[2, 5, 9, 10, 11], [2, 7], [2, 4, 5, 6, 7, 8, 9, 10, 11]]  # a prompt tail, a short one, a whole block


def tiny_policy_model(objective: str = "standard", seed: int = 0) -> BlockDiffusionForMaskedLM:
    """The tests' tiny block-diffusion LM in float64 (``fast_dllm_v2``: with a token shift)."""
    if objective == "standard":
        return tiny_bdlm(seed).double()
    torch.manual_seed(seed)
    backbone = LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=64, max_position_embeddings=256)
    model = BlockDiffusionForMaskedLM(BlockDiffusionConfig(backbone_config=backbone, block_size=BLOCK,
                                                           mask_token_id=MASK, objective=objective)).eval()
    model.generation_config.eos_token_id = None
    return model.double()


def args_for(**fields) -> BDLMGRPOConfig:
    defaults = dict(output_dir="unused", per_device_train_batch_size=4, num_generations=2, max_completion_length=8,
                    learning_rate=1e-2, report_to=[], use_cpu=True, bf16=False, gradient_checkpointing=False,
                    save_strategy="no", temperature=0.9, confidence_threshold=0.5, seed=0, beta=0.0,
                    logging_steps=1, disable_tqdm=True)
    return BDLMGRPOConfig(**{**defaults, **fields})


def policy_for(model, **fields):
    args = args_for(**fields)
    return family_named("block_diffusion").role("policy").policy(model, tiny_tokenizer(), args)


def count_forwards(module):
    calls = []
    handle = module.register_forward_hook(lambda *_: calls.append(1))
    return calls, handle


# --- the decoding trace ----------------------------------------------------------------------------------------------
DECODINGS = {
    "sampled, threshold": dict(do_sample=True, temperature=0.8, top_k=0, confidence_threshold=0.3),
    "greedy, one per step": dict(do_sample=False),
    "sub-blocks, techniques off": dict(do_sample=True, temperature=1.2, top_k=5, confidence_threshold=0.2,
                                       sub_block_size=2, fuse_block_commit=False, eos_early_exit=False,
                                       compact_batch=False),
    "two per step, EOS": dict(do_sample=True, temperature=0.7, top_p=0.9, min_tokens_per_step=2, eos_token_id=3),
}


@pytest.mark.parametrize("objective", ["standard", "fast_dllm_v2"])
def test_the_trace_is_off_by_default_and_changes_no_token(objective):
    model = tiny_policy_model(objective)
    prompts = [torch.tensor(p) for p in PROMPTS]
    for name, fields in DECODINGS.items():
        config = as_block_diffusion_config(model.generation_config)
        config.update(max_new_tokens=11, **fields)
        settings = resolve_settings(model, config, 1)
        outputs = []
        for trace in (None, DecodingTrace(), "default"):
            kwargs = {} if trace == "default" else {"trace": trace}
            with torch.no_grad():
                outputs.append(decode_ragged(model, prompts, settings, generator=torch.Generator().manual_seed(7),
                                             **kwargs))
        for row in range(len(prompts)):
            assert torch.equal(outputs[0][row], outputs[1][row]), (name, row)
            assert torch.equal(outputs[0][row], outputs[2][row]), (name, row)


@pytest.mark.parametrize("objective,fields", [
    ("standard", {}),
    ("fast_dllm_v2", {}),
    ("standard", {"generation_kwargs": {"sub_block_size": 2, "fuse_block_commit": False, "compact_batch": False}}),
])
def test_trace_reproduces_the_decoders_log_probs_with_one_forward_per_step(objective, fields):
    model = tiny_policy_model(objective)
    policy = policy_for(model, temperature=0.8, max_completion_length=11, **fields)
    rollout = policy.rollout(model, PROMPTS, seed=3, trace=True)
    batch = padded_batch(PROMPTS, rollout.completions, rollout.rows)
    calls, handle = count_forwards(model.decoder)
    log_probs, entropies = policy.log_probs(model, batch, PolicyScoring("trace", temperature=0.8), entropy=True)
    handle.remove()
    recorded = torch.zeros_like(log_probs)
    for i, values in enumerate(rollout.log_probs):
        recorded[i, :len(values)] = torch.tensor(values, dtype=recorded.dtype)
    assert (log_probs - recorded).abs().max() <= 1e-6  # measured: 0.0 (float64)
    assert log_probs.requires_grad and bool((entropies[batch.completion_mask.bool()] > 0).all())
    # One clean forward, then one per decoding step, whatever the number of tokens.
    steps = rollout.rows["trace_steps"]
    assert len(calls) == 1 + int(steps[steps < (1 << 30)].max()) + 1
    assert len(calls) < int(batch.completion_mask.sum())
    # Without the clean rows' cache (activation checkpointing): the same numbers, one training-form forward per step.
    calls, handle = count_forwards(model.decoder)
    again, _ = policy.log_probs(model, batch, PolicyScoring("trace", temperature=0.8, cache_clean_rows=False))
    handle.remove()
    assert (again - recorded).abs().max() <= 1e-6 and len(calls) == int(steps[steps < (1 << 30)].max()) + 1


# --- coupled and one_step ---------------------------------------------------------------------------------------
def test_coupled_scores_each_token_once_and_equals_the_elbo_at_the_same_masks(monkeypatch):
    model = tiny_policy_model()
    policy = policy_for(model, temperature=1.0, max_completion_length=10)
    rollout = policy.rollout(model, PROMPTS, seed=5)
    batch = padded_batch(PROMPTS, rollout.completions, {})
    scoring = PolicyScoring("coupled", temperature=1.0, seed=11)
    log_probs, _, forward = policy.coupled(model, batch, scoring)
    completion = batch.completion_mask.bool()
    assert set(forward[completion].tolist()) == {0, 1} and bool((forward[~completion] == -1).all())
    scorer = family_named("block_diffusion").role("evaluation").likelihood_scorer(model, None)
    worst = 0.0
    for i, (prompt, tokens) in enumerate(zip(PROMPTS, rollout.completions)):
        positions = torch.arange(len(prompt), len(prompt) + len(tokens))
        first = coupled_masks(scoring.seed, sample_key(prompt, tokens), positions, BLOCK)
        assert torch.equal(first, forward[i, :len(tokens)] == 0)  # the draw's tokens in the first forward
        masks = torch.stack([first, ~first])
        weight = torch.zeros(2, len(tokens), dtype=torch.float64)
        for k in range(2):
            for block in torch.unique(positions // BLOCK):
                inside = positions // BLOCK == block
                if masks[k][inside].any():
                    weight[k, inside & masks[k]] = inside.sum() / (inside & masks[k]).sum()
        monkeypatch.setattr(likelihood, "absorbing_draws", lambda *a, m=masks, w=weight: AbsorbingDraws(m, w))
        [estimate] = scorer.score([ScoreRequest(tuple(prompt), tuple(tokens))], mc_num=2, seed=0, batch_size=1)
        mine = 0.5 * float((weight.sum(0) * log_probs[i, :len(tokens)].detach()).sum())
        worst = max(worst, abs(mine - estimate.log_likelihood))
    assert worst <= 1e-10, worst  # measured: 0.0 (float64)


def test_one_step_masks_the_whole_completion_and_a_share_of_the_prompt():
    model = tiny_policy_model()
    policy = policy_for(model, max_completion_length=8)
    rollout = policy.rollout(model, PROMPTS, seed=1)
    batch = padded_batch(PROMPTS, rollout.completions, {})
    seen = []
    handle = model.register_forward_pre_hook(lambda m, a, kw: seen.append((kw["input_ids"], kw["clean_input_ids"])),
                                             with_kwargs=True)
    one, _ = policy.log_probs(model, batch, PolicyScoring("one_step", seed=4, prompt_mask_ratio=0.5))
    other, _ = policy.log_probs(model, batch, PolicyScoring("one_step", seed=5, prompt_mask_ratio=0.5))
    handle.remove()
    (noisy, clean), _ = seen
    for i, prompt in enumerate(PROMPTS):
        assert bool((noisy[i, len(prompt):len(prompt) + 8] == MASK).all())
        assert torch.equal(noisy[i, :len(prompt)], clean[i, :len(prompt)])  # the prompt masked alike in both streams
    assert int((clean[:, :5] == MASK).sum()) > 0 and not torch.equal(one, other)  # fresh prompt masks per seed


# --- the GRPO loss -----------------------------------------------------------------------------------------------
def reward_count_w1(completions, **kwargs):
    return [float(text.count("w1")) for text in completions]


def constant_reward(completions, **kwargs):
    return [1.0] * len(completions)


DATA = Dataset.from_dict({"prompt": ["w9 w10 w11", "w12 w13", "w20 w21 w22 w23 w24 w25", "w30"] * 4})


def trainer_for(estimator, reward=reward_count_w1, model=None, tools=None, peft_config=None,
                **fields) -> BDLMGRPOTrainer:
    model = tiny_policy_model() if model is None else model
    return BDLMGRPOTrainer(model, reward_funcs=reward, args=args_for(logp_estimator=estimator, **fields),
                           train_dataset=DATA, processing_class=tiny_tokenizer(), tools=tools,
                           peft_config=peft_config)


def rollout_batch(trainer) -> dict:
    """One generation round as TRL's ``_prepare_inputs`` makes it in training (each prompt ``num_generations`` times,
    the model in training mode: the old log-probabilities in chunks of ``per_device_train_batch_size``)."""
    trainer.model.train()
    G = trainer.args.num_generations
    inputs = [DATA[i] for i in range(trainer.args.generation_batch_size // G) for _ in range(G)]
    return trainer._generate_and_score_completions(inputs)


def current_log_probs(trainer, batch, iteration=0, grad=False):
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    trainer._rows, trainer._iteration = {k: v for k, v in batch.items() if k.startswith(ROWS)}, iteration
    try:
        with torch.set_grad_enabled(grad):
            return trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask,
                                                              batch["completion_ids"].shape[1])[0]
    finally:
        trainer._rows, trainer._iteration = None, 0


def float64_norms(monkeypatch):
    """transformers' RMSNorm computes in float32 (a float64 model's norms round to float32, which finite differences
    of a float64 model would see): the test's norms compute in their input's dtype."""
    from transformers.models.llama import modeling_llama

    def forward(self, hidden):
        return self.weight * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", forward)


@pytest.mark.parametrize("estimator", ["trace", "coupled", "one_step"])
def test_the_grpo_loss_gradient_equals_finite_differences(estimator, monkeypatch):
    float64_norms(monkeypatch)
    trainer = trainer_for(estimator, beta=0.05)
    model = trainer.model
    with torch.no_grad():  # a reference that differs from the policy, so the KL term has a gradient
        for p in trainer.ref_model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    batch = rollout_batch(trainer)
    batch["old_per_token_logps"] = current_log_probs(trainer, batch) - 0.01  # fixed: the ratio's denominator
    trainer.current_gradient_accumulation_steps = 1
    model.train()

    def loss() -> torch.Tensor:
        return trainer._compute_loss(model, batch)

    model.zero_grad()
    loss().backward()
    params = dict(model.named_parameters())
    worst = 0.0
    for name, index in (("backbone.model.embed_tokens.weight", (5, 3)), ("backbone.lm_head.weight", (9, 1)),
                        ("backbone.model.layers.0.self_attn.q_proj.weight", (2, 7)),
                        ("backbone.model.layers.1.mlp.down_proj.weight", (4, 11)),
                        ("backbone.model.norm.weight", (6,))):
        p, h = params[name], 1e-5
        with torch.no_grad():
            p[index] += h
            up = float(loss())
            p[index] -= 2 * h
            down = float(loss())
            p[index] += h
        numeric = (up - down) / (2 * h)
        worst = max(worst, abs(numeric - float(p.grad[index])) / max(1e-3, abs(numeric)))
    assert worst < 1e-6, worst  # measured: at most 4.5e-9 (|numeric - autograd| / max(|numeric|, 1e-3), h = 1e-5)


@pytest.mark.parametrize("estimator", ["trace", "coupled"])
def test_importance_ratios_are_exactly_one_on_the_first_iteration(estimator):
    trainer = trainer_for(estimator, num_iterations=2, per_device_train_batch_size=2, steps_per_generation=2,
                          num_generations=2)
    batch = rollout_batch(trainer)
    old = batch["old_per_token_logps"]  # computed at the rollout, in generation order, every iteration's
    assert old.shape[:2] == (4, 2) if estimator == "coupled" else old.dim() == 2  # trace: no draws, one set
    mask = batch["completion_mask"].bool()
    for part in split_tensor_dict(shuffle_sequence_dict(batch), 2):  # the loss's micro-batches
        now = current_log_probs(trainer, part, iteration=0)
        first = part["old_per_token_logps"][:, 0] if estimator == "coupled" else part["old_per_token_logps"]
        assert torch.equal(torch.exp(now - first)[part["completion_mask"].bool()],
                           torch.ones(int(part["completion_mask"].sum()), dtype=now.dtype))
    if estimator == "coupled":  # each iteration draws its own masks
        assert not torch.equal(old[:, 0][mask], old[:, 1][mask])


def test_with_a_constant_reward_only_the_kl_term_moves_the_weights():
    for beta, moves in ((0.0, False), (0.1, True)):
        trainer = trainer_for("trace", reward=constant_reward, beta=beta, max_steps=1)
        if trainer.ref_model is not None:
            with torch.no_grad():
                for p in trainer.ref_model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
        changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p)]
        assert bool(changed) == moves, (beta, changed)


@pytest.mark.parametrize("estimator,fields", [("trace", {"gradient_checkpointing": True}),
                                              ("trace", {"lora": True, "beta": 0.05}),
                                              ("coupled", {"num_iterations": 2}), ("one_step", {"beta": 0.05})])
def test_a_two_step_run_trains(estimator, fields):
    fields = dict(fields)
    if fields.pop("lora", False):  # PEFT: the reference is the model with its adapter disabled, as in TRL
        from peft import LoraConfig

        fields["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    trainer = trainer_for(estimator, max_steps=2, **fields)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def test_a_drafter_is_refused_by_name():
    from fixtures import tiny_drafter, tiny_target

    drafter = tiny_drafter(tiny_target("llama", vocab_size=64), num_hidden_layers=1, block_size=4, mask_token_id=63)
    with pytest.raises(RoleUnavailable, match="'dflash' checkpoint: this family has no policy role.*Train the target"):
        BDLMGRPOTrainer(drafter, reward_funcs=constant_reward, args=args_for(), train_dataset=DATA,
                        processing_class=tiny_tokenizer())


def test_trace_is_refused_with_tools_naming_the_estimators_that_work():
    def tool(x: int) -> int:
        """A tool.

        Args:
            x: a number.
        """
        return x

    with pytest.raises(ValueError, match="use logp_estimator='coupled' or 'one_step'"):
        trainer_for("trace", tools=[tool])


def test_the_round_seeds_the_rollouts():
    model = tiny_policy_model()
    policy = policy_for(model)
    one, again, other = (policy.rollout(model, PROMPTS, seed=s).completions for s in (draw_seed(0, 0, 0),) * 2 +
                         (draw_seed(0, 1, 0),))
    assert one == again and one != other
