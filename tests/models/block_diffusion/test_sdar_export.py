"""The SDAR export: the folder SGLang and LMDeploy serve, and the same model, the same tokens.

The model is a tiny Qwen3 with Qwen3's real vocabulary layout (151936 rows, 151669 tokens; `tiny_qwen3.py`) converted
with `objective="standard"`, so [MASK] lands on 151669 without a resize. Neither engine runs here; what they compute
is assembled in `scripts/sdar_engines.py`: the exported weights in transformers' own `Qwen3ForCausalLM` under the
engines' block-causal mask, SGLang's LowConfidence and LMDeploy's low_confidence_dynamic transcribed from their
released sources, and LMDeploy's own `UnmaskingProcessor` imported from its released wheel.
Run: python -m pytest tests/models/block_diffusion/test_sdar_export.py -q
"""

from __future__ import annotations

import json

import pytest
import torch
from huggingface_hub import HfApi
from safetensors import safe_open
from fixtures import tiny_target
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig

from scripts.sdar_engines import (
    block_forward,
    engine_logits,
    lmdeploy_decode,
    lmdeploy_dynamic_released,
    lmdeploy_dynamic_transcribed,
    lmdeploy_unmasking_module,
    load_reference_qwen3,
    our_inference_logits,
    sglang_low_confidence,
)
from hf_bdlm import convert_causal_lm
from hf_bdlm.cli import main
from hf_bdlm.models.block_diffusion.generation import BlockDiffusionGenerationConfig, resolve_settings
from hf_bdlm.models.block_diffusion.inference.export_sdar import (
    SDAR_MASK_TOKEN_ID,
    SDARExportError,
    check_sdar_folder,
    export_sdar,
    push_sdar_to_hub,
    sdar_tensor_shapes,
    zero_mask_logit,
)
from tiny_qwen3 import ENDOFTEXT, IM_END, qwen3_layout_tokenizer, sharpen_head, tiny_qwen3

B = 4
MASK = SDAR_MASK_TOKEN_ID


def converted(tie=False, sharpen=False, objective="standard", **kwargs):
    lm = tiny_qwen3(tie=tie)
    if sharpen:
        sharpen_head(lm)
    model, tokenizer = convert_causal_lm(lm, qwen3_layout_tokenizer(), block_size=B, objective=objective, **kwargs)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    model, tokenizer = converted(tie=False, sharpen=True)
    out = export_sdar(model, tmp_path_factory.mktemp("untied") / "sdar", tokenizer, confidence_threshold=0.9)
    return model, tokenizer, out


def plain_exports(tmp_path_factory, tie):
    model, tokenizer = converted(tie=tie)
    root = tmp_path_factory.mktemp("tied" if tie else "untied")
    return model, tokenizer, export_sdar(model, root / "zero", tokenizer), export_sdar(
        model, root / "keep", tokenizer, mask_logit="keep")


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return plain_exports(tmp_path_factory, tie=True)


@pytest.fixture(scope="module")
def plain_untied(tmp_path_factory):
    return plain_exports(tmp_path_factory, tie=False)


def tensor_shapes(folder):
    shapes = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    return shapes


# --- the contract -----------------------------------------------------------------------------------------------------
def test_the_folder_holds_exactly_the_qwen3_tensors_and_every_field_the_engines_read(untied):
    model, _, out = untied
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["SDARForCausalLM"] and config["model_type"] == "sdar"
    assert config["auto_map"] == {"AutoConfig": "configuration_sdar.SDARConfig"}
    backbone = model.config.backbone_config
    expected = {"vocab_size": 151936, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "hidden_act": "silu",
                "rms_norm_eps": backbone.rms_norm_eps, "max_position_embeddings": 512, "rope_theta": 1e6,
                "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
                "max_window_layers": 2, "tie_word_embeddings": False, "bos_token_id": ENDOFTEXT,
                "eos_token_id": IM_END, "pad_token_id": ENDOFTEXT, "torch_dtype": "float32", "block_size": B,
                "mask_token_id": MASK}
    assert {k: config[k] for k in expected} == expected
    assert "rope_scaling" not in config and "rope_parameters" not in config
    # every tensor the engines load, no wrapper prefix, nothing else (LMDeploy's loader fails on any other name)
    shapes = tensor_shapes(out)
    assert shapes == sdar_tensor_shapes(config)
    assert len(shapes) == 3 + 2 * 11 and "lm_head.weight" in shapes
    assert not any(name.startswith("backbone.") for name in shapes)
    report = check_sdar_folder(out)
    assert report["tensor_count"] == 25 and report["mask_row_zero"] and report["threshold"] == 0.9


