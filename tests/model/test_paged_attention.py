"""The in-place paged decode kernel (attention/cpu_paged.py) equals the gather + SDPA path it
replaces (attention/sdpa.py's `gather_decode_attention`) and a plain float64 softmax, on
shuffled block tables; on a float16 cache it equals both on the same (rounded) keys and values,
and on an int8 cache the float64 softmax over the dequantized ones."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import make_engine, run_to_completion
from step_inputs import make_step_input

from nanoserve.model.attention import (
    CpuPagedBackend,
    GatheredDecodes,
    SdpaBackend,
    cpu_paged,
    dequantize_kv_rows,
    head_block_rows,
    quantize_kv_rows,
    selector,
)
from nanoserve.model.attention.cpu_paged import can_read_cache_in_place, decode_attention
from nanoserve.model.attention.sdpa import gather_decode_attention
from nanoserve.native import load_kernels, missing_build_tool
from nanoserve.sampling_params import SamplingParams

if missing_build_tool() is not None or load_kernels("paged_attention") is None:
    pytest.skip(f"paged attention kernel unavailable: {missing_build_tool()}",
                allow_module_level=True)

BLOCK_SIZE = 16
CONTEXT_LENS = [1, 15, 16, 17, 300, 17, 1, 300, 16]  # mixed in one batch


def random_case(context_lens: list[int], num_kv_heads: int, group: int, head_dim: int,
                seed: int = 0, block_size: int = BLOCK_SIZE) -> tuple[torch.Tensor, ...]:
    """q [B, H, D], caches [Hkv, num_blocks, block_size, D], and each request's blocks drawn at
    random from a shuffled pool (non-contiguous, in no order), padded with stale ids past the
    end."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 7
    max_blocks = max(-(-n // block_size) for n in context_lens) + 2
    k_cache = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=gen)
    v_cache = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=gen)
    pool = torch.randperm(num_blocks, generator=gen)
    table = torch.randint(0, num_blocks, (len(context_lens), max_blocks), generator=gen)
    taken = 0
    for row, n in enumerate(context_lens):
        used = -(-n // block_size)
        table[row, :used] = pool[taken : taken + used]
        taken += used
    q = 2 * torch.randn(len(context_lens), num_kv_heads * group, head_dim, generator=gen)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    return q, k_cache, v_cache, table.to(torch.int32), lens


def sdpa_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   table: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Today's gather + SDPA decode path, with the metadata the runner builds for it."""
    num_kv_heads, num_blocks, block_size = k_cache.shape[:3]
    rows = head_block_rows(table.numpy().astype(np.int64), num_kv_heads, num_blocks)
    mask = torch.arange(table.shape[1] * block_size)[None, :] < lens[:, None].long()
    decodes = GatheredDecodes(torch.from_numpy(rows), mask[:, None, None, :], lens.long())
    return gather_decode_attention(q, k_cache, v_cache, decodes)


def plain_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    table: torch.Tensor, lens: torch.Tensor,
                    scale: float | None = None, window: int = 0) -> torch.Tensor:
    """softmax(q Kᵀ * scale) V per request (scale 1 / √D unless given), in float64, token by
    token through the table; over each request's last `window` keys where window > 0."""
    batch, num_heads, head_dim = q.shape
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    num_kv_heads, _, block_size = k_cache.shape[:3]
    out = torch.empty(batch, num_heads, head_dim, dtype=torch.float64)
    for b, n in enumerate(lens.tolist()):
        t = torch.arange(max(0, n - window) if window else 0, n)
        rows = table[b, t // block_size].long() * block_size + t % block_size
        keys = k_cache.view(num_kv_heads, -1, head_dim)[:, rows].double()  # [Hkv, n, D]
        values = v_cache.view(num_kv_heads, -1, head_dim)[:, rows].double()
        grouped = q[b].view(num_kv_heads, -1, head_dim).double()  # [Hkv, G, D]
        probs = torch.softmax(grouped @ keys.transpose(1, 2) * scale, dim=-1)
        out[b] = (probs @ values).reshape(num_heads, head_dim)
    return out.view(batch, num_heads * head_dim)


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours.double() - reference.double()).abs().max() / reference.abs().max()).item()


