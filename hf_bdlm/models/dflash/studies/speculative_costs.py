"""What one step of DFlash speculative decoding costs on this CPU: the drafter (its forward and the projection of the
newly committed context rows), the target's verification forward and the loop around them, in ms and in units of
one target decoding step, beside tokens/s of the target alone and with the drafter, side by side in one run.

The target is the embedded SmolLM2-135M-Instruct; the drafter a DFlash2 drafter made for it by
``from_target(init="target_layers")``, untrained (its acceptance is low: read the cost ratios, not the speed-up).
Each prompt (the shipped arithmetic test prompts, chat template) is decoded alone, greedily, EOS ignored, by
``target.generate``, by ``speculative_generate`` (this project's loop, ``SpeculativeSession``) and by ``generate``
with ``custom_generate=dflash_assisted_decoding`` (transformers' assisted loop); the outputs are compared. Timers
around the target's forward, the drafting functions, the context cache's appends and a whole step give each cost;
the loop overhead is a step's time minus its drafter and verification time. A second table times one drafter
forward at growing context lengths: re-projecting the whole context (``draft_block``) and from the context cache
(``draft_from_cache``). A third times one verification forward of the target over 1 .. B tokens after a prompt
(what ``num_speculative_tokens`` = rows - 1 costs per step).

    python -m hf_bdlm.models.dflash.studies.speculative_costs              # 3 prompts x 32 tokens, block 8, ~1 min
    python -m hf_bdlm.models.dflash.studies.speculative_costs --prompts 8 --new-tokens 128 --contexts 128 1024 8192

Times are the main thread's CPU time by default (``--clock cpu``; one thread does all the work at ``--threads 1``):
on a machine shared with other jobs, wall time mostly measures the others. ``--clock wall`` on an idle machine.
The script also runs against an older version of the package (one without the context cache): it times whichever
of these functions exist.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from .. import modeling
from ....data import load_arith
from ..inference import speculative
from ..inference.speculative import dflash_assisted_decoding, speculative_generate
from ..modeling import DFlash2DraftModel
from ..target import resolve_target_path

RESULTS = pathlib.Path("benchmarks") / "results" / "speculative_costs"  # under the folder it runs from
CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}
clock = time.thread_time


def make_parser() -> argparse.ArgumentParser:
    class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
        pass

    p = argparse.ArgumentParser(prog="python -m hf_bdlm.models.dflash.studies.speculative_costs",
                                description=__doc__,
                                formatter_class=Formatter)
    p.add_argument("--target", default="embedded:smollm2", help="causal-LM folder, Hub id or embedded:smollm2")
    p.add_argument("--prompts", type=int, default=3, help="arithmetic test prompts, decoded one at a time")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per prompt (EOS ignored)")
    p.add_argument("--block-size", type=int, default=8, help="the drafter's block size")
    p.add_argument("--drafter-layers", type=int, default=1, help="the drafter's decoder layers")
    p.add_argument("--contexts", type=int, nargs="*", default=[64, 1024],
                   help="context lengths of the drafter-forward table (none: skip it)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per drafter-forward measurement (best kept)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                   help="cpu: the main thread's CPU time (robust on a shared machine); wall: elapsed time")
    p.add_argument("--out", default=None, help=f"JSON file (default: {RESULTS}/<date-time>.json)")
    return p


# --- timers ----------------------------------------------------------------------------------------------------------
class Timers:
    """Seconds and calls per ``scope.name``, counted only while a scope is open (a session step, an assisted
    ``generate`` call)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.scope: str | None = None
        self.forwards_in_scope = 0

    def add(self, name: str, seconds: float) -> None:
        if self.scope is not None:
            self.seconds[f"{self.scope}.{name}"] += seconds
            self.calls[f"{self.scope}.{name}"] += 1

    @contextmanager
    def open(self, scope: str):
        self.scope, self.forwards_in_scope = scope, 0
        tick = clock()
        try:
            yield
        finally:
            self.add("total", clock() - tick)
            self.scope = None

    def wrap(self, owner, attribute: str, name: str):
        """Time ``owner.attribute`` under ``name``; returns the original."""
        original = getattr(owner, attribute)
        timers = self

        def timed(*args, **kwargs):
            if timers.scope is None:
                return original(*args, **kwargs)
            tick = clock()
            try:
                return original(*args, **kwargs)
            finally:
                timers.add(name, clock() - tick)

        setattr(owner, attribute, timed)
        return original


