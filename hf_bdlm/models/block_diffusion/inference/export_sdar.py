"""Export a block-diffusion Qwen3 as an SDAR folder, the block-diffusion checkpoint SGLang and LMDeploy serve.

SGLang (``--dllm-algorithm LowConfidence``) and LMDeploy (PyTorch engine, ``--dllm-block-length``) serve dense
block-diffusion models of one kind: SDAR, a Qwen3 decoder checkpoint with ``architectures: ["SDARForCausalLM"]``,
``model_type: "sdar"`` and ``[MASK]`` at id 151669, decoded block by block with no token shift. Of this project's
models exactly those trained with the ``standard`` objective and a ``block_causal`` clean stream on a Qwen3 backbone
compute what they compute (docs/deploy.md). The exported folder holds

- ``model.safetensors`` (or shards and their index): the Qwen3 tensors under their transformers names, no wrapper
  prefix, ``lm_head.weight`` only when the head is its own tensor;
- ``config.json``: every field the engines read, explicit, ``rope_theta`` included; ``auto_map`` names
  ``configuration_sdar.SDARConfig``, shipped beside it;
- ``generation_config.json``: the special tokens, and greedy decoding (LMDeploy's API server always samples);
- the tokenizer, with ``[MASK]`` as id 151669;
- ``sglang_dllm.yaml``: SGLang's algorithm config (the block size and threshold);
- ``README.md``: the model card with both launch commands.

The ``[MASK]`` logit: the ``standard`` objective leaves it out of its softmax, so training never lowers it, while both
engines take the argmax and softmax over the whole vocabulary. By default the export gives the head a ``[MASK]`` row
of zeros (a copy of the embedding when the head is tied to it): the ``[MASK]`` logit is then exactly 0 whatever the
input, and every other logit is exactly the model's (``mask_logit="zero"``).

    from hf_bdlm import export_sdar
    export_sdar(model, "out/sdar", tokenizer)                  # a standard-objective Qwen3 BDLM
    # hf-bdlm export --format sdar out/bdlm out/sdar [--push-to-hub me/model-sdar]
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import yaml
from huggingface_hub import ModelCardData, save_torch_state_dict
from safetensors import safe_open
from transformers import AutoConfig, AutoModel, AutoTokenizer

from ....hub.exports import qwen3_layer_shapes, write_folder
from ....hub.upload import push_folder_to_hub
from ....protocols.card_parts import hub_repo_id, parameters_text, render_card_template
from ....protocols.registry import entry_for_model_type
from ..modeling import BlockDiffusionForMaskedLM

SDAR_MASK_TOKEN_ID = 151669
ARCHITECTURE = "SDARForCausalLM"
CONFIG_MODULE = "configuration_sdar.py"
SGLANG_CONFIG = "sglang_dllm.yaml"
CARD = "README.md"
TEMPLATE_FILE = "model_card_sdar.md"
MASK_LOGIT_MODES = ("zero", "keep")
DEFAULT_THRESHOLD = 0.9  # hf_bdlm's own decoding default (BlockDiffusionGenerationConfig)
# Where each engine hard-codes the SDAR contract (read in the released sources; docs/deploy.md cites the lines).
ENGINE_PATHS = (
    "SGLang's --dllm-algorithm serves a fixed list of architectures (sglang/srt/dllm/config.py, DLLM_PARAMS) and "
    "LMDeploy's --dllm-block-length the model types 'sdar' / 'sdar_moe' (lmdeploy/pytorch/configurations/sdar.py); "
    "of those, a dense converted model can only be SDARForCausalLM"
)
SERVE_HERE = "`hf-bdlm serve DIR` serves it as it is (an OpenAI-compatible API)"


class SDARExportError(ValueError):
    """A model or folder that SGLang and LMDeploy would not serve as SDAR; the message lists every reason."""


# --- what can be served -----------------------------------------------------------------------------------------------
def sdar_problems(config) -> list[str]:
    """Every reason the model of ``config`` (a `BlockDiffusionConfig`) cannot be served as SDAR, each with what to do.

    An empty list: the engines compute what the model computes (the checks of docs/deploy.md)."""
    problems = []
    objective = getattr(config, "objective", None)
    if objective != "standard":
        problems.append(
            f"objective={objective!r}: the logit at position i predicts token i+1 (token shift), while the engines "
            "read it as token i, so they would emit every token one place early; no weight transform fixes that. "
            f"{SERVE_HERE}; to serve it in SGLang or LMDeploy, fine-tune it with objective='standard' first")
    elif getattr(config, "clean_attention", None) != "block_causal":
        problems.append(
            f"clean_attention={config.clean_attention!r}: the engines compute the clean prefix block-causally (a "
            "clean token sees its whole block), this model token-causally. "
            f"{SERVE_HERE}; for the engines train with clean_attention='block_causal'")
    backbone = getattr(config, "backbone_config", None)
    model_type = getattr(backbone, "model_type", None)
    if model_type != "qwen3":
        problems.append(
            f"the backbone is {model_type!r}, and SDAR is a Qwen3 decoder: {ENGINE_PATHS}. {SERVE_HERE}")
        return problems
    vocab = backbone.vocab_size
    mask = getattr(config, "mask_token_id", None)
    if mask != SDAR_MASK_TOKEN_ID:
        problems.append(
            f"mask_token_id={mask}: both engines hard-code [MASK] = {SDAR_MASK_TOKEN_ID} (Qwen3's first unused id). "
            "Convert the Qwen3 checkpoint with its own tokenizer (`hf-bdlm convert QWEN3_DIR OUT --objective "
            f"standard` puts [MASK] there without resizing); {SERVE_HERE}")
    if vocab <= SDAR_MASK_TOKEN_ID:
        problems.append(f"vocab_size={vocab} has no row {SDAR_MASK_TOKEN_ID} for [MASK]")
    if getattr(backbone, "use_sliding_window", False) or any(
            kind != "full_attention" for kind in (getattr(backbone, "layer_types", None) or ())):
        problems.append("the backbone has sliding-window layers, which the engines' SDAR layers do not apply; "
                        f"{SERVE_HERE}")
    rope = _rope_parameters(backbone)
    if rope.get("rope_type", "default") != "default":
        problems.append(f"RoPE scaling {rope.get('rope_type')!r}: SDAR export writes plain RoPE only; {SERVE_HERE}")
    if getattr(backbone, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={backbone.hidden_act!r}: the engines' SDAR MLP is SiLU-gated; {SERVE_HERE}")
    return problems


def check_servable_as_sdar(model) -> None:
    """Raise `SDARExportError` naming every reason ``model`` cannot be served as SDAR (see :func:`sdar_problems`)."""
    if not isinstance(model, BlockDiffusionForMaskedLM):
        raise SDARExportError(
            f"{type(model).__name__} is not a converted block-diffusion model: the SDAR export takes a "
            "BlockDiffusionForMaskedLM. docs/deploy.md says which engine serves each family's models.")
    problems = sdar_problems(model.config)
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        problems.append("the LM head has a bias, which the engines' SDAR head does not have")
    if problems:
        raise SDARExportError("this model cannot be served as SDAR by SGLang or LMDeploy: " + "; ".join(problems)
                              + ".")


# --- the folder's contents ----------------------------------------------------------------------------------------------
def _rope_parameters(backbone) -> dict:
    parameters = getattr(backbone, "rope_parameters", None)  # transformers 5
    if parameters:
        return dict(parameters)
    return {"rope_type": "default", "rope_theta": getattr(backbone, "rope_theta", 10000.0)}


def _first(value):
    return value[0] if isinstance(value, (list, tuple)) else value


def special_token_ids(model, tokenizer) -> dict[str, Any]:
    """``bos``, ``eos`` (int: config.json's) and ``pad`` ids, and the list of end ids (generation_config.json's)."""
    backbone = model.config.backbone_config
    generation = getattr(model, "generation_config", None)

    def pick(name):
        for source in (generation, backbone):
            value = getattr(source, name, None)
            if value is not None:
                return value
        return getattr(tokenizer, name, None)

    eos = pick("eos_token_id")
    ends = [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None]
    bos, pad = pick("bos_token_id"), pick("pad_token_id")
    return {"bos": None if bos is None else int(_first(bos)), "eos": ends[0] if ends else None,
            "pad": int(_first(pad)) if pad is not None else (ends[0] if ends else None), "ends": ends}


def sdar_config(model, tokens: dict, *, tied: bool, dtype: torch.dtype) -> dict:
    """``config.json`` of the export: every field SGLang's and LMDeploy's SDAR paths read, explicit (``tokens``:
    :func:`special_token_ids`)."""
    backbone = model.config.backbone_config
    hidden, heads = backbone.hidden_size, backbone.num_attention_heads
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "sdar",
        "auto_map": {"AutoConfig": "configuration_sdar.SDARConfig"},
        "vocab_size": backbone.vocab_size,
        "hidden_size": hidden,
        "intermediate_size": backbone.intermediate_size,
        "num_hidden_layers": backbone.num_hidden_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(backbone, "num_key_value_heads", None) or heads,
        "head_dim": getattr(backbone, "head_dim", None) or hidden // heads,
        "hidden_act": "silu",
        "rms_norm_eps": backbone.rms_norm_eps,
        "max_position_embeddings": backbone.max_position_embeddings,
        "initializer_range": getattr(backbone, "initializer_range", 0.02),
        # A key of its own: SGLang reads config.rope_theta (10000 when absent). No `rope_scaling` key: transformers 5
        # turns one into `rope_parameters`, which LMDeploy then reads instead; absent, both read plain RoPE.
        "rope_theta": float(_rope_parameters(backbone)["rope_theta"]),
        "attention_bias": bool(getattr(backbone, "attention_bias", False)),
        "attention_dropout": 0.0,
        # LMDeploy reads sliding_window without a default and applies any number it finds.
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": backbone.num_hidden_layers,
        "tie_word_embeddings": tied,
        "use_cache": True,
        "bos_token_id": tokens["bos"],
        "eos_token_id": tokens["eos"],
        "pad_token_id": tokens["pad"],
        "torch_dtype": str(dtype).removeprefix("torch."),
        # Informational (no engine reads them): what the model was trained with.
        "block_size": model.config.block_size,
        "mask_token_id": SDAR_MASK_TOKEN_ID,
    }


def zero_mask_logit(model):
    r"""
    Give ``model``'s head a ``[MASK]`` row (``model.config.mask_token_id``) of zeros, in place (untying it from the input embedding first if they are
    one tensor), and return the model: the model the export with ``mask_logit="zero"`` writes, for decoding here
    what the engines serve (``generate(..., unmasking="sglang_low_confidence")``).

    The head has no bias, so logit ``j`` is ``h . W[j]`` and depends on row ``j`` alone: the ``[MASK]`` logit becomes
    exactly 0 for every input and every other logit is unchanged.
    """
    backbone = model.backbone
    head = backbone.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise SDARExportError("the LM head has a bias: zeroing the [MASK] row would not zero the [MASK] logit.")
    with torch.no_grad():
        weight = head.weight.detach().clone()
        weight[model.config.mask_token_id] = 0
    head.weight = torch.nn.Parameter(weight, requires_grad=head.weight.requires_grad)
    # Untied for good: transformers re-ties on load and save when the config says so.
    backbone.config.tie_word_embeddings = False
    model.config.tie_word_embeddings = False
    return model


def sdar_weights(model, *, mask_logit: str = "zero", dtype: torch.dtype | None = None) -> tuple[dict, bool]:
    r"""
    The export's tensors under their Qwen3 names, and whether the head stays tied to the embedding.

    ``mask_logit="zero"`` writes the head of :func:`zero_mask_logit` (the model is not changed); ``"keep"`` writes it
    as trained.
    """
    if mask_logit not in MASK_LOGIT_MODES:
        raise ValueError(f"mask_logit must be one of {MASK_LOGIT_MODES}, got {mask_logit!r}.")
    backbone = model.backbone
    head = backbone.get_output_embeddings().weight
    tied = head is backbone.get_input_embeddings().weight and mask_logit == "keep"
    state = {name: tensor for name, tensor in backbone.state_dict().items() if name != "lm_head.weight"}
    if not tied:
        head = head.detach().clone()
        if mask_logit == "zero":
            head[SDAR_MASK_TOKEN_ID] = 0  # as zero_mask_logit does
        state["lm_head.weight"] = head
    out = {}
    for name, tensor in state.items():
        tensor = tensor.detach().to("cpu")
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        out[name] = tensor.contiguous()
    return out, tied


def sdar_tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The tensors (name -> shape) an SDAR folder with this ``config.json`` must hold, exactly: LMDeploy's loader
    fails on any other name, SGLang's on a wrapper prefix."""
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(config["num_hidden_layers"]):
        shapes.update(qwen3_layer_shapes(f"model.layers.{i}.", hidden=hidden, intermediate=inter, heads=heads,
                                         kv_heads=kv_heads, head_dim=head_dim,
                                         attention_bias=config["attention_bias"]))
    return shapes


