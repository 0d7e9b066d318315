"""CPU benchmark of a DiffusionGemma training step: hf_bdlm's all-blocks pass against TRL's one-block estimator.

A small but not trivial random ``DiffusionGemmaForBlockDiffusion`` (hidden 256, 4 layers: 3 sliding (W = 128) + 1
full, 4 heads of 64, 2 KV heads, 8 experts top-2, vocab 8192, canvas 64, float32) and one sequence of ``L`` tokens:
a prompt of ``L / 2`` tokens and a response of ``L / 2``. One training step = forward + backward of the loss (no
optimizer), self-conditioning on (both methods then run the first, no-grad decoder pass every step, as TRL's example
always does), default noise range, encoder next-token loss included.

- ``ours``: ``DiffusionGemmaObjective.loss`` (P = 1): the encoder once over the sequence, the decoder over all
  ``L / 2 / 64`` canvas blocks at once, hf_bdlm's ``blockwise`` attention. Supervises every response token.
- ``trl``: the loss computation of TRL's example trainer (``examples/scripts/sft_diffusion_gemma.py``), written here
  from its documented algorithm: one random response block per example; the encoder reads the whole sequence, the
  decoder's mask cuts the cache at the block start; transformers' ``sdpa`` attention. Supervises ``canvas`` tokens.

Reported per (method, L): step time (every one of ``--steps`` timed steps after one warm-up, at least 3: median and
range), supervised tokens per second (the quantity a fixed training budget buys), all tokens per second, and peak
memory (``ru_maxrss`` high-water mark minus the RSS once model and batch are built; each configuration runs in a
fresh process). One thread per process. Ratios are of median seconds per supervised token, and a tie where the two
ranges overlap (``hf_bdlm.benchmarks.spread.compare``).

``--parallel P``: the same step on a block-parallel group of ``P`` ranks (``torchrun``, gloo) in each layout of
``hf_bdlm.models.diffusion_gemma.training.sharded`` (``--layouts``: ``csbp``, ``cp``, ``cp-paper`` the paper's CP baseline,
``block_parallel_cp_layout="paper"``, and ``bp``; all-gather transport), beside TRL's one-block step and ``ours`` at
P = 1. Per rank: its rows of the frame, the loss of its targets, backward (the gradient all-reduce every data-parallel
run adds is left out, the same in every mode). Reported: the group's step time (per step the slowest rank's) and the
slowest rank's CPU time per step, supervised tokens per second, peak memory per rank (max over ranks), K/V bytes
received per rank per step (ByteMeter, max over ranks) and CSBP's speed-up over each layout (wall and CPU time).

    python -m hf_bdlm.models.diffusion_gemma.studies.sft_throughput --lengths 512 1024 --steps 3        # ~1 minute
    python -m hf_bdlm.models.diffusion_gemma.studies.sft_throughput --lengths 512 1024 2048 4096 --out dg.json
    python -m hf_bdlm.models.diffusion_gemma.studies.sft_throughput --parallel 2 --lengths 2048 4096 \
        --out dg_p2.json                                                                            # ~8 minutes
    # the recorded table: + summary.md and the planner's projection of the paper's DiffusionGemma setting
    python -m hf_bdlm.models.diffusion_gemma.studies.sft_throughput --parallel 2 --lengths 4096 8192 --steps 3 \
        --out-dir benchmarks/results/dg_throughput
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

from ....benchmarks.spread import MIN_TIMED_STEPS, Spread, check_timed_steps, compare
from ....planner.hardware import device_spec
from ....planner.model import model_spec
from ....planner.plan_command import PAPER_GROUP, PAPER_PAIR, paper_topology
from ....protocols.registry import family_named

MODULE = "hf_bdlm.models.diffusion_gemma.studies.sft_throughput"  # run as python -m MODULE (its workers too)

CANVAS, VOCAB, WINDOW = 64, 8192, 128
EOS, TURN_END, PAD = 1, 4, 0
LAYOUTS = ("csbp", "cp", "cp-paper", "bp")  # cp-paper: cp in the paper's baseline layout


def _current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def build_model():
    import torch  # lazy: the study's own process only launches workers and loads no torch (4 s measured)
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, Gemma4VisionConfig
    from transformers.models.diffusion_gemma.configuration_diffusion_gemma import DiffusionGemmaTextConfig

    torch.manual_seed(0)
    text = DiffusionGemmaTextConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, global_head_dim=64, num_global_key_value_heads=2,
        layer_types=["sliding_attention"] * 3 + ["full_attention"], sliding_window=WINDOW, num_experts=8,
        top_k_experts=2, moe_intermediate_size=256, max_position_embeddings=65536, pad_token_id=PAD,
        eos_token_id=[EOS, TURN_END], bos_token_id=2,
    )
    vision = Gemma4VisionConfig(hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
                                num_key_value_heads=1, head_dim=8, position_embedding_size=4, patch_size=2)
    config = DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=CANVAS)
    return DiffusionGemmaForBlockDiffusion(config).train()


def build_batch(length: int):
    import torch  # lazy: the study's own process only launches workers and loads no torch (4 s measured)

    g = torch.Generator().manual_seed(length)
    ids = torch.randint(9, VOCAB, (1, length), generator=g)
    ids[0, -1] = TURN_END
    completion = torch.zeros_like(ids)
    completion[0, length // 2 :] = 1
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_mask": completion}


# --- TRL's one-block estimator, from the example's documented algorithm ----------------------------------------------
def trl_loss(model, batch, generator, eps: float = 1e-4, self_conditioning_prob: float = 0.5):
    """One random response block per example; encoder over the whole sequence, decoder mask cut at the block start;
    uniform-token corruption at ``t ~ U(eps, 1 - eps)``; two-pass self-conditioning; CE over the canvas + the
    encoder's next-token CE. Returns ``(loss, supervised tokens)``."""
    import torch  # lazy: the study's own process only launches workers and loads no torch (4 s measured)
    import torch.nn.functional as F

    ids, attention = batch["input_ids"], batch["attention_mask"]
    supervised = batch["completion_mask"].bool() & attention.bool()
    b, length = ids.shape
    B = model.config.canvas_length
    pos = torch.arange(length)
    starts = supervised & ~F.pad(supervised, (1, 0))[:, :-1]
    end = torch.where(supervised, pos, -1).amax(1)
    prefix = torch.where(starts, pos, -1).amax(1).clamp(min=0)
    response = (end - prefix + 1) * (end >= 0)
    blocks = (response - 1).clamp(min=0) // B + 1
    chosen = (torch.rand(b, generator=generator) * blocks).long()
    encoder_len = prefix + chosen * B
    offsets = torch.arange(B)
    in_response = offsets < (response - chosen * B)[:, None]
    source = (encoder_len[:, None] + offsets).clamp(max=length - 1)
    target = torch.where(in_response, ids.gather(1, source), EOS)
    t = eps + (1 - 2 * eps) * torch.rand(b, 1, generator=generator)
    corrupt = torch.rand(b, B, generator=generator) < t
    canvas = torch.where(corrupt, torch.randint(VOCAB, (b, B), generator=generator), target)
    cache_mask = (pos < encoder_len[:, None]).long()
    kwargs = dict(input_ids=ids, attention_mask=attention, decoder_input_ids=canvas,
                  decoder_attention_mask=torch.cat([cache_mask, torch.ones(b, B, dtype=torch.long)], 1),
                  decoder_position_ids=encoder_len[:, None] + offsets)
    with torch.no_grad():
        kwargs["self_conditioning_logits"] = model(**kwargs).logits
    kwargs["self_conditioning_mask"] = torch.rand(b, generator=generator) < self_conditioning_prob
    out = model(**kwargs)
    diffusion = F.cross_entropy(out.logits.flatten(0, 1), target.flatten())
    cap = model.final_logit_softcapping
    encoder_logits = torch.tanh(model.lm_head(out.encoder_last_hidden_state).float() / cap) * cap
    pairs = attention[:, :-1].bool() & attention[:, 1:].bool()
    ar = F.cross_entropy(encoder_logits[:, :-1].flatten(0, 1), torch.where(pairs, ids[:, 1:], -100).flatten())
    return diffusion + ar, b * B


