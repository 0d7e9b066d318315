"""Training acceptance equals served acceptance: `DFlashTrainer`'s eval (`eval_acceptance_length`) is the acceptance
`hf-bdlm serve TARGET --draft DRAFTER` reports on the same prompts.

A tiny random Llama target (float64) answers prompts greedily; its answers, some ended by EOS and some by the token
budget, are captured (self-distillation): training records and held-out records. A 1-layer DFlash2 drafter trains a
few steps with the held-out capture as its eval set; the saved drafter is then served with the saved target, over
HTTP, on the held-out prompts with the same token budget, as concurrent requests (one ragged batch).

Checked:
- every served completion is the captured answer (the precondition: held-out records are the target's greedy output);
- each request's `usage.speculative` (verification steps, accepted tokens) equals the replay of that record, and the
  server's total (`/health`) equals the trainer's logged `eval_verification_steps` and `eval_acceptance_length`,
  exactly: in float64 the features the server computes step by step with a KV cache differ from the captured full
  forward by ~1e-15, far below any gap between two logits the drafter or target choose between, so every proposal
  and every greedy token is the same and the counts are integers;
- a mismatch is caught: acceptance measured at training's anchors (random positions, each with the true context)
  is another number, and serving with fewer proposals per step reports another number, which the eval reproduces
  when set to the same count.

Run: python -m pytest tests/models/dflash/test_acceptance.py -q
"""

from __future__ import annotations

import concurrent.futures
import json
import urllib.request

import pytest
import torch

openai = pytest.importorskip("openai", reason="the serving tests need the openai client (dev extra)")
pytest.importorskip("fastapi", reason="the serving tests need fastapi and uvicorn (serve extra)")


from hf_bdlm.models.dflash.training.acceptance import replay_acceptance, served_requests  # noqa: E402
from hf_bdlm.models.dflash.training.capture import FeatureStore, capture_features  # noqa: E402
from hf_bdlm.models.dflash.modeling import DFlash2DraftModel  # noqa: E402
from hf_bdlm.models.dflash.training.objectives import DFlashObjective, DFlashObjectiveConfig  # noqa: E402
from hf_bdlm.models.dflash.inference.speculative import draft_block  # noqa: E402
from hf_bdlm.models.dflash.training.trainer import DFlashTrainer  # noqa: E402
from hf_bdlm.models.dflash.training.config import DFlashTrainingConfig  # noqa: E402
from hf_bdlm.protocols.card_parts import format_value  # noqa: E402
from fixtures import openai_client, serve, tiny_target  # noqa: E402
from hf_bdlm.serving import Engine  # noqa: E402

from tiny_bdlm import MASK, VOCAB, tiny_tokenizer  # noqa: E402

BLOCK = 4
BUDGET = 16  # max_new_tokens of the self-distilled answers and of the served requests
LAYER_IDS = (1, 3)


def prompt_ids(tokenizer, i: int, length: int) -> list[int]:
    words = " ".join(f"w{7 + (i * 7 + j * 3) % 50}" for j in range(length))
    return list(tokenizer.apply_chat_template([{"role": "user", "content": words}], add_generation_prompt=True,
                                              tokenize=True, return_dict=True)["input_ids"])


def greedy_records(target, prompts: list[list[int]]) -> list[dict]:
    """The target's own greedy answers, one prompt at a time: prompt + answer (its EOS included), loss on the
    answer."""
    records = []
    for ids in prompts:
        out = target.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=BUDGET)[0, len(ids):].tolist()
        eos = target.generation_config.eos_token_id
        cut = next((i + 1 for i, t in enumerate(out) if t == eos), len(out))
        records.append({"input_ids": ids + out[:cut], "loss_mask": [0] * len(ids) + [1] * cut})
    return records