def generation_config(tokens: dict) -> dict:
    # LMDeploy's API server always samples (lmdeploy/serve/core/generation_config.py, build_generation_config), with
    # this file's values as defaults: top_k 1 at temperature 1 makes that the argmax, scored by the plain softmax, as
    # SGLang's LowConfidence decodes. A request may still set its own.
    return {"bos_token_id": tokens["bos"], "eos_token_id": tokens["ends"], "pad_token_id": tokens["pad"],
            "do_sample": True, "top_k": 1, "top_p": 1.0, "temperature": 1.0}


def launch_commands(model_ref: str, block_size: int, threshold: float, yaml_ref: str | None = None) -> dict[str, str]:
    r"""
    The launch commands of an exported folder (``model_ref``: its path or Hub repo id): SGLang's (``yaml_ref``: its
    algorithm config file; `None` writes the file first, for a Hub repo) and LMDeploy's. Both engines take the block
    size from these flags, never from the checkpoint, and fall back to 4 without them.
    """
    yaml_text = sglang_yaml(block_size, threshold)
    if yaml_ref is None:
        printf = yaml_text.replace("\n", "\\n")
        prefix, yaml_ref = f"printf '{printf}' > {SGLANG_CONFIG}\n", SGLANG_CONFIG
    else:
        prefix = ""
    return {
        "sglang": f"{prefix}python -m sglang.launch_server --model-path {model_ref} --trust-remote-code "
                  f"--dllm-algorithm LowConfidence --dllm-algorithm-config {yaml_ref}",
        "lmdeploy": f"lmdeploy serve api_server {model_ref} --backend pytorch --trust-remote-code "
                    f"--dllm-block-length {block_size} --dllm-unmasking-strategy low_confidence_dynamic "
                    f"--dllm-confidence-threshold {threshold}",
    }