# --- worker -----------------------------------------------------------------------------------------------------
def worker(method: str, length: int, steps: int) -> dict:
    import torch  # lazy: the study's own process only launches workers and loads no torch (4 s measured)

    torch.set_num_threads(1)
    # lazy: the study's own process only launches workers and loads no torch (4 s measured)
    from ....objectives import get_objective

    model = build_model()
    batch = build_batch(length)
    objective = get_objective("diffusion_gemma", dict(block_size=CANVAS, vocab_size=VOCAB, fill_token_id=EOS,
                                                      end_token_ids={EOS, TURN_END}, self_conditioning_prob=1.0))
    generator = torch.Generator().manual_seed(0)
    base_rss = _current_rss()
    times, cpu_times, supervised = [], [], 0
    for step in range(steps + 1):
        model.zero_grad(set_to_none=True)
        start, cpu_start = time.perf_counter(), time.process_time()
        if method == "ours":
            corrupted = objective.corrupt(batch, seed=0, step=step)
            loss, _ = objective.loss(model, corrupted)
            supervised = int(corrupted.normalizer)
        else:
            loss, supervised = trl_loss(model, batch, generator)
        loss.backward()
        if step:
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
    step_s = statistics.median(times)
    return {"method": method, "length": length, "step_s": step_s, "cpu_s": statistics.median(cpu_times),
            "step_times": times, "cpu_times": cpu_times, "supervised_tokens": supervised,
            "supervised_tokens_per_s": supervised / step_s, "tokens_per_s": length / step_s,
            "peak_mem_bytes": _peak_rss() - base_rss, "loss": float(loss)}


