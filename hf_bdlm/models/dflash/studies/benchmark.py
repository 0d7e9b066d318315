"""The ``drafter`` study of ``hf-bdlm bench``: DFlash2 drafter training under ``csbp``, the paper's CP-only layout
``cp``, ``bp`` and plain data parallelism ``dp`` side by side, at the longest contexts this machine holds (P = 2 and
4; one process as the reference).

**Layouts** (:mod:`.sharded`): ``cp`` shards the context features over the ``P`` ranks and every rank drafts *all*
anchors; it is the paper's reference CP-only drafter layout, the baseline of its published CSBP speed-ups (2.48x at
512K, 7.59x at 1M tokens on 8 H100). ``bp`` replicates the features and deals the anchors (heaviest with lightest);
``csbp`` does both: features sharded, anchors dealt. ``dp`` is what a user could run instead of any of them when one
sequence fits on one rank: each of the ``P`` ranks trains on a sequence of its own, alone (the single process's
step; the gradient all-reduce is left out, as in every layout), so a ``dp`` step trains ``P`` sequences. ``single``
is one process running the same sharded forward with a one-rank plan. The layouts are compared per *sequence*:
``dp``'s step time over ``P``, the others' step time. The strongest baseline of a cell is the faster (median time per
sequence) of ``bp`` and ``dp``.

**The benchmark drafter** is the published DFlash2 drafter of a Qwen3-27B-class target (hidden 5120, 32 heads and 8
K/V heads of 128, 5 sliding-window layers of window 2048, non-causal blocks of 8, features of target layers
``[6, 20, 34, 48, 62]`` of 64, candidate selector of rank 256 over the top 16) scaled down to hidden 256: 8 heads
and 2 K/V heads of 32, MLP 864, vocabulary 8192, selector rank 16 over the top 16, the same 5 feature layers (features
5 x 256 = 1280 wide), block 8, window 2048, and 1 layer (``--drafter-layers``). A drafter's width is its target's (it
embeds with the target's embedding), so the target is scaled with it. Anchors follow the recipe's density, 2048 per
1M tokens (``L / 512`` per sequence; ``--drafter-anchors`` fixes them), drawn by the recipe's locality sampler (every
``s``-th position from a random start, ``s`` about the block size: the anchors of a step lie in one stretch of about
``9 A`` tokens); the loss is the recipe's D-PACE with the candidate selector. float32, one sequence per step and
group, every token supervised, one thread per rank. The features are random (they are inputs: no target runs).
``dp``'s rank ``r`` trains sequence ``r`` (its own tokens, features and anchor draw); rank 0's is the single
process's.

Since every layer slides, the sharded forward *compacts the context*: a ring needs only the rows its anchors can see
(the anchors' stretch and one window before it), cut over its ranks so that each projects as many of them as any
other (:func:`~.sharded.balanced_bounds`), and a rank holds the features of only the rows it projects, as the trainer
reads them (:class:`~.objectives.DeferredFeatures`): ``cp`` and ``csbp`` about ``1 / C`` of the seen rows each, ``bp``
those its own anchors see, ``dp`` (and ``single``) all the seen rows of its sequence. A step costs about ``A x B``
queries over ``9 A + W`` rows per layer, growing like ``L^2`` through ``A = L / 512``. ``cp`` runs all ``A`` anchors
on every rank; ``bp`` and ``csbp`` ``A / P`` each; ``dp`` all ``A`` of its own sequence.

**A step** is the trainer's: draw the anchors, build the plan, forward, D-PACE loss (summed over the group where
ranks hold disjoint anchors), backward. The optimizer and DDP's gradient all-reduce are left out, as in the other
studies (the all-reduce is the same ~1.5M parameters under every layout).

**Processes per core.** This machine may have fewer cores than ranks (P = 4 on 2 cores: two ranks share a core).
Each rank therefore measures its compute rate right before every step, all ranks at once: a fixed matrix product
(:func:`compute_rate`, the drafter's MLP shape) in GFLOP/s. The record keeps every rank's rate; the report divides a
launch's rate by the single process's (same run, same length) and gives each time also *normalised* to one core per
rank (the time times that ratio): what the layout would take were every rank alone on a core as fast as the single
process. Ratios between layouts at the same P share the oversubscription; the normalised times compare across P.

**Per (P, L, layout)**, one fresh launch (``torchrun`` for ``P > 1``): every timed step after one warm-up (at least
:data:`~hf_bdlm.benchmarks.spread.MIN_TIMED_STEPS`; the slowest rank's time of each), reported as median and range
(:class:`~hf_bdlm.benchmarks.spread.Spread`); per rank its step times, its compute time (the process's CPU time over
the step: what it computed, whatever else shared its core) and its compute rate; context tokens/s and supervised
tokens/s (per sequence); peak memory per rank (``ru_maxrss`` above the RSS once the drafter is built: the rank's
feature rows, listed beside, and the step), the context rows each rank projected, context K/V bytes each rank received
in the last step (the group's byte meter) beside :func:`~.sharded.context_bytes`' formula, exposed waits (time
blocked on the K/V exchanges, forward and backward), and the group's summed loss (``dp``: rank 0's), which equals the
single process's on the same anchors. The report compares csbp with every baseline by
:func:`~hf_bdlm.benchmarks.spread.compare` (ratio of medians per sequence; a tie where the ranges overlap), also on
the slowest rank's CPU seconds per sequence, and gives the peak-memory ratios.

    hf-bdlm bench --only drafter --quick --out /tmp/bench       # L = 2048, P = 2: about a minute on 2 idle cores
    hf-bdlm bench --only drafter --out bench_results             # L = 64K, 128K, 192K: ~20 minutes
    torchrun --nproc_per_node 2 -m hf_bdlm.models.dflash.studies.benchmark --worker --layout csbp --length 4096 \\
        --out /tmp/csbp.json                                      # one measurement
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from ....benchmarks.bench_command import positive_int
from ....benchmarks.parallel_modes import current_rss, peak_rss
from ....benchmarks.processes import child_env
from ....benchmarks.report import length_label, rows_table
from ....benchmarks.spread import MIN_TIMED_STEPS, Spread, check_timed_steps, compare

MODULE = f"{__package__}.benchmark"  # what ``python -m`` / ``torchrun -m`` run (also when this file is __main__)
LAYOUTS = ("csbp", "cp", "bp", "dp")
BASELINES = ("cp", "bp", "dp")
# What a user could run instead of csbp on the same ranks: the strongest baseline is the faster of these.
ALTERNATIVES = ("bp", "dp")
SINGLE = "single"
# The published DFlash2 drafter of a Qwen3-27B-class target (see the module docstring), scaled to hidden 256.
DRAFTER = dict(vocab_size=8192, hidden_size=256, intermediate_size=864, num_attention_heads=8, num_key_value_heads=2,
               head_dim=32, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0},
               max_position_embeddings=262144)
DFLASH2 = dict(block_size=8, conv_kernel_size=2, conv_group_size=16, selector_rank=16, selector_top_k=16)
TARGET_LAYER_IDS, NUM_TARGET_LAYERS = (6, 20, 34, 48, 62), 64
WINDOW = 2048
# The recipe draws 2048 anchors per sequence of 1M tokens.
RECIPE_ANCHORS, RECIPE_LENGTH = 2048, 2**20
# Feature rows are drawn in chunks seeded by their index (and the sequence's), so any rank makes exactly its rows,
# equal in every layout.
FEATURE_CHUNK = 256
# The compute-rate probe before every step: a matrix product of the drafter's MLP shape, about 0.1 s on one core.
RATE_ROWS, RATE_REPEATS = 1024, 12
# The presets fill the options left unset (``hf-bdlm bench --quick`` picks QUICK). Full: about 20 minutes on 2 idle
# cores (192K: cp at P = 4 holds ~2.4 GB per rank, ~10 GB in all; 256K would need ~4 GB per rank and double the time).
FULL = dict(lengths=(65536, 131072, 196608), nprocs=(2, 4), layouts=LAYOUTS, layers=1, window=WINDOW)
QUICK = dict(lengths=(2048,), nprocs=(2,), layouts=LAYOUTS, layers=1, window=WINDOW)


def recipe_anchors(length: int) -> int:
    """Anchors per sequence of ``length`` tokens at the recipe's density (2048 per 1M tokens), at least one."""
    return max(1, length * RECIPE_ANCHORS // RECIPE_LENGTH)


def ring_size(layout: str, P: int) -> int:
    """Ranks ``C`` one copy of the context is sharded over: ``P`` under ``cp`` and ``csbp``, else 1."""
    return P if layout in ("cp", "csbp") else 1


def sequences_per_step(layout: str, P: int) -> int:
    """Sequences one step of a launch trains: ``P`` under ``dp`` (one per rank), else one per group."""
    return P if layout == "dp" else 1


@dataclass(frozen=True)
class DrafterStudy:
    """One run of the study, every option resolved.

    Parameters:
        lengths (`tuple[int, ...]`): context lengths ``L``. nprocs (`tuple[int, ...]`): group sizes ``P`` (the
            single process always runs too). layouts (`tuple[str, ...]`): of ``csbp``, ``cp``, ``bp``, ``dp``.
        layers (`int`): drafter layers. window (`int | None`): their sliding window (`None`: full attention).
        anchors (`int | None`): anchors per sequence (`None`: :func:`recipe_anchors` of each length).
        steps (`int`): timed steps after one warm-up (at least 3). timeout (`float`): seconds per launch.
    """

    lengths: tuple[int, ...]
    nprocs: tuple[int, ...]
    layouts: tuple[str, ...]
    layers: int
    window: int | None
    anchors: int | None
    steps: int
    timeout: float

    def anchors_at(self, length: int) -> int:
        return self.anchors or recipe_anchors(length)

    def configurations(self) -> list[tuple[str, int, int]]:
        """``(layout, P, L)`` of every launch: at each length the single process, then every layout at each P."""
        return [(layout, P, L) for L in self.lengths
                for layout, P in [(SINGLE, 1)] + [(m, P) for P in self.nprocs for m in LAYOUTS if m in self.layouts]]


# ----------------------------------------------------------------------------------------------------------------------
# the benchmark drafter and its inputs
# ----------------------------------------------------------------------------------------------------------------------
def benchmark_config(layers: int = 1, window: int | None = WINDOW):
    """The benchmark drafter's `DFlashConfig` (see the module docstring)."""
    # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)
    from ..configuration import DFlashConfig

    kinds = ["sliding_attention" if window else "full_attention"] * layers
    return DFlashConfig(**DRAFTER, **DFLASH2, num_hidden_layers=layers, layer_types=kinds, sliding_window=window,
                        mask_token_id=DRAFTER["vocab_size"] - 1, target_layer_ids=list(TARGET_LAYER_IDS),
                        num_target_layers=NUM_TARGET_LAYERS, target_hidden_size=DRAFTER["hidden_size"],
                        is_causal=False)


def benchmark_target_ends(vocab_size: int, hidden_size: int):
    """The parts of a target a drafter's training step uses: its input embedding and LM head (random; the features
    stand in for the rest)."""
    from torch import nn  # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)

    from ..target import TargetHeads  # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)

    embed_tokens = nn.Embedding(vocab_size, hidden_size)
    lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
    nn.init.normal_(embed_tokens.weight, std=0.02)
    return TargetHeads(embed_tokens, lm_head, None, None, source="random (the drafter study)")


def benchmark_drafter(layers: int = 1, window: int | None = WINDOW):
    """The benchmark drafter (random, the same in every process), bound to :func:`benchmark_target_ends`."""
    import torch  # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)

    # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)
    from ..modeling import DFlash2DraftModel

    config = benchmark_config(layers, window)
    torch.manual_seed(0)
    drafter = DFlash2DraftModel(config).float()
    return drafter.bind_target(benchmark_target_ends(config.vocab_size, config.hidden_size)).train()


def benchmark_tokens(length: int, vocab_size: int = DRAFTER["vocab_size"], sequence: int = 0):
    """``(input_ids, loss_mask)`` of benchmark sequence ``sequence`` ``[1, L]``: random tokens, every one supervised
    (sequence 0: the one every layout but ``dp``'s other ranks trains)."""
    import torch  # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)

    ids = torch.randint(1, vocab_size - 1, (1, length), generator=torch.Generator().manual_seed(1 + sequence))
    return ids, torch.ones_like(ids)


def benchmark_objective(anchors: int, sequence: int = 0):
    """The recipe's objective for the benchmark drafter: ``anchors`` per sequence drawn by the locality sampler (seed
    ``sequence``, the same on every rank training that sequence), D-PACE."""
    # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)
    from ..training.objectives import DFlashObjective

    return DFlashObjective(mask_token_id=DRAFTER["vocab_size"] - 1, block_size=DFLASH2["block_size"],
                           max_anchors=anchors, loss="dpace", anchor_sampling="locality", seed=sequence)


def benchmark_features(runs, width: int, sequence: int = 0):
    """Feature rows ``runs`` (ascending ``[start, stop)``) of benchmark sequence ``sequence``, ``[1, rows, width]``:
    standard normal, drawn chunk by chunk into one buffer, so a rank makes (and holds) only the rows it projects, as
    the trainer reads them (every row the same on every rank)."""
    import torch  # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)

    out = torch.empty(1, sum(stop - start for start, stop in runs), width)
    at = 0
    for start, stop in runs:
        for chunk in range(start // FEATURE_CHUNK, -(-stop // FEATURE_CHUNK)):
            first = chunk * FEATURE_CHUNK
            seed = 10_000 + chunk + sequence * 1_000_000
            rows = torch.randn(FEATURE_CHUNK, width, generator=torch.Generator().manual_seed(seed))
            lo, hi = max(start, first), min(stop, first + FEATURE_CHUNK)
            out[0, at + lo - start:at + hi - start] = rows[lo - first:hi - first]
        at += stop - start
    return out


def compute_rate(rows: int = RATE_ROWS, repeats: int = RATE_REPEATS) -> float:
    """This process's matrix-product rate now, GFLOP/s: ``repeats`` products of ``[rows, hidden]`` by the drafter's
    ``[intermediate, hidden]`` MLP weight (one thread, float32). Ranks sharing a core measure about half of a rank
    alone."""
    import torch  # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, DRAFTER["hidden_size"], generator=g)
    w = torch.randn(DRAFTER["intermediate_size"], DRAFTER["hidden_size"], generator=g)
    torch.nn.functional.linear(x, w)  # allocate once outside the timing
    t0 = time.perf_counter()
    for _ in range(repeats):
        torch.nn.functional.linear(x, w)
    seconds = time.perf_counter() - t0
    return 2 * rows * DRAFTER["hidden_size"] * DRAFTER["intermediate_size"] * repeats / seconds / 1e9


# ----------------------------------------------------------------------------------------------------------------------
# worker: one process, or one rank of a torchrun group
# ----------------------------------------------------------------------------------------------------------------------
def _worker(args: argparse.Namespace) -> None:
    """One measurement: the single process (``--layout single``), or one rank of a ``torchrun`` group whose rank 0
    writes the group's record. ``dp`` ranks train a sequence each, alone; the group only starts their steps together
    and gathers the record."""
    import torch  # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)
    import torch.distributed as dist

    # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)
    from ....parallel.collectives import ByteMeter
    from ....parallel.dims import ParallelDims
    from ....parallel.groups import BlockParallelGroups

    torch.set_num_threads(1)
    if args.layout == SINGLE:
        mine = _rank_steps(args, None, sequence=0)
        pathlib.Path(args.out).write_text(json.dumps(_group_record(args, 1, 1, [mine])))
        return
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = None
    if args.layout != "dp":
        groups = BlockParallelGroups.build(ParallelDims(world, None, args.layout), "cpu", ByteMeter())
    mine = _rank_steps(args, groups, sequence=rank if args.layout == "dp" else 0)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    C = groups.dims.clean_ring_size if groups is not None else 1
    record = _group_record(args, world, C, everyone)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        pathlib.Path(args.out).write_text(json.dumps(record))


def _rank_steps(args: argparse.Namespace, groups, sequence: int) -> dict:
    """This rank's (or the single process's) timed steps after one warm-up: step times, compute rates, waits, bytes
    received and their formula, losses, peak memory. The single process and every ``dp`` rank run the same sharded
    forward with a one-rank plan (so they compact the context as the ranks do), ``dp`` rank ``r`` on sequence
    ``r``."""
    import torch.distributed as dist  # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)

    # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)
    from ..training.sharded import DFlashShardPlan, context_bytes, sharded_draft_forward

    drafter = benchmark_drafter(args.layers, args.window or None)
    config = drafter.config
    ids, loss_mask = benchmark_tokens(args.length, config.vocab_size, sequence)
    objective = benchmark_objective(args.anchors, sequence)
    windows = [config.layer_window(i) for i in range(config.num_hidden_layers)]
    synchronized = dist.is_available() and dist.is_initialized()
    if groups is None:  # the single process, or a dp rank: alone on its sequence
        mode, P, C, rank, comms, ring = "bp", 1, 1, 0, (), None
    else:
        mode, P, C, rank = args.layout, groups.dims.block_parallel_size, groups.dims.clean_ring_size, groups.group_rank
        comms, ring = (groups.group, groups.ring), groups.ring if C > 1 else None

    def plan_of(batch):
        return DFlashShardPlan.build(batch, mode=mode, world=P, rank=rank, layer_windows=windows, ring_size=C)

    base = current_rss()  # the peak counts the rank's feature rows: the layout decides them
    kv = dict(batch_size=1, kv_width=config.num_key_value_heads * config.head_dim, element_size=4)
    times, cpu_times, rates, fwd_waits, waits, losses, supervised, projected, feature_bytes = ([] for _ in range(9))
    for step in range(args.steps + 1):  # step 0 is the warm-up
        drafter.zero_grad(set_to_none=True)
        t_plan, c_plan = time.perf_counter(), time.process_time()
        batch = objective.prepare(ids, loss_mask, step=step)
        plan = plan_of(batch)
        t_plan, c_plan = time.perf_counter() - t_plan, time.process_time() - c_plan
        # The rows this rank projects (the plan's, from this step's anchors), as the trainer reads them from the
        # capture; drawn outside the timed step (a trainer reads them from disk, not from a random generator).
        features = benchmark_features(plan.projected_runs, config.feature_width, sequence)
        if groups is not None:
            groups.meter.next_step()
        if synchronized:
            dist.barrier()  # every rank probes its rate at once: the rate under this launch's processes per core
        rate = compute_rate()
        if synchronized:
            dist.barrier()  # start together: the slowest rank's time is the group's step time
        wait0 = sum(c.wait_seconds for c in comms)
        t0 = time.perf_counter() - t_plan  # the step counts its anchors' draw and its plan
        c0 = time.process_time() - c_plan
        share = plan.select(batch)
        out = sharded_draft_forward(drafter, features, ids, share, plan, ring)
        loss = _loss(objective, drafter, out.hidden_states, share, plan.global_sum(groups and groups.group))
        loss = loss * plan.loss_scale
        wait_fwd = sum(c.wait_seconds for c in comms) - wait0
        loss.backward()
        dt = time.perf_counter() - t0
        cpu = time.process_time() - c0  # this process's CPU time: its compute, whatever else shares its core
        total = loss.detach().clone()
        if groups is not None:
            dist.all_reduce(total, group=groups.group.group)  # the group's loss: the single process's
        if step:
            times.append(dt)
            cpu_times.append(cpu)
            rates.append(rate)
            fwd_waits.append(wait_fwd)
            waits.append(sum(c.wait_seconds for c in comms) - wait0)
            losses.append(total.item())
            supervised.append(int(batch.supervised_mask.sum()))
            projected.append(plan.num_projected)
            feature_bytes.append(features.numel() * 4)
        del out, loss, features
    names = groups.meter.by_name() if groups is not None else {}
    return dict(times=times, cpu_times=cpu_times, rates=rates, fwd_waits=fwd_waits, waits=waits, bytes=names,
                losses=losses,
                supervised=supervised, anchors=len(plan.anchor_slots[rank]), projected=projected,
                features=max(feature_bytes),
                forward_bytes=sum(v for k, v in names.items() if k.endswith((".all_gather", ".all_to_all"))),
                backward_bytes=sum(v for k, v in names.items()
                                   if k.endswith((".reduce_scatter", ".all_to_all_backward"))),
                formula=list(context_bytes(plan, windows, **kv)), peak=peak_rss() - base, peak_abs=peak_rss())


def _loss(objective, drafter, hidden, batch, global_sum=None):
    return objective.loss_from_hidden(hidden, drafter.lm_head.weight, batch, selector=drafter.candidate_selector,
                                      global_sum=global_sum)


def _group_record(args, P: int, C: int, everyone: list[dict]) -> dict:
    """The group's record from every rank's measurements: per step the slowest rank's time (per sequence: over the
    step's sequences) and the slowest rank's CPU time (per sequence); per rank its step times, CPU times, compute
    rates, peak
    memory, received bytes and their formula."""
    steps = len(everyone[0]["times"])
    step_times = [max(r["times"][i] for r in everyone) for i in range(steps)]
    step_s = statistics.median(step_times)
    sequences = sequences_per_step(args.layout, P)
    received = [r["forward_bytes"] + r["backward_bytes"] for r in everyone]
    names = sorted({n for r in everyone for n in r["bytes"]})
    rates = [statistics.median(r["rates"]) for r in everyone]
    return dict(
        study="drafter", layout=args.layout, P=P, C=C, L=args.length, layers=args.layers, window=args.window or None,
        block_size=DFLASH2["block_size"], anchors=args.anchors, anchors_per_rank=[r["anchors"] for r in everyone],
        steps=steps, step_s=step_s, step_times=step_times, step_low_s=min(step_times), step_high_s=max(step_times),
        sequences_per_step=sequences, seconds_per_sequence=[t / sequences for t in step_times],
        step_times_per_rank=[r["times"] for r in everyone],
        step_s_per_rank=[statistics.median(r["times"]) for r in everyone],
        cpu_times_per_rank=[r["cpu_times"] for r in everyone],
        compute_s_per_rank=[statistics.median(r["cpu_times"]) for r in everyone],
        cpu_seconds_per_sequence=[max(r["cpu_times"][i] for r in everyone) / sequences for i in range(steps)],
        compute_rates_per_rank=[r["rates"] for r in everyone], compute_rate_per_rank=rates,
        compute_rate_gflops=statistics.median(rates),
        context_tokens_per_s=sequences * args.length / step_s,
        supervised_tokens=statistics.median(everyone[0]["supervised"]),
        supervised_tokens_per_s=sum(statistics.median(r["supervised"]) for r in everyone[:sequences]) / step_s,
        projected_rows_per_rank=[statistics.median(r["projected"]) for r in everyone],
        features_bytes_per_rank=[r["features"] for r in everyone],
        peak_mem_bytes=max(r["peak"] for r in everyone), peak_mem_per_rank=[r["peak"] for r in everyone],
        peak_rss_bytes=max(r["peak_abs"] for r in everyone),
        bytes_per_rank=received, bytes_per_step=max(received),
        bytes_fwd_bwd_per_rank=[[r["forward_bytes"], r["backward_bytes"]] for r in everyone],
        context_bytes_per_rank=[r["formula"] for r in everyone],
        bytes_match=all([r["forward_bytes"], r["backward_bytes"]] == r["formula"] for r in everyone),
        bytes_by_name={n: max(r["bytes"].get(n, 0) for r in everyone) for n in names},
        comm_wait_s=max(statistics.median(r["waits"]) for r in everyone),
        comm_wait_fwd_s=max(statistics.median(r["fwd_waits"]) for r in everyone),
        comm_wait_bwd_s=max(statistics.median([w - f for w, f in zip(r["waits"], r["fwd_waits"])])
                            for r in everyone),
        losses=everyone[0]["losses"], losses_per_rank=[r["losses"] for r in everyone])


# ----------------------------------------------------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------------------------------------------------
def launch(layout: str, P: int, L: int, study: DrafterStudy, tmp: pathlib.Path) -> dict:
    """One configuration's record from a fresh launch (one that crashed runs once more, its error kept in
    ``retried_after_error``: gloo's teardown racing the exit is seen about once in a few hundred launches)."""
    record = _launch_once(layout, P, L, study, tmp)
    if "error" in record and not record["error"].startswith("timed out"):
        first = record["error"]
        record = dict(_launch_once(layout, P, L, study, tmp), retried_after_error=first[-1500:])
    return record


def _launch_once(layout: str, P: int, L: int, study: DrafterStudy, tmp: pathlib.Path) -> dict:
    tmp = pathlib.Path(tmp).resolve()
    out = tmp / f"drafter_{layout}_P{P}_L{L}.json"
    out.unlink(missing_ok=True)
    common = ["--worker", "--layout", layout, "--length", str(L), "--layers", str(study.layers),
              "--window", str(study.window or 0), "--anchors", str(study.anchors_at(L)), "--steps", str(study.steps),
              "--out", str(out)]
    if P == 1:
        cmd = [sys.executable, "-m", MODULE, *common]
    else:  # --standalone picks a free rendezvous port
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(P), "-m", MODULE,
               *common]
    base = dict(study="drafter", layout=layout, P=P, C=ring_size(layout, P), L=L, layers=study.layers,
                window=study.window, anchors=study.anchors_at(L))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=child_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"), cwd=tmp,
                              capture_output=True, text=True, timeout=study.timeout)
    except subprocess.TimeoutExpired:
        return dict(base, error=f"timed out after {study.timeout}s")
    if proc.returncode or not out.exists():
        return dict(base, error=(proc.stderr or proc.stdout)[-3000:])
    return dict(json.loads(out.read_text()), wall_s=time.perf_counter() - t0)


