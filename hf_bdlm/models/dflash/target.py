"""What a drafter needs of its target, and of a drafter folder, without the target itself: the target's frozen
input embedding, LM head and final norm read alone from its weights files (:func:`load_target_heads`; training from
captured features never loads the whole target; :func:`load_target` does, for a capture or a new drafter), the
drafter class a config names, and the drafter inside wrappers.

    heads = load_target_heads("embedded:smollm2")                              # embedding + head only
    drafter = DFlash2DraftModel.from_pretrained("runs/drafter").bind_target(heads)
"""

from __future__ import annotations

import json
import logging

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.utils import cached_file

from . import modeling
from ...embedded import resolve_model_path

logger = logging.getLogger(__name__)


class TargetHeads(nn.Module):
    """The parts of a target causal LM a drafter uses in training: its input embedding and LM head (frozen), and its
    final norm (for a KL objective's teacher). Binds to a drafter like the target itself
    (``drafter.bind_target(heads)``).

    Attributes:
        embed_tokens (`nn.Embedding`), lm_head (`nn.Linear`), norm (`nn.Module` or `None`).
        config (`PretrainedConfig`): the target's config (its text config for a multimodal target).
        source (`str`): where the weights were read.
    """

    def __init__(self, embed_tokens: nn.Embedding, lm_head: nn.Linear, norm: nn.Module | None, config,
                 source: str = ""):
        super().__init__()
        self.embed_tokens, self.lm_head, self.norm = embed_tokens, lm_head, norm
        self.config, self.source = config, source
        self.requires_grad_(False)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def teacher_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The target's logits of its last decoder layer's output before the final norm (a capture's teacher
        state)."""
        if self.norm is None:
            raise ValueError("these target heads were read without the final norm; load them with with_norm=True "
                             "(the KL objective's teacher needs it).")
        return self.lm_head(self.norm(hidden_states.to(self.lm_head.weight.dtype)))


def resolve_target_path(name: str) -> str:
    """``embedded:smollm2`` -> the exported SmolLM2 folder; a folder or a Hub id as it is."""
    return resolve_model_path(name)


def load_target(name: str, revision: str | None = None, dtype: str | None = None, device: str | None = None):
    """The whole target causal LM (``name`` as :func:`resolve_target_path` reads it), frozen, in eval mode, on
    ``device`` (default: cuda when available, else cpu); ``dtype`` by name (default: its own)."""
    kwargs = {"revision": revision} if revision else {}
    if dtype:
        kwargs["dtype"] = getattr(torch, dtype)
    target = AutoModelForCausalLM.from_pretrained(resolve_target_path(name), **kwargs)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return target.to(device).eval().requires_grad_(False)


def load_target_heads(name_or_path: str, *, revision: str | None = None, dtype: torch.dtype | None = None,
                      with_norm: bool = False) -> TargetHeads:
    """Read a target's input embedding and LM head (and, ``with_norm``, its final norm) from its weights files alone.

    The target is built on the meta device to learn the names of those modules; only their tensors are read from
    the (possibly sharded) safetensors files. A tied head is the embedding. A checkpoint whose tensor names differ
    from its modules' (an older layout transformers renames on load) is loaded whole instead, with a warning.

    Args:
        name_or_path (`str`): a folder, a Hub id or ``embedded:smollm2``.
        revision (`str`, *optional*): the Hub revision.
        dtype (`torch.dtype`, *optional*): the dtype to hold them in (default: as stored).
        with_norm (`bool`, defaults to `False`): also read the final norm (the KL objective's teacher).

    Returns:
        [`TargetHeads`].
    """

    path = resolve_target_path(name_or_path)
    config = AutoConfig.from_pretrained(path, revision=revision)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    names = {id(module): name for name, module in skeleton.named_modules()}
    embed, head = skeleton.get_input_embeddings(), skeleton.get_output_embeddings()
    norm = getattr(decoder_of(skeleton)[0], "norm", None) if with_norm else None
    if with_norm and not isinstance(norm, nn.Module):
        raise ValueError(f"{name_or_path}: the target has no final norm (`get_decoder().norm`) to read.")
    wanted = {"embed": names[id(embed)], "head": names[id(head)]}
    if norm is not None:
        wanted["norm"] = names[id(norm)]
    tensors = _read_tensors(path, revision, [f"{prefix}.{p}" for prefix in wanted.values()
                                             for p in ("weight", "bias")])
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    embed_weight = tensors.get(f"{wanted['embed']}.weight")
    head_weight = tensors.get(f"{wanted['head']}.weight")
    if head_weight is None and getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)):
        head_weight = embed_weight
    if embed_weight is None or head_weight is None or (norm is not None and f"{wanted['norm']}.weight" not in tensors):
        logger.warning("%s: the embedding / head tensors are not stored under their module names; loading the whole "
                       "target to read them.", name_or_path)
        full = AutoModelForCausalLM.from_pretrained(path, revision=revision, dtype=dtype)
        norm_module = getattr(decoder_of(full)[0], "norm", None) if with_norm else None
        return TargetHeads(full.get_input_embeddings(), full.get_output_embeddings(), norm_module, text, path)
    dtype = dtype or embed_weight.dtype
    embedding = nn.Embedding(*embed_weight.shape, dtype=dtype)
    embedding.weight.data.copy_(embed_weight)
    head_bias = tensors.get(f"{wanted['head']}.bias")
    lm_head = nn.Linear(head_weight.shape[1], head_weight.shape[0], bias=head_bias is not None, dtype=dtype)
    lm_head.weight.data.copy_(head_weight)
    if head_bias is not None:
        lm_head.bias.data.copy_(head_bias)
    if norm is not None:
        norm = norm.to_empty(device="cpu").to(dtype)
        norm.load_state_dict({k.split(".")[-1]: v for k, v in tensors.items() if k.startswith(wanted["norm"] + ".")})
    return TargetHeads(embedding, lm_head, norm, text, path)


def _read_tensors(path: str, revision: str | None, keys: list[str]) -> dict[str, torch.Tensor]:
    """The tensors named ``keys`` that the checkpoint holds, read from its safetensors file(s) alone."""
    def fetch(filename: str) -> str | None:
        return cached_file(path, filename, revision=revision, _raise_exceptions_for_missing_entries=False)

    index = fetch("model.safetensors.index.json")
    if index is not None:
        weight_map = json.loads(open(index, encoding="utf-8").read())["weight_map"]
        files: dict[str, list[str]] = {}
        for key in keys:
            if key in weight_map:
                files.setdefault(weight_map[key], []).append(key)
    else:
        files = {"model.safetensors": keys}
    found = {}
    for filename, names in files.items():
        local = fetch(filename)
        if local is None:
            raise FileNotFoundError(f"{path} holds no {filename}: the target's weights must be safetensors files.")
        with safe_open(local, framework="pt") as f:
            present = set(f.keys())
            found.update({name: f.get_tensor(name) for name in names if name in present})
    return found


def drafter_class(config):
    """`DFlash2DraftModel` or `DFlashDraftModel`, as a drafter config (or its ``architectures``) names."""
    architectures = list(getattr(config, "architectures", None) or [])
    name = architectures[0] if architectures else ("DFlash2DraftModel" if getattr(config, "is_dflash2", False)
                                                   else "DFlashDraftModel")
    if name not in ("DFlashDraftModel", "DFlash2DraftModel"):
        raise ValueError(f"config.architectures names {name!r}; a DFlash drafter is a 'DFlash2DraftModel' or a "
                         "'DFlashDraftModel'.")
    return getattr(modeling, name)


def decoder_of(target):
    """The decoder stack to run (a causal LM's base model: no LM head, no logits) and the text config."""
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else target
    if decoder is None or not hasattr(decoder, "get_input_embeddings"):
        raise TypeError(f"the target must be a transformers causal LM (or its decoder), got {type(target).__name__}.")
    config = getattr(decoder, "config", None) or target.config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return decoder, config