def parallel_worker(layout_name: str, length: int, steps: int, out: str) -> None:
    """One rank of a block-parallel group (under torchrun): its rows of the step, timed; rank 0 writes the record with
    every timed step (per step the slowest rank's wall and CPU time)."""
    import torch  # lazy: the study's own process only launches workers and loads no torch (4 s measured)
    import torch.distributed as dist

    torch.set_num_threads(1)
    # lazy: the study's own process only launches workers and loads no torch (4 s measured)
    from ....objectives import get_objective
    from ....parallel import BlockParallelGroups, ParallelDims
    from ..training.sharded import diffusion_gemma_layout, frame_padding

    dist.init_process_group("gloo")
    P = dist.get_world_size()
    mode, cp_layout = ("cp", "paper") if layout_name == "cp-paper" else (layout_name, "balanced")
    groups = BlockParallelGroups.build(ParallelDims(P, None, mode, cp_layout=cp_layout))
    model = build_model()  # same seed on every rank: the group shares weights and batch
    batch = build_batch(length)
    frame_multiple, canvas_multiple = frame_padding(groups.dims, CANVAS)
    objective = get_objective("diffusion_gemma", dict(
        block_size=CANVAS, vocab_size=VOCAB, fill_token_id=EOS, end_token_ids={EOS, TURN_END},
        self_conditioning_prob=1.0, pad_to_multiple_of=frame_multiple, canvas_blocks_multiple_of=canvas_multiple))
    meter = groups.meter
    base_rss = _current_rss()
    times, cpu_times, received, supervised = [], [], [], 0
    for step in range(steps + 1):
        meter.next_step()
        model.zero_grad(set_to_none=True)
        dist.barrier()  # start together: the slowest rank's time is the group's
        start, cpu_start = time.perf_counter(), time.process_time()
        corrupted = objective.corrupt(batch, seed=0, step=step)
        layout = diffusion_gemma_layout(corrupted.frame, groups, "blockwise")  # per batch, as the trainer does
        loss, _ = objective.loss(model, corrupted, layout)
        (loss * P).backward()
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        supervised = int(corrupted.normalizer)
        if step:
            times.append(elapsed)
            cpu_times.append(cpu)
            received.append(meter.total())
    mine = [times, _peak_rss() - base_rss, max(received), cpu_times, float(loss)]
    everyone = [None] * P
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        # The group advances at its slowest rank's pace, step by step.
        step_times = [max(r[0][i] for r in everyone) for i in range(steps)]
        cpu_step_times = [max(r[3][i] for r in everyone) for i in range(steps)]
        step_s = statistics.median(step_times)
        record = {"method": f"{layout_name} P={P}", "mode": mode, "cp_layout": cp_layout, "layout": layout_name,
                  "P": P,
                  "length": length, "step_s": step_s, "cpu_s": statistics.median(cpu_step_times),
                  "step_times": step_times, "cpu_times": cpu_step_times,
                  "supervised_tokens": supervised, "supervised_tokens_per_s": supervised / step_s,
                  "tokens_per_s": length / step_s, "peak_mem_bytes": max(r[1] for r in everyone),
                  "kv_bytes_per_step": max(r[2] for r in everyone),
                  "loss": sum(r[4] for r in everyone)}  # the ranks' losses add up to the single-device loss
        with open(out, "w") as f:
            json.dump(record, f)
    dist.destroy_process_group()


