"""``hf-bdlm dflash``: make, feed, export and check DFlash speculative drafters from the command line.

    # a new drafter for a target without a published one (a serving-ready folder, untrained)
    hf-bdlm dflash init --target embedded:smollm2 --out runs/drafter --layers 1 --block-size 8
    # the target's features at the drafter's layers, over the training data (resumable)
    hf-bdlm dflash capture --target embedded:smollm2 --drafter runs/drafter --dataset hf_bdlm:arith \\
        --out runs/features --max-length 256 --batch-size 8 --max-records 64
    # a trained drafter checkpoint -> the folder vLLM / SGLang serve (optionally uploaded)
    hf-bdlm dflash export runs/train/checkpoint-500 --out runs/export --target Qwen/Qwen3-8B --push-to-hub me/drafter
    hf-bdlm dflash check runs/export          # the serving contract: config fields, tensor names and shapes, hash

``--target`` takes a local folder, a Hub id or ``embedded:smollm2`` (the SmolLM2-135M-Instruct export shipped with
hf_bdlm).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ...hub.exports import revision_flag

DTYPES = ("float32", "bfloat16", "float16")


def add_parsers(subparsers) -> None:
    """Register ``hf-bdlm dflash`` and its commands (``init``, ``capture``, ``export``, ``check``)."""
    p = subparsers.add_parser(
        "dflash", help="DFlash speculative drafters: init, capture target features, export for vLLM/SGLang, check",
        description="DFlash drafters: a small block drafter conditioned on a frozen target model's hidden states, "
                    "served by vLLM and SGLang as the target's speculative decoder.")
    commands = p.add_subparsers(dest="dflash_command", metavar="COMMAND", required=True)

    init = commands.add_parser("init", help="a new (untrained) drafter for a target, as a serving-ready folder")
    init.add_argument("--target", required=True, help="target causal LM: folder, Hub id or 'embedded:smollm2'")
    init.add_argument("--target-revision", default=None)
    init.add_argument("--out", required=True, help="folder to write (must not exist unless --overwrite)")
    init.add_argument("--layers", type=int, default=1, help="drafter decoder layers (default: 1)")
    init.add_argument("--block-size", type=int, default=8, help="tokens per draft block (default: 8)")
    init.add_argument("--init", choices=["scratch", "target_layers"], default="scratch",
                      help="fresh weights, or copies of the target's last layers (default: scratch)")
    init.add_argument("--layer-ids", type=int, nargs="+", default=None,
                      help="canonical target hidden-state ids to read (0 = embeddings; default: the model's rule)")
    init.add_argument("--mask-token-id", type=int, default=None, help="the draft block's [MASK] token id")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--overwrite", action="store_true")
    init.set_defaults(func=run_init)

    capture = commands.add_parser("capture", help="run the frozen target over a dataset and store its features")
    capture.add_argument("--target", required=True, help="target causal LM: folder, Hub id or 'embedded:smollm2'")
    capture.add_argument("--target-revision", default=None)
    capture.add_argument("--dataset", required=True,
                         help="'hf_bdlm:arith' or a dataset datasets.load_dataset reads (as hf-bdlm train)")
    capture.add_argument("--dataset-config", default=None)
    capture.add_argument("--split", default="train")
    capture.add_argument("--out", required=True, help="capture folder (a rerun resumes it)")
    layers = capture.add_mutually_exclusive_group(required=True)
    layers.add_argument("--layer-ids", type=int, nargs="+", help="canonical hidden-state ids (0 = embeddings)")
    layers.add_argument("--drafter", help="a drafter folder: capture its target_layer_ids")
    capture.add_argument("--max-length", type=int, default=None, help="longest record in tokens")
    capture.add_argument("--overlong", choices=["truncate", "drop", "error"], default="truncate",
                         help="what happens to a longer record (default: truncate)")
    capture.add_argument("--max-records", type=int, default=None, help="capture only the first N records")
    capture.add_argument("--batch-size", type=int, default=1)
    capture.add_argument("--teacher", action="store_true",
                         help="also store the last layer's output before the final norm (for a KL objective)")
    capture.add_argument("--assistant-only-loss", action="store_true")
    capture.add_argument("--dtype", choices=DTYPES, default=None, help="the target's dtype (default: its own)")
    capture.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    capture.add_argument("--no-resume", action="store_true", help="recompute every record")
    capture.add_argument("--quiet", action="store_true", help="no progress bar")
    capture.set_defaults(func=run_capture)

    export = commands.add_parser("export", help="a drafter checkpoint -> the folder vLLM / SGLang serve")
    export.add_argument("checkpoint", help="a saved drafter folder (save_pretrained, a trainer checkpoint)")
    export.add_argument("--out", required=True)
    export.add_argument("--target", required=True,
                        help="the target as served (vllm serve TARGET): a Hub id or a folder; 'embedded:smollm2' "
                             "stands for the Hub model it is an export of")
    export.add_argument("--target-revision", default=None)
    export.add_argument("--dtype", choices=DTYPES, default=None, help="cast the weights (default: as saved)")
    export.add_argument("--push-to-hub", metavar="REPO", default=None, help="then upload the folder to this repo")
    export.add_argument("--private", action="store_true", help="with --push-to-hub: create the repo private")
    export.add_argument("--overwrite", action="store_true")
    export.set_defaults(func=run_export)

    check = commands.add_parser("check", help="check an exported folder against the serving contract")
    check.add_argument("folder")
    check.set_defaults(func=run_check)


# --- commands ---------------------------------------------------------------------------------------------------------
def run_init(args) -> int:
    import torch

    from .inference.export import export_drafter

    torch.manual_seed(args.seed)
    target = _load_target(args.target, args.target_revision)
    kwargs = {"num_hidden_layers": args.layers, "block_size": args.block_size}
    if args.layer_ids is not None:
        kwargs["target_layer_ids"] = args.layer_ids
    if args.mask_token_id is not None:
        kwargs["mask_token_id"] = args.mask_token_id
    drafter = _drafter_class("DFlash2DraftModel").from_target(target, init=args.init, **kwargs)
    out = _export(export_drafter, drafter, args.out, target_id=args.target,
                  target_revision=args.target_revision, overwrite=args.overwrite,
                  training_info={"init": f"{args.init} ({args.layers} layers, seed {args.seed}); not trained"})
    _print_served(out)
    return 0


def run_capture(args) -> int:
    from transformers import AutoTokenizer

    from ...data import load_splits
    from .training.capture import capture_features, tokenize_records

    path = _target_path(args.target)
    target = _load_target(args.target, args.target_revision, dtype=args.dtype, device=args.device)
    if args.drafter:
        config = _drafter_config(args.drafter)
        layer_ids = list(config.target_layer_ids)
        width = getattr(config, "target_hidden_size", None)
        if width is not None and int(width) != int(target.config.get_text_config().hidden_size):
            raise ValueError(f"the drafter {args.drafter!r} reads features of width {width}, the target "
                             f"{args.target!r} has hidden size {target.config.get_text_config().hidden_size}: it "
                             "was made for another target.")
    else:
        layer_ids = args.layer_ids
    train, test = load_splits(args.dataset, args.dataset_config, train_split=args.split, test_split="test")
    dataset = test if args.split == "test" and test is not None else train
    if args.max_records is not None:
        dataset = dataset.select(range(min(args.max_records, len(dataset))))
    tokenizer = AutoTokenizer.from_pretrained(path, revision=args.target_revision)
    records = tokenize_records(dataset, tokenizer, max_length=args.max_length, overlong_samples=args.overlong,
                               assistant_only_loss=args.assistant_only_loss)
    manifest = capture_features(target, records, layer_ids=layer_ids, out_dir=args.out, batch_size=args.batch_size,
                                teacher=args.teacher, target_id=args.target, target_revision=args.target_revision,
                                resume=not args.no_resume, progress=not args.quiet)
    print(f"captured {manifest['num_records']} records ({manifest['num_tokens']} tokens) of {args.target}: layers "
          f"{manifest['layer_ids']}, width {manifest['feature_width']}, {manifest['dtype']}"
          f"{', with teacher states' if manifest['teacher'] else ''} -> {args.out}")
    return 0


def run_export(args) -> int:
    import torch

    from .inference.export import export_drafter, push_drafter_to_hub

    checkpoint = Path(args.checkpoint)
    config_path = checkpoint / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{checkpoint} holds no config.json: pass a saved drafter folder.")
    architecture = (json.loads(config_path.read_text()).get("architectures") or [None])[0]
    drafter = _drafter_class(architecture).from_pretrained(checkpoint)
    out = _export(export_drafter, drafter, args.out, target_id=args.target, target_revision=args.target_revision,
                  training_info=_training_facts(checkpoint), repo_id=args.push_to_hub,
                  dtype=getattr(torch, args.dtype) if args.dtype else None, overwrite=args.overwrite)
    _print_served(out)
    if args.push_to_hub:
        push_drafter_to_hub(out, args.push_to_hub, private=args.private or None)
        print(f"uploaded {out} to https://huggingface.co/{args.push_to_hub}")
    return 0


def run_check(args) -> int:
    from .inference.export import check_serving_inventory

    print(json.dumps(check_serving_inventory(args.folder), indent=2))
    return 0


# --- helpers ----------------------------------------------------------------------------------------------------------
def _target_path(name: str) -> str:
    from ...embedded import resolve_model_path

    return resolve_model_path(name)


def _load_target(name: str, revision: str | None, dtype: str | None = None, device: str | None = None):
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {"revision": revision} if revision else {}
    if dtype:
        kwargs["dtype"] = getattr(torch, dtype)
    target = AutoModelForCausalLM.from_pretrained(_target_path(name), **kwargs)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return target.to(device).eval().requires_grad_(False)


def _drafter_class(architecture: str | None):
    from . import modeling

    if architecture not in ("DFlash2DraftModel", "DFlashDraftModel"):
        raise ValueError(f"config.json names architecture {architecture!r}; a DFlash drafter is a 'DFlash2DraftModel' "
                         "or a 'DFlashDraftModel'.")
    return getattr(modeling, architecture)


def _drafter_config(folder: str):
    from .configuration import DFlashConfig

    if not (Path(folder) / "config.json").is_file():
        raise FileNotFoundError(f"--drafter {folder!r} holds no config.json: pass a drafter folder (hf-bdlm dflash "
                                "init writes one).")
    return DFlashConfig.from_pretrained(folder)


def _export(export_drafter, *args, **kwargs) -> Path:
    try:
        return export_drafter(*args, **kwargs)
    except FileExistsError as err:
        raise ValueError(str(err)) from err  # the command prints it as an error (exit code 2)


def _training_facts(checkpoint: Path) -> dict:
    """What a trainer checkpoint says about its run (``trainer_state.json``): steps and the last logged loss."""
    path = checkpoint / "trainer_state.json"
    if not path.is_file():
        return {}
    state = json.loads(path.read_text())
    facts = {"steps": state.get("global_step")}
    losses = [entry["loss"] for entry in state.get("log_history", []) if "loss" in entry]
    if losses:
        facts["loss"] = losses[-1]
    return {k: v for k, v in facts.items() if v is not None}


def _print_served(folder: Path) -> None:
    from .inference.export import check_serving_inventory

    report = check_serving_inventory(folder)
    provenance = json.loads((folder / "training_export.json").read_text())
    target, tokens = provenance["model_id"], report["num_speculative_tokens"]
    revision = revision_flag(provenance.get("model_revision"))
    spec = json.dumps({"method": "dflash", "model": str(folder), "num_speculative_tokens": tokens})
    print(f"wrote {folder} ({report['architecture']}, {report['tensor_count']} tensors, {report['parameters']:,} "
          f"parameters, block size {report['block_size']}). Serve it with\n"
          f"    vllm serve {target}{revision} --speculative-config '{spec}'\n"
          f"    python -m sglang.launch_server --model-path {target}{revision} --speculative-algorithm DFLASH "
          f"--speculative-draft-model-path {folder} --speculative-dflash-block-size {report['block_size']}",
          file=sys.stdout)


__all__ = ["add_parsers", "run_capture", "run_check", "run_export", "run_init"]
