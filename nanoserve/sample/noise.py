"""Counter-based random numbers: noise that is a pure function of (seed, position, token id).

A request's draw at output position p depends only on its own seed and p, never on which other
requests share the batch or which row it sits in, so a seeded request is reproducible alone or
batched. The mixer is splitmix64's finalizer over int64 tensors (wrapping arithmetic; logical
right shifts are emulated with masks because torch shifts signed integers arithmetically).
"""

from __future__ import annotations

import torch

_GOLDEN = -0x61C8864680B583EB  # 0x9E3779B97F4A7C15 as a signed int64
_MIX1 = -0x40A7B892E31B1A47  # 0xBF58476D1CE4E5B9
_MIX2 = -0x6B2FB644ECCEEE15  # 0x94D049BB133111EB
_POSITION_STRIDE = 0x632BE59BD9B4E019  # odd, so distinct positions give distinct counters


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finalizer: a bijection on 64-bit integers with good avalanche."""
    x = x + _GOLDEN
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, vocab] float32 uniforms in (0, 1) for rows with int64 `seeds` and `positions` [R]."""
    row_key = mix64(seeds + positions * _POSITION_STRIDE)  # [R]
    token_ids = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    bits = mix64(row_key[:, None] ^ token_ids[None, :])  # [R, vocab]
    # the top 24 bits, centred in their interval: never exactly 0 or 1
    return (_shift_right(bits, 40).float() + 0.5) * (1.0 / (1 << 24))
