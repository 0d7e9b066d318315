"""Tensor parallelism under block parallelism: the backbone's own transformers plan, applied over the mesh's ``"tp"``.

transformers models declare how their layers split over tensor-parallel ranks (``base_model_tp_plan``: q/k/v and the
MLP's gate/up column-wise, o/down row-wise, the embedding by vocabulary, the head gathering its output), and
``from_pretrained(..., distributed_config=DistributedConfig(tp_size=T))`` applies it over a mesh transformers builds
for the whole world. Block parallelism needs the tensor-parallel group to be one dim of *its* mesh
(:meth:`ParallelDims.build_mesh <.dims.ParallelDims.build_mesh>`: ``tp`` innermost, a block-parallel group made of
the ranks of equal ``t``), so :func:`apply_tensor_parallel` applies the same plan, with transformers' own styles,
over that dim of a model already built or loaded.

Why it composes with every block-parallel mode: after the column-wise q/k/v a rank holds ``H/T`` query heads and
``Hkv/T`` K/V heads of *its* rows, and attention is independent per head. The sharded attention
(:mod:`.sharded`) therefore runs unchanged on the local heads, and its K/V exchange goes over the block-parallel group
of the rank's tensor-parallel index: every byte count of ``docs/design.md`` §3 is divided by ``T`` per rank. The
row-wise o/down all-reduce over the tensor-parallel group, as in any tensor-parallel run; the loss, computed from
gathered logits, is the same on the ``T`` ranks of a tensor-parallel group.

    torchrun --nproc_per_node 4 tests/distributed/tensor_parallel_worker.py --out /tmp/tp.json   # P=2 x T=2 == P=1
"""

from __future__ import annotations

import re

from torch import nn
from transformers import PretrainedConfig
from transformers.distributed.tensor_parallel import apply_tensor_parallelism

_LAYER_NUMBER = re.compile(r"\.\d+(?=\.|$)")


def _generic(name: str) -> str:
    """``backbone.model.layers.3.mlp`` -> ``backbone.model.layers.*.mlp`` (how transformers' plans name layers)."""
    return _LAYER_NUMBER.sub(".*", name)


def _shared_parameters(model: nn.Module) -> list[tuple[str, str, str]]:
    """``(module name, parameter name, owner's full name)`` of every parameter a module shares with an earlier one
    (a head tied to the embedding; an encoder-decoder's decoder layers tied to its encoder's)."""
    owners: dict[int, str] = {}
    shared = []
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            owner = owners.setdefault(id(param), full)
            if owner != full:
                shared.append((module_name, param_name, owner))
    return shared


# Styles acting on a parameter's gradient (an all-reduce hook): installed once per parameter, on its owner's module.
_GRADIENT_STYLES = {"replicated_with_grad_allreduce"}


def tensor_parallel_plan(model: nn.Module) -> dict[str, str]:
    """The model's transformers tensor-parallel plan expanded to its concrete names, parameters before modules.

    A shared parameter is split once, under its owner; a module using it takes its own plan entry, else its owner
    module's (so tied decoder projections split their inputs and outputs like the encoder's), and
    :func:`apply_tensor_parallel` points it at the split parameter afterwards.
    """
    plan = getattr(model, "tp_plan", None)
    if not plan:
        raise ValueError(
            f"{type(model).__name__} has no transformers tensor-parallel plan (its config's base_model_tp_plan is "
            "empty), so tensor_parallel_size > 1 cannot split it. Use tensor_parallel_size=1, or a backbone whose "
            "transformers config declares base_model_tp_plan (Llama, Qwen2/3, Gemma 3, Mistral, ...)."
        )
    owned = dict(model.named_parameters())
    borrowed = {module_name: owner.rpartition(".")[0] for module_name, _, owner in _shared_parameters(model)}
    expanded: dict[str, str] = {}
    for module_name, module in model.named_modules():
        style = plan.get(_generic(module_name))
        for param_name, _ in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            param_style = plan.get(_generic(full), style)
            if param_style is not None and full in owned:
                expanded[full] = param_style
        if style is None and module_name in borrowed:
            style = plan.get(_generic(borrowed[module_name]))
            style = None if style in _GRADIENT_STYLES else style
        if style is not None:
            expanded[module_name] = style
    return expanded


def _configs(config, path: str = "config"):
    """``config`` and every config nested in it (a backbone's, a text model's, a vision tower's), with their paths."""
    yield path, config
    for name, value in vars(config).items():
        if isinstance(value, PretrainedConfig):
            yield from _configs(value, f"{path}.{name}")


def _check_divisible(model: nn.Module, tp_size: int) -> None:
    """Every head count of every (sub-)config must divide by ``tp_size``: the plan splits q/k/v by output rows, so an
    indivisible count would cut a head in two and attend with half its dimensions."""
    for path, config in _configs(model.config):
        for field, heads in vars(config).items():
            if field.startswith("num_") and field.endswith("heads") and isinstance(heads, int) and heads % tp_size:
                raise ValueError(
                    f"tensor_parallel_size={tp_size} must divide {path}.{field}={heads}: each tensor-parallel rank "
                    f"attends with whole heads. Choose a tensor_parallel_size that divides {heads}."
                )


def apply_tensor_parallel(model: nn.Module, tp_mesh) -> nn.Module:
    """Split ``model`` over the 1-D ``tp_mesh`` with its transformers plan (in place; returns ``model``).

    Every rank of ``tp_mesh`` must hold the same weights (each keeps its own slice; nothing is broadcast). Parameters
    the plan splits become ``DTensor`` s on ``tp_mesh``; replicated ones (norms) stay plain tensors, their gradients
    equal on every tensor-parallel rank. Heads must divide by the mesh size. Tied parameters stay tied.
    """
    size = tp_mesh.size()
    if size == 1:
        return model
    _check_divisible(model, size)
    shared = _shared_parameters(model)
    apply_tensor_parallelism(model, tp_mesh, tensor_parallel_plan(model))
    # Splitting replaced each owner's Parameter: the modules sharing it must point at the split one.
    params, modules = dict(model.named_parameters()), dict(model.named_modules())
    for module_name, param_name, owner in shared:
        modules[module_name]._parameters[param_name] = params[owner]
    return model
