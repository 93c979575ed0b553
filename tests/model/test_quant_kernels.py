"""The quantized-weight kernels (`csrc/quant_matmul.cpp`) against gguf's own dequantization.

Tolerances. The kernel rounds each row of x to int8 blocks of 32 (scale max|x| / 127) and is
otherwise exact integer arithmetic plus float32 scaling, so it is checked two ways:
- against an emulation in float64 of the same rounding, W_gguf @ x8, where the only difference
  is float32 accumulation of at most K / 32 block terms: 1e-5 of sum(|W| |x8|) per output;
- against plain float32 W_gguf @ x: the 8-bit rounding error is ~1/(127 * sqrt(12)) of a block's
  max|x| per input and averages out over a dot product, ~5e-3 of the output norm Gaussian data
  gives on average (|w| |x| / sqrt(K) an output); 2e-2 of it leaves room without hiding a wrong
  scale, offset or nibble order (those give O(1)).
`rows` and `dequantize` must equal gguf's dequantization bit for bit (all scale products the
kernel stores are exact in float32), on random blocks and on a real file's (Gemma 3 270M's
Q5_0, Q4_K, Q6_K and Q8_0 tensors, where its package is installed).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from nanoserve.kernel_tuning.schedule import WIDE_MIN_ROWS
from nanoserve.model import weights
from nanoserve.model.gguf_file import GGUFFile
from nanoserve.model.quant_linear import (
    BLOCK_FORMATS,
    GGML_Q4_0,
    GGML_Q4_1,
    GGML_Q4_K,
    GGML_Q5_0,
    GGML_Q5_1,
    GGML_Q5_K,
    GGML_Q6_K,
    GGML_Q8_0,
    WIDE_TYPES,
    QuantizedWeight,
    kernels,
    quantize_q8_0,
)

ALL_TYPES = [GGML_Q8_0, GGML_Q4_0, GGML_Q4_1, GGML_Q5_0, GGML_Q5_1, GGML_Q4_K, GGML_Q5_K,
             GGML_Q6_K]
TYPE_IDS = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
# ggml type -> the byte offsets of a block's f16 scales (random bytes there could be NaN)
SCALE_OFFSETS = {GGML_Q4_K: (0, 2), GGML_Q5_K: (0, 2), GGML_Q6_K: (208,)}


@pytest.fixture(scope="module")
def native():
    module = kernels()
    if module is None:
        pytest.skip("the quant_matmul C++ extension is unavailable (see the warning for why)")
    return module


def make_raw(ggml_type: int, num_rows: int, in_features: int, seed: int = 0) -> np.ndarray:
    """Valid raw GGUF rows: gguf's quantizer where it has one, else random bytes whose f16
    super-block scales are set to sane values (Q4_K, Q5_K: d, dmin; Q6_K: d)."""
    rng = np.random.default_rng(seed)
    if ggml_type not in SCALE_OFFSETS:
        weight = rng.standard_normal((num_rows, in_features)).astype(np.float32)
        return quantize(weight, GGMLQuantizationType(ggml_type))
    block, size = BLOCK_FORMATS[ggml_type]
    raw = rng.integers(0, 256, (num_rows, in_features // block, size), dtype=np.uint8)
    for offset in SCALE_OFFSETS[ggml_type]:
        scale = rng.uniform(1e-3, 1e-2, raw.shape[:2]).astype(np.float16)
        raw[..., offset : offset + 2] = scale[..., None].view(np.uint8)
    return raw.reshape(num_rows, -1)


def reference_weight(raw: np.ndarray, ggml_type: int, shape: tuple[int, int]) -> torch.Tensor:
    values = dequantize(raw, GGMLQuantizationType(ggml_type))
    return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(shape))


def emulate_int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the kernel rounds it: per block of 32, q = rint(x * (127 / max|x|))."""
    blocks = x.reshape(-1, 32)
    max_abs = blocks.abs().amax(dim=1, keepdim=True)
    inverse = torch.where(max_abs == 0, torch.zeros_like(max_abs), 127 / max_abs)
    q = torch.round(blocks * inverse)  # half to even, like _mm256_cvtps_epi32
    return (q.double() * (max_abs / 127).double()).reshape(x.shape)


def shape_for(ggml_type: int, num_rows: int) -> tuple[int, int]:
    # two super-blocks for the K-quants; three blocks of 32 (an odd count) for the others
    return (num_rows, 512 if BLOCK_FORMATS[ggml_type][0] == 256 else 96)


