"""BDLMSFTTrainer in one process: what a step computes, model loading and conversion, LoRA, saving.

Multi-process layouts (P = 2 CSBP vs P = 1, resume, data sharding) are in tests/trainer/test_distributed.py.
"""

import os

import pytest
import torch
from transformers import AutoModel

from trainer_common import language_modeling, prompt_completion, tiny_bdlm, tiny_causal_lm, tiny_tokenizer  # noqa

from hf_bdlm import BDLMSFTConfig, BDLMSFTTrainer, BlockDiffusionForMaskedLM  # noqa: E402

STEPS = 3


def train(tmp_path, name="run", model=None, dataset=None, peft_config=None, tokenizer=None, **kw):
    args = dict(output_dir=str(tmp_path / name), report_to="none", max_steps=STEPS, logging_steps=1,
                per_device_train_batch_size=2, learning_rate=0.05, optim="sgd", activation_checkpointing=False,
                save_strategy="no", disable_tqdm=True, seed=1, max_length=64)
    args.update(kw)
    trainer = BDLMSFTTrainer(model if model is not None else tiny_bdlm(), args=BDLMSFTConfig(**args),
                             train_dataset=dataset if dataset is not None else prompt_completion(16),
                             processing_class=tokenizer or tiny_tokenizer(), peft_config=peft_config)
    trainer.train()
    return trainer


def losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def max_rel(a, b):
    return max((x - y).abs().max().item() / max(y.abs().max().item(), 1e-30) for x, y in zip(a, b))


def test_accumulation_and_batch_size_give_the_same_steps(tmp_path):
    # One optimizer step = the same 4 samples, same noise (keyed by step and sample), one normalizer.
    big = train(tmp_path, "big", per_device_train_batch_size=4)
    accumulated = train(tmp_path, "accumulated", per_device_train_batch_size=2, gradient_accumulation_steps=2)
    assert losses(accumulated) == pytest.approx(losses(big), rel=1e-5)
    assert max_rel(list(accumulated.model.parameters()), list(big.model.parameters())) < 1e-5


def test_activation_checkpointing_does_not_change_the_step(tmp_path):
    plain = train(tmp_path, "plain", objective="fast_dllm_v2")
    checkpointed = train(tmp_path, "ckpt", objective="fast_dllm_v2", activation_checkpointing=True)
    assert checkpointed.model.is_activation_checkpointing and not plain.model.is_activation_checkpointing
    assert losses(checkpointed) == pytest.approx(losses(plain), rel=1e-6)
    assert max_rel(list(checkpointed.model.parameters()), list(plain.model.parameters())) < 1e-6


def test_logged_metrics_cover_loss_masked_token_accuracy_and_tokens(tmp_path):
    trainer = train(tmp_path)
    history = [h for h in trainer.state.log_history if "loss" in h]
    assert len(history) == STEPS
    for h in history:
        assert h["loss"] > 0 and 0 <= h["mean_token_accuracy"] <= 1 and h["masked_tokens"] > 0
    assert history[-1]["num_tokens"] > history[0]["num_tokens"]


def test_lora_trains_only_the_adapters(tmp_path):
    from peft import LoraConfig

    model = tiny_bdlm()
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = train(tmp_path, model=model, peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                  task_type="CAUSAL_LM"),
                    optim="adamw_torch", learning_rate=1e-2)
    changed = {n for n, p in trainer.model.named_parameters() if "lora_" in n
               and not torch.equal(p, torch.zeros_like(p)) and p.requires_grad}
    assert any("lora_B" in n for n in changed)  # B starts at zero and moved
    for name, p in trainer.model.named_parameters():
        if "lora_" not in name:
            key = name.replace("base_model.model.", "").replace(".base_layer", "")
            assert torch.equal(p, base[key]), name


def test_bfloat16_weights_train(tmp_path):
    trainer = train(tmp_path, model=tiny_bdlm().to(torch.bfloat16), max_steps=2)
    assert torch.isfinite(torch.tensor(losses(trainer))).all()