@contextmanager
def instrumented(target):
    """Timers around the target's forward, the drafting functions, the context cache's appends and the session's
    step (whichever of them this version of the package has); all restored on exit. Yields the timers and the list
    of every target forward, ``(tokens, seconds)``."""
    timers = Timers()
    restore = []
    for name in ("draft_block", "draft_from_cache"):
        if hasattr(speculative, name):
            restore.append((speculative, name, timers.wrap(speculative, name, "draft")))
    cache = getattr(modeling, "DFlashContextCache", None)
    if cache is not None:
        restore.append((cache, "append", timers.wrap(cache, "append", "context")))
    session = speculative.SpeculativeSession
    original_step = session.step

    def step(self):
        with timers.open("session"):
            return original_step(self)

    session.step = step
    restore.append((session, "step", original_step))
    starts: list[float] = []
    forwards: list[tuple[int, float]] = []

    def before(module, args, kwargs):
        starts.append(clock())

    def after(module, args, kwargs, output):
        ids = kwargs.get("input_ids", args[0] if args else None)
        seconds = clock() - starts.pop()
        forwards.append((int(ids.shape[1]) if ids is not None else -1, seconds))
        # Inside an assisted generate call, the first forward is the prefill.
        timers.add("prefill" if timers.scope == "assisted" and timers.forwards_in_scope == 0 else "verify", seconds)
        timers.forwards_in_scope += 1

    handles = [target.register_forward_pre_hook(before, with_kwargs=True),
               target.register_forward_hook(after, with_kwargs=True)]
    try:
        yield timers, forwards
    finally:
        for handle in handles:
            handle.remove()
        for owner, name, original in restore:
            setattr(owner, name, original)


# --- the models and prompts ------------------------------------------------------------------------------------------
def load(args):
    path = resolve_target_path(args.target)
    tokenizer = AutoTokenizer.from_pretrained(path)
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().requires_grad_(False)
    torch.manual_seed(0)
    drafter = DFlash2DraftModel.from_target(target, init="target_layers", num_hidden_layers=args.drafter_layers,
                                            block_size=args.block_size).eval()
    return tokenizer, target, drafter


