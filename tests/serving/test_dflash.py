"""`hf-bdlm serve TARGET --draft DIR`: a causal LM served as it is, decoded greedily with a DFlash drafter.

A tiny random Llama target with the word-level chat tokenizer of tests/tiny_bdlm.py and a random DFlash2 drafter made
for it (`from_target`), both saved with `save_pretrained`. The contract checked: a completion is token for token
`target.generate(ids, do_sample=False, max_new_tokens=N)` on the same templated prompt (cut at the first EOS), alone or
batched with other requests of other lengths and budgets, over the openai client too; a stream sends the tokens each
verification forward committed; sampling and diffusion fields are a 400; a folder that is not a drafter is a clear
error; the served acceptance (tokens per target forward) is the one `speculative_generate` measures on the same
prompts.
Run: python -m pytest tests/serving/test_dflash.py -q
"""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

openai = pytest.importorskip("openai", reason="the serving tests need the openai client (dev extra)")
pytest.importorskip("fastapi", reason="the serving tests need fastapi and uvicorn (serve extra)")

from hf_bdlm.models.dflash.modeling import DFlash2DraftModel  # noqa: E402
from hf_bdlm.models.dflash.inference.serving import SpeculativeServingDecoder  # noqa: E402
from hf_bdlm.serving import Engine  # noqa: E402
from hf_bdlm.serving.protocol import ChatCompletionRequest, parse_request  # noqa: E402

from fixtures import openai_client, serve  # noqa: E402
from tiny_bdlm import MASK, save_tiny_bdlm, save_tiny_target  # noqa: E402

EOS = 3
PROMPTS = [[{"role": "user", "content": " ".join(f"w{7 + (i * 5 + j) % 50}" for j in range(n))}]
           for i, n in enumerate((1, 3, 6, 9))]  # ragged prompt lengths


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("speculative")
    target = save_tiny_target(root / "target", num_hidden_layers=3)
    drafter = DFlash2DraftModel.from_target(target, init="target_layers", num_hidden_layers=1, block_size=4,
                                            mask_token_id=MASK)
    drafter.save_pretrained(root / "drafter")
    save_tiny_bdlm(root / "bdlm")
    return root


@pytest.fixture(scope="module")
def served(folders):  # the engine (tests/serving/conftest.py): the target served with the drafter
    return dict(path=folders / "target", name="tiny", draft=folders / "drafter")


def reference(engine, ids: list[int], max_tokens: int) -> list[int]:
    out = engine.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_tokens)
    tokens = out[0, len(ids):].tolist()
    cut = next((i + 1 for i, t in enumerate(tokens) if t == EOS), len(tokens))
    return tokens[:cut]


def chat_job(engine, messages, max_tokens, **fields):
    request = parse_request(ChatCompletionRequest, {"model": "tiny", "messages": messages, "temperature": 0,
                                                    "max_tokens": max_tokens, **fields})
    return engine.make_job(request, engine.chat_prompt(messages), 64, 8, 255)


def test_the_target_is_served_as_the_causal_lm_it_is_with_the_drafter(engine):
    assert type(engine.model).__name__ == "LlamaForCausalLM"
    assert isinstance(engine.decoder, SpeculativeServingDecoder)
    assert engine.decoder.drafter.embed_tokens is engine.model.get_input_embeddings()


def test_completions_are_the_target_greedy_output_alone_and_batched(engine):
    budgets = (12, 7, 20, 5)
    expected = [reference(engine, engine.chat_prompt(p), n) for p, n in zip(PROMPTS, budgets)]
    alone = []
    for p, n in zip(PROMPTS, budgets):
        job = chat_job(engine, p, n)
        engine.run_batch([job])
        alone.append(job.stream.ids)
    jobs = [chat_job(engine, p, n) for p, n in zip(PROMPTS, budgets)]
    assert len({j.batch_key for j in jobs}) == 1
    engine.run_batch(jobs)
    assert alone == expected
    assert [j.stream.ids for j in jobs] == expected


