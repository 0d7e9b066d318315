"""The decoding study of ``hf-bdlm bench --only decoding``: every family's decoding against greedy AR.

Each model is loaded as ``hf-bdlm serve`` loads it (its family found from its config through ``hf_bdlm.models``) and
decoded by its family's serving decoder in each of the family's named variants (``ServingSpec.decoding_variants``:
a block-diffusion model's techniques one by one, a drafter's proposal counts, an encoder-decoder's canvas settings). A
model's speed is compared with greedy ``generate`` of an AR model: ``--decoding-causal`` (the parent fine-tuned like
for like) for the diffusion models, the target itself for a drafter. Same held-out prompts of a shipped task
(``--task``: ``arith``, the arithmetic / word tasks, the default; ``fast_apply``, the code edits of
``hf_bdlm.data.fast_apply``, whose answers are 48-320 tokens: 300 prompts and 384 new tokens by default), chat
template, EOS honoured (a variant that ignores it decodes its whole budget, its text cut at EOS after), at batch 1
and 8.

Per variant and batch size:

- **tokens per forward**: delivered tokens over the forwards of the model (its ``counted_modules()["model"]``: the
  prompt's forward included; greedy AR makes exactly 1), the device-independent measure;
- **tokens/s** (wall) and **CPU s per token** (this process, all threads), median and range over the timed groups
  (every group of prompts a sample, at least ``--decoding-timed-groups``, itself at least 3: the groups are passed
  over again until there are that many; the variants of every model take turns group by group). A record with fewer
  than 3 timed groups is refused (:func:`check_records`): no speed figure without its range;
- **quality**: each of the task's scorers on the held-out answers (``hf_bdlm.data.shipped_task``: exact match; for
  fast_apply also AST match, ``hf_bdlm.data.fast_apply.scoring``), with the prompt count and its 95 % Wilson interval
  (a quality claim needs at least :data:`QUALITY_PROMPTS` prompts; the table says so below that); agreement
  (identical tokens)
  with the family's reference variant (one token per step), or for a drafter with its target's greedy text; batch 8
  against batch 1 (batch invariance);
- **cost model**: the CPU time of every counted forward by its rows, fitted ``a + b * rows`` per model part, and the
  time each variant's forwards would take on a GPU of the planner's table (``hf_bdlm.planner.hardware``), each
  counted forward priced by :func:`gpu_seconds`, a roofline per forward of its part::

      t(part, rows) = max((W + A * rows) / HBM, 2 * M * rows / F)

  ``W``: the part's weight bytes (every parameter but embedding tables, 2 bytes each), read once per call, so a head
  called by the verification and by a drafter's proposals is read twice; ``A``: bytes per row of every ``nn.Linear``
  of the part (its input and output values, 2 bytes each: the hidden states and, for a head, the logits of the row);
  ``M``: multiply-accumulates per row (the part's parameter count); ``HBM``: the GPU's memory bandwidth, ``F`` its
  achievable matmul rate (planner's table: H100 3.35e12 B/s, 989e12 x 0.55 FLOP/s). A variant's GPU seconds per
  token are the sum over its counted forwards over its tokens; its speed over AR the ratio of the two. The model
  has no per-forward fixed cost (kernel launches, the decoder's host work between forwards), no attention FLOPs and
  no KV-cache reads: it is a lower bound on every forward's time, and it favours whichever decoding makes fewer
  forwards. A BDLM forward costs more than an AR forward through its rows (``A * rows`` and ``2 * M * rows``: a
  block's rows, its head over every block position).

Records: ``decoding.json`` (a list: one ``"decoding"`` record per model, variant and batch size, one ``"forward_cost"``
record per model part), ``decoding.png``. Records written before the drafter's head was counted (no ``"counting"``
field) are completed by ``scripts/decoding_reprice.py`` (the head and context-projection calls they lack,
reconstructed from the calls they hold; ``A`` from the parts' architecture) before the report prices them.

    hf-bdlm bench --only decoding --quick --out /tmp/dec        # the embedded SmolLM2 converted untrained vs itself
    python -m hf_bdlm.benchmarks.decoding_study --models outputs/bdlm --causal outputs/ar --out /tmp/decoding.json
    hf-bdlm bench --only decoding --decoding-task fast_apply --decoding-models outputs/bdlm --decoding-causal \
        outputs/ar --decoding-speculative outputs/ar:outputs/drafter --out /tmp/fa   # 300 prompts, 384 tokens each
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

from ..data import shipped_task
from ..evaluation.decoders import ForwardMeter, GreedyAR, serve_decode  # shared with HumanEval
from ..evaluation.intervals import wilson_interval
from ..planner.hardware import device_spec
from ..protocols.decoding import DecodingRequest
from ..protocols.registry import family_for_config
from .processes import child_env, module_command
from .report import pyplot
from .spread import MIN_TIMED_STEPS, Spread, check_timed_steps, compare

QUICK = dict(prompts=8, batches=(1, 8), max_new_tokens=32)
FULL = dict(prompts=24, batches=(1, 8), max_new_tokens=32)
TASKS = ("arith", "fast_apply")  # hf_bdlm.data.shipped_task
# Each task's held-out prompts (full preset, --quick); its token budget is the task's (ShippedTask.max_new_tokens)
TASK_PROMPTS = {"arith": (FULL["prompts"], QUICK["prompts"]), "fast_apply": (300, 8)}
EMBEDDED = "embedded:smollm2"
GPU = "h100"
QUALITY_PROMPTS = 100  # fewer prompts than this: exact match is printed with its interval, and carries no quality claim
COUNTING = 2  # records' "counting": 2 = every call of a head counted (a drafter's proposals too), the drafter's fc


# --- options ----------------------------------------------------------------------------------------------------------
def add_arguments(group) -> None:
    """The study's ``hf-bdlm bench`` options (``None`` defaults: the preset fills them)."""
    group.add_argument("--decoding-models", nargs="+", default=None, metavar="DIR",
                       help="checkpoints hf-bdlm serve loads (any family; a causal LM is converted untrained); "
                            f"default: {EMBEDDED} converted on the fly")
    group.add_argument("--decoding-causal", default=None, metavar="DIR",
                       help=f"the AR model the --decoding-models are compared with (default: {EMBEDDED})")
    group.add_argument("--decoding-speculative", nargs="+", default=None, metavar="TARGET:DRAFTER",
                       help="a causal target and its drafter folder, decoded as hf-bdlm serve TARGET --draft DRAFTER "
                            "does; compared with the target's own greedy generate")
    group.add_argument("--decoding-task", choices=TASKS, default=None,
                       help="the shipped task whose held-out prompts are decoded and scored (default: arith; "
                            "fast_apply: code edits, scored by exact and AST match)")
    group.add_argument("--decoding-prompts", type=int, default=None, metavar="N",
                       help=f"held-out prompts (default: {FULL['prompts']}, fast_apply "
                            f"{TASK_PROMPTS['fast_apply'][0]}; --quick: {QUICK['prompts']})")
    group.add_argument("--decoding-batches", type=int, nargs="+", default=None, metavar="B",
                       help="batch sizes (default: 1 8)")
    group.add_argument("--decoding-max-new-tokens", type=int, default=None, metavar="N",
                       help=f"token budget per prompt (default: the task's, {FULL['max_new_tokens']} for arith, 384 "
                            "for fast_apply)")
    group.add_argument("--decoding-threads", type=int, default=1, metavar="T",
                       help="torch threads of the measuring process (default: 1)")
    group.add_argument("--decoding-variants", nargs="+", default=None, metavar="NAME",
                       help="decode only these named variants of the families (e.g. 'threshold 0.9' 'exact "
                            "techniques' '7 proposals'; AR greedy always runs: it is every ratio's baseline); default: "
                            "every variant")
    group.add_argument("--decoding-timed-groups", type=int, default=MIN_TIMED_STEPS, metavar="N",
                       help=f"timed groups of prompts per variant and batch size, at least {MIN_TIMED_STEPS} (the "
                            f"groups are passed over again until there are N; default: {MIN_TIMED_STEPS})")


