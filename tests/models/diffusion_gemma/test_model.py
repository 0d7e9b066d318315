"""DiffusionGemma: the all-blocks pass equals transformers' own inference computation, block by block.

The reference of every test is `DiffusionGemmaForBlockDiffusion` itself: for a canvas block starting at `s`, its
forward with `input_ids = x[:s]` and `decoder_input_ids = canvas` is what `generate` computes for that block (its
cache keeps the last W - 1 prefix positions on sliding layers). Tiny float32 models with a sliding window W = 6
shorter than the sequences, 2 layers (sliding, full), 4 experts top-2; the DiffusionGemma chat template is TRL's.
"""

from __future__ import annotations

import copy

import datasets
import pytest
import torch
import torch.nn.functional as F
from transformers import DiffusionGemmaForBlockDiffusion

from hf_bdlm import BDLMSFTConfig, BDLMSFTTrainer
from hf_bdlm.models.diffusion_gemma.modeling import (
    DIFFUSION_GEMMA_LORA_TARGETS,
    DiffusionGemmaLayout,
    build_canvas_frame,
    decode,
    encode,
    softcapped_logits,
)
from hf_bdlm.objectives import get_objective
from hf_bdlm.models.diffusion_gemma.training.objectives import DiffusionGemmaObjective

from tiny_diffusion_gemma import B, EOS, PAD, TURN_END, VOCAB, W, conversations, tiny_tokenizer  # noqa: E402
from tiny_diffusion_gemma import tiny_model as _tiny_model  # noqa: E402
from paths import ROOT


def tiny_model(seed: int = 0) -> DiffusionGemmaForBlockDiffusion:
    return _tiny_model(seed).eval()


