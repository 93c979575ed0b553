"""The fused element-wise kernels (`csrc/fused_ops.cpp`) against the plain PyTorch ops they
replace (layer_ops.py's EXACT_OPS), on odd shapes and both KV cache dtypes.

Tolerances: norms, SiLU and GELU-tanh within 1e-5 relative (another summation order, another exp
polynomial: measured ~4e-7); RoPE within 1e-6; v and the untouched cache rows exactly; the
float16 cache within one float16 step of the reference's own rounding (a k that differs in its
last float32 bit may round the other way).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanoserve.model.arch import ArchConfig, RopeScaling
from nanoserve.model.attention import dequantize_kv_rows, quantize_kv_rows, write_kv_cache
from nanoserve.model.fused_ops import fused_ops, kernels
from nanoserve.model.rope import RotaryEmbedding, apply_rope, inverse_frequencies

if kernels() is None:
    pytest.skip("fused_ops kernel unavailable", allow_module_level=True)

OPS = fused_ops()
EPS = 1e-6
# (rows, features): one decode, odd widths that leave masked tails, a batch, a prefill chunk
ROW_SHAPES = [(1, 576), (3, 13), (5, 7), (64, 576), (700, 64)]


def assert_close(ours: torch.Tensor, ref: torch.Tensor, rtol: float) -> None:
    torch.testing.assert_close(ours, ref, rtol=rtol, atol=rtol * ref.abs().max().item())


@pytest.mark.parametrize(("rows", "features"), ROW_SHAPES)
def test_rms_norm_matches_torch(rows: int, features: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + features)
    x = 3 * torch.randn(rows, features, generator=gen)
    weight = torch.rand(features, generator=gen) + 0.5
    assert_close(OPS.rms_norm(x, weight, EPS), F.rms_norm(x, (features,), weight, EPS), 1e-5)


@pytest.mark.parametrize(("rows", "features"), ROW_SHAPES)
def test_add_rms_norm_adds_in_place_then_normalizes(rows: int, features: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + features)
    hidden = torch.randn(rows, features, generator=gen)
    delta = torch.randn(rows, features, generator=gen)
    weight = torch.rand(features, generator=gen) + 0.5
    expected_sum = hidden + delta
    normed = OPS.add_rms_norm(hidden, delta, weight, EPS)
    assert torch.equal(hidden, expected_sum)  # the residual stream, updated in place
    assert_close(normed, F.rms_norm(expected_sum, (features,), weight, EPS), 1e-5)


@pytest.mark.parametrize(("rows", "features"), ROW_SHAPES)
def test_silu_mul_matches_torch(rows: int, features: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + features)
    gate_up = 4 * torch.randn(rows, 2 * features, generator=gen)
    gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0])[: min(3, features)]  # exp's clamps
    gate, up = gate_up.chunk(2, dim=-1)
    out = OPS.silu_mul(gate_up)
    assert out.shape == (rows, features) and torch.isfinite(out).all()
    assert_close(out, F.silu(gate) * up, 1e-5)


@pytest.mark.parametrize(("rows", "features"), ROW_SHAPES)
def test_gelu_tanh_mul_matches_torch(rows: int, features: int) -> None:
    """Gemma's gate, against F.gelu(approximate="tanh") computed in float64 (float32's own
    1 + tanh cancels below ~-3, where the kernel's sigmoid form does not)."""
    gen = torch.Generator().manual_seed(rows * 1000 + features)
    gate_up = 4 * torch.randn(rows, 2 * features, generator=gen)
    gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0])[: min(3, features)]  # exp's clamps
    gate, up = gate_up.double().chunk(2, dim=-1)
    out = OPS.gelu_tanh_mul(gate_up)
    assert out.shape == (rows, features) and torch.isfinite(out).all()
    assert_close(out, (F.gelu(gate, approximate="tanh") * up).float(), 1e-5)


def test_norms_refuse_mismatched_shapes() -> None:
    with pytest.raises(RuntimeError, match="weight must be a contiguous float32"):
        OPS.rms_norm(torch.randn(2, 8), torch.ones(7), EPS)
    with pytest.raises(RuntimeError, match="must match hidden"):
        OPS.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), EPS)


def rope_arch(head_dim: int) -> ArchConfig:
    """Llama 3.1 scaling, so the kernel must read the table rather than recompute angles."""
    return ArchConfig(family="llama", vocab_size=10, hidden_size=64, intermediate_size=64,
                      num_layers=1, num_heads=4, num_kv_heads=2, head_dim=head_dim,
                      rms_norm_eps=EPS, rope_theta=500000.0, max_position_embeddings=4096,
                      tie_word_embeddings=False, has_qkv_bias=False, has_qk_norm=False,
                      rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64))


