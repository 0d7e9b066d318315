"""``hf-bdlm export --format sdar``: a block-diffusion checkpoint folder -> the SDAR folder SGLang and LMDeploy serve.

    hf-bdlm export --format sdar runs/qwen3-bdlm out/sdar --confidence-threshold 0.9 --dtype bfloat16
    hf-bdlm export --format sdar runs/qwen3-bdlm out/sdar --push-to-hub me/qwen3-bdlm-sdar

Argparse only at import; the model code is imported when the command runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")


def add_arguments(group) -> None:
    """The SDAR export's options (``hf-bdlm export --format sdar``)."""
    group.add_argument("--confidence-threshold", type=float, default=None,
                       help="the threshold the launch commands set (SGLang's YAML, LMDeploy's flag; default: the "
                            "checkpoint's generation config, else 0.9)")
    group.add_argument("--mask-logit", choices=("zero", "keep"), default="zero",
                       help="'zero' (default): the head's [MASK] row is zero, so the engines' argmax over the whole "
                            "vocabulary never meets the [MASK] logit the standard objective leaves untrained (a tied "
                            "head is untied); 'keep': the head as trained")
    group.add_argument("--dtype", choices=DTYPES, default=None, help="cast the weights (default: as saved)")


def run_export(args) -> int:
    import torch
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    from .inference.export_sdar import (SDARExportError, check_sdar_folder, export_sdar, launch_commands, push_sdar_to_hub,
                              sdar_problems)

    source = Path(args.source)
    if not (source / "config.json").is_file():
        raise FileNotFoundError(f"{source} holds no config.json: pass a saved block-diffusion checkpoint folder.")
    from ...protocols.registry import entry_for_model_type

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
                               yaml_ref=str(Path(out) / "sglang_dllm.yaml"))
    print(f"wrote {out} (SDAR: {report['tensor_count']} tensors, {report['parameters']:,} parameters, block size "
          f"{report['block_size']}, threshold {report['threshold']}, [MASK] row of the head "
          f"{'zero' if report['mask_row_zero'] else 'as trained'}). Serve it with\n"
          f"    {commands['sglang']}\n    {commands['lmdeploy']}", file=sys.stdout)
    if args.push_to_hub:
        push_sdar_to_hub(out, args.push_to_hub, private=args.private or None)
        print(f"uploaded {out} to https://huggingface.co/{args.push_to_hub}")
    return 0


__all__ = ["add_arguments", "run_export"]