def resolve(cfg, args: argparse.Namespace) -> DrafterStudy:
    """The study's settings: the ``--drafter-*`` options, the preset (:data:`QUICK` when ``cfg.quick``, else
    :data:`FULL`) for those left unset, the suite's ``--timeout``, and ``--steps`` when given (else
    :data:`~hf_bdlm.benchmarks.spread.MIN_TIMED_STEPS`: every figure carries a range). ``ValueError`` naming the
    option on a combination no layout can run, or on fewer than 3 timed steps."""
    preset = QUICK if cfg.quick else FULL

    def pick(name):
        value = getattr(args, f"drafter_{name}", None)
        value = preset[name] if value is None else value
        return tuple(value) if isinstance(value, (list, tuple)) else value

    window = pick("window")
    steps = getattr(args, "steps", None)
    steps = check_timed_steps(MIN_TIMED_STEPS if steps is None else steps, "--steps")
    study = DrafterStudy(lengths=pick("lengths"), nprocs=pick("nprocs"), layouts=pick("layouts"), layers=pick("layers"),
                         window=window or None, anchors=getattr(args, "drafter_anchors", None), steps=steps,
                         timeout=cfg.timeout)
    bad = [L for L in study.lengths if any(L % P for P in study.nprocs)]
    if bad:
        raise ValueError(f"--drafter-lengths {' '.join(map(str, bad))}: csbp and cp cut the context into P "
                         f"equal shards, so every length must be a multiple of every --drafter-nprocs "
                         f"({' '.join(map(str, study.nprocs))}); e.g. multiples of 512")
    return study