@dataclass(frozen=True)
class DecodingStudy:
    models: tuple[str, ...]
    causal: str
    speculative: tuple[tuple[str, str], ...]
    prompts: int
    batches: tuple[int, ...]
    max_new_tokens: int
    threads: int
    timed_groups: int = MIN_TIMED_STEPS
    task: str = "arith"
    variants: tuple[str, ...] = ()  # the family variants decoded (empty: all); AR greedy always

    def command_args(self) -> list[str]:
        args = ["--task", self.task, "--models", *self.models, "--causal", self.causal, "--prompts", str(self.prompts),
                "--batches", *map(str, self.batches), "--max-new-tokens", str(self.max_new_tokens),
                "--threads", str(self.threads), "--timed-groups", str(self.timed_groups)]
        if self.speculative:
            args += ["--speculative", *(f"{t}:{d}" for t, d in self.speculative)]
        if self.variants:
            args += ["--variants", *self.variants]
        return args


def _pair(text: str) -> tuple[str, str]:
    target, sep, drafter = text.rpartition(":")
    if not sep or not target or not drafter or target == "embedded":
        if text.startswith(EMBEDDED + ":"):
            return EMBEDDED, text[len(EMBEDDED) + 1:]
        raise ValueError(f"--decoding-speculative {text!r}: write TARGET:DRAFTER (a causal-LM folder or {EMBEDDED}, "
                         "a colon, a drafter folder)")
    return target, drafter


def resolve(cfg, args: argparse.Namespace) -> DecodingStudy:
    """The study's settings from the suite's preset and the ``--decoding-*`` options (``ValueError`` on a bad one)."""
    preset = QUICK if cfg.quick else FULL
    task = shipped_task(getattr(args, "decoding_task", None) or "arith")
    prompts = args.decoding_prompts or TASK_PROMPTS[task.name][1 if cfg.quick else 0]
    batches = tuple(args.decoding_batches or preset["batches"])
    budget = args.decoding_max_new_tokens or task.max_new_tokens
    for name, values in (("--decoding-prompts", [prompts]), ("--decoding-batches", batches),
                         ("--decoding-max-new-tokens", [budget]), ("--decoding-threads", [args.decoding_threads])):
        if any(v < 1 for v in values):
            raise ValueError(f"{name} {' '.join(map(str, values))}: must be positive")
    if max(batches) > prompts:
        raise ValueError(f"--decoding-batches {max(batches)} is more than the {prompts} prompts; raise "
                         f"--decoding-prompts to at least {max(batches)}")
    if prompts > task.held_out_size:
        raise ValueError(f"--decoding-prompts {prompts}: the {task.name} task has {task.held_out_size} held-out "
                         "prompts")
    timed = check_timed_steps(getattr(args, "decoding_timed_groups", MIN_TIMED_STEPS), "--decoding-timed-groups")
    return DecodingStudy(tuple(args.decoding_models or [EMBEDDED]), args.decoding_causal or EMBEDDED,
                         tuple(_pair(p) for p in args.decoding_speculative or ()), prompts, batches, budget,
                         args.decoding_threads, timed, task.name, tuple(getattr(args, "decoding_variants", None) or ()))