def test_the_config_class_in_the_folder_keeps_rope_theta_and_the_token_ids(untied):
    _, _, out = untied
    config = AutoConfig.from_pretrained(out, trust_remote_code=True)  # what SGLang and LMDeploy load
    assert type(config).__name__ == "SDARConfig"
    assert config.rope_theta == 1e6 and getattr(config, "rope_scaling", None) is None
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (ENDOFTEXT, ENDOFTEXT, IM_END)
    assert config.sliding_window is None and config.tie_word_embeddings is False and config.head_dim == 8
    # LMDeploy's fallback without remote code: a generic config keeping every key
    generic = PretrainedConfig.from_pretrained(out)
    assert generic.model_type == "sdar" and generic.rope_theta == 1e6 and generic.pad_token_id == ENDOFTEXT


def test_tokenizer_generation_config_yaml_and_card(untied):
    _, _, out = untied
    tokenizer = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    assert tokenizer.mask_token_id == MASK and tokenizer.mask_token == "<|mask|>" and len(tokenizer) == MASK + 1
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [IM_END, ENDOFTEXT] and generation["pad_token_id"] == ENDOFTEXT
    assert generation["top_k"] == 1 and generation["temperature"] == 1.0  # LMDeploy's server samples: the argmax
    assert not any(k in generation for k in ("block_size", "confidence_threshold", "token_shift", "unmasking"))
    assert (out / "sglang_dllm.yaml").read_text() == "block_size: 4\nthreshold: 0.9\n"
    card = (out / "README.md").read_text()
    assert (f"python -m sglang.launch_server --model-path {out} --trust-remote-code --dllm-algorithm LowConfidence "
            f"--dllm-algorithm-config {out}/sglang_dllm.yaml") in card
    assert (f"lmdeploy serve api_server {out} --backend pytorch --trust-remote-code --dllm-block-length 4 "
            "--dllm-unmasking-strategy low_confidence_dynamic --dllm-confidence-threshold 0.9") in card
    assert "- sdar" in card and "(this model's block size is 4)" in card


def test_a_tied_head_is_written_untied_with_a_zero_mask_row_or_kept_tied(tied):
    model, _, zero, keep = tied
    embedding = model.get_input_embeddings().weight.detach()
    with safe_open(str(zero / "model.safetensors"), framework="pt") as f:
        head, embed = f.get_tensor("lm_head.weight"), f.get_tensor("model.embed_tokens.weight")
    assert torch.equal(embed, embedding)  # the [MASK] input embedding is the trained one
    assert torch.equal(head[MASK], torch.zeros(32)) and embedding[MASK].abs().sum() > 0
    rows = torch.arange(head.shape[0]) != MASK
    assert torch.equal(head[rows], embedding[rows])
    assert json.loads((zero / "config.json").read_text())["tie_word_embeddings"] is False
    assert "lm_head.weight" not in tensor_shapes(keep)
    assert json.loads((keep / "config.json").read_text())["tie_word_embeddings"] is True
    assert check_sdar_folder(keep)["tied"] is True
    # the model itself is not changed by the export
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


# --- refusals ---------------------------------------------------------------------------------------------------------
def llama_bdlm():
    lm = tiny_target("llama", num_hidden_layers=1, training=True)
    return convert_causal_lm(lm, mask_token_id=63, block_size=B, objective="standard")[0]