def sglang_yaml(block_size: int, threshold: float) -> str:
    """SGLang's ``--dllm-algorithm-config`` for LowConfidence: the block size (else SDAR's 4) and the threshold."""
    return f"block_size: {block_size}\nthreshold: {threshold}\n"


# --- export -------------------------------------------------------------------------------------------------------------
def export_sdar(
    model,
    out_dir: str | os.PathLike,
    tokenizer,
    *,
    confidence_threshold: float | None = None,
    mask_logit: str = "zero",
    dtype: torch.dtype | None = None,
    repo_id: str | None = None,
    overwrite: bool = False,
) -> Path:
    r"""
    Write the SDAR folder SGLang and LMDeploy serve for ``model`` (see the module docstring), checked with
    :func:`check_sdar_folder` before it appears: ``out_dir`` is either the complete export or untouched.

    Args:
        model ([`BlockDiffusionForMaskedLM`]):
            A Qwen3 block-diffusion model trained with `objective="standard"` and `clean_attention="block_causal"`,
            `[MASK]` = 151669 (anything else is refused, naming what serves it).
        out_dir (`str` or `os.PathLike`):
            The folder to write.
        tokenizer:
            The model's tokenizer; id 151669 becomes its `mask_token` (a copy is saved; the object is not changed).
        confidence_threshold (`float`, *optional*):
            The threshold written into the launch commands (SGLang's YAML, LMDeploy's flag). Defaults to the model's
            generation config's (else 0.9).
        mask_logit (`str`, defaults to `"zero"`):
            `"zero"`: the head's `[MASK]` row is zero (the head untied from the embedding if needed), so the engines'
            argmax over the whole vocabulary never meets an untrained `[MASK]` logit; `"keep"`: the head as trained.
        dtype (`torch.dtype`, *optional*):
            Cast the weights (e.g. `torch.bfloat16` for serving); default: as they are.
        repo_id (`str`, *optional*):
            The Hub repo the folder will be uploaded to (the card's commands name it; default: the folder).
        overwrite (`bool`, defaults to `False`):
            Replace an existing `out_dir`.

    Returns:
        `Path` of the folder.
    """
    check_servable_as_sdar(model)
    tokenizer = _mask_tokenizer(tokenizer, model.config.backbone_config.vocab_size)
    if confidence_threshold is None:
        confidence_threshold = getattr(getattr(model, "generation_config", None), "confidence_threshold", None)
        confidence_threshold = DEFAULT_THRESHOLD if confidence_threshold is None else confidence_threshold
    if not 0.0 < float(confidence_threshold) <= 1.0:
        raise ValueError(f"confidence_threshold must lie in (0, 1], got {confidence_threshold!r}.")
    confidence_threshold = float(confidence_threshold)
    weights, tied = sdar_weights(model, mask_logit=mask_logit, dtype=dtype)
    dtype = dtype or next(iter(weights.values())).dtype
    tokens = special_token_ids(model, tokenizer)
    config = sdar_config(model, tokens, tied=tied, dtype=dtype)
    destination = Path(out_dir)
    block_size = model.config.block_size

    def build(staging: Path) -> None:
        save_torch_state_dict(weights, staging, max_shard_size="5GB", metadata={"format": "pt"})
        _write_json(staging / "config.json", config)
        _write_json(staging / "generation_config.json", generation_config(tokens))
        shutil.copyfile(Path(__file__).with_name(CONFIG_MODULE), staging / CONFIG_MODULE)
        tokenizer.save_pretrained(staging)
        (staging / SGLANG_CONFIG).write_text(sglang_yaml(block_size, confidence_threshold), encoding="utf-8")
        (staging / CARD).write_text(render_card(
            staging, model_ref=repo_id or str(destination), model_name=destination.resolve().name,
            source=str(getattr(model, "name_or_path", "") or ""), mask_logit=mask_logit,
            confidence_threshold=confidence_threshold, local=repo_id is None), encoding="utf-8")

    return write_folder(destination, build, check=check_sdar_folder, overwrite=overwrite)


