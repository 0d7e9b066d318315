"""One DFlash / DFlash2 training step end to end against the paper's implementation (``dllm_parallel``, the oracle):
the same weights, target features, tokens, loss mask and anchors give the same loss and the same gradient for every
trainable tensor.

Ours: ``DFlashObjective.prepare`` draws the anchors of ``(seed, step)``, the slots valid in some sample are kept (as
``DFlashTrainer`` does), the drafter's forward gives the final hidden states, ``DFlashObjective.loss_from_hidden`` the
loss through the target's frozen head (with the drafter's output multiplier, soft cap and, for D-PACE, its candidate
selector). The oracle: its training task ``DFlashTrainingTask`` (``prepare`` with its generator set to the state our
``(seed, step)`` gives: it draws the anchors, keeps the slots valid in some sample and passes the whole batch's
supervised counts as the normaliser; ``forward``; ``loss``, i.e. the model's ``distributed_dflash_loss``) on the oracle
model loaded with our weights. The oracle's attention kernel needs CUDA: it runs with the dense CPU attention of
tests/dflash_oracle.py (the oracle's own mask predicate); all the rest is the oracle's code.

Precision. Everything is float64, but the oracle's loss kernels compute the vocabulary softmax and accumulate the loss
in float32 whatever the input dtype, so it is compared twice:

- as it is, to float32 rounding;
- with float32 lifted to float64 (``oracle_float32_as_float64``: the same code, with ``torch.float32`` in its loss
  modules and ``Tensor.float()`` meaning float64), to float64 rounding: loss within 1e-10 relative, every gradient
  within 1e-9 of the tensor's largest entry.

Measured (max |diff| / max |oracle value|, per tensor for gradients, worst tensor):

================  ==========================  ============================
case              lifted: loss / gradients    as it is: loss / gradients
================  ==========================  ============================
dflash2_dpace     4.1e-16 / 1.6e-14           2.0e-07 / 2.0e-07
dflash2_ce        0 / 8.7e-15                 1.1e-07 / 2.4e-07
dflash_ce         0 / 3.0e-15                 1.3e-07 / 3.4e-07
================  ==========================  ============================

Run: ``python -m pytest tests/models/dflash/test_reference_loss.py -q`` (a few seconds on CPU).
"""

from __future__ import annotations

import contextlib
import importlib
import types

import pytest
import torch

from hf_bdlm.attention.rows import document_starts
from hf_bdlm.models.dflash.training.objectives import (
    DFlashObjective,
    DFlashObjectiveConfig,
    active_anchor_slots,
    anchor_generator,
    select_anchors,
)

pytest.importorskip("dllm_parallel.core.models.backbones.dflash.training", reason="the oracle dllm_parallel is absent")
from dllm_parallel.core.models.backbones.dflash.training import DFlashTrainingTask  # noqa: E402
from dflash_oracle import (  # noqa: E402
    BLOCK,
    VOCAB,
    drafter,
    drafter_config,
    features_for,
    qwen3_target,
    reference_of,
)

# The oracle's modules on the loss path (its forward and backward), imported by path: the kernels package also exports
# functions named like two of these modules.
ORACLE_LOSS_MODULES = [importlib.import_module(f"dllm_parallel.core.{name}") for name in (
    "models.backbones.dflash.model", "models.backbones.dflash.dflash2", "kernels.dflash_linear_topk",
    "kernels.tiled_linear_cross_entropy")]
MASK_ID = VOCAB - 1
LENGTH, ANCHORS = 32, 8
SEED, STEP = 3, 5
# The oracle's names of our losses.
ORACLE_LOSS = {"dpace": "dpace", "ce": "paper_ce"}

CASES = {
    # The production DFlash2 objective: D-PACE with the lambda CE/TV mix and the candidate selector (settings away
    # from their defaults, so a forgotten one shows); a sliding and a full layer; output multiplier and soft cap.
    "dflash2_dpace": dict(
        config=dict(dflash2=True, layer_types=["sliding_attention", "full_attention"], sliding_window=5,
                    selector_top_k=16, output_multiplier=0.8, final_logit_softcapping=6.0),
        objective=dict(loss="dpace", anchor_sampling="locality", dpace_alpha=0.3, lk_loss_type="lambda",
                       kl_scale=0.9, kl_decay=1.5, selector_loss_alpha=0.7),
    ),
    # The oracle's "paper_ce" applies the soft cap but not output_multiplier: the multiplier stays 1 here.
    "dflash2_ce": dict(config=dict(dflash2=True, final_logit_softcapping=6.0),
                       objective=dict(loss="ce", anchor_sampling="uniform")),
    "dflash_ce": dict(config=dict(dflash2=False, layer_types=["sliding_attention"] * 2, sliding_window=6),
                      objective=dict(loss="ce", anchor_sampling="uniform")),
}


