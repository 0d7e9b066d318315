"""Export a DFlash drafter as the folder vLLM and SGLang serve, check a folder against that contract, and upload it.

The exported folder holds

- ``config.json``: the serving contract (``model_type`` ``qwen3``, ``architectures`` ``["DFlash2DraftModel"]`` or
  ``["DFlashDraftModel"]``, the ``dflash_config`` mapping, ``target_hidden_size``);
- ``model.safetensors``: the drafter's own tensors only (never the target's embedding or head);
- ``training_export.json``: provenance (target id and revision, the weights' sha256 and tensor count);
- ``README.md``: the model card (the target, the two serving commands, the training facts).

::

    from hf_bdlm.models.dflash.inference.export import export_drafter, check_serving_inventory, push_drafter_to_hub
    export_drafter(drafter, "out/drafter", target_id="Qwen/Qwen3-8B", training_info={"steps": 2000})
    check_serving_inventory("out/drafter")        # raises naming every missing / extra / mis-shaped tensor
    push_drafter_to_hub("out/drafter", "me/Qwen3-8B-DFlash2")

    vllm serve Qwen/Qwen3-8B --speculative-config '{"method": "dflash", "model": "out/drafter",
                                                    "num_speculative_tokens": 7}'
    python -m sglang.launch_server --model-path Qwen/Qwen3-8B --speculative-algorithm DFLASH \\
        --speculative-draft-model-path out/drafter

or ``hf-bdlm dflash export CHECKPOINT --out DIR --target ID`` and ``hf-bdlm dflash check DIR``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import ModelCardData
from safetensors import safe_open
from safetensors.torch import save_file

from ....hub.upload import push_folder_to_hub
from ....protocols.card_parts import format_value, hub_repo_id, parameters_text, render_card_template, unique
from ....hub.exports import qwen3_layer_shapes, revision_flag, serving_model_id, write_folder
from ....checkpoints.files import file_sha256
from ....version import __version__

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
PROVENANCE = "training_export.json"
CARD = "README.md"
# The provenance format the published DFlash2 export checkers accept (they read `format`, and the weights' `sha256`
# and `tensor_count`); hf_bdlm's own fields sit beside them.
PROVENANCE_FORMAT = "dllm_parallel.dflash2_training_export.v1"
# Tensors of the target that a serving engine takes from the target itself: never in a drafter's weights file.
VERIFIER_TENSORS = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight",
                    "t2d", "d2t")
ARCHITECTURES = ("DFlash2DraftModel", "DFlashDraftModel")
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
ATTENTION_MODES = ("gqa", "mha")


class ServingContractError(ValueError):
    """A folder (or a config) that vLLM / SGLang would not serve as a DFlash drafter; the message lists every
    problem found."""


# --- the contract ---------------------------------------------------------------------------------------------------
def serving_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    r"""
    The tensors (name -> shape) a drafter's ``model.safetensors`` must hold exactly, read from its ``config.json``.

    Args:
        config (`dict`): the parsed ``config.json``.

    Raises:
        ServingContractError: naming every field of the contract the config breaks.
    """
    problems: list[str] = []

    def positive_int(mapping: dict, key: str, where: str = "", default=None) -> int:
        value = mapping.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            problems.append(f"{where}{key} must be a positive integer, got {value!r}")
            return 1
        return value

    architectures = config.get("architectures")
    if not (isinstance(architectures, list) and len(architectures) == 1 and architectures[0] in ARCHITECTURES):
        problems.append(f"architectures must be one of {[[a] for a in ARCHITECTURES]}, got {architectures!r}")
    dflash2 = architectures == ["DFlash2DraftModel"]
    if config.get("model_type") != "qwen3":
        problems.append(f"model_type must be 'qwen3' (the layer type the serving engines build), got "
                        f"{config.get('model_type')!r}")
    hidden = positive_int(config, "hidden_size")
    intermediate = positive_int(config, "intermediate_size")
    layers = positive_int(config, "num_hidden_layers")
    heads = positive_int(config, "num_attention_heads")
    kv_heads = positive_int(config, "num_key_value_heads", default=heads)
    head_dim = positive_int(config, "head_dim", default=hidden // heads if hidden % heads == 0 else None)
    vocab = positive_int(config, "vocab_size")
    target_hidden = positive_int(config, "target_hidden_size", default=hidden)
    if heads % kv_heads:
        problems.append(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act must be 'silu', got {config.get('hidden_act')!r}")

    method = config.get("dflash_config")
    if not isinstance(method, dict):
        problems.append(f"dflash_config must be a mapping, got {method!r}")
        method = {}
    block = positive_int(method, "block_size", "dflash_config.")
    if method.get("block_size") == 1:
        problems.append(f"dflash_config.block_size must be at least 2 (the anchor and one drafted token), got {block}")
    if config.get("block_size") is not None and config["block_size"] != method.get("block_size"):
        problems.append(f"block_size={config['block_size']!r} disagrees with dflash_config.block_size="
                        f"{method.get('block_size')!r}")
    mask = method.get("mask_token_id")
    if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask < vocab:
        problems.append(f"dflash_config.mask_token_id must be a token id in [0, {vocab}), got {mask!r}")
    serving_ids = method.get("target_layer_ids")
    if (not isinstance(serving_ids, list) or not serving_ids
            or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in serving_ids)
            or len(set(serving_ids)) != len(serving_ids)):
        problems.append(f"dflash_config.target_layer_ids must be a non-empty list of distinct non-negative layer "
                        f"indices (the serving convention: the output of layer i), got {serving_ids!r}")
        serving_ids = [0]
    for key in ("target_layer_ids", "aux_hidden_state_layer_ids"):
        # A top-level list is read as canonical ids (hidden_states[i], 0 = embeddings): one more than the serving ids.
        if config.get(key) is not None and list(config[key]) != [i + 1 for i in serving_ids]:
            problems.append(f"top-level {key}={config[key]!r} (canonical ids) disagrees with dflash_config."
                            f"target_layer_ids={serving_ids!r} (serving ids, one less)")
    if dflash2:
        kernel = positive_int(method, "conv_kernel_size", "dflash_config.")
        group = positive_int(method, "conv_group_size", "dflash_config.")
        rank = positive_int(method, "selector_rank", "dflash_config.")
        top_k = positive_int(method, "selector_top_k", "dflash_config.")
        if kernel > block:
            problems.append(f"dflash_config.conv_kernel_size={kernel} exceeds block_size={block}")
        if hidden % group:
            problems.append(f"dflash_config.conv_group_size={group} does not divide hidden_size={hidden}")
        if top_k > vocab:
            problems.append(f"dflash_config.selector_top_k={top_k} exceeds vocab_size={vocab}")
        mode = str(method.get("attention_mode", "gqa")).lower()
        if mode not in ATTENTION_MODES:
            problems.append(f"dflash_config.attention_mode must be one of {ATTENTION_MODES}, got "
                            f"{method.get('attention_mode')!r}")
    if problems:
        raise ServingContractError("the config breaks the DFlash serving contract: " + "; ".join(problems) + ".")

    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (hidden, len(serving_ids) * target_hidden),
        "hidden_norm.weight": (hidden,),
        "norm.weight": (hidden,),
    }
    if dflash2:
        shapes.update({
            "candidate_selector.predecessor_codebook": (vocab, rank),
            "candidate_selector.successor_codebook": (vocab, rank),
            "candidate_selector.hidden_projection.weight": (rank, hidden),
        })
    for i in range(layers):
        p = f"layers.{i}."
        shapes.update(qwen3_layer_shapes(p, hidden=hidden, intermediate=intermediate, heads=heads, kv_heads=kv_heads,
                                         head_dim=head_dim, attention_bias=bool(config.get("attention_bias")),
                                         mlp_bias=bool(config.get("mlp_bias"))))
        if dflash2:
            for conv in ("attention_conv", "mlp_conv"):
                # Per block position offset (2 sides), kernel tap and channel; the projection predicts the dynamic
                # part per channel group.
                shapes[p + conv + ".base_kernel"] = (2, kernel, hidden)
                shapes[p + conv + ".kernel_projection.weight"] = (2 * kernel * (hidden // group), hidden)
    return shapes


def check_serving_inventory(folder: str | os.PathLike) -> dict[str, Any]:
    r"""
    Check an exported drafter folder against the serving contract: ``config.json``'s fields, the exact tensor
    inventory of ``model.safetensors`` (names and shapes, no target tensor) and the provenance file's hash.

    Args:
        folder (`str` or `os.PathLike`): the exported folder.

    Returns:
        `dict` with ``path``, ``architecture``, ``block_size``, ``num_speculative_tokens`` (``block_size - 1``, what
        vLLM's ``--speculative-config`` takes), ``target_layer_ids`` (serving convention), ``tensor_count`` and
        ``parameters``.

    Raises:
        FileNotFoundError: a file of the folder is missing.
        ServingContractError: naming every missing, extra and mis-shaped tensor and every broken field.
    """
    root = Path(folder)
    for name in (CONFIG, WEIGHTS, PROVENANCE):
        if not (root / name).is_file():
            raise FileNotFoundError(f"{root} has no {name}; export the drafter with export_drafter (or `hf-bdlm "
                                    "dflash export`).")
    config = json.loads((root / CONFIG).read_text(encoding="utf-8"))
    expected = serving_shapes(config)
    with safe_open(str(root / WEIGHTS), framework="pt") as f:
        observed = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    problems = []
    verifier = sorted(n for n in observed if n in VERIFIER_TENSORS or n.startswith("verifier_"))
    if verifier:
        problems.append(f"target tensors that must not be exported (the engines take them from the target): "
                        f"{verifier}")
    missing = sorted(expected.keys() - observed.keys())
    extra = sorted(observed.keys() - expected.keys() - set(verifier))
    wrong = sorted(f"{n} {list(observed[n])} (expected {list(expected[n])})"
                   for n in expected.keys() & observed.keys() if observed[n] != expected[n])
    if missing:
        problems.append(f"missing tensors {missing}")
    if extra:
        problems.append(f"unexpected tensors {extra}")
    if wrong:
        problems.append(f"mis-shaped tensors {wrong}")
    provenance = json.loads((root / PROVENANCE).read_text(encoding="utf-8"))
    weights = provenance.get("weights") or {}
    if provenance.get("format") != PROVENANCE_FORMAT:
        problems.append(f"{PROVENANCE} has format {provenance.get('format')!r}, expected {PROVENANCE_FORMAT!r}")
    if weights.get("sha256") != file_sha256(root / WEIGHTS):
        problems.append(f"{WEIGHTS} does not match the sha256 in {PROVENANCE} (the weights changed after export)")
    if weights.get("tensor_count") != len(observed):
        problems.append(f"{PROVENANCE} counts {weights.get('tensor_count')!r} tensors, {WEIGHTS} holds "
                        f"{len(observed)}")
    if problems:
        raise ServingContractError(f"{root} breaks the DFlash serving contract: " + "; ".join(problems) + ".")
    method = config["dflash_config"]
    parameters = 0
    for shape in observed.values():
        parameters += int(torch.Size(shape).numel())
    return {"path": str(root.resolve()), "architecture": config["architectures"][0],
            "block_size": method["block_size"], "num_speculative_tokens": method["block_size"] - 1,
            "target_layer_ids": list(method["target_layer_ids"]), "tensor_count": len(observed),
            "parameters": parameters}


# --- export ---------------------------------------------------------------------------------------------------------
def export_drafter(
    drafter,
    out_dir: str | os.PathLike,
    *,
    target_id: str,
    target_revision: str | None = None,
    training_info: dict | None = None,
    repo_id: str | None = None,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    r"""
    Write the folder vLLM and SGLang serve for ``drafter`` (see the module docstring), checked before it appears.

    The folder is written in a staging directory beside ``out_dir``, checked with :func:`check_serving_inventory`,
    then renamed into place: ``out_dir`` is either the complete export or untouched.

    Args:
        drafter ([`DFlashDraftModel`] or [`DFlash2DraftModel`]):
            The drafter (unwrapped); its ``state_dict()`` holds exactly its serving tensors.
        out_dir (`str` or `os.PathLike`):
            The folder to write.
        target_id (`str`):
            The target model the drafter was trained for, as served (``vllm serve TARGET_ID``): a Hub id or a folder;
            ``embedded:smollm2`` is recorded as the Hub model it is an export of.
        target_revision (`str`, *optional*):
            The target's revision (commit), recorded in the provenance.
        training_info (`dict`, *optional*):
            Training facts for the model card and provenance (dataset, steps, tokens, loss, acceptance length, ...).
        repo_id (`str`, *optional*):
            The Hub repo the folder will be uploaded to (the card's serving commands name it; default: the folder).
        dtype (`torch.dtype`, *optional*):
            Cast floating tensors to this dtype (e.g. `torch.bfloat16` for serving); default: as they are.
        overwrite (`bool`, defaults to `False`):
            Replace an existing ``out_dir``; otherwise an existing one is an error.

    Returns:
        `Path` of the folder.
    """
    destination = Path(out_dir)
    if not target_id:
        raise ValueError("target_id is required: the model the drafter serves with (e.g. 'Qwen/Qwen3-8B').")
    target_id = serving_model_id(target_id)
    config = _serving_config(drafter, dtype)
    state = {}
    for name, tensor in drafter.state_dict().items():
        if name in VERIFIER_TENSORS or name.startswith("verifier_"):
            continue
        tensor = tensor.detach().to("cpu")
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        state[name] = tensor.contiguous().clone()  # clone: safetensors refuses tensors that share storage

    def build(staging: Path) -> None:
        save_file(state, str(staging / WEIGHTS), metadata={"format": "pt"})
        (staging / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        provenance = {
            "format": PROVENANCE_FORMAT,
            "exported_by": f"hf_bdlm {__version__}",
            "model_id": target_id,
            "model_revision": target_revision,
            "architecture": config["architectures"][0],
            "block_size": config["dflash_config"]["block_size"],
            "weights": {"path": WEIGHTS, "bytes": (staging / WEIGHTS).stat().st_size,
                        "sha256": file_sha256(staging / WEIGHTS), "tensor_count": len(state)},
            "training": dict(training_info or {}),
        }
        (staging / PROVENANCE).write_text(json.dumps(provenance, indent=2, sort_keys=True, default=str) + "\n",
                                          encoding="utf-8")
        (staging / CARD).write_text(render_card(staging, model_name=destination.resolve().name,
                                                model_ref=repo_id or str(destination)), encoding="utf-8")

    return write_folder(destination, build, check=check_serving_inventory, overwrite=overwrite)


def _serving_config(drafter, dtype: torch.dtype | None) -> dict:
    # What save_pretrained writes (the config class keeps every field of the contract in it), less a local path, an
    # attention-kernel choice or remote code: nothing the engines read.
    config = drafter.config.to_diff_dict()
    for key in [k for k in config if k.startswith("_") or k == "auto_map"]:
        config.pop(key)
    if dtype is not None:
        config["dtype"] = str(dtype).removeprefix("torch.")
    return config


# --- the model card -------------------------------------------------------------------------------------------------
TRAINING_LABELS = {
    "dataset": "Dataset",
    "init": "Initialisation",
    "steps": "Training steps",
    "tokens": "Training tokens",
    "loss": "Final loss",
    "objective": "Objective",
    "learning_rate": "Learning rate",
    "acceptance_length": "Mean acceptance length",
    "eval_acceptance_length": "Held-out acceptance length (greedy, counted as served)",
    "eval_verification_steps": "Held-out verification steps",
    "features": "Target features",
}


def render_card(folder: str | os.PathLike, *, model_name: str | None = None, model_ref: str | None = None,
                description: str | None = None, license: str = "unknown") -> str:
    """The model card (``README.md``) of an exported folder, from its ``config.json`` and ``training_export.json``;
    ``model_ref`` is what the serving commands name as the drafter (a Hub repo id or a folder)."""
    root = Path(folder)
    config = json.loads((root / CONFIG).read_text(encoding="utf-8"))
    provenance = json.loads((root / PROVENANCE).read_text(encoding="utf-8"))
    method = config["dflash_config"]
    architecture = config["architectures"][0]
    target_id = provenance["model_id"]
    hub_target = hub_repo_id(target_id)
    training = dict(provenance.get("training") or {})
    serving_ids = list(method["target_layer_ids"])
    method_rows = []
    if architecture == "DFlash2DraftModel":
        method_rows = [("Dynamic convolutions", f"kernel {method['conv_kernel_size']}, channel groups of "
                                                f"{method['conv_group_size']}, around attention and MLP"),
                       ("Candidate selector", f"rank {method['selector_rank']}, top-{method['selector_top_k']}")]
    card_data = ModelCardData(library_name="transformers", base_model=hub_target, license=license,
                              tags=unique(["dflash", "speculative-decoding", "hf-bdlm", "draft-model"]))
    values = dict(
        card_data=card_data.to_yaml(),
        model_name=model_name or root.resolve().name,
        description=description,
        architecture=architecture,
        target_id=target_id,
        target_url=f"https://huggingface.co/{hub_target}" if hub_target else target_id,
        target_text=f"[{hub_target}](https://huggingface.co/{hub_target})" if hub_target else f"`{target_id}`",
        target_revision=provenance.get("model_revision"),
        revision_flag=revision_flag(provenance.get("model_revision")),
        num_target_layers=len(serving_ids),
        architecture_text=(f"`{architecture}`: {config['num_hidden_layers']} Qwen3 "
                           f"layer{'s' if config['num_hidden_layers'] > 1 else ''}, hidden "
                           f"{config['hidden_size']}, {config['num_attention_heads']} heads "
                           f"({config.get('num_key_value_heads', config['num_attention_heads'])} K/V)"),
        parameters_text=parameters_text(root),
        block_size=method["block_size"],
        num_speculative_tokens=method["block_size"] - 1,
        target_layers_text=(f"{serving_ids} (outputs of those decoder layers; `hidden_states` indices "
                            f"{[i + 1 for i in serving_ids]})"),
        mask_token_id=method["mask_token_id"],
        method_rows=method_rows,
        dtype=config.get("dtype") or config.get("torch_dtype") or "float32",
        model_ref=model_ref or str(root),
        training_rows=[(TRAINING_LABELS.get(k, k), format_value(training[k]))
                       for k in sorted(training, key=lambda k: (k not in TRAINING_LABELS, list(TRAINING_LABELS).index(k)
                                                                if k in TRAINING_LABELS else k))],
    )
    # The card template sits at the top of the family folder, beside the model it describes.
    return render_card_template(__package__.rpartition(".")[0], "model_card.md", values)


# --- the hub --------------------------------------------------------------------------------------------------------
def push_drafter_to_hub(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    commit_message: str | None = None,
    private: bool | None = None,
    token: str | bool | None = None,
    revision: str | None = None,
    create_pr: bool = False,
):
    r"""
    Upload an exported drafter folder to the Hub repo ``repo_id`` (created if needed) in one commit, after checking
    it against the serving contract.

    Args:
        folder (`str` or `os.PathLike`): a folder [`export_drafter`] wrote.
        repo_id (`str`): ``namespace/name`` of the model repository.
        commit_message, private, token, revision, create_pr: as in transformers' ``push_to_hub``.

    Returns:
        The `huggingface_hub.CommitInfo` of the commit.
    """
    check_serving_inventory(folder)
    return push_folder_to_hub(folder, repo_id, commit_message=commit_message or "Upload DFlash drafter (hf_bdlm)",
                              private=private, token=token, revision=revision, create_pr=create_pr)


# --- hf-bdlm dflash init / export / check (the commands of ..commands) ----------------------------------------------
def run_init(args) -> int:
    """``hf-bdlm dflash init``: a new (untrained) drafter for ``args.target``, written as a serving-ready folder."""
    # lazy: import cost measured: +2.9 s (transformers, the drafter) on export's 1.6 s; dflash check reads files
    from ..modeling import DFlash2DraftModel
    from ..target import load_target

    torch.manual_seed(args.seed)
    target = load_target(args.target, args.target_revision)
    kwargs = {"num_hidden_layers": args.layers, "block_size": args.block_size}
    if args.layer_ids is not None:
        kwargs["target_layer_ids"] = args.layer_ids
    if args.mask_token_id is not None:
        kwargs["mask_token_id"] = args.mask_token_id
    drafter = DFlash2DraftModel.from_target(target, init=args.init, **kwargs)
    out = _export_command(drafter, args.out, target_id=args.target, target_revision=args.target_revision,
                          overwrite=args.overwrite,
                          training_info={"init": f"{args.init} ({args.layers} layers, seed {args.seed}); not trained"})
    print_served(out)
    return 0


def run_export(args) -> int:
    """``hf-bdlm dflash export``: a saved drafter checkpoint -> the folder vLLM / SGLang serve (and the Hub)."""
    checkpoint = Path(args.checkpoint)
    config_path = checkpoint / CONFIG
    if not config_path.is_file():
        raise FileNotFoundError(f"{checkpoint} holds no config.json: pass a saved drafter folder.")
    architecture = (json.loads(config_path.read_text()).get("architectures") or [None])[0]
    drafter = _drafter_class(architecture).from_pretrained(checkpoint)
    out = _export_command(drafter, args.out, target_id=args.target, target_revision=args.target_revision,
                          training_info=training_facts(checkpoint), repo_id=args.push_to_hub,
                          dtype=getattr(torch, args.dtype) if args.dtype else None, overwrite=args.overwrite)
    print_served(out)
    if args.push_to_hub:
        push_drafter_to_hub(out, args.push_to_hub, private=args.private or None)
        print(f"uploaded {out} to https://huggingface.co/{args.push_to_hub}")
    return 0


def run_check(args) -> int:
    """``hf-bdlm dflash check``: the serving inventory of ``args.folder``, as JSON."""
    print(json.dumps(check_serving_inventory(args.folder), indent=2))
    return 0


def _drafter_class(architecture: str | None):
    # lazy: import cost measured: +2.9 s (transformers, the drafter) on export's 1.6 s; dflash check reads files
    from .. import modeling

    if architecture not in ("DFlash2DraftModel", "DFlashDraftModel"):
        raise ValueError(f"config.json names architecture {architecture!r}; a DFlash drafter is a 'DFlash2DraftModel' "
                         "or a 'DFlashDraftModel'.")
    return getattr(modeling, architecture)


def _export_command(drafter, out_dir, **kwargs) -> Path:
    try:
        return export_drafter(drafter, out_dir, **kwargs)
    except FileExistsError as err:
        raise ValueError(str(err)) from err  # the command prints it as an error (exit code 2)


def training_facts(checkpoint: str | os.PathLike) -> dict:
    """What a trainer checkpoint says about its run (``trainer_state.json``): steps and the last logged loss."""
    path = Path(checkpoint) / "trainer_state.json"
    if not path.is_file():
        return {}
    state = json.loads(path.read_text())
    facts = {"steps": state.get("global_step")}
    losses = [entry["loss"] for entry in state.get("log_history", []) if "loss" in entry]
    if losses:
        facts["loss"] = losses[-1]
    return {k: v for k, v in facts.items() if v is not None}


def print_served(folder: Path) -> None:
    """Print what was written to ``folder`` and the vLLM / SGLang commands that serve it."""
    report = check_serving_inventory(folder)
    provenance = json.loads((folder / PROVENANCE).read_text())
    target, tokens = provenance["model_id"], report["num_speculative_tokens"]
    revision = revision_flag(provenance.get("model_revision"))
    spec = json.dumps({"method": "dflash", "model": str(folder), "num_speculative_tokens": tokens})
    print(f"wrote {folder} ({report['architecture']}, {report['tensor_count']} tensors, {report['parameters']:,} "
          f"parameters, block size {report['block_size']}). Serve it with\n"
          f"    vllm serve {target}{revision} --speculative-config '{spec}'\n"
          f"    python -m sglang.launch_server --model-path {target}{revision} --speculative-algorithm DFLASH "
          f"--speculative-draft-model-path {folder} --speculative-dflash-block-size {report['block_size']}",
          file=sys.stdout)


__all__ = ["PROVENANCE_FORMAT", "ServingContractError", "VERIFIER_TENSORS", "check_serving_inventory",
           "export_drafter", "print_served", "push_drafter_to_hub", "render_card", "run_check", "run_export",
           "run_init", "serving_shapes", "training_facts"]