def _mask_tokenizer(tokenizer, vocab_size: int):
    if tokenizer is None:
        raise ValueError("export_sdar needs the model's tokenizer: the engines load it from the exported folder.")
    if len(tokenizer) > vocab_size:
        raise SDARExportError(f"the tokenizer has {len(tokenizer)} tokens but the model only {vocab_size} rows: they "
                              "do not belong together.")
    if len(tokenizer) <= SDAR_MASK_TOKEN_ID:
        raise SDARExportError(f"the tokenizer has no id {SDAR_MASK_TOKEN_ID} ({len(tokenizer)} tokens): pass the "
                              "tokenizer the model was converted with (its [MASK] token is id 151669).")
    token = tokenizer.convert_ids_to_tokens(SDAR_MASK_TOKEN_ID)
    if tokenizer.mask_token_id not in (None, SDAR_MASK_TOKEN_ID):
        raise SDARExportError(f"the tokenizer's mask token is id {tokenizer.mask_token_id}, the engines' "
                              f"{SDAR_MASK_TOKEN_ID}: pass the tokenizer the model was converted with.")
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.mask_token = token
    return tokenizer


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# --- checking a folder --------------------------------------------------------------------------------------------------
REQUIRED_CONFIG = {
    "architectures": [ARCHITECTURE], "model_type": "sdar", "auto_map": {"AutoConfig": "configuration_sdar.SDARConfig"},
    "hidden_act": "silu", "use_sliding_window": False, "sliding_window": None,
}
# Fields the engines read, each must be present (values checked against the tensors): SGLang srt/models/sdar.py
# (SDARAttention, SDARModel, SDARForCausalLM), LMDeploy pytorch/models/sdar.py and pytorch/configurations/default.py.
READ_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "rope_theta",
               "attention_bias", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")