@pytest.mark.parametrize("make, message", [
    (lambda: converted(objective="fast_dllm_v2")[0], "objective='fast_dllm_v2': the logit at position i predicts "
                                                     "token i+1"),
    (lambda: converted(objective="fast_dllm_v2_causal_clean")[0], "objective='fast_dllm_v2_causal_clean'"),
    (lambda: converted(clean_attention="causal")[0], "clean_attention='causal': the engines compute the clean "
                                                     "prefix block-causally"),
    (lambda: converted(mask_token_id=151668)[0], "mask_token_id=151668: both engines hard-code [MASK] = 151669"),
    (llama_bdlm, "the backbone is 'llama', and SDAR is a Qwen3 decoder: SGLang's --dllm-algorithm serves a fixed list"),
])
def test_a_model_the_engines_cannot_serve_is_refused_naming_what_serves_it(make, message, tmp_path):
    model = make()
    tokenizer = None  # the model is refused before its tokenizer is looked at
    with pytest.raises(SDARExportError, match="cannot be served as SDAR") as err:
        export_sdar(model, tmp_path / "out", tokenizer)
    assert message in str(err.value) and "hf-bdlm serve DIR" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_without_the_mask_id_is_refused(tmp_path):
    model, _ = converted()
    tokenizer = qwen3_layout_tokenizer()  # never given the [MASK] token: 151669 entries, no id 151669
    with pytest.raises(SDARExportError, match="the tokenizer has no id 151669"):
        export_sdar(model, tmp_path / "out", tokenizer)


# --- same model, same logits ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mask_logit", ["keep", "zero"])
@pytest.mark.parametrize("tie", [False, True])
def test_the_exported_weights_in_transformers_qwen3_give_our_logits(request, tie, mask_logit):
    model, _, zero, keep = request.getfixturevalue("tied" if tie else "plain_untied")
    qwen3 = load_reference_qwen3(zero if mask_logit == "zero" else keep)  # strict: every tensor used, none missing
    torch.manual_seed(3)
    prefix = torch.randint(0, 151000, (8,)).tolist()  # two clean blocks
    block = [17, MASK, 5, MASK]  # the noisy block: a decoded token, masks
    engine = engine_logits(qwen3, prefix + block, B)
    ours = our_inference_logits(model, prefix, block)  # clean rows, and generate's cached noisy block
    if mask_logit == "zero":
        assert torch.equal(engine[:, MASK], torch.zeros(len(prefix) + B))
        keep_columns = torch.arange(engine.shape[1]) != MASK
        engine, ours = engine[:, keep_columns], ours[:, keep_columns]
    difference = (engine - ours).abs().max().item()
    # float32: measured 1.5e-7 in all four cases (logits up to 0.76; with the head x100, logits up to 54: 1.3e-5)
    assert difference <= 1e-6, difference


def test_zeroing_the_mask_row_changes_no_other_logit_of_our_model():
    model, _ = converted(tie=True)
    ids = torch.tensor([[5, 6, 7, 8, MASK, 9, MASK, 3]])
    with torch.no_grad():
        before = model(input_ids=ids, clean_input_ids=ids).logits[0]
        after = zero_mask_logit(model)(input_ids=ids, clean_input_ids=ids).logits[0]
    assert torch.equal(after[:, MASK], torch.zeros(8)) and before[:, MASK].abs().min() > 0
    others = torch.arange(after.shape[1]) != MASK
    assert torch.equal(after[:, others], before[:, others])
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight


# --- same model, same tokens ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lmdeploy_module():
    try:
        return lmdeploy_unmasking_module()
    except RuntimeError as err:
        pytest.skip(f"LMDeploy's released wheel is not reachable ({err}); set HF_BDLM_LMDEPLOY_SOURCE to an unzipped "
                    "lmdeploy 0.18.0 wheel")


@pytest.fixture(scope="module")
def served(untied):
    """Our model as the export serves it ([MASK] row of the head zero) and the engine forward of its export."""
    model, _, folder = untied
    return zero_mask_logit(model), block_forward(load_reference_qwen3(folder), B)


def ours(model, prompt, rule, threshold, new_tokens=12):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, unmasking=rule,
                         confidence_threshold=threshold, eos_token_id=None)
    return out[0, len(prompt):].tolist()


PROMPT = [9, 4512, 77, 130000, 5, 61, 8, 2024, 150, 3]


@pytest.mark.parametrize("length", [3, 8, 10])  # the prompt ends mid-block (3, 2 tokens in it) or on a boundary
@pytest.mark.parametrize("threshold", [0.6, 0.95])
def test_generate_with_sglangs_rule_decodes_what_sglang_decodes(served, length, threshold):
    model, forward = served
    engine = sglang_low_confidence(forward, PROMPT[:length], B, threshold, 12, MASK)
    assert ours(model, PROMPT[:length], "sglang_low_confidence", threshold) == engine["tokens"]