def sample(length: int, response_start: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(9, VOCAB, (length,), generator=g)
    ids[-1] = TURN_END  # a complete response: its EOS fill is supervised
    mask = torch.zeros(length, dtype=torch.long)
    mask[response_start:] = 1
    return ids, mask


def batch_of(*samples):
    length = max(ids.numel() for ids, _ in samples)
    ids = torch.full((len(samples), length), PAD)
    att, comp = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (x, m) in enumerate(samples):
        ids[i, : x.numel()], att[i, : x.numel()], comp[i, : x.numel()] = x, 1, m
    return {"input_ids": ids, "attention_mask": att, "completion_mask": comp}


def objective(**kw) -> DiffusionGemmaObjective:
    base = dict(block_size=B, vocab_size=VOCAB, fill_token_id=EOS, end_token_ids={EOS, TURN_END},
                noise_eps_min=0.0, noise_eps_max=0.0, self_conditioning_prob=0.0)
    base.update(kw)
    return get_objective("diffusion_gemma", base)


@torch.no_grad()
def inference_block_ce(model, ids, response_start, noisy=None, t=None, self_conditioning=False):
    """Per-token cross-entropy of every response block, each computed as `generate` computes it."""
    r1 = ids.numel()
    out = []
    for j in range(-(-(r1 - response_start) // B)):
        s = response_start + j * B
        target = torch.full((B,), EOS)
        n = min(B, r1 - s)
        target[:n] = ids[s : s + n]
        canvas = target if noisy is None else noisy[j * B : (j + 1) * B]
        kwargs = dict(input_ids=ids[None, :s], decoder_input_ids=canvas[None])
        if self_conditioning:
            kwargs["self_conditioning_logits"] = model(**kwargs).logits
            kwargs["self_conditioning_mask"] = torch.tensor([True])
        logits = model(**kwargs).logits[0]
        out.append(F.cross_entropy(logits, target, reduction="none"))
    return torch.cat(out)


@torch.no_grad()
def encoder_next_token_ce(model, ids):
    hidden = model(input_ids=ids[None], decoder_input_ids=ids[None, :B]).encoder_last_hidden_state[0]
    return F.cross_entropy(softcapped_logits(model, hidden[:-1]), ids[1:], reduction="none")


@torch.no_grad()
def one_pass_canvas_ce(model, batch, obj, backend="auto"):
    corrupted = obj.corrupt(batch, seed=0, step=0)
    frame = corrupted.frame
    layout = DiffusionGemmaLayout.local(frame, backend)
    _, cache = encode(model, frame, layout)
    hidden = decode(model, frame, layout, corrupted.noisy_ids, cache)
    ce = F.cross_entropy(softcapped_logits(model, hidden).transpose(1, 2), frame.canvas_target, reduction="none")
    return corrupted, ce


# --- the frame ----------------------------------------------------------------------------------------------------
def test_frame_starts_every_response_on_a_block_boundary_with_its_true_positions():
    ids, mask = sample(11, response_start=5, seed=0)
    frame = build_canvas_frame(ids[None], torch.ones(1, 11), mask[None], block_size=B, fill_token_id=EOS)
    shift = (-5) % B  # 3 pad rows: the response start lands on frame position 8
    assert frame.clean_source[0, :shift].tolist() == [-1] * shift
    assert frame.clean_source[0, shift : shift + 11].tolist() == list(range(11))
    assert frame.clean_positions[0, shift : shift + 11].tolist() == list(range(11))  # RoPE positions unchanged
    assert frame.canvas_rows.pos.tolist() == list(range(8, 16))  # two canvas blocks
    assert frame.canvas_positions[0].tolist() == list(range(5, 13))
    assert frame.canvas_target[0].tolist() == ids[5:].tolist() + [EOS, EOS]  # EOS fill past the response
    assert frame.canvas_supervised.all() and int(frame.ar_pairs.sum()) == 10


def test_a_truncated_response_leaves_its_fill_unsupervised():
    ids, mask = sample(11, response_start=5, seed=0)
    ids[-1] = 9  # not an end token: the sample was cut
    frame = build_canvas_frame(ids[None], torch.ones(1, 11), mask[None], block_size=B, fill_token_id=EOS,
                               end_token_ids={EOS, TURN_END})
    assert frame.canvas_supervised[0].tolist() == [True] * 6 + [False] * 2
    told = build_canvas_frame(ids[None], torch.ones(1, 11), mask[None], block_size=B, fill_token_id=EOS,
                              truncated=torch.tensor([False]), end_token_ids={EOS, TURN_END})
    assert told.canvas_supervised.all()


def test_the_response_is_the_last_supervised_span():
    ids, _ = sample(14, response_start=0, seed=1)
    mask = torch.tensor([0, 0, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1])  # two assistant turns
    frame = build_canvas_frame(ids[None], torch.ones(1, 14), mask[None], block_size=B, fill_token_id=EOS)
    assert frame.canvas_source[0].tolist() == list(range(9, 17))


# --- exact semantics ----------------------------------------------------------------------------------------------
def test_all_blocks_in_one_pass_equal_transformers_per_block_inference():
    model = tiny_model()
    reference = copy.deepcopy(model)  # never routed through hf_bdlm's attention
    samples = [sample(23, response_start=5, seed=0), sample(17, response_start=10, seed=1)]
    corrupted, ce = one_pass_canvas_ce(model, batch_of(*samples), objective())
    for row, (ids, mask) in enumerate(samples):
        mine = ce[row][corrupted.frame.canvas_source[row] >= 0]
        theirs = inference_block_ce(reference, ids, int(mask.argmax()))
        assert mine.shape == theirs.shape and ids.numel() > 2 * W  # blocks start past the window
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_canvases_through_flex_equal_the_block_sparse_kernels(monkeypatch):
    # The CUDA path's block masks and log-sum-exp merge over the decoder's two sources (canvas, encoder's clean
    # keys), run here by eager FlexAttention (forward only on CPU).
    from hf_bdlm.attention import flex

    monkeypatch.setattr(flex, "compiled_flex_attention", lambda dynamic=False: flex._eager_flex_attention)
    calls, real = [], flex.flex_call
    monkeypatch.setattr(flex, "flex_call", lambda *a, **k: calls.append(k.get("dynamic")) or real(*a, **k))
    model = tiny_model()
    batch = batch_of(sample(23, response_start=5, seed=0), sample(17, response_start=10, seed=1))
    _, blockwise = one_pass_canvas_ce(model, batch, objective(), "blockwise")
    assert not calls
    _, through_flex = one_pass_canvas_ce(model, batch, objective(), "flex")
    assert len(calls) >= 3  # the encoder's layers (one source), the decoder's (canvas and clean keys: two)
    torch.testing.assert_close(through_flex, blockwise, rtol=1e-5, atol=1e-5)


def test_encoder_next_token_loss_equals_the_encoder_over_the_sequence():
    model = tiny_model()
    ids, mask = sample(23, response_start=5, seed=0)
    corrupted = objective().corrupt(batch_of((ids, mask)), seed=0, step=0)
    frame = corrupted.frame
    with torch.no_grad():
        hidden, _ = encode(model, frame, DiffusionGemmaLayout.local(frame))
        rows = frame.ar_pairs[0].nonzero().flatten()
        mine = F.cross_entropy(softcapped_logits(model, hidden[0, rows]), frame.clean_ids[0, rows + 1], reduction="none")
    torch.testing.assert_close(mine, encoder_next_token_ce(copy.deepcopy(tiny_model()), ids), rtol=1e-5, atol=1e-5)


def test_trl_style_masked_cache_differs_from_inference_once_the_sequence_passes_the_window():
    # TRL's example: the encoder reads the whole sequence into its cache, the decoder mask cuts it at the block start.
    model = tiny_model()
    ids, _ = sample(23, response_start=5, seed=0)
    s = 17  # a block starting past W: the sliding layers' masked cache is not the one generate holds
    canvas = ids[s : s + B][None]
    with torch.no_grad():
        exact = model(input_ids=ids[None, :s], decoder_input_ids=canvas).logits
        cache_mask = (torch.arange(23) < s).long()[None]
        trl = model(input_ids=ids[None], decoder_input_ids=canvas, decoder_position_ids=torch.arange(s, s + B)[None],
                    decoder_attention_mask=torch.cat([cache_mask, torch.ones(1, B, dtype=torch.long)], 1)).logits
    assert (exact - trl).abs().max() > 1e-3


def test_self_conditioning_equals_the_model_fed_its_own_first_pass_logits():
    model = tiny_model()
    reference = copy.deepcopy(model)
    ids, mask = sample(19, response_start=6, seed=3)
    obj = objective(self_conditioning_prob=1.0, noise_eps_min=0.3, noise_eps_max=0.7)
    corrupted = obj.corrupt(batch_of((ids, mask)), seed=0, step=0)
    assert corrupted.self_conditioning.all() and corrupted.masked.any()
    with torch.no_grad():
        loss, metrics = obj.loss(model, corrupted)
    frame = corrupted.frame
    theirs = inference_block_ce(reference, ids, 6, noisy=corrupted.noisy_ids[0], self_conditioning=True)
    ar = encoder_next_token_ce(reference, ids)
    assert metrics["count"] == theirs.numel()
    assert float(loss) == pytest.approx(float(theirs.mean() + ar.mean()), rel=1e-5)
    assert frame.canvas_supervised.sum() == theirs.numel()


def test_mean_loo_scores_the_bayes_posterior_of_the_leave_one_out_prediction():
    model = tiny_model()
    ids, mask = sample(13, response_start=4, seed=4)
    obj = objective(model_prediction_type="mean_loo", noise_eps_min=0.5, noise_eps_max=0.5, ar_loss_weight=0.0)
    corrupted = obj.corrupt(batch_of((ids, mask)), seed=0, step=0)
    with torch.no_grad():
        loss, _ = obj.loss(model, corrupted)
        _, cache = encode(model, corrupted.frame, layout := DiffusionGemmaLayout.local(corrupted.frame))
        probs = softcapped_logits(model, decode(model, corrupted.frame, layout, corrupted.noisy_ids, cache)).softmax(-1)
    t = 0.5
    kernel = torch.full((VOCAB, VOCAB), t / VOCAB) + (1 - t) * torch.eye(VOCAB)  # q(z | v): row z, column v
    posterior = probs[0] * kernel[corrupted.noisy_ids[0]]
    posterior = posterior / posterior.sum(-1, keepdim=True)
    expected = -posterior.gather(1, corrupted.frame.canvas_target[0, :, None]).log().mean()
    assert float(loss) == pytest.approx(float(expected), rel=1e-5)


def test_generate_is_unchanged_by_the_training_attention():
    from hf_bdlm.models.diffusion_gemma.modeling import use_block_diffusion_attention

    pristine = tiny_model()
    routed = copy.deepcopy(pristine)
    assert use_block_diffusion_attention(routed).startswith("bdlm_diffusion_gemma+")
    prompt = torch.randint(9, VOCAB, (1, 13), generator=torch.Generator().manual_seed(5))  # longer than W
    outputs = []
    for model in (pristine, routed):
        torch.manual_seed(0)
        out = model.generate(prompt, max_new_tokens=3 * B, eos_token_id=None, max_denoising_steps=4)
        outputs.append(out.sequences if hasattr(out, "sequences") else out)
    assert torch.equal(outputs[0], outputs[1])


# --- noise ---------------------------------------------------------------------------------------------------------
def test_zero_noise_range_leaves_the_canvas_clean_and_defaults_corrupt_it():
    batch = batch_of(sample(23, 5, 0), sample(17, 10, 1))
    clean = objective().corrupt(batch, seed=0, step=0)
    assert torch.equal(clean.noisy_ids, clean.frame.canvas_target) and float(clean.canvas_t.max()) == 0.0
    noisy = objective(noise_eps_min=1e-4, noise_eps_max=1 - 1e-4).corrupt(batch, seed=0, step=0)
    assert noisy.masked.any()
    t = noisy.canvas_t[noisy.frame.canvas_source >= 0]
    assert float(t.min()) >= 1e-4 and float(t.max()) <= 1 - 1e-4


def test_noise_depends_on_sample_and_position_only():
    a, b = sample(23, 5, 0), sample(17, 10, 1)
    obj = objective(noise_eps_min=0.2, noise_eps_max=0.9, self_conditioning_prob=0.5)
    together = obj.corrupt({**batch_of(a, b), "sample_ids": torch.tensor([7, 8])}, seed=3, step=5)
    alone = obj.corrupt({**batch_of(b), "sample_ids": torch.tensor([8])}, seed=3, step=5)
    held = together.frame.canvas_source[1] >= 0
    assert torch.equal(together.noisy_ids[1][held], alone.noisy_ids[0])
    assert torch.equal(together.canvas_t[1][held], alone.canvas_t[0])
    assert bool(together.self_conditioning[1]) == bool(alone.self_conditioning[0])
    # One rate per (sample, block); blocks differ.
    rates = alone.canvas_t[0].view(-1, B)
    assert (rates == rates[:, :1]).all() and rates[:, 0].unique().numel() == rates.shape[0]


def test_self_conditioning_prob_zero_runs_the_decoder_once():
    model = tiny_model()
    calls = []
    handle = model.model.decoder.register_forward_hook(lambda *args: calls.append(1))
    batch = batch_of(sample(19, 6, 3))
    for p, passes in ((0.0, 1), (1.0, 2)):
        calls.clear()
        obj = objective(self_conditioning_prob=p)
        with torch.no_grad():
            obj.loss(model, obj.corrupt(batch, seed=0, step=0))
        assert len(calls) == passes
    handle.remove()


# --- the trainer ---------------------------------------------------------------------------------------------------
def trainer_args(tmp_path, name, **kw):
    base = dict(output_dir=str(tmp_path / name), report_to="none", max_steps=2, logging_steps=1,
                per_device_train_batch_size=2, per_device_eval_batch_size=2, learning_rate=1e-2,
                activation_checkpointing=False, save_strategy="no", disable_tqdm=True, seed=0, max_length=64,
                objective="diffusion_gemma")
    base.update(kw)
    return BDLMSFTConfig(**base)


def test_trainer_eval_loss_is_the_per_block_inference_loss_plus_the_encoder_loss(tmp_path):
    ids, mask = sample(23, response_start=5, seed=0)
    data = datasets.Dataset.from_dict({"input_ids": [ids.tolist()], "completion_mask": [mask.tolist()]})
    model = tiny_model()
    reference = copy.deepcopy(model)
    trainer = BDLMSFTTrainer(model, args=trainer_args(tmp_path, "exact", noise_eps_min=0.0, noise_eps_max=0.0,
                                                      self_conditioning_prob=0.0, completion_only_loss=True),
                             train_dataset=data, eval_dataset=data, processing_class=tiny_tokenizer())
    eval_loss = trainer.evaluate()["eval_loss"]
    expected = inference_block_ce(reference, ids, 5).mean() + encoder_next_token_ce(reference, ids).mean()
    assert eval_loss == pytest.approx(float(expected), rel=1e-5)


def test_chat_template_assistant_only_loss_supervises_the_reply_and_its_turn_end(tmp_path):
    trainer = BDLMSFTTrainer(tiny_model(), args=trainer_args(tmp_path, "chat", assistant_only_loss=True),
                             train_dataset=conversations(4), processing_class=tiny_tokenizer())
    row = trainer.train_dataset[0]
    tok = trainer.processing_class
    supervised = [t for t, label in zip(tok.convert_ids_to_tokens(row["input_ids"]), row["labels"]) if label != -100]
    assert supervised == ["w0", "w1", "w2", "w3", "<turn|>"]  # TRL's training template, generation markers


def test_gradient_accumulation_equals_the_big_batch(tmp_path):
    kw = dict(assistant_only_loss=True, optim="sgd", noise_eps_min=0.1, noise_eps_max=0.9)
    big = BDLMSFTTrainer(tiny_model(), args=trainer_args(tmp_path, "big", per_device_train_batch_size=4, **kw),
                         train_dataset=conversations(8), processing_class=tiny_tokenizer())
    big.train()
    acc = BDLMSFTTrainer(tiny_model(), args=trainer_args(tmp_path, "acc", gradient_accumulation_steps=2, **kw),
                         train_dataset=conversations(8), processing_class=tiny_tokenizer())
    acc.train()
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (big, acc)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    for (name, p), q in zip(big.model.named_parameters(), acc.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)


def test_packed_conversations_give_the_unpacked_loss(tmp_path):
    kw = dict(assistant_only_loss=True, noise_eps_min=0.0, noise_eps_max=0.0, self_conditioning_prob=0.0)
    data = conversations(2)
    losses = []
    for packing in (False, True):
        trainer = BDLMSFTTrainer(tiny_model(), args=trainer_args(tmp_path, f"pack{packing}", packing=packing, **kw),
                                 train_dataset=data, eval_dataset=data, processing_class=tiny_tokenizer())
        if packing:
            assert len(trainer.eval_dataset) == 1  # both conversations in one row
        losses.append(trainer.evaluate()["eval_loss"])
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


def test_full_fine_tuning_keeps_the_router_frozen_and_the_checkpoint_reloads_and_generates(tmp_path):
    model = tiny_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = BDLMSFTTrainer(model, args=trainer_args(tmp_path, "full", assistant_only_loss=True),
                             train_dataset=conversations(8), processing_class=tiny_tokenizer())
    trainer.train()
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and not any(".router." in n for n in changed)
    assert any("experts" in n for n in changed) and any("self_conditioning" in n for n in changed)
    trainer.save_model(str(tmp_path / "saved"))
    reloaded = DiffusionGemmaForBlockDiffusion.from_pretrained(str(tmp_path / "saved")).eval()
    for name, p in reloaded.state_dict().items():
        torch.testing.assert_close(p, trainer.model.state_dict()[name], msg=name)
    prompt = tiny_tokenizer().apply_chat_template([{"role": "user", "content": "w1 w2"}], add_generation_prompt=True,
                                                  return_tensors="pt", return_dict=True)["input_ids"]
    out = reloaded.generate(prompt, max_new_tokens=2 * B, eos_token_id=None, max_denoising_steps=4)
    sequences = out.sequences if hasattr(out, "sequences") else out
    assert sequences.shape == (1, prompt.shape[1] + 2 * B)
    card = (tmp_path / "saved" / "README.md").read_text()
    assert "DiffusionGemmaForBlockDiffusion.from_pretrained" in card and "| Self-conditioning probability | 0.5 |" in card


def test_activation_checkpointing_does_not_change_the_step(tmp_path):
    kw = dict(assistant_only_loss=True, optim="sgd", max_steps=1)
    runs = []
    for checkpointing in (False, True):
        trainer = BDLMSFTTrainer(tiny_model(), args=trainer_args(tmp_path, f"ckpt{checkpointing}",
                                                                 activation_checkpointing=checkpointing, **kw),
                                 train_dataset=conversations(4), processing_class=tiny_tokenizer())
        trainer.train()
        runs.append(trainer)
    assert runs[1].model.is_activation_checkpointing and not runs[0].model.is_activation_checkpointing
    assert runs[1].state.log_history[0]["loss"] == pytest.approx(runs[0].state.log_history[0]["loss"], rel=1e-6)
    for p, q in zip(runs[0].model.parameters(), runs[1].model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-7)


def test_lora_adapts_encoder_and_decoder_attention_and_mlp_only(tmp_path):
    from peft import LoraConfig

    trainer = BDLMSFTTrainer(tiny_model(), args=trainer_args(tmp_path, "lora", assistant_only_loss=True),
                             train_dataset=conversations(4), processing_class=tiny_tokenizer(),
                             peft_config=LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0))
    assert trainer.model.peft_config["default"].target_modules == DIFFUSION_GEMMA_LORA_TARGETS
    trainer.train()
    trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n for n in trained)
    adapted = {n.split(".lora_")[0].split(".model.model.", 1)[1] for n in trained}
    assert {"encoder.language_model.layers.0.self_attn.q_proj", "decoder.layers.1.mlp.down_proj"} <= adapted
    assert not any(k in n for n in adapted for k in ("router", "experts", "self_conditioning", "vision"))
    enc = trainer.model.get_base_model().model.encoder.language_model.layers[0].self_attn.q_proj
    dec = trainer.model.get_base_model().model.decoder.layers[0].self_attn.q_proj
    assert enc.base_layer.weight is dec.base_layer.weight  # tied base weights, two adapters (kept unmerged)
    assert not torch.equal(enc.lora_B["default"].weight, dec.lora_B["default"].weight)


def test_the_26b_recipe_scaled_down_to_a_tiny_model_trains_and_saves_a_diffusion_gemma_checkpoint(tmp_path):
    from pathlib import Path

    from trl import ModelConfig, ScriptArguments, TrlParser

    recipe = ROOT / "recipes" / "configs" / "diffusion_gemma_26b_a4b_sft_256k_16gpu.yaml"
    tiny_model().save_pretrained(tmp_path / "model")
    tiny_tokenizer().save_pretrained(tmp_path / "model")
    conversations(6).to_json(tmp_path / "data" / "train.jsonl")
    parser = TrlParser((ScriptArguments, BDLMSFTConfig, ModelConfig))
    script, args, model_args = parser.parse_args_and_config(args=[
        "--config", str(recipe), "--model_name_or_path", str(tmp_path / "model"), "--dtype", "float32",
        "--dataset_name", str(tmp_path / "data"), "--output_dir", str(tmp_path / "out"), "--max_length", "64",
        "--block_parallel_size", "1", "--clean_ring_size", "1", "--bf16", "false", "--max_steps", "2",
        "--gradient_accumulation_steps", "1", "--per_device_train_batch_size", "2", "--dataloader_num_workers", "0",
        "--save_strategy", "no", "--disable_tqdm", "true"])[:3]
    assert (args.objective, args.self_conditioning_prob, args.packing) == ("diffusion_gemma", 0.5, True)
    train = datasets.load_dataset(script.dataset_name)[script.dataset_train_split]
    trainer = BDLMSFTTrainer(model_args.model_name_or_path, args=args, train_dataset=train)
    trainer.train()
    trainer.save_model(args.output_dir)
    assert DiffusionGemmaForBlockDiffusion.from_pretrained(args.output_dir).config.canvas_length == B
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in trainer.state.log_history if "loss" in h)


