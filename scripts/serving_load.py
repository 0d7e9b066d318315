"""`hf-bdlm serve` under load, then stopped while it works: a real server process on 127.0.0.1, a tiny checkpoint.

1. load: ``--requests`` requests from ``--clients`` concurrent asyncio clients (httpx), in a fixed random mix: chat
   answers whole and streamed, text completions, prompts of 2 to 200 words and 8 to 64 new tokens, streams the client
   drops after the first block, and malformed requests (bad JSON, missing or mistyped fields, an unknown model, too
   large a ``max_tokens``). A 429 is retried after its ``Retry-After`` (at most 5 times). Reported: status codes per
   kind, any 5xx of a valid request, whether every 429 carried ``Retry-After``, latency p50 / p99 and time to first
   block, generated tokens/s, the server's resident memory before (after a warm-up) and after (idle again);
2. stop: ``--in-flight`` streamed requests, SIGTERM once they all stream; when new connections are refused, whether
   the streams finish whole, the exit status and the seconds to exit.

    python scripts/serving_load.py --out benchmarks/results/serving_load/load.json

The checkpoint is the serving tests' tiny random model (tests/tiny_bdlm.py: 2 layers, hidden 32, block 4, a
word-level tokenizer), decoded in float32 on the CPU: the server's machinery is measured, not a model's speed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("chat", "chat_stream", "completion", "disconnect", "malformed")
WEIGHTS = (0.40, 0.25, 0.10, 0.10, 0.15)
MALFORMED = (
    ("not JSON", b"{this is not json", 400),
    ("no model", {"messages": [{"role": "user", "content": "w9"}]}, 400),
    ("messages a string", {"model": "tiny", "messages": "w9 w10"}, 400),
    ("unknown model", {"model": "other", "messages": [{"role": "user", "content": "w9"}]}, 404),
    ("max_tokens too large", {"model": "tiny", "messages": [{"role": "user", "content": "w9"}], "max_tokens": 10**6},
     400),
)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def start_server(folder: Path, port: int, grace: float, batch: int, queue: int, log: Path) -> subprocess.Popen:
    cli = Path(sys.executable).with_name("hf-bdlm")
    proc = subprocess.Popen([str(cli), "serve", str(folder), "--port", str(port), "--served-model-name", "tiny",
                             "--max-batch-size", str(batch), "--max-queue", str(queue), "--shutdown-grace-seconds",
                             str(grace)], stdout=open(log, "w"), stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the server did not start within 180 s")


def plan(n: int, seed: int) -> list[dict]:
    """The fixed mix of requests."""
    rng = random.Random(seed)
    requests = []
    for i in range(n):
        kind = rng.choices(KINDS, WEIGHTS)[0]
        words = " ".join(f"w{rng.randrange(7, 63)}" for _ in range(rng.choice((2, 10, 50, 200))))
        tokens = rng.choice((8, 16, 32, 64))
        if kind == "malformed":
            name, body, status = MALFORMED[i % len(MALFORMED)]
            requests.append({"kind": kind, "name": name, "body": body, "expect": status})
        elif kind == "completion":
            requests.append({"kind": kind, "body": {"model": "tiny", "prompt": words, "max_tokens": tokens,
                                                    "temperature": 0, "ignore_eos": True}})
        else:
            requests.append({"kind": kind, "body": {"model": "tiny", "messages": [{"role": "user", "content": words}],
                                                    "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                                                    "stream": kind != "chat"}})
    return requests


async def one(client: httpx.AsyncClient, request: dict) -> dict:
    kind, body = request["kind"], request["body"]
    path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
    out = {"kind": kind, "tries": 0, "retry_after": []}
    for _ in range(6):
        out["tries"] += 1
        start = time.perf_counter()
        if isinstance(body, bytes):
            answer = await client.post(path, content=body, headers={"content-type": "application/json"})
        elif not body.get("stream"):
            answer = await client.post(path, json=body)
        else:
            async with client.stream("POST", path, json=body) as answer:
                if answer.status_code == 200:
                    blocks, first = 0, None
                    async for line in answer.aiter_lines():
                        if line.startswith("data: {") and '"content"' in line and first is None:
                            first = time.perf_counter() - start
                        blocks += line.startswith("data: {")
                        if kind == "disconnect" and first is not None:
                            break  # the client goes away mid-answer: the context manager closes the connection
                    out.update(status=200, seconds=time.perf_counter() - start, first_block=first, chunks=blocks,
                               tokens=0 if kind == "disconnect" else body["max_tokens"])
                    return out
                await answer.aread()
        if answer.status_code == 429:
            out["retry_after"].append(answer.headers.get("retry-after"))
            await asyncio.sleep(float(answer.headers.get("retry-after") or 1))
            continue
        out.update(status=answer.status_code, seconds=time.perf_counter() - start)
        if answer.status_code == 200:
            out["tokens"] = answer.json()["usage"]["completion_tokens"]
        if kind == "malformed":
            out.update(expected=request["expect"], name=request["name"])
        return out
    out.update(status=429, seconds=None)
    return out


async def load(url: str, requests: list[dict], clients: int) -> tuple[list[dict], float]:
    queue: asyncio.Queue = asyncio.Queue()
    for request in requests:
        queue.put_nowait(request)
    results: list[dict] = []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async def worker():
        async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
            while not queue.empty():
                results.append(await one(client, queue.get_nowait()))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return results, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def wait_idle(url: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = httpx.get(f"{url}/health", timeout=5).json()
        if health["queued"] == 0 and health["running"] == 0:
            return health
        time.sleep(0.1)
    raise RuntimeError("the server did not become idle")


def summarize(results: list[dict], seconds: float) -> dict:
    by_kind = {k: {} for k in KINDS}
    for r in results:
        by_kind[r["kind"]][str(r["status"])] = by_kind[r["kind"]].get(str(r["status"]), 0) + 1
    valid = [r for r in results if r["kind"] != "malformed"]
    answered = [r for r in valid if r["status"] == 200 and r["kind"] != "disconnect"]
    retry_after = [v for r in results for v in r["retry_after"]]
    first_blocks = [r["first_block"] for r in valid if r.get("first_block") is not None]
    tokens = sum(r.get("tokens", 0) for r in answered)
    return {
        "seconds": round(seconds, 2),
        "status_by_kind": by_kind,
        "valid_5xx": sum(1 for r in valid if r["status"] is not None and r["status"] >= 500),
        "valid_not_answered": sum(1 for r in valid if r["status"] != 200),
        "malformed_answered_as_expected": sum(1 for r in results if r["kind"] == "malformed"
                                              and r["status"] == r["expected"]),
        "malformed": sum(1 for r in results if r["kind"] == "malformed"),
        "responses_429": len(retry_after),
        "responses_429_with_retry_after": sum(1 for v in retry_after if v is not None and v.isdigit()),
        "retry_after_values": sorted({int(v) for v in retry_after if v and v.isdigit()}),
        "latency_s": {"p50": percentile([r["seconds"] for r in answered], 0.5),
                      "p99": percentile([r["seconds"] for r in answered], 0.99)},
        "first_block_s": {"p50": percentile(first_blocks, 0.5), "p99": percentile(first_blocks, 0.99)},
        "generated_tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 1),
    }


def stop_while_streaming(url: str, proc: subprocess.Popen, in_flight: int, tokens: int) -> dict:
    """SIGTERM once ``in_flight`` streams are running; what the clients and the process do."""
    async def run() -> dict:
        started = asyncio.Event()
        streaming = []

        async def stream(client):
            body = {"model": "tiny", "messages": [{"role": "user", "content": "w9 w10"}], "max_tokens": tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            usage, done = None, False
            try:
                async with client.stream("POST", "/v1/chat/completions", json=body) as answer:
                    async for line in answer.aiter_lines():
                        if line.startswith("data: {") and len(streaming) < in_flight and '"content"' in line:
                            streaming.append(1)
                            if len(streaming) == in_flight:
                                started.set()
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("data: {") and '"usage": {' in line:
                            usage = json.loads(line[6:])["usage"]
                return {"status": answer.status_code, "done": done,
                        "tokens": usage["completion_tokens"] if usage else None}
            except httpx.TransportError as err:
                return {"status": None, "error": type(err).__name__}

        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            tasks = [asyncio.create_task(stream(client)) for _ in range(in_flight)]
            await asyncio.wait_for(started.wait(), 120)
            proc.send_signal(signal.SIGTERM)
            stopped = time.monotonic()
            refused = None
            while refused is None and time.monotonic() - stopped < 10:
                try:
                    async with httpx.AsyncClient(base_url=url, timeout=2) as fresh:
                        await fresh.get("/health")
                except httpx.ConnectError:
                    refused = time.monotonic() - stopped
                await asyncio.sleep(0.02)
            results = await asyncio.gather(*tasks)
            streams_done = time.monotonic() - stopped
        code = await asyncio.to_thread(proc.wait, 120)
        return {"in_flight": in_flight, "max_tokens": tokens, "refused_after_s": round(refused, 3),
                "streams_finished_whole": sum(r["status"] == 200 and r.get("done") and r.get("tokens") == tokens
                                              for r in results),
                "streams_finished_after_s": round(streams_done, 2), "exit_code": code,
                "exit_after_s": round(time.monotonic() - stopped, 2)}

    return asyncio.run(run())


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=500)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--batch", type=int, default=8, help="the server's --max-batch-size")
    p.add_argument("--queue", type=int, default=32, help="the server's --max-queue")
    p.add_argument("--grace", type=float, default=25.0, help="the server's --shutdown-grace-seconds")
    p.add_argument("--in-flight", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    return p


def main(argv=None) -> dict:
    args = make_parser().parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_bdlm import save_tiny_bdlm

    from hf_bdlm.serving.server import free_port

    with tempfile.TemporaryDirectory() as tmp:
        folder = save_tiny_bdlm(Path(tmp) / "tiny", context=1024)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = Path(tmp) / "server.log"
        proc = start_server(folder, port, args.grace, args.batch, args.queue, log)
        try:
            warm, _ = asyncio.run(load(url, plan(2 * args.batch, args.seed + 1), args.batch))
            wait_idle(url)
            rss_before = rss_bytes(proc.pid)
            results, seconds = asyncio.run(load(url, plan(args.requests, args.seed), args.clients))
            health = wait_idle(url)
            time.sleep(1.0)
            rss_after = rss_bytes(proc.pid)
            summary = summarize(results, seconds)
            stop = stop_while_streaming(url, proc, args.in_flight, 64)
            stop["server_log_tail"] = log.read_text().splitlines()[-8:]
        finally:
            if proc.poll() is None:
                proc.kill()
    record = {
        "command": "python scripts/serving_load.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_average": os.getloadavg()},
        "server": {"max_batch_size": args.batch, "max_queue": args.queue, "shutdown_grace_s": args.grace,
                   "model": "tests/tiny_bdlm.py (float32, block 4)"},
        "load": {"requests": args.requests, "clients": args.clients, "mix": dict(zip(KINDS, WEIGHTS)), **summary,
                 "server_counters": health,
                 "rss_before_mb": round(rss_before / 2**20, 1), "rss_after_mb": round(rss_after / 2**20, 1),
                 "rss_growth": round(rss_after / rss_before - 1, 4)},
        "stop": stop,
    }
    text = json.dumps(record, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return record


if __name__ == "__main__":
    main()
