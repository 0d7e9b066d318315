"""hf_bdlm: block diffusion language models on the Hugging Face stack, with block parallelism.

Importing the package registers ``BlockDiffusionConfig`` / ``BlockDiffusionForMaskedLM`` with
``AutoConfig``, ``AutoModel`` and ``AutoModelForMaskedLM``, and the ``"bdlm"`` attention
implementation with transformers.

Registering imports torch and transformers (seconds), which ``import hf_bdlm`` does not do itself: the command
line's parsers and ``--help`` import the package and none of them. So the registration waits for transformers: it
runs at once when transformers is imported already, else the moment transformers' own import finishes (a finder on
``sys.meta_path``, :class:`_RegisterWithTransformers`), so that no code can reach an Auto class before it. The public
names below load on first use (``from hf_bdlm import BlockDiffusionForMaskedLM`` imports the model).
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import threading

from . import moved
from .version import __version__

# name -> module that defines it, imported on first use.
_LAZY = {
    "BlockDiffusionConfig": ".models.block_diffusion.configuration",
    "BlockDiffusionGenerationConfig": ".models.block_diffusion.generation",
    "BlockDiffusionForMaskedLM": ".models.block_diffusion.modeling",
    "BlockDiffusionOutput": ".models.block_diffusion.modeling",
    "pad_to_block_multiple": ".models.block_diffusion.modeling",
    "register_attention": ".attention",
    "convert_causal_lm": ".models.block_diffusion.conversion",
    "BDLMSFTConfig": ".trainer",  # imports TRL
    "BDLMSFTTrainer": ".trainer",
    "BDLMGRPOConfig": ".rl.config",  # imports TRL (docs/rl.md)
    "BDLMGRPOTrainer": ".rl.trainer",
    "export_sdar": ".models.block_diffusion.inference.export_sdar",  # the SDAR folder SGLang and LMDeploy serve (docs/deploy.md)
    "BlockParallelPlugin": ".parallel.plugin",
}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is not None:
        return getattr(importlib.import_module(module, __name__), name)
    raise AttributeError(f"module 'hf_bdlm' has no attribute {name!r}")


def register() -> None:
    """Register the block diffusion classes with transformers' Auto classes and the ``"bdlm"`` attention (idempotent;
    ``import hf_bdlm`` arranges it, see the module docstring)."""
    global _registered, _pending
    with _lock:
        if _registered:
            return
        _registered = True  # first: the imports below come through the finder, which must let them be
        _pending = False
        _remove_finder()
        try:
            # lazy: import hf_bdlm stays free of torch: registering waits for transformers (module docstring)
            from transformers import AutoConfig, AutoModel, AutoModelForMaskedLM

            # lazy: import hf_bdlm stays free of torch: registering waits for transformers (module docstring)
            from .attention import register_attention
            from .models.block_diffusion.configuration import BlockDiffusionConfig
            from .models.block_diffusion.modeling import BlockDiffusionForMaskedLM
        except BaseException:
            _registered = False
            raise
        register_attention()
        AutoConfig.register(BlockDiffusionConfig.model_type, BlockDiffusionConfig, exist_ok=True)
        AutoModel.register(BlockDiffusionConfig, BlockDiffusionForMaskedLM, exist_ok=True)
        AutoModelForMaskedLM.register(BlockDiffusionConfig, BlockDiffusionForMaskedLM, exist_ok=True)


_lock = threading.RLock()
_registered = False
_pending = False  # transformers is imported; the registration waits for an hf_bdlm import in progress to finish
_depth = threading.local()  # .value: hf_bdlm module imports in progress in this thread


class _RegisterWithTransformers(importlib.abc.MetaPathFinder):
    """Runs :func:`register` when the import of transformers finishes.

    hf_bdlm's own modules import transformers, and registering imports some of them (the model's configuration and
    modeling): when transformers is first imported from inside one of them, that module is half made, and registering
    then would meet it (a circular import). So the finder also watches the imports of hf_bdlm's modules and, in that
    case, registers when the outermost one in progress has finished. It finds nothing itself: it wraps the loader
    the other finders return, and puts that loader back on the module before running it.
    """

    def find_spec(self, name, path=None, target=None):
        if _registered or not (name == "transformers" or name.startswith("hf_bdlm.")):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader)
        return spec


class _Loader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def __getattr__(self, name):  # get_code, get_source, get_resource_reader, ...: the real loader's
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        global _pending
        module.__loader__ = module.__spec__.loader = self.loader
        if module.__name__ == "transformers":
            self.loader.exec_module(module)
            if getattr(_depth, "value", 0):
                _pending = True
            else:
                register()
            return
        _depth.value = getattr(_depth, "value", 0) + 1
        try:
            self.loader.exec_module(module)
        finally:
            _depth.value -= 1
        if _pending and not _depth.value:
            register()


def _remove_finder() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _RegisterWithTransformers)]


if "transformers" in sys.modules:
    register()
else:
    _remove_finder()  # a re-import (importlib.reload) installs one finder, not two
    sys.meta_path.insert(0, _RegisterWithTransformers())
moved.install()  # old module paths (hf_bdlm/moved.py) still import, with a DeprecationWarning, for one release


__all__ = [
    "BDLMGRPOConfig",
    "BDLMGRPOTrainer",
    "BDLMSFTConfig",
    "BDLMSFTTrainer",
    "BlockDiffusionConfig",
    "BlockDiffusionForMaskedLM",
    "BlockDiffusionGenerationConfig",
    "BlockDiffusionOutput",
    "BlockParallelPlugin",
    "convert_causal_lm",
    "export_sdar",
    "pad_to_block_multiple",
    "register",
]
