"""Process-wide allocator tuning for CPU inference.

PyTorch's CPU allocator is plain malloc. glibc serves large blocks (above a threshold of at
most 32 MB) with fresh mmap'd pages and returns them to the OS on free, so a step that makes a
[256, 49152] float32 temporary pays a page fault for every 4 KiB of it, every step: on a small
VM that made a 256-row sampling pass 7x slower. Raising the mmap and trim thresholds keeps freed
memory in the heap for reuse. Called once when an engine starts on the CPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_THRESHOLD = 1 << 30  # 1 GiB: anything a step allocates is reused, not unmapped


def keep_freed_memory_in_heap() -> bool:
    """Tune glibc malloc (Linux only); True if it took effect."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, _THRESHOLD)
                    and libc.mallopt(_M_TRIM_THRESHOLD, _THRESHOLD))
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False


def available_memory_bytes() -> int | None:
    """The memory the kernel says a new allocation can have without swapping
    (`MemAvailable` in /proc/meminfo); None where there is no such file."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_kv_cache_fits(num_bytes: int) -> None:
    """Refuse, before allocating, a CPU KV cache larger than the memory left after the
    weights: touched page by page it would be ended by the kernel's out-of-memory killer with
    no word of why."""
    available = available_memory_bytes()
    if available is not None and num_bytes > available:
        gib = 1 << 30
        raise ValueError(
            f"not enough memory for the KV cache: it needs {num_bytes / gib:.1f} GiB and "
            f"{available / gib:.1f} GiB is available after loading the model; lower "
            "--kv-cache-memory (or --num-kv-blocks)")