@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=TYPE_IDS)
@pytest.mark.parametrize("num_rows", [1, 13, 40])
def test_rows_and_dequantize_equal_gguf(native, ggml_type: int, num_rows: int) -> None:
    shape = shape_for(ggml_type, num_rows)
    raw = make_raw(ggml_type, *shape)
    expected = reference_weight(raw, ggml_type, shape)
    weight = QuantizedWeight.from_gguf(raw, ggml_type, shape)
    assert weight.is_packed
    ids = torch.tensor([num_rows - 1, 0, num_rows // 2, num_rows - 1])
    assert torch.equal(weight.rows(ids), expected[ids])
    assert torch.equal(weight.dequantize(), expected)
    raw_rows = native.quant_rows(torch.from_numpy(raw.reshape(-1).copy()), ggml_type, ids,
                                 shape[1])
    assert torch.equal(raw_rows, expected[ids])


@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=TYPE_IDS)
@pytest.mark.parametrize("num_x_rows", [1, 3, 17, 64])
@pytest.mark.parametrize("num_rows", [1, 13, 40])
def test_matmul_equals_int8_emulation(ggml_type: int, num_x_rows: int, num_rows: int) -> None:
    shape = shape_for(ggml_type, num_rows)
    raw = make_raw(ggml_type, *shape, seed=num_rows)
    w = reference_weight(raw, ggml_type, shape).double()
    x = torch.randn(num_x_rows, shape[1], generator=torch.Generator().manual_seed(num_x_rows))
    weight = QuantizedWeight.from_gguf(raw, ggml_type, shape)
    if not weight.is_packed:
        pytest.skip("the quant_matmul C++ extension is unavailable (see the warning for why)")
    y = weight.matmul(x)
    assert y.shape == (num_x_rows, num_rows) and y.dtype == torch.float32
    x8 = emulate_int8_rows(x)
    expected = x8 @ w.T
    bound = 1e-5 * (x8.abs() @ w.abs().T) + 1e-30
    assert ((y.double() - expected).abs() <= bound).all()
    exact = x @ w.float().T
    # the output's norm on average over Gaussian x: one drawn output can be near zero (Q5_K's
    # single output here is 0.07 of it), and the rounding error does not shrink with it
    typical = (x.norm(dim=1, keepdim=True) * w.float().norm(dim=1)).norm() / shape[1] ** 0.5
    assert (y - exact).norm() <= 2e-2 * typical


@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=TYPE_IDS)
def test_fallback_equals_dequantized_matmul(ggml_type: int) -> None:
    shape = shape_for(ggml_type, 24)
    raw = make_raw(ggml_type, *shape, seed=7)
    expected_w = reference_weight(raw, ggml_type, shape)
    weight = QuantizedWeight.from_gguf(raw, ggml_type, shape, use_kernel=False)
    assert not weight.is_packed
    x = torch.randn(5, shape[1])
    # float32 either way; only the summation order differs (oneDNN vs torch.matmul)
    bound = 1e-5 * (x.abs() @ expected_w.abs().T)
    assert ((weight.matmul(x) - x @ expected_w.T).abs() <= bound).all()
    ids = torch.tensor([3, 0, 23])
    assert torch.equal(weight.rows(ids), expected_w[ids])
    assert torch.equal(weight.dequantize(), expected_w)


def test_matmul_keeps_leading_dims(native) -> None:
    shape = (20, 64)
    weight = QuantizedWeight.from_gguf(make_raw(GGML_Q4_1, *shape), GGML_Q4_1, shape)
    x = torch.randn(2, 3, 64)
    y = weight.matmul(x)
    assert y.shape == (2, 3, 20)
    torch.testing.assert_close(y[1, 2], weight.matmul(x[1, 2:3])[0])
    assert weight.rows(torch.tensor([[1, 2], [3, 4]])).shape == (2, 2, 64)


def test_zero_rows_and_zero_blocks(native) -> None:
    shape = (9, 64)
    weight = QuantizedWeight.from_gguf(make_raw(GGML_Q8_0, *shape), GGML_Q8_0, shape)
    assert weight.matmul(torch.zeros(0, 64)).shape == (0, 9)
    x = torch.randn(3, 64)
    x[1] = 0.0  # all-zero activation blocks have scale 0 and must give exact zeros
    assert torch.equal(weight.matmul(x)[1], torch.zeros(9))


