"""The OpenAI-compatible server, driven by the official `openai` client against a real uvicorn server on 127.0.0.1.

A tiny random block-diffusion checkpoint (float64, block size 4, context 256) is saved, loaded by `Engine` and
served in a background thread. Covered: models, chat and text completions, SSE streaming (one chunk per block),
stop strings, block-diffusion knobs, usage, batching of concurrent requests, every bad input of the spec (4xx in
OpenAI's error shape, server alive afterwards), a full queue (429), client disconnects, a failing batch.
Run: python -m pytest tests/serving/test_server.py -q
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import httpx
import pytest
import torch

openai = pytest.importorskip("openai", reason="the serving tests need the openai client (dev extra)")
pytest.importorskip("fastapi", reason="the serving tests need fastapi and uvicorn (serve extra)")

from fixtures import API_KEY  # noqa: E402
from hf_bdlm.serving import ServerConfig, ServerThread  # noqa: E402
from hf_bdlm.serving.scheduler import BatchScheduler, Job, QueueFull, TextStream  # noqa: E402
from tiny_bdlm import BLOCK, CONTEXT, save_tiny_bdlm  # noqa: E402

KEY = API_KEY
PROMPT = [{"role": "user", "content": "w9 w10 w11"}]
# The module's server (tests/serving/conftest.py: engine, server, client).
SERVER = dict(max_batch_size=4, max_queue=16, batch_wait_ms=50, max_body_bytes=20_000, max_tokens_limit=64,
              default_max_tokens=8)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return dict(path=save_tiny_bdlm(tmp_path_factory.mktemp("tiny-bdlm")), name="tiny", dtype=torch.float64)


def raw(server, path="/chat/completions", body=None, content=None, key=KEY, method="POST"):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if content is None and body is not None:
        content = json.dumps(body)
    return httpx.request(method, server.base_url + path, content=content, headers=headers, timeout=30)


def chat(client, **kwargs):
    return client.chat.completions.create(model="tiny", messages=PROMPT, **kwargs)


# --- what the client sees ---------------------------------------------------------------------


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert client.models.retrieve("tiny").owned_by == "hf-bdlm"


def test_chat_completion_returns_text_and_usage(client, engine):
    out = chat(client, max_tokens=12, temperature=0)
    assert out.object == "chat.completion" and out.model == "tiny"
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant" and choice.message.content
    prompt_ids = engine.chat_prompt(PROMPT)
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == 12 and out.usage.total_tokens == len(prompt_ids) + 12
    assert not out.usage.model_extra  # OpenAI's three counts; a drafter's acceptance only with --draft


def test_streaming_sends_one_chunk_per_decoded_block_and_the_same_text(client):
    full = chat(client, max_tokens=12, temperature=0).choices[0].message.content
    chunks = list(chat(client, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(texts) == 12 // BLOCK  # the prompt ends on a block boundary here: 3 blocks of 4 tokens
    assert "".join(texts) == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12


def test_stop_string_cuts_the_text_and_finishes_with_stop(client):
    words = chat(client, max_tokens=12, temperature=0).choices[0].message.content.split()
    stop = words[5]
    first = words.index(stop)
    out = chat(client, max_tokens=12, temperature=0, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content.split() == words[:first]
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(client, max_tokens=12, temperature=0,
                                                                       stop=stop, stream=True) if c.choices)
    assert streamed == out.choices[0].message.content


def test_text_completions_plain_streaming_and_echo(client):
    out = client.completions.create(model="tiny", prompt="w20 w21 w22", max_tokens=6, temperature=0)
    assert out.object == "text_completion" and out.usage.completion_tokens == 6
    text = out.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="w20 w21 w22", max_tokens=6, temperature=0, stream=True) if c.choices)
    assert streamed == text
    echoed = client.completions.create(model="tiny", prompt="w20 w21 w22", max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == "w20 w21 w22" + text
    two = client.completions.create(model="tiny", prompt=["w20 w21 w22", "w30"], max_tokens=6, temperature=0)
    assert [c.index for c in two.choices] == [0, 1] and two.choices[0].text == text


def test_block_diffusion_knobs_are_extra_body_fields(client):
    for extra in ({"steps_per_block": 1}, {"confidence_threshold": 0.5}, {"steps_per_block": BLOCK,
                                                                           "confidence_threshold": 1.0}):
        out = chat(client, max_tokens=8, temperature=0, extra_body=extra)
        assert out.usage.completion_tokens == 8
    with pytest.raises(openai.BadRequestError, match="confidence_threshold"):
        chat(client, max_tokens=8, extra_body={"confidence_threshold": 5})


def test_seeded_sampling_is_reproducible(client):
    texts = {chat(client, max_tokens=8, temperature=1.5, top_p=0.9, seed=7).choices[0].message.content
             for _ in range(2)}
    assert len(texts) == 1


# --- batching ------------------------------------------------------------------------------------


def test_concurrent_requests_are_decoded_in_one_batch_with_the_same_results(client, server):
    prompts = [[{"role": "user", "content": " ".join(f"w{7 + (i * 5 + j) % 50}" for j in range(n))}]
               for i, n in enumerate((1, 3, 6, 9))]  # ragged: the prompts end in different places of a block
    alone = [client.chat.completions.create(model="tiny", messages=p, max_tokens=9, temperature=0)
             .choices[0].message.content for p in prompts]
    stats = server.app.state.scheduler.stats
    batches_before = stats.batches
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda p: client.chat.completions.create(
            model="tiny", messages=p, max_tokens=9, temperature=0).choices[0].message.content, prompts))
    assert together == alone
    assert stats.batches - batches_before < len(prompts)  # at least two requests shared a batch
    assert stats.largest_batch >= 2


# --- bad input ----------------------------------------------------------------------------------


BAD_REQUESTS = {
    "malformed json": (dict(content=b'{"model": "tiny", "messages": ['), 400, None),
    "body not an object": (dict(body=[1, 2]), 400, None),
    "messages missing": (dict(body={"model": "tiny"}), 400, "messages"),
    "max_tokens wrong type": (dict(body={"model": "tiny", "messages": PROMPT, "max_tokens": "many"}), 400,
                              "max_tokens"),
    "stream wrong type": (dict(body={"model": "tiny", "messages": PROMPT, "stream": "yes"}), 400, "stream"),
    "bad role": (dict(body={"model": "tiny", "messages": [{"role": "robot", "content": "w9"}]}), 400, None),
    "image part": (dict(body={"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}), 400, "messages"),
    "n > 1": (dict(body={"model": "tiny", "messages": PROMPT, "n": 2}), 400, "n"),
    "tools": (dict(body={"model": "tiny", "messages": PROMPT, "tools": [{"type": "function"}]}), 400, "tools"),
    "temperature out of range": (dict(body={"model": "tiny", "messages": PROMPT, "temperature": 9}), 400,
                                 "temperature"),
    "unknown model": (dict(body={"model": "gpt-9", "messages": PROMPT}), 404, "model"),
    "max_tokens over the limit": (dict(body={"model": "tiny", "messages": PROMPT, "max_tokens": 65}), 400,
                                  "max_tokens"),
    "context overflow": (dict(body={"model": "tiny", "messages": [{"role": "user", "content": "w9 " * CONTEXT}]}),
                         400, "messages"),
    "prompt + max_tokens overflow": (dict(body={"model": "tiny", "messages": [
        {"role": "user", "content": "w9 " * (CONTEXT - 40)}], "max_tokens": 60}), 400, "max_tokens"),
    "body too large": (dict(body={"model": "tiny", "messages": [{"role": "user", "content": "w9 " * 10_000}]}),
                       413, None),
    "no api key": (dict(body={"model": "tiny", "messages": PROMPT}, key=None), 401, None),
    "wrong api key": (dict(body={"model": "tiny", "messages": PROMPT}, key="nope"), 401, None),
    "unknown route": (dict(path="/embeddings", body={}), 404, None),
    "wrong method": (dict(path="/chat/completions", method="GET"), 405, None),
    "empty completion prompt": (dict(path="/completions", body={"model": "tiny", "prompt": []}), 400, "prompt"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_input_is_a_4xx_in_openai_error_shape(server, case):
    kwargs, status, param = BAD_REQUESTS[case]
    response = raw(server, **kwargs)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if param:
        assert error["param"].startswith(param), error
    assert raw(server, body={"model": "tiny", "messages": PROMPT, "max_tokens": 2}).status_code == 200


def test_context_overflow_and_auth_errors_map_to_openai_exceptions(server):
    unauthorized = openai.OpenAI(base_url=server.base_url, api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        unauthorized.models.list()
    client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w9 " * CONTEXT}])
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=PROMPT)


def test_full_queue_answers_429_and_the_server_keeps_serving(engine):
    config = ServerConfig(port=0, max_batch_size=1, max_queue=2, batch_wait_ms=0)
    with ServerThread(engine, config) as running:
        client = openai.OpenAI(base_url=running.base_url, api_key="unused", max_retries=0, timeout=120)

        retry_after = []

        def one(_):
            try:
                chat(client, max_tokens=40, temperature=0)
                return 200
            except openai.RateLimitError as err:
                retry_after.append(err.response.headers.get("retry-after"))
                return 429

        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            codes = list(pool.map(one, range(12)))
        assert codes.count(429) >= 1 and codes.count(200) >= 3, codes
        # Every 429 says when to come back: whole seconds (RFC 9110), the queue ahead at the recent batch duration.
        assert len(retry_after) == codes.count(429) and all(v is not None and v.isdigit() and int(v) >= 1
                                                             for v in retry_after), retry_after
        assert chat(client, max_tokens=4).usage.completion_tokens == 4
        assert running.app.state.scheduler.stats.rejected == codes.count(429)


def _wait_idle(scheduler, timeout=30):
    deadline = time.monotonic() + timeout
    while (scheduler.running or scheduler.queued) and time.monotonic() < deadline:
        time.sleep(0.05)


def test_client_disconnect_cancels_its_generation(server, engine):
    scheduler = server.app.state.scheduler
    _wait_idle(scheduler)
    cancelled, jobs = scheduler.stats.cancelled, scheduler.stats.jobs
    # 20 ms per forward: a 64-token answer at one token per step takes 80 forwards (64 steps + 16 blocks)
    forwards = []

    def slow_forward(module, args):
        forwards.append(1)
        time.sleep(0.02)

    slow = engine.model.register_forward_pre_hook(slow_forward)
    body = {"model": "tiny", "messages": PROMPT, "max_tokens": 64, "stream": True,
            "steps_per_block": BLOCK, "confidence_threshold": 1.0}
    headers = {"Authorization": f"Bearer {KEY}"}
    try:
        with httpx.stream("POST", server.base_url + "/chat/completions", json=body, headers=headers,
                          timeout=30) as response:
            for line in response.iter_lines():
                if '"content": "w' in line:
                    break  # the first decoded block arrived: hang up
        _wait_idle(scheduler)
        assert scheduler.stats.cancelled == cancelled + 1
        assert len(forwards) < 40  # stopped at a block boundary, not after 64 tokens
        forwards.clear()
        # a non-streaming request whose client gives up is cancelled as well
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.base_url + "/chat/completions", json={**body, "stream": False}, headers=headers,
                       timeout=0.3)
        _wait_idle(scheduler)
        assert scheduler.stats.cancelled == cancelled + 2 and scheduler.stats.jobs == jobs + 2
        assert len(forwards) < 80
    finally:
        slow.remove()


# --- the scheduler alone ------------------------------------------------------------------------


class _Words:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids)


def _job(key="k") -> Job:
    return Job(prompt_ids=[1], max_tokens=4, settings=None, stream=TextStream(_Words(), []), batch_key=key)


def test_a_failing_batch_fails_its_jobs_and_the_worker_goes_on():
    calls = []

    def run_batch(jobs):
        calls.append(len(jobs))
        if len(calls) == 1:
            raise RuntimeError("boom")
        for job in jobs:
            job.finish("length")

    scheduler = BatchScheduler(run_batch, max_batch_size=2, max_queue=4, batch_wait_s=0)
    first, second = _job(), _job()
    scheduler.start()
    try:
        scheduler.submit([first])
        while not first.finished:
            time.sleep(0.01)
        scheduler.submit([second])
        while not second.finished:
            time.sleep(0.01)
    finally:
        scheduler.stop()
    assert first.finish_reason == "error" and second.finish_reason == "length"
    assert scheduler.stats.failed_batches == 1


def test_scheduler_batches_only_compatible_jobs_and_bounds_its_queue():
    gate = threading.Event()
    batches = []

    def run_batch(jobs):
        gate.wait(5)
        batches.append([j.batch_key for j in jobs])
        for job in jobs:
            job.finish("length")

    scheduler = BatchScheduler(run_batch, max_batch_size=3, max_queue=4, batch_wait_s=0)
    jobs = [_job("a"), _job("b"), _job("a"), _job("a"), _job("a")]
    scheduler.submit(jobs[:4])
    with pytest.raises(QueueFull):
        scheduler.submit(jobs[4:])
    scheduler.start()
    gate.set()
    try:
        while not all(j.finished for j in jobs[:4]):
            time.sleep(0.01)
    finally:
        scheduler.stop()
    assert batches == [["a", "a", "a"], ["b"]]


def test_text_stream_holds_back_a_possible_stop_string():
    stream = TextStream(_Words(), ["cd"])
    assert stream.add([0, 1]) == ("a", False)  # "b" could start "cd"? no, but one char is held back
    assert stream.add([2]) == ("b", False)
    assert stream.add([3, 4]) == ("", True) and stream.text == "ab"
