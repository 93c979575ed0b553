"""The attention backends (model/attention/) built from a hand-made step input: each builds the
metadata its path needs, computes what the functions it wraps compute (bit for bit), and the two
agree with each other on a step that mixes decodes, a prompt and a chunk over a cached prefix."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from step_inputs import make_step_input

from nanoserve.model.attention import (
    CpuPagedBackend,
    CpuPagedMetadata,
    PrefillChunk,
    SdpaBackend,
    SdpaMetadata,
    head_block_rows,
    select_attention_backend,
)
from nanoserve.model.attention.cpu_paged import can_read_cache_in_place, decode_attention
from nanoserve.model.attention.sdpa import gather_decode_attention, prefill_attention
from nanoserve.protocol import StepInput

CPU = torch.device("cpu")
BLOCK_SIZE, NUM_BLOCKS, NUM_KV_HEADS, GROUP, HEAD_DIM = 4, 24, 2, 3, 16
needs_kernel = pytest.mark.skipif(not can_read_cache_in_place(CPU, torch.float32),
                                  reason="paged attention kernel unavailable")


def mixed_step() -> StepInput:
    """Two decodes (positions 6 and 0), a 5-token prompt, a 3-token chunk after 9 cached
    tokens; each request's row padded with stale ids past its own blocks."""
    table = np.array([[3, 8, 1, 1],    # decode at 6: blocks 3, 8
                      [5, 9, 9, 2],    # decode at 0: block 5
                      [10, 11, 0, 4],  # prompt 0..4: blocks 10, 11
                      [6, 7, 12, 0]])  # chunk 9..11: blocks 6, 7, 12
    return make_step_input([6, 0, 0, 9], [1, 1, 5, 3], table, BLOCK_SIZE)


def backend(kind: type[SdpaBackend] | type[CpuPagedBackend]) -> SdpaBackend | CpuPagedBackend:
    return kind(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, num_blocks=NUM_BLOCKS,
                device=CPU)


def random_inputs(num_tokens: int, cache_dtype: torch.dtype, seed: int = 0
                  ) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_KV_HEADS, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    v_cache = torch.randn(shape, generator=gen).to(cache_dtype)
    q = torch.randn(num_tokens, NUM_KV_HEADS * GROUP, HEAD_DIM, generator=gen)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    return q, k, v, k_cache, v_cache


def test_sdpa_metadata_is_what_the_runner_built() -> None:
    """Decodes: every head's rows of their blocks up to the longest context, and a key mask;
    a prompt attends to itself; a chunk after cached tokens gathers its whole context."""
    meta = backend(SdpaBackend).build_metadata(mixed_step())
    assert isinstance(meta, SdpaMetadata) and meta.reads_new_kv
    assert meta.cache_index.tolist() == [8 * 4 + 2, 5 * 4, *range(40, 45), 12 * 4 + 1,
                                         12 * 4 + 2, 12 * 4 + 3]
    assert meta.decodes is not None and meta.decodes.num_decodes == 2
    expected_rows = head_block_rows(np.array([[3, 8], [5, 9]]), NUM_KV_HEADS, NUM_BLOCKS)
    assert meta.decodes.block_rows.tolist() == expected_rows.tolist()
    assert meta.decodes.key_mask.shape == (2, 1, 1, 8)
    assert meta.decodes.key_mask[:, 0, 0].sum(dim=1).tolist() == [7, 1]
    prompt, chunk = meta.prefills
    assert (prompt.start, prompt.num_tokens, prompt.context_len) == (2, 5, 5)
    assert prompt.block_ids is None and prompt.mask is None
    assert (chunk.start, chunk.num_tokens, chunk.context_len) == (7, 3, 12)
    assert chunk.block_ids is not None and chunk.mask is not None
    assert chunk.block_ids.tolist() == head_block_rows(np.array([6, 7, 12]), NUM_KV_HEADS,
                                                       NUM_BLOCKS).tolist()
    assert torch.equal(chunk.mask, torch.arange(12)[None, :] <= torch.arange(9, 12)[:, None])


def test_cpu_paged_metadata_makes_every_token_a_query() -> None:
    meta = backend(CpuPagedBackend).build_metadata(mixed_step())
    assert isinstance(meta, CpuPagedMetadata) and not meta.reads_new_kv
    assert meta.context_lens.dtype == torch.int32 and meta.block_table.dtype == torch.int32
    assert meta.context_lens.tolist() == [7, 1, 1, 2, 3, 4, 5, 10, 11, 12]
    assert meta.block_table.is_contiguous() and meta.block_table.shape == (10, 3)
    assert meta.block_table[:, 0].tolist() == [3, 5, 10, 10, 10, 10, 10, 6, 6, 6]


