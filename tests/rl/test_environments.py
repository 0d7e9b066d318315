"""Agentic environments (TRL's ``environment_factory``) played by a block-diffusion LM, in process and served.

The environment is :class:`Counter`: one tool, ``add(n)``, that adds ``n`` to a running total and returns it; the
environment owns its reward (``get_reward``: the total). The policy is the tests' tiny BDLM (tests/tiny_bdlm.py's
shape), trained here for a few seconds on agent transcripts in a tool-call syntax of a word-level tokenizer:

    <s> system add </s> <s> user w41 w50 </s>
    <s> assistant <tool_call> {"name": "add", "arguments": {"n": 4 }} </tool_call> </s> <s> tool 4 </s>
    <s> assistant <tool_call> {"name": "add", "arguments": {"n": 3 }} </tool_call> </s> <s> tool 7 </s>
    <s> assistant done </s>

(``n`` uniform on 1..5), so its rollouts call the tool twice, then answer. Nothing in the rollouts is scripted: the
tool calls are what the decoder samples, parsed by TRL (the tokenizer's ``response_template``) or by the server
(hf_bdlm/serving/tools.py, Hermes JSON), and each call runs the environment's method with the parsed arguments.

- in process: one generation round of ``BDLMGRPOTrainer`` (``coupled`` and ``one_step``; ``trace`` is refused with
  tools, test_grpo.py): every rollout's calls reached its environment with the arguments its completion holds, the
  tool's output tokens are in the completion with tool mask 0 and out of the loss, the rewards differ; a GRPO step
  on them trains (finite loss, weights move);
- served: the same model by ``hf-bdlm serve`` (the OpenAI-compatible server, in a thread), an episode played through
  the ``openai`` client: the server returns ``tool_calls``, the client runs them on a Counter and sends the results
  back as ``tool`` messages, until the model answers.
"""

from __future__ import annotations

import copy
import json
import random
import re
from contextlib import contextmanager

import pytest
import torch
from datasets import Dataset
from fixtures import openai_client, serve, word_tokenizer
from tiny_bdlm import MASK, tiny_bdlm
from tokenizers import AddedToken
from transformers.utils import get_json_schema

from hf_bdlm.objectives import get_objective
from hf_bdlm.rl import BDLMGRPOConfig, BDLMGRPOTrainer
from hf_bdlm.serving import Engine


class Counter:
    """The environment: a running total that the ``add`` tool moves; the reward is the total."""

    def __init__(self):
        self.total = 0
        self.calls: list = []

    def reset(self, **kwargs) -> None:
        self.total = 0
        self.calls = []

    def add(self, n: int) -> int:
        """Add a number to the counter.

        Args:
            n: the number to add.

        Returns:
            The counter's new total.
        """
        self.calls.append(n)
        self.total += n
        return self.total

    def get_reward(self) -> float:
        return float(self.total)


# --- the tokenizer: a word-level vocabulary whose tool calls are Hermes JSON in a few tokens ---------------------
CALL_TOKENS = ['<tool_call>', '</tool_call>', '{"name":', '"add",', '"arguments":', '{"n":', '}}']
WORDS = ["[UNK]", "[PAD]", "<s>", "</s>", "user", "assistant", "system", "tool", "add", "done", *CALL_TOKENS,
         *(str(i) for i in range(21))]
WORDS += [f"w{i}" for i in range(len(WORDS), MASK)] + ["<|mask|>"]
EOS = WORDS.index("</s>")
# Tools go in a system turn (their names); an assistant turn holds its content and its calls; a tool turn its output.
CHAT_TEMPLATE = (
    "{% if tools %}<s> system{% for t in tools %} {{ t['function']['name'] }}{% endfor %} </s> {% endif %}"
    "{% for m in messages %}<s> {{ m['role'] }}{% if m['content'] %} {{ m['content'] }}{% endif %}"
    "{% for c in m['tool_calls'] or [] %} <tool_call> {\"name\": {{ c['function']['name'] | tojson }}, "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}} </tool_call>{% endfor %} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s> assistant {% endif %}"
)
# How TRL parses a completion into an assistant message (transformers' response templates; TRL ships them for known
# chat templates only): calls between <tool_call> and </tool_call>, JSON; the rest, up to </s>, content.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<s> assistant",
    "fields": {
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"</s>\s*", "content": "text"},
    },
}


def agent_tokenizer():
    tokenizer = word_tokenizer(WORDS, CHAT_TEMPLATE, pad_token="[PAD]", bos_token="<s>", eos_token="</s>",
                               mask_token="<|mask|>")
    tokenizer.add_tokens([AddedToken(t, normalized=False) for t in CALL_TOKENS])  # their ids stay WORDS'
    tokenizer.response_template = RESPONSE_TEMPLATE
    return tokenizer


# --- the model: the tiny BDLM trained on transcripts -------------------------------------------------------------
def call(n: int) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                                                                "function": {"name": "add", "arguments": {"n": n}}}]}


