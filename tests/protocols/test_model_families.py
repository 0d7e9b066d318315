"""The model-family registry: every family found from a checkpoint's config and from a model object, objectives
built by name whatever their family, a clear error for an objective of another family, and the rest of the package
naming no family (each is named only in its own folder under hf_bdlm/models/)."""

import re

import pytest
import torch
from transformers import AutoConfig, LlamaConfig

from hf_bdlm.protocols.registry import (
    REGISTRY,
    family_for_config,
    family_for_model,
    family_for_model_type,
    family_named,
    get_objective,
)

from tiny_bdlm import tiny_bdlm  # noqa: E402
from tiny_diffusion_gemma import tiny_model as tiny_diffusion_gemma  # noqa: E402
from tiny_diffusion_gemma import tiny_tokenizer as tiny_dg_tokenizer  # noqa: E402
from paths import ROOT



def test_each_family_is_found_from_its_model_type_and_other_causal_lms_are_converted():
    assert family_for_config(AutoConfig.for_model("block_diffusion")).name == "block_diffusion"
    assert family_for_config(tiny_diffusion_gemma().config).name == "diffusion_gemma"
    assert family_for_config(LlamaConfig()).name == "block_diffusion"  # the family that converts causal LMs
    assert family_for_model_type("qwen3").converts_causal_lms
    # The package's families are its folders under hf_bdlm/models/ that hold a family.py, each registered once.
    folders = sorted(p.name for p in (ROOT / "hf_bdlm" / "models").iterdir() if (p / "family.py").is_file())
    built_in = [e.name for e in REGISTRY if e.module.startswith("hf_bdlm.models.")]
    assert sorted(built_in) == folders and len(set(built_in)) == len(built_in), (built_in, folders)
    with pytest.raises(ValueError, match=r"no model family named 'dflash2'; the registered ones are"):
        family_named("dflash2")


def test_a_drafter_is_found_by_its_architecture_though_its_model_type_is_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from hf_bdlm.models.dflash.modeling import DFlash2DraftModel

    target = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, pad_token_id=0))
    drafter = DFlash2DraftModel.from_target(target, init="scratch", selector_rank=8, selector_top_k=4,
                                            conv_group_size=8)
    assert drafter.config.model_type == "qwen3"
    assert family_for_config(drafter.config).name == "dflash"
    assert family_for_model_type("qwen3", ["DFlash2DraftModel"]).name == "dflash"
    assert family_for_config(target.config).name == "block_diffusion"  # the target itself: a causal LM to convert
    assert family_for_model(drafter).name == "dflash" and family_for_model(target) is None


def test_each_family_claims_its_models_and_only_them_also_inside_peft():
    from peft import LoraConfig, get_peft_model

    bdlm, dg = tiny_bdlm(), tiny_diffusion_gemma()
    assert family_for_model(bdlm).name == "block_diffusion"
    assert family_for_model(dg).name == "diffusion_gemma"
    assert family_for_model(torch.nn.Linear(2, 2)) is None
    wrapped = get_peft_model(dg, LoraConfig(target_modules=family_named("diffusion_gemma").role("training").default_lora_targets(dg)))
    assert family_for_model(wrapped).name == "diffusion_gemma"
    assert family_named("block_diffusion").block_size(bdlm) == bdlm.config.block_size
    assert family_named("diffusion_gemma").block_size(wrapped) == dg.config.canvas_length


def test_objectives_of_every_family_are_built_by_name():
    from hf_bdlm.models.diffusion_gemma.training.objectives import DiffusionGemmaObjective
    from hf_bdlm.models.block_diffusion.training.objectives import StandardObjective
    from hf_bdlm.objectives import get_objective as from_objectives

    assert isinstance(get_objective("standard", dict(block_size=4, mask_token_id=9)), StandardObjective)
    dg = from_objectives("diffusion_gemma", dict(block_size=4, vocab_size=64, fill_token_id=1))
    assert isinstance(dg, DiffusionGemmaObjective) and dg.block_size == 4
    with pytest.raises(ValueError, match=r"unknown objective 'bd3'; valid names: \['dflash', 'diffusion_gemma', "):
        get_objective("bd3", {})
    from hf_bdlm.models.dflash.training.objectives import DFlashTrainingObjective

    dflash = get_objective("dflash", dict(block_size=4, mask_token_id=9, max_anchors=16))
    assert isinstance(dflash, DFlashTrainingObjective) and dflash.config.max_anchors == 16
    with pytest.raises(ValueError, match=r"objective 'dflash' needs mask_token_id"):
        get_objective("dflash", dict(block_size=4))


def test_an_objective_of_another_family_is_refused_before_anything_is_trained(tmp_path):
    from hf_bdlm import BDLMSFTConfig
    from hf_bdlm.trainer.inputs import load_diffusion_model

    args = BDLMSFTConfig(str(tmp_path), report_to="none", max_length=32, objective="diffusion_gemma")
    with pytest.raises(ValueError, match=r"objective='diffusion_gemma' trains the 'diffusion_gemma' family .* got a "
                                         r"'block_diffusion' model of the 'block_diffusion' family, which trains "
                                         r"\['standard', 'fast_dllm_v2', 'fast_dllm_v2_causal_clean'\]"):
        load_diffusion_model(tiny_bdlm(), object(), args)
    args = BDLMSFTConfig(str(tmp_path), report_to="none", max_length=32, objective="standard")
    with pytest.raises(ValueError, match=r"objective='standard' trains the 'block_diffusion' family"):
        load_diffusion_model(tiny_diffusion_gemma(), object(), args)


def test_the_server_decodes_each_family_with_that_familys_decoder(tmp_path):
    """The engine takes its decoder from the family the checkpoint's config names (it never branches on a name)."""
    from hf_bdlm.protocols.registry import family_for_config
    from hf_bdlm.serving.engine import Engine

    tiny_diffusion_gemma().save_pretrained(tmp_path)
    tiny_dg_tokenizer().save_pretrained(tmp_path)
    engine = Engine.from_pretrained(tmp_path)
    family = family_for_config(engine.model.config)
    assert type(engine.decoder) is type(family.role("serving").decoder(engine.model, engine.tokenizer))
    assert type(engine.decoder).__module__.startswith(f"hf_bdlm.models.{family.name}")


# The shared code talks to families through hf_bdlm.models only: no family is named outside its own folder. A place
# that must (user-facing text or data) goes here with its reason; none does now (each family's card text lives in its
# own folder).
ALLOWED: set[str] = set()
FAMILY_NAMES = re.compile(r"diffusion_?gemma|dflash", re.IGNORECASE)


def test_no_shared_module_names_a_model_family_outside_the_allowed_places():
    naming = sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "hf_bdlm").rglob("*.py")
        if FAMILY_NAMES.search(p.read_text())
        # a family's own folder
        and not p.relative_to(ROOT).as_posix().startswith(("hf_bdlm/models/diffusion_gemma/", "hf_bdlm/models/dflash/"))
        # the registry (its line per family), the interface's description of the families and the families' index
        and p.relative_to(ROOT).as_posix() not in ("hf_bdlm/protocols/registry.py",
                                                   "hf_bdlm/models/__init__.py")
    )
    assert set(naming) <= ALLOWED, sorted(set(naming) - ALLOWED)
