"""Turns the scheduler's choice for a step into the workers' data-only `StepInput`.

The flat batch puts single-token requests first (attention takes them all at once), then the
runs of tokens (prefill chunks, and decodes that carry draft tokens), each request's tokens in
order. The core keeps every running request's blocks in a per-slot `BlockTable`, written when
a request is admitted and then only where a block is added, so a step's block table and cache
rows are fancy indexes of one array. Sampled rows follow the scheduled order: one per sampling
request, or 1 + k when it carries k draft tokens. Pooling requests sample nothing: their
rows are named in `pooling` for the worker to pool.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from nanoserve.engine.block_table import BlockTable
from nanoserve.engine.rope_positions import step_rope_positions
from nanoserve.engine.scheduler import ScheduledRequest
from nanoserve.protocol import (
    NewSequence,
    PoolingRows,
    PromptLogprobsRows,
    StepImage,
    StepInput,
)


def build_step_input(scheduled: list[ScheduledRequest], block_table: BlockTable,
                     block_size: int, new_sequences: list[NewSequence],
                     released_slots: list[int],
                     grammar: tuple[np.ndarray, np.ndarray],
                     group_tables: Sequence[BlockTable] = (),
                     images_both_ways: bool = False) -> StepInput:
    """The step input for `scheduled` (their blocks already synced into `block_table`, and
    into `group_tables` for the KV layer groups after the first); `grammar` is the core's
    filled bitmask: (sampled rows with a grammar, their rows). `images_both_ways`: the
    model's image placeholders attend each other both ways (the step's `key_ends`)."""
    order = batch_order(scheduled)
    num_decodes = sum(1 for s in scheduled if s.num_new_tokens == 1)
    first_row = step_first_rows(scheduled)
    # 1) single-token requests, as whole-batch arrays
    decodes = [scheduled[i] for i in order[:num_decodes]]
    token_ids = [s.request.all_token_ids[s.start] for s in decodes]
    positions = [np.fromiter((s.start for s in decodes), dtype=np.int64, count=num_decodes)]
    # 2) runs of tokens: known tokens, then any draft tokens
    for i in order[num_decodes:]:
        s = scheduled[i]
        num_known = s.num_new_tokens - len(s.draft_token_ids)
        token_ids.extend(s.request.all_token_ids[s.start : s.start + num_known])
        token_ids.extend(s.draft_token_ids)
        positions.append(np.arange(s.start, s.start + s.num_new_tokens))
    flat = [scheduled[i] for i in order]
    slots = np.fromiter((s.request.slot for s in flat), dtype=np.int64, count=len(flat))
    num_new = np.fromiter((s.num_new_tokens for s in flat), dtype=np.int64, count=len(flat))
    context_lens = positions[0] + 1 if len(flat) == num_decodes else \
        np.fromiter((s.start + s.num_new_tokens for s in flat), dtype=np.int64, count=len(flat))
    all_positions = np.concatenate(positions)
    token_slots = slots if len(flat) == num_decodes else np.repeat(slots, num_new)
    max_blocks = int(-(-context_lens.max() // block_size)) if len(flat) else 0

    def rows_of(table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A group's cache row per token, and its block table's rows for this step."""
        block_ids = table[token_slots, all_positions // block_size].astype(np.int64)
        return block_ids * block_size + all_positions % block_size, table[slots, :max_blocks]

    cache_index, step_table = rows_of(block_table.table)
    groups = [rows_of(t.table) for t in group_tables]
    query_start_loc = np.zeros(len(flat) + 1, dtype=np.int64)
    np.cumsum(num_new, out=query_start_loc[1:])
    rows = _sample_rows(scheduled, first_row)
    grammar_rows, grammar_bitmask = grammar
    images = step_images(scheduled, first_row)
    key_ends = (image_key_ends(scheduled, first_row, all_positions) if images and images_both_ways
                else np.zeros(0, np.int32))
    rope_positions = (step_rope_positions(
        [(first_row[i], s.start, s.request.rope_positions, s.request.rope_delta,
          s.num_new_tokens) for i, s in enumerate(scheduled)], len(all_positions))
        if any(s.request.rope_positions is not None for s in scheduled)
        else np.zeros((3, 0), np.int64))
    return StepInput(
        token_ids=np.asarray(token_ids, dtype=np.int64), positions=all_positions,
        cache_index=cache_index, query_start_loc=query_start_loc,
        context_lens=context_lens.astype(np.int32),
        block_table=step_table,  # [R, max_blocks], a fresh copy
        num_decodes=num_decodes, logits_rows=rows["logits_rows"],
        sample_slots=rows["sample_slots"], sample_positions=rows["sample_positions"],
        draft_token_ids=rows["draft_token_ids"], num_sample_rows=rows["num_sample_rows"],
        grammar_rows=grammar_rows,
        grammar_bitmask=grammar_bitmask,
        prompt_logprobs=_prompt_logprobs_rows(scheduled, first_row),
        new_sequences=new_sequences, released_slots=released_slots,
        pooling=_pooling_rows(scheduled, first_row),
        group_block_tables=[t for _, t in groups], group_cache_index=[c for c, _ in groups],
        seq_slots=slots.tolist(), images=images, key_ends=key_ends,
        rope_positions=rope_positions)


def step_images(scheduled: Sequence[ScheduledRequest], first_row: list[int]
                ) -> list[StepImage]:
    """The placeholder rows of every image this step computes (an image is never split by a
    chunk, but a prefix hit may have cached its first rows: the features after them)."""
    out = []
    for i, s in enumerate(scheduled):
        end = s.start + s.num_new_tokens
        for image in s.request.images:
            first, last = max(image.offset, s.start), min(image.end, end)
            if first < last:
                out.append(StepImage(first_row[i] + first - s.start, first - image.offset,
                                     last - first, image.content_hash, image.pixels))
    return out


def image_key_ends(scheduled: Sequence[ScheduledRequest], first_row: list[int],
                   positions: np.ndarray) -> np.ndarray:
    """Each token's key end [T] int32: its position + 1, or for an image's placeholder its
    image's end, so it attends every placeholder of its image (the rest of the image is in
    the same step, and its keys are written before any layer attends)."""
    key_ends = (positions + 1).astype(np.int32)
    for i, s in enumerate(scheduled):
        for image in s.request.images:
            first, last = max(image.offset, s.start), min(image.end, s.start + s.num_new_tokens)
            if first < last:
                row = first_row[i] + first - s.start
                key_ends[row : row + last - first] = image.end
    return key_ends


def batch_order(scheduled: Sequence[ScheduledRequest]) -> list[int]:
    """The scheduled requests' indexes in batch order: single-token ones first."""
    return sorted(range(len(scheduled)), key=lambda i: scheduled[i].num_new_tokens > 1)


def step_first_rows(scheduled: Sequence[ScheduledRequest]) -> list[int]:
    """Each scheduled request's first row in the step's flat batch (in scheduled order)."""
    first_row = [0] * len(scheduled)
    row = 0
    for i in batch_order(scheduled):
        first_row[i] = row
        row += scheduled[i].num_new_tokens
    return first_row


def _sample_rows(scheduled: list[ScheduledRequest], first_row: list[int]
                 ) -> dict[str, np.ndarray]:
    """The sampled rows, in scheduled order: each sampling request's last known token's row,
    then one row per draft token."""
    logits_rows: list[int] = []
    slots: list[int] = []
    positions: list[int] = []
    drafts: list[int] = []
    counts: list[int] = []
    for i, s in enumerate(scheduled):
        if not s.samples:
            continue
        num_rows = 1 + len(s.draft_token_ids)
        last_known = first_row[i] + s.num_new_tokens - num_rows
        logits_rows.extend(range(last_known, last_known + num_rows))
        slots.extend([s.request.slot] * num_rows)  # type: ignore[list-item]
        num_output = s.request.num_output_tokens
        positions.extend(range(num_output, num_output + num_rows))
        drafts.extend(s.draft_token_ids)
        drafts.append(-1)
        counts.append(num_rows)
    return {"logits_rows": np.asarray(logits_rows, dtype=np.int64),
            "sample_slots": np.asarray(slots, dtype=np.int64),
            "sample_positions": np.asarray(positions, dtype=np.int64),
            "draft_token_ids": np.asarray(drafts, dtype=np.int64),
            "num_sample_rows": np.asarray(counts, dtype=np.int64)}


def _prompt_logprobs_rows(scheduled: list[ScheduledRequest], first_row: list[int]
                          ) -> list[PromptLogprobsRows]:
    """For requests that asked for prompt logprobs: the rows of this step's prompt positions
    not yet computed (a recompute after preemption skips the ones it has) and their targets."""
    entries = []
    for i, s in enumerate(scheduled):
        request = s.request
        if request.params.prompt_logprobs is None:
            continue
        last = min(s.start + s.num_new_tokens, request.num_prompt_tokens - 1)
        first = max(s.start, len(request.prompt_logprobs))
        if last > first:
            entries.append(PromptLogprobsRows(
                i, first_row[i] + first - s.start, request.prompt_token_ids[first + 1 : last + 1],
                request.params.prompt_logprobs))
    return entries


def _pooling_rows(scheduled: list[ScheduledRequest], first_row: list[int]) -> list[PoolingRows]:
    """The pooling requests' rows the worker reads this step: the chunk that ends a prompt, and
    for a mean every chunk (its running sum needs each position's hidden state)."""
    entries = []
    for i, s in enumerate(scheduled):
        request = s.request
        if request.pooling_params is None:
            continue
        is_last = s.finishes_pooling
        if is_last or request.pooling_method == "mean":
            assert request.slot is not None, "a scheduled request holds a slot"
            entries.append(PoolingRows(
                i, request.slot, first_row[i], s.num_new_tokens, s.start == 0, is_last,
                request.num_prompt_tokens, request.pooling_method, request.pooling_params))
    return entries