def transcript(rng: random.Random) -> list[dict]:
    a, b = rng.randint(1, 5), rng.randint(1, 5)
    words = " ".join(f"w{rng.randint(40, 62)}" for _ in range(rng.randint(1, 3)))
    return [{"role": "user", "content": words}, call(a), {"role": "tool", "name": "add", "content": str(a)},
            call(b), {"role": "tool", "name": "add", "content": str(a + b)}, {"role": "assistant", "content": "done"}]


def turn_rows(tokenizer, messages, block: int) -> list[tuple[list[int], list[int]]]:
    """One training row per assistant turn, as the decoder meets it: the conversation before the turn (clean), the
    turn, then EOS to its block's end (supervised): no later turn's tokens sit in the turn's last block."""
    rows = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        render = dict(tools=[Counter.add], tokenize=True, return_dict=True)
        prefix = tokenizer.apply_chat_template(messages[:k], add_generation_prompt=True, **render)["input_ids"]
        whole = tokenizer.apply_chat_template(messages[:k + 1], **render)["input_ids"]
        turn = whole[len(prefix):whole.index(EOS, len(prefix)) + 1]
        turn += [EOS] * (-(len(prefix) + len(turn)) % block)
        rows.append((prefix + turn, [0] * len(prefix) + [1] * len(turn)))
    return rows


@contextmanager
def one_thread():
    """A model this small runs fastest on one thread (two threads of tiny matmuls mostly wait for each other)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def train_agent(tokenizer, steps: int = 200, lr: float = 6e-3, transcripts: int = 6):
    """The tiny BDLM after ``steps`` AdamW steps of the standard objective on transcripts (measured: 8-25 s on one
    thread of a shared 2-core CPU; 16 of 16 rollouts then call twice and answer)."""
    model = tiny_bdlm(seed=0)
    model.generation_config.eos_token_id = EOS
    block = model.config.block_size
    objective = get_objective("standard", model.config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(0)
    model.train()
    with one_thread():
        for step in range(steps):
            rows = [row for _ in range(transcripts) for row in turn_rows(tokenizer, transcript(rng), block)]
            length = max(len(ids) for ids, _ in rows)
            ids = torch.full((len(rows), length), tokenizer.pad_token_id, dtype=torch.long)
            supervised, attention = torch.zeros_like(ids), torch.zeros_like(ids)
            for i, (row, sup) in enumerate(rows):
                ids[i, :len(row)], supervised[i, :len(row)], attention[i, :len(row)] = torch.tensor(row), \
                    torch.tensor(sup), 1
            batch = {"input_ids": ids, "completion_mask": supervised, "attention_mask": attention}
            loss, _ = objective.loss(model, objective.corrupt(batch, seed=0, step=step))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model.eval()


@pytest.fixture(scope="module")
def agent():
    tokenizer = agent_tokenizer()
    return train_agent(tokenizer), tokenizer


# --- in process: BDLMGRPOTrainer with environment_factory ---------------------------------------------------------
PROMPTS = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"w{40 + i}"}] for i in range(8)]})
ARGUMENT = re.compile(r'\{"n": (\d+) \}\}')


def agent_trainer(model, tokenizer, estimator: str) -> BDLMGRPOTrainer:
    args = BDLMGRPOConfig(output_dir="unused", per_device_train_batch_size=16, num_generations=4,
                          max_completion_length=48, max_tool_calling_iterations=3, num_iterations=2,
                          logp_estimator=estimator, temperature=1.0, confidence_threshold=0.9, learning_rate=1e-3,
                          beta=0.0, seed=0, max_steps=1, report_to=[], use_cpu=True, bf16=False, save_strategy="no",
                          logging_steps=1, disable_tqdm=True)
    return BDLMGRPOTrainer(model, args=args, train_dataset=PROMPTS, processing_class=tokenizer,
                           environment_factory=Counter)


def segments(mask: list[int]) -> list[tuple[int, int, int]]:
    """``(value, start, end)`` of each run of equal values."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((mask[start], start, i))
            start = i
    return runs


