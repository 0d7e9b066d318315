"""`hf-bdlm serve` on a DiffusionGemma checkpoint: transformers' own `generate`, one random stream per request.

A tiny random DiffusionGemma (tests/distributed/tiny_diffusion_gemma.py: canvas 4, vocabulary 64, context 256) and its
word-level chat tokenizer are saved with `save_pretrained` (the format our trainer writes and transformers loads), with
a generation config of 8 denoising steps per canvas, and served in a background thread. The contract checked: a
request with `seed: S` answers token for token what `torch.manual_seed(S); model.generate(ids, do_sample=False,
max_new_tokens=N)` gives on the same templated prompt (cut at the first EOS), alone or batched with other requests;
streaming sends one chunk per canvas; bad input is a 4xx; a full queue a 429; a client that hangs up is cancelled.
Run: python -m pytest tests/serving/test_diffusion_gemma.py -q
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import time

import httpx
import pytest
import torch

openai = pytest.importorskip("openai", reason="the serving tests need the openai client (dev extra)")
pytest.importorskip("fastapi", reason="the serving tests need fastapi and uvicorn (serve extra)")

from transformers import BertConfig  # noqa: E402

from hf_bdlm.models.diffusion_gemma.inference.serving import DiffusionGemmaServingDecoder  # noqa: E402
from fixtures import API_KEY  # noqa: E402
from hf_bdlm.serving import Engine, ServerConfig, ServerThread  # noqa: E402
from hf_bdlm.protocols.registry import REGISTRY  # noqa: E402
from hf_bdlm.serving.protocol import ChatCompletionRequest, CompletionRequest, parse_request  # noqa: E402
from tiny_diffusion_gemma import B, EOS, TURN_END, save_checkpoint, tiny_model, tiny_tokenizer  # noqa: E402

KEY = API_KEY
CONTEXT = 256
# The module's server (tests/serving/conftest.py: engine, server, client).
SERVER = dict(max_batch_size=4, max_queue=16, batch_wait_ms=100, max_body_bytes=20_000, max_tokens_limit=64,
              default_max_tokens=8)
CLIENT_TIMEOUT = 120
PROMPT = [{"role": "user", "content": "w9 w10 w11"}]
PROMPTS = [[{"role": "user", "content": " ".join(f"w{7 + (i * 5 + j) % 50}" for j in range(n))}]
           for i, n in enumerate((1, 3, 6, 9))]  # ragged prompt lengths


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("tiny-diffusion-gemma"), denoising_steps=8)


@pytest.fixture(scope="module")
def served(folder):
    return dict(path=folder, name="tiny")


def reference(engine, ids: list[int], seed: int, max_tokens: int, ignore_eos: bool = False) -> list[int]:
    """What transformers' generate gives for one prompt, cut where the server's answer ends (EOS, max_tokens)."""
    kwargs = {"eos_token_id": None} if ignore_eos else {}
    torch.manual_seed(seed)
    out = engine.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_tokens, **kwargs)
    tokens = out.sequences[0, len(ids):].tolist()[:max_tokens]
    ends = set() if ignore_eos else {EOS, TURN_END}
    cut = next((i + 1 for i, t in enumerate(tokens) if t in ends), len(tokens))
    return tokens[:cut]


def chat_job(engine, messages, seed, max_tokens, **fields):
    request = parse_request(ChatCompletionRequest, {"model": "tiny", "messages": messages, "seed": seed,
                                                    "temperature": 0, "max_tokens": max_tokens, **fields})
    return engine.make_job(request, engine.chat_prompt(messages), 64, 8, CONTEXT - 1)


def _wait_idle(scheduler, timeout=60):
    deadline = time.monotonic() + timeout
    while (scheduler.running or scheduler.queued) and time.monotonic() < deadline:
        time.sleep(0.05)


# --- loading ---------------------------------------------------------------------------------------


def test_the_family_comes_from_the_checkpoint_config_and_decodes_with_generate(engine, folder):
    assert type(engine.model).__name__ == "DiffusionGemmaForBlockDiffusion"
    assert isinstance(engine.decoder, DiffusionGemmaServingDecoder)
    assert engine.context_length == CONTEXT and engine.tokenizer.chat_template
    assert engine.model.generation_config.max_denoising_steps == 8  # the checkpoint's generation config
    # a model object (the evaluation callback's path) finds its family too
    assert isinstance(Engine(tiny_model(), tiny_tokenizer(), name="live").decoder, DiffusionGemmaServingDecoder)


def test_an_unknown_model_type_is_a_clear_error_naming_the_supported_ones(tmp_path):
    BertConfig(vocab_size=64, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
               intermediate_size=8).save_pretrained(tmp_path / "bert")
    supported = re.escape(str(sorted(t for entry in REGISTRY for t in entry.model_types)))  # every family's
    with pytest.raises(ValueError, match=rf"model_type='bert'.*{supported}.*causal LMs"):
        Engine.from_pretrained(tmp_path / "bert")
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text(json.dumps({"model_type": "no_such_model"}))
    with pytest.raises(ValueError, match=rf"no_such_model.*{supported}"):
        Engine.from_pretrained(tmp_path / "odd")


# --- the seed contract -------------------------------------------------------------------------------


def test_a_seeded_request_answers_what_generate_gives_alone_and_batched(engine):
    seeds, budgets = (0, 1, 2, 3), (12, 7, 12, 5)
    expected = [reference(engine, engine.chat_prompt(p), s, n) for p, s, n in zip(PROMPTS, seeds, budgets)]
    alone = []
    for p, s, n in zip(PROMPTS, seeds, budgets):
        job = chat_job(engine, p, s, n)
        engine.run_batch([job])
        alone.append(job.stream.ids)
    jobs = [chat_job(engine, p, s, n) for p, s, n in zip(PROMPTS, seeds, budgets)]
    assert len({j.batch_key for j in jobs}) == 1  # seeded requests share a batch
    state = torch.get_rng_state()
    engine.run_batch(jobs)
    assert torch.equal(torch.get_rng_state(), state)  # the global generator is not consumed
    assert alone == expected
    assert [j.stream.ids for j in jobs] == expected
    assert [j.completion_tokens for j in jobs] == [len(e) for e in expected]


def test_served_chat_text_equals_generate_alone_and_under_concurrency(client, server, engine):
    _wait_idle(server.app.state.scheduler)
    seeds = (11, 12, 13, 14)
    expected = [reference(engine, engine.chat_prompt(p), s, 12) for p, s in zip(PROMPTS, seeds)]
    texts = [engine.tokenizer.decode(e, skip_special_tokens=True) for e in expected]

    def ask(i):
        out = client.chat.completions.create(model="tiny", messages=PROMPTS[i], max_tokens=12, temperature=0,
                                             seed=seeds[i])
        return out.choices[0].message.content, out.usage.completion_tokens

    alone = [ask(i) for i in range(4)]
    stats = server.app.state.scheduler.stats
    batches_before = stats.batches
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(ask, range(4)))
    assert alone == together == [(t, len(e)) for t, e in zip(texts, expected)]
    assert stats.batches - batches_before < 4 and stats.largest_batch >= 2  # requests shared a batch


def test_text_completions_answer_what_generate_gives(client, server, engine):
    _wait_idle(server.app.state.scheduler)
    ids = engine.text_prompt("w20 w21 w22")
    expected = engine.tokenizer.decode(reference(engine, ids, 5, 9), skip_special_tokens=True)
    out = client.completions.create(model="tiny", prompt="w20 w21 w22", max_tokens=9, temperature=0, seed=5)
    assert out.choices[0].text == expected
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="w20 w21 w22", max_tokens=9, temperature=0, seed=5, stream=True) if c.choices)
    assert streamed == expected


def test_streaming_sends_one_chunk_per_decoded_canvas(client, server, engine):
    _wait_idle(server.app.state.scheduler)
    ids = engine.chat_prompt(PROMPT)
    specials = set(engine.tokenizer.all_special_ids)
    # a seed whose 3 canvases hold only words, so that every canvas has text to send
    seed = next(s for s in range(100) if not specials & set(reference(engine, ids, s, 3 * B, ignore_eos=True)))
    canvases = reference(engine, ids, seed, 3 * B, ignore_eos=True)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=PROMPT, max_tokens=3 * B, temperature=0, seed=seed, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(texts) == 3
    assert "".join(texts) == engine.tokenizer.decode(canvases, skip_special_tokens=True)
    assert texts[0] == engine.tokenizer.decode(canvases[:B])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 3 * B


def test_request_fields_map_to_the_generation_config(engine):
    job = chat_job(engine, PROMPT, 0, 8, steps_per_block=3, confidence_threshold=0.5)
    assert dict(job.settings.overrides) == {"max_denoising_steps": 3, "confidence_threshold": 0.5}
    assert set(job.settings.eos_token_ids) == {EOS, TURN_END}
    assert chat_job(engine, PROMPT, 0, 8, ignore_eos=True).settings.eos_token_ids == ()


# --- errors, limits, cancellation ------------------------------------------------------------------


BAD_REQUESTS = {
    "top_p below 1": ({"top_p": 0.5}, 400, None),
    "seed out of range": ({"seed": 1 << 70}, 400, None),
    "steps_per_block 0": ({"steps_per_block": 0}, 400, "steps_per_block"),
    "confidence_threshold above 1": ({"confidence_threshold": 5}, 400, "confidence_threshold"),
    "max_tokens over the limit": ({"max_tokens": 65}, 400, "max_tokens"),
    "context overflow": ({"messages": [{"role": "user", "content": "w9 " * CONTEXT}]}, 400, "messages"),
    "tools": ({"tools": [{"type": "function"}]}, 400, "tools"),
    "unknown model": ({"model": "gpt-9"}, 404, "model"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_input_is_a_4xx_in_openai_error_shape(server, case):
    fields, status, param = BAD_REQUESTS[case]
    body = {"model": "tiny", "messages": PROMPT, "max_tokens": 2, **fields}
    headers = {"Authorization": f"Bearer {KEY}"}
    response = httpx.post(server.base_url + "/chat/completions", json=body, headers=headers, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if param:
        assert error["param"].startswith(param), error
    ok = httpx.post(server.base_url + "/chat/completions", json={"model": "tiny", "messages": PROMPT,
                                                                 "max_tokens": 2}, headers=headers, timeout=30)
    assert ok.status_code == 200


def test_auth_is_required(server):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="nope", max_retries=0).models.list()


def test_full_queue_answers_429_and_the_server_keeps_serving(engine):
    config = ServerConfig(port=0, max_batch_size=1, max_queue=2, batch_wait_ms=0)
    with ServerThread(engine, config) as running:
        client = openai.OpenAI(base_url=running.base_url, api_key="unused", max_retries=0, timeout=120)

        def one(_):
            try:
                client.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=40,
                                               extra_body={"ignore_eos": True})
                return 200
            except openai.RateLimitError:
                return 429

        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            codes = list(pool.map(one, range(12)))
        assert codes.count(429) >= 1 and codes.count(200) >= 3, codes
        assert running.app.state.scheduler.stats.rejected == codes.count(429)
        out = client.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=4,
                                             extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 4


def test_client_disconnect_cancels_its_generation(server, engine):
    scheduler = server.app.state.scheduler
    _wait_idle(scheduler)
    cancelled = scheduler.stats.cancelled
    # 20 ms per decoder pass: 64 tokens are 16 canvases of 8 denoising steps (128 passes)
    passes = []

    def slow_pass(module, args, kwargs):
        passes.append(1)
        time.sleep(0.02)

    slow = engine.model.model.decoder.register_forward_pre_hook(slow_pass, with_kwargs=True)
    body = {"model": "tiny", "messages": PROMPT, "max_tokens": 64, "stream": True, "ignore_eos": True, "seed": 0}
    headers = {"Authorization": f"Bearer {KEY}"}
    try:
        with httpx.stream("POST", server.base_url + "/chat/completions", json=body, headers=headers,
                          timeout=30) as response:
            for line in response.iter_lines():
                if '"content": "' in line and '"content": ""' not in line:
                    break  # the first decoded canvas arrived: hang up
        _wait_idle(scheduler)
        assert scheduler.stats.cancelled == cancelled + 1
        assert len(passes) < 48  # stopped at a canvas boundary, not after 16 canvases
    finally:
        slow.remove()
