"""`TrainingStep`: a training step that is not the model's forward, as a module forward DDP and Accelerate see.

A family whose training role ``owns_step`` (`hf_bdlm.protocols.roles.TrainingSpec`) trains with an objective that
calls the model's parts itself (an encoder-decoder's: its encoder, its decoder once or twice, its LM head on the scored
rows only) and never the model's top-level forward. A `DistributedDataParallel` wrapper synchronizes gradients only for a forward that went through it (its reducer
expects the parameters' gradient hooks after its own forward), and Accelerate's mixed precision is an autocast
around the model's forward, so both would miss such a step: silently unsynchronized gradients, silently float32.

`TrainingStep` owns the model as its only submodule (`module`, so the same parameters) and its forward runs
whatever step function it is given: ``step(fn, *args) == fn(model, *args)``. The trainer prepares it with
``accelerator.prepare_model`` in place of the model (DDP around it when the world has several processes, autocast
under ``bf16``), and ``compute_loss`` calls ``model(objective.loss, corrupted, layout)``: DDP's forward runs, its
reducer sees the step's graph, its ``no_sync`` covers gradient accumulation, and the loss each rank returns (scaled
by the world size) averages to the single-device gradient. Saving, PEFT and generation keep using the model itself.

Under FSDP2 the same module is the root unit (the family's ``shard_fsdp``, e.g.
the tied encoder/decoder layer pairs of an encoder-decoder): its forward gathers the root's parameters (e.g.
embeddings = LM head, final norm) for the whole step, the units inside gather their own around each call, and
training and evaluation both run through it.
"""

from __future__ import annotations

from typing import Any, Callable

from accelerate.utils import extract_model_from_parallel, is_peft_model
from torch import nn


class TrainingStep(nn.Module):
    """``forward(fn, *args, **kwargs)`` returns ``fn(self.module, *args, **kwargs)`` (see the module docstring)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, fn: Callable[..., Any], *args, **kwargs):
        return fn(self.module, *args, **kwargs)


def unwrap_model(model):
    """The model inside its training wrappers: DDP, DataParallel, FSDP1, DeepSpeed and ``torch.compile`` (Accelerate's
    ``extract_model_from_parallel``), a :class:`TrainingStep`, and PEFT's ``PeftModel`` (its base model, which keeps
    the adapter layers injected, so it computes with the adapter). The one place hf_bdlm looks through wrappers; anything
    else is returned as it is."""
    if not isinstance(model, nn.Module):
        return model
    inner = extract_model_from_parallel(model, keep_torch_compile=False)
    while isinstance(inner, TrainingStep):  # (DDP around) the step of a family that drives its model's parts
        inner = extract_model_from_parallel(inner.module, keep_torch_compile=False)
    return inner.get_base_model() if is_peft_model(inner) else inner


def run_step(model: nn.Module, fn: Callable[..., Any], *args, **kwargs):
    """Run ``fn(model, ...)`` through ``model``'s forward when it is a (DDP-wrapped or FSDP2-sharded)
    :class:`TrainingStep`, else directly (evaluation without FSDP2, where the trainer passes the model itself)."""
    if isinstance(getattr(model, "module", model), TrainingStep) or isinstance(model, TrainingStep):
        return model(fn, *args, **kwargs)
    return fn(model, *args, **kwargs)


__all__ = ["TrainingStep", "run_step", "unwrap_model"]