def test_served_over_http_equals_generate_alone_and_under_concurrency(engine):
    expected = [engine.tokenizer.decode(reference(engine, engine.chat_prompt(p), 10), skip_special_tokens=True)
                for p in PROMPTS]
    with serve(engine, max_batch_size=4, max_queue=16, batch_wait_ms=100, max_tokens_limit=64,
               default_max_tokens=8) as server:
        client = openai_client(server, timeout=120)

        def ask(i):
            out = client.chat.completions.create(model="tiny", messages=PROMPTS[i], max_tokens=10, temperature=0)
            return out.choices[0].message.content

        alone = [ask(i) for i in range(4)]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            together = list(pool.map(ask, range(4)))
        streamed = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="tiny", messages=PROMPTS[2], max_tokens=10, temperature=0, stream=True) if c.choices]
        with pytest.raises(openai.BadRequestError, match="decodes greedily"):
            client.chat.completions.create(model="tiny", messages=PROMPTS[0], max_tokens=4, temperature=0.7)
        with pytest.raises(openai.BadRequestError, match="steps_per_block"):
            client.chat.completions.create(model="tiny", messages=PROMPTS[0], max_tokens=4,
                                           extra_body={"steps_per_block": 2})
    assert alone == together == expected
    assert "".join(streamed) == expected[2]


def test_a_folder_that_is_not_a_drafter_is_a_clear_error(folders):
    with pytest.raises(ValueError, match=r"holds a 'block_diffusion' checkpoint: this family has no drafting role. --draft "
                                         r"takes a drafter folder"):
        Engine.from_pretrained(folders / "target", draft=folders / "bdlm")
    with pytest.raises(FileNotFoundError, match="holds no config.json"):
        Engine.from_pretrained(folders / "target", draft=folders / "missing")


def test_fewer_speculative_tokens_per_forward_serve_the_same_completions(folders, engine):
    """--num-speculative-tokens 1: each verification runs the anchor and one proposal; completions are unchanged."""
    one = Engine.from_pretrained(folders / "target", name="tiny", draft=folders / "drafter", num_speculative_tokens=1)
    assert one.decoder.num_speculative_tokens == 1 and engine.decoder.num_speculative_tokens == 3
    widths = []
    one.model.register_forward_pre_hook(lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]),
                                        with_kwargs=True)
    budgets = (12, 7, 20, 5)
    jobs = [chat_job(one, p, n) for p, n in zip(PROMPTS, budgets)]
    one.run_batch(jobs)
    assert [j.stream.ids for j in jobs] == [reference(engine, engine.chat_prompt(p), n)
                                            for p, n in zip(PROMPTS, budgets)]
    # The prefill, then anchor + one proposal per forward (the anchor alone where the budget leaves no room).
    assert widths[0] > 2 and widths[1:].count(2) > len(widths[1:]) // 2 and set(widths[1:]) <= {1, 2}


def test_a_bad_number_of_speculative_tokens_is_a_clear_error(folders):
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be an integer in \[1, 3\].*got 4"):
        Engine.from_pretrained(folders / "target", draft=folders / "drafter", num_speculative_tokens=4)
    with pytest.raises(ValueError, match=r"num_speculative_tokens=2 .*pass a drafter folder \(--draft DIR\)"):
        Engine.from_pretrained(folders / "target", num_speculative_tokens=2)


def test_served_acceptance_equals_the_recipes_measurement(engine):
    """`hf-bdlm serve --draft` accepts as many tokens per target forward as `speculative_generate` (what the DFlash
    recipe measures after training) on the same prompts: the same target forwards for the same tokens."""
    from hf_bdlm.benchmarks.decoding_study import ForwardMeter, serve_decode
    from hf_bdlm.models.dflash.inference.speculative import speculative_generate

    decoder = engine.decoder
    acceptance = []
    for messages in PROMPTS:
        ids = list(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                        return_dict=True)["input_ids"])
        with ForwardMeter({"model": decoder.model.get_decoder()}) as meter, torch.no_grad():
            served = serve_decode(decoder, [ids], 12, False, {EOS})[0]
        out, stats = speculative_generate(decoder.model, decoder.drafter, torch.tensor([ids]), max_new_tokens=12,
                                          eos_token_id=EOS, num_speculative_tokens=decoder.num_speculative_tokens)
        assert served == out[0, len(ids):].tolist()[: len(served)]
        assert len(meter.forwards["model"]) == stats.target_forwards
        acceptance.append(stats.mean_acceptance_length)
    assert max(acceptance) > 1.2  # 1.57 measured: the drafter (the target's own layers) gets proposals accepted: a check with teeth