def test_config_accepts_zero_noise_only_for_diffusion_gemma_and_rejects_its_knobs_elsewhere(tmp_path):
    args = trainer_args(tmp_path, "cfg", noise_eps_min=0.0, noise_eps_max=0.0, self_conditioning_prob=0.0)
    assert (args.noise_eps_min, args.noise_eps_max) == (0.0, 0.0)
    with pytest.raises(ValueError, match=r"must lie in \(0, 1\], got 0.0 \(0 is allowed with an objective whose "
                                         r"noise includes t = 0"):
        trainer_args(tmp_path, "cfg", objective="standard", noise_eps_min=0.0)
    with pytest.raises(ValueError, match=r"\['ar_loss_weight'\] apply to objective='diffusion_gemma' only"):
        trainer_args(tmp_path, "cfg", objective="standard", ar_loss_weight=0.5)
    with pytest.raises(ValueError, match="model_prediction_type must be one of"):
        trainer_args(tmp_path, "cfg", model_prediction_type="x0")


def test_packaged_card_template_is_the_model_cards_copy():
    root = ROOT
    packaged = (root / "hf_bdlm" / "models" / "diffusion_gemma" / "model_card.md").read_text()
    assert (root / "model_cards" / "diffusion_gemma_model_card.md").read_text() == packaged


