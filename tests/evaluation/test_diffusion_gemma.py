"""Evaluation of DiffusionGemma checkpoints: `hf-bdlm eval --model DIR` and `BDLMEvalCallback` in DiffusionGemma runs.

A tiny random DiffusionGemma (tests/distributed/eval_callback_worker.py: the tiny model of
tests/distributed/tiny_diffusion_gemma.py with a context of 8192, 4 denoising steps per canvas) solves nothing, so the
tests check that every run completes and is graded: the offline SWE-bench set through the command line (the grader's
gold / empty sanity still holds), seeded evaluations that reproduce, and the callback at every save on 1 process and
under torchrun on 2 (P = 2 csbp, DDP and FSDP2): every rank logs the main process's pass rate at the same steps and
finishes, and the training's losses are those of the run without the callback.
Run: python -m pytest tests/evaluation/test_diffusion_gemma.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("minisweagent", reason="the evaluation tests need mini-swe-agent (eval/dev extra)")
pytest.importorskip("swebench", reason="the evaluation tests need swebench (eval/dev extra)")
pytest.importorskip("fastapi", reason="the evaluation tests serve the model (serve extra)")

from torchrun import SharedJob  # noqa: E402

from hf_bdlm.cli import main  # noqa: E402
from hf_bdlm.evaluation.tasksets import load_swebench_instances  # noqa: E402

from eval_callback_worker import servable_tiny_model, training_config  # noqa: E402
from tiny_diffusion_gemma import conversations, tiny_tokenizer  # noqa: E402

INSTANCES = load_swebench_instances("offline")
# FSDP2's gathered weights against DDP's live ones (float32; measured 7e-9 relative on the norms).
TOL = 1e-5


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-diffusion-gemma")
    servable_tiny_model().save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


# --- the command line -----------------------------------------------------------------------------


def test_cli_eval_swebench_serves_a_diffusion_gemma_folder_and_grades_every_task(folder, tmp_path, capsys):
    out = tmp_path / "swe"
    assert main(["eval", "swebench", "--model", str(folder), "--output-dir", str(out), "--step-limit", "1",
                 "--max-tokens", "8", "--quiet"]) == 0
    assert "pass rate:" in capsys.readouterr().out
    record = json.loads((out / "swebench-offline_results.json").read_text())
    assert record["model"] == folder.name
    assert record["total"] == len(INSTANCES) == len(record["tasks"])
    assert 0.0 <= record["pass_rate"] <= 1.0 and record["resolved"] == sum(t["resolved"] for t in record["tasks"])
    assert all(t["steps"] == 1 and t["prompt_tokens"] > 0 for t in record["tasks"])  # the model answered each task
    predictions = [json.loads(line) for line in (out / "preds.jsonl").read_text().splitlines()]
    assert sorted(p["instance_id"] for p in predictions) == sorted(i["instance_id"] for i in INSTANCES)


def test_cli_swebench_grader_sanity_still_holds(tmp_path, capsys):
    assert main(["eval", "swebench", "--sanity", "--quiet", "--output-dir", str(tmp_path)]) == 0
    assert "grader sanity: gold 100%, empty 0% -> OK" in capsys.readouterr().out


def test_cli_model_that_is_not_a_folder_says_what_model_means_without_base_url():
    with pytest.raises(SystemExit, match="without --base-url, --model names the folder"):
        main(["eval", "terminal-bench", "--model", "/nonexistent/checkpoint"])


# --- seeded evaluation ----------------------------------------------------------------------------


def _answers(results_path: Path) -> list[str]:
    trajectory = json.loads((results_path.parent / "trajectories" / "create-greeting.traj.json").read_text())
    return [m["extra"]["model_response"] for m in trajectory["messages"] if "model_response" in m.get("extra", {})]


def test_seeded_evaluation_of_a_diffusion_gemma_checkpoint_reproduces(tmp_path):
    """A DiffusionGemma canvas starts from random tokens: the callback's seed makes a checkpoint's answers, hence its
    score, the same at every evaluation."""
    from hf_bdlm.evaluation.callback import BDLMEvalCallback

    model, tokenizer = servable_tiny_model(), tiny_tokenizer()
    callback = BDLMEvalCallback(benchmark="terminal-bench", tasks=["create-greeting"], step_limit=2, max_tokens=6,
                                seed=7)
    answers = [_answers(callback.evaluate(model, tokenizer, tmp_path / str(i), step=1)[1]) for i in range(2)]
    assert answers[0] and answers[0] == answers[1]


# --- the trainer callback -------------------------------------------------------------------------


def _train(out: Path, with_callback: bool):
    from hf_bdlm import BDLMSFTTrainer
    from hf_bdlm.evaluation.callback import BDLMEvalCallback

    trainer = BDLMSFTTrainer(servable_tiny_model(), args=training_config(out, 1, max_steps=2, save_steps=1),
                             train_dataset=conversations(8), processing_class=tiny_tokenizer())
    if with_callback:
        trainer.add_callback(BDLMEvalCallback(trainer, benchmark="terminal-bench", tasks=["create-greeting"],
                                              step_limit=1, max_tokens=4))
    trainer.train()
    return trainer


def test_eval_callback_evaluates_every_diffusion_gemma_checkpoint_and_leaves_training_unchanged(tmp_path):
    trainer = _train(tmp_path / "with", with_callback=True)
    logged = [row for row in trainer.state.log_history if "eval/pass_rate" in row]
    assert [row["step"] for row in logged] == [1, 2] and all(0.0 <= row["eval/pass_rate"] <= 1.0 for row in logged)
    eval_dir = tmp_path / "with" / "eval"
    assert [row["step"] for row in json.loads((eval_dir / "eval_history.json").read_text())] == [1, 2]
    assert (eval_dir / "pass_rate.png").read_bytes()[:4] == b"\x89PNG"
    record = json.loads((eval_dir / "checkpoint-2" / "terminal-bench-offline_results.json").read_text())
    assert record["total"] == 1 and record["tasks"][0]["steps"] == 1
    assert trainer.model.training  # the trainer's mode is back
    reference = _train(tmp_path / "without", with_callback=False)
    losses = [[row["loss"] for row in t.state.log_history if "loss" in row] for t in (trainer, reference)]
    assert losses[0] == losses[1]  # the evaluation drew nothing from the training's random streams


SHARED_JOBS = [SharedJob("eval_callback", "eval_callback_worker.py", 2, timeout=420)]


@pytest.fixture(scope="module")
def torchrun_runs(shared_launch):
    out = shared_launch.folder("eval_callback", 2)
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("run", ["ddp", "fsdp2"])
def test_eval_callback_under_torchrun_p2_csbp_every_rank_logs_the_main_process_evaluation(torchrun_runs, run):
    out, ranks = torchrun_runs
    for rank in ranks:
        assert rank[run]["eval_rows"] == [{"step": 2, "pass_rate": 0.0}, {"step": 4, "pass_rate": 0.0}]
        assert rank[run]["training_after"]
    assert len(ranks[0][run]["served"]) == 2 and ranks[1][run]["served"] == []  # the main process evaluated, alone
    history = json.loads((out / run / "eval" / "eval_history.json").read_text())
    assert [row["step"] for row in history] == [2, 4]
    for row in history:
        assert json.loads(Path(row["results"]).read_text())["total"] == 1


@pytest.mark.parametrize("run", ["ddp", "fsdp2"])
def test_eval_callback_under_torchrun_leaves_the_training_losses_unchanged(torchrun_runs, run):
    _, ranks = torchrun_runs
    for rank in ranks:
        reference, losses = rank["reference"]["losses"], rank[run]["losses"]
        assert len(losses) == len(reference) == 4
        if run == "ddp":
            assert losses == reference
        else:  # FSDP2's reduce-scatter sums in another order than DDP's all-reduce
            assert losses == pytest.approx(reference, rel=TOL)


def test_eval_callback_under_fsdp2_serves_a_plain_copy_of_the_gathered_weights(torchrun_runs):
    _, ranks = torchrun_runs
    assert ranks[0]["fsdp2"]["dtensors"] > 0  # the live model really is sharded
    ddp, fsdp2 = ranks[0]["ddp"]["served"], ranks[0]["fsdp2"]["served"]
    for live, gathered in zip(ddp, fsdp2):
        assert live["step"] == gathered["step"] and gathered["dtensors"] == 0
        assert set(live["weights"]) == set(gathered["weights"])
        for name, (total, norm) in live["weights"].items():
            assert gathered["weights"][name][1] == pytest.approx(norm, rel=TOL), name
            assert abs(gathered["weights"][name][0] - total) <= TOL * max(norm, 1.0), name
