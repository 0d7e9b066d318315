"""`hf-bdlm bench --only decoding` (hf_bdlm.benchmarks.decoding_study) on tiny random checkpoints of every family.

A tiny Llama target (the AR baseline), a tiny block-diffusion model, a tiny DiffusionGemma and a DFlash2 drafter of
the target, each saved as the server loads it. Checked on the study's records: every variant of every family decodes
the same tokens at batch 1 and 2 (batch invariance); the drafter's outputs are the target's greedy outputs; greedy AR
makes exactly one forward per token of a lone row; a block-diffusion variant that fixes one position per step makes
no more tokens than forwards, and the threshold variants fewer forwards than it (a random model is unsure: the
per-step floor does it); DiffusionGemma's own setting (2 denoising steps per canvas of 4) makes fewer decoder
forwards than its reference (4); the cost model has a line for every counted part; the report and plot draw.

The GPU column and the quality columns by hand: the drafter's proposals call the target's head as a module, so the
counted weight bytes of a speculative decode are the hand count (target forwards + drafter calls) x the head's
vocab x hidden x 2 bytes plus the other parts (and the rule that rebuilds those calls for old records is the hooks');
the roofline of made-up counts equals its hand computation; the Wilson interval of 2 / 8 is the textbook one and the
table prints it with its count; fewer than 3 timed groups are refused.
Run: python -m pytest tests/benchmarks/test_decoding.py -q
"""

from __future__ import annotations

import json

import pytest
import torch

from hf_bdlm.benchmarks import decoding_study as decoding
from hf_bdlm.models.dflash.modeling import DFlash2DraftModel

from fixtures import families_with_role  # noqa: E402
from tiny_bdlm import MASK, VOCAB, save_tiny_bdlm, save_tiny_target  # noqa: E402
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
    decoding = {"causal", *families_with_role("serving"), *families_with_role("drafting")}  # from the registry
    assert decoding <= families, f"no decoding record of {sorted(decoding - families)}: build a tiny checkpoint of it"
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


def test_cost_model_prices_the_drafters_proposals_through_the_targets_head(records):
    root, recs = records
    for r in rows(recs, family="dflash"):  # every sample: one head call per target forward and per drafted block
        for s in r["samples"]:
            f = s["forwards"]
            assert len(f["head"]) == len(f["model"]) + len(f["drafter"]) and r["counting"] == decoding.COUNTING
            assert [x[0] for x in f["drafter context"]] == [x[0] for x in f["model"]]

    from hf_bdlm.serving.engine import Engine

    decoder = Engine.from_pretrained(str(root / "target"), dtype=torch.float32, draft=str(root / "drafter")).decoder
    drafted, target_calls = [], []  # counted apart from the hooks
    compute_logits, forward = decoder.drafter.compute_logits, decoder.model.forward
    decoder.drafter.compute_logits = lambda h: drafted.append(h.shape[:-1].numel()) or compute_logits(h)
    decoder.model.forward = lambda *a, **k: target_calls.append(1) or forward(*a, **k)
    meter = decoding.ForwardMeter(decoder.counted_modules())
    with meter, torch.no_grad():
        decoding.serve_decode(decoder, [[2, 5, 6, 7, 8], [2, 9, 10]], 9, True, set())
    counted = {name: [f[0] for f in forwards] for name, forwards in meter.forwards.items()}
    assert len(drafted) == len(counted["drafter"]) >= 3 and len(target_calls) == len(counted["model"])

    # Hand counts of the tiny Llama target (hidden 32, 2 layers, 4 heads of 8, 2 K/V heads, MLP 64, vocab 64, untied
    # head) and its drafter's fc (the target's features at its target layers, to hidden 32), 2 bytes per weight.
    head = VOCAB * 32 * 2
    layer = 32 * 32 + 32 * 16 + 32 * 16 + 32 * 32 + 3 * 32 * 64 + 2 * 32
    body = (2 * layer + 32) * 2
    fc = decoder.drafter.config.feature_width * 32 * 2
    costs = {name: decoding.part_cost(m) for name, m in decoder.counted_modules().items()}
    assert (costs["head"]["weight_bytes"], costs["model"]["weight_bytes"]) == (head, body)
    assert costs["drafter context"]["weight_bytes"] == fc
    total = sum(len(calls) * costs[name]["weight_bytes"] for name, calls in counted.items())
    assert total == (len(target_calls) * (body + head) + len(drafted) * (head + costs["drafter"]["weight_bytes"])
                     + len(target_calls) * fc)
    # Before the head was called as a module these drafted blocks' head reads were missing:
    assert total - len(target_calls) * (body + head + fc) - len(drafted) * costs["drafter"]["weight_bytes"] \
        == len(drafted) * head

    # The rule that rebuilds those calls for records written before: the hooks' own rows.
    old = dict(kind="decoding", family="dflash", entry="e", variant="3 proposals",
               description="block 4, the target verifies 3 proposals per forward",
               samples=[dict(forwards={"model": [[n, 0, 0] for n in counted["model"]],
                                       "drafter": [[n, 0, 0] for n in counted["drafter"]]})])
    assert decoding.reconstruct_drafter_calls(old, costs := [])
    rebuilt = old["samples"][0]["reconstructed"]
    assert [x[0] for x in rebuilt["head"]] == drafted
    assert [x[0] for x in rebuilt["drafter context"]] == counted["drafter context"]
    assert costs[0]["part"] == "drafter context" and costs[0]["activation_bytes_per_row"] is None


