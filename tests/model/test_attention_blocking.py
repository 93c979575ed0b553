"""The keys decode attention reads a step of its walk (schedule.h's attention_block_tokens:
one, two or four 32-key tiles) is a schedule, not arithmetic: every candidate gives the default's
output bit for bit, on every cache type, on the layouts the kernel's own tests cover (odd head
sizes, groups and block sizes, mixed contexts, contexts split into partitions, one thread and
two), in sliding windows (a window starts inside a tile and inside a step) and with sinks."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from test_paged_attention import random_case, with_cache_dtype

from nanoserve import native
from nanoserve.kernel_tuning.schedule import ATTENTION_BLOCK_TOKENS, DEFAULT, ROW_CLASSES
from nanoserve.kernel_tuning.schedule import LAYOUTS as LAYOUTS_OF_SCHEDULE
from nanoserve.model.attention.cpu_paged import decode_attention

if native.missing_build_tool() is not None or native.load_kernels("paged_attention") is None:
    pytest.skip(f"paged attention kernel unavailable: {native.missing_build_tool()}",
                allow_module_level=True)

CACHE_DTYPES = [torch.float32, torch.float16, torch.int8]
LENS = [1, 3, 17, 33, 300, 5, 1000]  # mixed: within a tile, a step, several steps
# (group, head_dim, block_size): test_paged_attention.py's float16 and int8 layouts
LAYOUTS = [(1, 64, 16), (3, 64, 5), (4, 128, 1), (9, 8, 7), (2, 24, 32), (5, 16, 3)]


@pytest.fixture(autouse=True)
def default_schedule_after() -> Any:
    yield
    native.set_kernel_schedule(DEFAULT.flat())


def under_every_block_size(attend: Any) -> None:
    """`attend()` under each candidate equals it under DEFAULT, bit for bit."""
    native.set_kernel_schedule(DEFAULT.flat())
    expected = attend()
    for tokens in ATTENTION_BLOCK_TOKENS[1:]:
        schedule = dataclasses.replace(DEFAULT, attention_block_tokens=tokens)
        native.set_kernel_schedule(schedule.flat())
        assert native.load_kernels("paged_attention").get_schedule() == schedule.flat()
        assert torch.equal(attend(), expected), tokens


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize(("group", "head_dim", "block_size"), LAYOUTS)
def test_every_block_size_gives_the_same_bits(group: int, head_dim: int, block_size: int,
                                              cache_dtype: torch.dtype) -> None:
    case = with_cache_dtype(random_case(LENS, num_kv_heads=3, group=group, head_dim=head_dim,
                                        seed=block_size, block_size=block_size), cache_dtype)
    under_every_block_size(lambda: decode_attention(*case))


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("context_len", [1, 257, 1000, 2049])
def test_split_contexts_give_the_same_bits(context_len: int, num_threads: int,
                                           cache_dtype: torch.dtype) -> None:
    """Partitions of 512 keys (whole steps of every size), alone and beside a short request."""
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        for lens in ([context_len], [context_len, 3]):
            case = with_cache_dtype(random_case(lens, num_kv_heads=2, group=3, head_dim=64,
                                                seed=context_len), cache_dtype)
            under_every_block_size(lambda case=case: decode_attention(*case))
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("window", [1, 40, 100, 200, 600])
def test_windows_and_sinks_give_the_same_bits(window: int, cache_dtype: torch.dtype) -> None:
    """A window's first key anywhere in a tile or a step; sinks join where a row normalizes."""
    lens = [1, 50, 129, 300, 1000, 2049]
    case = with_cache_dtype(random_case(lens, num_kv_heads=2, group=4, head_dim=64,
                                        seed=window), cache_dtype)
    sinks = torch.linspace(-4.0, 4.0, case[0].shape[1])
    under_every_block_size(lambda: decode_attention(*case, window))
    under_every_block_size(lambda: decode_attention(*case, window, sinks=sinks))


def test_a_block_size_outside_the_candidates_is_refused() -> None:
    flat = DEFAULT.flat()
    flat[2 * len(LAYOUTS_OF_SCHEDULE) * len(ROW_CLASSES) + 1] = 48  # after attention_hint
    with pytest.raises(RuntimeError, match="attention_block_tokens is 32, 64 or 128, got 48"):
        native.load_kernels("paged_attention").set_schedule(flat)
    with pytest.raises(ValueError, match="attention_block_tokens 48 is not one of"):
        dataclasses.replace(DEFAULT, attention_block_tokens=48)