def pick_eos(answers: list[list[int]]) -> int:
    """The token that first appears latest (position >= 3) in some answer, and is absent from another."""
    best = None
    for answer in answers:
        for position, token in enumerate(answer):
            if position >= 3 and token not in answer[:position] and not all(token in a for a in answers):
                if best is None or position > best[0]:
                    best = (position, token)
                break
    assert best is not None, answers
    return best[1]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("acceptance")
    tokenizer = tiny_tokenizer()
    # A frozen float64 Llama with a head that separates tokens (initializer_range 0.02 leaves every softmax flat).
    target = tiny_target("llama", vocab_size=VOCAB, num_hidden_layers=4, max_position_embeddings=256, bos_token_id=2,
                         eos_token_id=3, pad_token_id=1, dtype=torch.float64, frozen=True, head_std=0.2)
    train_prompts = [prompt_ids(tokenizer, i, 1 + i % 7) for i in range(24)]
    held_prompts = [prompt_ids(tokenizer, 100 + i, 2 + (3 * i) % 8) for i in range(6)]
    # EOS: a token the target writes in the middle of some held-out answers (without EOS), so that some answers end
    # at it and others at the budget: the count's cut at a request's end is exercised both ways.
    target.generation_config.eos_token_id = None
    free = [r["input_ids"][len(p):] for r, p in zip(greedy_records(target, held_prompts), held_prompts)]
    target.generation_config.eos_token_id = pick_eos(free)
    target.generation_config.pad_token_id = 1
    train, held = greedy_records(target, train_prompts), greedy_records(target, held_prompts)
    ends = [r["input_ids"][-1] == target.generation_config.eos_token_id for r in held]
    assert any(ends) and not all(ends), ends
    for name, records in (("train", train), ("held", held)):
        capture_features(target, records, layer_ids=LAYER_IDS, out_dir=root / name, batch_size=4, progress=False,
                         target_id="tiny-llama")
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")

    torch.manual_seed(1)
    drafter = DFlash2DraftModel.from_target(target, init="target_layers", num_hidden_layers=1, block_size=BLOCK,
                                            mask_token_id=MASK, target_layer_ids=LAYER_IDS, selector_rank=8,
                                            selector_top_k=4, conv_group_size=8)
    args = DFlashTrainingConfig(str(root / "run"), eval_features_dir=str(root / "held"), max_steps=6,
                                eval_strategy="steps", eval_steps=6, logging_steps=3, per_device_train_batch_size=8,
                                per_device_eval_batch_size=4, optim="adamw_torch", learning_rate=3e-3,
                                max_anchors=8, dflash_loss="ce", save_strategy="no", report_to="none",
                                disable_tqdm=True, seed=0)
    trainer = DFlashTrainer(drafter, args, train_dataset=str(root / "train"), target=target,
                            processing_class=tokenizer)
    trainer.train()
    trainer.save_model(str(root / "drafter"))
    return {"root": root, "trainer": trainer, "target": target, "held": held, "held_prompts": held_prompts}


@pytest.fixture(scope="module")
def served(setup):
    """Each held-out prompt as its own concurrent request to the served target + drafter: completions, usages and
    the server's /health."""
    engine = Engine.from_pretrained(setup["root"] / "target", name="tiny", draft=setup["root"] / "drafter",
                                    dtype=torch.float64)
    with serve(engine, max_batch_size=8, max_queue=16, batch_wait_ms=200, max_tokens_limit=64,
               default_max_tokens=8) as server:
        client = openai_client(server, timeout=120)

        def ask(ids):
            return client.completions.create(model="tiny", prompt=ids, max_tokens=BUDGET, temperature=0)

        with concurrent.futures.ThreadPoolExecutor(len(setup["held_prompts"])) as pool:
            outs = list(pool.map(ask, setup["held_prompts"]))
        health = json.loads(urllib.request.urlopen(server.base_url.removesuffix("/v1") + "/health").read())
    return {"engine": engine, "outs": outs, "health": health}


def replay(setup, count=None):
    store = FeatureStore(setup["root"] / "held")
    drafter = setup["trainer"].model
    requests = []
    for i in range(len(store)):
        ids, mask = store.record(i)
        (start, stop), = served_requests(ids, mask)
        requests.append((ids.long(), store.features(i), start, stop))
    return replay_acceptance(drafter, requests, count)


