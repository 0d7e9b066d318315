"""`BDLMEvalCallback`: the paper's per-checkpoint comparison as one line of trainer configuration.

At every checkpoint the trainer saves, the live model is served on 127.0.0.1 (hf-bdlm's server, in a thread),
the chosen evaluation runs against it (the shipped offline SWE-bench set by default), `eval/pass_rate` is logged
through the trainer's loggers (TensorBoard, W&B, ... whatever `report_to` names), and `pass_rate.png` draws pass
rate against training step.

    from hf_bdlm.evaluation.callback import BDLMEvalCallback
    trainer = BDLMSFTTrainer(model, args=BDLMSFTConfig(..., save_steps=50), train_dataset=train)
    trainer.add_callback(BDLMEvalCallback(trainer))                 # evaluation at every saved checkpoint
    trainer.train()        # -> <output_dir>/eval/{eval_history.json, pass_rate.png, checkpoint-<step>/...}

Any model family the server decodes (the registry of ``hf_bdlm.models``) and any parallel mode:
the main process evaluates while the other ranks wait for its result at the same point of the run (under torchrun,
with block parallelism, DDP or FSDP2). Parameters that are DTensors (FSDP2; tensor parallelism's split weights take the
same path, not tested yet) are gathered by every rank first and served from a plain copy on the main process
(:mod:`.live_model`). The
evaluation runs on its own random streams: the training that follows is the one without the callback.
"""

from __future__ import annotations

import json
import random
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from ..protocols.step import unwrap_model
from ..serving import Engine
from .agent import AgentSettings
from .endpoint import model_endpoint
from .live_model import servable_model

BENCHMARKS = ("swebench", "terminal-bench")


def plot_pass_rate(history: list[dict], path: str | Path, title: str = "pass rate per checkpoint") -> Path:
    """Line plot of pass rate (%) against training step, one line per benchmark (matplotlib, PNG)."""
    import matplotlib  # lazy: optional dependency (matplotlib)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: after matplotlib.use picks the backend pyplot starts with

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    for benchmark in sorted({row["benchmark"] for row in history}):
        rows = sorted((r for r in history if r["benchmark"] == benchmark), key=lambda r: r["step"])
        ax.plot([r["step"] for r in rows], [100 * r["pass_rate"] for r in rows], marker="o", label=benchmark)
    ax.set_xlabel("training step")
    ax.set_ylabel("pass rate (%)")
    ax.set_ylim(-2, 102)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


