"""The decoding study on the fast-apply task (``--task fast_apply``): the plumbing, on tiny random checkpoints.

Every family's variants decode 2 held-out fast-apply prompts at batch 1 and 2; each record carries the task, both of
its scorers (exact and AST match: hits, share, 95 % Wilson interval), the budget and the task's longest answer; the
table gets an AST-match column; the scorers are the task's (a reply that differs from the answer only by a comment is
an AST match and no exact match); the options default to the task's 300 prompts and 384 new tokens.
"""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest

from hf_bdlm.benchmarks import decoding_study as decoding
from hf_bdlm.data import shipped_task
from hf_bdlm.models.dflash.modeling import DFlash2DraftModel

from fixtures import families_with_role  # noqa: E402
from tiny_bdlm import MASK, save_tiny_bdlm, save_tiny_target  # noqa: E402
from tiny_diffusion_gemma import save_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    root = tmp_path_factory.mktemp("decoding_fast_apply")
    target = save_tiny_target(root / "target")
    DFlash2DraftModel.from_target(target, init="target_layers", num_hidden_layers=1, block_size=4,
                                  mask_token_id=MASK).save_pretrained(root / "drafter")
    save_tiny_bdlm(root / "bdlm", context=2048)  # the word-level tokenizer makes these prompts long
    dg = save_checkpoint(root / "dg", denoising_steps=2)
    out = root / "decoding.json"
    decoding.main(["--task", "fast_apply", "--models", str(root / "bdlm"), str(dg), "--causal", str(root / "target"),
                   "--speculative", f"{root / 'target'}:{root / 'drafter'}", "--prompts", "2", "--batches", "1", "2",
                   "--max-new-tokens", "6", "--out", str(out)])
    return json.loads(out.read_text())


def test_every_family_decodes_the_task_and_is_scored_by_its_scorers(records):
    rows = [r for r in records if r["kind"] == "decoding"]
    assert {"causal", *families_with_role("serving"), *families_with_role("drafting")} <= {r["family"] for r in rows}
    for r in rows:
        assert (r["task"], r["prompts"], r["max_new_tokens"], r["longest_answer_tokens"]) == ("fast_apply", 2, 6, 320)
        assert r["scorers"] == ["exact_match", "ast_match"]
        for name in r["scorers"]:
            assert r[f"{name}_hits"] == 0 and r[name] == 0.0  # 6 random tokens are no edited function
            low, high = r[f"{name}_interval"]
            assert low == 0.0 and 0.5 < high < 1.0  # Wilson's 95 % interval of 0 / 2
        assert r["same_as_batch_1"] == 1.0 and len(r["samples"]) >= 3 and r["tokens_per_forward"] > 0
    text = decoding.report(records)
    assert "task fast_apply, 6 new tokens at most" in text
    assert "| exact match (95 % interval) | ast match (95 % interval) |" in text and "0/2, 0% [0%-66%]" in text


def test_the_task_scorers_score_the_decoded_text():
    answer = shipped_task("fast_apply").held_out(1)[0]["answer"]
    lines = answer.split("\n")
    commented = "\n".join([lines[0] + "  # edited"] + lines[1:])  # a comment: the same tree, another text
    texts = {0: answer + "\n\n", 1: commented, 2: answer.replace("def ", "def  (", 1)}

    class Tokenizer:
        def decode(self, tokens, skip_special_tokens=True):
            return texts[tokens[0]]

    examples = [{"answer": answer}] * 3
    record = dict(kind="decoding", entry="m", variant="greedy", batch=1, reference=True, ar="",
                  outputs=[[0], [1], [2]])
    decoding.score([record], [decoding.Entry("m", Tokenizer())], examples, "fast_apply", 384)
    assert (record["exact_match_hits"], record["ast_match_hits"]) == (1, 2)
    assert record["max_new_tokens"] == 384 and record["task"] == "fast_apply"
    arith = dict(record, outputs=[[0]])
    decoding.score([arith], [decoding.Entry("m", Tokenizer())], [{"answer": answer.strip()}], "arith")
    assert arith["scorers"] == ["exact_match"] and arith["exact_match_hits"] == 1


def test_the_options_default_to_the_tasks_prompts_and_budget():
    def resolved(quick=False, **given):
        args = dict(decoding_models=None, decoding_causal=None, decoding_speculative=None, decoding_prompts=None,
                    decoding_batches=None, decoding_max_new_tokens=None, decoding_threads=1,
                    decoding_timed_groups=3, decoding_task=None)
        return decoding.resolve(SimpleNamespace(quick=quick), argparse.Namespace(**{**args, **given}))

    study = resolved(decoding_task="fast_apply")
    assert (study.task, study.prompts, study.max_new_tokens, study.batches) == ("fast_apply", 300, 384, (1, 8))
    assert study.command_args()[:2] == ["--task", "fast_apply"]
    assert resolved(quick=True, decoding_task="fast_apply").prompts == 8
    arith = resolved()
    assert (arith.task, arith.prompts, arith.max_new_tokens) == ("arith", 24, 32)
    with pytest.raises(ValueError, match="has 400 held-out prompts"):
        resolved(decoding_task="fast_apply", decoding_prompts=500)
    parser = decoding.make_parser()
    assert parser.parse_args(["--out", "x"]).task == "arith"


def test_variants_named_are_the_only_ones_decoded_and_a_name_no_model_offers_is_refused(tmp_path):
    target = save_tiny_target(tmp_path / "target")
    DFlash2DraftModel.from_target(target, init="target_layers", num_hidden_layers=1, block_size=4,
                                  mask_token_id=MASK).save_pretrained(tmp_path / "drafter")
    save_tiny_bdlm(tmp_path / "bdlm", context=2048)
    common = ["--task", "fast_apply", "--models", str(tmp_path / "bdlm"), "--causal", str(tmp_path / "target"),
              "--speculative", f"{tmp_path / 'target'}:{tmp_path / 'drafter'}", "--prompts", "1", "--batches", "1",
              "--max-new-tokens", "3"]
    out = tmp_path / "decoding.json"
    rows = decoding.main([*common, "--variants", "threshold 0.9", "exact techniques", "3 proposals", "--out", str(out)])
    decoded = sorted((r["family"], r["variant"]) for r in rows if r["kind"] == "decoding")
    assert decoded == [("block_diffusion", "exact techniques"), ("block_diffusion", "threshold 0.9"),
                       ("causal", "greedy"), ("dflash", "3 proposals")]
    assert len(json.loads(out.read_text())) == len(rows)
    with pytest.raises(ValueError, match=r"'thresold 0\.9': no model of the study offers it"):
        decoding.main([*common, "--variants", "threshold 0.9", "thresold 0.9", "3 proposals", "--out", str(out)])
    with pytest.raises(ValueError, match=r"keeps no variant of dflash drafter"):
        decoding.main([*common, "--variants", "threshold 0.9", "--out", str(out)])
