"""The DFlash family's command line as data: ``hf-bdlm dflash init|capture|export|check`` and the ``drafter`` study of
``hf-bdlm bench`` (the types: :mod:`hf_bdlm.protocols.commands`; nothing here imports torch or argparse).

    # a new drafter for a target without a published one (a serving-ready folder, untrained)
    hf-bdlm dflash init --target embedded:smollm2 --out runs/drafter --layers 1 --block-size 8
    # the target's features at the drafter's layers, over the training data (resumable)
    hf-bdlm dflash capture --target embedded:smollm2 --drafter runs/drafter --dataset hf_bdlm:arith \\
        --out runs/features --max-length 256 --batch-size 8 --max-records 64
    # a trained drafter checkpoint -> the folder vLLM / SGLang serve (optionally uploaded)
    hf-bdlm dflash export runs/train/checkpoint-500 --out runs/export --target Qwen/Qwen3-8B --push-to-hub me/drafter
    hf-bdlm dflash check runs/export          # the serving contract: config fields, tensor names and shapes, hash

``--target`` takes a local folder, a Hub id or ``embedded:smollm2`` (the SmolLM2-135M-Instruct export shipped with
hf_bdlm). What runs each command: :func:`.inference.export.run_init`, :func:`.training.capture.run_capture`,
:func:`.inference.export.run_export`, :func:`.inference.export.run_check`.
"""

from __future__ import annotations

from ...protocols.commands import Argument, Command, Study

DTYPES = ("float32", "bfloat16", "float16")
TARGET = "target causal LM: folder, Hub id or 'embedded:smollm2'"
EXPORT = "hf_bdlm.models.dflash.inference.export"

INIT = Command(
    "init", help="a new (untrained) drafter for a target, as a serving-ready folder", run=f"{EXPORT}:run_init",
    arguments=(
        Argument("--target", required=True, help=TARGET),
        Argument("--target-revision"),
        Argument("--out", required=True, help="folder to write (must not exist unless --overwrite)"),
        Argument("--layers", type="int", default=1, help="drafter decoder layers (default: 1)"),
        Argument("--block-size", type="int", default=8, help="tokens per draft block (default: 8)"),
        Argument("--init", choices=("scratch", "target_layers"), default="scratch",
                 help="fresh weights, or copies of the target's last layers (default: scratch)"),
        Argument("--layer-ids", type="int", nargs="+",
                 help="canonical target hidden-state ids to read (0 = embeddings; default: the model's rule)"),
        Argument("--mask-token-id", type="int", help="the draft block's [MASK] token id"),
        Argument("--seed", type="int", default=0),
        Argument("--overwrite", action="store_true"),
    ))

CAPTURE = Command(
    "capture", help="run the frozen target over a dataset and store its features",
    run="hf_bdlm.models.dflash.training.capture:run_capture", required_groups=("layers",),
    arguments=(
        Argument("--target", required=True, help=TARGET),
        Argument("--target-revision"),
        Argument("--dataset", required=True,
                 help="'hf_bdlm:arith', 'hf_bdlm:fast_apply' or a dataset datasets.load_dataset reads "
                      "(as hf-bdlm train)"),
        Argument("--dataset-config"),
        Argument("--split", default="train"),
        Argument("--out", required=True, help="capture folder (a rerun resumes it)"),
        Argument("--layer-ids", type="int", nargs="+", exclusive="layers",
                 help="canonical hidden-state ids (0 = embeddings)"),
        Argument("--drafter", exclusive="layers", help="a drafter folder: capture its target_layer_ids"),
        Argument("--max-length", type="int", help="longest record in tokens"),
        Argument("--overlong", choices=("truncate", "drop", "error"), default="truncate",
                 help="what happens to a longer record (default: truncate)"),
        Argument("--max-records", type="int", help="capture only the first N records"),
        Argument("--batch-size", type="int", default=1),
        Argument("--teacher", action="store_true",
                 help="also store the last layer's output before the final norm (for a KL objective)"),
        Argument("--assistant-only-loss", action="store_true"),
        Argument("--dtype", choices=DTYPES, help="the target's dtype (default: its own)"),
        Argument("--device", help="default: cuda when available, else cpu"),
        Argument("--no-resume", action="store_true", help="recompute every record"),
        Argument("--quiet", action="store_true", help="no progress bar"),
    ))

EXPORT_COMMAND = Command(
    "export", help="a drafter checkpoint -> the folder vLLM / SGLang serve", run=f"{EXPORT}:run_export",
    arguments=(
        Argument("checkpoint", help="a saved drafter folder (save_pretrained, a trainer checkpoint)"),
        Argument("--out", required=True),
        Argument("--target", required=True,
                 help="the target as served (vllm serve TARGET): a Hub id or a folder; 'embedded:smollm2' stands for "
                      "the Hub model it is an export of"),
        Argument("--target-revision"),
        Argument("--dtype", choices=DTYPES, help="cast the weights (default: as saved)"),
        Argument("--push-to-hub", metavar="REPO", help="then upload the folder to this repo"),
        Argument("--private", action="store_true", help="with --push-to-hub: create the repo private"),
        Argument("--overwrite", action="store_true"),
    ))

CHECK = Command("check", help="check an exported folder against the serving contract", run=f"{EXPORT}:run_check",
                arguments=(Argument("folder"),))

COMMANDS = (
    Command("dflash", help="DFlash speculative drafters: init, capture target features, export for vLLM/SGLang, check",
            description="DFlash drafters: a small block drafter conditioned on a frozen target model's hidden states, "
                        "served by vLLM and SGLang as the target's speculative decoder.",
            commands=(INIT, CAPTURE, EXPORT_COMMAND, CHECK)),
)
STUDIES = (Study("drafter", module="hf_bdlm.models.dflash.studies.benchmark"),)
EXPORT_FORMATS = ()

__all__ = ["COMMANDS", "DTYPES", "EXPORT_FORMATS", "STUDIES"]
