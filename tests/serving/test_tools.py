"""Tools in chat: `tools` rendered by the chat template, the model's tool-call text returned as OpenAI `tool_calls`.

The parser is specified on model-like outputs (Hermes/Qwen JSON blocks, Gemma 4 `call:` blocks). End to end, two real
tiny checkpoints are served with byte-level tokenizers (every text round-trips exactly) and tool-taking templates:
a block-diffusion model with a Hermes-style template and a DiffusionGemma with its own (TRL's Gemma 4) template, whose
tool markers are special tokens. A random model never calls a tool by itself, so the decoder runs for real but the
tokens it hands the engine after each block are replaced by the tokenization of a scripted answer; everything else
(the template rendering, the detokenizer, the parser, HTTP and the `openai` client) is the server's own.
Run: python -m pytest tests/serving/test_tools.py -q
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch

openai = pytest.importorskip("openai", reason="the serving tests need the openai client (dev extra)")
pytest.importorskip("fastapi", reason="the serving tests need fastapi and uvicorn (serve extra)")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, PreTrainedTokenizerFast  # noqa: E402

from hf_bdlm import BlockDiffusionConfig, BlockDiffusionForMaskedLM  # noqa: E402
from fixtures import API_KEY, openai_client, serve  # noqa: E402
from hf_bdlm.serving import Engine  # noqa: E402
from hf_bdlm.serving.tools import (  # noqa: E402
    ToolCallStream,
    keep_tool_markers,
    parse_tool_calls,
    template_renders_tools,
)
from tiny_bdlm import save_tiny_bdlm  # noqa: E402

import tiny_diffusion_gemma  # noqa: E402

KEY = API_KEY
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]

# A Hermes/Qwen-style template (the shape of Qwen2.5's), small enough to read.
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n"
    "</tools>\nCall a function as <tool_call>{\"name\": <name>, \"arguments\": <args>}</tool_call><|im_end|>\n"
    "{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_level_tokenizer(specials: list[str], added: list[str] = ()) -> PreTrainedTokenizerFast:
    """Specials first (ids 0..), then the 256 byte symbols, then `added` (plain added tokens, like Qwen's markers)."""
    vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()) + list(added))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=specials[0], eos_token=specials[1],
                                  bos_token=specials[2], additional_special_tokens=specials[3:])
    tok.add_tokens(list(added))
    return tok


def script_decoder(monkeypatch, engine: Engine, text: str) -> None:
    """The decoder runs as usual, but each block's tokens handed to the engine are the next ones of `text`, then EOS."""
    script = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    eos = engine.tokenizer.eos_token_id
    decode = engine.decoder.decode

    def scripted(prompts, settings, seeds, on_block):
        given = {}

        def replace(new: dict):
            out = {}
            for row, tokens in new.items():
                n, at = len(tokens), given.get(row, 0)
                out[row] = (script + [eos] * n)[at:at + n]
                given[row] = at + n
            return on_block(out)

        return decode(prompts, settings, seeds, replace)

    monkeypatch.setattr(engine.decoder, "decode", scripted)


def record_prompts(monkeypatch, engine: Engine) -> list[str]:
    """The text of every chat prompt the server builds (the real template's rendering, detokenized)."""
    seen, chat_prompt = [], engine.chat_prompt

    def recording(messages, tools=None):
        ids = chat_prompt(messages, tools=tools)
        seen.append(engine.tokenizer.decode(ids))
        return ids

    monkeypatch.setattr(engine, "chat_prompt", recording)
    return seen


# The servers of this module (long answers: a tool call and its arguments).
SERVER = dict(max_batch_size=4, max_queue=16, batch_wait_ms=10, max_body_bytes=100_000, max_tokens_limit=200,
              default_max_tokens=120)


