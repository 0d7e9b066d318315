"""The matched comparison of block-parallel layouts: what is measured at every checkpoint, and the figure.

`recipes/dg_matched.py` fine-tunes one model once per layout (csbp, the paper's CP, bp, ...) from the same seed, data
order and token budget. This module holds the pieces that recipe shares with anything else that wants the same record:

- :class:`MatchedRecorder`: a `TrainerCallback` that turns a run into points (layout, step, seconds, metrics): the
  training loss and supervised tokens of every logged step, and at every checkpoint the held-out loss (the trainer's
  `eval_loss`), exact match and the `eval/pass_rate` rows of the `BDLMEvalCallback`\\ s added before it;
- :func:`step_times` / :func:`speed_comparison`: each layout's training seconds per step (every logged step after the
  first, evaluation pauses excluded) as a :class:`~.spread.Spread`, and one layout's speed over
  another's: the ratio of median step times, a tie where the ranges overlap;
- :func:`plot_matched`: each metric against training step and against training wall-clock, one line per layout.

    recorder = MatchedRecorder("csbp", benchmarks=["swebench"], exact_match_examples=held_out[:8])
    trainer.add_callback(BDLMEvalCallback(trainer, "swebench")); trainer.add_callback(recorder)
    recorder.record_initial(trainer); trainer.train()
    plot_matched(recorder.points, "matched.png")
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path

from transformers import TrainerCallback

from ..evaluation.exact_match import held_out_exact_match
from ..evaluation.live_model import servable_model
from .spread import Spread, compare

# The metrics of a checkpoint point besides the pass rates, in the figure's order.
CHECKPOINT_METRICS = ("held_out_loss", "exact_match")


class MatchedRecorder(TrainerCallback):
    r"""
    Record one layout's run as points of the matched comparison.

    Add it after the run's `BDLMEvalCallback`\ s (one per benchmark, in the order of ``benchmarks``): at a save their
    `eval/pass_rate` logs come first, then this callback closes the checkpoint's point. Every rank must run it (exact
    match gathers sharded weights collectively); the points are complete on the main process.

    Args:
        layout (`str`): The block-parallel mode of the run (`"csbp"`, `"cp"`, ...).
        benchmarks (`list[str]`): The benchmarks of the `BDLMEvalCallback`\ s added before it.
        exact_match_examples (`list[dict]`): Held-out examples with `prompt` and `answer` (may be empty).
        max_new_tokens (`int`, defaults to 8): Generation budget per exact-match prompt.
        seed (`int`, defaults to 0): Seed of every exact-match decode.

    Points: `{"layout", "kind": "train" | "checkpoint", "step", "wall_s", "train_s", "metrics"}`; `wall_s` counts
    from the start of training, `train_s` the same without the pauses of checkpoint evaluation (the clock the
    layouts are compared on).
    """

    def __init__(self, layout: str, benchmarks: list[str], exact_match_examples: list[dict],
                 max_new_tokens: int = 8, seed: int = 0):
        self.layout, self.benchmarks = layout, list(benchmarks)
        self.examples, self.max_new_tokens, self.seed = list(exact_match_examples), max_new_tokens, seed
        self.points: list[dict] = []
        self._start: float | None = None
        self._paused = 0.0
        self._pause_start: float | None = None
        self._pending: dict = {}
        self._pass_rates: list[float] = []
        self._tokenizer = None

    # --- clocks ------------------------------------------------------------------------------------
    def _clocks(self) -> tuple[float, float]:
        if self._start is None:
            return 0.0, 0.0
        now = time.perf_counter()
        pause = self._paused + (now - self._pause_start if self._pause_start is not None else 0.0)
        return now - self._start, now - self._start - pause

    def on_train_begin(self, args, state, control, **kwargs):
        self._start, self._paused, self._pause_start = time.perf_counter(), 0.0, None

    def on_step_begin(self, args, state, control, **kwargs):
        if self._pause_start is not None:
            self._paused += time.perf_counter() - self._pause_start
            self._pause_start = None

    def on_step_end(self, args, state, control, **kwargs):
        # The flow callback has decided by now whether this step evaluates or saves: that time is a pause.
        if control.should_evaluate or control.should_save:
            self._pause_start = time.perf_counter()

    # --- metrics -----------------------------------------------------------------------------------
    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = logs or {}
        if "eval/pass_rate" in logs:
            self._pass_rates.append(float(logs["eval/pass_rate"]))
        if "loss" in logs:
            wall, train = self._clocks()
            metrics = {"loss": float(logs["loss"])}
            for key in ("num_tokens", "masked_tokens", "mean_token_accuracy"):
                if key in logs:
                    metrics[key] = float(logs[key])
            self.points.append({"layout": self.layout, "kind": "train", "step": state.global_step, "wall_s": wall,
                                "train_s": train, "metrics": metrics})

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if metrics and "eval_loss" in metrics:
            self._pending["held_out_loss"] = float(metrics["eval_loss"])

    def on_save(self, args, state, control, model=None, processing_class=None, **kwargs):
        tokenizer = processing_class or self._tokenizer
        main = state.is_world_process_zero
        served = servable_model(model, main, device=args.device)  # every rank: a collective under FSDP2
        wall, train = self._clocks()
        metrics = dict(self._pending)
        if main and self.examples:
            metrics["exact_match"], _ = held_out_exact_match(served, tokenizer, self.examples,
                                                             max_new_tokens=self.max_new_tokens, seed=self.seed)
        if len(self._pass_rates) != len(self.benchmarks):
            raise RuntimeError(f"MatchedRecorder expected one eval/pass_rate per benchmark {self.benchmarks} at step "
                               f"{state.global_step}, got {self._pass_rates}; add it after the BDLMEvalCallbacks.")
        metrics.update({f"pass_rate/{b}": r for b, r in zip(self.benchmarks, self._pass_rates)})
        self.points.append({"layout": self.layout, "kind": "checkpoint", "step": state.global_step, "wall_s": wall,
                            "train_s": train, "metrics": metrics})
        self._pending, self._pass_rates = {}, []

    def record_initial(self, trainer, eval_callbacks) -> None:
        """The step-0 point, before `trainer.train()`: held-out loss, exact match and pass rates of the initial
        weights (every rank calls it, like the trainer's own evaluation)."""
        self._tokenizer = trainer.processing_class
        trainer.evaluate()  # -> on_evaluate: the held-out loss
        for callback in [*eval_callbacks, self]:
            callback.on_save(trainer.args, trainer.state, trainer.control, model=trainer.model,
                             processing_class=trainer.processing_class)


def loss_agreement(points: list[dict], reference: str, other: str) -> dict:
    """Step-by-step comparison of two layouts' training losses: steps compared and the largest absolute and relative
    difference."""
    losses = defaultdict(dict)
    for p in points:
        if p["kind"] == "train":
            losses[p["layout"]][p["step"]] = p["metrics"]["loss"]
    steps = sorted(set(losses[reference]) & set(losses[other]))
    diffs = [abs(losses[reference][s] - losses[other][s]) for s in steps]
    rel = [d / max(abs(losses[reference][s]), 1e-12) for d, s in zip(diffs, steps)]
    return {"steps": len(steps), "max_abs_diff": max(diffs, default=0.0), "max_rel_diff": max(rel, default=0.0)}


def step_times(points: list[dict], layout: str) -> Spread:
    """``layout``'s training seconds per step: between consecutive logged training points, the training clock's advance
    (evaluation pauses excluded) over the steps it covers. The first logged interval (from the start of training) is
    the warm-up and is left out."""
    train = sorted((p for p in points if p["layout"] == layout and p["kind"] == "train"), key=lambda p: p["step"])
    if len(train) < 2:
        raise ValueError(f"layout {layout!r} logged {len(train)} training step(s); the step times need at least 2 "
                         "(set logging_steps so that a run logs several).")
    return Spread((b["train_s"] - a["train_s"]) / (b["step"] - a["step"]) for a, b in zip(train, train[1:]))


def speed_comparison(points: list[dict], reference: str, other: str) -> dict:
    """How much faster ``reference`` trains than ``other`` per step: the ratio of their median step times (> 1:
    ``reference`` is faster), the extreme ratios their ranges allow, whether the ranges overlap (a tie), and the text
    tables print (``1.14x`` or ``tie (1.05x)``)."""
    comparison = compare(step_times(points, other), step_times(points, reference))
    return dict(comparison.as_record(), describe=comparison.describe())


def plot_matched(points: list[dict], path: str | Path, title: str = "matched comparison") -> Path:
    """One PNG: a row per metric (training loss, then each checkpoint metric), against training step (left) and
    training wall-clock without evaluation pauses (right), one line per layout."""
    import matplotlib  # lazy: optional dependency (matplotlib)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: after matplotlib.use picks the backend pyplot starts with

    layouts = list(dict.fromkeys(p["layout"] for p in points))
    checkpoint_keys = sorted({k for p in points if p["kind"] == "checkpoint" for k in p["metrics"]},
                             key=lambda k: (k not in CHECKPOINT_METRICS, CHECKPOINT_METRICS.index(k)
                                            if k in CHECKPOINT_METRICS else 0, k))
    rows = [("train", "loss")] + [("checkpoint", k) for k in checkpoint_keys]
    fig, axes = plt.subplots(len(rows), 2, figsize=(10, 2.6 * len(rows)), dpi=110, squeeze=False)
    for r, (kind, key) in enumerate(rows):
        for c, (clock, xlabel) in enumerate((("step", "training step"),
                                             ("train_s", "training wall-clock (s, evaluation excluded)"))):
            ax = axes[r][c]
            for i, layout in enumerate(layouts):
                series = sorted((p for p in points if p["layout"] == layout and p["kind"] == kind
                                 and key in p["metrics"]), key=lambda p: p["step"])
                ax.plot([p[clock] for p in series], [p["metrics"][key] for p in series],
                        marker="o" if kind == "checkpoint" else None, markersize=3, label=layout,
                        linestyle=("-", "--", ":", "-.")[i % 4])  # exact layouts coincide: keep both visible
            ax.set_xlabel(xlabel)
            ax.set_ylabel("training loss" if kind == "train" else key.replace("_", " "))
            if key == "exact_match" or key.startswith("pass_rate/"):
                ax.set_ylim(-0.02, 1.02)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
