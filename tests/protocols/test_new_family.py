"""A fourth family is one folder and one registry line: a made-up family, written into a temporary package outside
hf_bdlm (a configuration, a model, a training role and a serving role), registered with one call, trains one step
with `BDLMSFTTrainer`, serves one request through `hf-bdlm serve`'s server, and is refused by name by every role it
lacks (drafting, evaluation, planning) — with no edit anywhere in hf_bdlm.
"""

from __future__ import annotations

import json
import sys
import textwrap

import httpx
import pytest
import torch

pytest.importorskip("fastapi", reason="serving a request needs fastapi and uvicorn (serve extra)")

from hf_bdlm.protocols import registry  # noqa: E402
from hf_bdlm.protocols.entry import ROLE_KINDS, RoleUnavailable  # noqa: E402
from tiny_bdlm import VOCAB, tiny_tokenizer  # noqa: E402

# The family's folder: every file it needs, and nothing in hf_bdlm changes.
FOLDER = {
    "__init__.py": '"""toy: a made-up block-diffusion family (one embedding, one linear head)."""\n',
    "configuration.py": '''
        from transformers import PretrainedConfig


        class ToyConfig(PretrainedConfig):
            model_type = "toy_bdlm"

            def __init__(self, vocab_size=64, hidden_size=16, block_size=4, mask_token_id=63, **kwargs):
                self.vocab_size, self.hidden_size = vocab_size, hidden_size
                self.block_size, self.mask_token_id = block_size, mask_token_id
                super().__init__(**kwargs)
        ''',
    "modeling.py": '''
        import torch
        from torch import nn
        from transformers import PreTrainedModel
        from transformers.modeling_outputs import MaskedLMOutput

        from .configuration import ToyConfig


        class ToyModel(PreTrainedModel):
            config_class = ToyConfig

            def __init__(self, config):
                super().__init__(config)
                self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
                self.head = nn.Linear(config.hidden_size, config.vocab_size)
                self.post_init()

            def forward(self, input_ids, **kwargs):
                return MaskedLMOutput(logits=self.head(torch.tanh(self.embed(input_ids))))
        ''',
    "family.py": '''
        from dataclasses import dataclass

        import torch

        from hf_bdlm.objectives import Objective, supervised_mask
        from hf_bdlm.protocols.decoding import ServingDecoder
        from hf_bdlm.protocols.entry import ModelFamily
        from hf_bdlm.protocols.roles import LossStep, ServingSpec, TrainingSpec
        from hf_bdlm.protocols.step import unwrap_model

        from .modeling import ToyModel


        @dataclass
        class ToyBatch:
            noisy_ids: torch.Tensor
            targets: torch.Tensor  # the clean token where a supervised token was masked, else -100
            normalizer: float


        class ToyObjective(Objective):
            """Masks each supervised token with probability 1/2, drawn from (seed, step)."""

            name = "toy_masked"

            def corrupt(self, batch, *, seed, step):
                ids, supervised = batch["input_ids"], supervised_mask(batch)
                draw = torch.rand(ids.shape, generator=torch.Generator().manual_seed(seed * 1000 + step))
                masked = supervised & (draw < 0.5)
                targets = torch.where(masked, ids, torch.full_like(ids, -100))
                noisy = torch.where(masked, torch.full_like(ids, self.mask_token_id), ids)
                return ToyBatch(noisy, targets, float(masked.sum()))


        class ToyStep(LossStep):
            def __init__(self, objective):
                self.objective = objective

            def __call__(self, runner, corrupted, optional_pass=None):
                logits = runner(input_ids=corrupted.noisy_ids).logits.float()
                picked = corrupted.targets != -100
                loss_sum = torch.nn.functional.cross_entropy(logits[picked], corrupted.targets[picked],
                                                             reduction="sum")
                metrics = {"loss_sum": loss_sum.detach(), "count": picked.sum(),
                           "correct": (logits[picked].argmax(-1) == corrupted.targets[picked]).sum()}
                return loss_sum / corrupted.normalizer, metrics

            def zero(self, runner, inputs, optional_pass=None):
                return runner(input_ids=inputs["input_ids"]).logits.sum() * 0.0


        class ToyTraining(TrainingSpec):
            def objective_class(self, name):
                return ToyObjective

            def step(self, model, args, tokenizer, plugin):
                config = unwrap_model(model).config
                return ToyStep(ToyObjective(block_size=config.block_size, mask_token_id=config.mask_token_id))


        @dataclass(frozen=True)
        class ToySettings:
            max_new_tokens: int
            eos: int


        class ToyDecoder(ServingDecoder):
            """One block of [MASK]s at a time, filled by argmax in one forward."""

            def __init__(self, model, tokenizer):
                self.model, self.eos, self.context_length = model.eval(), tokenizer.eos_token_id, 256

            def settings(self, request, prompt_len, max_tokens):
                return ToySettings(max_tokens, self.eos)

            def batch_key(self, settings, seed):
                return ("toy",)

            def eos_token_ids(self, settings):
                return {settings.eos}

            def decode(self, prompts, settings, seeds, on_block):
                block, mask = self.model.config.block_size, self.model.config.mask_token_id
                for row, (prompt, s) in enumerate(zip(prompts, settings)):
                    ids = list(prompt)
                    for _ in range(0, s.max_new_tokens, block):
                        with torch.no_grad():
                            logits = self.model(input_ids=torch.tensor([ids + [mask] * block])).logits
                        new = logits[0, -block:, :mask].argmax(-1).tolist()
                        ids += new
                        if row in (on_block({row: new}) or ()):
                            break


        class ToyServing(ServingSpec):
            def load(self, path, config, init_kwargs, block_size):
                from transformers import AutoTokenizer

                return ToyModel.from_pretrained(path), AutoTokenizer.from_pretrained(path)

            def decoder(self, model, tokenizer):
                return ToyDecoder(model, tokenizer)


        class ToyFamily(ModelFamily):
            name = "toy"
            roles = {"training": ToyTraining, "serving": ToyServing}

            def claims_model(self, model):
                return isinstance(unwrap_model(model), ToyModel)

            def block_size(self, model):
                return int(unwrap_model(model).config.block_size)
        ''',
}