def check_arguments(cfg, args: argparse.Namespace) -> None:
    """Refuse, before anything runs, options no layout can run (:func:`resolve`'s ``ValueError``)."""
    resolve(cfg, args)


def run(cfg, args: argparse.Namespace, out: pathlib.Path, log=print) -> list[dict]:
    """Run the study; every record, also written to ``out`` (a JSON list) as it goes. Records already in ``out`` of
    configurations this run does not measure are kept, so a second run with other lengths adds its own.

    Args:
        cfg: the suite's `BenchConfig` (``quick``, ``timeout``).
        args (`argparse.Namespace`): the parsed ``--drafter-*`` options (:func:`add_arguments`) and ``--steps``.
        out (`pathlib.Path`): the study's JSON file.
    """
    study = resolve(cfg, args)
    configs = study.configurations()
    log(f"drafter: {len(configs)} runs (L {', '.join(map(str, study.lengths))}; P 1, "
        f"{', '.join(map(str, study.nprocs))}; {', '.join(study.layouts)}; {study.layers} layer(s), "
        + (f"window {study.window}" if study.window else "full attention")
        + f", anchors {', '.join(str(study.anchors_at(L)) for L in study.lengths)}; {study.steps} timed steps after "
        "a warm-up)")
    out = pathlib.Path(out)
    planned = {(layout, P, L) for layout, P, L in configs}
    kept = [r for r in (json.loads(out.read_text()) if out.exists() else [])
            if (r["layout"], r["P"], r["L"]) not in planned]
    records: list[dict] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for i, (layout, P, L) in enumerate(configs, 1):
            record = launch(layout, P, L, study, pathlib.Path(tmp))
            records.append(record)
            log(f"  [drafter {i}/{len(configs)}, {time.perf_counter() - started:5.0f} s] {_line(record)}")
            out.write_text(json.dumps(kept + records, indent=1))
    return records


