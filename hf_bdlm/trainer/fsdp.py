"""FSDP2 for `BDLMSFTTrainer`: parameters sharded with ``fully_shard`` over the data world (``dp x bp``: every rank, or
with tensor parallelism the ranks of one tensor-parallel index, each parameter then a 2-D DTensor).

The switch is the one transformers users know: ``TrainingArguments.fsdp`` / ``fsdp_config`` with
``fsdp_version: 2``, or an ``accelerate launch`` config with ``distributed_type: FSDP`` and
``fsdp_version: 2`` (``recipes/accelerate/``). Accelerate runs FSDP only on accelerators (on a CPU
world it silently trains plain DDP), and its FSDP2 would shard over a mesh of its own, so the
trainer takes the request away from Accelerate and applies ``fully_shard`` itself, on CPU (gloo) and
GPU (NCCL) alike, over the world dim ``"dp_bp"`` of the block-parallel mesh
(:meth:`ParallelDims.build_mesh <hf_bdlm.parallel.dims.ParallelDims.build_mesh>`). Accelerate then
prepares mixed precision only (transformers' path for a model that owns its sharding).

What FSDP2 changes and what it does not (``docs/design.md`` §3): every rank still computes the loss
of its own rows, scaled by the world size; FSDP2's reduce-scatter averages the gradients over the
world, as DDP's all-reduce does, so losses and weights equal the DDP run of the same layout (tested on 2 and 4 CPU
processes, every model family: ``tests/trainer/test_fsdp.py``; not yet run on GPUs).

- Units: every module whose class is in ``transformer_cls_names_to_wrap`` (default: the backbone's
  ``_no_split_modules``, its decoder layers), then the root (embeddings, final norm, LM head). The root
  is not resharded after forward: the loss applies the LM head outside the model's forward.
  ``auto_wrap_policy: NO_WRAP`` shards the root only.
- A family whose weights need another grouping shards itself with the same arguments
  (its training role's ``TrainingSpec.shard_fsdp``, e.g. an encoder-decoder's tied
  encoder/decoder layer pairs, with a :class:`~hf_bdlm.protocols.step.TrainingStep` as the root).
- ``reshard_after_forward``, ``cpu_offload`` (accelerators only) and a ``mixed_precision_policy`` are
  passed to ``fully_shard``; ``activation_checkpointing`` checkpoints each decoder layer (the model's
  own checkpointing, the same units). Without a ``mixed_precision_policy`` parameters stay in their
  dtype and ``bf16=True`` runs under autocast, as with DDP.
- Checkpoints (``state_dict_type``): ``FULL_STATE_DICT`` writes the ordinary transformers checkpoint
  (weights or adapter gathered on rank 0, ``optimizer.pt`` in ``torch.optim``'s own format), which any
  run resumes: DDP, one process, FSDP2 on another layout or world. ``SHARDED_STATE_DICT`` writes
  ``model_sharded/`` and ``optimizer_sharded/`` with ``torch.distributed.checkpoint`` (each rank its
  shards; resharded on load, so another world size or layout resumes it too, FSDP2 or not).

    torchrun --nproc_per_node 2 recipes/sft.py --config recipes/configs/smollm2_cpu_csbp.yaml \\
        --fsdp full_shard --fsdp_config '{"fsdp_version": 2}'
"""

from __future__ import annotations

import contextlib
import json
import os

import torch
import torch.distributed.checkpoint as dcp
from accelerate.utils import FullyShardedDataParallelPlugin
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from transformers.utils import ADAPTER_SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

MODEL_SHARDED_DIR = "model_sharded"
OPTIMIZER_SHARDED_DIR = "optimizer_sharded"
STATE_DICT_TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT")
_ACCELERATE_FSDP_ENV = "ACCELERATE_USE_FSDP"


