"""amx_shim.h's emulator against tiles computed by hand (numpy), as Intel's manual defines
them: a configuration's limits (palette 1: 8 tiles of up to 16 rows x 64 bytes), loads and dot
products that zero every byte past the configured rows and column bytes, int32 sums that wrap,
the four signedness kinds at their extremes, stores of exactly rows x column bytes, and an abort
naming the fault wherever the hardware faults (#GP, #UD). The emulator lives in the `amx-emu`
tier's module, which needs AVX-512; without it, every test here is skipped saying so."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
import torch

from nanoserve import native

SIGNS = {"su": (True, False), "us": (False, True), "ss": (True, True), "uu": (False, False)}


@pytest.fixture(scope="module")
def emu() -> Any:
    missing = native.tier_missing("amx-emu")
    if missing:
        pytest.skip(f"the amx-emu tier needs AVX-512 (this CPU lacks {', '.join(missing)})")
    if native.missing_build_tool() is not None:
        pytest.skip(f"the kernels cannot build here: {native.missing_build_tool()}")
    module = native.load_kernels("quant_matmul", "amx-emu")
    assert module is not None
    return module


def config(shapes: dict[int, tuple[int, int]], palette: int = 1) -> torch.Tensor:
    """LDTILECFG's 64 bytes: tile -> (rows, column bytes)."""
    raw = np.zeros(64, dtype=np.uint8)
    raw[0] = palette
    for tile, (rows, colsb) in shapes.items():
        raw[16 + 2 * tile:18 + 2 * tile] = np.frombuffer(np.uint16(colsb).tobytes(), np.uint8)
        raw[48 + tile] = rows
    return torch.from_numpy(raw)


