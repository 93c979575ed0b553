"""Builds and loads nanoserve's C++ kernels (`nanoserve/csrc/*.cpp`) on first use.

Each kernel file is one PyTorch extension, compiled with `torch.utils.cpp_extension.load` into
the user's cache directory (`~/.cache/nanoserve/ext`, or `$XDG_CACHE_HOME/nanoserve/ext`) so only
the first start on a machine pays for the build. `make install` builds them ahead of time
(`python -m nanoserve.native`).

Builds of one kernel are serialised by an `flock` on its build directory, which the kernel drops
when the holder dies. torch's own lock (a `lock` file it creates and deletes) outlives a build that
was killed, and every later build then waits on it forever; under our lock any such file is a
leftover, and is removed.

Instruction-set tiers. Flags are fixed per tier, never `-march=native` (the build machine may
differ from the run machine). Every kernel is built for `avx2` (AVX2 + FMA + F16C: the reference
and the fallback); the quantized matmuls (`TIERED_KERNELS`) are also built for `avxvnni` (AVX2
with the VEX `vpdpbusd` of Intel's client cores and Zen 5) and `avx512` (AVX-512 BW/VL/DQ +
VNNI), as modules of their own, loaded only after /proc/cpuinfo shows the CPU has every
flag the tier is compiled with, so no instruction reaches a CPU that lacks it. The process runs
one tier (`cpu_tier`): the best the CPU has, or `NANOSERVE_CPU_ISA`. A tier's module proves
itself when it loads: a small matmul of every weight layout must equal the `avx2` module's bit for
bit, or the process falls back to `avx2` with one warning (a newer unit never gives a crash at
build time or a different answer). Where there is no compiler, no AVX2, or the build fails,
`load_kernels` returns None and says why once; the callers then keep the plain PyTorch path.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import shutil
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

CSRC_DIR = Path(__file__).parent / "csrc"
CPU_FLAGS = ["-O3", "-fopenmp", "-std=c++17"]

# each tier: the compiler flags its modules are built with, and the /proc/cpuinfo flags the CPU
# must show (every one the compiler flags let it emit). Worst first.
_AVX512_FLAGS = ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
                 "-mavx512dq", "-mavx512vnni")
_AVX512_CPU = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
               "avx512_vnni")
# (csrc/tier.h: NANOSERVE_TIER_AVX512 picks the avx512 tier's header, NANOSERVE_TIER_AMX adds
# the tiles)
TIER_COMPILE_FLAGS: dict[str, tuple[str, ...]] = {
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "avxvnni": ("-mavx2", "-mfma", "-mf16c", "-mavxvnni", "-DNANOSERVE_TIER_AVXVNNI"),
    "avx512": (*_AVX512_FLAGS, "-DNANOSERVE_TIER_AVX512"),
    # AMX tiles for 16 rows and more (csrc/matmul_amx.h), the avx512 kernels below
    "amx": (*_AVX512_FLAGS, "-mamx-tile", "-mamx-int8", "-DNANOSERVE_TIER_AVX512",
            "-DNANOSERVE_TIER_AMX"),
    # the same source on amx_shim.h's emulator: what the tests compare on any AVX-512 CPU
    "amx-emu": (*_AVX512_FLAGS, "-DNANOSERVE_TIER_AVX512", "-DNANOSERVE_TIER_AMX",
                "-DNANOSERVE_AMX_EMU"),
}
TIER_CPU_FLAGS: dict[str, tuple[str, ...]] = {
    "avx2": ("avx2", "fma", "f16c"),
    "avxvnni": ("avx2", "fma", "f16c", "avx_vnni"),
    "avx512": _AVX512_CPU,
    "amx": (*_AVX512_CPU, "amx_tile", "amx_int8"),
    "amx-emu": _AVX512_CPU,
}
TIERS: tuple[str, ...] = tuple(TIER_COMPILE_FLAGS)
# the tiers `auto` may choose, worst first (amx-emu runs only where NANOSERVE_CPU_ISA names it)
AUTO_TIERS: tuple[str, ...] = ("avx2", "avxvnni", "avx512", "amx")
_AMX_TIERS = ("amx", "amx-emu")
# the kernels with a module per tier (the quantized matmul's tiles: matmul_tiles.h). Not
# gemma4_layers: it reaches the matmuls only through the dispatcher's packed_matmul, which the
# process's tier registers, so its one avx2 build serves every tier.
TIERED_KERNELS = frozenset({"quant_matmul", "decode_layers"})


def user_cache_dir() -> Path:
    """nanoserve's files in the user's cache (`$XDG_CACHE_HOME/nanoserve` or ~/.cache/...)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nanoserve"