def _line(r: dict) -> str:
    name = f"{r['layout']:6} P={r['P']} L={r['L']:>6}"
    if "error" in r:
        return f"{name}: ERROR {(r['error'].strip().splitlines() or ['?'])[-1][:100]}"
    return (f"{name}: {per_sequence(r).describe('.3f')} s/sequence  {r['compute_rate_gflops']:5.1f} GFLOP/s/rank  "
            f"{r['supervised_tokens_per_s']:7.1f} supervised tok/s  peak {r['peak_mem_bytes'] / 2**20:7.1f} MiB/rank  "
            f"K/V {r['bytes_per_step'] / 2**20:6.2f} MiB/rank{'' if r['bytes_match'] else ' (NOT the formula)'}  "
            f"wait {r['comm_wait_s']:.3f} s  (run {r.get('wall_s', 0):.0f} s)")


# ----------------------------------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------------------------------
def per_sequence(record: dict, scale: float = 1.0) -> Spread:
    """A record's time per trained sequence over its timed steps (the slowest rank's step time over the step's
    sequences), times ``scale``."""
    times = record.get("seconds_per_sequence") or [t / record.get("sequences_per_step", 1)
                                                   for t in record["step_times"]]
    return Spread([t * scale for t in times])


def cpu_per_sequence(record: dict) -> Spread | None:
    """A record's compute per trained sequence over its timed steps: the slowest rank's CPU seconds (exposed waits and
    time spent descheduled excluded) over the step's sequences; ``None`` for a record without them."""
    times = record.get("cpu_seconds_per_sequence")
    return Spread(times) if times else None