# --- driver -----------------------------------------------------------------------------------------------------
def run_parallel(lengths, steps: int, P: int, layouts=LAYOUTS) -> list[dict]:
    """TRL's one-block estimator and ``ours`` at P = 1, then each of ``layouts`` at P (a fresh process or torchrun
    launch each), one length after the other: every layout of a length is measured in the same run, minutes apart."""
    results = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for length in lengths:
        results += run([length], steps, methods=("trl", "ours"))
        for layout in layouts:
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "result.json")
                proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                       "--nproc_per_node", str(P), "-m", MODULE,
                                       "--parallel-worker", layout, "--lengths", str(length), "--steps", str(steps),
                                       "--out", out], env=env, capture_output=True, text=True)
                if proc.returncode or not os.path.exists(out):
                    raise RuntimeError(f"{layout} P={P} L={length} failed:\n{proc.stderr[-3000:]}")
                with open(out) as f:
                    result = json.load(f)
            results.append(result)
            print(f"  {result['method']:13s} L={length:6d}: {_steps(result).describe()} s/step, "
                  f"{result['supervised_tokens_per_s']:.0f} supervised tok/s, "
                  f"{result['peak_mem_bytes'] / 2**20:.0f} MiB/rank, {result['kv_bytes_per_step'] / 2**20:.1f} MiB K/V",
                  file=sys.stderr)
    return results


def _steps(r: dict, cpu: bool = False) -> Spread:
    """A record's timed steps (wall, or the slowest rank's CPU time); records of one step keep their median."""
    key = "cpu_times" if cpu else "step_times"
    return Spread(r.get(key) or [r["cpu_s" if cpu else "step_s"]])


def per_token(r: dict, cpu: bool = False) -> Spread:
    """Seconds per supervised token of every timed step: the quantity layouts doing different work per step (TRL's
    one block, the all-blocks step) are compared by."""
    return Spread(t / r["supervised_tokens"] for t in _steps(r, cpu).values)


def _name(r: dict) -> str:
    return {"ours": "P = 1", "trl": "TRL one-block, P = 1"}.get(r["method"], r["method"])