class BDLMEvalCallback(TrainerCallback):
    r"""
    Evaluate every saved checkpoint on an agentic benchmark and log `eval/pass_rate`.

    Args:
        trainer (*optional*):
            The trainer, whose `log` sends `eval/pass_rate` to its loggers. Without it the value is only appended to
            `state.log_history`.
        benchmark (`str`, defaults to `"swebench"`):
            `"swebench"` (the shipped offline SWE-bench set) or `"terminal-bench"` (the shipped terminal tasks).
        tasks (`list[str]`, *optional*):
            A subset: instance ids (SWE-bench) or task names (Terminal-Bench).
        output_dir (`str`, *optional*):
            Defaults to `<args.output_dir>/eval`.
        step_limit (`int`, defaults to 10), max_tokens (`int`, defaults to 256):
            Agent budget per task and per model call.
        seed (`int`, *optional*, defaults to 0):
            Sent as every request's `seed`, so that a checkpoint's score does not depend on sampling luck (a family
            whose decoding starts from a random canvas draws it from this seed; a greedy decode ignores it). `None`: a
            fresh stream per request.
        wait_timeout_s (`float`, defaults to 86400):
            How long the other ranks of a distributed run wait for the main process's evaluation (they wait on a
            process group of their own, not under the trainer's `ddp_timeout`).
    """

    def __init__(self, trainer=None, benchmark: str = "swebench", tasks: list[str] | None = None,
                 output_dir: str | None = None, step_limit: int = 10, max_tokens: int = 256, seed: int | None = 0,
                 wait_timeout_s: float = 86400.0):
        if benchmark not in BENCHMARKS:
            raise ValueError(f"benchmark must be one of {BENCHMARKS}, got {benchmark!r}.")
        self.trainer, self.benchmark, self.tasks = trainer, benchmark, tasks
        self.output_dir, self.step_limit, self.max_tokens = output_dir, step_limit, max_tokens
        self.seed, self.wait_timeout_s = seed, wait_timeout_s
        self.history: list[dict] = []
        self._wait_group = None

    def on_save(self, args, state, control, model=None, processing_class=None, **kwargs):
        """Every rank: gather the weights if they are sharded; the main process evaluates; all ranks then receive its
        row and log it (the trainer's loggers write on the main process only)."""
        main = state.is_world_process_zero
        tokenizer = processing_class or getattr(self.trainer, "processing_class", None)
        if model is None or tokenizer is None:
            raise ValueError("BDLMEvalCallback needs the model and its tokenizer (pass processing_class to the "
                             "trainer).")
        row, failure = None, None
        try:
            servable = servable_model(model, main, device=args.device)
            if main:
                row = self._evaluate_checkpoint(args, state, model, servable, tokenizer)
        except Exception as err:  # the other ranks must hear of it, not wait for a row that never comes
            failure = err
        row = self._shared(row if failure is None else {"error": traceback.format_exc()}, main)
        if failure is not None:
            raise failure
        if "error" in row:
            raise RuntimeError(f"BDLMEvalCallback: the main process failed to evaluate step {state.global_step}:\n"
                               f"{row['error']}")
        logs = {"eval/pass_rate": row["pass_rate"]}
        if self.trainer is not None:
            self.trainer.log(logs)
        else:
            state.log_history.append({**logs, "step": state.global_step})

    def _evaluate_checkpoint(self, args, state, model, servable, tokenizer) -> dict:
        out = Path(self.output_dir or Path(args.output_dir) / "eval")
        was_training = model.training
        try:
            with _own_random_streams(servable):
                pass_rate, results_path = self.evaluate(servable, tokenizer, out / f"checkpoint-{state.global_step}",
                                                        state.global_step)
        finally:
            model.train(was_training)
        row = {"step": state.global_step, "benchmark": self.benchmark, "pass_rate": pass_rate,
               "results": str(results_path)}
        self.history.append(row)
        (out / "eval_history.json").write_text(json.dumps(self.history, indent=2))
        plot_pass_rate(self.history, out / "pass_rate.png")
        return row

    def _shared(self, row: dict | None, main: bool) -> dict:
        """The main process's row on every rank: the other ranks wait here while it evaluates."""
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return row
        if self._wait_group is None:  # every rank reaches the first save: the group is created collectively
            self._wait_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.wait_timeout_s))
        box = [row if main else None]
        dist.broadcast_object_list(box, src=0, group=self._wait_group)
        return box[0]

    def evaluate(self, model, tokenizer, output_dir: Path, step: int) -> tuple[float, Path]:
        """Serve `model` (a model of any family the server decodes) and run the benchmark; the model's train/eval
        mode is restored afterwards."""
        served = unwrap_model(model)
        was_training = served.training
        try:
            engine = Engine(served, tokenizer, name=f"checkpoint-{step}")
            with model_endpoint(engine=engine) as endpoint:
                settings = AgentSettings(endpoint.base_url, endpoint.model, step_limit=self.step_limit,
                                         max_tokens=self.max_tokens,
                                         model_kwargs={} if self.seed is None else {"seed": self.seed})
                if self.benchmark == "swebench":
                    from .swebench_runner import run_swebench  # lazy: optional dependency (swebench)

                    run = run_swebench(endpoint, output_dir, settings, instance_ids=self.tasks, progress=False)
                else:
                    from .terminal_runner import run_terminal_bench  # lazy: optional dependency (swebench)

                    run = run_terminal_bench(endpoint, output_dir, settings, names=self.tasks, progress=False)
        finally:
            served.train(was_training)
        return run.pass_rate, run.results_path


class _own_random_streams:
    """Keep the training's random generators (torch CPU and the model's accelerator, Python's) as they were: the
    evaluation must not shift the noise the next steps draw on the main process only."""

    def __init__(self, model):
        device = next(model.parameters()).device
        self.devices = [device.index or 0] if device.type == "cuda" else []

    def __enter__(self):
        self.python = random.getstate()
        self.torch = torch.random.fork_rng(devices=self.devices)
        self.torch.__enter__()

    def __exit__(self, *exc):
        random.setstate(self.python)
        return self.torch.__exit__(*exc)