def test_quantize_q8_0_matches_gguf() -> None:
    weight = torch.randn(7, 96) * 3
    weight[2, :32] = 0.0  # a zero block
    weight[3, :3] = torch.tensor([127.0, 0.5, -2.5])  # scale 1: ties round away from zero
    expected = quantize(weight.numpy(), GGMLQuantizationType.Q8_0)
    assert np.array_equal(quantize_q8_0(weight).numpy(), expected)
    q = QuantizedWeight.from_float(weight)
    assert torch.equal(q.dequantize(), reference_weight(expected, GGML_Q8_0, (7, 96)))


def test_bad_shapes_are_reported() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantizedWeight.from_gguf(np.zeros(34 * 3, np.uint8), GGML_Q8_0, (3, 40))
    with pytest.raises(ValueError, match="needs 102 bytes"):
        QuantizedWeight.from_gguf(np.zeros(100, np.uint8), GGML_Q8_0, (3, 32))
    with pytest.raises(ValueError, match="no quantized kernel"):
        QuantizedWeight.from_gguf(np.zeros(100, np.uint8), 1, (3, 32))


@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=TYPE_IDS)
def test_each_row_is_independent_of_the_batch(native, ggml_type: int) -> None:
    """Seeded sampling gives the same tokens alone or batched only if a row's logits do not
    depend on which other rows share its matmul: every row, bit for bit, equal alone and in
    a batch of any size (the kernel tiles rows by 4; 67 leaves a remainder)."""
    shape = shape_for(ggml_type, 40)
    weight = QuantizedWeight.from_gguf(make_raw(ggml_type, *shape), ggml_type, shape)
    x = torch.randn(67, shape[1], generator=torch.Generator().manual_seed(3))
    batched = weight.matmul(x)
    for row in range(x.shape[0]):
        assert torch.equal(batched[row : row + 1], weight.matmul(x[row : row + 1].clone()))
    assert torch.equal(batched[5:13], weight.matmul(x[5:13].clone()))


WIDE_TYPE_IDS = {t: name for t, name in zip(ALL_TYPES, TYPE_IDS, strict=True) if t in WIDE_TYPES}


@pytest.mark.parametrize("ggml_type", list(WIDE_TYPE_IDS), ids=list(WIDE_TYPE_IDS.values()))
@pytest.mark.parametrize("num_x_rows", [1, 15, 16, 17, 64])
def test_wide_form_gives_the_same_products(native, ggml_type: int, num_x_rows: int) -> None:
    """The wide form (a byte per 4- or 5-bit value) is used from 16 activation rows on; below,
    the packed one. Either way the product is bit for bit the packed form's."""
    shape = shape_for(ggml_type, 43)  # 43 rows: a partial 8-row group at the end
    raw = make_raw(ggml_type, *shape, seed=7)
    weight = QuantizedWeight.from_gguf(raw, ggml_type, shape)
    wide = weight.widened()
    assert weight.wide is None and wide.wide is not None
    assert wide.wide.numel() - weight.data.numel() == wide.wide_extra_bytes
    x = torch.randn(num_x_rows, shape[1], generator=torch.Generator().manual_seed(num_x_rows))
    assert torch.equal(wide.matmul(x), weight.matmul(x))
    assert torch.equal(native.packed_matmul(x, weight.data, ggml_type, *shape, wide.wide),
                       native.packed_matmul(x, weight.data, ggml_type, *shape))


def test_only_4_and_5_bit_weights_widen(native) -> None:
    shape = shape_for(GGML_Q8_0, 8)
    weight = QuantizedWeight.from_gguf(make_raw(GGML_Q8_0, *shape), GGML_Q8_0, shape)
    assert not weight.can_widen and weight.widened() is weight
    with pytest.raises(RuntimeError, match="only 4- and 5-bit formats"):
        native.widen(weight.data, GGML_Q8_0, *shape)
    q4 = QuantizedWeight.from_gguf(make_raw(GGML_Q4_1, *shape), GGML_Q4_1, shape)
    # (as many rows as the largest wide threshold a machine's tuned schedule may hold: the
    # wide form is read, and checked, only from that many rows)
    with pytest.raises(RuntimeError, match=r"must be this packed weight's `widen` form"):
        native.packed_matmul(torch.zeros(WIDE_MIN_ROWS[-1], shape[1]), q4.data, GGML_Q4_1,
                             *shape, q4.data)  # the packed bytes passed as if they were wide


