"""DFlash drafter export: the folder vLLM and SGLang serve passes our serving-contract check and the published
DFlash2 export validators (``dllm_parallel``'s SGLang and vLLM checks, the oracle), holds no target tensor, reloads
to identical weights, is written atomically; a missing / extra / mis-shaped tensor is named; the upload sends exactly
the folder; and ``hf-bdlm dflash init / export / check`` run end to end on a tiny target.
"""

import functools
import json
import os

import fixtures
import pytest
import torch
from dllm_parallel.core.models.backbones.dflash.executor import (
    _expected_dflash2_serving_shapes,
    normalize_sglang_dflash2_config,
    validate_sglang_dflash2_export,
)
from dllm_parallel.serving.vllm_dflash import validate_vllm_dflash2_export
from huggingface_hub import HfApi
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tiny_bdlm import tiny_tokenizer
from transformers import LlamaForCausalLM

import hf_bdlm.models.dflash.inference.export as export_module
from hf_bdlm.cli import main
from hf_bdlm.hub.upload import folder_files
from hf_bdlm.models.dflash.training.capture import FeatureStore
from hf_bdlm.models.dflash.configuration import DFlashConfig
from hf_bdlm.models.dflash.inference.export import (
    PROVENANCE_FORMAT,
    ServingContractError,
    check_serving_inventory,
    export_drafter,
    push_drafter_to_hub,
    serving_shapes,
)
from hf_bdlm.models.dflash.modeling import DFlash2DraftModel, DFlashDraftModel

BLOCK = 4


tiny_target = functools.partial(fixtures.tiny_target, kind="qwen3", max_position_embeddings=128, pad_token_id=1,
                                eos_token_id=3)
# A bound drafter whose every weight is random (identity convolutions and a zero codebook would hide a swap).
tiny_drafter = functools.partial(fixtures.tiny_drafter, noise="normal", num_hidden_layers=2, target_layer_ids=(1, 3),
                                 block_size=BLOCK, dflash2_fields=dict(selector_rank=8))


@pytest.fixture
def exported(tmp_path):
    drafter = tiny_drafter(tiny_target())
    out = export_drafter(drafter, tmp_path / "export", target_id="org/tiny-target", target_revision="abc123",
                         training_info={"steps": 20, "loss": 2.5, "dataset": "hf_bdlm:arith"})
    return drafter, out


def rewrite_weights(folder, change):
    """Apply ``change`` to the weights dict and rewrite the file with a matching provenance hash (so only the
    inventory is wrong)."""
    weights = load_file(folder / "model.safetensors")
    change(weights)
    save_file(weights, folder / "model.safetensors")
    provenance = json.loads((folder / "training_export.json").read_text())
    provenance["weights"]["sha256"] = export_module.file_sha256(folder / "model.safetensors")
    provenance["weights"]["tensor_count"] = len(weights)
    (folder / "training_export.json").write_text(json.dumps(provenance))


# --- the contract ---------------------------------------------------------------------------------------------------
def test_the_export_passes_our_check_and_both_serving_validators(exported):
    _, out = exported
    ours = check_serving_inventory(out)
    sglang = validate_sglang_dflash2_export(out, expected_block_size=BLOCK)
    vllm = validate_vllm_dflash2_export(out, expected_block_size=BLOCK)
    assert ours["tensor_count"] == sglang["tensor_count"] == vllm["tensor_count"] == 36  # 3 + 3 + 2 x 15
    assert ours["num_speculative_tokens"] == vllm["num_speculative_tokens"] == BLOCK - 1
    assert ours["architecture"] == "DFlash2DraftModel" and ours["target_layer_ids"] == [0, 2]
    provenance = json.loads((out / "training_export.json").read_text())
    assert provenance["format"] == PROVENANCE_FORMAT
    assert (provenance["model_id"], provenance["model_revision"]) == ("org/tiny-target", "abc123")
    assert provenance["training"] == {"steps": 20, "loss": 2.5, "dataset": "hf_bdlm:arith"}
    assert sorted(os.listdir(out)) == ["README.md", "config.json", "model.safetensors", "training_export.json"]


@pytest.mark.parametrize("overrides", [{}, {"attention_bias": True}, {"num_key_value_heads": 4, "num_hidden_layers": 3},
                                       {"mlp_bias": True, "conv_kernel_size": 3, "conv_group_size": 8}])