def rate_ratio(record: dict, single: dict | None) -> float | None:
    """The record's per-rank compute rate over the single process's at the same length (same run): about 1 when
    every rank has a core of its own, about 1/2 when two ranks share one. ``None`` without both rates."""
    if not single or "compute_rate_gflops" not in record or "compute_rate_gflops" not in single:
        return None
    return record["compute_rate_gflops"] / single["compute_rate_gflops"]


def rows(records: list[dict]) -> list[dict]:
    """One row per measured (P, L, layout), sorted by L, P and layout (single, csbp, cp, bp, dp): the record, its
    time per sequence (:func:`per_sequence`), its rate relative to the single process (:func:`rate_ratio`) and that
    time normalised to one core per rank (times the ratio), its compute per sequence (:func:`cpu_per_sequence`), and
    the relative difference of its loss (first timed step) from the single process's."""
    ok = {(r["layout"], r["P"], r["L"]): r for r in records if "error" not in r}
    order = (SINGLE, *LAYOUTS)
    out = []
    for (layout, P, L), r in sorted(ok.items(), key=lambda kv: (kv[0][2], kv[0][1], order.index(kv[0][0]))):
        single = ok.get((SINGLE, 1, L))
        ratio = rate_ratio(r, single)
        loss_diff = (abs(r["losses"][0] - single["losses"][0]) / abs(single["losses"][0])
                     if single and r.get("losses") and single.get("losses") else None)
        out.append(dict(layout=layout, P=P, L=L, record=r, per_sequence=per_sequence(r), rate_ratio=ratio,
                        normalised=None if ratio is None else per_sequence(r, ratio), cpu=cpu_per_sequence(r),
                        loss_diff=loss_diff))
    return out


