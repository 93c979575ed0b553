"""Counter-based random numbers: noise that is a pure function of (seed, position, token id).

A request's draw at output position p depends only on its own seed, p and the token ids, never
on which other requests share the batch, which row it sits in, or how many candidates the
sampler looked at: the same token always gets the same noise. So a seeded request gives the
same tokens alone or batched.

Two levels: a 64-bit row key mixes (seed, position) with splitmix64 (R values per step, so cost
does not matter); each token's noise then mixes (row key, token id) with murmur3's 32-bit
finalizer, because int32 multiplies vectorize on AVX2 where int64 ones do not (~3x faster over
[rows, vocab]). torch shifts signed integers arithmetically, so logical right shifts are
emulated with masks. csrc/sampling_simd.h computes the same keys, hashes and uniforms bit for
bit, and the same noise within one float ulp (tests/sample/test_fused.py checks every uniform).
"""

from __future__ import annotations

import torch

_GOLDEN64 = -0x61C8864680B583EB  # 0x9E3779B97F4A7C15 as a signed int64
_MIX64_1 = -0x40A7B892E31B1A47  # 0xBF58476D1CE4E5B9
_MIX64_2 = -0x6B2FB644ECCEEE15  # 0x94D049BB133111EB
_POSITION_STRIDE = 0x632BE59BD9B4E019  # odd: distinct positions give distinct counters
_TOKEN_STRIDE32 = -0x61C88647  # 0x9E3779B9: odd, so token -> token * stride is a bijection
_FMIX32_1 = -0x7A143595  # 0x85EBCA6B
_FMIX32_2 = -0x3D4D51CB  # 0xC2B2AE35
_UNIFORM_SCALE = 1.0 / (1 << 24)
_UNIFORM_MAX = 1.0 - 1.0 / (1 << 24)  # the largest float32 below 1


def _shift_right(x: torch.Tensor, bits: int, width: int) -> torch.Tensor:
    return (x >> bits) & ((1 << (width - bits)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer: a bijection on 64-bit integers with good avalanche."""
    x = x + _GOLDEN64
    x = (x ^ _shift_right(x, 30, 64)) * _MIX64_1
    x = (x ^ _shift_right(x, 27, 64)) * _MIX64_2
    return x ^ _shift_right(x, 31, 64)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[R] int32 keys for rows drawing at output `positions` with int64 `seeds`."""
    key = mix64(seeds + positions * _POSITION_STRIDE)
    return (key ^ _shift_right(key, 32, 64)).to(torch.int32)  # fold to 32 bits (wraps)


def token_hashes(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """int32 hashes of (row key [R], token id ([V] or [R, K])): murmur3's finalizer."""
    tokens = token_ids.to(torch.int32)
    h = (tokens if tokens.dim() == 2 else tokens[None, :]) * _TOKEN_STRIDE32
    h = h ^ keys[:, None]  # [R, V or K], a fresh tensor from here on: update in place
    h ^= _shift_right(h, 16, 32)
    h *= _FMIX32_1
    h ^= _shift_right(h, 13, 32)
    h *= _FMIX32_2
    h ^= _shift_right(h, 16, 32)
    return h


def uniform_from_hashes(h: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1), float32, from the top 24 bits of each hash: (k + 0.5) / 2^24,
    centred in their interval. Above 2^23, k + 0.5 rounds to an even integer in float32, and
    k = 2^24 - 1 to 2^24, which would give u = 1 and infinite noise (that token would win
    whatever its probability): the clamp keeps u below 1."""
    u = _shift_right(h, 8, 32).float()
    return u.add_(0.5).mul_(_UNIFORM_SCALE).clamp_(max=_UNIFORM_MAX)


def gumbel_from_hashes(h: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise, float32, from hashes: -log(-log(u))."""
    return uniform_from_hashes(h).log_().neg_().log_().neg_()


def uniform_noise(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1), float32, for each row key [R] and token id ([V] or [R, K])."""
    return uniform_from_hashes(token_hashes(keys, token_ids))


def gumbel_noise(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise: argmax(logits + noise) samples from softmax(logits)."""
    return gumbel_from_hashes(token_hashes(keys, token_ids))


def row_uniforms(seeds: torch.Tensor, positions: torch.Tensor, salt: int) -> torch.Tensor:
    """One uniform in (0, 1) per row [R], float32, for a row's own decisions (XTC's coin):
    the uniform of token 0 under the key of (seed ^ salt, position). A salt gives a stream
    apart from the draw's noise, whose keys mix the seed itself; `salt` fits in an int64."""
    keys = row_keys(seeds ^ salt, positions)
    return uniform_noise(keys, torch.zeros(1, dtype=torch.int64, device=keys.device))[:, 0]