def prompt_tensors(tokenizer, count: int) -> list[torch.Tensor]:
    test = load_arith("test")
    encoded = [tokenizer.apply_chat_template(test[i]["prompt"], add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"] for i in range(count)]
    return [torch.tensor([list(ids)]) for ids in encoded]


# --- decoding ---------------------------------------------------------------------------------------------------------
@torch.inference_mode()
def decode_costs(target, drafter, prompts, new_tokens: int) -> dict:
    """Target alone, the batched loop and the assisted loop, prompt by prompt, with per-step costs."""
    # EOS disabled and the mask explicit: without EOS, generate would take the prompt's pad-id tokens (SmolLM2's pad
    # is its EOS, <|im_end|>) for padding.
    def plain(ids, n):
        return target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                               eos_token_id=[])

    def batched(ids, n):
        return speculative_generate(target, drafter, ids, max_new_tokens=n, eos_token_id=[])[0]

    def assisted(ids, n):
        return target.generate(ids, attention_mask=torch.ones_like(ids), custom_generate=dflash_assisted_decoding,
                               drafter=drafter, max_new_tokens=n, eos_token_id=[])

    for run in (plain, batched, assisted):  # warm-up
        run(prompts[0], 4)
    seconds, wall, identical = defaultdict(float), defaultdict(float), defaultdict(int)
    tokens = 0
    plain_forwards: list[tuple[int, float]] = []
    with instrumented(target) as (timers, forwards):
        for ids in prompts:
            outputs = {}
            for name, run in (("target", plain), ("session", batched), ("assisted", assisted)):
                forwards.clear()
                tick, start = clock(), time.perf_counter()
                if name == "assisted":
                    with timers.open("assisted"):
                        outputs[name] = run(ids, new_tokens)
                else:
                    outputs[name] = run(ids, new_tokens)
                seconds[name] += clock() - tick
                wall[name] += time.perf_counter() - start
                if name == "target":
                    plain_forwards += forwards
            tokens += outputs["target"].shape[1] - ids.shape[1]
            for name in ("session", "assisted"):
                # float32: a verification over B tokens rounds differently from 1-token forwards, so a near tie may
                # break the other way (exactness is tested in float64); counted, not fatal.
                identical[name] += bool(torch.equal(outputs[name], outputs["target"]))
    decode = [s for n, s in plain_forwards if n == 1]
    prefill = sum(s for n, s in plain_forwards if n != 1)
    # One target decoding step: generate's time per token after the prefill (1-token forward + generate's loop).
    unit_ms = 1e3 * (seconds["target"] - prefill) / max(1, len(decode))
    result = {"prompts": len(prompts), "new_tokens": tokens, "target_step_ms": unit_ms,
              "target_forward_1_token_ms": 1e3 * sum(decode) / max(1, len(decode)),
              "target_tokens_per_s": tokens / seconds["target"], "target_tokens_per_wall_s": tokens / wall["target"]}
    for name in ("session", "assisted"):
        steps = timers.calls[f"{name}.verify"]
        per = {key: 1e3 * timers.seconds[f"{name}.{key}"] / max(1, steps)
               for key in ("total", "prefill", "draft", "context", "verify")}
        # A session step is timed on its own; an assisted step is the generate call less its prefill, per step.
        step_ms = per["total"] - per["prefill"]
        drafter_ms = per["draft"] + per["context"]
        result[name] = {
            # Tokens per verification (the prefill yields each prompt's first; the budget may cut the last block).
            "steps": steps, "acceptance_length": (tokens - len(prompts)) / max(1, steps),
            "drafter_ms": drafter_ms, "draft_ms": per["draft"], "context_ms": per["context"],
            "verify_ms": per["verify"], "overhead_ms": step_ms - drafter_ms - per["verify"], "step_ms": step_ms,
            "tokens_per_s": tokens / seconds[name], "tokens_per_wall_s": tokens / wall[name],
            "speedup": seconds["target"] / seconds[name], "wall_speedup": wall["target"] / wall[name],
            "identical_outputs": identical[name],
        }
    return result


def _best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        tick = clock()
        fn()
        best = min(best, clock() - tick)
    return 1e3 * best


@torch.inference_mode()
def drafter_forward_costs(drafter, contexts: list[int], repeats: int) -> list[dict]:
    """One drafter forward (batch 1) at each context length: re-projecting the whole context, and from the cache."""
    rows = []
    config = drafter.config
    cached = hasattr(modeling, "DFlashContextCache") and hasattr(speculative, "draft_from_cache")
    g = torch.Generator().manual_seed(0)
    for length in contexts:
        features = torch.randn(1, length, config.feature_width, generator=g)
        tokens = torch.randint(0, config.vocab_size, (1, length + 1), generator=g)
        anchor = torch.tensor([length])
        row = {"context": length,
               "full_ms": _best_ms(lambda: speculative.draft_block(drafter, features, tokens, anchor), repeats)}
        if cached:
            cache = modeling.DFlashContextCache(drafter, batch_size=1, capacity=length + config.block_size)
            cache.append(features)
            row["cached_ms"] = _best_ms(lambda: speculative.draft_from_cache(drafter, cache, tokens[:, -1]), repeats)
            row["same_proposals"] = bool(torch.equal(speculative.draft_from_cache(drafter, cache, tokens[:, -1]),
                                                     speculative.draft_block(drafter, features, tokens, anchor)))
            step_rows = torch.randn(1, config.block_size, config.feature_width, generator=g)

            def append_block():  # the projection a step pays: B new rows (cropped back for the next repeat)
                cache.append(step_rows)
                cache.crop(torch.tensor([length]))

            row["append_block_ms"] = _best_ms(append_block, repeats)
        rows.append(row)
    return rows


@torch.inference_mode()
def verification_costs(target, prompt: torch.Tensor, block_size: int, repeats: int) -> list[dict]:
    """One target forward over ``rows`` = 1 .. B new tokens after ``prompt`` (its KV cache prefilled, cropped back
    after each forward): the cost of verifying ``rows - 1`` proposals, in ms and in 1-token forwards."""
    cache = DynamicCache(config=target.config)
    length = prompt.shape[1]
    target(input_ids=prompt, cache=cache, use_cache=True)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, target.config.vocab_size, (1, block_size), generator=g)
    rows = []
    for count in range(1, block_size + 1):
        def forward():
            target(input_ids=tokens[:, :count], position_ids=torch.arange(length, length + count)[None], cache=cache,
                   use_cache=True)
            cache.crop(-count)  # back to the prompt

        rows.append({"rows": count, "ms": _best_ms(forward, repeats)})
    for row in rows:
        row["one_token_forwards"] = row["ms"] / rows[0]["ms"]
    return rows