def with_cache_dtype(case: tuple[torch.Tensor, ...], dtype: torch.dtype
                     ) -> tuple[torch.Tensor, ...]:
    """The same case with its caches converted (rounded, for float16; quantized rows of
    D + 4 bytes, for int8); q stays float32."""
    q, k_cache, v_cache, table, lens = case
    if dtype == torch.int8:
        return q, quantize_kv_rows(k_cache), quantize_kv_rows(v_cache), table, lens
    return q, k_cache.to(dtype), v_cache.to(dtype), table, lens


def widened(case: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """A float16 or int8 case's values in a float32 cache: what the kernel must compute on."""
    q, k_cache, v_cache, table, lens = case
    if k_cache.dtype == torch.int8:
        return q, dequantize_kv_rows(k_cache), dequantize_kv_rows(v_cache), table, lens
    return with_cache_dtype(case, torch.float32)


def reference_on_the_cached_values(case: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """float64 attention over what the cache holds (widened); for an int8 cache with head_dim
    a multiple of 32 (integer scores), q scaled by 1 / √D and rounded to int8 per head as a
    cache row is, as the kernel does."""
    q, k_cache, v_cache, table, lens = widened(case)
    head_dim = q.shape[-1]
    if case[1].dtype != torch.int8 or head_dim % 32:
        return plain_reference(q, k_cache, v_cache, table, lens)
    q8 = dequantize_kv_rows(quantize_kv_rows(q * (1 / math.sqrt(head_dim))))
    return plain_reference(q8, k_cache, v_cache, table, lens, scale=1.0)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_kernel_equals_gather_sdpa(group: int, head_dim: int) -> None:
    case = random_case(CONTEXT_LENS, num_kv_heads=3, group=group, head_dim=head_dim)
    ours = decode_attention(*case)
    assert ours.shape == (len(CONTEXT_LENS), 3 * group * head_dim)
    assert relative_error(ours, sdpa_reference(*case)) < 1e-5
    assert relative_error(ours, plain_reference(*case)) < 1e-5


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.int8])
@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("context_len", [1, 257, 1000, 2049])
def test_split_contexts_merge_exactly(context_len: int, num_threads: int,
                                      cache_dtype: torch.dtype) -> None:
    """One long request has fewer (request, KV head) items than threads want: its context is
    split into partitions merged by log-sum-exp, and equals the unsplit reference."""
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        for lens in ([context_len], [context_len, 3]):
            case = with_cache_dtype(random_case(lens, num_kv_heads=2, group=3, head_dim=64,
                                                seed=context_len), cache_dtype)
            assert relative_error(decode_attention(*case),
                                  reference_on_the_cached_values(case)) < 1e-5
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("head_dim", [8, 16, 24, 32])
@pytest.mark.parametrize("group", [2, 5, 9])
def test_small_and_odd_shapes(group: int, head_dim: int) -> None:
    """Head sizes that are multiples of 8 but not of 16 (the tiny test models use 16 and 32),
    and groups over 4 query heads (taken four at a time)."""
    case = random_case([1, 17, 40], num_kv_heads=2, group=group, head_dim=head_dim, seed=group)
    assert relative_error(decode_attention(*case), plain_reference(*case)) < 1e-5


@pytest.mark.parametrize(("group", "head_dim", "block_size"),
                         [(1, 64, 16), (3, 64, 5), (4, 128, 1), (9, 8, 7), (2, 24, 32),
                          (5, 16, 3)])
def test_float16_cache_equals_gather_on_the_same_values(group: int, head_dim: int,
                                                        block_size: int) -> None:
    """On a float16 cache the kernel (which widens each row as it loads it) equals the gather
    path (which widens what it gathers) and float64 on the rounded values; an odd batch, odd
    contexts and odd block sizes."""
    lens = [1, 3, 17, 33, 300, 5, 1000]
    case = with_cache_dtype(random_case(lens, num_kv_heads=3, group=group, head_dim=head_dim,
                                        seed=block_size, block_size=block_size), torch.float16)
    ours = decode_attention(*case)
    assert ours.dtype == torch.float32
    assert relative_error(ours, sdpa_reference(*case)) < 1e-5
    assert relative_error(ours, plain_reference(*widened(case))) < 1e-5