def check_sdar_folder(folder: str | os.PathLike) -> dict[str, Any]:
    r"""
    Check an exported folder against what SGLang and LMDeploy read: ``config.json``'s fields, the exact tensor names
    and shapes, the ``[MASK]`` token of the tokenizer, the algorithm config, and (when the head is its own tensor)
    which ``[MASK]`` row it carries.

    Returns:
        `dict` with ``path``, ``block_size``, ``threshold``, ``tensor_count``, ``parameters``, ``tied`` and
        ``mask_row_zero`` (whether the head's `[MASK]` row is all zeros).

    Raises:
        SDARExportError: naming every broken field, missing / extra / mis-shaped tensor.
    """
    root = Path(folder)
    problems = []
    config = json.loads((root / "config.json").read_text(encoding="utf-8"))
    for key, value in REQUIRED_CONFIG.items():
        if config.get(key, "<absent>") != value:
            problems.append(f"config.json {key}={config.get(key, '<absent>')!r} (expected {value!r})")
    missing = [key for key in READ_FIELDS if config.get(key) is None]
    if missing:
        problems.append(f"config.json lacks {missing}")
        raise SDARExportError(f"{root} is not an SDAR folder: " + "; ".join(problems) + ".")
    if "rope_scaling" in config or "rope_parameters" in config:
        problems.append("config.json carries a rope_scaling / rope_parameters key (plain RoPE from rope_theta only)")
    if not (root / CONFIG_MODULE).is_file():
        problems.append(f"{CONFIG_MODULE} (the auto_map's config class) is missing")
    files = sorted(root.glob("*.safetensors"))
    observed, mask_row = {}, None
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                observed[name] = tuple(f.get_slice(name).get_shape())
                if name == "lm_head.weight":
                    mask_row = f.get_slice(name)[SDAR_MASK_TOKEN_ID:SDAR_MASK_TOKEN_ID + 1]
    expected = sdar_tensor_shapes(config)
    extra = sorted(observed.keys() - expected.keys())
    absent = sorted(expected.keys() - observed.keys())
    wrong = sorted(f"{n} {list(observed[n])} (expected {list(expected[n])})"
                   for n in expected.keys() & observed.keys() if observed[n] != expected[n])
    for label, names in (("unexpected tensors", extra), ("missing tensors", absent), ("mis-shaped tensors", wrong)):
        if names:
            problems.append(f"{label} {names}")
    # The folder's own config class (written by this module) is the remote code a plain load would ask about.
    tokenizer = AutoTokenizer.from_pretrained(root, trust_remote_code=True)
    if tokenizer.mask_token_id != SDAR_MASK_TOKEN_ID:
        problems.append(f"the tokenizer's mask token is id {tokenizer.mask_token_id}, not {SDAR_MASK_TOKEN_ID}")
    algorithm = yaml.safe_load((root / SGLANG_CONFIG).read_text()) if (root / SGLANG_CONFIG).is_file() else None
    if not isinstance(algorithm, dict) or algorithm.get("block_size") != config.get("block_size") \
            or not isinstance(algorithm.get("threshold"), float):
        problems.append(f"{SGLANG_CONFIG} must set block_size={config.get('block_size')} and a float threshold, got "
                        f"{algorithm!r}")
    if problems:
        raise SDARExportError(f"{root} breaks the SDAR serving contract: " + "; ".join(problems) + ".")
    return {"path": str(root.resolve()), "block_size": config["block_size"], "threshold": algorithm["threshold"],
            "tensor_count": len(observed), "parameters": sum(int(torch.Size(s).numel()) for s in observed.values()),
            "tied": config["tie_word_embeddings"],
            "mask_row_zero": None if mask_row is None else bool((mask_row == 0).all())}


