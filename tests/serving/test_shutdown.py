"""`hf-bdlm serve` stopped by SIGTERM while requests run (a real server process on 127.0.0.1, a tiny checkpoint).

What a Kubernetes rollout or `systemctl stop` does to it: new connections are refused at once (uvicorn closes its
listening socket; clients and load balancers retry elsewhere), the requests in flight finish whole (streamed or not),
and the process exits 0. With a grace period shorter than the work in flight (`--shutdown-grace-seconds`), what still
runs at 0.8 of it is answered 503 with `Retry-After` (a stream: an error chunk, then `[DONE]`) and the process exits 0
within the grace period and the interpreter's exit.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi", reason="the server needs fastapi and uvicorn (serve extra)")

from hf_bdlm.serving.server import free_port  # noqa: E402
from tiny_bdlm import save_tiny_bdlm  # noqa: E402

HF_BDLM = Path(sys.executable).with_name("hf-bdlm")
PROMPT = [{"role": "user", "content": "w9 w10 w11"}]
# Four requests of 960 tokens finish within the 25 s grace period (3.7 s past the stop on an idle 2-core machine), and
# most of them outlast the 2 s one.
TOKENS = LONG_TOKENS = 960
CUT_GRACE_S = 2.0
GRACE_MARGIN_S = 5.0  # past the grace period: uvicorn's 0.1 s ticks, the worker's stop, the interpreter's exit


def _start(folder: Path, grace: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([str(HF_BDLM), "serve", str(folder), "--port", str(port), "--max-batch-size", "4",
                             "--served-model-name", "tiny", "--shutdown-grace-seconds", str(grace)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"hf-bdlm serve exited with {proc.returncode}:\n{proc.stdout.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("hf-bdlm serve did not start within 180 s")


def _request(url: str, stream: bool, tokens: int, started) -> dict:
    body = {"model": "tiny", "messages": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": stream}
    try:
        if not stream:
            started()
            answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
            if answer.status_code != 200:
                return {"status": answer.status_code, "code": answer.json()["error"]["code"],
                        "retry_after": answer.headers.get("retry-after")}
            return {"status": answer.status_code, "tokens": answer.json()["usage"]["completion_tokens"],
                    "finish": answer.json()["choices"][0]["finish_reason"]}
        body["stream_options"] = {"include_usage": True}
        chunks, done = [], False
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as answer:
            for line in answer.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunks.append(json.loads(line[6:]))
                    if len(chunks) == 2:  # the role, then the first decoded block: in flight
                        started()
        usage = next((c["usage"] for c in chunks if c.get("usage")), None)
        finish = next((c["choices"][0]["finish_reason"] for c in chunks if c.get("choices") and
                       c["choices"][0].get("finish_reason")), None)
        error = next((c["error"]["code"] for c in chunks if c.get("error")), None)
        return {"status": answer.status_code, "tokens": usage and usage["completion_tokens"], "finish": finish,
                "done": done, "error": error}
    except httpx.TransportError as err:  # the connection cut
        return {"status": None, "error": type(err).__name__}


def _timed(*args) -> tuple[dict, float]:
    """`_request` and when its answer ended."""
    result = _request(*args)
    return result, time.monotonic()


def _stop_while_running(folder: Path, grace: float, tokens: int) -> dict:
    proc, url = _start(folder, grace)
    in_flight = concurrent.futures.ThreadPoolExecutor(4)
    started = []
    futures = [in_flight.submit(_timed, url, stream, tokens, lambda: started.append(1))
               for stream in (True, True, False, False)]
    deadline = time.monotonic() + 60
    while len(started) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)  # the plain requests' jobs are queued or decoding too
    proc.send_signal(signal.SIGTERM)
    stopped = time.monotonic()
    host, port = url.removeprefix("http://").split(":")
    refused_after = None
    while refused_after is None and time.monotonic() - stopped < 5:
        try:  # a bare TCP connect: an HTTP request accepted just before the close would wait for its own answer
            socket.create_connection((host, int(port)), timeout=1).close()
        except ConnectionRefusedError:
            refused_after = time.monotonic() - stopped
        time.sleep(0.02)
    results = [f.result(timeout=180) for f in futures]
    last_answer = max(ended for _, ended in results) - stopped
    results = [result for result, _ in results]
    code = proc.wait(timeout=grace + 60)
    return {"results": results, "code": code, "refused_after": refused_after, "last_answer": last_answer,
            "exit_after": time.monotonic() - stopped, "log": proc.stdout.read()}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return save_tiny_bdlm(tmp_path_factory.mktemp("tiny") / "tiny", context=1024)


@pytest.fixture(scope="module")
def stops(folder):
    # Both servers at once: each waits on its own requests most of the time.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        drained = pool.submit(_stop_while_running, folder, 25.0, TOKENS)
        cut = pool.submit(_stop_while_running, folder, CUT_GRACE_S, LONG_TOKENS)
        return {"drained": drained.result(), "cut": cut.result()}


def test_sigterm_refuses_new_connections_at_once(stops):
    # "At once": while the requests in flight still run, not after the drain. How soon in seconds depends on the
    # machine's load (0.1-0.3 s idle, 1.8 s seen with both servers decoding on 2 busy cores), so the bound is the drain.
    for stop in stops.values():
        assert stop["refused_after"] is not None, stop["log"][-3000:]
        assert stop["refused_after"] < stop["last_answer"], (stop["refused_after"], stop["last_answer"])


def test_requests_in_flight_finish_whole_and_the_server_exits_0(stops):
    stop = stops["drained"]
    assert stop["code"] == 0, stop["log"][-3000:]
    for result in stop["results"]:
        assert result["status"] == 200 and result["tokens"] == TOKENS and result["finish"] == "length", result
        assert result.get("done", True)  # a stream ends with its [DONE]
    assert "Waiting for connections to close" in stop["log"] or "Shutting down" in stop["log"]


def test_past_the_grace_period_the_rest_is_answered_503_and_the_server_still_exits_0(stops):
    stop = stops["cut"]
    assert stop["code"] == 0, stop["log"][-3000:]
    assert stop["exit_after"] <= CUT_GRACE_S + GRACE_MARGIN_S, stop["exit_after"]
    shed = 0
    for result in stop["results"]:  # at 0.8 of the grace period: a 503 to retry elsewhere, never a cut or a 500
        if result.get("tokens") == LONG_TOKENS:  # finished before then
            assert result["status"] == 200 and result["finish"] == "length", result
        elif result.get("done") is not None:  # a stream: its headers were sent; the error comes as its last chunk
            assert result["status"] == 200 and result["done"] and result["error"] == "service_unavailable", result
            shed += 1
        else:
            assert result == {"status": 503, "code": "service_unavailable", "retry_after": "1"}, result
            shed += 1
    assert shed >= 2, stop["results"]  # the work in flight outlasts the grace period
