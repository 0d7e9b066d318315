"""The block-diffusion family's command line as data: ``hf-bdlm export --format sdar``, a block-diffusion checkpoint
folder -> the SDAR folder SGLang and LMDeploy serve (the types: :mod:`hf_bdlm.protocols.commands`; nothing here imports
torch or argparse).

    hf-bdlm export --format sdar runs/qwen3-bdlm out/sdar --confidence-threshold 0.9 --dtype bfloat16
    hf-bdlm export --format sdar runs/qwen3-bdlm out/sdar --push-to-hub me/qwen3-bdlm-sdar

What runs it: :func:`.inference.export_sdar.run_export`.
"""

from __future__ import annotations

from ...protocols.commands import Argument, ExportFormat

DTYPES = ("float32", "bfloat16", "float16")

SDAR = ExportFormat(
    "sdar", run="hf_bdlm.models.block_diffusion.inference.export_sdar:run_export",
    arguments=(
        Argument("--confidence-threshold", type="float",
                 help="the threshold the launch commands set (SGLang's YAML, LMDeploy's flag; default: the "
                      "checkpoint's generation config, else 0.9)"),
        Argument("--mask-logit", choices=("zero", "keep"), default="zero",
                 help="'zero' (default): the head's [MASK] row is zero, so the engines' argmax over the whole "
                      "vocabulary never meets the [MASK] logit the standard objective leaves untrained (a tied head is "
                      "untied); 'keep': the head as trained"),
        Argument("--dtype", choices=DTYPES, help="cast the weights (default: as saved)"),
    ))

COMMANDS = ()
EXPORT_FORMATS = (SDAR,)
STUDIES = ()

__all__ = ["COMMANDS", "DTYPES", "EXPORT_FORMATS", "STUDIES"]