# --- the model card and the Hub -----------------------------------------------------------------------------------------
def render_card(folder: str | os.PathLike, *, model_ref: str, model_name: str, source: str, mask_logit: str,
                confidence_threshold: float, local: bool) -> str:
    """The model card (``README.md``) of an exported folder, from its ``config.json``."""
    root = Path(folder)
    config = json.loads((root / "config.json").read_text(encoding="utf-8"))
    block = config["block_size"]
    base = hub_repo_id(source)
    commands = launch_commands(model_ref, block, confidence_threshold,
                               yaml_ref=f"{model_ref}/{SGLANG_CONFIG}" if local else None)
    card_data = ModelCardData(library_name="transformers", base_model=base, pipeline_tag="text-generation",
                              tags=["sdar", "block-diffusion", "hf-bdlm"])
    values = dict(
        card_data=card_data.to_yaml(), model_name=model_name, source=source or "a block-diffusion model",
        parameters_text=parameters_text(root), block_size=block, threshold=confidence_threshold,
        mask_token_id=SDAR_MASK_TOKEN_ID, layers=config["num_hidden_layers"], hidden=config["hidden_size"],
        heads=config["num_attention_heads"], kv_heads=config["num_key_value_heads"], rope_theta=config["rope_theta"],
        dtype=config["torch_dtype"], tied=config["tie_word_embeddings"], mask_logit=mask_logit,
        sglang_command=commands["sglang"], lmdeploy_command=commands["lmdeploy"], yaml=sglang_yaml(block, confidence_threshold),
        default_block=block == 4,
    )
    return render_card_template(__package__, TEMPLATE_FILE, values)


