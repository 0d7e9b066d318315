"""The acceptance test of block parallelism: every layout equals the single-process reference.

Each launch runs a matrix of tests/distributed/exactness_worker.py under torchrun (gloo): backbones (Llama GQA,
Gemma 3 sliding+full, Qwen3) x objectives (standard, fast_dllm_v2) x modes (cp, bp, csbp with C in {1, 2, P}, and cp
in the paper's baseline layout) x batches (plain, padded, packed documents), float64 and float32 (every layout). The
2-process launch runs P = 2's whole product; the 4-process launch runs every P = 4 layout on every backbone x objective
(the batch kind turning with them, so that the layouts together run the whole product at P = 4) plus data parallelism
(2 groups x P 2: every layout in float32 and one float64 case each). Loss and every parameter gradient must match;
K/V bytes recorded by the meter must equal the formulas of docs/design.md §3, and on every case (sliding-window
layers included) the planner's prediction.
"""

import json

import pytest

from torchrun import SharedJob

pytestmark = pytest.mark.distributed


# Relative to the largest element of each tensor. Measured maxima over both launches (201 cases): float64 loss
# 4.4e-16, gradients 3.2e-15; float32 loss 1.2e-7, gradients 1.9e-6 (bp at P = 2, summing the replicated clean
# prefix in another order). Bounds keep a margin of ~2.5x over float32 and ~300x over float64 (whose errors are a
# handful of ulps).
LOSS_TOL = {"float64": 1e-12, "float32": 5e-7}
GRAD_TOL = {"float64": 1e-12, "float32": 5e-6}


SHARED_JOBS = [SharedJob("exactness", "exactness_worker.py", world, ("--out", "{out}/results.json"), timeout=900)
               for world in (2, 4)]


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def results(request, shared_launch):
    folder = shared_launch.folder("exactness", request.param)
    return request.param, json.loads((folder / "results.json").read_text())


def test_matrix_covers_every_mode_backbone_objective_and_batch_kind(results):
    world, cases = results
    seen = {(c["P"], c["mode"], c["C"]) for c in cases}
    expected = {(2, "cp", 2), (2, "bp", 1), (2, "csbp", 1), (2, "csbp", 2)}
    if world == 4:
        expected |= {(4, "cp", 4), (4, "bp", 1), (4, "csbp", 1), (4, "csbp", 2), (4, "csbp", 4)}
    assert expected <= seen
    paper = {(c["P"], c["backbone"], c["objective"], c["dtype"]) for c in cases if c.get("cp_layout") == "paper"}
    Ps = {2, world}
    # The paper's CP baseline layout: every backbone and objective in float64 at the launch's own group size (P = 2's
    # whole matrix runs in the 2-process launch), and float32 at every P.
    assert {(world, bb, obj, "float64") for bb in ("llama", "gemma3", "qwen3")
            for obj in ("standard", "fast_dllm_v2")} <= paper
    assert {P for P, _, _, dtype in paper if dtype == "float32"} == Ps
    assert {c["backbone"] for c in cases} == {"llama", "gemma3", "qwen3"}
    assert {c["objective"] for c in cases} == {"standard", "fast_dllm_v2"}
    assert {c["batch"] for c in cases} == {"plain", "padded", "packed"}
    product = {(bb, obj, batch) for bb in ("llama", "gemma3", "qwen3") for obj in ("standard", "fast_dllm_v2")
               for batch in ("plain", "padded", "packed")}
    float64 = [c for c in cases if c["P"] == world and c["dtype"] == "float64" and c["transport"] == "allgather"
               and c["backend"] == "blockwise" and c.get("cp_layout", "balanced") == "balanced"]
    # The launch's own P: every layout on every backbone x objective (P = 2: with every batch kind), and together
    # every backbone x objective x batch kind.
    assert {(c["backbone"], c["objective"], c["batch"]) for c in float64} == product
    for P, mode, C in expected:
        if P == world:
            run = {(c["backbone"], c["objective"], c["batch"]) for c in float64 if (c["mode"], c["C"]) == (mode, C)}
            assert len({(bb, obj) for bb, obj, _ in run}) == 6 and {batch for *_, batch in run} == {
                "plain", "padded", "packed"}, (mode, C, run)
            assert world != 2 or run == product
    layouts = {(c["P"], c["mode"], c["C"], c["transport"]) for c in cases}
    float32 = {(c["P"], c["mode"], c["C"], c["transport"]) for c in cases if c["dtype"] == "float32"}
    assert float32 == layouts  # a float32 case for every layout


def test_loss_and_every_gradient_equal_single_process(results):
    _, cases = results
    bad = [
        {k: c[k] for k in ("P", "C", "mode", "backbone", "objective", "batch", "dtype", "loss_err", "grad_err")}
        for c in cases
        if c["loss_err"] > LOSS_TOL[c["dtype"]] or c["grad_err"] > GRAD_TOL[c["dtype"]]
    ]
    assert not bad, bad


def test_data_parallel_groups_average_to_reference(results):
    world, cases = results
    if world != 4:
        pytest.skip("data parallelism needs 4 processes (2 groups x P 2)")
    dp = [c for c in cases if c["P"] == 2]
    assert dp and all(c["grad_err"] <= GRAD_TOL[c["dtype"]] for c in dp)


def test_bytes_received_match_design_formulas(results):
    _, cases = results
    checked = [c for c in cases if "expect_bytes" in c]
    assert checked
    for c in checked:
        assert c["fwd_bytes"] == c["expect_bytes"], c
        assert c["bwd_bytes"] == c["expect_bytes"], c
        if c["transport"] == "ring":  # plus dK/dV walking the whole ring back to their owners
            assert c["bwd_grad_bytes"] == c["expect_bwd_grad_bytes"], c


def test_planner_predicts_the_bytes_the_meter_records(results):
    # Every case, sliding-window layers (the halos) and the paper's CP (whole gathers) included, name by name.
    _, cases = results
    wrong = [(c["P"], c["mode"], c["C"], c.get("cp_layout"), c["transport"], c["backbone"], c["predicted_bytes"],
              c["bytes"]) for c in cases if c["predicted_bytes"] != c["bytes"]]
    assert not wrong, wrong
    assert {c["backbone"] for c in cases if c["mode"] != "bp"} >= {"gemma3", "llama"}


def test_ring_transport_is_covered(results):
    _, cases = results
    ring = {(c["mode"], c["C"]) for c in cases if c["transport"] == "ring"}
    assert ("cp", 2) in ring and ("csbp", 2) in ring


def test_csbp_moves_half_the_bytes_of_cp(results):
    world, cases = results
    by = {
        (c["P"], c["mode"], c["C"], c["dtype"], c["backbone"], c["batch"]): c["fwd_bytes"]
        for c in cases
        if "expect_bytes" in c and c["transport"] == "allgather" and c["backend"] == "blockwise"
        and c.get("cp_layout", "balanced") == "balanced"
    }
    compared = set()
    for (P, mode, C, dtype, bb, batch), nbytes in by.items():
        if mode == "csbp" and C == P and (P, "cp", P, dtype, bb, batch) in by:
            assert nbytes / by[(P, "cp", P, dtype, bb, batch)] == 0.5
            compared.add(P)
    assert world in compared
