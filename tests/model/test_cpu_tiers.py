"""The quantized matmul's instruction-set tiers (native.py): every tier this CPU has gives
`torch.equal` products to the avx2 tier's, for every weight layout, row counts around the
kernels' tile edges (4 rows, 16 for the wide form and the AMX tiles, 513 for a last partial
tile of rows), output counts that leave a pair of 8-row groups incomplete (the amx-emu tier's
emulated tiles included, on any AVX-512 CPU), extreme blocks, and a real file's blocks; the
one-region decode stack and the whole model give the same bits; and NANOSERVE_CPU_ISA chooses
a tier or fails at start-up naming what is missing.

A tier the CPU lacks is skipped with its missing flags in the reason: such a module must never
be loaded here (the amx tier's module is built on any AVX-512 CPU, and only asked why it cannot
run)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from test_quant_kernels import ALL_TYPES, REAL_TENSORS, TYPE_IDS, make_raw

from nanoserve import native
from nanoserve.model.gguf_file import GGUFFile
from nanoserve.model.quant_linear import (
    BLOCK_FORMATS,
    FIVE_BIT_TYPES,
    GGML_Q4_0,
    GGML_Q4_1,
    GGML_Q4_K,
    GGML_Q5_K,
    GGML_Q8_0,
    WIDE_TYPES,
)

WIDER_TIERS = [tier for tier in native.TIERS if tier != "avx2"]
ROW_COUNTS = [1, 2, 3, 4, 5, 15, 16, 17, 31, 32, 33, 64, 128, 513]


def tier_modules(tier: str, kernel: str = "quant_matmul") -> tuple[Any, Any]:
    """(this tier's module, avx2's), or a skip that names what the CPU lacks."""
    missing = native.tier_missing(tier)
    if missing:
        pytest.skip(f"this CPU has no {tier} tier (it lacks {', '.join(missing)})")
    if native.missing_build_tool() is not None:
        pytest.skip(f"the kernels cannot build here: {native.missing_build_tool()}")
    module, reference = native.load_kernels(kernel, tier), native.load_kernels(kernel, "avx2")
    assert module is not None and reference is not None
    assert (module.cpu_tier, reference.cpu_tier) == (tier, "avx2")
    return module, reference


def extreme_raw(ggml_type: int, num_rows: int, in_features: int) -> np.ndarray:
    """Blocks at the integer sums' limits: every 4-bit value 15; every 5-bit value 31 or 0,
    every int8 -128 or 127, and every 6-bit value 31 or -32, alternating by row."""
    raw = make_raw(ggml_type, num_rows, in_features, seed=1)
    block, size = BLOCK_FORMATS[ggml_type]
    blocks = raw.reshape(num_rows, in_features // block, size)
    if ggml_type in (GGML_Q4_0, GGML_Q4_1):
        blocks[..., size - 16:] = 0xFF
    elif ggml_type == GGML_Q4_K:
        blocks[..., 16:] = 0xFF
    elif ggml_type in FIVE_BIT_TYPES:  # qh and qs, after the scales (Q5_K: and 6-bit scales)
        values = size - (160 if ggml_type == GGML_Q5_K else 20)
        blocks[0::2, :, values:] = 0xFF
        blocks[1::2, :, values:] = 0x00
    elif ggml_type == GGML_Q8_0:
        blocks[0::2, :, 2:] = 0x80  # -128
        blocks[1::2, :, 2:] = 0x7F
    else:  # Q6_K: ql and qh all ones (q = 63 - 32 = 31) or all zeros (-32); sub-scales 127
        blocks[0::2, :, :192] = 0xFF
        blocks[1::2, :, :192] = 0x00
        blocks[..., 192:208] = 0x7F
    return blocks.reshape(num_rows, -1)


def inputs(ggml_type: int, num_rows: int, extreme: bool) -> tuple[torch.Tensor, int]:
    in_features = 512 if BLOCK_FORMATS[ggml_type][0] == 256 else 96
    raw = (extreme_raw if extreme else make_raw)(ggml_type, num_rows, in_features)
    return torch.from_numpy(raw.reshape(-1).copy()), in_features


@pytest.mark.parametrize("tier", WIDER_TIERS)
@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=TYPE_IDS)
@pytest.mark.parametrize("num_outputs", [8, 44, 72, 200])  # 1, 5.5, 9 and 25 groups of 8
@pytest.mark.parametrize("extreme", [False, True], ids=["random", "extreme"])
def test_every_tier_gives_the_avx2_tiers_bits(tier: str, ggml_type: int, num_outputs: int,
                                              extreme: bool) -> None:
    module, reference = tier_modules(tier)
    raw, in_features = inputs(ggml_type, num_outputs, extreme)
    packed = reference.repack(raw, ggml_type, num_outputs, in_features)
    assert torch.equal(module.repack(raw, ggml_type, num_outputs, in_features), packed)
    wide = reference.widen(packed, ggml_type, num_outputs, in_features) \
        if ggml_type in WIDE_TYPES else None
    generator = torch.Generator().manual_seed(num_outputs)
    for num_rows in ROW_COUNTS:
        x = torch.randn(num_rows, in_features, generator=generator)
        if extreme:  # every activation block at +-127 after rounding, one row all zero,
            x = torch.sign(x) * 3.0  # one all +127 and one all -127 (the largest sums)
            x[0] = 0.0
            x[1:2] = 3.0
            x[2:3] = -3.0
        args = (packed, ggml_type, num_outputs, in_features)
        expected = reference.packed_matmul(x, *args)
        assert torch.equal(module.packed_matmul(x, *args), expected), num_rows
        if wide is not None:
            assert torch.equal(module.packed_matmul(x, *args, wide),
                               reference.packed_matmul(x, *args, wide)), num_rows


@pytest.mark.parametrize("tier", WIDER_TIERS)
def test_a_real_files_blocks_give_the_avx2_tiers_bits(tier: str, gemma_270m_gguf) -> None:
    """Gemma 3 270M's Q5_0, Q4_K, Q6_K and Q8_0 weights, packed and (4- and 5-bit) wide."""
    module, reference = tier_modules(tier)
    tensors = GGUFFile(gemma_270m_gguf).tensors
    generator = torch.Generator().manual_seed(0)
    for name in REAL_TENSORS:
        tensor = tensors[name]
        num_outputs, in_features = tensor.shape
        raw = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))
        args = (reference.repack(raw, tensor.ggml_type, num_outputs, in_features),
                tensor.ggml_type, num_outputs, in_features)
        wide = reference.widen(*args) if tensor.ggml_type in WIDE_TYPES else None
        for num_rows in (1, 5, 17):
            x = torch.randn(num_rows, in_features, generator=generator)
            assert torch.equal(module.packed_matmul(x, *args, wide),
                               reference.packed_matmul(x, *args, wide)), (name, num_rows)


