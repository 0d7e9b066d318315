"""The live model of a training run, in a form the main process can serve alone.

A model trained with DDP or block parallelism holds whole parameters on every rank: the main process serves it as it
is (its forward outside a layout runs no collective). A model whose parameters are DTensors (FSDP2 shards, tensor
parallelism splits) cannot: every forward would gather over all ranks, and the other ranks are not decoding. So every
rank takes part in gathering the full weights once, and the main process loads them into a plain copy of the model
(same class and config, no sharding hooks), which it serves and then drops.

    servable = servable_model(model, is_main)   # every rank calls it; the main process gets a model, the others None
"""

from __future__ import annotations

import copy

import torch
from accelerate import init_empty_weights
from peft import get_peft_model
from torch.distributed.tensor import DTensor

from ..protocols.step import unwrap_model
from ..trainer.fsdp import full_model_state_dict


def holds_dtensors(model: torch.nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor (sharded by FSDP2 or split by tensor parallelism)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def servable_model(model: torch.nn.Module, is_main: bool, device: torch.device | str | None = None):
    """The model the main process serves: ``model`` itself (unwrapped from PEFT) when its parameters are whole, else a
    plain copy with the gathered weights. Every rank must call it (the gather is a collective); the other ranks get
    ``None``."""
    if not holds_dtensors(model):
        return unwrap_model(model) if is_main else None
    state = full_model_state_dict(model)  # on the CPU of the main process; empty elsewhere
    if not is_main:
        return None
    plain = _plain_copy(model, state)
    if device is not None:
        plain = plain.to(device)
    return unwrap_model(plain)


def _plain_copy(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A model of the same class and config as ``model`` (PEFT adapters re-applied), without its sharding, holding
    ``state``. Parameters are built on the meta device and take the gathered tensors; buffers (e.g. rotary
    frequencies, outside the state dict) are computed as at load time."""
    peft_config = None
    base = model
    if hasattr(model, "get_base_model"):
        peft_config, base = model.peft_config[model.active_adapter], model.get_base_model()
    with init_empty_weights(include_buffers=False):
        plain = type(base)(copy.deepcopy(base.config))
    if peft_config is not None:
        plain = get_peft_model(plain, copy.deepcopy(peft_config))
    missing, unexpected = plain.load_state_dict(state, strict=False, assign=True)
    still_meta = [name for name, p in plain.named_parameters() if p.is_meta]
    if still_meta or unexpected:
        raise RuntimeError(
            f"the gathered weights of the live {type(base).__name__} do not fit a plain copy of it (parameters left "
            f"without weights: {still_meta[:5]}, unexpected: {unexpected[:5]}); please report this with the model's "
            "config."
        )
    inner = unwrap_model(plain)
    inner.tie_weights()
    if getattr(base, "generation_config", None) is not None:
        inner.generation_config = copy.deepcopy(base.generation_config)
    return plain.train(False)
