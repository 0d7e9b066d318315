"""Block-diffusion attention: the mask rule, row metadata, block-sparse planning and backends."""

from .backends import BACKENDS, BackendUnavailable, attend
from .interface import ATTENTION_NAME, AttentionLayout, LocalLayout, register_attention
from .masks import CLEAN, NOISY, MaskRule, allowed, dense_mask
from .rows import RowMeta, check_block_aligned_documents, vectorized_rows

__all__ = [
    "ATTENTION_NAME",
    "AttentionLayout",
    "BACKENDS",
    "BackendUnavailable",
    "CLEAN",
    "LocalLayout",
    "MaskRule",
    "NOISY",
    "RowMeta",
    "allowed",
    "attend",
    "check_block_aligned_documents",
    "dense_mask",
    "register_attention",
    "vectorized_rows",
]