def fsdp_request(args):
    """The FSDP the user asked for, as Accelerate's ``FullyShardedDataParallelPlugin`` (FSDP2 only), or ``None``.

    Read from ``args.fsdp_plugin_args`` (``TrainingArguments.fsdp`` / ``fsdp_config``) or, under ``accelerate launch``
    with an FSDP config, from the ``FSDP_*`` environment. Options that cannot be honoured raise ``ValueError``.
    """
    if getattr(args, "fsdp_plugin_args", None) is not None:
        plugin, where = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args), "fsdp_config"
    elif os.environ.get(_ACCELERATE_FSDP_ENV, "false").lower() == "true":
        plugin, where = FullyShardedDataParallelPlugin(), "the accelerate config"
    else:
        return None
    if plugin.fsdp_version != 2:
        raise ValueError(
            f"BDLMSFTTrainer shards with FSDP2 only, got fsdp_version={plugin.fsdp_version} from {where}; set "
            "fsdp_version: 2 (fsdp_config={'fsdp_version': 2}, or fsdp_version: 2 in the accelerate config)."
        )
    policy = getattr(plugin.auto_wrap_policy, "__name__", None)
    if policy not in (None, "transformer_auto_wrap_policy"):
        raise ValueError(
            f"auto_wrap_policy SIZE_BASED_WRAP (from {where}) is not supported by BDLMSFTTrainer's FSDP2: the units "
            "are the decoder layers. Use TRANSFORMER_BASED_WRAP (optionally with transformer_layer_cls_to_wrap) or "
            "NO_WRAP."
        )
    if plugin.ignored_modules is not None:
        raise ValueError(f"ignored_modules (from {where}) is not supported by BDLMSFTTrainer's FSDP2; remove it.")
    if state_dict_type(plugin) not in STATE_DICT_TYPES:
        raise ValueError(f"state_dict_type must be one of {STATE_DICT_TYPES}, got {plugin.state_dict_type} ({where}).")
    return plugin


def state_dict_type(plugin) -> str:
    return str(plugin.state_dict_type).rsplit(".", 1)[-1]


def offloads(plugin) -> bool:
    return isinstance(plugin.cpu_offload, CPUOffloadPolicy)


@contextlib.contextmanager
def hidden_from_accelerate(args):
    """Accelerate must not see the FSDP request (it would DDP-wrap on CPU, or shard on its own mesh on GPU)."""
    saved_args, saved_env = getattr(args, "fsdp_plugin_args", None), os.environ.get(_ACCELERATE_FSDP_ENV)
    args.fsdp_plugin_args = None
    os.environ[_ACCELERATE_FSDP_ENV] = "false"
    try:
        yield
    finally:
        args.fsdp_plugin_args = saved_args
        if saved_env is None:
            os.environ.pop(_ACCELERATE_FSDP_ENV, None)
        else:
            os.environ[_ACCELERATE_FSDP_ENV] = saved_env


def unit_classes(model: nn.Module, plugin) -> set[str]:
    """Class names of the FSDP2 units below the root: the configured ones, else the backbone's ``_no_split_modules``."""
    if plugin.auto_wrap_policy is None:  # NO_WRAP
        return set()
    if plugin.transformer_cls_names_to_wrap:
        names = set(plugin.transformer_cls_names_to_wrap)
        present = {type(m).__name__ for m in model.modules()}
        if names - present:
            raise ValueError(
                f"transformer_layer_cls_to_wrap names {sorted(names - present)}, which the model does not contain; "
                f"its decoder layers are {sorted(_no_split_classes(model))}."
            )
        return names
    return _no_split_classes(model)


def _no_split_classes(model: nn.Module) -> set[str]:
    names = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return names


def fully_shard_kwargs(model: nn.Module, mesh, plugin) -> dict:
    """``fully_shard``'s arguments from the plugin (mesh, resharding, offload, mixed precision); refuses CPU offload on
    a CPU run."""
    if offloads(plugin) and next(model.parameters()).device.type == "cpu":
        raise ValueError(
            "FSDP2 cpu_offload / offload_params moves parameters to the CPU between uses; on a CPU run they are there "
            "already. Remove the option (or train on GPUs)."
        )
    return dict(mesh=mesh, reshard_after_forward=plugin.reshard_after_forward, offload_policy=plugin.cpu_offload,
                mp_policy=_mixed_precision_policy(plugin.mixed_precision_policy) or MixedPrecisionPolicy())