def cache_dir() -> Path:
    return user_cache_dir() / "ext"


class CpuTierError(ValueError):
    """NANOSERVE_CPU_ISA names no tier, or one this CPU lacks (a start-up error)."""


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """The CPU's flags as /proc/cpuinfo lists them (the kernel leaves out what it does not
    enable), or None where there is no /proc/cpuinfo."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def tier_missing(tier: str) -> list[str]:
    """The CPU flags `tier` needs that this CPU lacks (none where there is no /proc/cpuinfo and
    the tier is avx2: the compiler and the first call decide, as before tiers)."""
    flags = cpu_flags()
    if flags is None:
        return [] if tier == "avx2" else ["/proc/cpuinfo to show its flags"]
    return [flag for flag in TIER_CPU_FLAGS[tier] if flag not in flags]


def cpu_has_avx2() -> bool:
    return not tier_missing("avx2")


_preferred_tier: str | None = None  # the tuner's measured choice (kernel_tuning), if any


def prefer_tier(tier: str) -> bool:
    """Run `tier` where `NANOSERVE_CPU_ISA` leaves the choice to this process (auto) and the
    CPU has it: the tier the kernel tuner measured fastest here. Only before the first kernel
    loads (the process runs one tier); False when it comes too late or cannot apply."""
    global _preferred_tier
    if cpu_tier.cache_info().currsize or tier not in TIERS or tier_missing(tier):
        return False
    _preferred_tier = tier
    return True


def tier_is_forced() -> bool:
    """True when `NANOSERVE_CPU_ISA` names the tier (the tuner then leaves it)."""
    return (os.environ.get("NANOSERVE_CPU_ISA", "auto").strip().lower() or "auto") != "auto"


def check_cpu_isa() -> None:
    """Raise CpuTierError now where `NANOSERVE_CPU_ISA` names no tier or one the CPU lacks
    (the CLI's start-up check; the tier itself is chosen at the first kernel's load)."""
    asked = os.environ.get("NANOSERVE_CPU_ISA", "auto").strip().lower() or "auto"
    if asked == "auto":
        return
    if asked not in TIERS:
        raise CpuTierError(f"NANOSERVE_CPU_ISA={asked!r} is not a tier: one of "
                           f"{', '.join(TIERS)} or auto")
    missing = tier_missing(asked)
    if missing:
        raise CpuTierError(f"NANOSERVE_CPU_ISA={asked}: this CPU lacks {', '.join(missing)} "
                           f"(it can run: {', '.join(available_tiers()) or 'none'})")


@functools.cache
def cpu_tier() -> str:
    """The tier this process runs: `NANOSERVE_CPU_ISA` (avx2, avxvnni, avx512, amx, amx-emu or
    auto; default auto, the tuner's measured choice (`prefer_tier`), else the best tier the CPU
    has). Raises CpuTierError for a name that is no tier or a tier the CPU lacks."""
    check_cpu_isa()
    asked = os.environ.get("NANOSERVE_CPU_ISA", "auto").strip().lower() or "auto"
    if asked != "auto":
        return asked
    if _preferred_tier is not None:
        return _preferred_tier
    return next((t for t in reversed(AUTO_TIERS) if not tier_missing(t)), "avx2")


def available_tiers() -> list[str]:
    """Every tier this CPU can run, worst first (amx-emu last, where the CPU has AVX-512)."""
    return [t for t in TIERS if not tier_missing(t)]


def available_auto_tiers() -> list[str]:
    """The tiers `auto` may choose on this CPU, worst first."""
    return [t for t in AUTO_TIERS if not tier_missing(t)]


def missing_build_tool() -> str | None:
    """Why the kernels cannot be built here, or None when they can."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} is not on PATH)"
    venv_bin = str(Path(sys.executable).parent)
    if shutil.which("ninja") is None and shutil.which("ninja", path=venv_bin) is None:
        return "ninja is not installed (pip install ninja)"
    if not cpu_has_avx2():
        return "this CPU lacks AVX2/FMA/F16C"
    return None


def load_kernels(name: str, tier: str | None = None) -> ModuleType | None:
    """The compiled extension built from `csrc/<name>.cpp`, or None (with one warning). A
    tiered kernel is built for `tier` (default: the process's, `kernel_tier()`), every other
    for avx2."""
    if name not in TIERED_KERNELS:
        tier = "avx2"
    elif tier is None:
        tier = kernel_tier()
    return _load_or_warn(name, tier)


