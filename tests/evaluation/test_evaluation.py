"""SWE-bench / Terminal-Bench evaluation offline: task sets, grader sanity, the agent loop end to end, clear
messages where Docker or a harness is missing, the command line.

The agent loop runs the real mini-swe-agent against (a) a scripted OpenAI-compatible stub on 127.0.0.1 that
replays each task's reference solution as fenced shell actions, so patch extraction and grading must resolve every
task, and (b) hf-bdlm's own server over a tiny random model, which never produces an action.
Run: python -m pytest tests/evaluation/test_evaluation.py -q
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from embedded_model import needs_embedded_model
import pytest

pytest.importorskip("minisweagent", reason="the evaluation tests need mini-swe-agent (eval/dev extra)")
pytest.importorskip("swebench", reason="the evaluation tests need swebench (eval/dev extra)")

from hf_bdlm.cli import main  # noqa: E402
from hf_bdlm.evaluation import swebench_runner, terminal_runner  # noqa: E402
from hf_bdlm.evaluation.agent import AgentSettings  # noqa: E402
from hf_bdlm.evaluation.endpoint import Endpoint  # noqa: E402
from hf_bdlm.evaluation.sandbox import checkout_instance, git  # noqa: E402
from hf_bdlm.evaluation.tasksets import OFFLINE_SWEBENCH, load_swebench_instances, terminal_task_dirs  # noqa: E402
from swebench.harness.run_evaluation import get_dataset_from_preds  # noqa: E402
from swebench.harness.utils import get_predictions_from_file  # noqa: E402

INSTANCES = load_swebench_instances("offline")
FIELDS = ("repo", "instance_id", "base_commit", "patch", "test_patch", "problem_statement", "hints_text",
          "created_at", "version", "FAIL_TO_PASS", "PASS_TO_PASS", "environment_setup_commit")


# --- the shipped task sets ----------------------------------------------------------------------


def test_offline_instances_have_swebench_fields_and_reproduce_their_base_commit(tmp_path):
    assert len(INSTANCES) >= 3
    for instance in INSTANCES:
        assert all(field in instance for field in FIELDS)
        assert json.loads(instance["FAIL_TO_PASS"]) and isinstance(json.loads(instance["PASS_TO_PASS"]), list)
        repo = checkout_instance(instance, tmp_path / instance["instance_id"])
        assert git(repo, "rev-parse", "HEAD").strip() == instance["base_commit"]


def test_offline_terminal_tasks_are_in_harbor_format():
    tasks = terminal_task_dirs("offline")
    assert len(tasks) >= 3
    for task in tasks:
        for part in ("instruction.md", "task.toml", "environment/Dockerfile", "tests/test.sh", "solution/solve.sh"):
            assert (task / part).is_file(), (task, part)


def test_swebench_grader_sanity_gold_resolves_everything_and_empty_nothing(tmp_path):
    runs = swebench_runner.sanity_check(INSTANCES, tmp_path)
    assert runs["gold"].pass_rate == 1.0
    assert runs["empty"].pass_rate == 0.0
    record = json.loads(runs["empty"].results_path.read_text())
    assert record["total"] == len(INSTANCES) and record["pass_rate"] == 0.0
    first = record["tasks"][0]
    assert {"task_id", "resolved", "steps", "tokens", "wall_time_s"} <= set(first)
    assert first["detail"]["tests_status"]["FAIL_TO_PASS"]["failure"]  # the failing test is named


def test_terminal_grader_sanity_reference_solutions_pass_and_no_op_fails(tmp_path):
    tasks = terminal_task_dirs("offline")
    assert terminal_runner.run_local(tasks, tmp_path / "gold", None, None, mode="gold", progress=False).pass_rate == 1
    assert terminal_runner.run_local(tasks, tmp_path / "empty", None, None, mode="empty", progress=False).pass_rate == 0


def test_a_patch_that_does_not_apply_is_unresolved(tmp_path):
    instance = INSTANCES[0]
    broken = instance["patch"].replace('-    return "-".join(words)', '-    return "+".join(words)')
    assert broken != instance["patch"]
    run = swebench_runner.run_offline([instance], tmp_path, None, None, predictions={instance["instance_id"]: broken},
                                      progress=False)
    assert not run.results[0].resolved and run.results[0].detail["patch_applied"] is False


# --- the agent loop against a scripted endpoint ---------------------------------------------------


def _fenced(command: str) -> str:
    return f"THOUGHT: next step.\n\n```mswea_bash_command\n{command}\n```"


def _scripts() -> dict[str, list[str]]:
    """Per task (found by a phrase of its prompt): the assistant turns that solve it."""
    scripts = {}
    for instance in INSTANCES:
        scripts[instance["problem_statement"][:60]] = [
            _fenced("ls && git status --short"),
            _fenced(f"git apply <<'PATCH'\n{instance['patch']}PATCH"),
            _fenced("git diff > patch.txt"),
            _fenced("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat patch.txt"),
        ]
    for task in terminal_task_dirs("offline"):
        solve = (task / "solution" / "solve.sh").read_text().split('cd "${APP_DIR:-/app}"\n', 1)[1].strip()
        scripts[(task / "instruction.md").read_text().strip()[:60]] = [
            _fenced(solve), _fenced("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")]
    return scripts


class ScriptedModel(BaseHTTPRequestHandler):
    """A minimal OpenAI chat-completions endpoint that replays a script per task."""

    scripts: dict[str, list[str]] = {}
    requests: list[dict] = []

    def do_POST(self):  # noqa: N802 (http.server's naming)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(body)
        messages = body["messages"]
        task_text = messages[1]["content"]
        script = next(turns for key, turns in self.scripts.items() if key in task_text)
        turn = sum(m["role"] == "assistant" for m in messages)
        content = script[min(turn, len(script) - 1)]
        reply = {"id": "stub", "object": "chat.completion", "created": 0, "model": body["model"],
                 "choices": [{"index": 0, "finish_reason": "stop",
                              "message": {"role": "assistant", "content": content}}],
                 "usage": {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110}}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def scripted_endpoint():
    ScriptedModel.scripts = _scripts()
    server = ThreadingHTTPServer(("127.0.0.1", 0), ScriptedModel)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield Endpoint(f"http://127.0.0.1:{server.server_address[1]}/v1", "scripted", "none")
    server.shutdown()


def test_agent_loop_patch_extraction_and_grading_resolve_scripted_solutions(tmp_path, scripted_endpoint, monkeypatch):
    settings = AgentSettings(scripted_endpoint.base_url, scripted_endpoint.model, step_limit=8)
    ids = [INSTANCES[3]["instance_id"]]
    run = swebench_runner.run_swebench(scripted_endpoint, tmp_path, settings, instance_ids=ids, progress=False)
    assert run.pass_rate == 1.0
    for result in run.results:
        assert result.exit_status == "Submitted" and result.steps == 4
        assert result.prompt_tokens == 400 and result.completion_tokens == 40
        assert result.detail["patch_source"] == "submission"
    predictions = [json.loads(line) for line in run.predictions_path.read_text().splitlines()]
    assert [p["instance_id"] for p in predictions] == ids
    assert all(set(p) == {"instance_id", "model_name_or_path", "model_patch"} for p in predictions)
    assert (tmp_path / "trajectories" / f"{ids[0]}.traj.json").is_file()
    # The official harness reads the file as `python -m swebench.harness.run_evaluation --predictions_path` does:
    # its loader, then its match of predictions to dataset instances (the shipped set is a SWE-bench jsonl file).
    loaded = get_predictions_from_file(str(run.predictions_path), str(OFFLINE_SWEBENCH), "test")
    assert loaded == predictions and all(p["model_name_or_path"] == "scripted" and p["model_patch"] for p in loaded)
    monkeypatch.chdir(tmp_path)  # the harness looks for earlier reports under ./logs
    to_grade = get_dataset_from_preds(str(OFFLINE_SWEBENCH), "test", ids, {p["instance_id"]: p for p in loaded},
                                      "hf-bdlm-test", rewrite_reports=False)
    assert [instance["instance_id"] for instance in to_grade] == ids


def test_agent_loop_solves_scripted_terminal_tasks(tmp_path, scripted_endpoint):
    settings = AgentSettings(scripted_endpoint.base_url, scripted_endpoint.model, step_limit=5)
    run = terminal_runner.run_terminal_bench(scripted_endpoint, tmp_path, settings, progress=False)
    assert run.pass_rate == 1.0 and all(r.exit_status == "Submitted" for r in run.results)
    assert json.loads(run.results_path.read_text())["resolved"] == len(run.results)


def test_agent_over_our_server_and_a_tiny_model_stops_cleanly_unresolved(tmp_path):
    import torch

    from hf_bdlm.evaluation.endpoint import model_endpoint
    from hf_bdlm.serving import Engine
    from tiny_bdlm import save_tiny_bdlm

    engine = Engine.from_pretrained(save_tiny_bdlm(tmp_path / "model", context=4096), name="tiny",
                                    dtype=torch.float32)
    with model_endpoint(engine=engine) as endpoint:
        settings = AgentSettings(endpoint.base_url, endpoint.model, step_limit=2, max_tokens=8)
        run = terminal_runner.run_terminal_bench(endpoint, tmp_path / "out", settings, names=["create-greeting"],
                                                 progress=False)
    result = run.results[0]
    assert not result.resolved and result.exit_status == "LimitsExceeded" and result.steps == 2
    assert result.completion_tokens == 2 * 8 and result.prompt_tokens > 0


# --- where Docker or a harness is missing ---------------------------------------------------------


def test_real_swebench_without_docker_says_so_and_keeps_the_predictions(tmp_path, monkeypatch):
    monkeypatch.setattr(swebench_runner, "docker_available", lambda: False)
    given = tmp_path / "given.jsonl"
    given.write_text(json.dumps({"instance_id": "astropy__astropy-12907", "model_name_or_path": "m",
                                 "model_patch": "diff --git a/x b/x\n"}) + "\n")
    run = swebench_runner.run_swebench(None, tmp_path / "out", dataset="princeton-nlp/SWE-bench_Verified",
                                       predictions_path=str(given), progress=False)
    assert "Docker" in run.message and str(run.predictions_path) in run.message
    assert json.loads(run.predictions_path.read_text())["instance_id"] == "astropy__astropy-12907"


def test_docker_path_commands_point_the_agent_and_harness_at_our_server(tmp_path):
    endpoint = Endpoint("http://127.0.0.1:8000/v1", "bdlm", "key")
    agent, harness = swebench_runner.docker_commands("princeton-nlp/SWE-bench_Verified", "test", endpoint, tmp_path,
                                                     AgentSettings(endpoint.base_url, "bdlm"), "run1", 2, None)
    assert "litellm_textbased" in agent and "openai/bdlm" in agent
    assert "model.model_kwargs.api_base=http://127.0.0.1:8000/v1" in agent
    assert harness[2] == "swebench.harness.run_evaluation" and str(tmp_path / "preds.jsonl") in harness


def test_terminal_bench_dataset_without_harness_names_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(terminal_runner, "docker_available", lambda: False)
    monkeypatch.setattr(terminal_runner.shutil, "which", lambda name: None)
    run = terminal_runner.run_terminal_bench(Endpoint("http://127.0.0.1:1/v1", "m"), tmp_path,
                                             tasks="terminal-bench@2.0")
    assert not run.results
    assert "harbor" in run.message and "Python >= 3.12" in run.message and "Docker" in run.message


# --- the command line -----------------------------------------------------------------------------


def test_cli_help_lists_the_commands(capsys):
    for argv in (["--help"], ["eval", "--help"], ["eval", "swebench", "--help"], ["serve", "--help"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "serve" in out and "terminal-bench" in out and "--dataset" in out


def test_cli_errors_are_clear():
    with pytest.raises(SystemExit, match="--model-dir"):
        main(["eval", "terminal-bench"])
    assert main(["eval", "swebench", "--dataset", "/nonexistent.jsonl", "--predictions", "/nonexistent"]) == 2


def test_cli_terminal_sanity_prints_the_grader_check(tmp_path, capsys):
    assert main(["eval", "terminal-bench", "--sanity", "--quiet", "--output-dir", str(tmp_path)]) == 0
    assert "grader sanity: gold 100%, empty 0% -> OK" in capsys.readouterr().out
    assert Path(tmp_path / "gold" / "terminal-sanity-gold_results.json").is_file()


# --- the trainer callback -------------------------------------------------------------------------


def test_eval_callback_logs_pass_rate_and_plots_it_for_every_checkpoint(tmp_path):
    import datasets

    from hf_bdlm import BDLMSFTConfig, BDLMSFTTrainer
    from hf_bdlm.evaluation.callback import BDLMEvalCallback
    from tiny_bdlm import tiny_bdlm, tiny_tokenizer

    data = datasets.Dataset.from_dict({"text": [f"w{7 + i} w{8 + i} w{9 + i} w{10 + i}" for i in range(8)]})
    args = BDLMSFTConfig(output_dir=str(tmp_path / "out"), report_to="none", per_device_train_batch_size=2,
                         max_length=16, max_steps=2, save_steps=1, disable_tqdm=True,
                         activation_checkpointing=False, logging_steps=1)
    trainer = BDLMSFTTrainer(tiny_bdlm(context=4096), args=args, train_dataset=data,
                             processing_class=tiny_tokenizer())
    callback = BDLMEvalCallback(trainer, benchmark="terminal-bench", tasks=["create-greeting"], step_limit=1,
                                max_tokens=4)
    trainer.add_callback(callback)
    trainer.train()
    logged = [row for row in trainer.state.log_history if "eval/pass_rate" in row]
    assert [row["step"] for row in logged] == [1, 2] and all(row["eval/pass_rate"] == 0.0 for row in logged)
    eval_dir = tmp_path / "out" / "eval"
    assert [row["step"] for row in json.loads((eval_dir / "eval_history.json").read_text())] == [1, 2]
    assert (eval_dir / "pass_rate.png").read_bytes()[:4] == b"\x89PNG"
    assert (eval_dir / "checkpoint-2" / "terminal-bench-offline_results.json").is_file()
    assert trainer.model.training  # the trainer's mode is back


@pytest.mark.slow
@needs_embedded_model
def test_embedded_smollm2_runs_through_server_agent_and_grader(tmp_path):
    """The real model end to end (the README's offline pass rates come from `hf-bdlm eval` runs of this path)."""
    from hf_bdlm.evaluation.endpoint import model_endpoint

    with model_endpoint(model_dir="embedded:smollm2") as endpoint:
        settings = AgentSettings(endpoint.base_url, endpoint.model, step_limit=1, max_tokens=16)
        run = terminal_runner.run_terminal_bench(endpoint, tmp_path, settings, names=["create-greeting"],
                                                 progress=False)
    result = run.results[0]
    assert result.steps >= 1 and result.prompt_tokens > 0 and result.exit_status
    assert json.loads(run.results_path.read_text())["total"] == 1