# --- what vLLM and SGLang read ----------------------------------------------------------------------------------------
# Every field vLLM 0.34.0's and SGLang 0.5.23's DiffusionGemma paths read, and where (read in their released wheels;
# hf_bdlm.models.diffusion_gemma.inference.engines keeps the same list with the same references):
ENGINE_CONFIG_FIELDS = {
    # vllm/model_executor/models/registry.py:429; sglang/srt/dllm/config.py:56,63-66 (the path is chosen by name)
    "architectures": ["DiffusionGemmaForBlockDiffusion"],
    # vllm/model_executor/models/config.py:677, sglang/srt/dllm/config.py:57 (both fall back to 256)
    "canvas_length": B,
    # sglang/srt/dllm/algorithm/gemma4_renoise.py:97-101 and srt/models/gemma4_diffusion.py:459-463: both True
    "tie_word_embeddings": True,
}
ENGINE_TEXT_FIELDS = {
    "tie_word_embeddings": True,  # vllm/model_executor/models/diffusion_gemma.py:250
    "vocab_size": VOCAB,  # vllm diffusion_gemma.py:244,260; sglang gemma4_renoise.py:234
    "hidden_size": 32,  # vllm diffusion_gemma.py:245,269,888; sglang gemma4_diffusion.py:109
    "intermediate_size": 64,  # vllm diffusion_gemma.py:266 (the self-conditioning width); sglang gemma4_diffusion.py:242
    "rms_norm_eps": 1e-6,  # vllm diffusion_gemma.py:271; sglang gemma4_diffusion.py:126
    "final_logit_softcapping": 30.0,  # vllm diffusion_gemma.py:256-258
    "layer_types": ["sliding_attention", "full_attention"],  # sglang gemma4_diffusion.py:87,274
    "sliding_window": W,  # sglang gemma4_diffusion.py:90
    "num_hidden_layers": 2,  # sglang gemma4_diffusion.py:411
}
# generation_config.json, as vLLM reads it (GenerationConfig.from_pretrained(...).to_diff_dict(),
# vllm/config/model.py:1849-1882): the values transformers' generate uses when the model's config leaves them unset.
ENGINE_GENERATION_FIELDS = {
    "max_denoising_steps": 48,  # vllm/model_executor/models/diffusion_gemma.py:879-881 (else 48)
    "stability_threshold": 1,  # diffusion_gemma.py:892, indexed and incremented: required, an integer
    "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.1},  # diffusion_gemma.py:931-938
    "t_min": 0.4,  # diffusion_gemma.py:951, indexed: required
    "t_max": 0.8,  # diffusion_gemma.py:952, indexed: required
    "confidence_threshold": 0.005,  # diffusion_gemma.py:954, indexed: required
}


