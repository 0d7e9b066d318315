"""`hf-bdlm bench --only decoding` (hf_bdlm.benchmarks.decoding) on tiny random checkpoints of every family.

A tiny Llama target (the AR baseline), a tiny block-diffusion model, a tiny DiffusionGemma and a DFlash2 drafter of
the target, each saved as the server loads it. Checked on the study's records: every variant of every family decodes
the same tokens at batch 1 and 2 (batch invariance); the drafter's outputs are the target's greedy outputs; greedy AR
makes exactly one forward per token of a lone row; a block-diffusion variant that fixes one position per step makes
no more tokens than forwards, and the threshold variants fewer forwards than it (a random model is unsure: the
per-step floor does it); DiffusionGemma's own setting (2 denoising steps per canvas of 4) makes fewer decoder
forwards than its reference (4); the cost model has a line for every counted part; the report and plot draw.
Run: python -m pytest tests/test_decoding_benchmark.py -q
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hf_bdlm.benchmarks import decoding
from hf_bdlm.models.dflash.modeling import DFlash2DraftModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "distributed"))
from tiny_bdlm import MASK, save_tiny_bdlm, save_tiny_target  # noqa: E402
from tiny_diffusion_gemma import save_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    root = tmp_path_factory.mktemp("decoding")
    target = save_tiny_target(root / "target")
    DFlash2DraftModel.from_target(target, init="target_layers", num_hidden_layers=1, block_size=4,
                                  mask_token_id=MASK).save_pretrained(root / "drafter")
    save_tiny_bdlm(root / "bdlm")
    dg = save_checkpoint(root / "dg", denoising_steps=2)  # 2 denoising steps per canvas of 4
    out = root / "decoding.json"
    decoding.main(["--models", str(root / "bdlm"), str(dg), "--causal", str(root / "target"),
                   "--speculative", f"{root / 'target'}:{root / 'drafter'}", "--prompts", "2", "--batches", "1", "2",
                   "--max-new-tokens", "6", "--out", str(out)])
    return root, json.loads(out.read_text())


def rows(records, **where):
    return [r for r in records if r["kind"] == "decoding" and all(r[k] == v for k, v in where.items())]


def test_every_variant_of_every_family_is_batch_invariant(records):
    _, recs = records
    families = {r["family"] for r in rows(recs)}
    assert {"causal", "block_diffusion", "diffusion_gemma", "dflash"} <= families, families
    for r in rows(recs):
        assert r["same_as_batch_1"] == 1.0, (r["entry"], r["variant"], r["batch"])
        assert len(r["samples"]) >= 3 and all(len(o) > 0 for o in r["outputs"])


def test_the_drafter_serves_its_targets_greedy_text_and_ar_makes_one_forward_per_token(records):
    _, recs = records
    for r in rows(recs, family="dflash"):
        assert r["agreement"] == 1.0 and r["agreement_with"].endswith("| greedy"), r["variant"]
    for r in rows(recs, family="causal", batch=1):
        assert r["tokens_per_forward"] == pytest.approx(1.0)


def test_one_position_per_step_is_the_slowest_block_diffusion_variant(records):
    _, recs = records
    for batch in (1, 2):
        by = {r["variant"]: r for r in rows(recs, family="block_diffusion", batch=batch)}
        reference = by["one per step"]
        assert reference["reference"] and reference["tokens_per_forward"] <= batch
        assert by["+ min 2 per step"]["forwards"] < by["threshold 0.9"]["forwards"]
        # the exact techniques change no token
        assert by["exact techniques"]["outputs"] == by["threshold 0.9"]["outputs"]
        assert by["no KV cache"]["outputs"] == by["threshold 0.9"]["outputs"]


def test_diffusion_gemma_own_settings_take_fewer_forwards_than_one_step_per_canvas_token(records):
    _, recs = records
    for batch in (1, 2):
        by = {r["reference"]: r for r in rows(recs, family="diffusion_gemma", batch=batch)}
        assert 0 < by[True]["tokens_per_forward"] <= batch and by[True]["rows_per_forward"] >= 4  # a canvas
        assert by[False]["forwards"] < by[True]["forwards"]


def test_cost_model_report_and_plot(records):
    root, recs = records
    costs = [r for r in recs if r["kind"] == "forward_cost"]
    parts = {(c["entry"], c["part"]) for c in costs}
    assert {r["entry"] for r in rows(recs)} == {e for e, _ in parts}
    assert all(c["weight_bytes"] > 0 and c["points"] for c in costs)
    for r in rows(recs):
        assert r["model_cpu_s_per_token"] > 0 and r["h100_s_per_token"] > 0
    text = decoding.report(recs)
    assert "one per step" in text and "forward cost" in text.lower()
    assert decoding.plot(recs, root / "decoding.png").stat().st_size > 0