def comparisons(records: list[dict]) -> list[dict]:
    """Per (P, L) with a csbp record: csbp's time per sequence, and against each baseline measured there the
    :class:`~hf_bdlm.benchmarks.spread.Comparison` (baseline's time per sequence over csbp's: > 1 csbp is faster;
    a tie where the ranges overlap), the same on times normalised to one core per rank and on compute (the slowest
    rank's CPU seconds per sequence), and csbp's peak memory per rank over the baseline's; ``strongest``: the
    faster of ``bp`` and ``dp`` (median time per sequence), ``strongest_cpu``: the one with less compute (median
    CPU seconds per sequence)."""
    by = {(row["layout"], row["P"], row["L"]): row for row in rows(records)}
    out = []
    for (layout, P, L), row in by.items():
        if layout != "csbp":
            continue
        entry = dict(P=P, L=L, csbp=row["per_sequence"], csbp_normalised=row["normalised"], csbp_cpu=row["cpu"],
                     against={})
        for base in BASELINES:
            other = by.get((base, P, L))
            if other is None:
                continue
            normalised = (compare(other["normalised"], row["normalised"])
                          if other["normalised"] is not None and row["normalised"] is not None else None)
            cpu = compare(other["cpu"], row["cpu"]) if other["cpu"] is not None and row["cpu"] is not None else None
            entry["against"][base] = dict(
                comparison=compare(other["per_sequence"], row["per_sequence"]), normalised=normalised, cpu=cpu,
                memory_ratio=row["record"]["peak_mem_bytes"] / other["record"]["peak_mem_bytes"])
        alternatives = [b for b in ALTERNATIVES if b in entry["against"]]
        entry["strongest"] = min(alternatives, key=lambda b: by[(b, P, L)]["per_sequence"].median, default=None)
        with_cpu = [b for b in alternatives if by[(b, P, L)]["cpu"] is not None]
        entry["strongest_cpu"] = min(with_cpu, key=lambda b: by[(b, P, L)]["cpu"].median, default=None)
        out.append(entry)
    return out