@pytest.mark.parametrize(("group", "head_dim", "block_size"),
                         [(1, 64, 16), (3, 64, 5), (4, 128, 1), (9, 8, 7), (2, 24, 32)])
def test_int8_cache_equals_float64_on_the_dequantized_values(group: int, head_dim: int,
                                                             block_size: int) -> None:
    """On an int8 cache (rows of D values and a scale, not a multiple of 64 bytes) the kernel
    equals float64 attention over the dequantized keys and values, with q (scaled by 1 / √D)
    rounded to int8 per head as a cache row is where head_dim is a multiple of 32 (the
    integer scores); odd batch, contexts, block sizes."""
    lens = [1, 3, 17, 33, 300, 5, 1000]
    case = with_cache_dtype(random_case(lens, num_kv_heads=3, group=group, head_dim=head_dim,
                                        seed=block_size, block_size=block_size), torch.int8)
    assert case[1].shape[-1] == head_dim + 4
    ours = decode_attention(*case)
    assert relative_error(ours, reference_on_the_cached_values(case)) < 1e-5
    # q's rounding (integer scores) moves the result by about a percent of its largest value
    assert relative_error(ours, plain_reference(*widened(case))) < 3e-2


def test_int8_rows_round_trip_within_half_a_step() -> None:
    rows = torch.randn(50, 3, 64) * torch.logspace(-3, 3, 50)[:, None, None]
    rows[7] = 0.0  # an all-zero row keeps a zero scale and zero values
    back = dequantize_kv_rows(quantize_kv_rows(rows))
    step = rows.abs().amax(dim=-1, keepdim=True) / 127
    assert ((back - rows).abs() <= step * 0.5 * (1 + 1e-5)).all()
    assert torch.equal(back[7], rows[7])