def plain_rope_store(qkv: torch.Tensor, bias: torch.Tensor | None, q_norm: torch.Tensor | None,
                     k_norm: torch.Tensor | None, rope: RotaryEmbedding,
                     positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     cache_index: torch.Tensor, num_heads: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The exact table's ops: bias, q/k norm, apply_rope, write_kv_cache -> (q, k, v)."""
    num_tokens = qkv.shape[0]
    num_kv_heads, head_dim = k_cache.shape[0], qkv.shape[1] // (num_heads + 2 * k_cache.shape[0])
    if bias is not None:
        qkv = qkv + bias
    q, k, v = qkv.view(num_tokens, -1, head_dim).split([num_heads, num_kv_heads, num_kv_heads],
                                                       dim=1)
    if q_norm is not None and k_norm is not None:
        q = F.rms_norm(q, (head_dim,), q_norm, EPS)
        k = F.rms_norm(k, (head_dim,), k_norm, EPS)
    cos, sin = rope.lookup(positions)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    write_kv_cache(k, v, k_cache, v_cache, cache_index)
    return q, k, v


ROPE_CASES = [(1, 64, "llama"), (7, 64, "qwen2"), (5, 32, "qwen3"), (3, 16, "both"),
              (33, 6, "llama"), (2, 34, "both"), (300, 64, "llama")]


@pytest.mark.parametrize(("num_tokens", "head_dim", "variant", "cache_dtype"), [
    *((*case, dtype) for case in ROPE_CASES for dtype in (torch.float32, torch.float16)),
    # int8 rows need a head_dim that is a multiple of 8
    *((*case, torch.int8) for case in ROPE_CASES if case[1] % 8 == 0),
])
def test_rope_store_matches_the_plain_ops(num_tokens: int, head_dim: int, variant: str,
                                          cache_dtype: torch.dtype) -> None:
    num_heads, num_kv_heads, block_size, num_blocks = 6, 2, 16, 40
    gen = torch.Generator().manual_seed(num_tokens * 100 + head_dim)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen)
    has_bias, has_norm = variant in ("qwen2", "both"), variant in ("qwen3", "both")
    bias = torch.randn(width, generator=gen) if has_bias else None
    q_norm = torch.rand(head_dim, generator=gen) + 0.5 if has_norm else None
    k_norm = torch.rand(head_dim, generator=gen) + 0.5 if has_norm else None
    rope = RotaryEmbedding(inverse_frequencies(rope_arch(head_dim)), 4096, torch.float32,
                           torch.device("cpu"))
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen)
    # distinct rows, shuffled over the cache, as a block table makes them
    cache_index = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=gen) for _ in range(2))
    if cache_dtype == torch.int8:
        k_cache, v_cache = quantize_kv_rows(k_cache), quantize_kv_rows(v_cache)
    else:
        k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    q_exp, k_exp, v_exp = plain_rope_store(qkv, bias, q_norm, k_norm, rope, positions, k_ref,
                                           v_ref, cache_index, num_heads)
    ours = qkv.clone()
    q = OPS.rope_store(ours, bias, q_norm, k_norm, EPS, rope.cos_table, rope.sin_table,
                       positions, k_cache, v_cache, cache_index)

    tol = 1e-5 if has_norm else 1e-6
    assert q.shape == (num_tokens, num_heads, head_dim)
    assert_close(q, q_exp, tol)
    # qkv keeps the rotated k and the biased v, for prefill chunks that attend to themselves
    k_cols = ours[:, num_heads * head_dim:].view(num_tokens, -1, head_dim)
    assert_close(k_cols[:, :num_kv_heads], k_exp, tol)
    assert torch.equal(k_cols[:, num_kv_heads:], v_exp)
    assert torch.equal(v_cache, v_ref)  # every row: the new ones, and the rest untouched
    if cache_dtype == torch.float32:
        assert_close(k_cache, k_ref, tol)
    elif cache_dtype == torch.int8:  # within one int8 step of the reference's rounding
        ours_k, ref_k = dequantize_kv_rows(k_cache), dequantize_kv_rows(k_ref)
        step = ref_k.abs().amax(dim=-1, keepdim=True) / 127
        assert ((ours_k - ref_k).abs() <= step * (1 + 1e-5)).all()
    else:  # within one float16 step of the reference's rounding
        step = k_ref.float().abs().clamp(min=2**-14) * 2**-10
        assert ((k_cache.float() - k_ref.float()).abs() <= step).all()
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[cache_index] = True
    untouched = ~written.view(num_blocks, block_size)
    assert torch.equal(k_cache[:, untouched], k_ref[:, untouched])


def test_rope_store_refuses_rows_outside_the_cache_and_the_table() -> None:
    num_heads, num_kv_heads, head_dim = 2, 1, 8
    qkv = torch.randn(2, (num_heads + 2 * num_kv_heads) * head_dim)
    table = torch.randn(100, head_dim)
    cache = torch.zeros(num_kv_heads, 4, 16, head_dim)
    ok = torch.tensor([0, 63])

    def call(positions: torch.Tensor, cache_index: torch.Tensor) -> torch.Tensor:
        return OPS.rope_store(qkv, None, None, None, EPS, table, table, positions, cache,
                              cache.clone(), cache_index)

    with pytest.raises(RuntimeError, match=r"cache_index\[1\] = 64 is outside the cache"):
        call(ok, torch.tensor([0, 64]))
    with pytest.raises(RuntimeError, match=r"positions\[0\] = 100 is outside the RoPE table"):
        call(torch.tensor([100, 0]), ok)
    with pytest.raises(RuntimeError, match="float32, float16 or int8"):
        OPS.rope_store(qkv, None, None, None, EPS, table, table, ok,
                       cache.bfloat16(), cache.bfloat16(), ok)
