"""Checkpoints and the Hub: complete folders, model cards, self-contained remote code, uploads without a network.

Tiny random Llama (GQA) and Gemma 3 (sliding + full layers, tied embeddings) block-diffusion models with a word-level
tokenizer built offline. The remote-code check runs a fresh interpreter in which hf_bdlm is not importable.
Run: python -m pytest tests/hub/test_hub.py -q
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import tomllib

import pytest
import torch
from huggingface_hub import HfApi, ModelCard
from fixtures import word_tokenizer
from transformers import (
    AutoModel,
    AutoModelForMaskedLM,
    Gemma3TextConfig,
    LlamaConfig,
    PreTrainedTokenizerFast,
)
from transformers.dynamic_module_utils import get_imports, get_relative_imports

import hf_bdlm
from hf_bdlm import BlockDiffusionConfig, BlockDiffusionForMaskedLM
from hf_bdlm.hub import AUTO_MAP, bundle_remote_code, push_to_hub, render_model_card, save_for_hub, write_model_card
from hf_bdlm.hub.remote_code import BundleError, _check_bundle
from paths import ROOT

REPO = ROOT
VOCAB, MASK, BLOCK = 64, 63, 4
WORDS = ["[UNK]", "[PAD]", "<s>", "</s>"] + [f"w{i}" for i in range(4, MASK)] + ["<|mask|>"]
_COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=64, head_dim=8, bos_token_id=2, eos_token_id=3, pad_token_id=1,
)
BACKBONES = {
    "llama": lambda: LlamaConfig(**_COMMON),
    "gemma3": lambda: Gemma3TextConfig(
        **_COMMON, sliding_window=3, layer_types=["sliding_attention", "full_attention"]
    ),
}
CARD_INFO = {
    "parallel": {"block_parallel_mode": "csbp", "block_parallel_size": 2, "clean_ring_size": 2,
                 "block_parallel_transport": "ring", "world_size": 4},
    "dataset": ["hf-bdlm/arith", "local arithmetic (packaged)"],
    "metrics": {"loss": 0.41234, "masked_token_accuracy": 0.8765, "exact_match": 0.625},
    "training": {"max_steps": 30, "learning_rate": 1e-4},
}
UPLOADED = ("model.safetensors", "config.json", "generation_config.json", "configuration_block_diffusion.py",
            "modeling_block_diffusion.py", "tokenizer.json", "tokenizer_config.json", "README.md")


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    return word_tokenizer(WORDS, pad_token="[PAD]", bos_token="<s>", eos_token="</s>", mask_token="<|mask|>")


def tiny_model(backbone: str, clean_attention: str = "block_causal") -> BlockDiffusionForMaskedLM:
    config = BACKBONES[backbone]()
    config._name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"  # as if converted from a Hub checkpoint
    torch.manual_seed(0)
    cfg = BlockDiffusionConfig(
        backbone_config=config, block_size=BLOCK, mask_token_id=MASK, clean_attention=clean_attention
    )
    return BlockDiffusionForMaskedLM._from_config(cfg, dtype=torch.float32).eval()


def inputs():
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(4, MASK, (2, 12), generator=g)
    noisy = clean.masked_fill(torch.rand(2, 12, generator=g) < 0.5, MASK)
    prompt = torch.randint(4, MASK, (1, 6), generator=g)
    return noisy, clean, prompt


@torch.no_grad()
def outputs(model):
    noisy, clean, prompt = inputs()
    logits = model(input_ids=noisy, clean_input_ids=clean).logits
    generated = model.generate(prompt, max_new_tokens=2 * BLOCK, confidence_threshold=0.9)
    return logits, generated


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``{backbone: (folder, expected logits, expected generation)}``, saved with save_for_hub."""
    root = tmp_path_factory.mktemp("saved")
    out = {}
    for backbone, clean_attention in (("llama", "block_causal"), ("gemma3", "causal")):
        model = tiny_model(backbone, clean_attention)
        tokenizer = tiny_tokenizer()
        if backbone == "gemma3":
            tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
        folder = save_for_hub(model, tokenizer, root / backbone, CARD_INFO)
        logits, generated = outputs(model)
        torch.save({"inputs": inputs(), "logits": logits, "generated": generated}, root / f"{backbone}_expected.pt")
        out[backbone] = (folder, logits, generated)
    return out


# --- the saved folder ---------------------------------------------------------------------------------