def test_mixed_cache_dtypes_are_refused() -> None:
    q, k_cache, v_cache, table, lens = random_case([20], num_kv_heads=1, group=1, head_dim=8)
    with pytest.raises(RuntimeError, match="must both be float32, both float16 or both int8"):
        decode_attention(q, k_cache.half(), v_cache, table, lens)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_decodes_in_a_mixed_batch_take_the_kernel_path(cache_dtype: torch.dtype) -> None:
    """Both backends give the same rows for decodes with a prefill chunk in the same batch
    (which the kernel backend attends token by token)."""
    q_dec, k_cache, v_cache, table, lens = with_cache_dtype(
        random_case([5, 33], num_kv_heads=2, group=2, head_dim=16), cache_dtype)
    chunk_len = 4
    q = torch.cat([q_dec, torch.randn(chunk_len, 4, 16)])
    k, v = torch.randn(2 + chunk_len, 2, 16), torch.randn(2 + chunk_len, 2, 16)
    # each decode's new token goes to its last position, the chunk's to a block no decode
    # holds (both backends write the same rows of their own copy of the cache)
    used = {int(b) for row, n in zip(table, lens.tolist(), strict=True)
            for b in row[: -(-n // BLOCK_SIZE)]}
    chunk_row = table[0].clone()
    chunk_row[0] = min(set(range(k_cache.shape[1])) - used)
    step = make_step_input([n - 1 for n in lens.tolist()] + [0], [1, 1, chunk_len],
                           torch.cat([table, chunk_row[None]]).numpy(), BLOCK_SIZE)
    outs = []
    for is_in_place in (False, True):
        backend = (CpuPagedBackend if is_in_place else SdpaBackend)(
            block_size=BLOCK_SIZE, num_kv_heads=2, num_blocks=k_cache.shape[1],
            device=torch.device("cpu"))
        meta = backend.build_metadata(step)
        outs.append(backend.forward(q, k, v, k_cache.clone(), v_cache.clone(), meta))
    assert relative_error(outs[1], outs[0]) < 1e-5


def chunk_case(prompt_len: int, chunk: range, decodes: tuple[int, ...], seed: int = 0,
               group: int = 3, head_dim: int = 64) -> tuple[torch.Tensor, ...]:
    """A prefill chunk's rows (positions `chunk` of a `prompt_len`-token request, each row a
    copy of the request's table, as the backend builds them) followed by `decodes` requests of
    their own, with fresh queries; 3 KV heads of `group` query heads each."""
    _, k_cache, v_cache, table, _ = random_case([prompt_len, *decodes], num_kv_heads=3,
                                                group=group, head_dim=head_dim, seed=seed)
    tables = torch.cat([table[:1].repeat(len(chunk), 1), table[1:]]).contiguous()
    lens = torch.tensor([t + 1 for t in chunk] + list(decodes), dtype=torch.int32)
    q = 2 * torch.randn(len(lens), 3 * group, head_dim,
                        generator=torch.Generator().manual_seed(seed + 1))
    return q, k_cache, v_cache, tables, lens


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize(("prompt_len", "chunk", "decodes"),
                         [(40, range(40), ()), (700, range(700), (5, 600)),
                          (1500, range(1000, 1300), (3,)), (1100, range(1023, 1100), ())])
def test_a_chunks_rows_attended_together_equal_each_row_alone(
        prompt_len: int, chunk: range, decodes: tuple[int, ...], num_threads: int,
        cache_dtype: torch.dtype) -> None:
    """A prefill chunk's rows share their keys and are attended in blocks (run_attend.h); each
    row's bits are still those it gets alone, across tiles, partitions and blocks of rows, with
    decodes in the batch: a token's result does not depend on the chunk it came in."""
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        q, k_cache, v_cache, tables, lens = with_cache_dtype(
            chunk_case(prompt_len, chunk, decodes), cache_dtype)
        together = decode_attention(q, k_cache, v_cache, tables, lens)
        alone = torch.cat([decode_attention(q[i : i + 1], k_cache, v_cache, tables[i : i + 1],
                                            lens[i : i + 1]) for i in range(len(lens))])
        assert torch.equal(together, alone)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("group", "head_dim"), [(1, 64), (2, 64), (4, 64), (4, 256), (5, 128),
                                                 (8, 128)])
def test_each_group_and_head_size_attends_alone_as_in_a_chunk(group: int, head_dim: int,
                                                               cache_dtype: torch.dtype) -> None:
    """A decode's scores take the keys transposed in registers, four query heads at a time
    (flash_tiles.h's score_keys), and four heads' P·V run together (accumulate_four); a prefill
    block's rows share one transposed tile: the same bits for every group of query heads."""
    q, k_cache, v_cache, tables, lens = with_cache_dtype(
        chunk_case(300, range(250, 300), (5, 140), group=group, head_dim=head_dim), cache_dtype)
    together = decode_attention(q, k_cache, v_cache, tables, lens)
    alone = torch.cat([decode_attention(q[i : i + 1], k_cache, v_cache, tables[i : i + 1],
                                        lens[i : i + 1]) for i in range(len(lens))])
    assert torch.equal(together, alone)


@pytest.mark.parametrize("is_in_place", [False, True])
def test_float16_cache_write_and_prefix_read(is_in_place: bool) -> None:
    """Each backend writes new keys and values rounded to a float16 cache, and a prefill
    chunk over a cached prefix reads them back widened: the step equals the same step on a
    float32 cache that holds the rounded values, decode and chunk alike."""
    num_kv_heads, group, head_dim, block_size = 2, 2, 16, 4
    gen = torch.Generator().manual_seed(7)
    shape = (num_kv_heads, 8, block_size, head_dim)
    k16 = torch.randn(shape, generator=gen).half()
    v16 = torch.randn(shape, generator=gen).half()
    # a decode at position 4 of blocks [0, 3]; a chunk at positions 6..8 of blocks [5, 2, 7]
    q = torch.randn(4, num_kv_heads * group, head_dim, generator=gen)
    k = torch.randn(4, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(4, num_kv_heads, head_dim, generator=gen)
    step = make_step_input([4, 6], [1, 3], np.array([[0, 3, 0], [5, 2, 7]]), block_size)
    backend = (CpuPagedBackend if is_in_place else SdpaBackend)(
        block_size=block_size, num_kv_heads=num_kv_heads, num_blocks=8,
        device=torch.device("cpu"))
    meta = backend.build_metadata(step)
    paged_attention = backend.forward
    k32, v32 = k16.float(), v16.float()
    ours = paged_attention(q, k, v, k16, v16, meta)
    reference = paged_attention(q, k.half().float(), v.half().float(), k32, v32, meta)
    assert k16.dtype == torch.float16 and ours.dtype == torch.float32
    assert torch.equal(k16.float(), k32) and torch.equal(v16.float(), v32)
    assert torch.equal(k16[:, 7, 0].float(), k[3].half().float())  # the chunk's last token
    assert relative_error(ours, reference) < 1e-5


def test_bad_block_id_is_refused() -> None:
    q, k_cache, v_cache, table, lens = random_case([20], num_kv_heads=1, group=1, head_dim=8)
    table[0, 1] = k_cache.shape[1]
    with pytest.raises(RuntimeError, match="outside the cache"):
        decode_attention(q, k_cache, v_cache, table, lens)


def test_kernel_path_is_chosen_for_cpu_float32_and_float16_only() -> None:
    assert can_read_cache_in_place(torch.device("cpu"), torch.float32)
    assert can_read_cache_in_place(torch.device("cpu"), torch.float16)
    assert not can_read_cache_in_place(torch.device("cpu"), torch.bfloat16)
    assert not can_read_cache_in_place(torch.device("cuda"), torch.float32)


def test_engine_decodes_through_the_kernel(tiny_model_dir: Callable[[str], Path],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU float32 the runner hands decodes, and prefill tokens as queries of their own, to
    the kernel, and the greedy tokens equal those of the gather + SDPA path (the runner told the
    kernel is unavailable)."""
    path = tiny_model_dir("qwen3")
    rng = random.Random(0)
    prompts = {f"p{n}": [rng.randrange(3, 49152) for _ in range(n)] for n in (1, 15, 16, 17, 40)}
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    calls: list[int] = []
    kernel = cpu_paged.CpuPagedBackend.forward

    def counted(self: cpu_paged.CpuPagedBackend, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(args[0].shape[0])
        return kernel(self, *args, **kwargs)

    monkeypatch.setattr(cpu_paged.CpuPagedBackend, "forward", counted)
    in_place = run_to_completion(make_engine(path), prompts, params)
    assert len(prompts) in calls, "all five requests should have decoded in one batch"
    assert max(calls) >= 40, "the prompts' tokens should have been attended by the kernel too"
    calls.clear()
    monkeypatch.setattr(selector, "can_read_cache_in_place", lambda *_: False)
    gathered = run_to_completion(make_engine(path), prompts, params)
    assert not calls
    assert in_place == gathered


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.int8])
@pytest.mark.parametrize(("num_kv_heads", "group"), [(3, 3), (1, 4), (4, 1)],
                         ids=["gqa-9-3", "one-kv-head", "mha"])
def test_tiled_prefill_rows_equal_float64(cache_dtype: torch.dtype, num_kv_heads: int,
                                          group: int) -> None:
    """A prefill chunk's rows (blocks of rows against tiles of keys, flash_tiles.h) and decodes
    beside them equal float64 attention over the cached values, for every cache type and head
    layout (the default model's 9 query heads over 3 KV heads, one KV head, MHA), with
    contexts on both sides of the 32-key tiles' and the 512-key partitions' edges."""
    _, k_cache, v_cache, table, _ = random_case([1100, 31, 32, 33, 513], num_kv_heads, group,
                                                head_dim=64, seed=num_kv_heads)
    chunk = range(480, 560)  # rows crossing a partition edge and every tile edge between
    tables = torch.cat([table[:1].repeat(len(chunk), 1), table[1:]]).contiguous()
    lens = torch.tensor([t + 1 for t in chunk] + [31, 32, 33, 513], dtype=torch.int32)
    q = 2 * torch.randn(len(lens), num_kv_heads * group, 64,
                        generator=torch.Generator().manual_seed(7))
    case = with_cache_dtype((q, k_cache, v_cache, tables, lens), cache_dtype)
    ours = decode_attention(*case)
    assert relative_error(ours, reference_on_the_cached_values(case)) < 1e-5
    alone = torch.cat([decode_attention(*(t[i : i + 1] if t.dim() < 4 else t for t in case))
                       for i in range(len(lens))])
    assert torch.equal(ours, alone)
