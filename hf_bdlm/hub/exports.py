"""What every family's export for a serving engine shares: the model id the engine is told to load, the tensors of a
Qwen3 decoder layer (the layer SDAR models and speculative drafters are made of), and writing the exported folder so
that it is either complete or absent.

    from hf_bdlm.hub.exports import serving_model_id, write_folder
    serving_model_id("embedded:smollm2")          # 'HuggingFaceTB/SmolLM2-135M-Instruct': what `vllm serve` loads
    write_folder("out/export", build, check=check_folder, overwrite=False)
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

# hf_bdlm's aliases of models shipped offline, and the Hub model each one is an export of. A serving engine has never
# heard of the alias: a printed launch command names the Hub model.
EMBEDDED_HUB_IDS = {"embedded:smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def serving_model_id(name: str) -> str:
    """The model id a serving engine loads for ``name``: the Hub id of an embedded model's alias, else ``name`` (a Hub
    id or a folder) as it is."""
    return EMBEDDED_HUB_IDS.get(name, name)


def revision_flag(revision: str | None) -> str:
    """`` --revision REV`` for a launch command (vLLM's and SGLang's flag alike), or nothing."""
    return f" --revision {revision}" if revision else ""


def qwen3_layer_shapes(prefix: str, *, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int,
                       attention_bias: bool = False, mlp_bias: bool = False) -> dict[str, tuple[int, ...]]:
    """The tensors (name -> shape) of one Qwen3 decoder layer under transformers' names, each prefixed by ``prefix``
    (e.g. ``"model.layers.3."``): what the engines' Qwen3-layer loaders expect, no more."""
    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    shapes = {
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q_width, hidden),
        "self_attn.k_proj.weight": (kv_width, hidden),
        "self_attn.v_proj.weight": (kv_width, hidden),
        "self_attn.o_proj.weight": (hidden, q_width),
        "self_attn.q_norm.weight": (head_dim,),
        "self_attn.k_norm.weight": (head_dim,),
        "mlp.gate_proj.weight": (intermediate, hidden),
        "mlp.up_proj.weight": (intermediate, hidden),
        "mlp.down_proj.weight": (hidden, intermediate),
    }
    if attention_bias:
        shapes.update({"self_attn.q_proj.bias": (q_width,), "self_attn.k_proj.bias": (kv_width,),
                       "self_attn.v_proj.bias": (kv_width,), "self_attn.o_proj.bias": (hidden,)})
    if mlp_bias:
        shapes.update({"mlp.gate_proj.bias": (intermediate,), "mlp.up_proj.bias": (intermediate,),
                       "mlp.down_proj.bias": (hidden,)})
    return {prefix + name: shape for name, shape in shapes.items()}


def write_folder(destination: str | os.PathLike, build: Callable[[Path], None],
                 check: Callable[[Path], object] | None = None, overwrite: bool = False) -> Path:
    r"""
    Write a folder through a staging directory beside it: ``build(staging)`` fills it, ``check(staging)`` (which
    raises on a broken folder) checks it, and only then is it renamed to ``destination``. An interrupted or refused
    export leaves ``destination`` as it was.

    Args:
        destination (`str` or `os.PathLike`): the folder to write.
        build (`Callable[[Path], None]`): writes every file into the staging folder it is given.
        check (`Callable[[Path], object]`, *optional*): raises if the staged folder breaks its contract.
        overwrite (`bool`, defaults to `False`): replace an existing ``destination``; otherwise it is an error.

    Returns:
        `Path` of ``destination``.

    Raises:
        FileExistsError: ``destination`` exists and ``overwrite`` is false.
    """
    destination = Path(destination)
    if destination.exists() and not overwrite:
        raise FileExistsError(f"{destination} exists; choose a new folder or pass overwrite=True "
                              "(`--overwrite`) to replace it.")
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.export-", dir=destination.parent))
    try:
        build(staging)
        if check is not None:
            check(staging)
        if destination.exists():
            old = destination.with_name(f".{destination.name}.replaced")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(destination, old)
            os.replace(staging, destination)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, destination)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return destination


__all__ = ["EMBEDDED_HUB_IDS", "qwen3_layer_shapes", "revision_flag", "serving_model_id", "write_folder"]