@pytest.fixture
def toy_family(tmp_path_factory):
    root = tmp_path_factory.mktemp("toy_pkg")
    (root / "toyfam").mkdir()
    for name, text in FOLDER.items():
        (root / "toyfam" / name).write_text(textwrap.dedent(text))
    sys.path.insert(0, str(root))
    from transformers import AutoConfig

    from toyfam.configuration import ToyConfig

    AutoConfig.register("toy_bdlm", ToyConfig, exist_ok=True)
    line = registry.FamilyEntry("toy", ("toy_bdlm",), ("toy_masked",), "toyfam.family", "ToyFamily")
    registry.register_family(line)  # the one registry line
    try:
        yield registry.family_named("toy")
    finally:
        registry.unregister_family("toy")
        sys.path.remove(str(root))
        for module in [m for m in sys.modules if m == "toyfam" or m.startswith("toyfam.")]:
            del sys.modules[module]


def toy_model(seed=0):
    from toyfam.configuration import ToyConfig
    from toyfam.modeling import ToyModel

    torch.manual_seed(seed)
    return ToyModel(ToyConfig(vocab_size=VOCAB, mask_token_id=VOCAB - 1))


def test_a_registered_family_trains_one_step_through_its_own_step(toy_family, tmp_path, monkeypatch):
    from datasets import Dataset

    from hf_bdlm import BDLMSFTConfig, BDLMSFTTrainer

    rows = [{"prompt": f"w{7 + i} w{8 + i}", "completion": f" w{9 + i} w{10 + i} w{11 + i}"} for i in range(4)]
    args = BDLMSFTConfig(output_dir=str(tmp_path / "run"), report_to="none", max_steps=1, logging_steps=1,
                         per_device_train_batch_size=4, learning_rate=0.5, optim="sgd", save_strategy="no",
                         activation_checkpointing=False,
                         disable_tqdm=True, seed=1, max_length=32)
    model = toy_model()
    before = model.head.weight.detach().clone()
    trainer = BDLMSFTTrainer(model, args=args, train_dataset=Dataset.from_list(rows),
                             processing_class=tiny_tokenizer())
    assert trainer.family is toy_family and type(trainer.step).__name__ == "ToyStep"
    calls, step = [], type(trainer.step).__call__
    monkeypatch.setattr(type(trainer.step), "__call__", lambda self, *a, **k: calls.append(1) or step(self, *a, **k))
    trainer.train()
    loss = trainer.state.log_history[0]["loss"]
    assert calls == [1] and 0 < loss < 10, (calls, trainer.state.log_history)
    assert not torch.equal(before, model.head.weight), "one SGD step changes the head"


def test_a_registered_family_serves_one_request_and_is_refused_by_the_roles_it_lacks(toy_family, tmp_path):
    from hf_bdlm.evaluation.lm_eval_model import load_for_evaluation
    from hf_bdlm.planner.model import spec_from_config
    from hf_bdlm.serving import Engine, ServerConfig, ServerThread

    folder = tmp_path / "toy"
    toy_model().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    engine = Engine.from_pretrained(folder, name="toy")
    assert type(engine.decoder).__name__ == "ToyDecoder"
    with ServerThread(engine, ServerConfig(port=0, api_key="k", default_max_tokens=8)) as server:
        reply = httpx.post(server.base_url + "/completions", headers={"Authorization": "Bearer k"}, timeout=60,
                           content=json.dumps({"model": "toy", "prompt": "w9 w10", "max_tokens": 8}))
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["usage"]["completion_tokens"] >= 1 and isinstance(body["choices"][0]["text"], str)

    lacking = [kind for kind in ROLE_KINDS if not toy_family.has_role(kind)]
    assert lacking == ["drafting", "evaluation", "planning", "policy"]
    for kind in lacking:
        with pytest.raises(RoleUnavailable, match=f"'toy' family: this family has no {kind} role"):
            toy_family.role(kind)
    # ... and every host that needs one of them says so, naming the folder.
    with pytest.raises(RoleUnavailable, match=f"{folder} holds a 'toy' checkpoint: this family has no evaluation"):
        load_for_evaluation(str(folder), None, None, 4)
    with pytest.raises(RoleUnavailable, match="this family has no drafting role"):
        Engine.from_pretrained(folder, draft=folder)
    with pytest.raises(RoleUnavailable, match="this family has no planning role"):
        spec_from_config(json.loads((folder / "config.json").read_text()), "toy")