@pytest.mark.parametrize("tier", WIDER_TIERS)
def test_a_tier_proves_itself_against_avx2(tier: str) -> None:
    """The check a tier passes before a process runs it finds a one-ulp difference."""
    module, reference = tier_modules(tier)
    assert native._tier_differs(module, reference) is None

    class OneUlpOff:
        def quant_matmul(self, x: torch.Tensor, *args: Any) -> torch.Tensor:
            y = module.quant_matmul(x, *args)
            return torch.nextafter(y, torch.full_like(y, float("inf")))

    assert native._tier_differs(OneUlpOff(), reference) == "Q8_0 at 1 rows differs from avx2"


def run_cli(*args: str, isa: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nanoserve.entrypoints.cli", *args],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "NANOSERVE_CPU_ISA": isa})


def test_an_unknown_tier_is_a_start_up_error() -> None:
    out = run_cli("serve", "--port", "1", isa="avx9000")
    assert out.returncode == 1
    assert ("NANOSERVE_CPU_ISA='avx9000' is not a tier: one of avx2, avxvnni, avx512, amx, "
            "amx-emu or auto") in out.stderr


def test_a_tier_the_cpu_lacks_is_a_start_up_error_naming_what_is_missing() -> None:
    lacking = [tier for tier in native.TIERS if native.tier_missing(tier)]
    if not lacking:
        pytest.skip(f"this CPU has every tier ({', '.join(native.TIERS)})")
    tier = lacking[-1]
    out = run_cli("serve", "--port", "1", isa=tier)
    assert out.returncode == 1
    missing = ", ".join(native.tier_missing(tier))
    assert f"NANOSERVE_CPU_ISA={tier}: this CPU lacks {missing}" in out.stderr


def test_auto_is_the_best_tier_the_cpu_has() -> None:
    script = "from nanoserve import native; print(native.cpu_tier(), native.kernel_tier())"
    chosen = {}
    for isa in ("auto", "avx2"):
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             env={**os.environ, "NANOSERVE_CPU_ISA": isa},
                             timeout=600)
        assert out.returncode == 0, out.stderr
        chosen[isa] = out.stdout.split()
    assert chosen["avx2"] == ["avx2", "avx2"]
    best = native.available_auto_tiers()[-1]  # never amx-emu
    assert chosen["auto"] == [best, best]