def test_our_inventory_is_the_serving_inventory_of_the_published_checker(overrides):
    layers = overrides.pop("num_hidden_layers", 2)
    config = DFlashConfig.for_target(tiny_target().config, num_hidden_layers=layers, target_layer_ids=(1, 2, 3),
                                     block_size=BLOCK, **overrides)
    raw = json.loads(config.to_json_string())
    assert serving_shapes(raw) == _expected_dflash2_serving_shapes(normalize_sglang_dflash2_config(raw))


def test_no_target_tensor_is_written_even_when_the_state_dict_offers_one(tmp_path, monkeypatch):
    drafter = tiny_drafter(tiny_target())
    assert drafter.embed_tokens is not None  # bound to its target
    offered = dict(drafter.state_dict(), **{"embed_tokens.weight": torch.zeros(64, 32),
                                            "lm_head.weight": torch.zeros(64, 32), "d2t": torch.zeros(64)})
    monkeypatch.setattr(drafter, "state_dict", lambda: offered)
    out = export_drafter(drafter, tmp_path / "export", target_id="org/tiny-target")
    with safe_open(out / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
    assert not names & {"embed_tokens.weight", "lm_head.weight", "d2t"}
    assert names == set(serving_shapes(json.loads((out / "config.json").read_text())))


def test_the_exported_folder_reloads_to_identical_weights(exported):
    drafter, out = exported
    reloaded = DFlash2DraftModel.from_pretrained(out)
    ours, theirs = drafter.state_dict(), reloaded.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
    assert reloaded.config.target_layer_ids == (1, 3) and reloaded.config.block_size == BLOCK


def test_a_bfloat16_export_casts_the_weights_and_says_so(tmp_path):
    drafter = tiny_drafter(tiny_target())
    out = export_drafter(drafter, tmp_path / "export", target_id="org/tiny-target", dtype=torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    weights = load_file(out / "model.safetensors")
    assert all(w.dtype == torch.bfloat16 for w in weights.values())
    assert torch.equal(weights["fc.weight"], drafter.fc.weight.detach().to(torch.bfloat16))
    validate_vllm_dflash2_export(out, expected_block_size=BLOCK)


def test_a_dflash_drafter_exports_without_convolutions_or_selector(tmp_path):
    out = export_drafter(tiny_drafter(tiny_target(), dflash2=False), tmp_path / "export", target_id="org/tiny-target")
    report = check_serving_inventory(out)
    assert report["architecture"] == "DFlashDraftModel" and report["tensor_count"] == 3 + 2 * 11
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert not any("conv" in name or "selector" in name for name in f.keys())
    saved = load_file(out / "model.safetensors")["fc.weight"]
    assert torch.equal(DFlashDraftModel.from_pretrained(out).fc.weight, saved)


def test_missing_extra_mis_shaped_and_target_tensors_are_all_named(exported):
    _, out = exported

    def break_it(weights):
        del weights["layers.1.mlp_conv.base_kernel"]
        weights["layers.0.self_attn.extra"] = torch.zeros(2)
        weights["fc.weight"] = torch.zeros(32, 63)
        weights["lm_head.weight"] = torch.zeros(64, 32)

    rewrite_weights(out, break_it)
    with pytest.raises(ServingContractError) as caught:
        check_serving_inventory(out)
    message = str(caught.value)
    assert "target tensors that must not be exported (the engines take them from the target): ['lm_head.weight']" \
        in message
    assert "missing tensors ['layers.1.mlp_conv.base_kernel']" in message
    assert "unexpected tensors ['layers.0.self_attn.extra']" in message
    assert "mis-shaped tensors ['fc.weight [32, 63] (expected [32, 64])']" in message
    with pytest.raises(RuntimeError, match="verifier-only tensors"):  # the oracle rejects it too
        validate_sglang_dflash2_export(out)


def test_weights_changed_after_export_fail_the_hash_check(exported):
    _, out = exported
    weights = load_file(out / "model.safetensors")
    weights["norm.weight"] = weights["norm.weight"] + 1
    save_file(weights, out / "model.safetensors")
    with pytest.raises(ServingContractError, match=r"model.safetensors does not match the sha256 in "
                                                   r"training_export.json"):
        check_serving_inventory(out)
    with pytest.raises(RuntimeError, match="SHA-256 mismatch"):
        validate_sglang_dflash2_export(out)


def test_a_config_that_breaks_the_contract_names_every_field():
    raw = json.loads(DFlashConfig.for_target(tiny_target().config, num_hidden_layers=1, target_layer_ids=(2,),
                                             block_size=BLOCK, selector_rank=8).to_json_string())
    raw.update(model_type="llama", block_size=8, target_layer_ids=[2, 3])
    raw["dflash_config"].pop("selector_top_k")
    raw["dflash_config"]["attention_mode"] = "mla"
    with pytest.raises(ServingContractError) as caught:
        serving_shapes(raw)
    message = str(caught.value)
    for part in ("model_type must be 'qwen3'", "block_size=8 disagrees with dflash_config.block_size=4",
                 "dflash_config.selector_top_k must be a positive integer, got None",
                 "attention_mode must be one of ('gqa', 'mha'), got 'mla'",
                 "top-level target_layer_ids=[2, 3] (canonical ids) disagrees with dflash_config.target_layer_ids=[1]"):
        assert part in message, part
    with pytest.raises(ServingContractError, match=r"architectures must be one of \[\['DFlash2DraftModel'\], "
                                                   r"\['DFlashDraftModel'\]\], got \['Qwen3ForCausalLM'\]"):
        serving_shapes(dict(raw, architectures=["Qwen3ForCausalLM"]))


# --- writing --------------------------------------------------------------------------------------------------------
def test_export_refuses_to_overwrite_unless_asked_and_leaves_no_staging_folder(exported, monkeypatch):
    drafter, out = exported
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(FileExistsError, match=r"exists; choose a new folder or pass overwrite=True"):
        export_drafter(drafter, out, target_id="org/tiny-target")
    with torch.no_grad():
        drafter.norm.weight.add_(1)
    export_drafter(drafter, out, target_id="org/tiny-target", overwrite=True)
    assert (out / "model.safetensors").read_bytes() != before
    assert torch.equal(load_file(out / "model.safetensors")["norm.weight"], drafter.norm.weight.detach())

    def broken(folder):
        raise ServingContractError("broken on purpose")

    monkeypatch.setattr(export_module, "check_serving_inventory", broken)
    with pytest.raises(ServingContractError, match="broken on purpose"):
        export_drafter(drafter, out.parent / "second", target_id="org/tiny-target")
    assert sorted(p.name for p in out.parent.iterdir()) == ["export"]  # no half export, no staging folder


def test_the_model_card_names_the_target_the_serving_commands_and_the_training(exported):
    _, out = exported
    card = (out / "README.md").read_text()
    assert "base_model: org/tiny-target" in card and "- dflash" in card
    assert ('vllm serve org/tiny-target --revision abc123 \\\n  --speculative-config \'{"method": "dflash", "model": '
            f'"{out}", "num_speculative_tokens": 3}}\'') in card
    assert "python -m sglang.launch_server --model-path org/tiny-target --revision abc123 \\\n" in card
    assert f"--speculative-algorithm DFLASH --speculative-draft-model-path {out}" in card
    assert "| Training steps | 20 |" in card and "| Final loss | 2.5 |" in card
    assert "| Dataset | hf_bdlm:arith |" in card and "(`abc123`)" in card


# --- the hub --------------------------------------------------------------------------------------------------------
@pytest.fixture
def hub(monkeypatch):
    commits = []

    def create_repo(self, repo_id, **kwargs):
        return type("RepoUrl", (), {"repo_id": repo_id})()

    def create_commit(self, repo_id, operations, **kwargs):
        commits.append((repo_id, {op.path_in_repo: open(op.path_or_fileobj, "rb").read() for op in operations},
                        kwargs))
        return "commit"

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    return commits


def test_push_to_hub_uploads_exactly_the_folders_files(exported, hub):
    _, out = exported
    (out / ".cache").mkdir()
    (out / ".cache" / "lock").write_text("")  # hidden: never uploaded
    push_drafter_to_hub(out, "me/tiny-drafter")
    [(repo_id, files, kwargs)] = hub
    assert repo_id == "me/tiny-drafter" and kwargs["commit_message"] == "Upload DFlash drafter (hf_bdlm)"
    assert sorted(files) == folder_files(out) == ["README.md", "config.json", "model.safetensors",
                                                  "training_export.json"]
    assert all(files[name] == (out / name).read_bytes() for name in files)


def test_push_to_hub_refuses_a_folder_that_breaks_the_contract(exported, hub):
    _, out = exported
    rewrite_weights(out, lambda weights: weights.pop("norm.weight"))
    with pytest.raises(ServingContractError, match=r"missing tensors \['norm.weight'\]"):
        push_drafter_to_hub(out, "me/tiny-drafter")
    assert hub == []


# --- the command ----------------------------------------------------------------------------------------------------
@pytest.fixture
def saved_target(tmp_path):
    folder = tmp_path / "target"
    tiny_target(kind="llama").save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def test_init_writes_a_serving_ready_drafter_for_a_target(saved_target, tmp_path, capsys):
    out = tmp_path / "drafter"
    assert main(["dflash", "init", "--target", str(saved_target), "--out", str(out), "--layers", "2",
                 "--block-size", "4", "--init", "target_layers", "--layer-ids", "1", "3"]) == 0
    assert "vllm serve" in capsys.readouterr().out
    validate_vllm_dflash2_export(out, expected_block_size=4)
    drafter = DFlash2DraftModel.from_pretrained(out)
    target = LlamaForCausalLM.from_pretrained(saved_target)
    assert drafter.config.target_layer_ids == (1, 3)
    # target_layers: the drafter's layers start as the target's last two
    assert torch.equal(drafter.layers[0].mlp.up_proj.weight, target.model.layers[1].mlp.up_proj.weight)
    assert torch.equal(drafter.layers[1].self_attn.q_proj.weight, target.model.layers[2].self_attn.q_proj.weight)
    assert main(["dflash", "init", "--target", str(saved_target), "--out", str(out)]) == 2
    assert "exists; choose a new folder or pass overwrite=True" in capsys.readouterr().err
    # the drafter's folder tells capture which target layers to store
    assert main(["dflash", "capture", "--target", str(saved_target), "--drafter", str(out), "--dataset",
                 "hf_bdlm:arith", "--out", str(tmp_path / "features"), "--max-records", "2", "--max-length", "32",
                 "--quiet"]) == 0
    store = FeatureStore(tmp_path / "features")
    store.check_drafter(drafter.config, target_id=str(saved_target))
    assert store.layer_ids == (1, 3) and len(store) == 2


def test_an_export_for_the_embedded_target_names_the_hub_model_engines_load(tmp_path, capsys):
    # `embedded:smollm2` is hf_bdlm's alias of a local export of SmolLM2-135M-Instruct: vLLM and SGLang load the Hub
    # model it was made from, so every printed and written command names that (and the revision, when given).
    drafter = tiny_drafter(tiny_target())
    drafter.save_pretrained(tmp_path / "checkpoint")
    out = tmp_path / "export"
    assert main(["dflash", "export", str(tmp_path / "checkpoint"), "--out", str(out), "--target", "embedded:smollm2",
                 "--target-revision", "rev1"]) == 0
    printed = capsys.readouterr().out
    hub_id = "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert f"    vllm serve {hub_id} --revision rev1 --speculative-config" in printed
    assert (f"    python -m sglang.launch_server --model-path {hub_id} --revision rev1 --speculative-algorithm DFLASH "
            f"--speculative-draft-model-path {out} --speculative-dflash-block-size {BLOCK}") in printed
    card = (out / "README.md").read_text()
    assert f"vllm serve {hub_id} --revision rev1 \\\n" in card and f"base_model: {hub_id}" in card
    assert json.loads((out / "training_export.json").read_text())["model_id"] == hub_id
    assert "embedded:" not in printed + card


def test_export_check_and_push_commands_run_end_to_end(tmp_path, hub, capsys):
    drafter = tiny_drafter(tiny_target())
    drafter.save_pretrained(tmp_path / "checkpoint")
    (tmp_path / "checkpoint" / "trainer_state.json").write_text(json.dumps(
        {"global_step": 40, "log_history": [{"loss": 3.0, "step": 20}, {"loss": 2.25, "step": 40}]}))
    out = tmp_path / "export"
    assert main(["dflash", "export", str(tmp_path / "checkpoint"), "--out", str(out), "--target", "org/tiny-target",
                 "--push-to-hub", "me/tiny-drafter"]) == 0
    validate_sglang_dflash2_export(out, expected_block_size=BLOCK)
    assert json.loads((out / "training_export.json").read_text())["training"] == {"steps": 40, "loss": 2.25}
    assert '"model": "me/tiny-drafter"' in (out / "README.md").read_text()
    [(repo_id, files, _)] = hub
    assert repo_id == "me/tiny-drafter" and sorted(files) == folder_files(out)
    reloaded = DFlash2DraftModel.from_pretrained(out).state_dict()
    assert all(torch.equal(reloaded[k], v) for k, v in drafter.state_dict().items())

    capsys.readouterr()
    assert main(["dflash", "check", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["tensor_count"] == 36
    rewrite_weights(out, lambda weights: weights.update({"fc.weight": torch.zeros(32, 65)}))
    assert main(["dflash", "check", str(out)]) == 2
    assert "mis-shaped tensors ['fc.weight [32, 65] (expected [32, 64])']" in capsys.readouterr().err