def packed_tokens():
    """Two rows of packed documents (positions restarting per document) with prompts outside the loss mask; row 0 has
    24 valid anchors, row 1 (a padded tail, document ``-1``) only 7: fewer than its 8 slots."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, MASK_ID, (2, LENGTH), generator=g)
    docs = torch.zeros(2, LENGTH, dtype=torch.long)
    docs[0, 13:], docs[1, 9:], docs[1, 27:] = 1, 1, -1
    loss_mask = torch.ones(2, LENGTH, dtype=torch.long)
    loss_mask[0, :3], loss_mask[0, 13:16] = 0, 0
    loss_mask[1, :5], loss_mask[1, 9:22], loss_mask[1, 27:] = 0, 0, 0
    positions = torch.arange(LENGTH).expand(2, -1) - document_starts(docs)
    return ids, loss_mask, docs, positions


class _TorchWithFloat64(types.ModuleType):
    """``torch``, except that ``float32`` is float64."""

    def __getattr__(self, name: str):
        return torch.float64 if name == "float32" else getattr(torch, name)


@contextlib.contextmanager
def oracle_float32_as_float64():
    """Run the oracle's loss code (forward and backward) with its float32 buffers and casts in float64."""
    with pytest.MonkeyPatch.context() as patch:
        lifted = _TorchWithFloat64("torch")
        for module in ORACLE_LOSS_MODULES:
            patch.setattr(module, "torch", lifted)
        patch.setattr(torch.Tensor, "float", torch.Tensor.double)
        yield


def grads_by_oracle_name(model: torch.nn.Module, grads) -> dict[str, torch.Tensor | None]:
    """Our gradients under the oracle's parameter names (it packs q/k/v and gate/up into one weight each)."""
    ours = dict(zip([name for name, _ in model.named_parameters()], grads))
    for name in list(ours):
        prefix = name.rsplit(".", 2)[0] + "."
        if name.endswith("self_attn.q_proj.weight"):
            ours[prefix + "packed_weight"] = torch.cat([ours[prefix + f"{x}_proj.weight"] for x in "qkv"])
        elif name.endswith("mlp.gate_proj.weight"):
            ours[prefix + "packed_weight"] = torch.cat([ours[prefix + f"{x}_proj.weight"] for x in ("gate", "up")])
    return ours


def worst_relative_gap(ours: dict, theirs: dict) -> float:
    """The largest ``max |ours - theirs| / max |theirs|`` over the tensors; both sides must leave the same ones
    without a gradient."""
    worst = 0.0
    for name, expected in theirs.items():
        mine = ours[name]
        assert (mine is None) == (expected is None), name
        if expected is not None:
            assert mine.shape == expected.shape and torch.isfinite(mine).all(), name
            scale = expected.abs().max().clamp_min(torch.finfo(expected.dtype).tiny)
            worst = max(worst, ((mine - expected).abs().max() / scale).item())
    return worst