def reference(kind: str, c: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """C (M x N int32) + A (M x 4K bytes) . B (K x 4N bytes) as the manual writes it."""
    a_signed, b_signed = SIGNS[kind]
    av = a.view(np.int8) if a_signed else a
    bv = b.view(np.int8) if b_signed else b
    m, k4 = a.shape
    n = b.shape[1] // 4
    products = av.astype(np.int64).reshape(m, k4 // 4, 1, 4) \
        * bv.astype(np.int64).reshape(1, k4 // 4, n, 4)
    total = c.astype(np.int64) + products.sum(axis=(1, 3))
    return ((total + 2**31) % 2**32 - 2**31).astype(np.int32)  # int32 wraps


@pytest.mark.parametrize("kind", list(SIGNS))
@pytest.mark.parametrize(("m", "k", "n"), [(16, 16, 16), (3, 5, 16), (16, 8, 7), (1, 1, 1)])
def test_dot_products_equal_the_manuals_sums(emu: Any, kind: str, m: int, k: int,
                                             n: int) -> None:
    rng = np.random.default_rng(m * 100 + k * 10 + n)
    for values in ("random", "extreme"):
        if values == "random":
            a = rng.integers(0, 256, (m, 4 * k), dtype=np.uint8)
            b = rng.integers(0, 256, (k, 4 * n), dtype=np.uint8)
            c = rng.integers(-2**31, 2**31, (m, n), dtype=np.int64).astype(np.int32)
        else:  # 255 (or -1) x 128 (-128), and C at the edge: the sums wrap
            a = np.full((m, 4 * k), 0x80 if kind[0] == "s" else 0xFF, dtype=np.uint8)
            b = np.full((k, 4 * n), 0x80, dtype=np.uint8)
            c = np.full((m, n), 2**31 - 1, dtype=np.int32)
        emu.emu_load_config(config({0: (m, 4 * n), 1: (m, 4 * k), 2: (k, 4 * n)}))
        buffers = [torch.from_numpy(x.copy().view(np.uint8).reshape(-1)) for x in (c, a, b)]
        for tile, (buffer, width) in enumerate(zip(buffers, (4 * n, 4 * k, 4 * n),
                                                   strict=True)):
            emu.emu_load(tile, buffer, 0, width)
        emu.emu_dot(kind, 0, 1, 2)
        out = torch.zeros(m * 4 * n, dtype=torch.uint8)
        emu.emu_store(0, out, 0, 4 * n)
        got = out.numpy().view(np.int32).reshape(m, n)
        assert np.array_equal(got, reference(kind, c, a, b)), values
        emu.emu_release()


def test_bytes_past_the_configured_shape_are_zero(emu: Any) -> None:
    emu.emu_load_config(config({0: (4, 8), 1: (4, 20), 2: (5, 8)}))
    dirty = torch.full((16 * 64,), 0xAB, dtype=torch.uint8)
    emu.emu_load(1, dirty, 0, 64)  # 4 rows x 20 bytes of 0xAB, the rest zero
    tile = emu.emu_tile(1)
    assert bool((tile[:4, :20] == 0xAB).all()) and int(tile[:4, 20:].sum()) == 0
    assert int(tile[4:].sum()) == 0
    emu.emu_load(0, dirty, 0, 64)
    emu.emu_load(2, dirty, 0, 64)
    emu.emu_dot("ss", 0, 1, 2)
    tile = emu.emu_tile(0)
    assert int(tile[:, 8:].sum()) == 0 and int(tile[4:].sum()) == 0
    out = torch.full((4 * 64,), 7, dtype=torch.uint8)  # a store writes rows x colsb only
    emu.emu_store(0, out, 0, 64)
    written = out.reshape(4, 64)
    assert bool((written[:, 8:] == 7).all()) and not bool((written[:, :8] == 7).all())
    emu.emu_zero(1)
    assert int(emu.emu_tile(1).sum()) == 0
    emu.emu_load(2, dirty, 0, 0)  # stride 0: every row from the first
    assert bool((emu.emu_tile(2)[:5, :8] == 0xAB).all())
    emu.emu_release()


def test_a_configuration_zeroes_every_tile_and_release_forgets_it(emu: Any) -> None:
    emu.emu_load_config(config({3: (2, 4)}))
    emu.emu_load(3, torch.full((8,), 1, dtype=torch.uint8), 0, 4)
    emu.emu_load_config(config({3: (2, 4)}))
    assert int(emu.emu_tile(3).sum()) == 0
    emu.emu_release()
    before = emu.emu_tile_ops()
    emu.emu_load_config(config({}, palette=0))  # palette 0: the initial state, valid
    assert emu.emu_tile_ops() == before + 1


def run_emulated(body: str) -> subprocess.CompletedProcess[str]:
    script = textwrap.dedent(f"""
        import numpy as np, torch, sys
        sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})
        from test_amx_shim import config
        from nanoserve import native
        emu = native.load_kernels("quant_matmul", "amx-emu")
        buffer = torch.zeros(4096, dtype=torch.uint8)
    """) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize(("body", "says"), [
    ("emu.emu_load_config(config({}, palette=2))", "#GP: palette above 1"),
    ("c = config({0: (1, 4)}); c[5] = 1; emu.emu_load_config(c)", "#GP: a reserved byte"),
    ("emu.emu_load_config(config({0: (1, 68)}))", "#GP: a tile's column bytes exceed 64"),
    ("emu.emu_load_config(config({0: (17, 4)}))", "#GP: a tile's rows exceed 16"),
    ("emu.emu_load_config(config({0: (2, 0)}))", "#GP: a tile has rows without column"),
    ("emu.emu_zero(0)", "#UD: a tile operation before a tile configuration"),
    ("emu.emu_load_config(config({0: (1, 4)})); emu.emu_zero(1)",
     "#UD: a tile the configuration leaves unused"),
    ("emu.emu_load_config(config({0: (2, 8), 1: (2, 8), 2: (3, 8)})); emu.emu_dot('su', 0, 1, 2)",
     "#UD: the second source's rows differ"),
    ("emu.emu_load_config(config({0: (2, 8), 1: (3, 8), 2: (2, 8)})); emu.emu_dot('su', 0, 1, 2)",
     "#UD: the destination's rows differ"),
    ("emu.emu_load_config(config({0: (2, 8), 1: (2, 8)})); emu.emu_dot('ss', 0, 1, 1)",
     "#UD: a dot product's tiles are not distinct"),
    ("emu.emu_load_config(config({0: (2, 6), 1: (2, 8), 2: (2, 6)})); emu.emu_dot('ss', 0, 1, 2)",
     "#UD: a dot product's tile has column bytes that are not a multiple of 4"),
    ("emu.emu_load_config(config({0: (1, 4)})); emu.emu_release(); emu.emu_zero(0)",
     "#UD: a tile operation before a tile configuration"),
])
def test_what_the_hardware_faults_on_aborts_naming_the_fault(emu: Any, body: str,
                                                              says: str) -> None:
    done = run_emulated(body)
    assert done.returncode != 0 and f"amx_emu: {says}" in done.stderr, done.stderr[-500:]


def test_a_valid_program_runs_in_the_same_harness(emu: Any) -> None:
    """The abort tests' harness, with a program the hardware runs: it exits 0."""
    done = run_emulated("emu.emu_load_config(config({0: (1, 4)})); emu.emu_zero(0)")
    assert done.returncode == 0, done.stderr[-500:]


def test_the_matmul_runs_on_the_emulated_tiles(emu: Any) -> None:
    """From the schedule's amx_min_rows (16) rows, the amx-emu matmul is the emulator's."""
    raw = torch.randint(0, 256, (16 * 64 // 32 * 34,), dtype=torch.uint8)
    raw.view(-1, 34)[:, :2] = torch.tensor([0x00, 0x1C], dtype=torch.uint8)  # f16 scale 0.0039
    packed = emu.repack(raw, 8, 16, 64)
    before = emu.emu_tile_ops()
    emu.packed_matmul(torch.randn(8, 64), packed, 8, 16, 64, None)
    assert emu.emu_tile_ops() == before  # below 16 rows: the avx512 kernels
    emu.packed_matmul(torch.randn(16, 64), packed, 8, 16, 64, None)
    assert emu.emu_tile_ops() > before
