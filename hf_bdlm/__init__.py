"""hf_bdlm: block diffusion language models on the Hugging Face stack, with block parallelism.

Importing the package registers ``BlockDiffusionConfig`` / ``BlockDiffusionForMaskedLM`` with
``AutoConfig``, ``AutoModel`` and ``AutoModelForMaskedLM``, and the ``"bdlm"`` attention
implementation with transformers.
"""

from transformers import AutoConfig, AutoModel, AutoModelForMaskedLM

from .attention import register_attention
from .models.block_diffusion.configuration import BlockDiffusionConfig
from .models.block_diffusion.generation import BlockDiffusionGenerationConfig
from .models.block_diffusion.modeling import BlockDiffusionForMaskedLM, BlockDiffusionOutput, pad_to_block_multiple
from .version import __version__

register_attention()
AutoConfig.register(BlockDiffusionConfig.model_type, BlockDiffusionConfig, exist_ok=True)
AutoModel.register(BlockDiffusionConfig, BlockDiffusionForMaskedLM, exist_ok=True)
AutoModelForMaskedLM.register(BlockDiffusionConfig, BlockDiffusionForMaskedLM, exist_ok=True)


def __getattr__(name):
    # Heavier modules load on first use.
    if name == "convert_causal_lm":
        from .models.block_diffusion.conversion import convert_causal_lm

        return convert_causal_lm
    if name in ("BDLMSFTConfig", "BDLMSFTTrainer"):  # imports TRL
        from . import trainer

        return getattr(trainer, name)
    if name == "export_sdar":  # the SDAR folder SGLang and LMDeploy serve (docs/deploy.md)
        from .models.block_diffusion.export_sdar import export_sdar

        return export_sdar
    if name == "BlockParallelPlugin":
        from .parallel.plugin import BlockParallelPlugin

        return BlockParallelPlugin
    raise AttributeError(f"module 'hf_bdlm' has no attribute {name!r}")


__all__ = [
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
]
