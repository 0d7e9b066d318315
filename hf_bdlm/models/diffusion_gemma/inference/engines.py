"""What vLLM and SGLang read of a DiffusionGemma checkpoint, and the commands that serve it as `generate` decodes it.

Both engines serve transformers' `DiffusionGemmaForBlockDiffusion` natively: vLLM (0.34.0, ``vllm serve DIR``) and
SGLang (0.5.23, ``--dllm-algorithm Gemma4Renoise``). They load ``config.json`` through transformers' own config class,
which supplies every field a checkpoint leaves at its default, but they read the decoding settings differently:

- vLLM reads them from ``generation_config.json`` with a plain ``GenerationConfig`` (no defaults of DiffusionGemma's
  own): ``t_min``, ``t_max``, ``confidence_threshold`` and ``stability_threshold`` are indexed without a default, and
  ``sampler_config`` must be an ``EntropyBoundSamplerConfig`` with a positive ``entropy_bound``;
- SGLang reads them from its ``--dllm-algorithm-config`` YAML, each with a default of its own.

transformers' `DiffusionGemmaGenerationConfig` leaves those fields ``None`` until `generate` fills them in, and saves
them as ``null``: a model built from a config (rather than loaded from a published checkpoint) is saved with a
generation config vLLM cannot start from. :func:`fill_decoding_settings` writes the values `generate` uses into the
model's generation config; the family applies it before training, so every checkpoint the trainer saves carries them.

    from hf_bdlm.models.diffusion_gemma.inference.engines import engine_field_problems, launch_commands
    engine_field_problems("runs/dg/checkpoint-50")    # [] when vLLM and SGLang find every field they read
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from transformers import AutoConfig, GenerationConfig
from transformers.models.diffusion_gemma.generation_diffusion_gemma import DiffusionGemmaGenerationConfig

# config.json as the engines see it (after transformers' config class), field -> where it is read.
CONFIG_FIELDS = {
    "architectures[0] == 'DiffusionGemmaForBlockDiffusion'":
        "vllm/model_executor/models/registry.py:429; sglang/srt/dllm/config.py:56,63-66",
    "canvas_length": "vllm/model_executor/models/config.py:677 (default 256); sglang/srt/dllm/config.py:57 (default 256)",
    "tie_word_embeddings (True)": "sglang/srt/dllm/algorithm/gemma4_renoise.py:97-101, srt/models/gemma4_diffusion.py:459-463",
    "text_config.tie_word_embeddings (True)": "vllm/model_executor/models/diffusion_gemma.py:250; sglang as above",
    "text_config.vocab_size": "vllm diffusion_gemma.py:244,260; sglang gemma4_renoise.py:234",
    "text_config.hidden_size": "vllm diffusion_gemma.py:245,269,888; sglang gemma4_diffusion.py:109",
    "text_config.intermediate_size": "vllm diffusion_gemma.py:266 (self-conditioning width); sglang gemma4_diffusion.py:242",
    "text_config.rms_norm_eps": "vllm diffusion_gemma.py:271; sglang gemma4_diffusion.py:126",
    "text_config.final_logit_softcapping": "vllm diffusion_gemma.py:256-258 (None: no soft-capping)",
    "text_config.layer_types": "sglang gemma4_diffusion.py:87,274",
    "text_config.sliding_window": "sglang gemma4_diffusion.py:90",
    "text_config.rope_parameters (per layer type)": "sglang gemma4_diffusion.py:132",
    "text_config.num_hidden_layers": "sglang gemma4_diffusion.py:411",
}
# generation_config.json, read by vLLM with a plain GenerationConfig: field -> where (vllm/model_executor/models/).
GENERATION_FIELDS = {
    "max_denoising_steps": "diffusion_gemma.py:879-881 (default 48; --diffusion-config overrides)",
    "stability_threshold": "diffusion_gemma.py:892 (indexed: required, an integer)",
    "sampler_config._cls_name": "diffusion_gemma.py:931-933 (must name EntropyBound)",
    "sampler_config.entropy_bound": "diffusion_gemma.py:934-938 (must be positive)",
    "t_min": "diffusion_gemma.py:951 (indexed: required)",
    "t_max": "diffusion_gemma.py:952 (indexed: required)",
    "confidence_threshold": "diffusion_gemma.py:954 (indexed: required)",
}
DECODING_FIELDS = ("max_denoising_steps", "sampler_config", "t_min", "t_max", "stability_threshold",
                   "confidence_threshold")


def fill_decoding_settings(generation_config) -> list[str]:
    """Set every unset decoding field of a `DiffusionGemmaGenerationConfig` to the value `generate` uses for it, in
    place; returns the names set. (`generate` fills them from the config class's defaults at every call: written into
    the config, they reach ``generation_config.json`` and the engines that read it.)"""
    # The class's own table of those defaults (transformers' models/diffusion_gemma/generation_diffusion_gemma.py,
    # `_get_default_generation_params`, applied in `_prepare_generation_config`): one source, so the engines decode
    # with exactly what generate does here.
    defaults = type(generation_config)._get_default_generation_params()
    filled = []
    for name in DECODING_FIELDS:
        if getattr(generation_config, name, None) is None and name in defaults:
            setattr(generation_config, name, defaults[name])
            filled.append(name)
    return filled


def engine_field_problems(folder: str | os.PathLike) -> list[str]:
    """What vLLM or SGLang would miss in a saved DiffusionGemma folder (an empty list: nothing)."""
    root = Path(folder)
    problems = []
    config = AutoConfig.from_pretrained(root)
    if (getattr(config, "architectures", None) or [None])[0] != "DiffusionGemmaForBlockDiffusion":
        problems.append(f"architectures={getattr(config, 'architectures', None)!r}: both engines pick their "
                        "DiffusionGemma path by 'DiffusionGemmaForBlockDiffusion'")
    text = config.get_text_config()
    if not (getattr(config, "tie_word_embeddings", False) and getattr(text, "tie_word_embeddings", False)):
        problems.append("SGLang's Gemma4Renoise requires tied word embeddings (tie_word_embeddings in config.json and "
                        "in text_config)")
    for name in ("canvas_length",):
        if not isinstance(getattr(config, name, None), int):
            problems.append(f"config {name}={getattr(config, name, None)!r}")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "rms_norm_eps", "layer_types", "sliding_window",
                 "rope_parameters", "num_hidden_layers"):
        if getattr(text, name, None) is None:
            problems.append(f"text_config.{name} is missing")
    if not (root / "generation_config.json").is_file():
        return problems + ["no generation_config.json: vLLM reads t_min, t_max, confidence_threshold, "
                           "stability_threshold and sampler_config from it"]
    generation = GenerationConfig.from_pretrained(root).to_diff_dict()  # what vLLM reads (its try_get_generation_config)
    for name in ("t_min", "t_max", "confidence_threshold"):
        if not isinstance(generation.get(name), (int, float)) or isinstance(generation.get(name), bool):
            problems.append(f"generation_config.json {name}={generation.get(name)!r} (vLLM indexes it: a number)")
    if not isinstance(generation.get("stability_threshold"), int) or isinstance(generation.get("stability_threshold"),
                                                                                bool):
        problems.append(f"generation_config.json stability_threshold={generation.get('stability_threshold')!r} "
                        "(vLLM adds 1 to it: an integer)")
    sampler = generation.get("sampler_config") or {}
    if "EntropyBound" not in str(sampler.get("_cls_name", "")) or not (sampler.get("entropy_bound") or 0) > 0:
        problems.append(f"generation_config.json sampler_config={generation.get('sampler_config')!r} (vLLM needs an "
                        "EntropyBoundSamplerConfig with a positive entropy_bound)")
    steps = generation.get("max_denoising_steps")
    if steps is not None and (not isinstance(steps, int) or steps < 1):
        problems.append(f"generation_config.json max_denoising_steps={steps!r}")
    return problems


def decoding_settings(folder: str | os.PathLike) -> dict:
    """The decoding settings of a saved folder's ``generation_config.json``, with `generate`'s defaults for unset
    ones: ``max_denoising_steps``, ``entropy_bound``, ``t_min``, ``t_max``, ``confidence_threshold``,
    ``stability_threshold``."""
    path = Path(folder) / "generation_config.json"
    raw = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    config = DiffusionGemmaGenerationConfig(**{k: raw[k] for k in DECODING_FIELDS if raw.get(k) is not None})
    fill_decoding_settings(config)
    return {"max_denoising_steps": config.max_denoising_steps, "entropy_bound": config.sampler_config.entropy_bound,
            "t_min": config.t_min, "t_max": config.t_max, "confidence_threshold": config.confidence_threshold,
            "stability_threshold": config.stability_threshold}


def sglang_renoise_yaml(settings: dict) -> str:
    """SGLang's ``--dllm-algorithm-config`` for Gemma4Renoise with ``settings`` (:func:`decoding_settings`): SGLang reads
    them there, not from the checkpoint (sglang/srt/dllm/algorithm/gemma4_renoise.py:180-195)."""
    return (f"max_denoising_steps: {settings['max_denoising_steps']}\n"
            f"sampler_config:\n  entropy_bound: {settings['entropy_bound']}\n"
            f"temperature_schedule:\n  t_min: {settings['t_min']}\n  t_max: {settings['t_max']}\n"
            f"stopping_config:\n  confidence_threshold: {settings['confidence_threshold']}\n"
            f"  stability_threshold: {settings['stability_threshold']}\n")


def launch_commands(model_ref: str, canvas_length: int, settings: dict, yaml_file: str = "dg_renoise.yaml") -> dict:
    """vLLM's and SGLang's commands serving ``model_ref`` (a folder or Hub id) with ``settings``."""
    yaml_text = sglang_renoise_yaml(settings).replace("\n", "\\n")
    diffusion = json.dumps({"canvas_length": canvas_length, "max_denoising_steps": settings["max_denoising_steps"]})
    return {
        "vllm": f"vllm serve {model_ref} --diffusion-config '{diffusion}'",
        "sglang": f"printf '{yaml_text}' > {yaml_file}\n"
                  f"python -m sglang.launch_server --model-path {model_ref} --dllm-algorithm Gemma4Renoise "
                  f"--dllm-algorithm-config {yaml_file}",
    }


__all__ = ["CONFIG_FIELDS", "GENERATION_FIELDS", "decoding_settings", "engine_field_problems",
           "fill_decoding_settings", "launch_commands", "sglang_renoise_yaml"]
