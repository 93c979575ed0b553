"""Attention sinks (gpt-oss: a logit per query head in the softmax's denominator, no value) in
every attention path: the paged kernel's decodes, split contexts, prefill-chunk row blocks and
sliding windows on float32, float16 and int8 caches, and both backends' forwards, each equal to
an eager float64 softmax with the sink column (transformers' gpt-oss attention); the kernel's
rows keep their bits alone or batched; and the sinks change the result by far more than the
tolerance, so a path that dropped them, or added them per partition, would fail."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from step_inputs import make_step_input
from test_paged_attention import random_case, relative_error, widened, with_cache_dtype

from nanoserve.model.attention import (
    CpuPagedBackend,
    SdpaBackend,
    dequantize_kv_rows,
    quantize_kv_rows,
)
from nanoserve.model.attention.cpu_paged import decode_attention
from nanoserve.protocol import StepInput

PARTITION_TOKENS = 512  # csrc/paged_attend.h's kPartitionTokens: longer contexts are split

CACHE_DTYPES = [torch.float32, torch.float16, torch.int8]
GQA = [(2, 2), (1, 8)]  # (num_kv_heads, group): H / Hkv = 2 and 8
GQA_IDS = ["gqa-2", "gqa-8"]


def sink_logits(num_heads: int) -> torch.Tensor:
    """[H] float32 sinks from below the scores' range to above it (q = 2 randn, D = 64: scores
    of about 2 standard deviations), so some heads are moved a little and some a lot."""
    return torch.linspace(-2.0, 9.0, num_heads)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread: the reference's small float64 products only wait for a second
    thread (~100x slower on a 2-core machine shared with other processes)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def sink_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   table: torch.Tensor, lens: torch.Tensor, sinks: torch.Tensor,
                   scale: float | None = None, window: int = 0) -> torch.Tensor:
    """The eager gpt-oss attention in float64, token by token through the table: softmax over
    [scores, sinks[h]], the sink's column dropped before P·V; over each request's last
    `window` keys where window > 0. float caches only (widen others first)."""
    batch, num_heads, head_dim = q.shape
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    num_kv_heads, _, block_size = k_cache.shape[:3]
    group = num_heads // num_kv_heads
    out = torch.empty(batch, num_heads, head_dim, dtype=torch.float64)
    with one_thread():
        for b, n in enumerate(lens.tolist()):
            t = torch.arange(max(0, n - window) if window else 0, n)
            rows = table[b, t // block_size].long() * block_size + t % block_size
            keys = k_cache.view(num_kv_heads, -1, head_dim)[:, rows].double()  # [Hkv, n, D]
            values = v_cache.view(num_kv_heads, -1, head_dim)[:, rows].double()
            grouped = q[b].view(num_kv_heads, group, head_dim).double()  # [Hkv, G, D]
            scores = grouped @ keys.transpose(1, 2) * scale  # [Hkv, G, n]
            logits = torch.cat([scores, sinks.double().view(num_kv_heads, group, 1)], dim=-1)
            probs = torch.softmax(logits, dim=-1)[..., :-1]
            out[b] = (probs @ values).reshape(num_heads, head_dim)
    return out.view(batch, num_heads * head_dim)


def reference_on_the_cached_values(case: tuple[torch.Tensor, ...], sinks: torch.Tensor,
                                   window: int = 0) -> torch.Tensor:
    """sink_reference over what the cache holds (widened); for an int8 cache (head_dim a
    multiple of 32: integer scores) with q scaled by 1 / √D and rounded to int8 per head as
    the kernel rounds it (test_paged_attention.py's reference, with the sinks)."""
    q, k_cache, v_cache, table, lens = widened(case)
    head_dim = q.shape[-1]
    if case[1].dtype != torch.int8 or head_dim % 32:
        return sink_reference(q, k_cache, v_cache, table, lens, sinks, window=window)
    q8 = dequantize_kv_rows(quantize_kv_rows(q * (1 / math.sqrt(head_dim))))
    return sink_reference(q8, k_cache, v_cache, table, lens, sinks, scale=1.0, window=window)


def kernel(case: tuple[torch.Tensor, ...], window: int = 0,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel (cpu_paged.decode_attention) on a case (q, caches, tables, lens)."""
    q, k_cache, v_cache, table, lens = case
    return decode_attention(q, k_cache, v_cache, table, lens, window, sinks=sinks)


def each_row_alone(case: tuple[torch.Tensor, ...], sinks: torch.Tensor,
                   window: int = 0) -> torch.Tensor:
    """The kernel on every row of the batch on its own (its context split only by its own
    length, a prefill row never in a block), on one thread: the bits depend on neither."""
    q, k_cache, v_cache, table, lens = case
    with one_thread():
        return torch.cat([decode_attention(q[i : i + 1], k_cache, v_cache, table[i : i + 1],
                                           lens[i : i + 1], window, sinks=sinks)
                          for i in range(len(lens))])


def assert_sinks_matter(without: torch.Tensor, reference: torch.Tensor) -> None:
    """The result without sinks is far (> 1e-2, against the 1e-5 that the result with them
    meets) from the sink reference: a path that dropped them would fail."""
    assert relative_error(without, reference) > 1e-2


@pytest.mark.parametrize("window", [0, 600])
@pytest.mark.parametrize(("num_kv_heads", "group"), GQA, ids=GQA_IDS)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_decodes_and_split_contexts(cache_dtype: torch.dtype, num_kv_heads: int, group: int,
                                    window: int) -> None:
    """Decodes of one to three partitions (contexts past 512 keys are split and merged by
    log-sum-exp; a sliding window of 600 keys starts inside a partition) equal the float64
    reference, and each row's bits are those it gets alone (where a short context alone is
    unsplit and in the batch one non-empty partition of a split)."""
    lens = [1, 31, 300, PARTITION_TOKENS, PARTITION_TOKENS + 1, 1100]
    case = with_cache_dtype(random_case(lens, num_kv_heads, group, head_dim=64, seed=group),
                            cache_dtype)
    sinks = sink_logits(num_kv_heads * group)
    ours = kernel(case, window, sinks)
    reference = reference_on_the_cached_values(case, sinks, window)
    assert relative_error(ours, reference) < 1e-5
    assert torch.equal(ours, each_row_alone(case, sinks, window))
    assert_sinks_matter(kernel(case, window), reference)


@pytest.mark.parametrize("window", [0, 200])
@pytest.mark.parametrize(("num_kv_heads", "group"), GQA, ids=GQA_IDS)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_prefill_chunk_row_blocks(cache_dtype: torch.dtype, num_kv_heads: int, group: int,
                                  window: int) -> None:
    """A prefill chunk's rows (attended in blocks of rows, run_attend.h, and merged per block)
    across a partition edge, with decodes beside them, equal the float64 reference, each row
    with the bits it gets alone: a token's result does not depend on its chunk."""
    _, k_cache, v_cache, table, _ = random_case([1100, 31, 513], num_kv_heads, group,
                                                head_dim=64, seed=num_kv_heads)
    chunk = range(PARTITION_TOKENS - 24, PARTITION_TOKENS + 24)  # three blocks of 16 rows
    tables = torch.cat([table[:1].repeat(len(chunk), 1), table[1:]]).contiguous()
    lens = torch.tensor([t + 1 for t in chunk] + [31, 513], dtype=torch.int32)
    q = 2 * torch.randn(len(lens), num_kv_heads * group, 64,
                        generator=torch.Generator().manual_seed(3))
    case = with_cache_dtype((q, k_cache, v_cache, tables, lens), cache_dtype)
    sinks = sink_logits(num_kv_heads * group)
    ours = kernel(case, window, sinks)
    reference = reference_on_the_cached_values(case, sinks, window)
    assert relative_error(ours, reference) < 1e-5
    assert torch.equal(ours, each_row_alone(case, sinks, window))
    assert_sinks_matter(kernel(case, window), reference)


def test_no_keys_and_extreme_sinks() -> None:
    """A sink far above every score leaves almost nothing (as the reference does, no NaN or
    overflow); one far below leaves the plain softmax; an empty context gives zeros."""
    case = random_case([0, 40, 700], num_kv_heads=1, group=4, head_dim=16, seed=5)
    sinks = torch.tensor([80.0, -80.0, 0.0, -math.inf])
    ours = kernel(case, sinks=sinks).view(3, 4, 16)
    assert torch.equal(ours[0], torch.zeros(4, 16))
    q, k_cache, v_cache, table, lens = case
    reference = sink_reference(q, k_cache, v_cache, table, lens, sinks).view(3, 4, 16)
    assert (ours[1:] - reference[1:]).abs().max().item() < 1e-5
    assert ours[1:, 0].abs().max().item() < 1e-20  # exp(score - 80): far below float's unit
    plain = kernel(case).view(3, 4, 16)
    assert torch.equal(ours[1:, 3], plain[1:, 3])  # a sink of -inf is no sink


def test_bad_sinks_are_refused() -> None:
    case = random_case([20], num_kv_heads=1, group=2, head_dim=8)
    with pytest.raises(RuntimeError, match="sinks must be contiguous CPU float32"):
        kernel(case, sinks=torch.zeros(3))


def backend_step() -> tuple[StepInput, np.ndarray]:
    """Two decodes (positions 6 and 0), a 5-token prompt attending to itself and a 3-token
    chunk after 9 cached tokens (blocks of 4; stale ids past each request's own blocks)."""
    table = np.array([[3, 8, 1, 1], [5, 9, 9, 2], [10, 11, 0, 4], [6, 7, 12, 0]])
    return make_step_input([6, 0, 0, 9], [1, 1, 5, 3], table, 4), table


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize(("num_kv_heads", "group"), GQA, ids=GQA_IDS)
@pytest.mark.parametrize("kind", [SdpaBackend, CpuPagedBackend], ids=["sdpa", "cpu-paged"])
def test_backends_decode_and_prefill(kind: type[SdpaBackend] | type[CpuPagedBackend],
                                     num_kv_heads: int, group: int, window: int) -> None:
    """Each backend's forward with sinks (SDPA's decodes and its two prefill paths: a prompt
    attending to itself, a chunk over a cached prefix) equals the float64 reference over the
    cache it wrote, token by token."""
    step, table = backend_step()
    num_heads, head_dim, num_tokens = num_kv_heads * group, 16, len(step.positions)
    gen = torch.Generator().manual_seed(group)
    shape = (num_kv_heads, 16, 4, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    q = 2 * torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    backend: Any = kind(block_size=4, num_kv_heads=num_kv_heads, num_blocks=16,
                   device=torch.device("cpu"))
    meta = backend.build_metadata(step)
    sinks = sink_logits(num_heads)
    ours = backend.forward(q, k, v, k_cache, v_cache, meta, window=window, sinks=sinks)
    without = backend.forward(q, k, v, k_cache, v_cache, meta, window=window)
    owner = np.repeat(np.arange(len(table)), np.diff(step.query_start_loc))
    reference = sink_reference(q, k_cache, v_cache, torch.from_numpy(table[owner]).int(),
                               torch.from_numpy(step.positions + 1).int(), sinks,
                               window=window)
    assert relative_error(ours, reference) < 1e-5
    assert_sinks_matter(without, reference)
