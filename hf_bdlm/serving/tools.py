"""Tool calling in chat: which chat templates take `tools`, and the model's tool-call text as OpenAI `tool_calls`.

A chat template "supports tools" when rendering a conversation with a probe tool puts the tool's name in the prompt
(:func:`template_renders_tools`). The model then answers in its template's own tool-call syntax, which
:func:`parse_tool_calls` turns into OpenAI tool calls. Two text formats are read, whatever the model family:

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>   # Hermes / Qwen / SmolLM3 style
    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>                 # Gemma 4 style

    from hf_bdlm.serving.tools import parse_tool_calls
    content, calls = parse_tool_calls('Let me look.<tool_call>{"name": "ls", "arguments": {}}</tool_call>')
    # content == "Let me look.", calls[0].name == "ls", calls[0].arguments == "{}"

A block that does not parse stays in the content as text, so a malformed call is visible to the client rather than
lost. Streaming: :class:`ToolCallStream` passes text through until a tool-call marker may be starting, holds the rest,
and parses it when the generation ends.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_PROBE_TOOL = "hf_bdlm_probe_tool_7f3a"


# --- the formats ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolCallFormat:
    """One tool-call syntax: `start` body `end`, and the parser of one body into `[(name, arguments)]`.

    `trailer` is text the template puts after a call that is not content (Gemma 4's `<|tool_response>` opener);
    `tokens` are the marker strings that must survive detokenization when a tokenizer marks them special.
    """

    name: str
    start: str
    end: str
    parse_body: Callable[[str], list[tuple[str, Any]]]
    trailer: str = ""
    tokens: tuple[str, ...] = ()


def _parse_json_body(body: str) -> list[tuple[str, Any]]:
    """`{"name": ..., "arguments": {...}}` (or `"parameters"`), or a JSON list of such objects."""
    value, end = json.JSONDecoder().raw_decode(body.strip())
    if body.strip()[end:].strip():
        raise ValueError("text after the JSON object")
    calls = value if isinstance(value, list) else [value]
    out = []
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
            raise ValueError("a tool call needs a non-empty string 'name'")
        out.append((call["name"], call.get("arguments", call.get("parameters", {}))))
    return out


_QUOTE = '<|"|>'


def _parse_call_body(body: str) -> list[tuple[str, Any]]:
    """`call:NAME{key:value,...}` with Gemma 4's values: `<|"|>text<|"|>`, numbers, true/false/null, {...}, [...]."""
    body = body.strip()
    if not body.startswith("call:"):
        raise ValueError("a call body starts with 'call:'")
    brace = body.index("{")
    name = body[len("call:"):brace].strip()
    if not name:
        raise ValueError("a tool call needs a name")
    arguments, end = _parse_value(body, brace)
    if body[end:].strip():
        raise ValueError("text after the arguments")
    return [(name, arguments)]


def _skip_spaces(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _parse_value(text: str, i: int) -> tuple[Any, int]:
    i = _skip_spaces(text, i)
    if text.startswith(_QUOTE, i):
        close = text.index(_QUOTE, i + len(_QUOTE))
        return text[i + len(_QUOTE):close], close + len(_QUOTE)
    if text.startswith('"', i):
        return json.JSONDecoder().raw_decode(text, i)
    if text.startswith("{", i):
        return _parse_container(text, i + 1, "}", keyed=True)
    if text.startswith("[", i):
        return _parse_container(text, i + 1, "]", keyed=False)
    end = i
    while end < len(text) and text[end] not in ",}]":
        end += 1
    literal = text[i:end].strip()
    if not literal:
        raise ValueError(f"a value is missing at offset {i}")
    try:
        return json.loads(literal), end  # numbers, true, false, null
    except ValueError:
        return literal, end


def _parse_container(text: str, i: int, close: str, keyed: bool) -> tuple[Any, int]:
    items: Any = {} if keyed else []
    i = _skip_spaces(text, i)
    if text.startswith(close, i):
        return items, i + 1
    while True:
        if keyed:
            key, i = _parse_key(text, i)
            items[key], i = _parse_value(text, i)
        else:
            value, i = _parse_value(text, i)
            items.append(value)
        i = _skip_spaces(text, i)
        if text.startswith(close, i):
            return items, i + 1
        if not text.startswith(",", i):
            raise ValueError(f"expected ',' or {close!r} at offset {i}")
        i += 1


def _parse_key(text: str, i: int) -> tuple[str, int]:
    i = _skip_spaces(text, i)
    if text.startswith(_QUOTE, i) or text.startswith('"', i):
        key, i = _parse_value(text, i)
        i = _skip_spaces(text, i)
    else:
        colon = text.index(":", i)
        key, i = text[i:colon].strip(), colon
    if not text.startswith(":", i) or not key:
        raise ValueError(f"expected 'key:' at offset {i}")
    return key, i + 1


HERMES = ToolCallFormat("hermes", "<tool_call>", "</tool_call>", _parse_json_body,
                        tokens=("<tool_call>", "</tool_call>"))
GEMMA4 = ToolCallFormat("gemma4", "<|tool_call>", "<tool_call|>", _parse_call_body, trailer="<|tool_response>",
                        tokens=("<|tool_call>", "<tool_call|>", "<|tool_response>", _QUOTE))
FORMATS: tuple[ToolCallFormat, ...] = (HERMES, GEMMA4)


# --- parsing ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolCall:
    """One parsed call; `arguments` is JSON text (OpenAI's `function.arguments`)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict:
        """The call as OpenAI's `message.tool_calls[i]` (with `index`: as a streamed `delta.tool_calls[i]`)."""
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def _arguments_json(arguments: Any) -> str:
    """Arguments as JSON text of an object; a string must already be one."""
    if isinstance(arguments, str):
        arguments = json.loads(arguments) if arguments.strip() else {}
    if not isinstance(arguments, dict):
        raise ValueError("tool-call arguments must be a JSON object")
    return json.dumps(arguments, ensure_ascii=False)


def split_tool_calls(text: str, formats: tuple[ToolCallFormat, ...] = FORMATS) -> tuple[str, list[ToolCall]]:
    """The text outside tool-call blocks (unstripped) and the calls in order.

    A block missing its end marker at the very end of the text (the model stopped right after the call) still
    counts when its body parses; a block that does not parse is kept in the text as it was.
    """
    content, calls, at = [], [], 0
    while True:
        starts = [(text.find(f.start, at), f) for f in formats]
        starts = [(i, f) for i, f in starts if i >= 0]
        if not starts:
            content.append(text[at:])
            return "".join(content), calls
        start, fmt = min(starts, key=lambda s: s[0])
        content.append(text[at:start])
        body_from = start + len(fmt.start)
        end = text.find(fmt.end, body_from)
        block_end = len(text) if end < 0 else end + len(fmt.end)
        try:
            parsed = [ToolCall(name, _arguments_json(args))
                      for name, args in fmt.parse_body(text[body_from:end if end >= 0 else len(text)])]
        except ValueError:  # json.JSONDecodeError is one
            content.append(text[start:block_end])
        else:
            calls.extend(parsed)
            if fmt.trailer and text.startswith(fmt.trailer, block_end):
                block_end += len(fmt.trailer)
        at = block_end


def parse_tool_calls(text: str, formats: tuple[ToolCallFormat, ...] = FORMATS) -> tuple[str | None, list[ToolCall]]:
    """A whole answer as OpenAI's message fields: `(content, tool_calls)`.

    Without a parsed call the text comes back unchanged; with calls, the text around them, stripped, or `None` when
    nothing is left (OpenAI's `content: null` beside `tool_calls`).
    """
    content, calls = split_tool_calls(text, formats)
    if not calls:
        return text, []
    return content.strip() or None, calls


class ToolCallStream:
    """Streaming: `add(delta)` returns the text that is safe to send as content; `finish()` the rest and the calls.

    Text is held from the first tool-call start marker on (and while the end of the text could be the start of one),
    so a call is never sent half as content; everything after the first marker is parsed once the answer is whole.
    """

    def __init__(self, formats: tuple[ToolCallFormat, ...] = FORMATS):
        self.formats = formats
        self.text, self.sent, self.held_from = "", 0, None

    def add(self, delta: str) -> str:
        self.text += delta
        if self.held_from is None:
            hits = [i for i in (self.text.find(f.start, self.sent) for f in self.formats) if i >= 0]
            if hits:
                self.held_from = min(hits)
        limit = self.held_from if self.held_from is not None else len(self.text) - self._partial_marker()
        if limit <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:limit], limit
        return out

    def _partial_marker(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a start marker."""
        return max((k for f in self.formats for k in range(1, len(f.start))
                    if self.text.endswith(f.start[:k])), default=0)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The content not sent yet (empty when only whitespace surrounds calls) and the parsed calls."""
        rest, calls = split_tool_calls(self.text[self.sent:], self.formats)
        self.sent = len(self.text)
        if calls and not rest.strip():
            rest = ""
        return rest, calls


# --- templates and tokenizers -----------------------------------------------------------------------------------
def template_renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template puts `tools` in the prompt (rendered with a probe tool, not guessed).

    A template that ignores `tools`, has none, or fails on a plain one-turn conversation with a tool gives False.
    """
    if not getattr(tokenizer, "chat_template", None):
        return False
    probe = {"type": "function", "function": {
        "name": _PROBE_TOOL, "description": "probe",
        "parameters": {"type": "object", "properties": {"x": {"type": "string", "description": "x"}},
                       "required": ["x"]}}}
    try:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[probe], tokenize=False,
                                                 add_generation_prompt=True)
    except Exception:  # any template error means: this template cannot be given tools
        return False
    return _PROBE_TOOL in rendered


class MarkerKeepingTokenizer:
    """A tokenizer whose `decode(..., skip_special_tokens=True)` keeps the tool-call markers.

    Some tokenizers mark their tool-call tokens special; the server's detokenizer skips special tokens, which would
    erase the markers before :func:`parse_tool_calls` sees them. Everything else is the wrapped tokenizer's.
    """

    def __init__(self, tokenizer, special_ids: set[int], keep_ids: set[int]):
        self.tokenizer, self.keep_ids = tokenizer, keep_ids
        self.skip_ids = special_ids - keep_ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False, **kwargs) -> str:
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.skip_ids]
        return self.tokenizer.decode(ids, skip_special_tokens=False, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def _special_ids(tokenizer) -> set[int]:
    """The ids `decode(skip_special_tokens=True)` drops: the named special tokens and added tokens marked special."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return set(getattr(tokenizer, "all_special_ids", ())) | {i for i, t in added.items() if getattr(t, "special", 0)}


def keep_tool_markers(tokenizer, formats: tuple[ToolCallFormat, ...] = FORMATS):
    """The tokenizer to detokenize a tool-enabled answer with: wrapped when some marker is a special token."""
    special = _special_ids(tokenizer)
    keep = set()
    for token in {t for f in formats for t in f.tokens}:
        i = tokenizer.convert_tokens_to_ids(token)
        if i in special and tokenizer.convert_ids_to_tokens(i) == token:
            keep.add(i)
    return MarkerKeepingTokenizer(tokenizer, special, keep) if keep else tokenizer