def test_decode_only_step() -> None:
    step = make_step_input([6, 0], [1, 1], np.array([[3, 8, 1], [5, 9, 9]]), BLOCK_SIZE)
    sdpa = backend(SdpaBackend).build_metadata(step)
    assert not sdpa.prefills and not sdpa.reads_new_kv
    assert backend(CpuPagedBackend).build_metadata(step).block_table.tolist() == [[3, 8],
                                                                                  [5, 9]]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_sdpa_forward_is_the_gather_and_the_chunk_loop(cache_dtype: torch.dtype) -> None:
    """The backend's forward equals its functions called on the same metadata, bit for bit:
    the decodes' gather, then each chunk."""
    attention = backend(SdpaBackend)
    meta = attention.build_metadata(mixed_step())
    q, k, v, k_cache, v_cache = random_inputs(10, cache_dtype)
    ours = attention.forward(q, k, v, k_cache, v_cache, meta)  # writes this step's k, v
    assert meta.decodes is not None
    expected = [gather_decode_attention(q[:2], k_cache, v_cache, meta.decodes)]
    for chunk in meta.prefills:
        rows = slice(chunk.start, chunk.start + chunk.num_tokens)
        expected.append(prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, chunk))
    assert torch.equal(ours, torch.cat(expected))


@needs_kernel
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_cpu_paged_forward_is_one_kernel_call(cache_dtype: torch.dtype) -> None:
    attention = backend(CpuPagedBackend)
    meta = attention.build_metadata(mixed_step())
    q, k, v, k_cache, v_cache = random_inputs(10, cache_dtype)
    ours = attention.forward(q, k, v, k_cache, v_cache, meta)
    assert torch.equal(ours, decode_attention(q, k_cache, v_cache, meta.block_table,
                                              meta.context_lens))


@needs_kernel
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_the_backends_agree(cache_dtype: torch.dtype) -> None:
    """Same step, same inputs: the same outputs within float32 rounding, and the same cache."""
    step = mixed_step()
    inputs = random_inputs(step.num_tokens, cache_dtype, seed=3)
    outs, caches = [], []
    for kind in (SdpaBackend, CpuPagedBackend):
        q, k, v, k_cache, v_cache = (t.clone() for t in inputs)
        attention = backend(kind)
        outs.append(attention.forward(q, k, v, k_cache, v_cache,
                                      attention.build_metadata(step)))
        caches.append((k_cache, v_cache))
    assert outs[0].shape == (10, NUM_KV_HEADS * GROUP * HEAD_DIM)
    error = ((outs[0] - outs[1]).abs().max() / outs[0].abs().max()).item()
    assert error < 1e-5
    assert all(torch.equal(a, b) for a, b in zip(caches[0], caches[1], strict=True))


def test_stored_keys_are_not_written_again() -> None:
    attention = backend(SdpaBackend)
    step = make_step_input([6], [1], np.array([[3, 8]]), BLOCK_SIZE)
    q, k, v, k_cache, v_cache = random_inputs(1, torch.float32)
    before = k_cache.clone()
    attention.forward(q, None, None, k_cache, v_cache, attention.build_metadata(step),
                      stored=True)
    assert torch.equal(k_cache, before)
    attention.forward(q, k, v, k_cache, v_cache, attention.build_metadata(step))
    assert torch.equal(k_cache[:, 8, 2], k[0])  # position 6: block 8, row 2


def test_a_self_attending_chunk_alone() -> None:
    """Metadata a test may build by hand (no step input): one prompt attending to itself."""
    q, k, v, k_cache, v_cache = random_inputs(5, torch.float32)
    meta = SdpaMetadata(cache_index=torch.arange(5), prefills=[PrefillChunk(0, 5, 5)])
    out = backend(SdpaBackend).forward(q, k, v, k_cache, v_cache, meta)
    assert torch.equal(out, prefill_attention(q, k, v, k_cache, v_cache, meta.prefills[0]))


def test_the_selector() -> None:
    kernel = can_read_cache_in_place(CPU, torch.float32)
    chosen = select_attention_backend(CPU, torch.float32, block_size=16, num_kv_heads=2,
                                      num_blocks=8)
    assert isinstance(chosen, CpuPagedBackend if kernel else SdpaBackend)
    for device, dtype in ((CPU, torch.bfloat16), (torch.device("cuda"), torch.float32)):
        chosen = select_attention_backend(device, dtype, block_size=16, num_kv_heads=2,
                                          num_blocks=8)
        assert isinstance(chosen, SdpaBackend) and chosen.block_size == 16
    with pytest.raises(ValueError, match="int8 KV cache needs the CPU attention kernel"):
        select_attention_backend(torch.device("cuda"), torch.int8, block_size=16,
                                 num_kv_heads=2, num_blocks=8)
