"""The FastAPI application: OpenAI-compatible routes over an :class:`~hf_bdlm.serving.engine.Engine`.

    from hf_bdlm.serving import Engine, ServerConfig, create_app
    app = create_app(Engine.from_pretrained("path/to/bdlm"), ServerConfig(api_key="secret"))
    # uvicorn.run(app, host="127.0.0.1", port=8000), or: hf-bdlm serve path/to/bdlm

Routes: `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/chat/completions`, `POST /v1/completions` (plain JSON or
SSE streaming with one chunk per decoded block; the prompt as text or token ids), the tokenizer routes vLLM serves
(`POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`: lm-eval's local-completions tokenizes through them by
default), `GET /health` (no key needed; scheduler counters; with a drafter, the acceptance of every request served:
the verification steps, accepted tokens and acceptance length, also in each response's `usage.speculative`). Every error is
OpenAI's JSON error shape; bad input is a 4xx, and a failure inside generation is a 500 for that request only.
Chat `tools` go to the chat template when it renders them (a 400 otherwise) and the answer's tool-call text comes
back as `tool_calls` (hf_bdlm/serving/tools.py); streamed, the calls arrive whole in the last chunks.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..protocols.decoding import AcceptanceCounts
from . import protocol, tools
from .config import ServerConfig
from .engine import Engine
from .protocol import APIError, ChatCompletionRequest, CompletionRequest
from .scheduler import BatchScheduler, Job, QueueFull, ShuttingDown

logger = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.25


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


TOKENIZER_ROUTES = ("/tokenize", "/detokenize", "/tokenizer_info")


class RetryLater(APIError):
    """An error the client should retry, with ``Retry-After`` in whole seconds (at least 1): a 429 (the queue is full:
    the seconds the queue ahead is expected to take) or a 503 (the server is stopping: retry elsewhere)."""

    def __init__(self, status: int, message: str, retry_after_s: float):
        kind = "rate_limit_exceeded" if status == 429 else "service_unavailable"
        super().__init__(status, message, type=kind if status == 429 else "server_error", code=kind)
        self.headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))}


def _stopping(message: str) -> RetryLater:
    return RetryLater(503, f"{message}; retry the request (on another instance).", 1)


class APIKeyMiddleware:
    """Pure ASGI check of `Authorization: Bearer <key>` on `/v1` paths and the tokenizer routes (401 otherwise);
    streams pass untouched."""

    def __init__(self, app, api_key: str):
        self.app, self.api_key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (scope["path"].startswith("/v1") or scope["path"] in TOKENIZER_ROUTES):
            given = dict(scope["headers"]).get(b"authorization", b"")
            token = given[7:] if given[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.api_key):
                err = APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>'.",
                               code="invalid_api_key")
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(engine: Engine, config: ServerConfig | None = None) -> FastAPI:
    """Build the app; the batching scheduler starts and stops with the app's lifespan."""
    config = config or ServerConfig()
    scheduler = BatchScheduler(engine.run_batch, config.max_batch_size, config.max_queue,
                               config.batch_wait_ms / 1000)
    created = int(time.time())
    app = FastAPI(title="hf-bdlm", lifespan=_scheduler_lifespan(scheduler))
    app.state.engine, app.state.scheduler, app.state.config = engine, scheduler, config
    _add_error_handlers(app)
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    _add_info_routes(app, engine, scheduler, created)
    _add_chat_route(app, engine, scheduler, config)
    _add_completion_route(app, engine, scheduler, config)
    _add_tokenizer_routes(app, engine, config)
    return app


# --- the app and its error handlers ----------------------------------------------------------------------------
def _scheduler_lifespan(scheduler: BatchScheduler) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app lifespan that runs the scheduler's worker while the app serves."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop()

    return lifespan


async def _api_error(request: Request, err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=getattr(err, "headers", None))


async def _client_gone(request: Request, err: ClientGone) -> Response:
    return Response(status_code=499)  # nobody reads it; keeps the log free of tracebacks


