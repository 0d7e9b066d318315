"""TRL integration: `BDLMSFTConfig`, the block-aligned collator and `BDLMSFTTrainer`."""

from .collator import SAMPLE_ID_COLUMN, BlockAlignedCollator, apply_length_policy, pack_block_aligned
from .config import BDLMSFTConfig
from .trainer import BDLMSFTTrainer

__all__ = [
    "BDLMSFTConfig",
    "BDLMSFTTrainer",
    "BlockAlignedCollator",
    "SAMPLE_ID_COLUMN",
    "apply_length_policy",
    "pack_block_aligned",
]
