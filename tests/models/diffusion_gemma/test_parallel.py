"""DiffusionGemma under block parallelism (hf_bdlm/models/diffusion_gemma/training/sharded.py): the plan of a frame's canvas blocks,
the whole-model exactness of every layout, the bytes each rank receives, and the 26B recipe's CSBP + FSDP2 training
run under `accelerate launch` (scaled down) that follows the single process step by step.

The pure tests run in-process; the distributed ones launch torchrun / accelerate with gloo on CPU
(tests/distributed/diffusion_gemma_worker.py, tests/distributed/tiny_diffusion_gemma.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tiny_diffusion_gemma import B, EOS, TURN_END, VOCAB, W, conversations, make_batch, tiny_model, tiny_tokenizer

from hf_bdlm.attention.masks import CLEAN, NOISY, MaskRule, count_allowed_pairs, dense_mask, keys_in_window
from hf_bdlm.attention.rows import RowMeta
from hf_bdlm.models.diffusion_gemma.modeling import diffusion_gemma_rule
from hf_bdlm.objectives import get_objective
from hf_bdlm.models.diffusion_gemma.training.sharded import frame_padding
from hf_bdlm.parallel.dims import ParallelDims
from hf_bdlm.parallel.plan import PlanConfig, make_plan, noisy_subset_multiple, subset_sequence_multiple
from torchrun import ROOT, SharedJob  # noqa: E402

LAYOUTS = [("cp", 2, 2, "dual_end"), ("bp", 2, 1, "dual_end"), ("csbp", 2, 2, "dual_end"), ("csbp", 2, 1, "dual_end"),
           ("cp", 4, 4, "dual_end"), ("bp", 4, 1, "dual_end"), ("bp", 4, 1, "contiguous"), ("csbp", 4, 4, "dual_end"),
           ("csbp", 4, 2, "dual_end"), ("csbp", 4, 4, "contiguous"), ("csbp", 8, 4, "dual_end")]


def _canvas_plan(mode, P, C, schedule, subset):
    dims = ParallelDims(P, C, mode, schedule)
    L = 8 * subset_sequence_multiple(dims, B)
    return make_plan(PlanConfig(ParallelDims(P, C, mode, schedule), L, B, noisy_blocks=subset))


def _subsets(mode, P, C, schedule):
    """A response at the tail (one contiguous run) and packed conversations (responses of 1 to 6 blocks after
    prompts of 1 to 4), padded as the layout requires."""
    m = noisy_subset_multiple(ParallelDims(P, C, mode, schedule))
    N = 8 * subset_sequence_multiple(ParallelDims(P, C, mode, schedule), B) // B
    tail = tuple(range(N - 2 * m, N))
    packed, at, k = [], 0, 0
    while at < N:
        prompt, response = 1 + k % 4, 1 + (5 * k) % 6
        packed += range(at + prompt, min(N, at + prompt + response))
        at, k = at + prompt + response, k + 1
    return {"tail": tail, "packed": tuple(packed[: len(packed) // m * m])}


# --- the plan ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: "-".join(map(str, x)))
def test_canvas_plan_owns_every_canvas_block_once_and_counts_every_clean_block_once(layout):
    for name, subset in _subsets(*layout).items():
        plan = _canvas_plan(*layout, subset)
        owned = [b for r in plan.ranks for b in r.noisy_blocks]
        assert sorted(owned) == list(subset), name
        assert len({len(r.noisy_blocks) for r in plan.ranks}) == 1, name  # equal rows: cp's all-gather needs them
        counted = torch.zeros(plan.config.seq_len, dtype=torch.long)
        for r in plan.ranks:
            held = set(r.clean_position_index().tolist())
            for s, e in r.loss_clean_positions:
                counted[s:e] += 1
                assert set(range(s, e)) <= held, (name, r.rank)  # a rank counts only rows it computes
        assert bool((counted == 1).all()), name


@pytest.mark.parametrize("layout", [x for x in LAYOUTS if x[3] == "dual_end"], ids=lambda x: "-".join(map(str, x)))
def test_canvas_plan_balances_the_decoder_and_the_encoder(layout):
    mode, P, C, _ = layout
    rule = diffusion_gemma_rule(B)
    for name, subset in _subsets(*layout).items():
        plan = _canvas_plan(*layout, subset)
        L = plan.config.seq_len
        keys = RowMeta.cat([RowMeta(torch.full((L,), CLEAN), torch.arange(L)),
                            RowMeta(torch.full((L,), NOISY), torch.arange(L))])
        decoder = [count_allowed_pairs(RowMeta(torch.full((r.local_noisy_rows,), NOISY), r.noisy_positions()), keys,
                                       rule) for r in plan.ranks]
        imbalance = max(decoder) / (sum(decoder) / P)
        # One response (a contiguous run): dual-end pairs cost exactly the same. Packed: measured at most 1.049 (P = 2).
        # (Dealing all frame blocks instead would leave a rank of P = 2 without canvas when the response is the tail.)
        assert imbalance == 1.0 if name == "tail" else imbalance <= 1.06, (name, decoder)
        if mode != "bp":  # the clean rows: head-tail chunks of the token-causal encoder cost exactly the same
            encoder = [count_allowed_pairs(RowMeta(torch.full((r.local_clean_rows,), CLEAN), r.clean_position_index()),
                                           keys, rule) for r in plan.ranks]
            assert len(set(encoder)) == 1, encoder


def test_canvas_plan_rejects_a_subset_it_cannot_deal_evenly():
    with pytest.raises(ValueError, match=r"noisy_blocks has 3 blocks; .* multiple of 4: pad the subset"):
        PlanConfig(ParallelDims(2, 2, "csbp"), 64, B, noisy_blocks=(4, 5, 6))
    with pytest.raises(ValueError, match=r"ascending, distinct block indices in \[0, 16\)"):
        PlanConfig(ParallelDims(2, 2, "csbp"), 64, B, noisy_blocks=(5, 4, 6, 7))
    with pytest.raises(ValueError, match="multiple of 16"):  # cp on a subset cuts the clean stream head-tail over 2P
        PlanConfig(ParallelDims(2, 2, "cp"), 40, B, noisy_blocks=(4, 5, 6, 7))


def test_keys_in_window_with_streams_fetches_exactly_the_keys_the_rule_allows():
    g = torch.Generator().manual_seed(0)
    for convention, clean in (("block_start", "causal"), ("block_start", "block_causal"), ("per_query", "causal")):
        rule = MaskRule(B, clean_attention=clean, sliding_window=W, window_convention=convention)
        for _ in range(20):
            q_pos = torch.randint(0, 48, (7,), generator=g)
            q = RowMeta(torch.randint(0, 2, (7,), generator=g), q_pos)
            k = RowMeta(torch.randint(0, 2, (40,), generator=g), torch.randint(0, 48, (40,), generator=g))
            exact = dense_mask(q, k, rule)[0].any(0)
            assert torch.equal(keys_in_window(q.stream, q.pos, k.pos, rule, k_stream=k.stream), exact)
            assert bool((keys_in_window(q.stream, q.pos, k.pos, rule) >= exact).all())  # without streams: a superset


def test_canvas_padding_adds_dummy_blocks_nobody_scores_and_keeps_the_loss():
    model = tiny_model().eval()
    batch = make_batch("packed", seed=0)
    losses = []
    for dims in (None, ParallelDims(4, 4, "csbp")):
        frame_multiple, canvas_multiple = frame_padding(dims, B) if dims else (None, None)
        obj = get_objective("diffusion_gemma", dict(block_size=B, vocab_size=VOCAB, fill_token_id=EOS,
                                                    end_token_ids={EOS, TURN_END}, self_conditioning_prob=1.0,
                                                    pad_to_multiple_of=frame_multiple,
                                                    canvas_blocks_multiple_of=canvas_multiple))
        corrupted = obj.corrupt(batch, seed=7, step=0)
        frame = corrupted.frame
        if dims:
            assert frame.frame_length % 32 == 0 and frame.canvas_blocks.numel() % 8 == 0
            dummy = (frame.canvas_source < 0).all(0)
            assert bool(dummy.any()) and not bool(frame.canvas_supervised[:, dummy].any())
        with torch.no_grad():
            losses.append(obj.loss(model, corrupted)[0].item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)


def test_diffusion_gemma_refuses_deepspeed_and_fsdp_in_one_process(tmp_path, monkeypatch):
    """FSDP2 is supported (tests/trainer/test_fsdp.py); DeepSpeed is refused, as is an FSDP request in one process."""
    from types import SimpleNamespace

    from hf_bdlm import BDLMSFTConfig, BDLMSFTTrainer
    from hf_bdlm.models.diffusion_gemma.family import _refuse_deepspeed

    with pytest.raises(NotImplementedError, match="trains with DDP or FSDP2 .* not with DeepSpeed"):
        _refuse_deepspeed(SimpleNamespace(deepspeed="ds_config.json"))
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    args = BDLMSFTConfig(str(tmp_path), report_to="none", max_length=64, objective="diffusion_gemma")
    with pytest.raises(ValueError, match="FSDP2 was requested .* but this is a single process"):
        BDLMSFTTrainer(tiny_model(), args=args, train_dataset=conversations(2), processing_class=tiny_tokenizer())


# --- every layout equals the single process ------------------------------------------------------------------------
# Relative to the largest element of each tensor. Measured maxima over both launches (world 2: 28 cases, world 4:
# 23): float64 loss 4.3e-16, gradients 4.0e-15 (cp with the ring at P = 4); float32 loss 1.2e-7, gradients 2.2e-6
# (the paper's CP layout). Bounds: float64 25x over its maximum, float32 as tests/parallel/test_exactness.py (2.3x).
LOSS_TOL = {"float64": 1e-13, "float32": 5e-7}
GRAD_TOL = {"float64": 1e-13, "float32": 5e-6}


SHARED_JOBS = [SharedJob("diffusion_gemma", "diffusion_gemma_worker.py", world, ("--out", "{out}/results.json"),
                         timeout=900) for world in (2, 4)]


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def results(request, shared_launch):
    folder = shared_launch.folder("diffusion_gemma", request.param)
    return request.param, json.loads((folder / "results.json").read_text())


@pytest.mark.distributed
def test_matrix_covers_every_layout_transport_and_self_conditioning(results):
    world, cases = results
    layouts = {(c["P"], c["mode"], c["C"], c["transport"]) for c in cases}
    P = world
    expected = {(P, "cp", P, "allgather"), (P, "cp", P, "ring"), (P, "bp", 1, "allgather"), (P, "csbp", 1, "allgather"),
                (P, "csbp", P, "allgather"), (P, "csbp", P, "ring"), (P, "csbp", 2, "allgather"), (P, "csbp", 2, "ring")}
    assert expected <= layouts
    every = {("float32", "mixed"), ("float32", "off"), ("float64", "mixed"), ("float64", "off")}
    for layout in expected:
        variants = {(c["dtype"], c["self_conditioning"]) for c in cases if (c["P"], c["mode"], c["C"], c["transport"]) == layout}
        if world == 2:
            assert variants == every
        else:  # P = 4: both dtypes and both self-conditioning settings on every layout, every variant on some
            assert {d for d, _ in variants} == {"float32", "float64"} and {s for _, s in variants} == {"mixed", "off"}
    assert {(c["dtype"], c["self_conditioning"]) for c in cases if c["P"] == P} == every
    assert {c["batch"] for c in cases if c["P"] == P and c.get("cp_layout", "balanced") == "balanced"} == {
        "plain", "packed"}
    paper = {(c["dtype"], c["self_conditioning"]) for c in cases if c.get("cp_layout") == "paper" and c["P"] == P}
    assert paper == {("float32", "mixed"), ("float32", "off"), ("float64", "mixed"), ("float64", "off")}
    if world == 4:
        assert {c["mode"] for c in cases if c["P"] == 2} == {"cp", "bp", "csbp"}  # two data-parallel groups


@pytest.mark.distributed
def test_loss_and_every_gradient_equal_the_single_process(results):
    _, cases = results
    bad = [{k: c[k] for k in ("P", "C", "mode", "transport", "dtype", "self_conditioning", "batch", "loss_err",
                              "grad_err", "worst_param")}
           for c in cases if c["loss_err"] > LOSS_TOL[c["dtype"]] or c["grad_err"] > GRAD_TOL[c["dtype"]]]
    assert not bad, bad
    assert all(c["nonzero_grads"] > 40 for c in cases)  # the whole model, not a piece of it


@pytest.mark.distributed
def test_every_rank_receives_the_bytes_of_the_design_table(results):
    _, cases = results
    for c in cases:
        for got, want in zip(c["bytes"], c["expect"]):
            assert (got["fwd"], got["bwd"]) == (want["fwd"], want["bwd"]), c
            # sliding layers: the W - 1 halos, nothing else (the paper's CP baseline: nothing, it gathers whole layers)
            assert got["window"] == want["window"], c
            if c["transport"] == "ring" and want["ring"] > 1:  # dK/dV walk the whole ring home
                assert got["dkv"] == want["bwd"] * want["ring"] / (want["ring"] - 1), c


@pytest.mark.distributed
def test_csbp_leaves_the_canvas_keys_home(results):
    world, cases = results
    fwd = {(c["P"], c["mode"], c["C"], c["transport"], c["dtype"], c["self_conditioning"], c["batch"]): c
           for c in cases if c.get("cp_layout", "balanced") == "balanced"}
    compared = set()
    for (P, mode, C, transport, *rest), c in fwd.items():
        cp = fwd.get((P, "cp", P, transport, *rest))
        if mode == "csbp" and C == P and cp:
            F, Nc = c["frame"], c["canvas_rows"]
            passes = 2 if c["self_conditioning"] == "mixed" else 1  # decoder passes: the encoder's F, then F or F + Nc
            ratio = c["bytes"][0]["fwd"] / cp["bytes"][0]["fwd"]
            assert ratio == pytest.approx((F + passes * F) / (F + passes * (F + Nc)))
            compared.add((P, transport))
    assert {(world, "allgather"), (world, "ring")} <= compared


# --- training: accelerate launch, 2 CPU processes, CSBP + FSDP2 ---------------------------------------------------
# The 26B recipe scaled down to the tiny model and launched as written, with an accelerate FSDP2 config (one CSBP group
# of P = C = 2, FSDP2 over both ranks, packing, activation checkpointing, gradient accumulation 2, SGD at lr 0.2,
# 3 steps). Measured: losses equal the single process's to 1.2e-7 relative, final weights to 1.7e-6 (relative to each
# tensor's largest element; float32 gradients accumulate 2e-6 per step; with cpu_2proc.yaml, DDP: 1.2e-7 and 1.9e-6).
# (DDP runs of the trainer for DiffusionGemma: tests/trainer/test_fsdp.py's pairs.)
TRAJECTORY_TOL = 1e-5


def _recipe_args(model_dir, data_dir, out, P):
    return ["--config", str(ROOT / "recipes/configs/diffusion_gemma_26b_a4b_sft_256k_16gpu.yaml"),
            "--model_name_or_path", str(model_dir), "--dtype", "float32", "--dataset_name", str(data_dir),
            "--output_dir", str(out), "--max_length", "64", "--bf16", "false", "--block_parallel_size", str(P),
            "--clean_ring_size", str(P), "--max_steps", "3", "--gradient_accumulation_steps", "2",
            "--per_device_train_batch_size", "2", "--dataloader_num_workers", "0", "--optim", "sgd",
            "--learning_rate", "0.2", "--lr_scheduler_type", "constant", "--lr_scheduler_kwargs", "{}",
            "--warmup_steps", "0", "--weight_decay", "0", "--save_strategy", "steps", "--save_steps", "3",
            "--logging_steps", "1", "--disable_tqdm", "true", "--report_to", "none"]


def _losses(out):
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    return [h["loss"] for h in state["log_history"] if "loss" in h]


def _weights(out):
    from safetensors.torch import load_file

    return load_file(str(out / "model.safetensors"))


@pytest.mark.distributed
def test_accelerate_launch_trains_the_recipe_with_csbp_and_fsdp2_on_two_processes_as_one_process(tmp_path):
    from hf_bdlm.train import main, make_parser

    tiny_model().save_pretrained(tmp_path / "model")
    tiny_tokenizer().save_pretrained(tmp_path / "model")
    conversations(16).to_json(tmp_path / "data" / "train.jsonl")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "recipes/accelerate/cpu_2proc_fsdp2.yaml"), str(ROOT / "recipes/sft.py"),
           *_recipe_args(tmp_path / "model", tmp_path / "data", tmp_path / "p2", 2)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "objective diffusion_gemma" in proc.stdout
    assert "world 2 = 1 data-parallel x P 2 (csbp, clean ring C 2)" in proc.stdout
    assert "FSDP2: BDLMSFTTrainer shards the model itself" in proc.stdout + proc.stderr
    assert "model.encoder.language_model.layers.0 + model.decoder.layers.0" in proc.stdout + proc.stderr

    main(*make_parser().parse_args_and_config(args=_recipe_args(tmp_path / "model", tmp_path / "data",
                                                                 tmp_path / "p1", 1))[:3])
    p1, p2 = _losses(tmp_path / "p1"), _losses(tmp_path / "p2")
    assert len(p1) == len(p2) == 3 and p1[0] != p1[-1]
    assert max(abs(a - b) / abs(b) for a, b in zip(p2, p1)) <= TRAJECTORY_TOL, (p2, p1)
    w1, w2 = _weights(tmp_path / "p1"), _weights(tmp_path / "p2")
    assert w1.keys() == w2.keys()
    initial = tiny_model().state_dict()
    moved = [k for k in w1 if k in initial and not torch.equal(w1[k], initial[k])]
    assert len(moved) > 40  # the step trained the whole text model, not a piece of it
    errors = {k: ((w2[k] - w1[k]).abs().max() / w1[k].abs().max().clamp(min=1e-30)).item() for k in w1}
    assert max(errors.values()) <= TRAJECTORY_TOL, max(errors.items(), key=lambda kv: kv[1])
