"""lm-eval's `--model bdlm` on both families: lm-eval's own command line on local tasks, batch invariance, the bounds.

Two tiny models learn to count (consecutive words w7 w8 w9 ...) for a few seconds: a converted BDLM (fast_dllm_v2
objective, 200 steps) and a DiffusionGemma (200 steps). `hf-bdlm lm-eval` (lm-eval's CLI with `bdlm` registered)
runs the shipped local tasks (tests/data/lm_eval_tasks: a multiple-choice task and a generation task over jsonl, no
hub) on each, and the results JSON is checked. The same requests scored and generated in this process at batch size
1 give exactly the CLI's batch-8 answers. The bounds themselves: each family's estimate equals the bound computed
through an independent forward (the training form; transformers' own DiffusionGemma forward per canvas), the
uniform-state bound is tight for the exact posterior, the absorbing-noise draws are unbiased, and the trained
models' bounds rank gold continuations far above corrupted ones.
Run: python -m pytest tests/evaluation/test_lm_eval.py -q
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures import families_with_role, for_family
from paths import LM_EVAL_TASKS

pytest.importorskip("lm_eval", reason="the lm-eval tests need lm-eval (dev / lmeval extra)")

from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from hf_bdlm.evaluation.lm_eval_model import HFBDLMEvalModel, load_for_evaluation  # noqa: E402
from hf_bdlm.protocols.registry import family_named  # noqa: E402
from hf_bdlm.models.diffusion_gemma.inference import likelihood as dg_likelihood  # noqa: E402
from hf_bdlm.protocols.likelihood import ScoreRequest  # noqa: E402
from hf_bdlm.objectives import get_objective  # noqa: E402
from hf_bdlm.objectives.likelihood import absorbing_draws, request_key, sample_uniform, stratified_levels  # noqa: E402,E501
from tiny_bdlm import BLOCK, MASK, tiny_bdlm, tiny_tokenizer  # noqa: E402

from tiny_diffusion_gemma import B as CANVAS, EOS, TURN_END, float64_faithful, save_checkpoint, tiny_model  # noqa: E402

TASKS = LM_EVAL_TASKS
TASK_NAMES = ["bdlm_count_mc", "bdlm_count_gen"]
FIRST_WORD, LAST_WORD = 7, 54  # words both tiny vocabularies hold
BD_WORD_ID, DG_WORD_ID = 0, 9  # token id of word w{i}: i + offset


def counting(n: int, length: int, generator: torch.Generator, offset: int) -> torch.Tensor:
    starts = torch.randint(FIRST_WORD, LAST_WORD - length + 2, (n,), generator=generator)
    return starts[:, None] + torch.arange(length) + offset


def train(model, objective, steps: int, lr: float, rows: int, length: int, offset: int, prompt: int = 0):
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(0)
    for step in range(steps):
        ids = counting(rows, length, generator, offset)
        completion = torch.ones_like(ids)
        completion[:, :prompt] = 0
        corrupted = objective.corrupt({"input_ids": ids, "completion_mask": completion}, seed=0, step=step)
        loss, _ = objective.loss(model, corrupted)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def counting_bdlm(path: Path) -> Path:
    """The converted BDLM that counts: tiny, fast_dllm_v2 objective, 200 steps; saved with its tokenizer."""
    model = tiny_bdlm()
    model.config.objective, model.config.loss_weighting = "fast_dllm_v2", "unit"
    train(model, get_objective("fast_dllm_v2", model.config), steps=200, lr=3e-3, rows=16, length=16,
          offset=BD_WORD_ID)
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def counting_diffusion_gemma(path: Path, seed: int = 0) -> Path:
    """The DiffusionGemma that counts: tiny MoE, canvas 4, 200 steps at the converted model's learning rate.

    Trained long enough that its scores do not hang on float rounding: across initial seeds 0-2 it ranks the next
    word first for 7-8 of the 8 questions (an 80-step, lr 1e-2 model scored 3-5 of 8 with the seed, and 3 or 5 with
    the CPU it ran on).
    """
    model = tiny_model(seed=seed)
    objective = get_objective("diffusion_gemma", dict(block_size=CANVAS, vocab_size=64, fill_token_id=EOS,
                                                      end_token_ids={EOS, TURN_END}, self_conditioning_prob=0.0))
    train(model, objective, steps=200, lr=3e-3, rows=8, length=12, offset=DG_WORD_ID, prompt=4)
    return save_checkpoint(path, model, denoising_steps=4)


@pytest.fixture(scope="module")
def bdlm_dir(tmp_path_factory):
    return counting_bdlm(tmp_path_factory.mktemp("counting-bdlm"))


@pytest.fixture(scope="module")
def dg_dir(tmp_path_factory):
    return counting_diffusion_gemma(tmp_path_factory.mktemp("counting-diffusion-gemma"))


def offline_env(tmp_path) -> dict:
    return {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_CACHE": str(tmp_path / "datasets"), "TOKENIZERS_PARALLELISM": "false"}


def run_cli(folder, out: Path, tmp_path, **model_args) -> tuple[dict, dict]:
    """`hf-bdlm lm-eval` on the shipped tasks at batch size 8; the results JSON and the logged samples per task."""
    args = ",".join(f"{k}={v}" for k, v in {"pretrained": folder, "mc_num": 8, "seed": 0, **model_args}.items())
    command = [str(Path(sys.executable).parent / "hf-bdlm"), "lm-eval", "--model", "bdlm", "--model_args", args,
               "--tasks", ",".join(TASK_NAMES), "--include_path", str(TASKS), "--batch_size", "8", "--device", "cpu",
               "--output_path", str(out), "--log_samples"]
    # One thread, as this process computes (conftest): a thread count splits some CPU reductions differently.
    env = {**offline_env(tmp_path), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=TASKS, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "standard error per request" in done.stderr  # the estimator's error is logged
    [results_file] = out.rglob("results_*.json")
    samples = {task: [json.loads(line) for line in next(out.rglob(f"samples_{task}_*.jsonl")).read_text().splitlines()]
               for task in TASK_NAMES}
    return json.loads(results_file.read_text()), samples


def evaluate_in_process(lm, tmp_path, monkeypatch) -> dict:
    """The same tasks through `lm_eval.simple_evaluate` in this process; the logged samples per task."""
    for key, value in offline_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(TASKS)
    out = simple_evaluate(model=lm, tasks=TASK_NAMES, log_samples=True,
                          task_manager=TaskManager(include_path=str(TASKS), include_defaults=False))
    return {task: sorted(rows, key=lambda r: r["doc_id"]) for task, rows in out["samples"].items()}


def responses(samples: dict) -> dict:
    """Each document's answers, as the samples file writes them (leaves as `str`: a float's repr is exact)."""
    def leaves(value):
        return [leaves(v) for v in value] if isinstance(value, (list, tuple)) else str(value)

    return {task: [(row["doc_id"], leaves(row["resps"])) for row in sorted(rows, key=lambda r: r["doc_id"])]
            for task, rows in samples.items()}


# --- lm-eval's own command line, both families -------------------------------------------------------------------


def test_cli_scores_a_converted_bdlm_and_batch_1_answers_exactly_as_batch_8(bdlm_dir, tmp_path, monkeypatch):
    results, samples = run_cli(bdlm_dir, tmp_path / "out", tmp_path)
    assert results["config"]["model"] == "bdlm" and results["config"]["batch_size"] == "8"
    assert results["results"]["bdlm_count_mc"]["acc,none"] == 1.0  # 8 of 8: the next word ranks first
    assert results["results"]["bdlm_count_gen"]["exact_match,none"] == 1.0  # 6 of 6 counts continued
    assert samples["bdlm_count_gen"][0]["resps"] == [["w16 w17 w18 w19"]]
    mc = sorted(samples["bdlm_count_mc"], key=lambda r: r["doc_id"])
    assert all(len(row["resps"]) == 4 for row in mc)  # one loglikelihood request per choice
    # Batch size 1, in this process: every score and generation equals the CLI's batch-8 answer, bit for bit.
    alone = evaluate_in_process(HFBDLMEvalModel(pretrained=str(bdlm_dir), batch_size=1, mc_num=8, seed=0), tmp_path,
                                monkeypatch)
    assert responses(alone) == responses(samples)


def test_cli_scores_diffusion_gemma_and_batch_1_answers_exactly_as_batch_8(dg_dir, tmp_path, monkeypatch):
    results, samples = run_cli(dg_dir, tmp_path / "out", tmp_path)
    assert results["config"]["model"] == "bdlm"
    # 200 steps of training: the bound ranks the next word first for 7 of the 8 questions (chance 0.25); from initial
    # seeds 0-2, 7-8 of 8 (benchmarks/results/lm_eval_tasks/diffusion_gemma_seeds.json), so one miss more than the
    # worst seed still passes and float rounding on another CPU does not decide the test.
    assert results["results"]["bdlm_count_mc"]["acc,none"] >= 0.75
    # Generation: the records span 0-3 of the 6 counts continued exactly (benchmarks/results/lm_eval_tasks: seeds 0,
    # 1, 2 give 3, 2, 0 of 6; lm_eval_tasks_rerun, another host and later code: 2, 2, 2), so seed 0's score moves with
    # the host or the code; docs/evaluation.md states that spread, and this checks the score stays within it.
    assert results["results"]["bdlm_count_gen"]["exact_match,none"] in {k / 6 for k in range(4)}
    assert all(len(row["resps"][0][0].split()) <= 4 for row in samples["bdlm_count_gen"])  # max_gen_toks = 4
    alone = evaluate_in_process(HFBDLMEvalModel(pretrained=str(dg_dir), batch_size=1, mc_num=8, seed=0), tmp_path,
                                monkeypatch)
    assert responses(alone) == responses(samples)


# --- generation: until, max_gen_toks, settings ----------------------------------------------------------------------


class _Request:
    def __init__(self, *args):
        self.args = args


def test_generate_until_stops_before_until_and_after_max_gen_toks(bdlm_dir):
    lm = HFBDLMEvalModel(pretrained=str(bdlm_dir), batch_size=2)
    texts = lm.generate_until([_Request("w20 w21 w22 w23", {"until": ["w26"], "max_gen_toks": 8}),
                               _Request("w20 w21 w22 w23", {"until": ["\n"], "max_gen_toks": 2}),
                               _Request("w20 w21 w22 w23", {"until": "w29", "max_gen_toks": 8})])
    assert texts == ["w24 w25 ", "w24 w25", "w24 w25 w26 w27 w28 "]


def test_decoding_settings_are_model_args_and_bad_ones_are_refused(bdlm_dir, dg_dir):
    lm = HFBDLMEvalModel(pretrained=str(bdlm_dir), block_size=2, confidence_threshold=0.5, steps=2)
    assert lm.decoder.settings(lm.decoding, 4, 4).block_size == 2
    assert lm.generate_until([_Request("w20 w21 w22 w23", {"max_gen_toks": 4})]) == ["w24 w25 w26 w27"]
    with pytest.raises(ValueError, match="canvas"):
        HFBDLMEvalModel(pretrained=str(dg_dir), block_size=8)
    with pytest.raises(TypeError, match="unknown model_args"):
        HFBDLMEvalModel(pretrained=str(bdlm_dir), temperature=0.3)
    with pytest.raises(ValueError, match="num_beams"):
        lm.generate_until([_Request("w20", {"num_beams": 4})])
    with pytest.raises(ValueError, match="max_length=16"):
        HFBDLMEvalModel(pretrained=str(bdlm_dir), max_length=16).generate_until(
            [_Request(" ".join(["w9"] * 14), {"max_gen_toks": 4})])
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        HFBDLMEvalModel(pretrained=str(bdlm_dir), batch_size="auto")


def test_a_drafter_folder_names_what_to_evaluate_instead(tmp_path):
    folder = tmp_path / "drafter"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3", "architectures": ["DFlash2DraftModel"]}))
    with pytest.raises(ValueError, match=r"drafter.*pretrained=TARGET.*--draft"):
        load_for_evaluation(str(folder), None, "cpu", 32)


# --- the bounds ----------------------------------------------------------------------------------------------------


def test_bdlm_bound_equals_the_training_form_forward():
    """mc_num = 1: the estimate is the weighted log-probabilities of one draw's masked tokens, which the training
    form ([noisy ; clean] rows, the model's forward) computes independently."""
    for objective in ("standard", "fast_dllm_v2"):
        model = tiny_bdlm(seed=3).double()
        model.config.objective = objective
        shift = objective == "fast_dllm_v2"
        scorer = family_named("block_diffusion").role("evaluation").likelihood_scorer(model, None)
        for context, continuation in (((9, 10, 11), (12, 13, 14, 15, 16, 17)), ((9, 10, 11, 12), (13,)),
                                      ((20,), (21, 22, 23, 24, 25, 26, 27, 28, 29))):
            [estimate] = scorer.score([ScoreRequest(context, continuation)], mc_num=1, seed=5, batch_size=1)
            tokens = torch.tensor(context + continuation)
            positions = torch.arange(len(context), tokens.numel())
            draws = absorbing_draws(5, request_key(context, continuation), 1, positions, BLOCK)
            length = -(-tokens.numel() // BLOCK) * BLOCK
            clean = torch.full((length,), MASK)
            clean[: tokens.numel()] = tokens
            noisy = clean.clone()
            noisy[positions[draws.masked[0]]] = MASK
            with torch.no_grad():
                hidden = model(input_ids=noisy[None], clean_input_ids=clean[None], return_logits=False).hidden_states[0]
            rows = positions - 1 if shift else positions.clone()
            if shift:
                start = positions % BLOCK == 0
                rows[start] = length + positions[start] - 1  # a block's first token: the clean row before it
            logits = model.lm_logits(hidden[rows]).detach()
            logits[:, MASK] = -math.inf
            log_probs = logits.log_softmax(-1).gather(1, tokens[positions][:, None])[:, 0]
            reference = float((log_probs * draws.weight[0]).sum())
            assert abs(estimate.log_likelihood - reference) < 1e-10, (objective, context, estimate, reference)


def test_diffusion_gemma_bound_equals_transformers_forward_per_canvas():
    """mc_num = 1: reconstruction minus the weighted score-entropy term of one draw, with each canvas's logits from
    transformers' own forward (`input_ids` = the text before the canvas, `decoder_input_ids` = the canvas)."""
    model = float64_faithful(tiny_model(seed=2)).eval()
    scorer = family_named("diffusion_gemma").role("evaluation").likelihood_scorer(model, None)
    t_min, vocab = scorer.t_min, scorer.vocab_size
    for context, continuation in (((9, 10, 11), (12, 13, 14, 15, 16, 17)), ((30, 31), (32,))):
        [estimate] = scorer.score([ScoreRequest(context, continuation)], mc_num=1, seed=7, batch_size=1)
        key = torch.tensor(request_key(context, continuation))
        tokens = torch.tensor(context + continuation)
        c = len(context)
        blocks = -(-len(continuation) // CANVAS)
        source = c + torch.arange(blocks * CANVAS)  # canvas slots: the continuation, then the tail
        block_start = c + (torch.arange(blocks * CANVAS) // CANVAS) * CANVAS
        level = t_min ** (1.0 - stratified_levels(7, int(key), 1, torch.unique(block_start))[0])
        t = level[(block_start - c) // CANVAS]
        target = torch.where(source < tokens.numel(), tokens[source.clamp(max=tokens.numel() - 1)], 0)
        is_continuation = source < tokens.numel()

        def canvas(replace_salt, level):  # sample 0's canvas at `level`
            def draw(salt):
                return sample_uniform(7, int(key), torch.tensor([0]), source, salt)[0]

            replace = draw(replace_salt) < level
            drawn = (draw(dg_likelihood.SALT_TOKEN) * vocab).long()
            tail = (draw(dg_likelihood.SALT_TAIL) * vocab).long()
            return torch.where(is_continuation, torch.where(replace, drawn, target), tail)

        recon_canvas = canvas(dg_likelihood.SALT_RECON_REPLACE, torch.full_like(t, t_min))
        diffusion_canvas = canvas(dg_likelihood.SALT_REPLACE, t)
        recon = rate = 0.0
        with torch.no_grad():
            for j in range(blocks):
                cols = slice(j * CANVAS, (j + 1) * CANVAS)
                prefix = tokens[None, : c + j * CANVAS]
                keep = is_continuation[cols]
                lp = model(input_ids=prefix, decoder_input_ids=recon_canvas[None, cols]).logits[0].double()
                recon += float(lp.log_softmax(-1)[keep].gather(1, target[cols][keep][:, None]).sum())
                probs = model(input_ids=prefix, decoder_input_ids=diffusion_canvas[None, cols]).logits[0].double()
                terms = dg_likelihood.score_entropy_rate(probs.softmax(-1)[keep], diffusion_canvas[cols][keep],
                                                         target[cols][keep], t[cols][keep], vocab)
                rate += float((terms * t[cols][keep] * math.log(1 / t_min)).sum())
        # float64 model; transformers' forward returns float32 logits (measured difference 4e-8 of 78).
        assert abs(estimate.log_likelihood - (recon - rate)) < 1e-6, (estimate, recon, rate)


def test_uniform_state_bound_is_tight_for_the_exact_posterior():
    """One token, 5 symbols, data p0: with the exact posterior as x_theta the reconstruction minus the integrated
    score-entropy term (Gauss-Legendre in log t, exact expectation over the noisy token) is log p0(x)."""
    torch.manual_seed(0)
    n, t_min = 5, 1e-4
    p0 = torch.rand(n, dtype=torch.float64)
    p0 /= p0.sum()

    def kernel(t):  # [x, z]
        return (1 - t) * torch.eye(n, dtype=torch.float64) + t / n

    def posterior(t):  # [z, x]
        joint = p0[:, None] * kernel(t)
        return (joint / joint.sum(0, keepdim=True)).T

    nodes, weights = np.polynomial.legendre.leggauss(200)
    low = math.log(t_min)
    z = torch.arange(n)
    for x in range(n):
        integral = 0.0
        for u, w in zip(nodes, weights):
            t = math.exp(low * (1 - u) / 2)
            rate = dg_likelihood.score_entropy_rate(posterior(t), z, torch.full((n,), x),
                                                    torch.full((n,), t, dtype=torch.float64), n)
            integral += w * (-low / 2) * t * float((kernel(t)[x] * rate).sum())
        recon = float((kernel(t_min)[x] * posterior(t_min)[:, x].log()).sum())
        assert abs((recon - integral) - math.log(p0[x])) < 1e-10


def test_absorbing_draws_are_unbiased_for_exact_conditionals():
    """Three tokens over 3 symbols in blocks of 2 and 1: with exact conditionals p(x_i | unmasked) of a joint table,
    the mean of the weighted draws converges to log p(x) (the bound is tight then); the masked counts are uniform."""
    torch.manual_seed(1)
    joint = torch.rand(3, 3, 3, dtype=torch.float64)
    joint /= joint.sum()
    x = (2, 0, 1)
    positions = torch.tensor([3, 4, 5])  # block size 2: blocks {3} (with context position 2) and {4, 5}

    @functools.cache
    def log_conditional(i, unmasked):
        """log p(x_i | x_unmasked): the other masked tokens summed out."""
        keep = sorted(set(unmasked) | {i})
        gone = tuple(j for j in range(3) if j not in keep)
        table = joint.sum(dim=gone) if gone else joint
        column = table[tuple(slice(None) if j == i else x[j] for j in keep)]
        return float(column[x[i]].log() - column.sum().log())

    # The bound of a block: the other block's tokens are clean context (block by block).
    samples = 4000
    draws = absorbing_draws(0, 123, samples, positions, 2)
    block_of = {0: [0], 1: [1, 2]}
    estimates = torch.zeros(samples, dtype=torch.float64)
    for k in range(samples):
        for block, members in block_of.items():
            earlier = [j for b, ms in block_of.items() if b < block for j in ms]
            masked = [i for i in members if draws.masked[k, i]]
            unmasked = frozenset(earlier) | {i for i in members if i not in masked}
            for i in masked:
                estimates[k] += float(draws.weight[k, i]) * log_conditional(i, unmasked)
    assert abs(float(estimates.mean()) - math.log(joint[x])) < 3 * float(estimates.std()) / math.sqrt(samples)
    counts = draws.masked[:, 1:].sum(1)
    assert set(counts.tolist()) == {1, 2} and abs(float((counts == 1).double().mean()) - 0.5) < 0.01


def test_scores_are_a_function_of_the_seed_and_the_request_only(bdlm_dir):
    model, _ = load_for_evaluation(str(bdlm_dir), None, "cpu", 32)
    scorer = family_named("block_diffusion").role("evaluation").likelihood_scorer(model, None)
    requests = [ScoreRequest((20, 21, 22), (23, 24, 25, 26, 27)), ScoreRequest((9,), (10, 11))]
    first = scorer.score(requests, mc_num=8, seed=0, batch_size=2)
    assert scorer.score(requests[::-1], mc_num=8, seed=0, batch_size=1)[::-1] == first  # order, batch, rerun
    assert scorer.score(requests, mc_num=8, seed=1, batch_size=2)[0] != first[0]  # another seed, other noise
    assert all(e.stderr > 0 for e in first)


def gold_and_corrupted(folder, family: str, offset: int):
    """The bound (``mc_num=16``, seed 0) of 10 counts of 4 words, and of the same words counting down."""
    model, _ = load_for_evaluation(str(folder), None, "cpu", 32)
    scorer = family_named(family).role("evaluation").likelihood_scorer(model, None)
    gold, corrupted = [], []
    for start in range(10, 40, 3):
        context = tuple(range(start + offset, start + offset + 5))
        continuation = tuple(range(start + offset + 5, start + offset + 9))
        gold.append(ScoreRequest(context, continuation))
        corrupted.append(ScoreRequest(context, continuation[::-1]))  # the same words, counting down
    return (scorer.score(gold, mc_num=16, seed=0, batch_size=8),
            scorer.score(corrupted, mc_num=16, seed=0, batch_size=8))


@pytest.mark.parametrize("family", families_with_role("evaluation"))
def test_the_bound_ranks_a_trained_models_gold_continuations_far_above_corrupted_ones(family, bdlm_dir, dg_dir):
    folder, offset = for_family({"block_diffusion": (bdlm_dir, BD_WORD_ID), "diffusion_gemma": (dg_dir, DG_WORD_ID)},
                                family)
    good, bad = gold_and_corrupted(folder, family, offset)
    gaps = [g.log_likelihood - b.log_likelihood for g, b in zip(good, bad)]
    stderr = math.sqrt(sum(g.stderr ** 2 + b.stderr ** 2 for g, b in zip(good, bad))) / len(gaps)
    # Measured (benchmarks/results/lm_eval_tasks/elbo_ranking.json): converted BDLM gold -0.06 .. -0.12 against
    # -24 .. -32, every pair apart by 24 nats or more; DiffusionGemma gold -2.7 .. -10.6 against -37 .. -56, every
    # pair apart by 30 nats or more (a single bound's standard error up to 7 nats: its uniform-state bound is noisier).
    assert sum(gaps) / len(gaps) > 3 * stderr, (gaps, stderr)
    assert min(gaps) > 10.0, gaps