def push_sdar_to_hub(folder: str | os.PathLike, repo_id: str, *, commit_message: str | None = None,
                     private: bool | None = None, token: str | bool | None = None, revision: str | None = None,
                     create_pr: bool = False):
    """Upload an exported SDAR folder to the Hub repo ``repo_id`` (created if needed) in one commit, after checking it
    with :func:`check_sdar_folder`. Arguments as in transformers' ``push_to_hub``."""
    check_sdar_folder(folder)
    return push_folder_to_hub(folder, repo_id, commit_message=commit_message or "Upload SDAR export (hf_bdlm)",
                              private=private, token=token, revision=revision, create_pr=create_pr)


# --- hf-bdlm export --format sdar (the format of ..commands) ---------------------------------------------------------
def run_export(args) -> int:
    """``hf-bdlm export --format sdar``: the checkpoint folder ``args.source`` -> the SDAR folder ``args.output`` (and
    the Hub with ``args.push_to_hub``); a folder that cannot be served as SDAR is refused from its config alone."""
    source = Path(args.source)
    if not (source / "config.json").is_file():
        raise FileNotFoundError(f"{source} holds no config.json: pass a saved block-diffusion checkpoint folder.")
    config = AutoConfig.from_pretrained(source)
    if getattr(config, "model_type", None) != "block_diffusion":
        entry = entry_for_model_type(config.model_type, getattr(config, "architectures", None))
        kind = f"a {entry.name!r} model" if entry is not None else f"a {config.model_type!r} causal LM"
        raise SDARExportError(
            f"{source} holds {kind}; the SDAR export takes a converted block-diffusion model (model_type "
            "'block_diffusion': a causal LM is converted first, hf-bdlm convert DIR OUT --objective standard, and "
            "trained). docs/deploy.md says which engine serves each family's models.")
    problems = sdar_problems(config)  # from the config alone: refused before any weight is read
    if problems:
        reasons = "; ".join(problem.split(":")[0].split(";")[0].strip() for problem in problems)
        raise SDARExportError(
            f"{source} cannot be exported as SDAR ({reasons}); export a Qwen3 converted with `hf-bdlm convert "
            "QWEN3_DIR OUT --objective standard`, then trained (docs/deploy.md). `hf-bdlm serve` serves this one.")
    model = AutoModel.from_pretrained(source).eval()
    tokenizer = AutoTokenizer.from_pretrained(source)
    try:
        out = export_sdar(model, args.output, tokenizer, confidence_threshold=args.confidence_threshold,
                          mask_logit=args.mask_logit, dtype=getattr(torch, args.dtype) if args.dtype else None,
                          repo_id=args.push_to_hub, overwrite=args.overwrite)
    except FileExistsError as err:
        raise ValueError(str(err)) from err
    report = check_sdar_folder(out)
    commands = launch_commands(str(out), report["block_size"], report["threshold"],
                               yaml_ref=str(Path(out) / SGLANG_CONFIG))
    print(f"wrote {out} (SDAR: {report['tensor_count']} tensors, {report['parameters']:,} parameters, block size "
          f"{report['block_size']}, threshold {report['threshold']}, [MASK] row of the head "
          f"{'zero' if report['mask_row_zero'] else 'as trained'}). Serve it with\n"
          f"    {commands['sglang']}\n    {commands['lmdeploy']}", file=sys.stdout)
    if args.push_to_hub:
        push_sdar_to_hub(out, args.push_to_hub, private=args.private or None)
        print(f"uploaded {out} to https://huggingface.co/{args.push_to_hub}")
    return 0


__all__ = ["SDARExportError", "SDAR_MASK_TOKEN_ID", "check_sdar_folder", "check_servable_as_sdar", "export_sdar",
           "launch_commands", "push_sdar_to_hub", "run_export", "sdar_problems", "sdar_tensor_shapes",
           "zero_mask_logit"]
