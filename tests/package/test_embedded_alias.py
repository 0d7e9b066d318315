"""The Python API takes ``embedded:smollm2`` wherever it takes a model folder or a Hub id, as the CLI does.

Every entry goes through one resolver, ``hf_bdlm.embedded.resolve_model_path``; here the embedded export is replaced by
a tiny causal Llama folder (``default_model_dir`` patched), so each test checks that the entry resolves the alias
without exporting SmolLM2. The real model runs through the same entries in tests/package/test_doc_blocks.py (the
README's Python block) and tests/models/dflash/test_capture.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tiny_bdlm import save_tiny_target  # noqa: E402

import hf_bdlm  # noqa: E402
import hf_bdlm.embedded  # noqa: E402
from hf_bdlm import BDLMSFTConfig, BDLMSFTTrainer, BlockDiffusionForMaskedLM  # noqa: E402


@pytest.fixture
def embedded(tmp_path, monkeypatch) -> Path:
    """``embedded:smollm2`` resolves to a tiny causal Llama folder for the test's duration."""
    folder = tmp_path / "embedded-export"
    save_tiny_target(folder)
    monkeypatch.setattr(hf_bdlm.embedded, "default_model_dir", lambda: folder)
    return folder


def test_the_resolver_maps_the_alias_and_leaves_other_names(embedded):
    assert hf_bdlm.embedded.resolve_model_path("embedded:smollm2") == str(embedded)
    assert hf_bdlm.embedded.resolve_model_path("some/folder") == "some/folder"
    with pytest.raises(ValueError, match="unknown embedded model 'other'"):
        hf_bdlm.embedded.resolve_model_path("embedded:other")


def test_convert_causal_lm_takes_the_alias(embedded):
    model, tok = hf_bdlm.convert_causal_lm("embedded:smollm2", block_size=4)
    assert isinstance(model, BlockDiffusionForMaskedLM) and model.config.block_size == 4
    assert tok.mask_token_id == model.config.mask_token_id


def test_the_trainer_takes_the_alias(embedded, tmp_path):
    from trainer_common import prompt_completion

    args = BDLMSFTConfig(str(tmp_path / "out"), report_to="none", max_steps=1, save_strategy="no", disable_tqdm=True,
                         block_size=4)
    trainer = BDLMSFTTrainer(model="embedded:smollm2", args=args, train_dataset=prompt_completion(4))
    assert isinstance(trainer.model, BlockDiffusionForMaskedLM)
    assert trainer._base_model_name == "embedded:smollm2"  # the card names the alias, not the cache folder
    assert torch.isfinite(torch.tensor(trainer.train().training_loss))


def test_the_trainer_names_its_default_output_folder_after_the_embedded_model():
    from hf_bdlm.trainer.trainer import _as_bdlm_config

    assert _as_bdlm_config(None, "embedded:smollm2").output_dir == "smollm2-BDLM-SFT"


def test_a_drafters_target_heads_take_the_alias(embedded):
    # The DFlash drafter's Python entry (DFlash2DraftModel.from_target) takes a loaded model, not a name; the name is
    # taken by the target heads (and DFlashTrainingConfig.target_model, read through them).
    from hf_bdlm.models.dflash.target import load_target_heads

    heads = load_target_heads("embedded:smollm2")
    assert heads.embed_tokens.weight.shape[0] == 64 and heads.source == str(embedded)
