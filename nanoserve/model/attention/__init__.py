"""Attention over the paged KV cache: one object per backend, each building its own metadata.

base.py says what a backend is; kv_rows.py owns the cache's row layout; sdpa.py and
cpu_paged.py are the two backends; selector.py picks one.
"""

from nanoserve.model.attention.base import AttentionBackend, AttentionMetadata
from nanoserve.model.attention.cpu_paged import (
    CpuPagedBackend,
    CpuPagedMetadata,
    can_read_cache_in_place,
)
from nanoserve.model.attention.kv_rows import (
    KV_INT8_SCALE_BYTES,
    cache_row_elements,
    dequantize_kv_rows,
    head_block_rows,
    quantize_kv_rows,
    write_kv_cache,
)
from nanoserve.model.attention.sdpa import (
    GatheredDecodes,
    PrefillChunk,
    SdpaBackend,
    SdpaMetadata,
)
from nanoserve.model.attention.selector import select_attention_backend

__all__ = [
    "KV_INT8_SCALE_BYTES",
    "AttentionBackend",
    "AttentionMetadata",
    "CpuPagedBackend",
    "CpuPagedMetadata",
    "GatheredDecodes",
    "PrefillChunk",
    "SdpaBackend",
    "SdpaMetadata",
    "cache_row_elements",
    "can_read_cache_in_place",
    "dequantize_kv_rows",
    "head_block_rows",
    "quantize_kv_rows",
    "select_attention_backend",
    "write_kv_cache",
]
