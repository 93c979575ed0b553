"""Turns a scheduled step into flat input tensors, runs one forward pass, returns logits rows.

Every scheduled token of every request goes into one batch: decodes first (so attention can
take them all at once), then prefill chunks. Logits are computed only for the rows that sample:
the last token of each request whose known tokens are all computed after this step.

The KV cache it allocates holds the model's dtype or, with `--kv-cache-dtype float16` (the
default on the CPU with quantized weights), float16: half the bytes, so twice the tokens in the
same memory and half the reads of decode attention, which is memory-bound (figures in
paged_decode.py). Rounding keys and values to float16 costs far less perplexity than quantized
weights do (docs/benchmarks.md), which is why "auto" pairs the two; exact weights keep an
exact cache.
"""

from __future__ import annotations

import numpy as np
import torch

from nanoserve.engine.block_table import BlockTable
from nanoserve.engine.scheduler import ScheduledRequest
from nanoserve.model.arch import ArchConfig
from nanoserve.model.attention import (
    AttentionMetadata,
    PrefillChunk,
    cache_row_elements,
    head_block_rows,
)
from nanoserve.model.llama import CausalLM
from nanoserve.model.paged_decode import can_read_cache_in_place

KV_CACHE_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "int8": torch.int8}


def resolve_kv_cache_dtype(choice: str, quantization: str, device: torch.device,
                           model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type for `--kv-cache-dtype` `choice`. "auto" is float16 on the CPU
    when the weights are quantized (`quantization`, the resolved mode, is not "none") and the
    decode kernel that reads float16 is built; else `model_dtype`, so the exact path stays
    exact and CUDA keeps its dtype. An int8 cache is read only by the CPU kernel."""
    if choice == "int8" and not can_read_cache_in_place(device, torch.int8):
        why = "is not built here" if device.type == "cpu" else "runs only on the CPU"
        raise ValueError(f"kv_cache_dtype='int8' needs the CPU attention kernel, which {why} "
                         f"(device {device}); use float16 or float32")
    if choice != "auto":
        return KV_CACHE_TORCH_DTYPES[choice]
    if (device.type == "cpu" and quantization != "none"
            and can_read_cache_in_place(device, torch.float16)):
        return torch.float16
    return model_dtype


def kv_bytes_per_block(arch: ArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block's keys and values over all layers, in a cache of `dtype`."""
    element_size = torch.empty((), dtype=dtype).element_size()
    row = cache_row_elements(arch.head_dim, dtype)
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * row * element_size


class ModelRunner:
    """Owns the model and the KV cache tensors; one `execute` per engine step."""

    def __init__(self, model: CausalLM, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, *, num_slots: int,
                 max_model_len: int) -> None:
        arch = model.arch
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.block_table = BlockTable(num_slots, -(-max_model_len // block_size))
        self.num_kv_heads = arch.num_kv_heads
        self.device = device
        # Zero-filled, so masked-out (stale or padding) cache entries are always finite; and
        # touched now, at start-up: a first write to a page during a step costs a page fault.
        shape = (arch.num_kv_heads, num_blocks, block_size,  # see attention.py
                 cache_row_elements(arch.head_dim, dtype))
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=device),
                           torch.zeros(shape, dtype=dtype, device=device))
                          for _ in range(arch.num_layers)]

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest], block_ids: list[list[int]]
                ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Logits [num_sampling_requests, vocab] (float32), in the order of `scheduled`; and,
        for requests that asked for prompt logprobs, the logits at this step's prompt positions
        (keyed by index into `scheduled`; row j predicts prompt token start + j + 1).

        `block_ids[i]` is the KV cache's live block list of `scheduled[i]`'s request; only its
        new tail is copied into the runner's per-slot table.
        """
        for s, ids in zip(scheduled, block_ids, strict=True):
            assert s.request.slot is not None, "a scheduled request holds a slot"
            self.block_table.sync(s.request.slot, ids)
        input_ids, positions, meta, logits_rows, first_row = self._prepare(scheduled)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)  # [T, hidden]
        prompt_logits = {}
        for i, s in enumerate(scheduled):
            request = s.request
            last = min(s.start + s.num_new_tokens, request.num_prompt_tokens - 1)
            if request.params.prompt_logprobs is not None and last > s.start:
                rows = hidden[first_row[i] : first_row[i] + last - s.start]
                prompt_logits[i] = self.model.compute_logits(rows)
        if logits_rows.numel() == 0:  # only partial prefill chunks this step
            empty = hidden.new_empty(0, self.model.arch.vocab_size, dtype=torch.float32)
            return empty, prompt_logits
        return self.model.compute_logits(hidden.index_select(0, logits_rows)), prompt_logits

    def release_slot(self, slot: int) -> None:
        """The request in `slot` finished or was preempted."""
        self.block_table.clear(slot)

    def _prepare(self, scheduled: list[ScheduledRequest]
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor,
                            list[int]]:
        size = self.block_size
        table = self.block_table.table
        order = sorted(range(len(scheduled)), key=lambda i: scheduled[i].num_new_tokens > 1)
        num_decodes = sum(1 for s in scheduled if s.num_new_tokens == 1)
        first_row = [0] * len(scheduled)
        # 1) decodes, one token each, as whole-batch arrays
        decodes = [scheduled[i] for i in order[:num_decodes]]
        for row, i in enumerate(order[:num_decodes]):
            first_row[i] = row
        slots = np.fromiter((s.request.slot for s in decodes), dtype=np.int64,
                            count=num_decodes)
        starts = np.fromiter((s.start for s in decodes), dtype=np.int64, count=num_decodes)
        ids = [s.request.all_token_ids[s.start] for s in decodes]
        positions = [starts]
        cache_index = [table[slots, starts // size].astype(np.int64) * size + starts % size]
        # 2) prefill chunks, each a run of positions. Where the kernel reads the cache in
        # place, each of their tokens is attended as a decode is, a query over the cache up to
        # its own position (written first): its result is then the same whatever chunk it came
        # in and whatever the prefix cache held, bit for bit (as a decode's is, alone or
        # batched), which SDPA over a chunk cannot give. At prompts of 32-512 tokens it is as
        # fast as SDPA or faster (0.5-1.05x its time, one and two threads, measured).
        in_place = can_read_cache_in_place(self.device, self.kv_caches[0][0].dtype)
        prefills: list[PrefillChunk] = []
        query_slots = [slots]
        for i in order[num_decodes:]:
            s = scheduled[i]
            first_row[i] = len(ids)
            end = s.start + s.num_new_tokens
            ids.extend(s.request.all_token_ids[s.start : end])
            pos = np.arange(s.start, end)
            blocks = table[s.request.slot]
            positions.append(pos)
            cache_index.append(blocks[pos // size].astype(np.int64) * size + pos % size)
            if in_place:
                query_slots.append(np.full(len(pos), s.request.slot, dtype=np.int64))
            else:
                prefills.append(self._prefill_chunk(first_row[i], s, blocks))
        if in_place and len(query_slots) > 1:
            slots, starts = np.concatenate(query_slots), np.concatenate(positions)
            num_decodes = len(ids)
        decode_ids, decode_mask, decode_table, decode_lens = self._decode_tables(
            slots, starts, in_place)
        logits_rows = [first_row[i] + s.num_new_tokens - 1
                       for i, s in enumerate(scheduled) if s.samples]
        meta = AttentionMetadata(
            cache_index=self._tensor(np.concatenate(cache_index).astype(np.int64)),
            num_decode_tokens=num_decodes,
            decode_block_ids=decode_ids,
            decode_key_mask=decode_mask,
            prefills=prefills,
            decode_block_table=decode_table,
            decode_context_lens=decode_lens,
        )
        return (self._tensor(np.asarray(ids, dtype=np.int64)),
                self._tensor(np.concatenate(positions)), meta,
                self._tensor(np.asarray(logits_rows, dtype=np.int64)), first_row)

    def _prefill_chunk(self, first_row: int, s: ScheduledRequest,
                       blocks: np.ndarray) -> PrefillChunk:
        context_len = s.start + s.num_new_tokens
        chunk = PrefillChunk(first_row, s.num_new_tokens, context_len)
        if s.start > 0:  # earlier tokens are in the cache: read the whole context from there
            num_blocks = -(-context_len // self.block_size)
            chunk.block_ids = self._tensor(self._head_rows(blocks[:num_blocks]))
            query_pos = np.arange(s.start, context_len)[:, None]
            chunk.mask = self._tensor(np.arange(context_len)[None, :] <= query_pos)
        return chunk

    def _decode_tables(self, slots: np.ndarray, starts: np.ndarray, in_place: bool
                       ) -> tuple[torch.Tensor | None, ...]:
        """(block rows, key mask, block table, context lengths) for the decodes in `slots`,
        each at position `starts`. Where the kernel reads the cache in place (`in_place`,
        paged_decode.py) only the last two are built: the table [B, max_blocks] and lengths
        [B], int32. Else the first two: padded block rows [Hkv * B * max_blocks] and the key
        mask [B, 1, 1, max_blocks * size] for the gather. Entries past a request's own blocks are
        left over from earlier owners of the slot: valid block ids, never read unmasked."""
        if not len(slots):
            return None, None, None, None
        size = self.block_size
        context_lens = starts + 1
        max_blocks = int(-(-context_lens.max() // size))
        padded = self.block_table.table[slots, :max_blocks]  # [B, max_blocks], a fresh copy
        if in_place:
            return (None, None, self._tensor(padded),
                    self._tensor(context_lens.astype(np.int32)))
        mask = np.arange(max_blocks * size)[None, :] < context_lens[:, None]
        return (self._tensor(self._head_rows(padded.astype(np.int64))),
                self._tensor(mask[:, None, None, :]), None, None)

    def _head_rows(self, block_ids: np.ndarray) -> np.ndarray:
        return head_block_rows(block_ids, self.num_kv_heads, self.num_blocks)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)