def test_served_completions_are_the_captured_answers(setup, served):
    tokenizer = served["engine"].tokenizer
    for record, prompt, out in zip(setup["held"], setup["held_prompts"], served["outs"]):
        answer = record["input_ids"][len(prompt):]
        assert out.usage.completion_tokens == len(answer)
        assert out.choices[0].text == tokenizer.decode(answer, skip_special_tokens=True)


def test_each_requests_served_acceptance_is_its_replay(setup, served):
    replayed = replay(setup)
    usages = [out.usage.model_extra["speculative"] for out in served["outs"]]
    assert usages == [counts.as_dict() for counts in replayed]
    # Proposals get accepted, and not all: a check with teeth.
    steps = sum(u["verification_steps"] for u in usages)
    accepted = sum(u["accepted_tokens"] for u in usages)
    assert 0 < accepted < (BLOCK - 1) * steps


def test_training_eval_acceptance_equals_the_servers(setup, served):
    trainer = setup["trainer"]
    logged = [h for h in trainer.state.log_history if "eval_acceptance_length" in h]
    assert len(logged) == 1 and logged[0]["step"] == 6  # logged by the eval during training
    health = served["health"]["speculative"]
    assert logged[0]["eval_verification_steps"] == health["verification_steps"]
    assert logged[0]["eval_acceptance_length"] == health["acceptance_length"]
    again = trainer.evaluate()
    assert again["eval_acceptance_length"] == health["acceptance_length"]
    assert 1.0 < health["acceptance_length"] < BLOCK
    card = (setup["root"] / "drafter" / "README.md").read_text()
    shown = format_value(round(health["acceptance_length"], 3))
    assert f"| Held-out acceptance length (greedy, counted as served) | {shown} |" in card


def test_acceptance_at_trainings_anchors_is_another_number(setup, served):
    """What a per-anchor metric at the objective's random anchors reports (each block with the true context before
    it, accepted prefix + 1, cut at the record's end) is not what serving reaches."""
    store = FeatureStore(setup["root"] / "held")
    drafter = setup["trainer"].model
    objective = DFlashObjective(DFlashObjectiveConfig(block_size=BLOCK, mask_token_id=MASK, max_anchors=8,
                                                      anchor_sampling="uniform", seed=0))
    lengths = []
    with torch.no_grad():
        for i in range(len(store)):
            ids, mask = store.record(i)
            ids = ids.long()
            anchors = objective.prepare(ids[None], mask[None].long(), step=0)
            positions = anchors.anchor_positions[0][anchors.anchor_valid[0]]
            for a in positions.tolist():
                proposals = draft_block(drafter, store.features(i)[None], ids[None], torch.tensor([a]))[0]
                expected = ids[a + 1:a + BLOCK]
                hits = (proposals[:len(expected)] == expected).long().cumprod(0).sum()
                lengths.append(min(int(hits) + 1, len(ids) - 1 - a))
    at_anchors = sum(lengths) / len(lengths)
    assert at_anchors != pytest.approx(served["health"]["speculative"]["acceptance_length"], abs=0.05)


def test_fewer_proposals_served_and_evaluated_alike(setup, served):
    """Served with --num-speculative-tokens 1, the acceptance differs from the default's, and the eval set to the
    same count reproduces it."""
    engine = Engine.from_pretrained(setup["root"] / "target", name="tiny", draft=setup["root"] / "drafter",
                                    dtype=torch.float64, num_speculative_tokens=1)
    with serve(engine, max_batch_size=8, max_tokens_limit=64) as server:
        client = openai_client(server, timeout=120)
        outs = [client.completions.create(model="tiny", prompt=ids, max_tokens=BUDGET, temperature=0)
                for ids in setup["held_prompts"]]
    usages = [out.usage.model_extra["speculative"] for out in outs]
    assert usages == [counts.as_dict() for counts in replay(setup, 1)]
    one = engine.acceptance.acceptance_length
    assert one != served["health"]["speculative"]["acceptance_length"]
    trainer = setup["trainer"]
    trainer.args.eval_num_speculative_tokens = 1
    try:
        assert trainer.evaluate()["eval_acceptance_length"] == one
    finally:
        trainer.args.eval_num_speculative_tokens = None