_loaded: set[tuple[str, str]] = set()  # (kernel, tier) of each module this process loaded
_modules: list[ModuleType] = []  # every module loaded, for the schedule
_schedule: list[int] | None = None  # the schedule every module runs (None: its defaults)


def set_kernel_schedule(flat: list[int]) -> None:
    """Run every kernel module of this process, loaded now or later, on the schedule `flat`
    (csrc/schedule.h; `kernel_tuning.Schedule.flat()`). Only when and how bytes move and work
    is split change: every output stays the same."""
    global _schedule
    _schedule = list(flat)
    for module in _modules:
        if hasattr(module, "set_schedule"):
            module.set_schedule(_schedule)


def kernel_schedule() -> list[int] | None:
    """The schedule set with `set_kernel_schedule`, or None (the modules' defaults)."""
    return None if _schedule is None else list(_schedule)


def loaded_tier() -> str | None:
    """The tier of the quantized matmul this process runs, or None where it loaded none (no
    compiler, a CUDA model)."""
    if not any(name == "quant_matmul" for name, _ in _loaded):
        return None
    return kernel_tier()  # decided before the first load


@functools.cache
def _load_or_warn(name: str, tier: str) -> ModuleType | None:
    reason = missing_build_tool()
    if reason is None:
        try:
            module = _build(name, tier)
            if name == "quant_matmul" and tier == kernel_tier():
                module.register_ops()  # the dispatcher's nanoserve::packed_matmul: this tier's
            if _schedule is not None and hasattr(module, "set_schedule"):
                module.set_schedule(_schedule)
            _loaded.add((name, tier))
            _modules.append(module)
            return module
        except Exception as exc:  # a failed build must leave the plain path working
            reason = f"building {name} failed: {exc}"
    warnings.warn(f"nanoserve: C++ kernels unavailable ({reason}); using the PyTorch path",
                  RuntimeWarning, stacklevel=3)
    return None


@functools.cache
def kernel_tier() -> str:
    """The tier the quantized kernels run in this process: `cpu_tier()`, unless its modules
    fail to build, to find the CPU ready (amx: its tiles' checks) or to prove themselves
    against avx2's (then the next tier down, with one warning)."""
    if missing_build_tool() is not None:
        return "avx2"
    tier = cpu_tier()
    while tier != "avx2":
        refused = _tier_refused(tier)
        if not refused:
            return tier
        lower = _tier_below(tier)
        warnings.warn(f"nanoserve: the {tier} kernels are not used ({refused}); using "
                      f"{lower}", RuntimeWarning, stacklevel=2)
        tier = lower
    return "avx2"


def _tier_below(tier: str) -> str:
    """The best tier `auto` may choose below `tier` that this CPU runs (avx2 at the least)."""
    below = AUTO_TIERS[:AUTO_TIERS.index(tier)] if tier in AUTO_TIERS else ("avx2", "avx512")
    return next((t for t in reversed(below) if not tier_missing(t)), "avx2")


def _tier_refused(tier: str) -> str | None:
    """Why `tier`'s modules cannot run here, or None: a failed build; for the amx tiers, a CPU
    whose tiles are not ready or whose tiles differ from the emulator; products that differ
    from avx2's."""
    try:
        module = _build("quant_matmul", tier)
        if tier in _AMX_TIERS:
            refused = module.amx_not_ready() or module.tile_conformance()
            if refused:
                return str(refused)
        differs = _tier_differs(module, _build("quant_matmul", "avx2"))
        _build("decode_layers", tier)
    except Exception as exc:
        return f"its build failed: {exc}"
    return differs


# a few rows of every layout the kernels run: (ggml type, elements and bytes a block, the byte
# offsets of its f16 scales, which random bytes must not make NaN)
_PROOF_TYPES = (("Q8_0", 8, 32, 34, (0,)), ("Q4_0", 2, 32, 18, (0,)),
                ("Q4_1", 3, 32, 20, (0, 2)), ("Q5_0", 6, 32, 22, (0,)),
                ("Q5_1", 7, 32, 24, (0, 2)), ("Q4_K", 12, 256, 144, (0, 2)),
                ("Q5_K", 13, 256, 176, (0, 2)), ("Q6_K", 14, 256, 210, (208,)),
                ("MXFP4", 39, 32, 17, ()))
_MXFP4 = 39  # its scale is one E8M0 byte at offset 0: random bytes up to 2^127 make inf