def test_gpu_column_equals_the_roofline_by_hand():
    """Made-up counts: an AR model of one part and a two-part model, on the planner's H100 (3.35e12 B/s HBM,
    989e12 x 0.55 FLOP/s): t = max((W + A rows) / HBM, 2 M rows / F) per forward, summed, over the tokens."""
    hbm, flops = 3.35e12, 989e12 * 0.55
    # W = 3.35e6 B (1 us), A = 3.35e4 B per row (10 ns), M = flops / 2 * 1e-8 (10 ns of matmul per row)
    part = dict(weight_bytes=3.35e6, activation_bytes_per_row=3.35e4, macs_per_row=flops / 2 * 1e-8)
    # a head whose matmul binds from 2 rows: W = 3.35e5 B (0.1 us), A = 0, 2 M / F = 0.06 us per row
    head = dict(weight_bytes=3.35e5, activation_bytes_per_row=0, macs_per_row=flops / 2 * 6e-8)
    fit = dict(a=0.0, b=0.0)
    costs = [dict(kind="forward_cost", entry="ar", part="model", fit=fit, **part),
             dict(kind="forward_cost", entry="bdlm", part="model", fit=fit, **part),
             dict(kind="forward_cost", entry="bdlm", part="head", fit=fit, **head)]
    ar = dict(kind="decoding", entry="ar", variant="greedy", batch=1, ar="", tokens=4,
              samples=[dict(forwards={"model": [[10, 0, 0], [1, 0, 0], [1, 0, 0], [1, 0, 0]]})])
    bdlm = dict(kind="decoding", entry="bdlm", variant="v", batch=1, ar="ar", tokens=4,
                samples=[dict(forwards={"model": [[10, 0, 0], [200, 0, 0]], "head": [[1, 0, 0], [16, 0, 0]]})])
    decoding.project([ar, bdlm], costs)
    # AR: the prefill (10 rows): max(1 + 0.1, 0.1) = 1.1 us; 3 steps of 1 row: max(1.01, 0.01) = 1.01 us each
    assert ar["h100_s_per_token"] == pytest.approx((1.1e-6 + 3 * 1.01e-6) / 4, rel=1e-12)
    # BDLM: body 10 rows 1.1 us, 200 rows max(1 + 2, 2) = 3 us; head 1 row max(0.1, 0.06) = 0.1 us,
    # 16 rows max(0.1, 0.96) = 0.96 us
    assert bdlm["h100_s_per_token"] == pytest.approx((1.1e-6 + 3e-6 + 0.1e-6 + 0.96e-6) / 4, rel=1e-12)
    assert bdlm["vs_ar_h100"] == pytest.approx(4.13 / 5.16, rel=1e-12)
    assert decoding.gpu_seconds(part, 200) == pytest.approx((3.35e6 + 200 * 3.35e4) / hbm, rel=1e-12)
    # a part with no activation bytes known (an old record not completed) leaves the column empty
    costs[2] = dict(costs[2], activation_bytes_per_row=None)
    decoding.project([ar, bdlm], costs)
    assert bdlm["h100_s_per_token"] is None and "vs_ar_h100" not in bdlm


def test_exact_match_carries_its_count_and_wilson_interval(records):
    low, high = decoding.wilson_interval(2, 8)
    assert (round(low, 4), round(high, 4)) == (0.0715, 0.5907)  # the textbook 95 % Wilson interval of 2 / 8
    assert decoding.wilson_interval(0, 8)[0] == 0.0 and decoding.wilson_interval(8, 8)[1] == 1.0
    _, recs = records
    for r in rows(recs):
        hits, n, lo, hi = decoding.exact_match_of(r)
        assert n == 2 and r["exact_match_hits"] == hits and r["exact_match_interval"] == [lo, hi]
    text = decoding.report(recs)
    assert "2 prompts" in text and "carry no quality claim" in text and "95 % Wilson interval" in text
    assert f"0/2, 0% [0%-{decoding.wilson_interval(0, 2)[1]:.0%}]" in text


def test_fewer_than_three_timed_groups_are_refused(records):
    import argparse

    class Cfg:
        quick = True

    args = argparse.Namespace(decoding_models=None, decoding_causal=None, decoding_speculative=None,
                              decoding_prompts=None, decoding_batches=None, decoding_max_new_tokens=None,
                              decoding_threads=1, decoding_timed_groups=2)
    with pytest.raises(ValueError, match="--decoding-timed-groups=2"):
        decoding.resolve(Cfg(), args)
    args.decoding_timed_groups = 5
    assert decoding.resolve(Cfg(), args).timed_groups == 5
    _, recs = records
    short = [dict(r, samples=r["samples"][:2]) for r in rows(recs)[:1]]
    with pytest.raises(ValueError, match="2 timed group"):
        decoding.check_records(short)
    with pytest.raises(ValueError, match="2 timed group"):
        decoding.report(short)
