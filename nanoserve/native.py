"""Builds and loads nanoserve's C++ kernels (`nanoserve/csrc/*.cpp`) on first use.

Each kernel file is one PyTorch extension, compiled with `torch.utils.cpp_extension.load` into
the user's cache directory (`~/.cache/nanoserve/ext`, or `$XDG_CACHE_HOME/nanoserve/ext`) so only
the first start on a machine pays for the build. `make install` builds them ahead of time
(`python -m nanoserve.native`).

Builds of one kernel are serialised by an `flock` on its build directory, which the kernel drops
when the holder dies. torch's own lock (a `lock` file it creates and deletes) outlives a build that
was killed, and every later build then waits on it forever; under our lock any such file is a
leftover, and is removed.

Flags are fixed, never `-march=native`: AVX2 + FMA + F16C is what the kernels use, the build
machine may differ from the run machine, and AVX-512 must not be emitted. Where there is no
compiler, no AVX2, or the build fails, `load_kernels` returns None and says why once; the callers
then keep the plain PyTorch path.
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
CPU_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-std=c++17"]


def cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "nanoserve" / "ext"


def cpu_has_avx2() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: let the compiler and the first call decide
        return True
    return " avx2" in flags and " fma" in flags and " f16c" in flags


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


@functools.cache
def load_kernels(name: str) -> ModuleType | None:
    """The compiled extension built from `csrc/<name>.cpp`, or None (with one warning)."""
    reason = missing_build_tool()
    if reason is None:
        try:
            return _build(name)
        except Exception as exc:  # a failed build must leave the plain path working
            reason = f"building {name} failed: {exc}"
    warnings.warn(f"nanoserve: C++ kernels unavailable ({reason}); using the PyTorch path",
                  RuntimeWarning, stacklevel=2)
    return None


@contextlib.contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """Holds this kernel's build to one process at a time; clears a killed build's torch lock."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "nanoserve.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released by the kernel, also when the holder dies
        (build_dir / "lock").unlink(missing_ok=True)  # torch's baton: only a dead build left it
        yield


def _build(name: str) -> ModuleType:
    from torch.utils.cpp_extension import load

    # ninja is found on PATH; a venv's bin directory is not on PATH when called by full path
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    build_dir = cache_dir() / name
    # torch rebuilds when a source or a flag changes, and sees only the .cpp: the headers'
    # hash, as a flag, makes an edited header rebuild the kernels that include it
    headers = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(CSRC_DIR.glob("*.h"))))
    flags = [*CPU_FLAGS, f"-DNANOSERVE_HEADERS={headers.hexdigest()[:16]}"]
    with build_lock(build_dir):
        return load(name=f"nanoserve_{name}", sources=[str(CSRC_DIR / f"{name}.cpp")],
                    extra_cflags=flags, extra_ldflags=["-fopenmp"],
                    build_directory=str(build_dir), verbose=False)


# decode_layers calls the ops the first three register: it loads after them
KERNEL_NAMES: tuple[str, ...] = ("fused_ops", "paged_attention", "quant_matmul", "sampling",
                                 "decode_layers")


if __name__ == "__main__":
    for kernel in KERNEL_NAMES:
        print(kernel, "ok" if load_kernels(kernel) is not None else "unavailable")