# --- the parser, on model-like outputs ----------------------------------------------------------------------------
def test_hermes_block_becomes_a_tool_call_and_the_text_around_it_the_content():
    content, calls = parse_tool_calls('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": '
                                      '{"city": "Paris", "days": 2}}\n</tool_call>')
    assert content == "I will check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "days": 2})]
    assert calls[0].to_openai()["type"] == "function" and calls[0].id.startswith("call_")


def test_several_calls_keep_their_order_and_a_lone_call_has_null_content():
    text = ('<tool_call>{"name": "ls", "arguments": {"path": "."}}</tool_call>\n'
            '<tool_call>{"name": "cat", "parameters": {"path": "a.py"}}</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("ls", {"path": "."}), ("cat", {"path": "a.py"})]
    assert calls[0].id != calls[1].id


def test_gemma4_call_block_with_strings_numbers_lists_and_objects():
    text = ('<|tool_call>call:run{cmd:<|"|>ls -la, then {x}<|"|>,timeout:30,ratio:0.5,dry:false,none:null,'
            'tags:[<|"|>a<|"|>,2],env:{HOME:<|"|>/root<|"|>}}<tool_call|><|tool_response>')
    content, calls = parse_tool_calls(text)
    assert content is None
    assert calls[0].name == "run"
    assert json.loads(calls[0].arguments) == {"cmd": "ls -la, then {x}", "timeout": 30, "ratio": 0.5, "dry": False,
                                              "none": None, "tags": ["a", 2], "env": {"HOME": "/root"}}


def test_text_without_calls_is_returned_unchanged():
    text = "  The weather is fine; no <tool> needed.\n"
    assert parse_tool_calls(text) == (text, [])


def test_a_block_that_does_not_parse_stays_in_the_content():
    text = 'Try: <tool_call>{"name": "ls", "arguments": {oops}}</tool_call> then <tool_call>{"name": "pwd"}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert [c.name for c in calls] == ["pwd"] and json.loads(calls[0].arguments) == {}
    assert content == 'Try: <tool_call>{"name": "ls", "arguments": {oops}}</tool_call> then'


def test_a_call_cut_before_its_end_marker_counts_when_its_body_is_whole():
    content, calls = parse_tool_calls('<tool_call>{"name": "ls", "arguments": {}}')
    assert content is None and calls[0].name == "ls"
    assert parse_tool_calls('<tool_call>{"name": "ls", "argu')[1] == []


@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
def test_streaming_sends_text_before_a_call_holds_the_call_and_agrees_with_the_whole_parse(chunk):
    text = 'Checking <the> weather.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    stream, sent = ToolCallStream(), []
    for i in range(0, len(text), chunk):
        sent.append(stream.add(text[i:i + chunk]))
        assert "<tool_call" not in "".join(sent)  # never a half call as content
    rest, calls = stream.finish()
    assert "".join(sent) + rest == "Checking <the> weather."
    whole = parse_tool_calls(text)[1]
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole]


def test_streaming_without_a_call_passes_all_text_through():
    stream = ToolCallStream()
    parts = [stream.add(p) for p in ["a <", "tool", " b"]]
    assert "".join(parts) + stream.finish()[0] == "a <tool b" and stream.finish()[1] == []


# --- which templates take tools ----------------------------------------------------------------------------------
def test_tool_support_is_read_from_the_rendered_template():
    hermes = byte_level_tokenizer(["<pad>", "<eos>", "<bos>"])
    hermes.chat_template = HERMES_TEMPLATE
    assert template_renders_tools(hermes)
    assert template_renders_tools(tiny_diffusion_gemma.tiny_tokenizer())  # TRL's Gemma 4 template
    plain = byte_level_tokenizer(["<pad>", "<eos>", "<bos>"])
    plain.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    assert not template_renders_tools(plain)
    plain.chat_template = None
    assert not template_renders_tools(plain)