@pytest.mark.parametrize("case", list(CASES))
def test_training_step_loss_and_gradients_equal_the_reference(case, tmp_path):
    settings = CASES[case]
    target = qwen3_target().double()
    config = drafter_config(**settings["config"])
    model = drafter(config, target)
    oracle = reference_of(model, target, tmp_path)
    ids, loss_mask, docs, positions = packed_tokens()
    features = features_for(config, *ids.shape)
    loss_name = settings["objective"]["loss"]

    # Ours.
    objective = DFlashObjective(DFlashObjectiveConfig(mask_token_id=MASK_ID, block_size=BLOCK, max_anchors=ANCHORS,
                                                      seed=SEED, chunk_rows=5, **settings["objective"]))
    batch = objective.prepare(ids, loss_mask, docs, step=STEP)
    share = select_anchors(batch, active_anchor_slots(batch))
    out = model(features, ids, share.anchor_positions, anchor_valid=share.anchor_valid, position_ids=positions,
                document_ids=docs, return_logits=False)
    selector = model.candidate_selector if loss_name == "dpace" else None
    loss = objective.loss_from_hidden(out.hidden_states, model.lm_head.weight, share,
                                      output_multiplier=config.output_multiplier,
                                      logit_softcap=config.final_logit_softcapping, selector=selector)
    ours = grads_by_oracle_name(model, torch.autograd.grad(loss, list(model.parameters()), allow_unused=True))

    # The oracle's training step on the same data, its anchors drawn from our (seed, step)'s generator state.
    o = settings["objective"]
    task = DFlashTrainingTask(
        block_size=BLOCK, max_anchors=ANCHORS, anchor_sampling=o["anchor_sampling"], mask_token_id=MASK_ID,
        decay_gamma=7.0, sample_from_anchor=False, loss_kind=ORACLE_LOSS[loss_name], device=torch.device("cpu"),
        seed=0, bp_loss_scale=None, runtime=None, sequence_length=LENGTH, sliding_window=None,
        dpace_alpha=o.get("dpace_alpha", 0.5), lk_loss_type=o.get("lk_loss_type"), kl_scale=o.get("kl_scale", 1.0),
        kl_decay=o.get("kl_decay", 1.0), selector_loss_alpha=o.get("selector_loss_alpha", 1.0), vocab_block_size=10,
    )
    task.objective_runtime.generator.set_state(anchor_generator(SEED, STEP).get_state())
    data = types.SimpleNamespace(input_ids=ids, loss_mask=loss_mask, document_ids=docs, position_ids=positions,
                                 target_position_ids=None, target_hidden_states=features,
                                 verifier_last_hidden_states=None)
    prepared = task.prepare(data)
    output = task.forward(oracle, prepared)
    trainable = [(name, p) for name, p in oracle.named_parameters() if p.requires_grad]
    parameters = [p for _, p in trainable]

    # The same anchors, labels and normaliser on both sides: 8 of row 0's 24 valid anchors (the draw matters), all 7
    # of row 1's and a padding slot.
    drawn = prepared.objective
    assert torch.equal(share.anchor_positions, drawn.anchor_positions)
    assert torch.equal(share.anchor_valid, drawn.anchor_valid)
    assert torch.equal(share.supervised_mask, drawn.supervised_mask)
    assert torch.equal(share.normalizer, prepared.normalization_count)
    assert share.num_anchors == ANCHORS and share.anchor_valid.sum(1).tolist() == [8, 7]

    with oracle_float32_as_float64():
        lifted = task.loss(oracle, prepared, output)
        lifted_grads = torch.autograd.grad(lifted, parameters, retain_graph=True, allow_unused=True)
    as_is = task.loss(oracle, prepared, output)
    as_is_grads = torch.autograd.grad(as_is, parameters, allow_unused=True)
    assert lifted.dtype == loss.dtype == torch.float64 and as_is.dtype == torch.float32
    if loss_name == "dpace":
        assert oracle.last_objective_metrics["selector_coverage"] > 0.1, "the selector's loss is exercised"
        assert all(ours[f"candidate_selector.{n}"] is not None for n, _ in model.candidate_selector.named_parameters())

    lifted_gap = ((loss - lifted).abs() / lifted.abs()).item()
    lifted_grad_gap = worst_relative_gap(ours, {name: g for (name, _), g in zip(trainable, lifted_grads)})
    as_is_gap = ((loss - as_is.double()).abs() / as_is.abs()).item()
    as_is_grad_gap = worst_relative_gap(ours, {name: g for (name, _), g in zip(trainable, as_is_grads)})
    print(f"{case}: loss {loss.item():.6f}; lifted oracle: loss {lifted_gap:.1e}, gradients {lifted_grad_gap:.1e}; "
          f"oracle as it is: loss {as_is_gap:.1e}, gradients {as_is_grad_gap:.1e}")
    assert lifted_gap <= 1e-10 and lifted_grad_gap <= 1e-9
    # A few float32 roundings (eps 1.2e-7) of the loss (about 4) and of the per-token factors of the gradients.
    assert as_is_gap <= 1e-6 and as_is_grad_gap <= 2e-6
