"""The OpenAI wire format the server speaks: request models (pydantic), response builders, errors.

Only what `/v1/chat/completions`, `/v1/completions`, `/v1/models` and the tokenizer routes (`/tokenize`,
`/detokenize`, `/tokenizer_info`, as vLLM names them) need. Unknown fields are accepted and ignored (clients send
`user`, `stream_options`, penalties, ...); fields we cannot honour (`n > 1`, `logprobs`, a forced `tool_choice`) are
refused with a 400 instead of being silently dropped. A completion prompt is text or token ids (one list of ints, or
a list of them), as OpenAI's API takes it. `tools` go to the chat template (hf_bdlm/serving/tools.py).
Block-diffusion knobs are extra body fields:

    client.chat.completions.create(model=..., messages=..., extra_body={"confidence_threshold": 0.8,
                                                                        "steps_per_block": 4})
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, field_validator

MAX_STOP_STRINGS = 16  # OpenAI takes 4; lm-eval's tasks send their `until` list plus the EOS text


class APIError(Exception):
    """An error returned to the client in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Sampling(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: str | list[str] | None = Field(default=None, validate_default=True)
    seed: int | None = None
    n: int = 1
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    logprobs: Any = None
    # block-diffusion decoding (defaults: the checkpoint's generation config)
    confidence_threshold: float | None = Field(default=None, gt=0.0, le=1.0)
    steps_per_block: int | None = Field(default=None, ge=1)
    block_size: int | None = Field(default=None, ge=1)  # decoding block (a converted BDLM may decode sub-blocks)
    ignore_eos: StrictBool = False  # generate exactly max_tokens (benchmarks), as vLLM's extra field

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value):
        if value is None:
            return []
        stops = [value] if isinstance(value, str) else value
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings")
        return stops

    def check_supported(self) -> None:
        if self.n != 1:
            raise APIError(400, f"n={self.n} is not supported: this server returns one choice per request.", param="n")
        if self.logprobs not in (None, False, 0):
            raise APIError(400, "logprobs are not supported by block-diffusion decoding: a diffusion model gives the "
                                "probability of a text only through a likelihood bound. To score log-likelihoods "
                                "(multiple-choice tasks), run lm-eval with the model type that estimates it: "
                                "`hf-bdlm lm-eval --model bdlm --model_args pretrained=DIR`.", param="logprobs")

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolDefinition(BaseModel):
    """One entry of `tools`: `{"type": "function", "function": {"name", "description", "parameters"}}`."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    function: FunctionDefinition


class FunctionCall(BaseModel):
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = "{}"


class AssistantToolCall(BaseModel):
    """A tool call of an earlier assistant turn, as the client sends it back."""

    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[AssistantToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: the call they answer
    name: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined); other part types are refused."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"unsupported content part of type {part.get('type')!r}: only text is accepted.",
                               param="messages")
            parts.append(part["text"])
        return "".join(parts)

    def for_template(self, index: int) -> dict:
        """The message as chat templates read it; a call's JSON `arguments` become a mapping, as templates expect."""
        message = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [{"id": call.id, "type": "function",
                                      "function": {"name": call.function.name,
                                                   "arguments": _arguments_mapping(call.function.arguments,
                                                                                   index, j)}}
                                     for j, call in enumerate(self.tool_calls)]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


def _arguments_mapping(arguments: str | dict, index: int, call: int) -> dict:
    if isinstance(arguments, dict):
        return arguments
    param = f"messages.{index}.tool_calls.{call}.function.arguments"
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError as err:
        raise APIError(400, f"{param} is not valid JSON ({err}): send the arguments string the server returned.",
                       param=param) from None
    if not isinstance(value, dict):
        raise APIError(400, f"{param} must be a JSON object, got {type(value).__name__}.", param=param)
    return value


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool = True

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools and self.tool_choice not in (None, "none", "auto"):
            raise APIError(400, f"tool_choice={self.tool_choice!r} is not supported: this server cannot force a "
                                "tool call (no constrained decoding); send tool_choice 'auto' or 'none'.",
                           param="tool_choice")

    @property
    def wants_tools(self) -> bool:
        """Whether tools go to the template and the answer is parsed for calls (`tools` given, not `"none"`)."""
        return bool(self.tools) and self.tool_choice != "none"

    def template_tools(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.wants_tools else None

    def template_messages(self) -> list[dict]:
        return [m.for_template(i) for i, m in enumerate(self.messages)]


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    echo: StrictBool = False

    def prompts(self) -> list[str | list[int]]:
        """The prompts: strings, or token-id lists (a flat list of ints is one prompt)."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts = [prompt]
        else:
            prompts = prompt
        if not prompts:
            raise APIError(400, "prompt must not be an empty list.", param="prompt")
        if any(isinstance(p, list) and not p for p in prompts):
            raise APIError(400, "a token-id prompt must not be an empty list.", param="prompt")
        return prompts


def parse_request(model_class: type[BaseModel], payload: Any) -> Any:
    """Validate a decoded JSON body; every problem becomes a 400 naming the field."""
    if not isinstance(payload, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(payload).__name__}.")
    try:
        request = model_class.model_validate(payload)
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise APIError(400, f"invalid value for {param}: {first['msg']}", param=param) from None
    request.check_supported()
    return request


# --- responses --------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int, speculative: dict | None = None) -> dict:
    """OpenAI's usage object; with ``speculative`` (a speculative decoder's ``AcceptanceCounts.as_dict()``), also
    ``usage["speculative"]``: the request's verification steps, accepted tokens and acceptance length."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if speculative is not None:
        out["speculative"] = speculative
    return out


def chat_response(rid: str, model: str, text: str | None, finish: str, usage_: dict,
                  tool_calls: list[dict] | None = None) -> dict:
    message = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": usage_,
    }


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None = None, usage_: dict | None = None) -> dict:
    chunk = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
             "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
    if usage_ is not None:
        chunk["choices"], chunk["usage"] = [], usage_
    return chunk


def completion_response(rid: str, model: str, choices: list[tuple[str, str]], usage_: dict) -> dict:
    return {
        "id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": i, "text": text, "finish_reason": finish, "logprobs": None}
                    for i, (text, finish) in enumerate(choices)],
        "usage": usage_,
    }


def completion_chunk(rid: str, model: str, text: str, finish: str | None = None,
                     usage_: dict | None = None) -> dict:
    chunk = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
             "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}
    if usage_ is not None:
        chunk["choices"], chunk["usage"] = [], usage_
    return chunk


class TokenizeRequest(BaseModel):
    """`POST /tokenize`: a text prompt, or chat messages rendered by the chat template (vLLM's shape)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True

    def check_supported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "send either prompt or messages.", param="prompt")


class DetokenizeRequest(BaseModel):
    """`POST /detokenize`: token ids back to text."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[StrictInt]

    def check_supported(self) -> None:
        pass


def model_card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "hf-bdlm"}