def test_the_embedded_smollm2_template_does_not_take_tools():
    from hf_bdlm.embedded import default_model_dir

    try:
        path = default_model_dir()
    except ImportError as err:
        pytest.skip(f"the embedded SmolLM2 is not installed: {err}")
    from transformers import AutoTokenizer

    assert not template_renders_tools(AutoTokenizer.from_pretrained(path))


def test_special_tool_markers_survive_detokenization():
    tok = byte_level_tokenizer(["<pad>", "<eos>", "<bos>", "<|tool_call>", "<tool_call|>", '<|"|>'])
    ids = tok("<|tool_call>call:f{a:<|\"|>x<|\"|>}<tool_call|>", add_special_tokens=False)["input_ids"] + [1]
    assert "<|tool_call>" not in tok.decode(ids, skip_special_tokens=True)
    kept = keep_tool_markers(tok).decode(ids, skip_special_tokens=True)
    assert kept == '<|tool_call>call:f{a:<|"|>x<|"|>}<tool_call|>'  # the EOS is still skipped
    plain = byte_level_tokenizer(["<pad>", "<eos>", "<bos>"], added=["<tool_call>"])
    assert keep_tool_markers(plain) is plain  # nothing to keep: the tokenizer is used as it is


# --- end to end: a block-diffusion model with a Hermes-style template -------------------------------------------
@pytest.fixture(scope="module")
def hermes_engine(tmp_path_factory):
    tok = byte_level_tokenizer(["<pad>", "<eos>", "<bos>", "<|mask|>"], added=["<tool_call>", "</tool_call>"])
    tok.mask_token = "<|mask|>"
    tok.chat_template = HERMES_TEMPLATE
    torch.manual_seed(0)
    backbone = LlamaConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=64, max_position_embeddings=1024,
                           bos_token_id=2, eos_token_id=1, pad_token_id=0)
    model = BlockDiffusionForMaskedLM(BlockDiffusionConfig(backbone_config=backbone, block_size=8,
                                                           mask_token_id=tok.mask_token_id)).eval()
    model.generation_config.eos_token_id = tok.eos_token_id
    folder = tmp_path_factory.mktemp("tiny-bdlm-tools")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return Engine.from_pretrained(folder, name="tiny")


@pytest.fixture(scope="module")
def hermes_server(hermes_engine):
    with serve(hermes_engine, **SERVER) as running:
        yield running


@pytest.fixture
def hermes_client(hermes_server):
    return openai_client(hermes_server, timeout=120)


HERMES_CALL = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_tools_reach_the_template_and_the_call_comes_back_as_tool_calls(monkeypatch, hermes_engine, hermes_client):
    prompts = record_prompts(monkeypatch, hermes_engine)
    script_decoder(monkeypatch, hermes_engine, HERMES_CALL)
    out = hermes_client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER])
    assert '"name": "get_weather"' in prompts[0] and "Current weather in a city." in prompts[0]
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_without_tools_the_same_answer_is_plain_text(monkeypatch, hermes_engine, hermes_client):
    prompts = record_prompts(monkeypatch, hermes_engine)
    script_decoder(monkeypatch, hermes_engine, HERMES_CALL)
    for kwargs in ({}, {"tools": [WEATHER], "tool_choice": "none"}):
        out = hermes_client.chat.completions.create(model="tiny", messages=ASK, **kwargs)
        assert out.choices[0].message.content == HERMES_CALL and not out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "stop"
    assert all("get_weather" not in p for p in prompts)