# --- the report -------------------------------------------------------------------------------------------------------
def print_tables(args, result: dict) -> None:
    decode, unit = result["decode"], result["decode"]["target_step_ms"]
    session, assisted = decode["session"], decode["assisted"]
    print(f"\n{args.prompts} prompts x {args.new_tokens} tokens, block {args.block_size}, {args.drafter_layers}-layer "
          f"untrained DFlash2 drafter, {result['threads']} thread(s), {args.clock} time. Acceptance length "
          f"{session['acceptance_length']:.2f}; outputs identical to the target's: batched loop "
          f"{session['identical_outputs']}/{args.prompts}, assisted {assisted['identical_outputs']}/{args.prompts}.")
    print(f"\nOne target decoding step (generate, 1-token forward + loop): {unit:.2f} ms, of which the forward "
          f"{decode['target_forward_1_token_ms']:.2f} ms.")
    print("\n| per step | batched loop ms | target tokens | assisted ms | target tokens |\n|---|---:|---:|---:|---:|")
    for label, key in (("drafter (draft + context projection)", "drafter_ms"), ("  draft forward", "draft_ms"),
                       ("  context projection", "context_ms"), ("verification forward", "verify_ms"),
                       ("loop overhead", "overhead_ms"), ("whole step", "step_ms")):
        print(f"| {label} | {session[key]:.2f} | {session[key] / unit:.2f} | {assisted[key]:.2f} | "
              f"{assisted[key] / unit:.2f} |")
    print(f"\n| tokens/s, batch 1 | target alone | batched loop | assisted |\n|---|---:|---:|---:|\n"
          f"| per {args.clock} second | {decode['target_tokens_per_s']:.2f} | {session['tokens_per_s']:.2f} "
          f"({session['speedup']:.2f}x) | {assisted['tokens_per_s']:.2f} ({assisted['speedup']:.2f}x) |\n"
          f"| per wall second | {decode['target_tokens_per_wall_s']:.2f} | {session['tokens_per_wall_s']:.2f} "
          f"({session['wall_speedup']:.2f}x) | {assisted['tokens_per_wall_s']:.2f} "
          f"({assisted['wall_speedup']:.2f}x) |")
    if result["drafter_forward"]:
        print("\n| context rows | drafter forward, whole context ms | from the cache ms | appending B rows ms |\n"
              "|---:|---:|---:|---:|")
        for row in result["drafter_forward"]:
            print(f"| {row['context']} | {row['full_ms']:.2f} | {row.get('cached_ms', float('nan')):.2f} | "
                  f"{row.get('append_block_ms', float('nan')):.2f} |")
    print("\n| verification rows (anchor + proposals) | target forward ms | in 1-token forwards |\n|---:|---:|---:|")
    for row in result["verification"]:
        print(f"| {row['rows']} | {row['ms']:.2f} | {row['one_token_forwards']:.2f} |")


def main(argv: list[str] | None = None) -> dict:
    global clock
    args = make_parser().parse_args(argv)
    clock = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    tokenizer, target, drafter = load(args)
    prompts = prompt_tensors(tokenizer, args.prompts)
    start = time.perf_counter()
    result = {"target": args.target, "block_size": args.block_size, "drafter_layers": args.drafter_layers,
              "threads": torch.get_num_threads(), "clock": args.clock,
              "machine": platform.processor() or platform.machine(),
              "decode": decode_costs(target, drafter, prompts, args.new_tokens),
              "drafter_forward": drafter_forward_costs(drafter, args.contexts, args.repeats),
              "verification": verification_costs(target, prompts[0], args.block_size, args.repeats)}
    result["seconds"] = time.perf_counter() - start
    print_tables(args, result)
    out = pathlib.Path(args.out) if args.out else RESULTS / f"{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {out}")
    return result


if __name__ == "__main__":
    main()