def test_a_checkpoint_the_trainer_saves_carries_every_field_vllm_and_sglang_read(tmp_path):
    from transformers import AutoConfig, GenerationConfig

    from hf_bdlm.models.diffusion_gemma.inference.engines import engine_field_problems

    model = tiny_model()  # built from a config: its generation config leaves the decoding settings unset (null)
    unset = copy.deepcopy(model.generation_config)
    plain = tmp_path / "plain"
    model.save_pretrained(plain)
    assert len(engine_field_problems(plain)) == 5  # vLLM could not start from it: t_min, t_max, ... are null
    trainer = BDLMSFTTrainer(model, args=trainer_args(tmp_path, "run", max_steps=1, assistant_only_loss=True),
                             train_dataset=conversations(2), processing_class=tiny_tokenizer())
    trainer.train()
    trainer.save_model(str(tmp_path / "saved"))
    saved = tmp_path / "saved"
    config = AutoConfig.from_pretrained(saved)  # what both engines load
    assert {k: getattr(config, k) for k in ENGINE_CONFIG_FIELDS} == ENGINE_CONFIG_FIELDS
    text = config.text_config
    assert {k: getattr(text, k) for k in ENGINE_TEXT_FIELDS} == ENGINE_TEXT_FIELDS
    assert set(text.rope_parameters) == {"sliding_attention", "full_attention"}  # sglang gemma4_diffusion.py:132
    generation = GenerationConfig.from_pretrained(saved).to_diff_dict()
    assert {k: generation.get(k) for k in ENGINE_GENERATION_FIELDS} == ENGINE_GENERATION_FIELDS
    assert engine_field_problems(saved) == []
    card = (saved / "README.md").read_text()
    assert (f"vllm serve {saved} --diffusion-config '{{\"canvas_length\": {B}, \"max_denoising_steps\": 48}}'"
            in card)
    assert (f"python -m sglang.launch_server --model-path {saved} --dllm-algorithm Gemma4Renoise "
            "--dllm-algorithm-config dg_renoise.yaml") in card
    assert "temperature_schedule:\\n  t_min: 0.4\\n  t_max: 0.8" in card
    # generate decodes as before: the values written are those it filled in at every call
    reloaded = DiffusionGemmaForBlockDiffusion.from_pretrained(saved).eval()
    prompt = torch.tensor([[2, 3, 7, 8, 9]])
    torch.manual_seed(0)
    before = reloaded.generate(prompt, generation_config=unset, max_new_tokens=2 * B, eos_token_id=None)
    torch.manual_seed(0)
    after = reloaded.generate(prompt, max_new_tokens=2 * B, eos_token_id=None)
    assert torch.equal(getattr(before, "sequences", before), getattr(after, "sequences", after))


