"""DFlashTrainer: a tiny DFlash2 drafter trained on a tiny random target's captured features.

- one process: the loss falls on learnable sequences, the saved folder is a drafter that reloads to the same weights
  and passes the serving contract; the first step's loss is the objective's loss of the whole batch (D-PACE, CE, KL),
  computed independently; a sequence's anchors do not depend on the batch it is in;
- resume: the checkpoint's objective state is restored, the same anchors are redrawn, and the run continues bitwise;
- the target: from a folder, only its embedding and head are read, and training equals training with the model;
- two processes (torchrun): data parallel, and P = 2 in csbp / cp / bp, equal one process on the same global batch
  (losses and weights after 3 SGD steps, float32, <= 1e-5 relative), also for a drafter whose layers all slide (each
  rank reads only the feature rows of its compacted, balanced range: deferred features, read exactly);
- clear errors: features of another drafter (layer ids, width) or target, objective options out of range.
"""

import json
import sys

import pytest
import torch

import dflash_trainer_worker as worker  # noqa: E402
from torchrun import SharedJob  # noqa: E402
from trainer_common import tiny_tokenizer  # noqa: E402

from hf_bdlm.models.dflash.training.capture import FeatureStore  # noqa: E402
from hf_bdlm.models.dflash.modeling import DFlash2DraftModel  # noqa: E402
from hf_bdlm.models.dflash.training.objectives import DFlashObjective, sample_seed  # noqa: E402
from hf_bdlm.models.dflash.training.trainer import DFlashTrainer  # noqa: E402
from hf_bdlm.models.dflash.training.config import DFlashTrainingConfig  # noqa: E402
from paths import ROOT

TOL = 1e-5


@pytest.fixture(scope="module")
def target():
    return worker.tiny_target()


@pytest.fixture(scope="module")
def features(tmp_path_factory, target):
    out = tmp_path_factory.mktemp("dflash_features")
    return worker.capture(out, target)


@pytest.fixture(scope="module")
def teacher_features(tmp_path_factory, target):
    from hf_bdlm.models.dflash.training.capture import capture_features

    out = tmp_path_factory.mktemp("dflash_teacher") / "features"
    capture_features(target, worker.progression_records(), layer_ids=worker.LAYER_IDS, out_dir=out,
                     teacher=True, progress=False, target_id="tiny-llama")
    return out


def trainer_for(out, features, target, drafter=None, **overrides):
    args = worker.config(out, **overrides)
    return DFlashTrainer(drafter if drafter is not None else worker.tiny_drafter(target), args,
                         train_dataset=str(features), target=target, processing_class=tiny_tokenizer())


def losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def rel(a, b):
    a, b = (torch.as_tensor(x).detach().to(torch.float64) for x in (a, b))
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


# --- one process ------------------------------------------------------------------------------------------------------
def test_training_lowers_the_loss_and_saves_a_drafter_that_reloads_and_serves(tmp_path, features, target):
    from transformers import AutoConfig

    from hf_bdlm.protocols.registry import family_for_config
    from hf_bdlm.models.dflash.inference.export import check_serving_inventory, export_drafter

    trainer = DFlashTrainer(worker.tiny_drafter(target), worker.config(
        tmp_path / "run", optim="adamw_torch", learning_rate=1e-2, max_steps=40, dflash_loss="ce"),
        train_dataset=str(features), eval_dataset=FeatureStore(features), target=target,
        processing_class=tiny_tokenizer())
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    logged = losses(trainer)
    assert sum(logged[-5:]) / 5 < 0.5 * sum(logged[:5]) / 5, logged
    assert trainer.evaluate()["eval_loss"] < 0.5 * before
    accuracy = [h["mean_token_accuracy"] for h in trainer.state.log_history if "mean_token_accuracy" in h]
    assert accuracy[-1] > accuracy[0]
    out = tmp_path / "drafter"
    trainer.save_model(str(out))
    assert family_for_config(AutoConfig.from_pretrained(out)).name == "dflash"
    reloaded = DFlash2DraftModel.from_pretrained(out)
    mine = trainer.model.state_dict()
    assert reloaded.state_dict().keys() == mine.keys()  # the drafter's own tensors: no embedding, no head
    assert all(torch.equal(reloaded.state_dict()[k], mine[k]) for k in mine)
    report = check_serving_inventory(out)  # the trainer writes the provenance a served drafter carries
    assert report["architecture"] == "DFlash2DraftModel" and report["block_size"] == 4
    assert "DFlash2DraftModel" in (out / "README.md").read_text()
    export_drafter(reloaded, tmp_path / "export", target_id="org/tiny-llama")
    assert check_serving_inventory(tmp_path / "export")["tensor_count"] == report["tensor_count"]