def shard_model(model: nn.Module, mesh, plugin) -> dict[str, str]:
    """Apply ``fully_shard`` over ``mesh`` to every unit (bottom-up), then to ``model`` (the root), in place.

    Returns ``{qualified name: class name}`` of the units below the root, read before sharding: ``fully_shard``
    swaps each unit's class for a subclass of its own (``FSDPQwen3DecoderLayer``).
    """
    kwargs = fully_shard_kwargs(model, mesh, plugin)
    classes = unit_classes(model, plugin)
    units = [(name, m) for name, m in model.named_modules() if name and type(m).__name__ in classes]
    classes_before = {name: type(m).__name__ for name, m in units}
    for _, module in reversed(units):  # deepest first: a unit is sharded before the module holding it
        fully_shard(module, **kwargs)
    # The root keeps its parameters gathered after forward: the loss applies the LM head outside the model's forward
    # (to the rows that carry targets), and backward needs them at once anyway.
    fully_shard(model, **{**kwargs, "reshard_after_forward": False})
    return {name: classes_before[name] for name, _ in units}


def _mixed_precision_policy(policy):
    if policy is None or isinstance(policy, MixedPrecisionPolicy):
        return policy
    if isinstance(policy, dict):
        dtypes = {k: getattr(torch, v) if isinstance(v, str) else v for k, v in policy.items()}
        return MixedPrecisionPolicy(**dtypes)
    raise ValueError(f"mixed_precision_policy must be a MixedPrecisionPolicy or a dict of its fields, got {policy!r}.")


# --- checkpoints ------------------------------------------------------------------------------------
def _options(**kw):
    return StateDictOptions(**kw)


def full_model_state_dict(model: nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict on rank 0, on the CPU; empty on the other ranks. Every rank must call it.

    ``trainable_only`` leaves out frozen parameters (a PEFT checkpoint holds the adapter only).
    """
    options = _options(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    state = get_model_state_dict(model, options=options)
    # Each key is gathered on its own, so tied parameters (an encoder/decoder layer pair sharing weights, the
    # embeddings and the LM head) come back as separate copies: point their names at one tensor again, so that
    # save_pretrained sees the tying and writes one copy under the name transformers expects, as without FSDP2.
    by_param: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(param), []).append(name)
    for names in by_param.values():
        held = [n for n in names if n in state]
        for name in held[1:]:
            state[name] = state[held[0]]
    return state


def load_full_model_state_dict(model: nn.Module, state: dict[str, torch.Tensor], strict: bool = False) -> None:
    """Load a full state dict (every rank holds it) into a sharded or plain model."""
    set_model_state_dict(model, state, options=_options(full_state_dict=True, strict=strict))


def _param_fqns(model: nn.Module, optimizer) -> list[list[str]]:
    """The name of every parameter of ``optimizer``, group by group, in its order."""
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [[names.get(id(p)) for p in group["params"]] for group in optimizer.param_groups]
    if any(n is None for g in groups for n in g):
        raise ValueError("the optimizer holds parameters that are not the model's; create it from the sharded model.")
    return groups


def full_optimizer_state_dict(model: nn.Module, optimizer) -> dict:
    """The optimizer's full state in ``torch.optim``'s own format (parameters by index), on rank 0; ``{}`` elsewhere.

    This is what a DDP or single-process run saves, so any run resumes it. Every rank must call it.
    """
    full = get_optimizer_state_dict(model, optimizer, options=_options(full_state_dict=True, cpu_offload=True))
    if not full:
        return {}
    index, counter = {}, 0
    for group in _param_fqns(model, optimizer):
        for fqn in group:
            index[fqn] = counter
            counter += 1
    groups = []
    for group in full["param_groups"]:
        groups.append({**group, "params": [index[fqn] for fqn in group["params"]]})
    return {"state": {index[fqn]: value for fqn, value in full["state"].items()}, "param_groups": groups}


def load_full_optimizer_state_dict(model: nn.Module, optimizer, state: dict) -> None:
    """Load an optimizer state in ``torch.optim``'s format (every rank holds it) into the optimizer of a sharded model."""
    fqns = _param_fqns(model, optimizer)
    if [len(g["params"]) for g in state["param_groups"]] != [len(g) for g in fqns]:
        raise ValueError(
            f"the checkpoint's optimizer has parameter groups of sizes {[len(g['params']) for g in state['param_groups']]}"
            f", this run's {[len(g) for g in fqns]}: it was saved for another model or another set of trainable "
            "parameters."
        )
    by_index = {i: fqn for g_state, g_fqns in zip(state["param_groups"], fqns) for i, fqn in zip(g_state["params"], g_fqns)}
    keyed = {
        "state": {by_index[i]: value for i, value in state["state"].items()},
        "param_groups": [{**g, "params": list(f)} for g, f in zip(state["param_groups"], fqns)],
    }
    set_optimizer_state_dict(model, optimizer, keyed, options=_options(full_state_dict=True))


def save_sharded_model(model: nn.Module, output_dir: str) -> None:
    """``output_dir/model_sharded/``: every rank writes its shards (``torch.distributed.checkpoint``)."""
    dcp.save(get_model_state_dict(model), checkpoint_id=os.path.join(output_dir, MODEL_SHARDED_DIR))


def save_sharded_optimizer(model: nn.Module, optimizer, output_dir: str) -> None:
    """``output_dir/optimizer_sharded/``, keyed by parameter name (so any layout can load it)."""
    dcp.save(get_optimizer_state_dict(model, optimizer), checkpoint_id=os.path.join(output_dir, OPTIMIZER_SHARDED_DIR))


def is_sharded_checkpoint(path: str) -> bool:
    return os.path.isdir(os.path.join(path, MODEL_SHARDED_DIR))


def load_sharded_model(model: nn.Module, checkpoint: str) -> None:
    """Load ``model_sharded/`` into ``model`` (sharded or plain, any world size: DCP reshards)."""
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=os.path.join(checkpoint, MODEL_SHARDED_DIR))
    set_model_state_dict(model, state)