def test_the_follow_up_turn_renders_the_call_and_the_tool_result(monkeypatch, hermes_engine, hermes_client):
    prompts = record_prompts(monkeypatch, hermes_engine)
    script_decoder(monkeypatch, hermes_engine, HERMES_CALL)  # the call as the client got it goes back with its answer
    call = hermes_client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER]).choices[0].message.tool_calls[0]
    script_decoder(monkeypatch, hermes_engine, "It is sunny in Paris.")
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                      {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    out = hermes_client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompts[1]
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompts[1]
    assert out.choices[0].message.content == "It is sunny in Paris." and not out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "stop"


def test_streamed_tool_calls_arrive_whole_after_the_text(monkeypatch, hermes_engine, hermes_client):
    script_decoder(monkeypatch, hermes_engine, HERMES_CALL)
    chunks = list(hermes_client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert text == "Let me check.\n"  # sent as it came; the call itself never as content
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].id.startswith("call_")
    assert calls[0].function.name == "get_weather" and json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert sum(c.choices[0].finish_reason is not None for c in chunks) == 1


@pytest.mark.parametrize("body, param", [
    ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"messages": ASK + [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}, "messages.1"),
])
def test_unsupported_tool_requests_are_a_400_naming_the_field(hermes_server, body, param):
    response = httpx.post(hermes_server.base_url + "/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": "tiny", "messages": ASK, **body}, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith(param)


# --- a template without tools ------------------------------------------------------------------------------------
def test_a_template_without_tools_refuses_them_with_a_400(tmp_path):
    engine = Engine.from_pretrained(save_tiny_bdlm(tmp_path), name="plain", dtype=torch.float64)
    with serve(engine, **SERVER) as server:
        client = openai_client(server, timeout=60)
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="plain", messages=[{"role": "user", "content": "w9"}],
                                           tools=[WEATHER])
        error = err.value.body
        assert error["param"] == "tools" and "does not render `tools`" in error["message"]
        out = client.chat.completions.create(model="plain", messages=[{"role": "user", "content": "w9"}],
                                             max_tokens=4)  # the same server still serves plain chat
        assert out.choices[0].finish_reason == "length"


# --- end to end: DiffusionGemma with its own template -----------------------------------------------------------
@pytest.fixture(scope="module")
def gemma_engine(tmp_path_factory):
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import DiffusionGemmaGenerationConfig

    g = tiny_diffusion_gemma
    # The fixture's ids for PAD, EOS, BOS, TURN_END; the tool markers special, as a real tokenizer may have them.
    tok = byte_level_tokenizer(["[PAD]", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|tool_call>", "<tool_call|>",
                                "<|tool_response>", "<tool_response|>", "<|tool>", "<tool|>", '<|"|>'])
    tok.chat_template = g.tiny_tokenizer().chat_template
    assert [tok.convert_tokens_to_ids(t) for t in ("[PAD]", "<eos>", "<bos>", "<turn|>")] == \
        [g.PAD, g.EOS, g.BOS, g.TURN_END]
    config = g.tiny_model(seed=0).config
    config.text_config.vocab_size = len(tok)
    torch.manual_seed(0)
    model = DiffusionGemmaForBlockDiffusion(config)
    model.generation_config = DiffusionGemmaGenerationConfig(max_denoising_steps=2, eos_token_id=[g.EOS, g.TURN_END],
                                                             pad_token_id=g.PAD)
    folder = tmp_path_factory.mktemp("tiny-diffusion-gemma-tools")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return Engine.from_pretrained(folder, name="tiny")


def test_diffusion_gemma_renders_tools_and_its_call_syntax_comes_back_as_tool_calls(monkeypatch, gemma_engine):
    prompts = record_prompts(monkeypatch, gemma_engine)
    script_decoder(monkeypatch, gemma_engine,
                   '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|><|tool_response>')
    with serve(gemma_engine, **SERVER) as server:
        client = openai_client(server, timeout=120)
        # Seeded: the real canvases under the script end the decode if they sample EOS, which about 7 % of
        # unseeded requests did (finish_reason "length", the call cut short); seed 1 runs past the script's end.
        out = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], seed=1)
        streamed = list(client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], stream=True,
                                                       seed=1))
    assert "<|tool>declaration:get_weather{description:<|\"|>Current weather in a city.<|\"|>" in prompts[0]
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    calls = [tc for c in streamed for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", call.function.arguments)]
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == ""
    assert streamed[-1].choices[0].finish_reason == "tool_calls"