def _first_batch(trainer):
    return next(iter(trainer.get_train_dataloader()))


@pytest.mark.parametrize("loss", ["dpace", "ce", "kl"])
def test_the_first_loss_is_the_objectives_loss_of_the_whole_batch(tmp_path, features, teacher_features, target, loss):
    """Recomputed without the trainer: each sequence's anchors from its own seed, the drafter's logits over the whole
    batch, `DFlashObjective.loss` (the logits path, not the trainer's hidden-state path)."""
    from hf_bdlm.models.dflash.training.objectives import gather_positions, select_anchors

    data = teacher_features if loss == "kl" else features
    drafter = worker.tiny_drafter(target)
    initial = {k: v.clone() for k, v in drafter.state_dict().items()}
    trainer = trainer_for(tmp_path, data, target, drafter=drafter, dflash_loss=loss, max_steps=1)
    batch = _first_batch(trainer)
    trainer.train()

    fresh = worker.tiny_drafter(target)
    fresh.load_state_dict(initial)
    config = trainer.objective.config
    parts = []
    for row, sample in enumerate(batch["sample_ids"].tolist()):
        objective = DFlashObjective(config)
        objective.seed = sample_seed(trainer.args.seed, sample)
        mask = batch["completion_mask"][row : row + 1] * batch["attention_mask"][row : row + 1]
        parts.append(objective.prepare(batch["input_ids"][row : row + 1], mask, step=0))
    width = max(p.anchor_valid.sum() for p in parts)  # every sequence's valid anchors come first
    parts = [select_anchors(p, torch.arange(int(width))) for p in parts]
    whole = type(parts[0])(**{f: (torch.cat([getattr(p, f) for p in parts]) if torch.is_tensor(getattr(parts[0], f))
                                  else getattr(parts[0], f)) for f in parts[0].__dataclass_fields__})
    with torch.no_grad():
        out = fresh(batch["features"], batch["input_ids"], anchor_positions=whole.anchor_positions,
                    anchor_valid=whole.anchor_valid)
        kwargs = {}
        if loss == "dpace":
            kwargs = dict(hidden_states=out.hidden_states, selector=fresh.candidate_selector,
                          selector_alpha=config.selector_loss_alpha)
        if loss == "kl":
            states = gather_positions(batch["teacher"], whole.teacher_positions)
            kwargs = dict(teacher_logits=target.lm_head(target.model.norm(states)))
        expected = DFlashObjective(config).loss(out.logits, whole, **kwargs)
    assert losses(trainer)[0] == pytest.approx(float(expected), rel=1e-6)


def test_a_sequences_anchors_do_not_depend_on_the_batch_it_is_in(tmp_path, features, target):
    trainer = trainer_for(tmp_path, features, target)
    batch = _first_batch(trainer)
    together = trainer.objective.corrupt(batch, seed=3, step=5)
    alone = trainer.objective.corrupt({k: v[1:2] for k, v in batch.items()}, seed=3, step=5)
    valid = alone.anchors.anchor_valid[0]
    assert valid.any()
    assert torch.equal(together.anchors.anchor_positions[1, : valid.sum()], alone.anchors.anchor_positions[0, valid])
    later = trainer.objective.corrupt(batch, seed=3, step=6)
    assert not torch.equal(later.anchors.anchor_positions, together.anchors.anchor_positions)


def test_gradient_accumulation_equals_one_big_batch_for_the_cross_entropy(tmp_path, features, target):
    """CE is the mean over every sequence of the step, however they are split; D-PACE normalises each micro-batch
    by its own totals and averages the micro-batches (so only a single micro-batch equals the big batch)."""
    big = trainer_for(tmp_path / "big", features, target, dflash_loss="ce")
    big.train()
    split = trainer_for(tmp_path / "split", features, target, dflash_loss="ce", per_device_train_batch_size=2,
                        gradient_accumulation_steps=2)
    split.train()
    assert rel(losses(split), losses(big)) <= TOL
    assert max(rel(a, b) for a, b in zip(split.model.parameters(), big.model.parameters())) <= TOL