@pytest.mark.filterwarnings("ignore:You are using 'environment_factory'")
@pytest.mark.parametrize("estimator", ["coupled", "one_step"])
def test_grpo_plays_counter_episodes_with_tool_calls_and_trains(agent, estimator):
    model, tokenizer = agent
    with one_thread():
        trainer = agent_trainer(copy.deepcopy(model), tokenizer, estimator)
        trainer.model.train()
        G = trainer.args.num_generations
        inputs = [PROMPTS[i] for i in range(trainer.args.generation_batch_size // G) for _ in range(G)]
        batch = trainer._generate_and_score_completions(inputs)  # one round, as TRL's _prepare_inputs makes it
        environments = list(trainer.environments)  # the round's, one per rollout, in the batch's order

        answered = 0
        for i, env in enumerate(environments):
            n = int(batch["completion_mask"][i].sum())
            ids = batch["completion_ids"][i, :n].tolist()
            tool_mask = batch["tool_mask"][i, :n].tolist()
            # The environment ran each call with the argument the model wrote, parsed to the tool's type.
            assert env.calls == [int(a) for a in ARGUMENT.findall(tokenizer.decode(ids))], tokenizer.decode(ids)
            assert all(type(a) is int for a in env.calls)
            # The tool's outputs are in the completion (the template's tool turn, then the next assistant header),
            # exactly where the tool mask is 0; the model's turns (tool mask 1) hold no tool output.
            outputs = [tokenizer.decode(ids[s:e]) for v, s, e in segments(tool_mask) if v == 0]
            totals = [sum(env.calls[:k + 1]) for k in range(len(env.calls))]
            assert outputs == [f"<s> tool {t} </s> <s> assistant" for t in totals]
            turns = [tokenizer.decode(ids[s:e]) for v, s, e in segments(tool_mask) if v == 1]
            assert len(turns) == len(env.calls) + 1
            answered += len(env.calls) == 2 and turns[-1] == "done </s>"
        assert answered >= 12, f"{answered} of 16 rollouts called twice then answered"  # measured: 16
        assert batch["advantages"].abs().sum() > 0  # the totals, hence the rewards, differ within groups

        # The tool mask keeps the tool's tokens out of the loss: the old log-probabilities there do not move it.
        trainer.current_gradient_accumulation_steps = 1
        tool = (batch["completion_mask"] * (1 - batch["tool_mask"])).bool()
        model_token = (batch["completion_mask"] * batch["tool_mask"]).bool()

        def loss_with(old, **fields) -> float:
            with torch.no_grad():
                return float(trainer._compute_loss(trainer.model, {**batch, "old_per_token_logps": old, **fields}))

        old = batch["old_per_token_logps"]  # [rows, num_iterations, C]: iteration 0's equal the current ones
        base = loss_with(old)
        assert loss_with(old + 3.0 * tool[:, None]) == base
        assert loss_with(old + 0.05 * model_token[:, None]) != base
        assert loss_with(old + 3.0 * tool[:, None], tool_mask=torch.ones_like(batch["tool_mask"])) != base

        # A GRPO step over fresh rollouts trains.
        before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
        trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 1 and torch.isfinite(torch.tensor(logged[0]["loss"]))
    assert logged[0]["tools/call_frequency"] > 1 and logged[0]["tools/failure_frequency"] == 0
    assert any(not torch.equal(before[name], p) for name, p in trainer.model.named_parameters())


# --- served: hf-bdlm serve and the openai client ------------------------------------------------------------------
def tool_schemas(environment) -> list[dict]:
    """The environment's tools as OpenAI ``tools`` (its public methods but ``reset`` and ``get_reward``, as TRL
    exposes them)."""
    names = [n for n, v in vars(type(environment)).items()
             if callable(v) and not n.startswith("_") and n not in ("reset", "get_reward")]
    return [get_json_schema(getattr(environment, n)) for n in names]


def play_served_episode(client, model: str, environment, prompt: list[dict], max_turns: int = 4, **sampling):
    """Chat with the served model, running each tool call it returns on ``environment``, until it answers without
    one (or ``max_turns``). Returns the messages."""
    messages, tools = list(prompt), tool_schemas(environment)
    for _ in range(max_turns):
        reply = client.chat.completions.create(model=model, messages=messages, tools=tools, **sampling)
        message = reply.choices[0].message
        calls = message.tool_calls or []
        messages.append({"role": "assistant", "content": message.content,
                         **({"tool_calls": [c.model_dump() for c in calls]} if calls else {})})
        if not calls:
            break
        assert reply.choices[0].finish_reason == "tool_calls"
        for c in calls:
            result = getattr(environment, c.function.name)(**json.loads(c.function.arguments))
            messages.append({"role": "tool", "tool_call_id": c.id, "name": c.function.name, "content": str(result)})
    return messages


def test_the_served_model_plays_a_counter_episode(agent, tmp_path):
    model, tokenizer = agent
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    environment = Counter()
    environment.reset()
    with one_thread(), serve(Engine.from_pretrained(tmp_path, name="counter-agent")) as server:
        messages = play_served_episode(openai_client(server), "counter-agent", environment,
                                       [{"role": "user", "content": "w41 w50"}], temperature=1.0, seed=3,
                                       max_tokens=16)
    roles = [m["role"] for m in messages]
    assert roles == ["user", "assistant", "tool", "assistant", "tool", "assistant"], messages
    calls = [json.loads(m["tool_calls"][0]["function"]["arguments"]) for m in messages if m.get("tool_calls")]
    assert environment.calls == [c["n"] for c in calls] and all(1 <= n <= 5 for n in environment.calls)
    assert [m["content"] for m in messages if m["role"] == "tool"] == \
        [str(sum(environment.calls[:k + 1])) for k in range(2)]
    assert messages[-1]["content"] == "done"