def test_saved_folder_holds_weights_config_tokenizer_generation_config_remote_code_and_card(saved):
    for folder, _, _ in saved.values():
        files = set(os.listdir(folder))
        assert set(UPLOADED) <= files, sorted(files)
        config = json.loads((folder / "config.json").read_text())
        assert config["auto_map"] == AUTO_MAP
        assert config["model_type"] == "block_diffusion"


def test_auto_map_is_written_to_disk_without_changing_the_model_config(tmp_path):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "a")
    assert not hasattr(model.config, "auto_map")
    model.config.auto_map = {"AutoTokenizer": ["x.Tok", None]}  # e.g. a config loaded with custom tokenizer code
    model.save_pretrained(tmp_path / "b")
    assert model.config.auto_map == {"AutoTokenizer": ["x.Tok", None]}
    assert json.loads((tmp_path / "b" / "config.json").read_text())["auto_map"] == {
        "AutoTokenizer": ["x.Tok", None], **AUTO_MAP
    }


@pytest.mark.parametrize("backbone", list(BACKBONES))
def test_installed_package_loads_the_folder_without_remote_code_to_identical_outputs(saved, backbone):
    folder, want_logits, want_generated = saved[backbone]
    for auto_class in (AutoModel, AutoModelForMaskedLM):
        model = auto_class.from_pretrained(folder).eval()
        assert type(model) is BlockDiffusionForMaskedLM  # the installed class, not the auto_map's code
        logits, generated = outputs(model)
        assert torch.equal(logits, want_logits), f"max diff {(logits - want_logits).abs().max():.2e}"
        assert torch.equal(generated, want_generated)


_FRESH_INTERPRETER = textwrap.dedent(
    r"""
    import json, sys
    site_packages, root = sys.argv[1], sys.argv[2]
    sys.path.append(site_packages)  # no `site`: .pth files (hf_bdlm's editable finder) are not processed
    try:
        import hf_bdlm
    except ImportError:
        pass
    else:
        sys.exit(f"hf_bdlm is importable from {hf_bdlm.__file__}; the check would prove nothing")

    import torch
    from transformers import AutoModel, AutoModelForMaskedLM, AutoTokenizer

    torch.set_num_threads(1)
    for backbone in json.loads(sys.argv[3]):
        folder = f"{root}/{backbone}"
        expected = torch.load(f"{root}/{backbone}_expected.pt")
        noisy, clean, prompt = expected["inputs"]
        for auto_class in (AutoModel, AutoModelForMaskedLM):
            model = auto_class.from_pretrained(folder, trust_remote_code=True).eval()
            assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
            with torch.no_grad():
                logits = model(input_ids=noisy, clean_input_ids=clean).logits
                generated = model.generate(prompt, max_new_tokens=8, confidence_threshold=0.9)
            diff = (logits - expected["logits"]).abs().max().item()
            assert torch.equal(logits, expected["logits"]), f"{backbone}: logits differ by {diff:.2e}"
            assert torch.equal(generated, expected["generated"]), f"{backbone}: {generated} != {expected['generated']}"
        tokenizer = AutoTokenizer.from_pretrained(folder)
        assert tokenizer.mask_token_id == model.config.mask_token_id
        # A remote-code model saves itself with transformers' custom-code machinery (it copies both files).
        model.save_pretrained(f"{root}/{backbone}_resaved")
        again = AutoModel.from_pretrained(f"{root}/{backbone}_resaved", trust_remote_code=True).eval()
        with torch.no_grad():
            assert torch.equal(again(input_ids=noisy, clean_input_ids=clean).logits, expected["logits"])
    print("ok")
    """
)


def test_fresh_interpreter_without_hf_bdlm_loads_remote_code_to_identical_logits_and_generation(saved, tmp_path):
    root = tmp_path / "copies"  # a copy, so nothing can reach back to the folders the package wrote
    for backbone, (folder, _, _) in saved.items():
        shutil.copytree(folder, root / backbone)
        shutil.copy(folder.parent / f"{backbone}_expected.pt", root / f"{backbone}_expected.pt")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-I", "-S", "-c", _FRESH_INTERPRETER, sysconfig.get_paths()["purelib"], str(root),
         json.dumps(list(saved))],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout + result.stderr