def test_resume_restores_the_objective_and_continues_bitwise(tmp_path, features, target):
    common = dict(optim="adamw_torch", learning_rate=5e-3, max_steps=4, save_strategy="steps", save_steps=2)
    whole = trainer_for(tmp_path / "whole", features, target, **common)
    whole.train()
    checkpoint = tmp_path / "whole" / "checkpoint-2"
    state = json.loads((checkpoint / "dflash_objective.json").read_text())
    assert state["seed"] == 3 and state["max_anchors"] == 8 and state["last_step"] == 1
    # Another seed (the data order kept): the checkpoint's anchor seed wins.
    resumed = trainer_for(tmp_path / "resumed", features, target, **{**common, "seed": 11, "data_seed": 3})
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.objective.seed == 3  # the checkpoint's seed, hence its anchors
    assert [h["step"] for h in resumed.state.log_history if "loss" in h] == [1, 2, 3, 4]  # 1, 2: the checkpoint's
    assert losses(resumed) == losses(whole)
    assert all(torch.equal(a, b) for a, b in zip(resumed.model.parameters(), whole.model.parameters()))
    changed = trainer_for(tmp_path / "changed", features, target, **{**common, "max_anchors": 6})
    with pytest.raises(ValueError, match="trained with max_anchors=8, this run has 6"):
        changed.train(resume_from_checkpoint=str(checkpoint))


def test_a_target_folder_gives_only_its_embedding_and_head_and_the_same_training(tmp_path, features, target):
    from hf_bdlm.models.dflash.target import load_target_heads

    folder = tmp_path / "target"
    target.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    heads = load_target_heads(str(folder))
    assert torch.equal(heads.embed_tokens.weight, target.get_input_embeddings().weight)
    assert torch.equal(heads.lm_head.weight, target.get_output_embeddings().weight)
    assert sum(p.numel() for p in heads.parameters()) == 2 * target.get_input_embeddings().weight.numel()
    with_model = trainer_for(tmp_path / "a", features, target)
    with_model.train()
    from_folder = DFlashTrainer(worker.tiny_drafter(target), worker.config(tmp_path / "b"),
                                train_dataset=str(features), target=str(folder))  # its tokenizer read from the folder
    from_folder.train()
    assert losses(from_folder) == losses(with_model)


def test_deferred_features_read_exactly_the_rows_asked_and_zero_past_a_records_end(features, target):
    from hf_bdlm.models.dflash.training.objectives import DeferredFeatures
    from hf_bdlm.models.dflash.training.trainer import DFlashFeatureCollator

    store = FeatureStore(features)
    rows = [dict(input_ids=store.record(i)[0].tolist(), completion_mask=store.record(i)[1].long().tolist(),
                 dflash_record=i, dflash_store=0, bdlm_sample_id=i) for i in (0, 1)]
    collated = DFlashFeatureCollator([store], 0)(rows)
    deferred = DFlashFeatureCollator([store], 0, defer_features=True)(rows)
    assert "features" not in deferred and deferred["feature_records"].tolist() == [[0, 0], [0, 1]]
    length = collated["features"].shape[1]
    runs = [(1, 4), (9, 12), (length - 3, length)]  # the last run passes the shorter record's end
    lazy = DeferredFeatures([store], torch.tensor([[0, 0], [-1, -1], [0, 1]]))
    got = lazy.rows(runs)
    index = torch.cat([torch.arange(a, b) for a, b in runs])
    assert got.shape == (3, len(index), store.feature_width)
    assert torch.equal(got[0], collated["features"][0, index]) and torch.equal(got[2], collated["features"][1, index])
    assert not got[1].any()  # a placeholder row reads nothing
    assert min(store.lengths[0], store.lengths[1]) < length  # the zero rows past an end were exercised
    with pytest.raises(ValueError, match=r"reach outside record 0"):
        store.feature_runs(0, [(0, store.lengths[0] + 1)])


# --- two processes ----------------------------------------------------------------------------------------------------
# The 2-process runs: a job of the shared launch (tests/torchrun.py), which captures the features; the one-process
# references then train here on the same features.
SHARED_JOBS = [SharedJob("dflash_trainer", "dflash_trainer_worker.py", 2, ("--scenario", "parallel", "--out", "{out}"))]


