"""Block-wise diffusion decoding: a clean KV cache across blocks, parallel denoising inside a block.

One module per concern, bottom to top: the generation config and its transformers hooks (``config``), the settings of
one run resolved against the model (``settings``), the decoding KV cache (``cache``), the clean context a step runs
over, cached or recomputed (``context``), the record of how a run committed each token (``trace``, on request), and
the decoding loop (``loop``: `generate`, `decode_ragged`). The public
names are re-exported here. Tiny CPU example::

    import torch
    from transformers import LlamaConfig
    from hf_bdlm import BlockDiffusionConfig, BlockDiffusionForMaskedLM
    from hf_bdlm.models.block_diffusion.generation import BlockDiffusionGenerationConfig, generate
    cfg = BlockDiffusionConfig(backbone_config=LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, intermediate_size=64),
                               block_size=4, mask_token_id=63)
    model = BlockDiffusionForMaskedLM(cfg).eval()
    out = generate(model, torch.tensor([[1, 2, 3, 4, 5, 6]]), max_new_tokens=10, confidence_threshold=0.9)
"""

from .kv_cache import DecodingCache, StepPlan, StepWindow
from .config import (
    BLOCK_DIFFUSION_FIELDS,
    ENGINE_DEFAULT_THRESHOLDS,
    UNMASKING_STRATEGIES,
    BlockDiffusionGenerationConfig,
    BlockDiffusionGenerationMixin,
    as_block_diffusion_config,
)
from .context import CachedContext, LeftPadding, RecomputedContext
from .loop import BlockCallback, choose_tokens, decode_ragged, denoise_block, generate, tokens_to_unmask
from .settings import DecodeSettings, resolve_settings
from .trace import DecodingTrace, TracedBlock

__all__ = [
    "BLOCK_DIFFUSION_FIELDS",
    "ENGINE_DEFAULT_THRESHOLDS",
    "UNMASKING_STRATEGIES",
    "BlockCallback",
    "BlockDiffusionGenerationConfig",
    "BlockDiffusionGenerationMixin",
    "CachedContext",
    "DecodeSettings",
    "DecodingCache",
    "DecodingTrace",
    "LeftPadding",
    "RecomputedContext",
    "StepPlan",
    "StepWindow",
    "TracedBlock",
    "as_block_diffusion_config",
    "choose_tokens",
    "decode_ragged",
    "denoise_block",
    "generate",
    "resolve_settings",
    "tokens_to_unmask",
]