def test_sglangs_first_eos_cut_and_token_budget_are_ours(served):
    model, forward = served
    prompt = PROMPT[:8]
    free = sglang_low_confidence(forward, prompt, B, 0.6, 12, MASK)["tokens"]
    eos = free[6]  # a token the model emits in its second block: the output stops there, keeping it
    engine = sglang_low_confidence(forward, prompt, B, 0.6, 12, MASK, eos_ids=(eos,))
    assert engine["tokens"] == free[: free.index(eos) + 1] and len(engine["tokens"]) < 12
    out = model.generate(torch.tensor([prompt]), max_new_tokens=12, unmasking="sglang_low_confidence",
                         confidence_threshold=0.6, eos_token_id=eos)
    assert out[0, len(prompt):].tolist() == engine["tokens"]
    assert sglang_low_confidence(forward, prompt, B, 0.6, 6, MASK)["tokens"] == ours(
        model, prompt, "sglang_low_confidence", 0.6, new_tokens=6)  # a budget that ends inside a block


@pytest.mark.parametrize("length", [3, 8, 10])
@pytest.mark.parametrize("threshold", [0.6, 0.95])
def test_generate_with_lmdeploys_rule_decodes_what_lmdeploys_processor_decodes(served, lmdeploy_module, length,
                                                                                threshold):
    model, forward = served
    prompt = PROMPT[:length]
    released = lmdeploy_decode(forward, prompt, B, 12, MASK, lmdeploy_dynamic_released(lmdeploy_module, B, threshold))
    transcribed = lmdeploy_decode(forward, prompt, B, 12, MASK, lmdeploy_dynamic_transcribed(B, threshold))
    assert released == transcribed
    assert ours(model, prompt, "lmdeploy_low_confidence_dynamic", threshold) == released["tokens"]


def test_the_thresholds_exercise_both_parallel_and_single_steps(served):
    _, forward = served
    loose = sglang_low_confidence(forward, PROMPT[:8], B, 0.6, 12, MASK)
    strict = sglang_low_confidence(forward, PROMPT[:8], B, 0.95, 12, MASK)
    assert loose["parallel_steps"] > 0 and max(strict["steps"]) == B  # some block needs one step per token


def test_where_mask_wins_sglang_stalls_lmdeploy_commits_it_and_ours_never_picks_it(tmp_path):
    model, tokenizer = converted(sharpen=True)
    with torch.no_grad():  # an untrained [MASK] logit that beats every other one
        model.get_output_embeddings().weight[MASK] = model.backbone.model.norm.weight.detach() * 50
    forward = block_forward(load_reference_qwen3(export_sdar(model, tmp_path / "keep", tokenizer,
                                                             mask_logit="keep")), B)
    prompt = PROMPT[:8]
    sglang = sglang_low_confidence(forward, prompt, B, 0.9, 8, MASK)
    lmdeploy = lmdeploy_decode(forward, prompt, B, 8, MASK, lmdeploy_dynamic_transcribed(B, 0.9))
    assert sglang["tokens"] == ours(model, prompt, "sglang_low_confidence", 0.9, 8) == [MASK] * 8
    assert sglang["steps"] == [B + 1, B + 1]  # SGLang's step budget runs out on a block it cannot change
    assert lmdeploy["tokens"] == ours(model, prompt, "lmdeploy_low_confidence_dynamic", 0.9, 8)
    assert MASK in lmdeploy["tokens"]
    assert MASK not in ours(model, prompt, "hf_bdlm", 0.9, 8)


def test_the_rules_differ_exactly_at_the_threshold():
    from hf_bdlm.models.block_diffusion.generation import DecodeSettings, tokens_to_unmask

    masked = torch.tensor([[True, True, True, False]])
    confidence = torch.tensor([[0.9, 0.5, 0.95, 1.0]])
    base = dict(block_size=4, mask_token_id=MASK, max_new_tokens=4, steps_per_block=None, confidence_threshold=0.9,
                token_shift=False, do_sample=False, temperature=1.0, top_k=None, top_p=1.0, eos_token_ids=(),
                pad_token_id=None, rule=None, backend="dense")
    picked = {rule: tokens_to_unmask(masked, confidence, 0, DecodeSettings(**base, unmasking=rule)).tolist()
              for rule in ("sglang_low_confidence", "lmdeploy_low_confidence_dynamic", "hf_bdlm")}
    assert picked["sglang_low_confidence"] == [[False, False, True, False]]  # strictly above 0.9
    assert picked["lmdeploy_low_confidence_dynamic"] == picked["hf_bdlm"] == [[True, False, True, False]]