HEAD = ["P", "L", "layout", "anchors/rank", "rows projected/rank", "sequences/step", "s/sequence median [range]",
        "compute s/rank/step", "rate vs P=1", "s/sequence, one core per rank", "supervised tok/s", "features MiB/rank",
        "peak MiB/rank", "K/V MiB/rank", "= context_bytes", "wait s (fwd/bwd)", "loss vs P=1"]
COMPARE_HEAD = ["P", "L", "csbp s/sequence", "vs cp (paper)", "vs bp", "vs dp", "strongest", "vs strongest",
                "vs strongest, one core per rank", "csbp CPU s/sequence", "vs cp, CPU s", "vs bp, CPU s",
                "vs dp, CPU s", "peak memory csbp/cp", "csbp/bp", "csbp/dp"]


def _spread(values, fmt: str = "{:g}") -> str:
    """``"96"`` when every rank has the same, else ``"0-2556"``."""
    low, high = min(values), max(values)
    return fmt.format(low) if low == high else f"{fmt.format(low)}-{fmt.format(high)}"


def table(records: list[dict], markdown: bool = False) -> str:
    """The study's measurements: per (P, L, layout) the anchors and projected context rows per rank, sequences per
    step, the time per sequence (median [range] over the timed steps), the largest rank's compute time (its CPU
    seconds a step, median), the per-rank compute rate relative to the single process's and the time per sequence
    normalised by it (one core per rank), supervised tokens/s, the feature rows held and the peak memory (largest
    rank), K/V bytes received (largest rank) and whether every rank's equal the formula, exposed waits and the loss
    against the single process's; failed launches last."""
    body = []
    for row in rows(records):
        r = row["record"]
        body.append([str(row["P"]), length_label(row["L"]), row["layout"], _spread(r["anchors_per_rank"]),
                     _spread(r["projected_rows_per_rank"]), str(r.get("sequences_per_step", 1)),
                     row["per_sequence"].describe(".3f"),
                     f"{max(r['compute_s_per_rank']):.3f}" if "compute_s_per_rank" in r else "-",
                     "-" if row["rate_ratio"] is None else f"{row['rate_ratio']:.2f}",
                     "-" if row["normalised"] is None else row["normalised"].describe(".3f"),
                     f"{r['supervised_tokens_per_s']:.1f}",
                     f"{max(r['features_bytes_per_rank']) / 2**20:.1f}", f"{r['peak_mem_bytes'] / 2**20:.1f}",
                     f"{r['bytes_per_step'] / 2**20:.2f}", "yes" if r["bytes_match"] else "NO",
                     f"{r['comm_wait_s']:.3f} ({r['comm_wait_fwd_s']:.3f}/{r['comm_wait_bwd_s']:.3f})",
                     "-" if row["loss_diff"] is None else f"{row['loss_diff']:.0e}"])
    for r in records:
        if "error" in r:
            message = (r["error"].strip().splitlines() or ["?"])[-1][:80]
            body.append([str(r["P"]), length_label(r["L"]), r["layout"], *["-"] * (len(HEAD) - 4),
                         f"ERROR {message}"])
    return rows_table(HEAD, body, markdown)


def comparison_table(records: list[dict], markdown: bool = False) -> str:
    """csbp against every baseline per (P, L): its time per sequence (median [range]); the baselines' time over it
    (``2.52x``, or ``tie (0.97x)`` where the ranges overlap); the strongest baseline (faster of bp and dp) and the
    ratio over it, also with every time normalised to one core per rank and on the slowest rank's CPU seconds per
    sequence; csbp's peak memory per rank over each baseline's."""
    body = []
    for entry in comparisons(records):
        against = entry["against"]

        def cell(base, key="comparison"):
            found = against.get(base, {}).get(key)
            return "-" if found is None else found.describe()

        def memory(base):
            return f"{against[base]['memory_ratio']:.2f}x" if base in against else "-"

        strongest = entry["strongest"]
        body.append([str(entry["P"]), length_label(entry["L"]), entry["csbp"].describe(".3f"), cell("cp"),
                     cell("bp"), cell("dp"), strongest or "-", cell(strongest) if strongest else "-",
                     cell(strongest, "normalised") if strongest else "-",
                     "-" if entry["csbp_cpu"] is None else entry["csbp_cpu"].describe(".3f"),
                     cell("cp", "cpu"), cell("bp", "cpu"), cell("dp", "cpu"), memory("cp"), memory("bp"),
                     memory("dp")])
    return rows_table(COMPARE_HEAD, body, markdown)


def _extent(values, fmt: str = "{:.2f}x") -> str:
    return "-" if not values else (fmt.format(min(values)) if min(values) == max(values)
                                   else f"{fmt.format(min(values))}-{fmt.format(max(values))}")


def findings(records: list[dict]) -> list[str]:
    """The comparison in a few lines: per P, csbp's ratio over each baseline (their range over the lengths, and how
    many cells are ties), and the memory ratios; the rate of each group size relative to the single process's."""
    entries = comparisons(records)
    lines = []
    for P in sorted({e["P"] for e in entries}):
        mine = [e for e in entries if e["P"] == P]
        parts = []
        for base in (*BASELINES, "strongest"):
            found = [(e["against"][e["strongest"] if base == "strongest" else base]["comparison"])
                     for e in mine if (e["strongest"] if base == "strongest" else base) in e["against"]]
            if not found:
                continue
            ties = sum(c.tie for c in found)
            parts.append(f"vs {base} {_extent([c.ratio for c in found])}"
                         + (f" ({ties} of {len(found)} ties)" if ties else ""))
        for base in (*BASELINES, "strongest"):
            cpu = [e["against"][e["strongest_cpu"] if base == "strongest" else base]["cpu"] for e in mine
                   if (e["strongest_cpu"] if base == "strongest" else base) in e["against"]]
            cpu = [c for c in cpu if c is not None]
            if cpu:
                ties = sum(c.tie for c in cpu)
                parts.append(f"by CPU seconds vs {base} {_extent([c.ratio for c in cpu])}"
                             + (f" ({ties} of {len(cpu)} ties)" if ties else ""))
        memory = {b: [e["against"][b]["memory_ratio"] for e in mine if b in e["against"]] for b in BASELINES}
        ratios = [row["rate_ratio"] for row in rows(records) if row["P"] == P and row["rate_ratio"] is not None]
        lines.append(f"- P = {P}: csbp {'; '.join(parts)}; peak memory per rank "
                     + ", ".join(f"{_extent(v)} of {b}'s" for b, v in memory.items() if v)
                     + (f"; per-rank compute rate {_extent(ratios, '{:.2f}')} of the single process's" if ratios
                        else "") + ".")
    return lines