def check_arguments(cfg, args: argparse.Namespace) -> None:
    resolve(cfg, args)


def run(cfg, args: argparse.Namespace, out: pathlib.Path, log=print) -> list[dict]:
    """Measure in a fresh process (``python -m hf_bdlm.benchmarks.decoding_study``), write ``out`` and the plot
    beside it."""
    study = resolve(cfg, args)
    cmd = [*module_command("decoding_study"), *study.command_args(), "--out", str(out.resolve())]
    log(f"decoding: {' '.join(cmd[2:])}")
    env = dict(child_env(), OMP_WAIT_POLICY="PASSIVE")  # spinning OpenMP threads inflate CPU time under contention
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            log("  " + line.rstrip())
    if proc.returncode:
        raise RuntimeError(f"{cmd[2]} exited with {proc.returncode} (its output is above)")
    return json.loads(out.read_text())


@dataclass
class Variant:
    """One way of decoding one model: a family's `DecodingVariant`, or greedy AR."""

    entry: str
    name: str
    family: str
    decoder: object
    eos: set[int]
    ignore_eos: bool = False
    reference: bool = False
    baseline: str = ""
    description: str = ""
    ar: str = ""  # the entry of the AR variant it is compared with

    @property
    def key(self) -> str:
        return f"{self.entry} | {self.name}"

    def decode(self, prompts, max_new_tokens):
        if isinstance(self.decoder, GreedyAR):
            return self.decoder.decode(prompts, max_new_tokens, self.ignore_eos)
        return serve_decode(self.decoder, prompts, max_new_tokens, self.ignore_eos, self.eos)


@dataclass
class Entry:
    label: str
    tokenizer: object
    variants: list[Variant] = field(default_factory=list)


def _folder(path: str) -> str:
    if path == EMBEDDED:
        # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)
        from ..embedded import default_model_dir

        return str(default_model_dir())
    return path


def load_entries(study: DecodingStudy, log=print) -> list[Entry]:
    """Every model of the study, loaded as the server loads it, with its variants (families through the registry)."""
    import torch  # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ..serving.engine import Engine  # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)

    entries: dict[str, Entry] = {}
    offered: set[str] = set()

    def ar_entry(path: str) -> str:
        label = f"AR {pathlib.Path(_folder(path)).name if path != EMBEDDED else EMBEDDED}"
        if label not in entries:
            folder = _folder(path)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(folder)
            ar = GreedyAR(model, tokenizer)
            entries[label] = Entry(label, tokenizer, [Variant(label, "greedy", "causal", ar, ar.eos)])
            log(f"{label}: {folder}")
        return label

    def family_entry(label: str, engine, family, ar: str) -> None:
        entry = entries[label] = Entry(label, engine.tokenizer)
        role = family.role("drafting" if engine.decoder.speculative else "serving")
        for name, v in role.decoding_variants(engine.decoder).items():
            if study.variants and name not in study.variants:
                continue
            offered.add(name)
            eos = v.decoder.eos_token_ids(v.decoder.settings(_request(), 1, 1))
            entry.variants.append(Variant(label, name, family.name, v.decoder, eos, v.ignore_eos, v.reference,
                                          v.baseline, v.description, ar=ar))
        log(f"{label}: {len(entry.variants)} variants, compared with {ar}")

    causal = ar_entry(study.causal)
    for path in study.models:
        engine = Engine.from_pretrained(path, dtype=torch.float32, block_size=16)
        family = family_for_config(engine.model.config)
        name = pathlib.Path(path).name if path != EMBEDDED else EMBEDDED + " (untrained)"
        family_entry(f"{family.name} {name}", engine, family, causal)
    for target, drafter in study.speculative:
        engine = Engine.from_pretrained(_folder(target), dtype=torch.float32, draft=drafter)
        family = family_for_config(AutoConfig.from_pretrained(drafter))
        family_entry(f"{family.name} {pathlib.Path(drafter).name}", engine, family, ar_entry(target))
    check_variants(study.variants, offered, entries.values())
    return list(entries.values())


def check_variants(asked, kept: set[str], entries) -> None:
    """Refuse a ``--variants`` name that no model of the study offers (a typo would silently drop a variant), and a
    study left with a model and no variant to decode."""
    missing = [name for name in asked if name not in kept]
    if missing:
        raise ValueError(f"--decoding-variants {', '.join(map(repr, missing))}: no model of the study offers it; "
                         "the names are those of the families' decoding variants (hf-bdlm bench --only decoding "
                         "--quick lists them in its table)")
    empty = [e.label for e in entries if not e.variants]
    if empty:
        raise ValueError(f"--decoding-variants {' '.join(map(repr, asked))} keeps no variant of {', '.join(empty)}: "
                         "name at least one of its variants, or leave it out of the study")


def _request():
    return DecodingRequest()


# --- measuring --------------------------------------------------------------------------------------------------------
def held_out(count: int, task: str = "arith") -> list[dict]:
    """The first ``count`` held-out records of the shipped task (``prompt`` messages, ``answer``)."""
    return shipped_task(task).held_out(count)


