"""`BDLMEvalCallback`: the paper's per-checkpoint comparison as one line of trainer configuration.

At every checkpoint the trainer saves, the live model is served on 127.0.0.1 (hf-bdlm's server, in a thread),
the chosen evaluation runs against it (the shipped offline SWE-bench set by default), `eval/pass_rate` is logged
through the trainer's loggers (TensorBoard, W&B, ... whatever `report_to` names), and `pass_rate.png` draws pass
rate against training step.

    from hf_bdlm.evaluation.callback import BDLMEvalCallback
    trainer = BDLMSFTTrainer(model, args=BDLMSFTConfig(..., save_steps=50), train_dataset=train)
    trainer.add_callback(BDLMEvalCallback(trainer))                 # evaluation at every saved checkpoint
    trainer.train()        # -> <output_dir>/eval/{eval_history.json, pass_rate.png, checkpoint-<step>/...}
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import TrainerCallback

BENCHMARKS = ("swebench", "terminal-bench")


def plot_pass_rate(history: list[dict], path: str | Path, title: str = "pass rate per checkpoint") -> Path:
    """Line plot of pass rate (%) against training step, one line per benchmark (matplotlib, PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    """

    def __init__(self, trainer=None, benchmark: str = "swebench", tasks: list[str] | None = None,
                 output_dir: str | None = None, step_limit: int = 10, max_tokens: int = 256):
        if benchmark not in BENCHMARKS:
            raise ValueError(f"benchmark must be one of {BENCHMARKS}, got {benchmark!r}.")
        self.trainer, self.benchmark, self.tasks = trainer, benchmark, tasks
        self.output_dir, self.step_limit, self.max_tokens = output_dir, step_limit, max_tokens
        self.history: list[dict] = []

    def on_save(self, args, state, control, model=None, processing_class=None, **kwargs):
        if not state.is_world_process_zero:
            return
        tokenizer = processing_class or getattr(self.trainer, "processing_class", None)
        if model is None or tokenizer is None:
            raise ValueError("BDLMEvalCallback needs the model and its tokenizer (pass processing_class to the "
                             "trainer).")
        out = Path(self.output_dir or Path(args.output_dir) / "eval")
        pass_rate, results_path = self.evaluate(model, tokenizer, out / f"checkpoint-{state.global_step}",
                                                state.global_step)
        row = {"step": state.global_step, "benchmark": self.benchmark, "pass_rate": pass_rate,
               "results": str(results_path)}
        self.history.append(row)
        (out / "eval_history.json").write_text(json.dumps(self.history, indent=2))
        plot_pass_rate(self.history, out / "pass_rate.png")
        logs = {"eval/pass_rate": pass_rate}
        if self.trainer is not None:
            self.trainer.log(logs)
        else:
            state.log_history.append({**logs, "step": state.global_step})

    def evaluate(self, model, tokenizer, output_dir: Path, step: int) -> tuple[float, Path]:
        """Serve `model` and run the benchmark; the model's train/eval mode is restored afterwards."""
        from ..serving import Engine
        from .agent import AgentSettings
        from .endpoint import model_endpoint

        bdlm = model.get_base_model() if hasattr(model, "get_base_model") else model
        was_training = bdlm.training
        try:
            engine = Engine(bdlm, tokenizer, name=f"checkpoint-{step}")
            with model_endpoint(engine=engine) as endpoint:
                settings = AgentSettings(endpoint.base_url, endpoint.model, step_limit=self.step_limit,
                                         max_tokens=self.max_tokens)
                if self.benchmark == "swebench":
                    from .swebench_runner import run_swebench

                    run = run_swebench(endpoint, output_dir, settings, instance_ids=self.tasks, progress=False)
                else:
                    from .terminal_runner import run_terminal_bench

                    run = run_terminal_bench(endpoint, output_dir, settings, names=self.tasks, progress=False)
        finally:
            bdlm.train(was_training)
        return run.pass_rate, run.results_path