def parallel_table(results: list[dict]) -> str:
    """Per length: TRL's one block and the all-blocks step at P = 1, then each layout at P. Step times are the median
    and range of the timed steps; the slowest rank's CPU time per step is distorted less by other jobs on a shared
    machine than wall time. CSBP's speed-up over each layout is the ratio of median seconds per supervised token
    (wall, then CPU), a tie where the two ranges overlap."""
    rows = ["| L | layout | step (s) | slowest rank CPU (s) | supervised tok/s | peak memory per rank (MiB) | "
            "K/V received per rank per step (MiB) | CSBP over it (wall) | CSBP over it (CPU) |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    order = {"trl": 0, "ours": 1, **{f"{m}": 2 + i for i, m in enumerate(LAYOUTS)}}
    for length in sorted({r["length"] for r in results}):
        here = [r for r in results if r["length"] == length]
        csbp = next((r for r in here if r.get("layout", r.get("mode")) == "csbp"), None)
        for r in sorted(here, key=lambda r: order.get(r.get("layout", r["method"]), 9)):
            if csbp is None or r is csbp:
                wall = cpu = "-"
            else:
                wall = compare(per_token(r), per_token(csbp)).describe()
                cpu = compare(per_token(r, True), per_token(csbp, True)).describe()
            rows.append(f"| {length} | {_name(r)} | {_steps(r).describe()} | {_steps(r, True).describe()} | "
                        f"{r['supervised_tokens_per_s']:.0f} | {r['peak_mem_bytes'] / 2**20:.0f} | "
                        f"{r.get('kv_bytes_per_step', 0) / 2**20:.1f} | {wall} | {cpu} |")
    return "\n".join(rows)


def paper_projection() -> tuple[list[dict], str]:
    """``hf-bdlm plan``'s projection of the paper's DiffusionGemma setting (26B-A4B SFT, 16 H200 in 2 nodes, expert
    parallelism 2, one group of 8 ranks, FSDP2, activation checkpointing) beside the published figures. A comparison,
    not a fit: nothing in the planner is tuned to them."""
    # lazy: the study's own process only launches workers and loads no torch (4 s measured)
    from ....planner.cost import Recipe

    device = device_spec("h200", None, {})
    records, rows = [], [
        "| context | CSBP layout | CSBP s/step | paper's CP s | balanced cp s | bp s | CSBP / paper's CP | "
        "CSBP / cp | CSBP / bp | CSBP tok/s | published |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for setting, preset, L, published, model_parallel in family_named("diffusion_gemma").role("planning").paper_settings():
        recipe = replace(Recipe(), model_parallel=PAPER_PAIR, model_parallel_kind=model_parallel)
        r = paper_topology(model_spec(preset, None), L, device, recipe)
        cs = r["csbp"]
        record = dict(setting=setting, model=preset, context=L, group=PAPER_GROUP, csbp_layout=cs.label,
                      csbp_step_s=cs.step_s, csbp_tokens_per_s=cs.tokens_per_s, paper_cp_step_s=r["paper"].step_s,
                      cp_step_s=r["cp"].step_s, bp_step_s=r["bp"].step_s, published=published)
        records.append(record)
        rows.append(f"| {L // 1024}K | {cs.label.split(' D=')[0]} | {cs.step_s:.2f} | {r['paper'].step_s:.2f} | "
                    f"{r['cp'].step_s:.2f} | {r['bp'].step_s:.2f} | **{r['paper'].step_s / cs.step_s:.2f}x** | "
                    f"{r['cp'].step_s / cs.step_s:.2f}x | {r['bp'].step_s / cs.step_s:.2f}x | {cs.tokens_per_s:.0f} | "
                    f"{published} |")
    return records, "\n".join(rows)


def run(lengths, steps: int, methods=("trl", "ours")) -> list[dict]:
    results = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for length in lengths:
        for method in methods:
            out = subprocess.run([sys.executable, "-m", MODULE, "--worker", method,
                                  "--lengths", str(length), "--steps", str(steps)],
                                 capture_output=True, text=True, env=env, check=True)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            results.append(result)
            print(f"  {method:4s} L={length:6d}: {_steps(result).describe()} s/step, "
                  f"{result['supervised_tokens_per_s']:.0f} supervised tok/s, "
                  f"{result['peak_mem_bytes'] / 2**20:.0f} MiB", file=sys.stderr)
    return results


def table(results: list[dict]) -> str:
    rows = ["| L | method | step (s) | supervised tokens / step | supervised tok/s | all tok/s | peak memory (MiB) |",
            "|---:|---|---:|---:|---:|---:|---:|"]
    by = {(r["method"], r["length"]): r for r in results}
    for length in sorted({r["length"] for r in results}):
        for method in ("trl", "ours"):
            r = by.get((method, length))
            if r:
                rows.append(f"| {length} | {method} | {_steps(r).describe()} | {r['supervised_tokens']} | "
                            f"{r['supervised_tokens_per_s']:.0f} | {r['tokens_per_s']:.0f} | "
                            f"{r['peak_mem_bytes'] / 2**20:.0f} |")
        if (("trl", length) in by) and (("ours", length) in by):
            ours, trl = by[("ours", length)], by[("trl", length)]
            # Per supervised token: ours over TRL's (the ratio of TRL's seconds per token to ours, or a tie).
            rows.append(f"| {length} | ours / trl | {ours['step_s'] / trl['step_s']:.2f}x | | "
                        f"**{compare(per_token(trl), per_token(ours)).describe()}** | "
                        f"{ours['tokens_per_s'] / trl['tokens_per_s']:.2f}x | "
                        f"{ours['peak_mem_bytes'] / max(trl['peak_mem_bytes'], 1):.2f}x |")
    return "\n".join(rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--steps", type=int, default=MIN_TIMED_STEPS,
                        help=f"timed steps after one warm-up (at least {MIN_TIMED_STEPS})")
    parser.add_argument("--out", help="write the results as JSON")
    parser.add_argument("--out-dir", help="write records.json and summary.md (tables, the command, the planner's "
                                          "projection of the paper's DiffusionGemma setting) into this folder")
    parser.add_argument("--parallel", type=int, metavar="P", help="compare the layouts on P ranks with P = 1")
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS),
                        help="layouts --parallel runs (cp-paper: the paper's CP baseline; default: all)")
    parser.add_argument("--worker", choices=("ours", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--parallel-worker", choices=LAYOUTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.lengths[0], args.steps)))
        return
    if args.parallel_worker:
        parallel_worker(args.parallel_worker, args.lengths[0], args.steps, args.out)
        return
    try:
        check_timed_steps(args.steps)
    except ValueError as err:
        parser.error(str(err))
    if args.parallel:
        results = run_parallel(args.lengths, args.steps, args.parallel, tuple(args.layouts))
        measured = parallel_table(results)
    else:
        results = run(args.lengths, args.steps)
        measured = table(results)
    print(measured)
    projection, projected = paper_projection()
    print("\n" + projected)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "records.json"), "w") as f:
            json.dump(dict(command=" ".join([f"python -m {MODULE}"] + (argv or sys.argv[1:])),
                           measured=results, projection=projection), f, indent=2)
        with open(os.path.join(args.out_dir, "summary.md"), "w") as f:
            f.write(f"# DiffusionGemma SFT throughput\n\n`python -m {MODULE} "
                    f"{' '.join(argv or sys.argv[1:])}` ({os.cpu_count()} cores, one thread per process; every "
                    f"layout of a length measured in this one run; {args.steps} timed steps after a warm-up, median "
                    f"[range]; a ratio whose ranges overlap is a tie)\n\n{measured}\n\n"
                    f"## The planner's projection of the paper's setting\n\n{projected}\n")


if __name__ == "__main__":
    main()
