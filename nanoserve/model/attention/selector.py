"""Which attention backend runs: chosen once, from the device and the KV cache's dtype."""

from __future__ import annotations

from typing import Any

import torch

from nanoserve.model.attention.base import AttentionBackend
from nanoserve.model.attention.cpu_paged import CpuPagedBackend, can_read_cache_in_place
from nanoserve.model.attention.sdpa import SdpaBackend


def select_attention_backend(device: torch.device, cache_dtype: torch.dtype, *,
                             block_size: int, num_kv_heads: int,
                             num_blocks: int) -> AttentionBackend[Any]:
    """The CPU kernel where it reads a cache of this device and dtype (cpu_paged.py: 2-10x
    the gather's speed), else gather + SDPA. An int8 cache is read by the kernel only."""
    in_place = can_read_cache_in_place(device, cache_dtype)
    if cache_dtype == torch.int8 and not in_place:
        raise ValueError(f"an int8 KV cache needs the CPU attention kernel (device {device})")
    backend = CpuPagedBackend if in_place else SdpaBackend
    return backend(block_size=block_size, num_kv_heads=num_kv_heads, num_blocks=num_blocks,
                   device=device)