def chat_ids(tokenizer, example) -> list[int]:
    return list(tokenizer.apply_chat_template(example["prompt"], add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


def measure(entries: list[Entry], examples: list[dict], batches, max_new_tokens: int, log=print,
            timed_groups: int = MIN_TIMED_STEPS) -> list[dict]:
    """Every variant at every batch size, the variants taking turns group by group (the order rotating), so that a
    change of the machine's load hits all alike; at least ``timed_groups`` (>= 3) timed groups each, the prompts'
    groups passed over again until there are that many."""
    import torch  # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)

    check_timed_steps(timed_groups, "--timed-groups")
    variants = [v for e in entries for v in e.variants]
    prompts = {e.label: [chat_ids(e.tokenizer, x) for x in examples] for e in entries}
    records = []
    for batch in batches:
        groups = [list(range(i, min(i + batch, len(examples)))) for i in range(0, len(examples), batch)]
        groups *= math.ceil(timed_groups / len(groups))
        with torch.no_grad():
            for v in variants:  # warm-up
                v.decode(prompts[v.entry][: min(batch, 2)], 4)
        samples = {v.key: [] for v in variants}
        outputs = {v.key: [None] * len(examples) for v in variants}
        started = time.perf_counter()
        for g, group in enumerate(groups):
            for k in range(len(variants)):
                v = variants[(g + k) % len(variants)]
                meter = ForwardMeter(v.decoder.counted_modules())
                rows = [prompts[v.entry][i] for i in group]
                wall, cpu = time.perf_counter(), time.process_time()
                with meter, torch.no_grad():
                    got = v.decode(rows, max_new_tokens)
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                for i, tokens in zip(group, got):
                    outputs[v.key][i] = tokens
                samples[v.key].append(dict(tokens=sum(len(t) for t in got), seconds=wall, cpu_seconds=cpu,
                                           forwards=meter.forwards))
            log(f"  batch {batch}: group {g + 1}/{len(groups)} ({time.perf_counter() - started:.0f} s)")
        for v in variants:
            records.append(dict(kind="decoding", entry=v.entry, variant=v.name, family=v.family, batch=batch,
                                ignore_eos=v.ignore_eos, reference=v.reference, baseline=v.baseline,
                                description=v.description, ar=v.ar, samples=samples[v.key],
                                outputs=outputs[v.key], counting=COUNTING))
    return records


def score(records: list[dict], entries: list[Entry], examples: list[dict], task: str = "arith",
          max_new_tokens: int | None = None) -> None:
    """Each of the task's scorers (``exact_match``; for fast_apply ``ast_match`` too: share, hits and 95 % Wilson
    interval), agreement with the reference (the family's, or the AR the variant is compared with) and batch
    invariance, written into each record, with the task, its longest answer and the budget decoded."""
    shipped = shipped_task(task)
    tokenizers = {e.label: e.tokenizer for e in entries}
    by = {(r["entry"], r["variant"], r["batch"]): r for r in records}
    first = min(r["batch"] for r in records)
    for r in records:
        tokenizer = tokenizers[r["entry"]]
        texts = [tokenizer.decode(t, skip_special_tokens=True) for t in r["outputs"]]
        r["task"], r["prompts"], r["longest_answer_tokens"] = task, len(examples), shipped.longest_answer_tokens
        if max_new_tokens is not None:
            r["max_new_tokens"] = max_new_tokens
        r["scorers"] = list(shipped.scorers)
        for name, rule in shipped.scorers.items():
            hits = sum(bool(rule(t, x["answer"])) for t, x in zip(texts, examples))
            r[name], r[f"{name}_hits"] = hits / len(examples), hits
            r[f"{name}_interval"] = list(wilson_interval(hits, len(examples)))
        reference = next((o for o in records if o["entry"] == r["entry"] and o["reference"] and o["batch"] == first),
                         None)
        if reference is None and r["ar"]:
            reference = by.get((r["ar"], "greedy", first))
        if reference is not None and reference is not r:
            r["agreement"] = sum(a == b for a, b in zip(r["outputs"], reference["outputs"])) / len(examples)
            r["agreement_with"] = f"{reference['entry']} | {reference['variant']}"
        alone = by[(r["entry"], r["variant"], first)]
        r["same_as_batch_1"] = sum(a == b for a, b in zip(r["outputs"], alone["outputs"])) / len(examples)


def exact_match_of(record: dict, name: str = "exact_match") -> tuple[int, int, float, float]:
    """``(hits, prompts, low, high)`` of a record's exact match, or of its scorer ``name`` (records written before
    the counts: from the share and the outputs)."""
    n = record.get("prompts", len(record["outputs"]))
    hits = record.get(f"{name}_hits", round(record[name] * n))
    return (hits, n, *wilson_interval(hits, n))


def check_records(records: list[dict]) -> None:
    """Refuse decoding records whose speed rests on fewer than :data:`MIN_TIMED_STEPS` timed groups."""
    for r in records:
        if r["kind"] == "decoding" and len(r["samples"]) < MIN_TIMED_STEPS:
            raise ValueError(f"{r['entry']} | {r['variant']} at batch {r['batch']}: {len(r['samples'])} timed "
                             f"group(s); a speed figure needs at least {MIN_TIMED_STEPS} so that it carries its "
                             f"range: measure again with --decoding-timed-groups {MIN_TIMED_STEPS} or more.")


def summarize(records: list[dict]) -> None:
    """Tokens per forward, rows per forward and the speed over the AR baseline, written into each record."""
    check_records(records)
    by = {(r["entry"], r["variant"], r["batch"]): r for r in records if r["kind"] == "decoding"}
    for r in by.values():
        tokens = sum(s["tokens"] for s in r["samples"])
        forwards = sum(len(s["forwards"]["model"]) for s in r["samples"])
        rows = sum(f[0] for s in r["samples"] for f in s["forwards"]["model"])
        r["tokens"], r["forwards"] = tokens, forwards
        r["tokens_per_forward"] = tokens / max(forwards, 1)
        r["rows_per_forward"] = rows / max(forwards, 1)
        r["tokens_per_s"] = _spread(r, "seconds", per_token=False).as_record()
        r["cpu_s_per_token"] = _spread(r, "cpu_seconds").as_record()
        base = by.get((r["ar"], "greedy", r["batch"]))
        if base is not None and base is not r:
            r["vs_ar_cpu"] = compare(_spread(base, "cpu_seconds"), _spread(r, "cpu_seconds")).as_record()
            r["vs_ar_wall"] = compare(_spread(base, "seconds"), _spread(r, "seconds")).as_record()
        own = by.get((r["entry"], r["baseline"], r["batch"])) if r["baseline"] else None
        if own is not None:
            r["vs_baseline_cpu"] = compare(_spread(own, "cpu_seconds"), _spread(r, "cpu_seconds")).as_record()
            r["forwards_vs_baseline"] = own["forwards"] / max(forwards, 1) if "forwards" in own else None


def _spread(record: dict, key: str, per_token: bool = True) -> Spread:
    """Seconds per token (``per_token``) or tokens per second of each timed group."""
    values = [(s[key] / s["tokens"]) if per_token else (s["tokens"] / s[key]) for s in record["samples"]
              if s["tokens"]]
    return Spread(values or [math.nan])


# --- the cost model ---------------------------------------------------------------------------------------------------
def parameter_bytes(module, dtype_bytes: int = 2) -> tuple[int, int]:
    """``(bytes of the weights a forward reads, multiply-accumulates per row)`` of a counted module: every
    parameter but embedding tables (a lookup reads only its rows)."""
    import torch  # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)

    embeddings = {id(p) for m in module.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    own = [p for p in module.parameters() if id(p) not in embeddings]
    if isinstance(module, torch.nn.Embedding):  # a tied head reached as an Embedding is still read whole
        own = list(module.parameters())
    count = sum(p.numel() for p in own)
    return count * dtype_bytes, count


def part_cost(module, dtype_bytes: int = 2) -> dict:
    """What one forward of a counted module costs the GPU model (:func:`gpu_seconds`): ``weight_bytes`` (``W``, read
    once per call), ``macs_per_row`` (``M``) and ``activation_bytes_per_row`` (``A``: the input and output values of
    every ``nn.Linear`` of the module for one row; a head reached as an ``nn.Embedding`` counts as the linear map it
    is used as)."""
    import torch  # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)

    weight_bytes, macs = parameter_bytes(module, dtype_bytes)
    values = sum(m.in_features + m.out_features for m in module.modules() if isinstance(m, torch.nn.Linear))
    if isinstance(module, torch.nn.Embedding):
        values = module.embedding_dim + module.num_embeddings
    return dict(weight_bytes=weight_bytes, macs_per_row=macs, activation_bytes_per_row=values * dtype_bytes)


def forward_costs(records: list[dict], entries: list[Entry]) -> list[dict]:
    """Per model part: CPU seconds of one forward by its rows (median per distinct row count), the least-squares
    line ``a + b * rows``, and the part's :func:`part_cost` (for the GPU model)."""
    modules = {}
    for e in entries:
        for v in e.variants:
            for name, module in v.decoder.counted_modules().items():
                modules.setdefault((e.label, name), module)
    by_part: dict[tuple[str, str], dict[int, list[float]]] = {}
    for r in records:
        for s in r["samples"]:
            for name, forwards in s["forwards"].items():
                for rows, cpu, _ in forwards:
                    by_part.setdefault((r["entry"], name), {}).setdefault(rows, []).append(cpu)
    out = []
    for (entry, name), table in sorted(by_part.items()):
        points = sorted((rows, statistics.median(cpus), len(cpus)) for rows, cpus in table.items())
        weight = [n for _, _, n in points]
        fit = _line([p[0] for p in points], [p[1] for p in points], weight)
        cost = part_cost(modules[(entry, name)]) if (entry, name) in modules else \
            dict(weight_bytes=0, macs_per_row=0, activation_bytes_per_row=0)
        out.append(dict(kind="forward_cost", entry=entry, part=name, points=points, fit=fit, **cost))
    return out


def _line(x, y, w) -> dict:
    """Weighted least squares ``y = a + b x`` (a constant when one x)."""
    total = sum(w)
    mx = sum(a * b for a, b in zip(x, w)) / total
    my = sum(a * b for a, b in zip(y, w)) / total
    sxx = sum(wi * (xi - mx) ** 2 for xi, wi in zip(x, w))
    b = sum(wi * (xi - mx) * (yi - my) for xi, yi, wi in zip(x, y, w)) / sxx if sxx else 0.0
    return dict(a=my - b * mx, b=b)


def gpu_seconds(cost: dict, rows: int, gpu: str = GPU) -> float:
    """One forward of ``rows`` rows of a model part on ``gpu`` (the planner's datasheet figures at its achievable
    fractions), a roofline: ``max((W + A * rows) / HBM, 2 * M * rows / F)`` with the part's weight bytes ``W``,
    activation bytes per row ``A`` and multiply-accumulates per row ``M`` (:func:`part_cost`), the HBM bandwidth and
    the achievable matmul rate ``F``. No fixed cost per forward (module docstring)."""
    spec = device_spec(gpu)
    memory = (cost["weight_bytes"] + cost["activation_bytes_per_row"] * rows) / spec.hbm_bytes_per_s
    return max(memory, 2 * cost["macs_per_row"] * rows / spec.matmul_flops)


def _priced(cost: dict | None) -> bool:
    return cost is not None and cost.get("activation_bytes_per_row") is not None and cost["weight_bytes"] > 0


def project(records: list[dict], costs: list[dict], gpu: str = GPU) -> None:
    """Each decoding record's CPU time predicted from its forwards' rows by the fitted lines (against the measured
    CPU time: how well the cost model explains it), and its time on ``gpu`` (:func:`gpu_seconds` of every counted
    forward, and of the calls a record written before they were counted holds as ``"reconstructed"``); the speed over
    AR on both. A record one of whose parts has no GPU cost (an old record whose parts ``decoding_reprice`` could not
    rebuild) gets none."""
    fits = {(c["entry"], c["part"]): c for c in costs}
    decoding = [r for r in records if r["kind"] == "decoding"]
    for r in decoding:
        cpu = gpu_t = 0.0
        priced = True
        for s in r["samples"]:
            for name, forwards in s["forwards"].items():
                c = fits.get((r["entry"], name))
                if c is None:
                    continue
                cpu += sum(c["fit"]["a"] + c["fit"]["b"] * rows for rows, _, _ in forwards)
            for name, forwards in [*s["forwards"].items(), *s.get("reconstructed", {}).items()]:
                c = fits.get((r["entry"], name))
                if not _priced(c):
                    priced = False
                    continue
                gpu_t += sum(gpu_seconds(c, f[0], gpu) for f in forwards)
        tokens = max(r["tokens"], 1)
        r["model_cpu_s_per_token"] = cpu / tokens
        r.setdefault("measured_forward_cpu_s_per_token", sum(f[1] for s in r["samples"] for fs in s["forwards"].values()
                                                             for f in fs) / tokens)  # at measuring (unrounded)
        r[f"{gpu}_s_per_token"] = gpu_t / tokens if priced else None
        r.pop(f"vs_ar_{gpu}", None)
    by = {(r["entry"], r["variant"], r["batch"]): r for r in decoding}
    for r in decoding:
        base = by.get((r["ar"], "greedy", r["batch"]))
        if base is not None and base is not r:
            if r["model_cpu_s_per_token"]:
                r["vs_ar_model_cpu"] = base["model_cpu_s_per_token"] / r["model_cpu_s_per_token"]
            if base[f"{gpu}_s_per_token"] and r[f"{gpu}_s_per_token"]:
                r[f"vs_ar_{gpu}"] = base[f"{gpu}_s_per_token"] / r[f"{gpu}_s_per_token"]


def reconstruct_drafter_calls(record: dict, costs: list[dict]) -> bool:
    """The calls a speculative record written before :data:`COUNTING` 2 lacks, added to each sample as
    ``"reconstructed"`` (priced, never timed), by the rule the counting hooks follow
    (``tests/benchmarks/test_decoding.py`` checks it against them): a step drafts (one drafter call of ``b x block`` rows, ``block`` read from the variant's
    description), then verifies (one target forward of ``b x (1 + proposals)`` rows), so drafter call ``i`` is
    followed by target forward ``i + 1`` (forward 0: the prefill) and its proposals' head call has that forward's rows
    less ``b``; and every target forward appends its rows' features to the drafter's context (one ``fc`` call of its
    rows). Returns whether anything was added; a ``"drafter context"`` cost record is added when missing (its costs
    unknown until ``scripts/decoding_reprice.py`` fills them)."""
    if record["kind"] != "decoding" or record.get("counting", 1) >= COUNTING:
        return False
    if not any(s["forwards"].get("drafter") for s in record["samples"]):  # no speculative decoding in it
        return False
    found = re.search(r"block (\d+)", record["description"])
    if found is None:
        raise ValueError(f"{record['entry']} | {record['variant']}: no 'block B' in its description "
                         f"{record['description']!r}")
    block = int(found.group(1))
    for s in record["samples"]:
        drafter, model = s["forwards"].get("drafter", []), s["forwards"].get("model", [])
        if len(model) < len(drafter) + 1:
            raise ValueError(f"{record['entry']} | {record['variant']}: {len(drafter)} drafter calls but "
                             f"{len(model)} target forwards; each draft is followed by a verification")
        s["reconstructed"] = {
            "head": [[model[i + 1][0] - d[0] // block] for i, d in enumerate(drafter)],
            "drafter context": [[f[0]] for f in model],
        }
    if not any(c["entry"] == record["entry"] and c["part"] == "drafter context" for c in costs):
        costs.append(dict(kind="forward_cost", entry=record["entry"], part="drafter context", points=[],
                          fit=dict(a=0.0, b=0.0), weight_bytes=0, macs_per_row=0, activation_bytes_per_row=None))
    return True


# --- the report -------------------------------------------------------------------------------------------------------
def _describe(rec: dict | None, fmt: str = ".1f") -> str:
    return "-" if rec is None else Spread(rec["values"]).describe(fmt)


def _ratio(rec: dict | None) -> str:
    if rec is None:
        return "-"
    return f"tie ({rec['ratio']:.2f}x)" if rec["tie"] else f"{rec['ratio']:.2f}x"


def _pct(x) -> str:
    return "-" if x is None else f"{x:.0%}"


def _quality(record: dict, name: str = "exact_match") -> str:
    """Exact match (or the scorer ``name``) as ``hits/n, share [95 % interval]``; ``-`` when the record has none."""
    if name not in record:
        return "-"
    hits, n, low, high = exact_match_of(record, name)
    return f"{hits}/{n}, {hits / n:.0%} [{low:.0%}-{high:.0%}]"


def _gpu_ratio(record: dict) -> str:
    value = record.get(f"vs_ar_{GPU}")
    return "-" if value is None else f"{value:.2f}x"


def table(records: list[dict]) -> str:
    decoding = [r for r in records if r["kind"] == "decoding"]
    extra = [n for n in dict.fromkeys(n for r in decoding for n in r.get("scorers", ())) if n != "exact_match"]
    lines = ["| model | decoding | batch | tokens / forward | rows / forward | tokens/s (wall) | CPU ms / token | "
             f"vs AR (CPU) | vs AR, {GPU.upper()} roofline | exact match (95 % interval) | "
             + "".join(f"{n.replace('_', ' ')} (95 % interval) | " for n in extra) + "agreement | = batch 1 |",
             "|---|---|---:|---:|---:|---|---|---|---:|---:|" + "---:|" * len(extra) + "---:|---:|"]
    for r in decoding:
        ms = dict(r["cpu_s_per_token"], values=[1000 * v for v in r["cpu_s_per_token"]["values"]])
        lines.append(f"| {r['entry']} | {r['variant']} | {r['batch']} | {r['tokens_per_forward']:.2f} | "
                     f"{r['rows_per_forward']:.1f} | {_describe(r['tokens_per_s'])} | {_describe(ms, '.0f')} | "
                     f"{_ratio(r.get('vs_ar_cpu'))} | {_gpu_ratio(r)} | {_quality(r)} | "
                     + "".join(f"{_quality(r, n)} | " for n in extra)
                     + f"{_pct(r.get('agreement'))} | {_pct(r['same_as_batch_1'])} |")
    return "\n".join(lines)


def technique_table(records: list[dict]) -> str:
    """Each variant against the one it adds a technique to: forwards saved, CPU time per token, exact match of both."""
    decoding = [r for r in records if r["kind"] == "decoding"]
    by = {(r["entry"], r["variant"], r["batch"]): r for r in decoding}
    lines = ["| model | technique | over | batch | forwards, over / this | CPU s per token, over / this | "
             "exact match, this; over | what it does |", "|---|---|---|---:|---:|---|---|---|"]
    for r in decoding:
        own = by.get((r["entry"], r["baseline"], r["batch"])) if r["baseline"] else None
        if own is None:
            continue
        lines.append(f"| {r['entry']} | {r['variant']} | {r['baseline']} | {r['batch']} | "
                     f"{own['forwards'] / max(r['forwards'], 1):.2f}x | {_ratio(r.get('vs_baseline_cpu'))} | "
                     f"{_quality(r)}; {_quality(own)} | {r['description']} |")
    return "\n".join(lines)


def cost_table(records: list[dict]) -> str:
    costs = [r for r in records if r["kind"] == "forward_cost"]
    lines = ["| model | part | forwards timed | CPU ms = a + b x rows | at 1 / 8 / 16 / 32 / 64 rows (x one row) | "
             f"W MB, A KB per row, M M per row | {GPU.upper()} roofline us at 1 / 64 rows |",
             "|---|---|---:|---|---|---|---|"]
    for c in costs:
        a, b = c["fit"]["a"], c["fit"]["b"]
        one = a + b
        rel = " / ".join(f"{(a + b * n) / one:.2f}" for n in (1, 8, 16, 32, 64)) if one > 0 else "-"
        priced = _priced(c)
        gpu = " / ".join(f"{1e6 * gpu_seconds(c, n):.1f}" for n in (1, 64)) if priced else "-"
        sizes = (f"{c['weight_bytes'] / 1e6:.2f}, {c['activation_bytes_per_row'] / 1e3:.1f}, "
                 f"{c['macs_per_row'] / 1e6:.2f}") if priced else "-"
        timed = sum(p[2] for p in c["points"])
        fit = f"{1000 * a:.1f} + {1000 * b:.2f} x rows" if timed else "- (calls reconstructed, not timed)"
        lines.append(f"| {c['entry']} | {c['part']} | {timed} | {fit} | {rel} | {sizes} | {gpu} |")
    return "\n".join(lines)


def reprice(records: list[dict]) -> None:
    """The GPU column of every record from its counted (and, for an old record, reconstructed) forwards, by the
    current cost model (:func:`project`); the report and ``--report-only`` draw it so."""
    check_records(records)
    costs = [r for r in records if r["kind"] == "forward_cost"]
    known = len(costs)
    for r in records:
        reconstruct_drafter_calls(r, costs)
    records.extend(costs[known:])
    project(records, costs)


def report(records: list[dict]) -> str:
    """The study's section of ``summary.md`` (the GPU column priced again by :func:`reprice`)."""
    reprice(records)
    decoding = [r for r in records if r["kind"] == "decoding"]
    prompts = sorted({exact_match_of(r)[1] for r in decoding})
    groups = sorted({(r["batch"], len(r["samples"])) for r in decoding})
    few = min(prompts, default=0) < QUALITY_PROMPTS
    tasks = sorted({r.get("task", "arith") for r in decoding})
    budgets = sorted({r["max_new_tokens"] for r in decoding if "max_new_tokens" in r})
    task = f"task {', '.join(tasks)}" + (f", {', '.join(map(str, budgets))} new tokens at most" if budgets else "")
    title = ("**Decoding: every family's variants against greedy AR** (held-out prompts of the "
             f"{task}, chat template, {', '.join(map(str, prompts))} prompts, EOS honoured; timed groups per batch "
             "size "
             f"{', '.join(f'{b}: {n}' for b, n in groups)}; median [range]; speed over AR = ratio of median CPU "
             "seconds per token, a tie where the ranges overlap; the GPU column: every counted forward priced by "
             f"the roofline max((W + A x rows) / HBM, 2 M x rows / F) on the planner's {GPU.upper()}, no fixed cost "
             "per forward; exact match: hits / prompts, share [95 % Wilson interval]"
             + (f". Fewer than {QUALITY_PROMPTS} prompts: the exact-match columns carry no quality claim" if few
                else "") + ")")
    return "\n\n".join([title, table(records), "**Each technique against the variant it adds to**",
                        technique_table(records), "**Forward cost by rows (the cost model)**", cost_table(records)])


def plot(records: list[dict], path: pathlib.Path) -> pathlib.Path | None:
    decoding = [r for r in records if r["kind"] == "decoding" and "vs_ar_cpu" in r]
    if not decoding:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    markers = {1: "o", 8: "s"}
    for ax, x_key, xlabel in ((axes[0], "tokens_per_forward", "tokens per forward"),
                              (axes[1], "exact_match", "exact match")):
        for r in decoding:
            x = r[x_key]
            y = r["vs_ar_cpu"]["ratio"]
            ax.scatter([x], [y], marker=markers.get(r["batch"], "^"), s=30)
            ax.annotate(f"{r['variant']} (b{r['batch']})", (x, y), fontsize=6)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("speed over AR (CPU s per token)")
    fig.suptitle("decoding: speed over greedy AR against tokens per forward and quality")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --- the measurement process ------------------------------------------------------------------------------------------
def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="*", default=[EMBEDDED],
                   help="models decoded by their family (none: only the --speculative pairs and their targets)")
    p.add_argument("--causal", default=EMBEDDED)
    p.add_argument("--speculative", nargs="*", default=[])
    p.add_argument("--task", choices=TASKS, default="arith",
                   help="the shipped task (hf_bdlm.data.shipped_task): arith, or fast_apply (code edits)")
    p.add_argument("--prompts", type=int, default=None,
                   help=f"held-out prompts (default: {FULL['prompts']}, fast_apply {TASK_PROMPTS['fast_apply'][0]})")
    p.add_argument("--batches", type=int, nargs="+", default=list(FULL["batches"]))
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="token budget per prompt (default: the task's: 32 for arith, 384 for fast_apply)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timed-groups", type=int, default=MIN_TIMED_STEPS)
    p.add_argument("--variants", nargs="+", default=[],
                   help="only these named family variants (AR greedy always runs); default: every variant")
    p.add_argument("--out", required=True)
    return p


def main(argv=None) -> list[dict]:
    args = make_parser().parse_args(argv)
    import torch  # lazy: keeps hf-bdlm --help free of torch (tests/package/test_cli_help.py)

    torch.set_num_threads(args.threads)
    shipped = shipped_task(args.task)
    study = DecodingStudy(tuple(args.models), args.causal, tuple(_pair(p) for p in args.speculative),
                          args.prompts or TASK_PROMPTS[args.task][0], tuple(args.batches),
                          args.max_new_tokens or shipped.max_new_tokens, args.threads,
                          check_timed_steps(args.timed_groups, "--timed-groups"), args.task, tuple(args.variants))
    entries = load_entries(study)
    examples = held_out(study.prompts, study.task)
    print(f"{sum(len(e.variants) for e in entries)} variants of {len(entries)} models; {len(examples)} held-out "
          f"prompts of the {study.task} task, batches {study.batches}, {study.max_new_tokens} new tokens at most "
          f"(its longest answer: {shipped.longest_answer_tokens} tokens), {study.threads} thread(s), "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    if study.max_new_tokens < shipped.longest_answer_tokens:
        print(f"note: --max-new-tokens {study.max_new_tokens} is below the task's longest answer "
              f"({shipped.longest_answer_tokens} tokens): longer answers are cut, and score as misses", flush=True)
    records = measure(entries, examples, study.batches, study.max_new_tokens, log=lambda s: print(s, flush=True),
                      timed_groups=study.timed_groups)
    score(records, entries, examples, study.task, study.max_new_tokens)
    summarize(records)
    costs = forward_costs(records, entries)
    project(records, costs)
    for r in records:
        for s in r["samples"]:  # keep the per-forward times compact: rows and CPU seconds
            s["forwards"] = {k: [[n, round(c, 6), round(w, 6)] for n, c, w in v] for k, v in s["forwards"].items()}
    out = records + costs
    pathlib.Path(args.out).write_text(json.dumps(out, indent=1))
    print(table(out))
    print(technique_table(out))
    print(cost_table(out))
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
