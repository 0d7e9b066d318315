"""Progress bars of long work (tqdm): generation from the command line, ``hf-bdlm plan --paper``, held-out scoring,
lm-eval runs and a drafter family's feature capture say how far they are instead of sitting silent for minutes.

One rule for every bar, so that nothing a script reads changes:

- a bar is drawn on standard error, never on standard output;
- only the main process of a distributed run (rank 0) draws one;
- as tqdm does with ``disable=None``, a bar is drawn only when standard error is a terminal: logs, pipes, CI and
  captured output get no bar lines. ``HF_BDLM_PROGRESS=1`` draws them anyway, ``HF_BDLM_PROGRESS=0`` never.

Text printed to standard output while a bar is shown goes through :func:`write` (tqdm clears the bar, prints the
line and draws the bar again), which writes the same bytes as ``print``.

    with progress_bar(total=len(prompts), desc="held-out exact match", unit="prompt") as bar:
        for prompt in prompts:
            ...
            bar.update(1)
"""

from __future__ import annotations

import os
import sys

from tqdm.auto import tqdm

PROGRESS_ENV = "HF_BDLM_PROGRESS"


def main_process() -> bool:
    """Whether this process is rank 0 (or the only process): the initialised process group's rank, else the ``RANK``
    that torchrun and ``accelerate launch`` set before the group exists."""
    dist = sys.modules.get("torch.distributed")  # a process that never imported torch has no group
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def bar_disabled(enabled: bool = True) -> bool | None:
    """tqdm's ``disable`` for a bar of this process: ``True`` when the caller turns it off, off rank 0, or with
    ``HF_BDLM_PROGRESS=0``; ``False`` with ``HF_BDLM_PROGRESS=1``; else ``None`` (tqdm: only on a terminal)."""
    setting = os.environ.get(PROGRESS_ENV, "").strip()
    if setting not in ("", "0", "1"):
        raise ValueError(f"{PROGRESS_ENV}={setting!r}; set it to 1 (draw progress bars off a terminal too) or 0 (never "
                         "draw them), or unset it (draw them on a terminal).")
    if not enabled or setting == "0" or not main_process():
        return True
    return False if setting == "1" else None


def progress_bar(iterable=None, *, total: int | None = None, desc: str | None = None, unit: str = "it",
                 enabled: bool = True, **kwargs) -> tqdm:
    """A tqdm bar on standard error under the module's rule (``enabled=False``: none; ``kwargs``: tqdm's)."""
    return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stderr, disable=bar_disabled(enabled),
                dynamic_ncols=True, **kwargs)


def write(line: str = "") -> None:
    """``print(line)`` with the bars on the terminal cleared first and drawn again after (the same bytes on stdout)."""
    tqdm.write(line, file=sys.stdout)


class ProgressStreamer:
    """A streamer (transformers' ``streamer=`` protocol: ``put`` the prompt, then the new tokens; ``end``) that moves
    ``bar`` by the tokens generated."""

    def __init__(self, bar: tqdm):
        self.bar = bar
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:  # the first call holds the prompt
            self.prompt_seen = True
            return
        self.bar.update(int(value.numel()))

    def end(self) -> None:
        self.bar.refresh()


__all__ = ["PROGRESS_ENV", "ProgressStreamer", "bar_disabled", "main_process", "progress_bar", "write"]