def test_bf16_mixed_precision_runs(tmp_path):
    # Under autocast RoPE leaves q/k in float32 and v in bf16; attention brings them to one dtype.
    trainer = train(tmp_path, bf16=True, use_cpu=True, max_steps=1)  # transformers wants use_cpu for CPU bf16
    assert torch.isfinite(torch.tensor(losses(trainer))).all()


def test_model_can_be_a_bdlm_checkpoint_folder(tmp_path):
    folder = tmp_path / "bdlm"
    tiny_bdlm(block_size=4).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    trainer = train(tmp_path, model=str(folder), tokenizer=None, block_size=8, max_steps=1)
    assert isinstance(trainer.model, BlockDiffusionForMaskedLM)
    assert trainer.model.config.block_size == 8 == trainer.block_size  # the config's block size wins


def test_a_causal_lm_is_converted(tmp_path):
    folder = tmp_path / "causal"
    tiny_causal_lm().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    trainer = train(tmp_path, model=str(folder), tokenizer=None, block_size=4, max_steps=1)
    config = trainer.model.config
    assert config.model_type == "block_diffusion" and config.objective == "fast_dllm_v2"
    assert config.clean_attention == "block_causal" and config.block_size == 4  # Fast-dLLM v2's clean stream
    assert trainer.processing_class.convert_tokens_to_ids("<|mask|>") == config.mask_token_id  # added token
    # A causal LM object with its tokenizer converts the same way.
    trainer = train(tmp_path, "object", model=tiny_causal_lm(), tokenizer=tiny_tokenizer(), objective="standard",
                    max_steps=1)
    assert trainer.model.config.objective == "standard"


def test_saved_checkpoint_loads_with_automodel_and_carries_a_card(tmp_path):
    trainer = train(tmp_path, max_steps=2)
    out = tmp_path / "saved"
    trainer.save_model(str(out))
    names = set(os.listdir(out))
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= names
    try:
        import hf_bdlm.hub  # noqa: F401  (the model-card writer)
    except ImportError:
        pytest.skip("hf_bdlm.hub (model cards) is not installed")
    assert "README.md" in names
    card = (out / "README.md").read_text()
    assert "csbp" in card or "block" in card.lower()
    reloaded = AutoModel.from_pretrained(out)
    assert isinstance(reloaded, BlockDiffusionForMaskedLM)
    for (name, a), b in zip(trainer.model.named_parameters(), reloaded.parameters()):
        assert torch.equal(a, b), name


def test_evaluate_reports_the_loss_and_accuracy_of_the_held_out_set(tmp_path):
    args = BDLMSFTConfig(output_dir=str(tmp_path / "eval"), report_to="none", per_device_eval_batch_size=3,
                         disable_tqdm=True, max_length=64)
    trainer = BDLMSFTTrainer(tiny_bdlm(), args=args, train_dataset=language_modeling(6),
                             eval_dataset=language_modeling(5), processing_class=tiny_tokenizer())
    first = trainer.evaluate()
    again = trainer.evaluate()
    assert first["eval_loss"] > 0 and 0 <= first["eval_mean_token_accuracy"] <= 1
    assert first["eval_loss"] == again["eval_loss"]  # evaluation noise is fixed


def test_the_certainty_term_trains_is_logged_and_goes_on_the_card(tmp_path):
    plain = train(tmp_path, "plain", objective="fast_dllm_v2")
    forced = train(tmp_path, "forced", objective="fast_dllm_v2", certainty_weight=1.0)
    assert forced.objective.certainty_weight == 1.0 and plain.objective.certainty_weight == 0.0
    history = [h for h in forced.state.log_history if "loss" in h]
    # The first step starts from the same weights with the same noise: the term only adds (an entropy is >= 0), and
    # adds something once a target is predicted right.
    assert history[0]["loss"] >= losses(plain)[0]
    right = [h for h in history if h["mean_token_accuracy"] > 0]
    assert right and all(h["certainty_entropy"] > 0 for h in right)
    if history[0]["mean_token_accuracy"] > 0:
        assert history[0]["loss"] > losses(plain)[0]
    assert not any("certainty_entropy" in h for h in plain.state.log_history)
    assert forced.model_card_info["training"] == {"certainty_weight": 1.0}
    assert "training" not in plain.model_card_info