def test_remote_code_imports_only_torch_transformers_and_the_standard_library(tmp_path):
    for name, source in bundle_remote_code().items():
        path = tmp_path / name
        path.write_text(source)
        third_party = set(get_imports(path)) - set(sys.stdlib_module_names)
        assert third_party <= {"torch", "transformers"}, (name, third_party)
        expected = [] if name.startswith("configuration") else ["configuration_block_diffusion"]
        assert get_relative_imports(path) == expected


def test_remote_code_holds_the_whole_model_and_none_of_the_hub_hooks():
    modeling = bundle_remote_code()["modeling_block_diffusion.py"]
    for source in ("attention/masks.py", "attention/rows.py", "attention/tiles.py", "attention/kernels.py",
                   "attention/backends.py", "attention/interface.py", "attention/block_mask.py", "attention/flex.py",
                   "models/block_diffusion/generation/config.py", "models/block_diffusion/generation/settings.py",
                   "models/block_diffusion/generation/kv_cache.py", "models/block_diffusion/generation/context.py",
                   "models/block_diffusion/generation/loop.py",
                   "models/block_diffusion/modeling.py"):
        assert f"hf_bdlm/{source}" in modeling
    for definition in ("def allowed(", "def plan_attention(", "def bdlm_attention_forward(", "def generate(",
                       "class BlockDiffusionForMaskedLM("):
        assert definition in modeling
    assert "def save_pretrained(" not in modeling and "def push_to_hub(" not in modeling
    config = bundle_remote_code()["configuration_block_diffusion.py"]
    assert "class BlockDiffusionConfig(" in config and 'BACKENDS = ("auto"' in config


def test_bundle_check_refuses_files_that_would_need_the_package():
    with pytest.raises(BundleError, match="not written"):
        _check_bundle("modeling_block_diffusion.py", "from .attention import allowed\n")
    with pytest.raises(BundleError, match="still imports the package"):
        _check_bundle("modeling_block_diffusion.py", "def f():\n    from hf_bdlm.attention import allowed\n")


# --- the model card -------------------------------------------------------------------------------------


def test_card_front_matter_is_hub_metadata(saved):
    card = ModelCard.load(saved["llama"][0] / "README.md")
    assert card.data.library_name == "hf-bdlm"
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert card.data.pipeline_tag == "text-generation"
    assert {"block-diffusion", "llama", "standard", "csbp"} <= set(card.data.tags)
    assert card.data.datasets == ["hf-bdlm/arith"]  # the local name is listed in the text, not as a Hub id
    assert card.data.license == "unknown"


def test_card_states_model_objective_layout_dataset_metrics_usage_and_citation(saved):
    text = (saved["gemma3"][0] / "README.md").read_text()
    for fact in (
        "| Block size | 4 tokens |",
        "`causal` — token-causal",
        "`standard` — BD3-LM",
        "`gemma3_text`",
        "| Mode | `csbp` |",
        "| Block-parallel group size P | 2 |",
        "| Clean ring size C | 2 |",
        "| Clean K/V transport | `ring` |",
        "| World size W | 4 |",
        "| Data-parallel replicas D = W / P | 2 |",
        "`local arithmetic (packaged)`",
        "| Loss (training objective) | 0.4123 |",
        "| Masked-token accuracy | 0.8765 |",
        "| Exact match | 0.625 |",
        "| max_steps | 30 |",
        "import hf_bdlm",
        f'AutoModel.from_pretrained("{saved["gemma3"][0].name}")',
        "trust_remote_code=True",
        "output = model.generate(\n    prompt, max_new_tokens=",
        "apply_chat_template",  # the saved tokenizer has a chat template
        "| `confidence_threshold` | 0.9 |",
        "2609.19242",
        "2503.09573",
    ):
        assert fact in text, fact


def test_card_without_info_says_what_was_not_recorded_and_keeps_local_paths_out_of_metadata(tmp_path):
    model = tiny_model("llama")
    model.config.backbone_config._name_or_path = str(tmp_path)  # converted from a local folder
    model.save_pretrained(tmp_path / "out")
    card = ModelCard.load(write_model_card(tmp_path / "out"))
    assert card.data.base_model is None
    assert f"`{tmp_path.name}` (a local checkpoint)" in card.text
    assert "Parallel layout.** Not recorded" in card.text
    assert "No metrics were recorded" in card.text
    assert "No tokenizer was saved" in card.text