@pytest.fixture(scope="module")
def parallel_runs(shared_launch, target):
    out = shared_launch.folder("dflash_trainer", 2)
    reference = worker.scenario_reference(out, out / "features", target)
    ranks = [json.loads((out / f"parallel_rank{r}.json").read_text()) for r in range(2)]
    return reference, ranks


PARALLEL = [f"{name}/{layout}" for name, (_, _, layouts) in worker.RUNS.items() for layout in layouts]


@pytest.mark.distributed
@pytest.mark.parametrize("run", PARALLEL)
def test_two_processes_train_like_one_on_the_same_global_batch(parallel_runs, run):
    reference, (rank0, rank1) = parallel_runs
    if not worker.sharded_forward_exists() and not run.endswith("/dp"):
        pytest.skip("the sharded forward (hf_bdlm.models.dflash.training.sharded) is not built")
    want, got = reference[run.split("/")[0] + "/p1"], rank0[run]
    assert got["steps"] == want["steps"] == [1, 2, 3]
    assert rel(got["losses"], want["losses"]) <= TOL, (got["losses"], want["losses"])
    assert rank1[run]["losses"] == got["losses"]
    mine, theirs = torch.load(got["weights"]), torch.load(want["weights"])
    assert mine.keys() == theirs.keys()
    assert max(rel(mine[k], theirs[k]) for k in mine) <= TOL


# --- errors -----------------------------------------------------------------------------------------------------------
def test_features_of_another_drafter_or_target_are_refused(tmp_path, target):
    other_layers = worker.capture(tmp_path / "layers", target, layer_ids=(1, 2))
    with pytest.raises(ValueError, match=r"reads target layers \[1, 3\], the capture holds \[1, 2\]"):
        trainer_for(tmp_path / "a", other_layers, target)
    deeper = worker.tiny_target(num_hidden_layers=6)
    with pytest.raises(ValueError, match="captured from a target of 6 layers"):
        trainer_for(tmp_path / "b", worker.capture(tmp_path / "deeper", deeper), target)
    from transformers import LlamaConfig, LlamaForCausalLM

    wide = LlamaForCausalLM(LlamaConfig(**{**target.config.to_dict(), "hidden_size": 48, "head_dim": 12})).eval()
    with pytest.raises(ValueError, match="the drafter's fc takes 64 features .* the capture's width is 96"):
        trainer_for(tmp_path / "c", worker.capture(tmp_path / "wide", wide), target)


@pytest.mark.parametrize("field, value, message", [
    ("max_anchors", 0, r"max_anchors must be >= 1, got 0 \(DFlashTrainingConfig.max_anchors\)"),
    ("dpace_alpha", 1.5, r"dpace_alpha must be in \[0, 1\], got 1.5"),
    ("dflash_loss", "mse",
     r"loss must be one of \('ce', 'kl', 'dpace'\), got 'mse' \(DFlashTrainingConfig.dflash_loss\)"),
    ("anchor_sampling", "random", "anchor_sampling must be one of"),
    ("decay_gamma", -1.0, "decay_gamma must be a positive number"),
    ("noise_eps_min", 0.1, r"\['noise_eps_min'\] are block-diffusion settings"),
])
def test_objective_options_out_of_range_are_refused_when_the_config_is_built(tmp_path, field, value, message):
    with pytest.raises(ValueError, match=message):
        DFlashTrainingConfig(str(tmp_path), report_to="none", **{field: value})


def test_a_block_size_other_than_the_drafters_or_missing_inputs_are_refused(tmp_path, features, target):
    with pytest.raises(ValueError, match="block_size=8 differs from the drafter's block size 4"):
        trainer_for(tmp_path, features, target, block_size=8)
    with pytest.raises(ValueError, match="no training features"):
        DFlashTrainer(worker.tiny_drafter(target), worker.config(tmp_path), target=target,
                      processing_class=tiny_tokenizer())
    with pytest.raises(ValueError, match="has no target bound"):
        DFlashTrainer(DFlash2DraftModel(worker.tiny_drafter(target).config), worker.config(tmp_path),
                      train_dataset=FeatureStore(features), processing_class=tiny_tokenizer())
    with pytest.raises(ValueError, match="lack: capture with teacher=True"):
        trainer_for(tmp_path, features, target, dflash_loss="kl")


