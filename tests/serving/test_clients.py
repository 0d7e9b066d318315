"""`hf-bdlm serve` speaks what evaluation clients send: token-id prompts, vLLM's tokenizer routes, lm-eval's
local-completions (its defaults) and local-chat-completions, and the requests terminus-2 sends through LiteLLM.

A tiny random converted BDLM (tests/tiny_bdlm.py) and a tiny random DiffusionGemma (tests/distributed/
tiny_diffusion_gemma.py) are served on 127.0.0.1 by real uvicorn servers in background threads, with an API key.
lm-eval runs the shipped generation task (tests/data/lm_eval_tasks/count_gen.yaml) against the server; with
local-completions its generations equal those of `--model bdlm` on the same folder, since both decode greedily with
the checkpoint's settings. The terminus-2 shapes come from harbor 0.26.0 (`harbor/agents/terminus_2`,
`harbor/llms/lite_llm.py`): `litellm.acompletion(model="openai/<name>", api_base=..., messages=[user, assistant,
user, ...], drop_params=True)` with no system message, no tools and no stop strings, `temperature` when set,
`extra_body={"session_id": ...}` plus an `X-Session-ID` header when the trial has a session; it reads `content`,
treats `finish_reason: "length"` as truncated output and a 400 whose text says `context_length_exceeded` as a full
context. Other harbor agents add a system message and stop strings, sent here too.
Run: python -m pytest tests/serving/test_clients.py -q
"""

from __future__ import annotations

import os

import httpx
import pytest
from paths import LM_EVAL_TASKS

openai = pytest.importorskip("openai", reason="the serving tests need the openai client (dev extra)")
pytest.importorskip("fastapi", reason="the serving tests need fastapi and uvicorn (serve extra)")

from fixtures import API_KEY, families_with_role, for_family, serve  # noqa: E402
from hf_bdlm.serving import Engine  # noqa: E402
from tiny_bdlm import CONTEXT, save_tiny_bdlm  # noqa: E402

from tiny_diffusion_gemma import save_checkpoint  # noqa: E402

KEY = API_KEY
TASKS = LM_EVAL_TASKS
# The servers of both families (tests/serving/conftest.py: engine, server, client: the block-diffusion one).
SERVER = dict(max_batch_size=8, max_queue=32, batch_wait_ms=20, max_tokens_limit=64, default_max_tokens=8)


@pytest.fixture(scope="module")
def bdlm_folder(tmp_path_factory):
    return save_tiny_bdlm(tmp_path_factory.mktemp("tiny-bdlm"))


@pytest.fixture(scope="module")
def served(bdlm_folder):
    return dict(path=bdlm_folder, name="tiny")


@pytest.fixture(scope="module")
def dg_server(tmp_path_factory):
    path = save_checkpoint(tmp_path_factory.mktemp("tiny-diffusion-gemma"), denoising_steps=4)
    with serve(Engine.from_pretrained(path, name="tiny-dg"), **SERVER) as running:
        yield running


def post(server, path, body, key=KEY):
    root = server.base_url.removesuffix("/v1")
    return httpx.post(root + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)


# --- token-id prompts, the tokenizer routes, the logprobs pointer ------------------------------------------------


def test_a_prompt_of_token_ids_answers_as_its_text(client, server):
    text = "w20 w21 w22"
    ids = post(server, "/tokenize", {"model": "tiny", "prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert len(ids) == 3
    by_text = client.completions.create(model="tiny", prompt=text, max_tokens=6, temperature=0).choices[0].text
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0).choices[0].text
    assert by_ids == by_text
    two = client.completions.create(model="tiny", prompt=[ids, ids[:1]], max_tokens=6, temperature=0)
    assert [c.text for c in two.choices][0] == by_text and len(two.choices) == 2
    echoed = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == text + by_text
    assert two.usage.prompt_tokens == 4


@pytest.mark.parametrize("prompt, message", [([5, 64], "token id 64"), ([[5], []], "empty"), ([-1], "token id -1"),
                                             ([1.5], "prompt"), ([True, 2], "prompt")])
def test_bad_token_id_prompts_are_a_400_naming_the_prompt(server, prompt, message):
    response = post(server, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 2})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].startswith("prompt") and message in error["message"]


def test_tokenizer_routes_round_trip_and_need_the_key(server, bdlm_folder):
    ids = post(server, "/tokenize", {"prompt": "w9 w10 w11"}).json()
    assert ids["tokens"] == [9, 10, 11] and ids["count"] == 3 and ids["max_model_len"] == CONTEXT
    assert post(server, "/detokenize", {"tokens": [9, 10, 11]}).json() == {"prompt": "w9 w10 w11"}
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "w9"}]}).json()["tokens"]
    assert chat == Engine.from_pretrained(bdlm_folder, name="tiny").chat_prompt([{"role": "user", "content": "w9"}])
    info = httpx.get(server.base_url.removesuffix("/v1") + "/tokenizer_info",
                     headers={"Authorization": f"Bearer {KEY}"}).json()
    assert info["eos_token"] == "</s>" and info["chat_template"] and info["model_max_length"] == CONTEXT
    assert post(server, "/tokenize", {"prompt": "w9"}, key="nope").status_code == 401
    assert post(server, "/detokenize", {"tokens": [999]}).status_code == 400


