"""FSDP2 units of DiffusionGemma: the tied encoder/decoder layer pairs, the vision tower, and the step as the root.

The trainer builds ``fully_shard``'s arguments (mesh, resharding, offload, mixed precision: ``hf_bdlm.trainer.fsdp``)
and asks the family for its units (:meth:`DiffusionGemmaFamily.shard_fsdp <.family.DiffusionGemmaFamily.shard_fsdp>`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from ....protocols.step import TrainingStep
from ..modeling import unwrap_diffusion_gemma


def shard_diffusion_gemma(model: nn.Module, fully_shard_kwargs: dict, plugin):
    """FSDP2 for transformers' DiffusionGemma (``model``: the model, or PEFT around it), in place.

    Units: encoder layer ``i`` and decoder layer ``i`` share their weights (``_tied_weights_keys``: the very same
    ``Parameter`` objects), so each pair is one unit, ``fully_shard([encoder_layer_i, decoder_layer_i])``; the frozen
    vision tower (with its embedder) is one unit, never called by the text objective and so never gathered; the root
    is a :class:`~hf_bdlm.protocols.step.TrainingStep` around the model, holding the rest (the embeddings, which the LM
    head and the decoder's self-conditioning read; the final norm, shared too; the self-conditioning block). The
    root's forward is the whole step, so its parameters are gathered once per step and used outside any module
    forward (LM head on the scored rows, soft embeddings); it is not resharded after forward (its backward needs them at once).

    A pair's two layers run at different times (the encoder, then the decoder once or twice), so each keeps the hooks
    of a one-module unit: gathered for each call and resharded after it, gathered again for each backward; the
    gradients of both uses reach the tied parameters before their reduce-scatter. (``fully_shard``'s hooks for a list
    of modules wait for all of them to run once and would reshard the pair after the decoder while the encoder's
    backward still needs it.) ``auto_wrap_policy: NO_WRAP`` shards the root only.

    Returns ``(step, unit names)``: ``step`` is what the trainer runs the objective through (``step(fn, ...)``).
    """
    kwargs = fully_shard_kwargs
    dg = unwrap_diffusion_gemma(model)
    encoder_layers, decoder_layers = dg.model.encoder.language_model.layers, dg.model.decoder.layers
    if len(encoder_layers) != len(decoder_layers):
        raise ValueError(f"DiffusionGemma with {len(encoder_layers)} encoder and {len(decoder_layers)} decoder layers: "
                         "FSDP2 pairs them one to one.")
    pair_classes = {type(encoder_layers[0]).__name__, type(decoder_layers[0]).__name__}
    if plugin.transformer_cls_names_to_wrap and not set(plugin.transformer_cls_names_to_wrap) <= pair_classes:
        raise ValueError(
            f"transformer_layer_cls_to_wrap={sorted(plugin.transformer_cls_names_to_wrap)}: DiffusionGemma's FSDP2 "
            f"units are its encoder/decoder layer pairs ({sorted(pair_classes)}, which share their weights); leave it "
            "unset, name those classes, or use auto_wrap_policy NO_WRAP (the root only)."
        )
    names = {id(m): n for n, m in model.named_modules()}
    units = []
    if plugin.auto_wrap_policy is not None:
        for enc, dec in zip(encoder_layers, decoder_layers):
            fully_shard([enc, dec], **kwargs)
            _hook_each_module(enc, dec)
            units.append(f"{names[id(enc)]} + {names[id(dec)]}")
        encoder = dg.model.encoder
        vision = [m for m in (getattr(encoder, "vision_tower", None), getattr(encoder, "embed_vision", None))
                  if m is not None]
        if vision:
            fully_shard(vision, **kwargs)
            units.append(" + ".join(names[id(m)] for m in vision))
    step = TrainingStep(model)
    # The root's inputs are the step's function, batch and layout, not activations: no cast to param_dtype.
    fully_shard(step, **{**kwargs, "reshard_after_forward": False,
                         "mp_policy": dataclasses.replace(kwargs["mp_policy"], cast_forward_inputs=False)})
    return step, units


def _hook_each_module(*modules: nn.Module) -> None:
    """Give a unit of several modules (``fully_shard([a, b])``) the hooks of a one-module unit on each module.

    ``fully_shard`` hooks a list of modules as one group forward: gathered at the first module's call, resharded and
    given its pre-backward hooks only once every module has run. DiffusionGemma's encoder layer runs long before its
    decoder layer, which may run twice (self-conditioning, the first time without gradient); the group would reshard
    the pair after the decoder's first call while the encoder's backward still needs its parameters, and gather them
    for no backward. With each module hooked as a one-module unit, every call gathers, reshards after it and registers
    its own pre-backward gather and post-backward reduce-scatter (autograd accumulates both layers' gradients of a
    tied parameter before they are reduced: one reduce-scatter per step).
    """
    # lazy: torch internals that move between versions: an unknown torch gets the error below
    from torch.autograd.graph import _MultiHandle
    from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state

    state = _get_module_fsdp_state(modules[0])
    group = getattr(state, "_pre_forward_hook_handle", None)
    if state is None or not isinstance(group, _MultiHandle) or not hasattr(state, "_pre_forward"):
        raise RuntimeError(
            f"this torch ({torch.__version__}) registers FSDP2's hooks for a list of modules in a way hf_bdlm does not "
            "know; the DiffusionGemma FSDP2 units are tested with torch 2.13."
        )
    group.remove()  # the group's pre- and post-forward hooks on every module
    handles = []
    for module in modules:
        handles.append(module.register_forward_pre_hook(state._pre_forward, prepend=True, with_kwargs=True))
        handles.append(module.register_forward_hook(state._post_forward, prepend=False))
    state._pre_forward_hook_handle = state._post_forward_hook_handle = _MultiHandle(tuple(handles))