# --- the recipe -------------------------------------------------------------------------------------------------------
CONFIG = ROOT / "recipes" / "configs" / "dflash_smollm2_cpu.yaml"


def _recipe():
    import importlib.util

    if "dflash_recipe" not in sys.modules:  # registered first: its dataclasses look their module up
        spec = importlib.util.spec_from_file_location("dflash_recipe", ROOT / "recipes" / "dflash.py")
        sys.modules["dflash_recipe"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["dflash_recipe"])
    return sys.modules["dflash_recipe"]


def test_the_recipe_config_names_real_fields_and_asks_for_csbp_on_two_processes(tmp_path):
    import dataclasses

    import yaml

    recipe = _recipe()
    config = yaml.safe_load(CONFIG.read_text())
    fields = {f.name for cls in (recipe.DFlashRecipeArguments, DFlashTrainingConfig) for f in dataclasses.fields(cls)}
    assert not set(config) - fields, set(config) - fields
    assert (config["target_model"], config["block_parallel_size"], config["block_parallel_mode"]) == (
        "embedded:smollm2", 2, "csbp")
    # One process here: the group size is overridden (the YAML asks for 2).
    script, args = recipe.make_parser().parse_args_and_config(
        args=["--config", str(CONFIG), "--block_parallel_size", "1", "--output_dir", str(tmp_path)])[:2]
    assert (script.drafter_block_size, args.objective, args.dflash_loss, args.max_anchors) == (8, "dflash", "dpace", 16)


def test_the_recipe_answers_captures_trains_measures_and_saves_for_a_tiny_target(tmp_path):
    from hf_bdlm.models.dflash.inference.export import check_serving_inventory

    folder = tmp_path / "target"
    tiny = worker.tiny_target(num_hidden_layers=6)  # 6 layers: the default rule spreads 2 feature layers over them
    with torch.no_grad():
        tiny.lm_head.weight[3] = 0.0  # a zero EOS logit is never the largest: every answer runs its 12 tokens
    tiny.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    data = tmp_path / "prompts"
    data.mkdir()
    for split, n in (("train", 6), ("test", 2)):
        rows = [{"prompt": [{"role": "user", "content": f"what is the sum of {i} and {i + 1}"}]} for i in range(n)]
        (data / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    recipe = _recipe()
    out = tmp_path / "out"
    script, args = recipe.make_parser().parse_args_and_config(args=[
        "--config", str(CONFIG), "--target_model", str(folder), "--dataset_name", str(data), "--output_dir", str(out),
        "--block_parallel_size", "1", "--train_prompts", "6", "--response_max_tokens", "12", "--drafter_block_size",
        "4", "--target_features", "2", "--selector_rank", "8", "--max_steps", "2", "--per_device_train_batch_size",
        "3", "--eval_prompts", "2", "--eval_max_new_tokens", "8", "--main_process_threads", "1", "--disable_tqdm",
        "true", "--logging_steps", "1", "--eval_speculative_tokens", "3", "1"])[:2]
    results = recipe.main(script, args)
    spec = results["speculative"]
    assert results["steps"] == 2 and spec["outputs_identical"] and spec["prompts"] == 2
    assert spec["new_tokens"] == 2 * 8 and 1.0 <= spec["acceptance_length"] <= 4 and spec["speedup"] > 0
    # Each proposal count measured over the same prompts; one proposal per forward keeps 1 or 2 tokens.
    sweep = results["speculative_sweep"]
    assert sweep[0] == spec and [r["num_speculative_tokens"] for r in sweep] == [3, 1]
    assert 1.0 <= sweep[1]["acceptance_length"] <= 2 and sweep[1]["new_tokens"] == 2 * 8
    assert json.loads((out / "dflash_results.json").read_text())["speculative"] == spec
    assert len((out / "data" / "responses.jsonl").read_text().splitlines()) == 6
    # The training eval's acceptance on the held-out answers' capture is the decoded one (at the headline count).
    assert len((out / "data" / "eval_responses.jsonl").read_text().splitlines()) == 2
    acceptance = results["acceptance"]
    assert acceptance["num_speculative_tokens"] == 3 and acceptance["verification_steps"] > 0
    assert acceptance["training_eval"] == pytest.approx(spec["acceptance_length"], rel=1e-12)
    assert check_serving_inventory(out)["block_size"] == 4