def test_card_rejects_unknown_info_keys_naming_the_accepted_ones(saved):
    with pytest.raises(ValueError, match=r"unknown model-card info keys \['metric'\].*metrics"):
        render_model_card(saved["llama"][0], {"metric": {"loss": 1.0}})
    with pytest.raises(ValueError, match="unknown key 'ranks' in info\\['parallel'\\]"):
        render_model_card(saved["llama"][0], {"parallel": {"ranks": 2}})
    with pytest.raises(ValueError, match=r"\['mode'\] must be one of \('csbp', 'bp', 'cp'\), got 'tp'"):
        render_model_card(saved["llama"][0], {"parallel": {"mode": "tp"}})


def test_card_needs_a_saved_model_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="save the model first"):
        write_model_card(tmp_path)


def test_packaged_template_is_the_model_cards_copy_and_is_package_data():
    packaged = (REPO / "hf_bdlm" / "models" / "block_diffusion" / "model_card.md").read_text()
    assert (REPO / "model_cards" / "bdlm_model_card.md").read_text() == packaged
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "models/*/*.md" in package_data["hf_bdlm"]


# --- uploads (no network: HfApi's repo and commit calls are captured) -------------------------------------


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A fake Hub: `create_commit` copies the uploaded files into ``hub.root / repo_id``."""

    class FakeHub:
        root = tmp_path / "hub"
        commits: list = []

    def create_repo(self, repo_id, **kwargs):
        return type("RepoUrl", (), {"repo_id": repo_id if "/" in repo_id else f"me/{repo_id}"})()

    def create_commit(self, repo_id, operations, **kwargs):
        operations = list(operations)
        FakeHub.commits.append((repo_id, [op.path_in_repo for op in operations], kwargs))
        for op in operations:
            target = FakeHub.root / repo_id / op.path_in_repo
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(op.path_or_fileobj, target)
        return "commit"

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    return FakeHub


def test_push_to_hub_uploads_the_saved_folder_in_one_commit_and_it_loads_back(hub, saved):
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    push_to_hub(model, "me/tiny-bdlm", tokenizer, CARD_INFO, commit_message="first")
    [(repo_id, files, kwargs)] = hub.commits
    assert repo_id == "me/tiny-bdlm" and kwargs["commit_message"] == "first"
    assert set(UPLOADED) <= set(files)
    local = hub.root / repo_id
    assert json.loads((local / "config.json").read_text())["auto_map"] == AUTO_MAP
    card = (local / "README.md").read_text()
    assert "\n# tiny-bdlm\n" in card and 'AutoModel.from_pretrained("me/tiny-bdlm")' in card
    logits, generated = outputs(AutoModel.from_pretrained(local).eval())
    assert torch.equal(logits, saved["llama"][1]) and torch.equal(generated, saved["llama"][2])


def test_model_push_to_hub_sends_the_same_files(hub):
    tiny_model("llama").push_to_hub("tiny-bdlm", tokenizer=tiny_tokenizer(), card_info={"metrics": {"loss": 1.5}})
    [(repo_id, files, _)] = hub.commits
    assert repo_id == "me/tiny-bdlm" and set(UPLOADED) <= set(files)
    assert "| Loss (training objective) | 1.5 |" in (hub.root / repo_id / "README.md").read_text()


def test_save_pretrained_with_push_to_hub_uploads_the_remote_code_too(hub, tmp_path):
    tiny_model("llama").save_pretrained(tmp_path / "out", push_to_hub=True, repo_id="me/out")
    [(repo_id, files, _)] = hub.commits
    assert repo_id == "me/out"
    assert {"model.safetensors", "config.json", "configuration_block_diffusion.py",
            "modeling_block_diffusion.py"} <= set(files)


def test_save_for_hub_refuses_models_it_cannot_save_whole(tmp_path):
    model = tiny_model("llama")
    model.peft_config = {"default": object()}  # what PEFT attaches
    with pytest.raises(ValueError, match="merge_and_unload"):
        save_for_hub(model, None, tmp_path)
    with pytest.raises(TypeError, match="convert_causal_lm"):
        save_for_hub(torch.nn.Linear(2, 2), None, tmp_path)


def test_hub_module_is_reachable_from_the_package():
    import hf_bdlm.hub

    assert hf_bdlm.hub.save_for_hub is save_for_hub
    assert hf_bdlm.__version__ in bundle_remote_code()["modeling_block_diffusion.py"]