def test_the_amx_tier_builds_and_says_why_it_cannot_run_here() -> None:
    """`make install` builds the amx tier on any AVX-512 CPU, so its source is known to compile
    where no tiles are; such a module only answers why it cannot run, and auto never picks it."""
    if not native.tier_missing("amx"):
        pytest.skip("this CPU has AMX: the tier runs here (the other tests)")
    if native.tier_missing("avx512"):
        pytest.skip(f"the amx tier builds only with AVX-512 (this CPU lacks "
                    f"{', '.join(native.tier_missing('avx512'))})")
    module = native.load_kernels("quant_matmul", "amx")
    assert module is not None and module.cpu_tier == "amx"
    assert module.amx_not_ready()  # a reason: CPUID, XCR0, the palette or the permission
    assert "amx" not in native.available_auto_tiers()


_AVXVNNI_TEST = "test_the_avxvnni_tier_compiles_where_the_cpu_lacks_it"


@pytest.fixture(scope="module")
def avxvnni_compiles(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """The compiler's check of every tiered kernel this run selected, all started at once: each
    is one core's ~20-30 s in torch's headers, so two kernels on two cores take the time of one.
    kernel -> its running `c++ -fsyntax-only`."""
    if not native.tier_missing("avxvnni"):
        pytest.skip("this CPU has AVX-VNNI: the tier runs here (the other tests)")
    if native.tier_missing("avx2") or native.missing_build_tool() is not None:
        pytest.skip("the kernels cannot build here")
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    includes = [f"-I{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]]
    selected = {item.callspec.params["kernel"] for item in request.session.items
                if getattr(item, "originalname", None) == _AVXVNNI_TEST}
    started = {kernel: subprocess.Popen(
        ["c++", "-fsyntax-only", *native.CPU_FLAGS, *native.TIER_COMPILE_FLAGS["avxvnni"],
         "-DNANOSERVE_CPU_TIER=avxvnni", "-DTORCH_EXTENSION_NAME=check", "-w", *includes,
         str(native.CSRC_DIR / f"{kernel}.cpp")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for kernel in sorted(selected)}
    yield started
    for compile_check in started.values():
        if compile_check.poll() is None:  # its test never ran (the run stopped early)
            compile_check.kill()
            compile_check.communicate()


@pytest.mark.parametrize("kernel", sorted(native.TIERED_KERNELS))
def test_the_avxvnni_tier_compiles_where_the_cpu_lacks_it(
        kernel: str, avxvnni_compiles: dict[str, Any]) -> None:
    """An AVX2 CPU without AVX-VNNI (the one CI runs) never loads the avxvnni tier, so its
    source is checked here by the compiler alone, with the tier's own flags: a tier that does
    not compile would otherwise first fail on a user's Alder Lake or Zen 5."""
    compile_check = avxvnni_compiles[kernel]
    _, stderr = compile_check.communicate()
    assert compile_check.returncode == 0, stderr[-4000:]