def test_certainty_term_adds_the_entropy_of_the_right_canvas_predictions():
    model = tiny_model()
    samples = [sample(23, response_start=5, seed=0), sample(17, response_start=10, seed=1)]
    plain = objective(noise_eps_min=0.5, noise_eps_max=0.5)
    forced = objective(noise_eps_min=0.5, noise_eps_max=0.5, certainty_weight=0.5)
    corrupted = plain.corrupt(batch_of(*samples), seed=0, step=0)
    base, _ = plain.loss(model, corrupted)
    loss, metrics = forced.loss(model, corrupted)
    frame = corrupted.frame
    layout = DiffusionGemmaLayout.local(frame)
    _, cache = encode(model, frame, layout)
    logits = softcapped_logits(model, decode(model, frame, layout, corrupted.noisy_ids, cache))
    scored, targets = logits[frame.canvas_supervised], frame.canvas_target[frame.canvas_supervised]
    hits = scored.argmax(-1) == targets
    entropy = torch.distributions.Categorical(logits=scored[hits]).entropy().sum()
    assert int(hits.sum()) >= 3 and metrics["correct"] == int(hits.sum())
    assert metrics["certainty_sum"].item() == pytest.approx(entropy.item(), rel=1e-5)
    assert loss.item() == pytest.approx(base.item() + 0.5 * entropy.item() / corrupted.normalizer, rel=1e-5)
    with torch.no_grad():  # evaluation: the cross-entropy alone
        assert torch.equal(forced.loss(model, corrupted)[0], plain.loss(model, corrupted)[0])
    assert forced.card_settings()["certainty_weight"] == 0.5 and "certainty_weight" not in plain.card_settings()