async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
    return JSONResponse(APIError(err.status_code, str(err.detail)).body(), status_code=err.status_code)


async def _internal_error(request: Request, err: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s", request.url.path)
    return JSONResponse(APIError(500, f"internal error: {type(err).__name__}", type="server_error").body(),
                        status_code=500)


def _add_error_handlers(app: FastAPI) -> None:
    """Answer every error in OpenAI's JSON error shape (a vanished client gets a bare 499)."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(ClientGone, _client_gone)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)


# --- request checks and job submission -------------------------------------------------------------------------
def _check_model(engine: Engine, name: str) -> None:
    """Raise the 404 for a model id this server does not serve."""
    if name != engine.name:
        raise APIError(404, f"the model {name!r} does not exist; this server serves {engine.name!r}.",
                       param="model", code="model_not_found")


async def _read_json(request: Request, max_body_bytes: int) -> Any:
    """The request body parsed as JSON; 413 past `max_body_bytes`, 400 when it is not JSON."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_body_bytes:
        raise APIError(413, f"the request body has {declared} bytes; the limit is {max_body_bytes}.")
    body = bytearray()
    # The declared length may be absent or false: the limit is enforced on what actually arrives too.
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_body_bytes:
            raise APIError(413, f"the request body exceeds the limit of {max_body_bytes} bytes.")
    try:
        return json.loads(bytes(body))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise APIError(400, f"the request body is not valid JSON: {err}") from None


def _build_job(engine: Engine, config: ServerConfig, request: Any, prompt_ids: list[int]) -> Job:
    """A scheduler job for one prompt, with the server's token limits applied."""
    return engine.make_job(request, prompt_ids, config.max_tokens_limit, config.default_max_tokens,
                           config.max_prompt_tokens or engine.context_length - 1)


def _submit(scheduler: BatchScheduler, jobs: list[Job]) -> None:
    """Queue jobs whose events come back on this event loop; a full queue is a 429."""
    loop = asyncio.get_running_loop()
    for job in jobs:
        job.loop, job.events = loop, asyncio.Queue()
    try:
        scheduler.submit(jobs)
    except QueueFull as err:
        wait = scheduler.expected_wait_s()
        raise RetryLater(429, f"the server is busy ({err}); retry in {max(1, math.ceil(wait))} s.", wait) from None
    except ShuttingDown as err:
        raise _stopping(str(err)) from None


# --- routes ------------------------------------------------------------------------------------------------------
def _add_info_routes(app: FastAPI, engine: Engine, scheduler: BatchScheduler, created: int) -> None:
    """`GET /health` (scheduler counters) and the model listing routes."""

    @app.get("/health")
    async def health():
        stats = scheduler.stats
        return {"status": "ok", "model": engine.name, "queued": scheduler.queued, "running": scheduler.running,
                "batches": stats.batches, "requests": stats.jobs, "largest_batch": stats.largest_batch,
                "mean_batch": round(stats.mean_batch, 3), "rejected": stats.rejected, "cancelled": stats.cancelled,
                "failed_batches": stats.failed_batches,
                **({"speculative": engine.acceptance.as_dict()} if engine.acceptance is not None else {})}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [protocol.model_card(engine.name, created)]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        _check_model(engine, model_id)
        return protocol.model_card(engine.name, created)


def _add_chat_route(app: FastAPI, engine: Engine, scheduler: BatchScheduler, config: ServerConfig) -> None:
    """`POST /v1/chat/completions`: one chat prompt, answered whole or streamed; with `tools`, calls parsed."""
    renders_tools = tools.template_renders_tools(engine.tokenizer)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = protocol.parse_request(ChatCompletionRequest, await _read_json(request, config.max_body_bytes))
        _check_model(engine, req.model)
        if req.wants_tools and not renders_tools:
            raise APIError(400, f"model {engine.name!r} cannot take tools: its chat template does not render "
                                "`tools` into the prompt. Describe the tools in the messages instead (a text-based "
                                "agent mode), or serve a model whose template takes `tools`.", param="tools")
        prompt_ids = engine.chat_prompt(req.template_messages(), tools=req.template_tools())
        job = _build_job(engine, config, req, prompt_ids)
        if req.wants_tools:
            job.stream.tokenizer = tools.keep_tool_markers(engine.tokenizer)
        _submit(scheduler, [job])
        rid = protocol.new_id("chatcmpl")
        if req.stream:
            calls = tools.ToolCallStream() if req.wants_tools else None
            return _sse(_chat_events(engine, job, rid, req.include_usage, calls, req.parallel_tool_calls))
        text, finish = await _collect(request, job)
        tool_calls = None
        if req.wants_tools:
            text, parsed = tools.parse_tool_calls(text)
            if parsed:
                parsed = parsed if req.parallel_tool_calls else parsed[:1]
                tool_calls, finish = [c.to_openai() for c in parsed], "tool_calls"
        return protocol.chat_response(rid, engine.name, text, finish, _usage(engine, [job]), tool_calls)


def _add_completion_route(app: FastAPI, engine: Engine, scheduler: BatchScheduler, config: ServerConfig) -> None:
    """`POST /v1/completions`: one or more text prompts answered whole, or a single prompt streamed."""

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = protocol.parse_request(CompletionRequest, await _read_json(request, config.max_body_bytes))
        _check_model(engine, req.model)
        prompts = req.prompts()
        if req.stream and len(prompts) > 1:
            raise APIError(400, "streaming takes a single prompt.", param="prompt")
        if len(prompts) > config.max_batch_size:
            raise APIError(400, f"at most {config.max_batch_size} prompts per request.", param="prompt")
        jobs = [_build_job(engine, config, req, engine.text_prompt(p) if isinstance(p, str) else engine.token_prompt(p))
                for p in prompts]
        texts = [p if isinstance(p, str) else engine.tokenizer.decode(p) for p in prompts]  # what echo returns
        _submit(scheduler, jobs)
        rid = protocol.new_id("cmpl")
        if req.stream:
            echo = texts[0] if req.echo else ""
            return _sse(_completion_events(engine, jobs[0], rid, req.include_usage, echo))
        try:
            results = await asyncio.gather(*(_collect(request, job) for job in jobs))
        finally:
            for job in jobs:  # one failed prompt: the others stop too
                if not job.finished:
                    job.cancelled.set()
        choices = [((p if req.echo else "") + text, finish) for p, (text, finish) in zip(texts, results)]
        return protocol.completion_response(rid, engine.name, choices, _usage(engine, jobs))


def _add_tokenizer_routes(app: FastAPI, engine: Engine, config: ServerConfig) -> None:
    """vLLM's tokenizer routes: `POST /tokenize` (text or chat messages -> ids), `POST /detokenize`,
    `GET /tokenizer_info`. lm-eval's local-completions looks for them to tokenize requests as the server does."""

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = protocol.parse_request(protocol.TokenizeRequest, await _read_json(request, config.max_body_bytes))
        if req.model is not None:
            _check_model(engine, req.model)
        if req.messages is not None:
            ids = engine.chat_prompt([m.for_template(i) for i, m in enumerate(req.messages)])
        else:
            ids = list(engine.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"])
        return {"count": len(ids), "max_model_len": engine.context_length, "tokens": ids, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = protocol.parse_request(protocol.DetokenizeRequest, await _read_json(request, config.max_body_bytes))
        if req.model is not None:
            _check_model(engine, req.model)
        return {"prompt": engine.tokenizer.decode(engine.token_prompt(req.tokens))}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return engine.tokenizer_info()


# --- answers: whole, or streamed as server-sent events ---------------------------------------------------------
async def _collect(request: Request, job: Job) -> tuple[str, str]:
    """Wait for a job's text; a client that disconnects cancels it."""
    parts = []
    checked = time.monotonic()
    try:
        while True:
            try:
                kind, payload = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                kind = None
            if time.monotonic() - checked >= DISCONNECT_POLL_S:  # text may arrive faster than the poll
                checked = time.monotonic()
                if await request.is_disconnected():
                    raise ClientGone
            if kind is None:
                continue
            if kind == "text":
                parts.append(payload)
            elif kind == "done":
                return "".join(parts), payload
            elif kind == "unavailable":
                raise _stopping(payload)
            else:
                raise APIError(500, payload, type="server_error")
    finally:
        if not job.finished:
            job.cancelled.set()


async def _job_events(job: Job) -> AsyncIterator[tuple[str, str]]:
    """A job's `("text", piece)` events, then its `("done", finish_reason)`; a generation error raises a 500."""
    try:
        while True:
            kind, payload = await job.events.get()
            if kind == "error":
                raise APIError(500, payload, type="server_error")
            if kind == "unavailable":
                raise _stopping(payload)
            yield kind, payload
            if kind == "done":
                return
    finally:
        if not job.finished:  # the client went away mid-stream
            job.cancelled.set()


async def _chat_events(engine: Engine, job: Job, rid: str, include_usage: bool,
                       calls: tools.ToolCallStream | None = None, parallel_tool_calls: bool = True,
                       ) -> AsyncIterator[dict]:
    """The chat completion chunks of a streamed job: the role, the text pieces, the finish, optionally usage.

    With `calls`, text that may be a tool call is held back; at the end come the rest of the content, one chunk per
    parsed call (`delta.tool_calls`, whole), and the finish `tool_calls`.
    """
    yield protocol.chat_chunk(rid, engine.name, {"role": "assistant", "content": ""})
    async for kind, payload in _job_events(job):
        if kind == "text":
            text = calls.add(payload) if calls is not None else payload
            if text:
                yield protocol.chat_chunk(rid, engine.name, {"content": text})
            continue
        finish = payload
        if calls is not None:
            rest, parsed = calls.finish()
            if rest:
                yield protocol.chat_chunk(rid, engine.name, {"content": rest})
            for i, call in enumerate(parsed if parallel_tool_calls else parsed[:1]):
                yield protocol.chat_chunk(rid, engine.name, {"tool_calls": [call.to_openai(index=i)]})
            finish = "tool_calls" if parsed else finish
        yield protocol.chat_chunk(rid, engine.name, {}, finish=finish)
    if include_usage:
        yield protocol.chat_chunk(rid, engine.name, {}, usage_=_usage(engine, [job]))


async def _completion_events(engine: Engine, job: Job, rid: str, include_usage: bool,
                             echo: str) -> AsyncIterator[dict]:
    """The text completion chunks of a streamed job: the echo, the text pieces, the finish, optionally usage."""
    if echo:
        yield protocol.completion_chunk(rid, engine.name, echo)
    async for kind, payload in _job_events(job):
        if kind == "text":
            yield protocol.completion_chunk(rid, engine.name, payload)
        else:
            yield protocol.completion_chunk(rid, engine.name, "", finish=payload)
    if include_usage:
        yield protocol.completion_chunk(rid, engine.name, "", usage_=_usage(engine, [job]))


def _usage(engine: Engine, jobs: list[Job]) -> dict:
    """The usage of finished `jobs` (one request's prompts), with a speculative decoder's acceptance over them."""
    speculative = None
    if engine.acceptance is not None:
        counts = AcceptanceCounts()
        for job in jobs:
            counts.merge(job.acceptance)
        speculative = counts.as_dict()
    return protocol.usage(sum(len(j.prompt_ids) for j in jobs), sum(j.completion_tokens for j in jobs), speculative)


def _sse(events: AsyncIterator[dict]) -> StreamingResponse:
    """A server-sent-event response of the given chunks, closed by `data: [DONE]`."""

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n"
        except APIError as err:  # headers are sent already: report the error in the stream
            yield f"data: {json.dumps(err.body())}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