def load_sharded_optimizer(model: nn.Module, optimizer, checkpoint: str) -> None:
    state = get_optimizer_state_dict(model, optimizer)
    dcp.load(state, checkpoint_id=os.path.join(checkpoint, OPTIMIZER_SHARDED_DIR))
    set_optimizer_state_dict(model, optimizer, state)


def load_full_checkpoint(model: nn.Module, checkpoint: str) -> None:
    """Load an ordinary transformers checkpoint (``model.safetensors``, its sharded index, or a PEFT adapter) into a
    sharded model; every rank reads the files."""
    def read(name):
        return load_file(os.path.join(checkpoint, name), device="cpu")

    if os.path.isfile(os.path.join(checkpoint, ADAPTER_SAFE_WEIGHTS_NAME)):
        adapter = getattr(model, "active_adapter", "default")
        load_full_model_state_dict(model, adapter_state_to_model_keys(read(ADAPTER_SAFE_WEIGHTS_NAME), model, adapter))
        return
    if os.path.isfile(os.path.join(checkpoint, SAFE_WEIGHTS_NAME)):
        state = read(SAFE_WEIGHTS_NAME)
    elif os.path.isfile(os.path.join(checkpoint, SAFE_WEIGHTS_INDEX_NAME)):
        with open(os.path.join(checkpoint, SAFE_WEIGHTS_INDEX_NAME)) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        state = {k: v for name in files for k, v in read(name).items()}
    else:
        raise ValueError(
            f"no model weights in {checkpoint}: expected {SAFE_WEIGHTS_NAME}, {SAFE_WEIGHTS_INDEX_NAME}, "
            f"{ADAPTER_SAFE_WEIGHTS_NAME} or a {MODEL_SHARDED_DIR}/ folder."
        )
    _check_covers_parameters(model, state, checkpoint)
    load_full_model_state_dict(model, state)


def _check_covers_parameters(model: nn.Module, state: dict, checkpoint: str) -> None:
    """Every parameter must be in the file, directly or through a tied parameter that is."""
    by_tensor: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(param), []).append(name)
    missing = [names[0] for names in by_tensor.values() if not any(n in state for n in names)]
    if missing:
        raise ValueError(f"{checkpoint} lacks {len(missing)} parameters of the model, e.g. {missing[:3]}.")


def adapter_state_to_model_keys(saved: dict[str, torch.Tensor], model: nn.Module, adapter: str) -> dict:
    """PEFT saves adapter weights without the adapter's name (``lora_A.weight``); the model calls them
    ``lora_A.<adapter>.weight``. Rename the saved keys to the model's."""
    renamed = {}
    for fqn in model.state_dict().keys():
        key = fqn.replace(f".{adapter}", "")
        if key in saved and key != fqn:
            renamed[fqn] = saved[key]
    missing = set(saved) - {k.replace(f".{adapter}", "") for k in renamed}
    if missing:
        raise ValueError(f"adapter weights {sorted(missing)[:4]} match no parameter of the model (adapter {adapter!r}).")
    return renamed