def report(records: list[dict]) -> str:
    """The study's section of ``summary.md``: a title saying what was measured, :func:`comparison_table`,
    :func:`findings` and :func:`table`."""
    ok = [r for r in records if "error" not in r]
    first = ok[0] if ok else records[0] if records else {}
    layers, window = first.get("layers", "?"), first.get("window")
    anchors = ", ".join(f"{length_label(L)}: {A}" for L, A in sorted({(r["L"], r["anchors"]) for r in ok}))
    steps = sorted({r["steps"] for r in ok})
    title = (f"**DFlash2 drafter training: csbp against cp (the paper's baseline), bp and dp** (benchmark drafter: "
             f"hidden 256, {layers} layer(s), "
             + (f"sliding window {window}" if window else "full attention")
             + f", block {DFLASH2['block_size']}, 5 feature layers, vocabulary {DRAFTER['vocab_size']}; anchors per "
             f"sequence {anchors}; D-PACE with the selector; float32, one thread per rank; step = forward + backward, "
             f"slowest rank; {'/'.join(map(str, steps))} timed steps after a warm-up, median [range]). cp is the "
             "paper's reference CP-only drafter layout (context sharded, every rank drafts all anchors), the baseline "
             "of its published CSBP speed-ups (2.48x at 512K, 7.59x at 1M); bp replicates the context and deals the "
             "anchors; dp trains one sequence per rank (P sequences a step). Times are per sequence; `vs X` = X's "
             "time per sequence over csbp's, a tie where the ranges overlap; the strongest baseline is the faster of "
             "bp and dp. Rate vs P=1: each launch's per-rank compute rate (a fixed matrix product before every step, "
             "all ranks at once) over the single process's at that length; `one core per rank`: times multiplied by "
             "it (P = 4 runs four processes on this machine's cores); `CPU s`: compared on the slowest rank's CPU "
             "seconds per sequence (its compute, whatever else shared its core; exposed waits excluded). Rows "
             "projected: context rows a rank projects "
             "(every layer slides, so only those its ring's anchors can see). Peak MiB: above the built drafter, the "
             "rank's feature rows (features MiB) included. K/V MiB: context K/V received per rank and step, forward "
             "and backward; `= context_bytes`: every rank's bytes equal the formula.")
    parts = [title, comparison_table(records, markdown=True), "\n".join(findings(records)),
             table(records, markdown=True)]
    return "\n\n".join(p for p in parts if p)


# ----------------------------------------------------------------------------------------------------------------------
# arguments
# ----------------------------------------------------------------------------------------------------------------------
def _group_size(text: str) -> int:
    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: group sizes are at least 2 (the single process, P = 1, always "
                                         "runs as the reference)")
    return value


def _window(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a window is a positive number of tokens, or 0 for full attention")
    return value


def add_arguments(group) -> None:
    """The study's ``hf-bdlm bench`` options (``None`` defaults: the preset fills them)."""
    group.add_argument("--drafter-lengths", type=positive_int, nargs="+", default=None, metavar="L",
                       help=f"context lengths, multiples of every P (default: {' '.join(map(str, FULL['lengths']))}; "
                            f"--quick: {' '.join(map(str, QUICK['lengths']))})")
    group.add_argument("--drafter-nprocs", type=_group_size, nargs="+", default=None, metavar="P",
                       help="group sizes besides the single process (default: 2 4; --quick: 2)")
    group.add_argument("--drafter-layouts", nargs="+", choices=LAYOUTS, default=None,
                       help="layouts (default: all four)")
    group.add_argument("--drafter-layers", type=positive_int, default=None, help="drafter layers (default: 1)")
    group.add_argument("--drafter-window", type=_window, default=None, metavar="W",
                       help=f"the layers' sliding window, 0 for full attention (default: {WINDOW}, the published "
                            "drafter's)")
    group.add_argument("--drafter-anchors", type=positive_int, default=None, metavar="A",
                       help="anchors per sequence (default: the recipe's density, 2048 per 1M tokens: L / 512)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help="run one measurement (what the study launches)")
    parser.add_argument("--layout", choices=(SINGLE, *LAYOUTS), default="csbp")
    parser.add_argument("--length", type=positive_int, default=4096)
    parser.add_argument("--layers", type=positive_int, default=FULL["layers"])
    parser.add_argument("--window", type=_window, default=WINDOW, help="0: full attention")
    parser.add_argument("--anchors", type=positive_int, default=None, help="default: L / 512")
    parser.add_argument("--steps", type=positive_int, default=MIN_TIMED_STEPS, help="timed steps after one warm-up")
    parser.add_argument("--out", required=True, help="the record (JSON), written by rank 0")
    args = parser.parse_args(argv)
    if not args.worker:
        parser.error("this module runs one measurement with --worker; the study runs with hf-bdlm bench --only "
                     "drafter")
    args.anchors = args.anchors or recipe_anchors(args.length)
    if args.layout == SINGLE and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        parser.error("--layout single is one process: run it with python -m, not torchrun")
    _worker(args)


if __name__ == "__main__":
    main()