def test_logprobs_are_a_400_that_points_to_the_bdlm_model_type(server):
    body = {"model": "tiny", "prompt": [9, 10, 11], "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    response = post(server, "/v1/completions", body)  # what lm-eval's local-completions sends for a likelihood
    assert response.status_code == 400
    assert "--model bdlm" in response.json()["error"]["message"]


# --- lm-eval against the server --------------------------------------------------------------------------------------


def _evaluate(model: str, model_args: str, tmp_path, monkeypatch, **kwargs) -> dict:
    lm_eval = pytest.importorskip("lm_eval", reason="needs lm-eval (dev / lmeval extra)")
    from lm_eval.tasks import TaskManager

    for key, value in {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OPENAI_API_KEY": KEY,
                       "HF_DATASETS_CACHE": str(tmp_path / "datasets")}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(TASKS)
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["bdlm_count_gen"], log_samples=True,
                                   task_manager=TaskManager(include_path=str(TASKS), include_defaults=False), **kwargs)


def _generations(out: dict) -> list[str]:
    return [row["resps"][0][0] for row in sorted(out["samples"]["bdlm_count_gen"], key=lambda r: r["doc_id"])]


def test_lm_eval_local_completions_with_its_defaults_generates_what_model_bdlm_generates(
        server, bdlm_folder, tmp_path, monkeypatch):
    from hf_bdlm.evaluation.lm_eval_model import HFBDLMEvalModel

    remote = _evaluate("local-completions", f"model=tiny,base_url={server.base_url}/completions,auth_token={KEY}",
                       tmp_path, monkeypatch)
    assert remote["results"]["bdlm_count_gen"]["sample_len"] == 6
    local = _evaluate(HFBDLMEvalModel(pretrained=str(bdlm_folder), batch_size=8), "", tmp_path, monkeypatch)
    assert _generations(remote) == _generations(local)
    assert all(len(text.split()) == 4 for text in _generations(remote))  # max_gen_toks


def test_lm_eval_local_chat_completions_runs_a_generation_task(server, tmp_path, monkeypatch):
    out = _evaluate("local-chat-completions", f"model=tiny,base_url={server.base_url}/chat/completions", tmp_path,
                    monkeypatch, apply_chat_template=True)
    texts = _generations(out)
    assert len(texts) == 6 and all(0 < len(text.split()) <= 4 for text in texts)
    assert 0.0 <= out["results"]["bdlm_count_gen"]["exact_match,none"] <= 1.0


# --- terminus-2 through LiteLLM ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def litellm():
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of the price list
    return pytest.importorskip("litellm", reason="needs LiteLLM (dev extra)")


TERMINAL_PROMPT = ("You are an AI assistant solving command-line tasks in a Linux environment. Answer in JSON with "
                   "the fields analysis, plan, commands (keystrokes and duration) and task_complete.\n\nTask: w9 w10 "
                   "w11\n\nCurrent terminal state:\nroot@box:/app# ")


@pytest.mark.parametrize("family", families_with_role("serving"))
def test_terminus_2_requests_through_litellm(family, server, dg_server, litellm):
    served, name = for_family({"block_diffusion": (server, "tiny"), "diffusion_gemma": (dg_server, "tiny-dg")}, family)
    common = dict(model=f"openai/{name}", api_base=served.base_url, api_key=KEY, drop_params=True)
    session = {"extra_body": {"session_id": "trial-1"}, "extra_headers": {"X-Session-ID": "trial-1"}}
    history = [{"role": "user", "content": TERMINAL_PROMPT}]
    first = litellm.completion(messages=history, **common, **session)  # no temperature, no max_tokens: defaults
    reply = first.choices[0]
    assert isinstance(reply.message.content, str) and reply.finish_reason in ("stop", "length")
    assert first.usage.completion_tokens <= 8  # the server's default_max_tokens
    history += [{"role": "assistant", "content": reply.message.content},
                {"role": "user", "content": "New terminal output:\nw12 w13\nroot@box:/app# "}]
    second = litellm.completion(messages=history, temperature=0.7, seed=3, **common, **session)
    assert isinstance(second.choices[0].message.content, str)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    # Other harbor agents: a system message and stop strings.
    third = litellm.completion(messages=[{"role": "system", "content": "You run shell commands."},
                                         {"role": "user", "content": "w9 w10"}], stop=["w30", "</cmd>"],
                               max_tokens=8, **common)
    assert "w30" not in third.choices[0].message.content
    # A full context: LiteLLM raises its ContextWindowExceededError, whose text harbor recognises ("maximum context
    # length"), and terminus-2 unwinds its history.
    with pytest.raises(litellm.exceptions.ContextWindowExceededError) as err:
        litellm.completion(messages=[{"role": "user", "content": "w9 " * 300}], **common)
    assert "maximum context length" in str(err.value).lower()