def test_engine_rules_refuse_settings_they_have_no_counterpart_for():
    model, _ = converted(objective="fast_dllm_v2")
    prompt = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="decodes without token shift"):
        model.generate(prompt, unmasking="sglang_low_confidence")
    model, _ = converted()
    with pytest.raises(ValueError, match="greedy"):
        model.generate(prompt, unmasking="sglang_low_confidence", do_sample=True)
    with pytest.raises(ValueError, match="no fixed number of steps"):
        model.generate(prompt, unmasking="lmdeploy_low_confidence_dynamic", steps_per_block=2)
    with pytest.raises(ValueError, match="unmasking must be one of"):
        model.generate(prompt, unmasking="sglang")
    settings = resolve_settings(model, BlockDiffusionGenerationConfig(unmasking="sglang_low_confidence",
                                                                      confidence_threshold=None), 3)
    assert settings.confidence_threshold == 0.95  # SGLang's default
    settings = resolve_settings(model, BlockDiffusionGenerationConfig(unmasking="lmdeploy_low_confidence_dynamic",
                                                                      confidence_threshold=None), 3)
    assert settings.confidence_threshold == 0.85  # LMDeploy's default


# --- the command ------------------------------------------------------------------------------------------------------
@pytest.fixture
def hub(monkeypatch):
    commits = []
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: type("Repo", (), {"repo_id": repo_id})())
    monkeypatch.setattr(HfApi, "create_commit", lambda self, repo_id, operations, **kw: commits.append(
        (repo_id, sorted(op.path_in_repo for op in operations))) or "commit")
    return commits


def test_the_export_command_writes_prints_the_commands_and_pushes(tmp_path, hub, capsys):
    model, tokenizer = converted(tie=True)
    model.save_pretrained(tmp_path / "bdlm")
    tokenizer.save_pretrained(tmp_path / "bdlm")
    out = tmp_path / "sdar"
    assert main(["export", "--format", "sdar", str(tmp_path / "bdlm"), str(out), "--dtype", "bfloat16",
                 "--confidence-threshold", "0.8", "--push-to-hub", "me/tiny-sdar"]) == 0
    printed = capsys.readouterr().out
    assert (f"python -m sglang.launch_server --model-path {out} --trust-remote-code --dllm-algorithm LowConfidence "
            f"--dllm-algorithm-config {out}/sglang_dllm.yaml") in printed
    assert f"--dllm-block-length 4 --dllm-unmasking-strategy low_confidence_dynamic --dllm-confidence-threshold 0.8" \
        in printed
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    card = (out / "README.md").read_text()
    assert "printf 'block_size: 4\\nthreshold: 0.8\\n' > sglang_dllm.yaml" in card  # the Hub copy writes its YAML
    assert "--model-path me/tiny-sdar" in card and "lmdeploy serve api_server me/tiny-sdar" in card
    [(repo, files)] = hub
    assert repo == "me/tiny-sdar" and "configuration_sdar.py" in files and "sglang_dllm.yaml" in files
    with pytest.raises(SDARExportError, match="breaks the SDAR serving contract"):
        (out / "sglang_dllm.yaml").write_text("threshold: 0.8\n")
        push_sdar_to_hub(out, "me/tiny-sdar")
    assert len(hub) == 1


def test_the_export_command_refuses_what_it_cannot_serve(tmp_path, capsys):
    model, tokenizer = converted(objective="fast_dllm_v2")
    model.save_pretrained(tmp_path / "bdlm")
    tokenizer.save_pretrained(tmp_path / "bdlm")
    assert main(["export", "--format", "sdar", str(tmp_path / "bdlm"), str(tmp_path / "sdar")]) == 2
    err = capsys.readouterr().err
    assert "objective='fast_dllm_v2'" in err and "hf-bdlm convert QWEN3_DIR OUT --objective standard" in err
    assert not (tmp_path / "sdar").exists()
    tiny_qwen3().save_pretrained(tmp_path / "causal")  # not converted yet
    assert main(["export", "--format", "sdar", str(tmp_path / "causal"), str(tmp_path / "sdar")]) == 2
    assert "holds a 'qwen3' causal LM; the SDAR export takes a converted block-diffusion model" in \
        capsys.readouterr().err