def _tier_differs(module: ModuleType, reference: ModuleType) -> str | None:
    """Which layout's product differs between two tiers' quant_matmul modules, or None."""
    import torch

    gen = torch.Generator().manual_seed(0)
    n, k = 40, 512  # 5 groups of 8 output rows: two pairs and one alone in a wide tier
    for label, ggml_type, elems, size, scale_offsets in _PROOF_TYPES:
        raw = torch.randint(0, 256, (n, k // elems, size), dtype=torch.uint8, generator=gen)
        for offset in scale_offsets:
            scales = torch.rand(n, k // elems, generator=gen) * 0.01 + 1e-3
            raw[..., offset:offset + 2] = scales.half().unsqueeze(-1).view(torch.uint8)
        if ggml_type == _MXFP4:
            raw[..., 0] = torch.randint(118, 126, (n, k // elems), dtype=torch.uint8,
                                        generator=gen)
        raw = raw.reshape(-1)
        for rows in (1, 5, 17):
            x = torch.randn(rows, k, generator=gen)
            if not torch.equal(module.quant_matmul(x, raw, ggml_type, n, k),
                               reference.quant_matmul(x, raw, ggml_type, n, k)):
                return f"{label} at {rows} rows differs from avx2"
    return None


@contextlib.contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """Holds this kernel's build to one process at a time; clears a killed build's torch lock."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "nanoserve.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released by the kernel, also when the holder dies
        (build_dir / "lock").unlink(missing_ok=True)  # torch's baton: only a dead build left it
        yield


def _build(name: str, tier: str) -> ModuleType:
    from torch.utils.cpp_extension import load

    # ninja is found on PATH; a venv's bin directory is not on PATH when called by full path
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    suffix = "" if tier == "avx2" else "_" + tier.replace("-", "_")
    build_dir = cache_dir() / f"{name}{suffix}-{_checkout_key()}"
    # torch rebuilds when a source or a flag changes, and sees only the .cpp: the headers'
    # hash, as a flag, makes an edited header rebuild the kernels that include it
    headers = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(CSRC_DIR.glob("*.h"))))
    flags = [*CPU_FLAGS, *TIER_COMPILE_FLAGS[tier], f"-DNANOSERVE_CPU_TIER={tier}",
             f"-DNANOSERVE_HEADERS={headers.hexdigest()[:16]}"]
    with build_lock(build_dir):
        return load(name=f"nanoserve_{name}{suffix}", sources=[str(CSRC_DIR / f"{name}.cpp")],
                    extra_cflags=flags, extra_ldflags=["-fopenmp"],
                    build_directory=str(build_dir), verbose=False)


@functools.cache
def kernel_build_id() -> str:
    """What the kernels' behaviour depends on besides the CPU: their sources, every tier's
    flags and torch's version (the kernel tuner's cache key)."""
    import torch

    digest = hashlib.sha256()
    for path in sorted(CSRC_DIR.glob("*")):
        if path.suffix in (".h", ".cpp"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(repr((CPU_FLAGS, TIER_COMPILE_FLAGS, torch.__version__)).encode())
    return digest.hexdigest()[:16]


def _checkout_key() -> str:
    """Which sources and which Python build these kernels: each checkout and each virtual
    environment gets build directories of its own. One shared directory was rebuilt whenever
    another checkout (other source paths) or venv (other include paths) had built into it last:
    two clones served side by side rebuilt each other's kernels at every start, minutes each."""
    import torch

    where = f"{CSRC_DIR.resolve()}\0{sys.prefix}\0{torch.__version__}"
    return hashlib.sha256(where.encode()).hexdigest()[:10]


# decode_layers, gemma4_layers and hybrid_layers call the ops the first three register: they
# load after them
KERNEL_NAMES: tuple[str, ...] = ("fused_ops", "paged_attention", "quant_matmul", "sampling",
                                 "decode_layers", "gemma4_layers", "delta_net", "hybrid_layers")


def build_tiers() -> list[str]:
    """The tiers `make install` builds: every one this CPU runs, and on an AVX-512 CPU without
    tiles the amx tier too (built, never run here: so its source is known to compile)."""
    tiers = available_tiers()
    if "avx512" in tiers and "amx" not in tiers:
        tiers.append("amx")
    return tiers


if __name__ == "__main__":  # make install: every kernel, tiered ones for each tier the CPU has
    for kernel in KERNEL_NAMES:
        for kernel_tier_name in build_tiers() if kernel in TIERED_KERNELS else ["avx2"]:
            built = load_kernels(kernel, kernel_tier_name) is not None
            print(kernel, kernel_tier_name, "ok" if built else "unavailable")
    print("the tier this machine runs:", kernel_tier())