def test_loader_keeps_wide_forms_within_its_budget(native, monkeypatch) -> None:
    """Every 4-bit matmul weight gets its wide form while all of them fit the budget; none
    does past it; the embedding (looked up, never multiplied) and Q8_0 weights never do."""
    def model() -> torch.nn.Module:
        shape = shape_for(GGML_Q4_1, 16)
        net, layer = torch.nn.Module(), torch.nn.Module()
        net.layer = layer
        layer.o_proj = QuantizedWeight.from_gguf(make_raw(GGML_Q4_1, *shape), GGML_Q4_1, shape)
        layer.down_proj = QuantizedWeight.from_gguf(make_raw(GGML_Q8_0, *shape), GGML_Q8_0,
                                                    shape)
        net.embed_tokens = QuantizedWeight.from_gguf(make_raw(GGML_Q4_1, *shape), GGML_Q4_1,
                                                     shape)
        return net

    net = model()
    weights._keep_wide_forms(net)
    assert net.layer.o_proj.wide is not None
    assert net.layer.down_proj.wide is None and net.embed_tokens.wide is None
    monkeypatch.setattr(weights, "WIDE_FORMS_BUDGET", net.layer.o_proj.wide_extra_bytes - 1)
    net = model()
    weights._keep_wide_forms(net)
    assert net.layer.o_proj.wide is None


FIVE_BIT_IDS = {GGML_Q5_0: "Q5_0", GGML_Q5_1: "Q5_1", GGML_Q5_K: "Q5_K"}


@pytest.mark.parametrize("ggml_type", list(FIVE_BIT_IDS), ids=list(FIVE_BIT_IDS.values()))
def test_5_bit_sums_at_their_bound(native, ggml_type: int) -> None:
    """Every 5-bit value 31 against activations all +127 or all -127: the largest integer
    sums the kernel forms (AVX2 sums four products of 31 * 127 pairs in int16), packed and
    wide, on 43 outputs (a partial 8-row group) and 2 + 17 rows."""
    shape = shape_for(ggml_type, 43)
    _, size = BLOCK_FORMATS[ggml_type]
    blocks = make_raw(ggml_type, *shape, seed=5).reshape(shape[0], -1, size)
    blocks[..., size - (160 if ggml_type == GGML_Q5_K else 20):] = 0xFF  # qh and qs
    raw = blocks.reshape(shape[0], -1)
    w = reference_weight(raw, ggml_type, shape).double()
    weight = QuantizedWeight.from_gguf(raw, ggml_type, shape).widened()
    for x in (torch.tensor([[1.0], [-1.0]]).expand(2, shape[1]),
              torch.ones(17, shape[1]) * torch.tensor([1.0, -1.0]).repeat(9)[:17, None]):
        x8 = emulate_int8_rows(x.contiguous())
        bound = 1e-5 * (x8.abs() @ w.abs().T) + 1e-30
        assert ((weight.matmul(x.contiguous()).double() - x8 @ w.T).abs() <= bound).all()


# the real file's tensors multiplied here: each type it holds (Q5_0 three times)
REAL_TENSORS = ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.3.ffn_gate.weight",
                "blk.0.attn_output.weight", "blk.0.ffn_down.weight", "blk.0.attn_v.weight"]


def test_a_real_files_blocks_equal_gguf(native, gemma_270m_gguf) -> None:
    """Gemma 3 270M (Q4_K_M: Q5_0, Q4_K, Q6_K and Q8_0 tensors): every matmul weight's type
    has a kernel, every one but the 167M-value embedding dequantizes from the packed form as
    gguf does bit for bit, and a few multiply within the int8 emulation's bound."""
    tensors = GGUFFile(gemma_270m_gguf).tensors
    matrices = {name: t for name, t in tensors.items() if len(t.shape) == 2}
    assert {t.type_name for t in matrices.values()} == {"Q5_0", "Q4_K", "Q6_K", "Q8_0"}
    assert sum(t.ggml_type == GGML_Q5_0 for t in matrices.values()) == 81
    for name, tensor in matrices.items():
        if name == "token_embd.weight":
            continue
        shape = (tensor.shape[0], tensor.shape[1])
        raw = np.asarray(tensor.data).reshape(shape[0], -1)
        expected = reference_weight(raw, tensor.ggml_type, shape)
        weight = QuantizedWeight.from_gguf(raw, tensor.ggml_type, shape)
        assert torch.equal(weight.dequantize(), expected), name
        if name in REAL_TENSORS:
            x = torch.randn(5, shape[1], generator=torch.Generator().manual_seed(1))
            x8 = emulate_int8_rows(x)
            w = expected.double()
            bound = 1e-5 * (x8.abs() @ w.abs().T) + 1e-30
            assert ((weight.matmul(x).double() - x8 @ w.T).abs() <= bound).all(), name
