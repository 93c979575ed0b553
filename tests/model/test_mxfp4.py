"""MXFP4 (ggml type 39, gpt-oss's experts) in the quantized kernel: transformers' safetensors
form converts to GGUF blocks with the same values (`mxfp4.py`); the packed L4F layout
(csrc/gguf_blocks.h) multiplies as gguf's dequantized weights times the int8-rounded
activations, within test_quant_kernels.py's bounds (the same rounding emulation); every tier
the CPU has, amx-emu included, gives the avx2 tier's bits; the exact paths (`rows`,
`dequantize`, the float fallback, a 3-D expert tensor split from a GGUF file) equal gguf's
dequantization bit for bit.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from test_cpu_tiers import WIDER_TIERS, tier_modules
from test_quant_kernels import emulate_int8_rows

from nanoserve.model.dequant import dequantize_fast
from nanoserve.model.gguf_file import GGUFFile
from nanoserve.model.moe_weights import split_gguf_experts
from nanoserve.model.mxfp4 import hf_mxfp4_to_gguf_blocks
from nanoserve.model.quant_linear import GGML_MXFP4, QuantizedWeight, kernels
from nanoserve.model.quantization import RawBlocks, make_matmul_weight

BLOCK_BYTES = 17


def random_mxfp4(num_rows: int, in_features: int, seed: int = 0,
                 scales: tuple[int, int] = (118, 126)) -> np.ndarray:
    """Raw GGUF MXFP4 rows [num_rows, in_features / 32 * 17]: random codes, scale bytes drawn
    from `scales` (2^-10 .. 2^-2: weights of gpt-oss's magnitude)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (num_rows, in_features // 32, BLOCK_BYTES), dtype=np.uint8)
    raw[..., 0] = rng.integers(*scales, raw.shape[:2], endpoint=True, dtype=np.uint8)
    return raw.reshape(num_rows, -1)


def gguf_weight(raw: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
    values = dequantize(raw.reshape(shape[0], -1), GGMLQuantizationType.MXFP4)
    return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(shape))


@pytest.fixture(scope="module")
def native():
    module = kernels()
    if module is None:
        pytest.skip("the quant_matmul C++ extension is unavailable (see the warning for why)")
    return module


def test_hf_blocks_convert_to_gguf_with_transformers_values() -> None:
    """transformers' own dequantization of its blocks equals gguf's of the converted ones,
    every code and the scale bytes' whole range (0 and 1 give subnormal scales) included."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    num_experts, num_rows, num_blocks = 3, 10, 4  # [E, out, in / 32]
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (num_experts, num_rows, num_blocks, 16), dtype=torch.uint8,
                           generator=gen)
    scales = torch.randint(100, 150, (num_experts, num_rows, num_blocks), dtype=torch.uint8,
                           generator=gen)
    scales[0, 0] = torch.tensor([0, 1, 2, 127])
    scales[0, 1] = torch.tensor([128, 200, 250, 126])
    blocks[0, 2, 0] = torch.arange(256, dtype=torch.uint8)[::16] + torch.arange(16,
                                                                               dtype=torch.uint8)
    raw = hf_mxfp4_to_gguf_blocks(blocks, scales)
    assert raw.shape == (num_experts, num_rows, num_blocks * BLOCK_BYTES)
    expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    values = dequantize(raw.reshape(-1, num_blocks * BLOCK_BYTES).numpy(),
                        GGMLQuantizationType.MXFP4)
    got = torch.from_numpy(values).reshape(num_experts, num_rows, -1).transpose(1, 2)
    assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="disagree"):
        hf_mxfp4_to_gguf_blocks(blocks, scales[..., :-1])


# (out, in): a partial 8-row group; in = 2880 (90 blocks, gpt-oss's hidden size); out = 2880
SHAPES = [(13, 96), (40, 2880), (2880, 64)]


@cache
def weight_case(shape: tuple[int, int]) -> tuple[np.ndarray, torch.Tensor]:
    raw = random_mxfp4(*shape, seed=shape[0])
    return raw, gguf_weight(raw, shape)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("num_x_rows", [1, 3, 8, 16, 64])
def test_matmul_equals_int8_emulation(native, shape: tuple[int, int], num_x_rows: int) -> None:
    """test_quant_kernels.py's two checks: within float32 accumulation of the int8-rounded
    product, and within 2e-2 of the typical output of the exact float product."""
    raw, w32 = weight_case(shape)
    weight = QuantizedWeight.from_gguf(raw, GGML_MXFP4, shape)
    assert weight.is_packed
    x = torch.randn(num_x_rows, shape[1], generator=torch.Generator().manual_seed(num_x_rows))
    y = weight.matmul(x)
    assert y.shape == (num_x_rows, shape[0]) and y.dtype == torch.float32
    w = w32.double()
    x8 = emulate_int8_rows(x)
    bound = 1e-5 * (x8.abs() @ w.abs().T) + 1e-30
    assert ((y.double() - x8 @ w.T).abs() <= bound).all()
    typical = (x.norm(dim=1, keepdim=True) * w32.norm(dim=1)).norm() / shape[1] ** 0.5
    assert (y - x @ w32.T).norm() <= 2e-2 * typical


def extreme_mxfp4(num_rows: int, in_features: int) -> np.ndarray:
    """Every value 12 (code 7) or -12 (code 15), alternating by row: the largest sums (the
    avx2 tier adds all 32 products of an output's block in int16 pairs)."""
    blocks = random_mxfp4(num_rows, in_features, seed=1).reshape(num_rows, -1, BLOCK_BYTES)
    blocks[0::2, :, 1:] = 0x77
    blocks[1::2, :, 1:] = 0xFF
    return blocks.reshape(num_rows, -1)


def test_sums_at_their_bound(native) -> None:
    shape = (43, 96)
    raw = extreme_mxfp4(*shape)
    w = gguf_weight(raw, shape).double()
    weight = QuantizedWeight.from_gguf(raw, GGML_MXFP4, shape)
    for x in (torch.tensor([[1.0], [-1.0]]).expand(2, shape[1]),
              torch.ones(17, shape[1]) * torch.tensor([1.0, -1.0]).repeat(9)[:17, None]):
        x8 = emulate_int8_rows(x.contiguous())
        bound = 1e-5 * (x8.abs() @ w.abs().T) + 1e-30
        assert ((weight.matmul(x.contiguous()).double() - x8 @ w.T).abs() <= bound).all()


@pytest.mark.parametrize("tier", WIDER_TIERS)
@pytest.mark.parametrize("extreme", [False, True], ids=["random", "extreme"])
def test_every_tier_gives_the_avx2_tiers_bits(tier: str, extreme: bool) -> None:
    module, reference = tier_modules(tier)
    for num_outputs, in_features in ((44, 96), (200, 2880)):  # 5.5 and 25 groups of 8
        raw = (extreme_mxfp4 if extreme else random_mxfp4)(num_outputs, in_features)
        flat = torch.from_numpy(raw.reshape(-1).copy())
        args = (reference.repack(flat, GGML_MXFP4, num_outputs, in_features), GGML_MXFP4,
                num_outputs, in_features)
        assert torch.equal(module.repack(flat, *args[1:]), args[0])
        generator = torch.Generator().manual_seed(num_outputs)
        for num_rows in (1, 3, 4, 5, 8, 15, 16, 17, 33, 64):
            x = torch.randn(num_rows, in_features, generator=generator)
            if extreme:
                x = torch.sign(x) * 3.0
                x[0] = 0.0
            assert torch.equal(module.packed_matmul(x, *args),
                               reference.packed_matmul(x, *args)), (tier, num_outputs, num_rows)


def test_exact_paths_equal_gguf(native) -> None:
    """The packed weight's rows and dequantization, the raw rows' (`quant_rows`), the float
    fallback (no kernel: what `--quantization none` multiplies) and the torch dequantizer all
    give gguf's values, subnormal scales (e = 0, 1) included."""
    shape = (21, 96)
    raw = random_mxfp4(*shape, seed=3, scales=(0, 250))
    raw.reshape(shape[0], -1, BLOCK_BYTES)[0, :3, 0] = [0, 1, 2]
    expected = gguf_weight(raw, shape)
    packed = QuantizedWeight.from_gguf(raw, GGML_MXFP4, shape)
    ids = torch.tensor([20, 0, 7, 20])
    assert torch.equal(packed.rows(ids), expected[ids])
    assert torch.equal(packed.dequantize(), expected)
    flat = torch.from_numpy(raw.reshape(-1).copy())
    assert torch.equal(native.quant_rows(flat, GGML_MXFP4, ids, shape[1]), expected[ids])
    fallback = QuantizedWeight.from_gguf(raw, GGML_MXFP4, shape, use_kernel=False)
    assert not fallback.is_packed and torch.equal(fallback.dequantize(), expected)
    fast = dequantize_fast(raw, GGML_MXFP4, shape)
    assert fast is not None and torch.equal(fast, expected)
    blocks = RawBlocks(raw, GGML_MXFP4, shape)
    assert blocks.has_kernel and torch.equal(blocks.dequantize(), expected)
    exact = make_matmul_weight(blocks, "none", torch.float32, torch.device("cpu"))
    assert isinstance(exact, torch.Tensor)  # float32, the weights gguf dequantizes to


def test_experts_split_from_a_3d_gguf_tensor(tmp_path: Path) -> None:
    """A stacked [E, out, in] MXFP4 tensor (17-byte blocks: rows are not aligned) splits into
    each expert's raw rows, which multiply and dequantize as that expert's slice."""
    num_experts, num_rows, in_features = 3, 12, 64
    raw = random_mxfp4(num_experts * num_rows, in_features, seed=5)
    path = tmp_path / "experts.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    writer.add_tensor("blk.0.ffn_up_exps.weight", raw.reshape(num_experts, num_rows, -1),
                      raw_dtype=GGMLQuantizationType.MXFP4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    file = GGUFFile(path)
    assert file.tensors["blk.0.ffn_up_exps.weight"].shape == (num_experts, num_rows, in_features)
    expected = gguf_weight(raw, (num_experts * num_rows, in_features))
    parts = dict(split_gguf_experts(file, "blk.0.ffn_up_exps.weight", "mlp.experts.up_proj",
                                    keep_blocks=True))
    assert list(parts) == [f"mlp.experts.{e}.up_proj" for e in range(num_experts)]
    x = torch.randn(2, in_features, generator=torch.Generator().manual_seed(0))
    for e, part in enumerate(parts.values()):
        assert not isinstance(part, torch.Tensor)
        assert part.ggml_type == GGML_MXFP4 and part.shape == (num_rows, in_features)
        rows = expected[e * num_rows:(e + 1) * num_rows]
        assert torch.equal(part.dequantize(), rows)
        weight = QuantizedWeight.from_gguf(part.rows(), part.ggml_type, part.shape)
        assert torch.equal(weight.dequantize(), rows)
        bound = 1e-5 * (emulate_int8_rows(x).abs() @ rows.double().abs().T) + 1e-30
        assert ((weight.matmul(x).double() - emulate_int8_rows(x) @ rows.double().T).abs()
                <= bound).all()
    floats = dict(split_gguf_experts(file, "blk.0.ffn_up_exps.weight", "mlp.experts.up_proj",
                                     keep_blocks=False))
    assert torch.equal(torch.stack(list(floats.values())).reshape(-1, in_features), expected)
