"""Whole decode steps for the step check (step_check.py): the model runner's own forward, as a
serving step runs it (the one-region native layer stack where the runner uses it, the LM head
over every row), at a few batch sizes of requests at one short context.

The steps are built by hand as the engine core would send them (`StepInput`), over KV blocks
of the runner's cache, one run of blocks per request and KV layer group. The tuner runs at
start-up, before the core admits a request, so every block is free; still, the only rows a
step writes (each request's last position, in every group) are saved when the steps are made
and written back when they are done, so a runner is left exactly as it was found. A hybrid
model's DeltaNet state slots are used too: the state pool sets a slot when its request is
admitted (engine/state_pool.py), so whatever the steps leave there is never read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from nanoserve.protocol import StepInput

STEP_BATCHES = (1, 8, 32)
STEP_CONTEXT = 256  # tokens in the cache after the step: a short chat's


@dataclass
class DecodeSteps:
    """One decode step per batch size, ready to run (`run(batch)`)."""

    runner: Any  # the ModelRunner (engine/model_runner.py): kernel_tuning sits below engine
    context: int
    inputs: dict[int, StepInput]  # by batch size: the timed step
    firsts: dict[int, StepInput]  # by batch size: the same with the states set (hybrids)

    @property
    def batches(self) -> list[int]:
        return list(self.inputs)

    def prepare(self) -> None:
        """Run each batch's first step once (a hybrid's states zeroed: the pool's slots start
        unfilled), so that the timed steps compute on finite values."""
        for step in self.firsts.values():
            self.runner.execute(step)

    def run(self, batch: int) -> None:
        """One decode step of `batch` requests, as the runner runs a serving step."""
        self.runner.execute(self.inputs[batch])


@contextlib.contextmanager
def decode_steps(runner: Any, batches: tuple[int, ...] = STEP_BATCHES,
                 context: int = STEP_CONTEXT) -> Iterator[DecodeSteps | None]:
    """The steps over `runner`'s cache (a small cache: a shorter context, and the batch sizes
    that fit; None where the model writes no cache); the rows they write are restored on
    exit."""
    num_groups = runner.kv_groups.num_groups
    context = min(context, runner.model.arch.max_position_embeddings,
                  runner.num_blocks // num_groups * runner.block_size)
    blocks_per_request = -(-context // runner.block_size)
    fit = runner.num_blocks // (num_groups * max(blocks_per_request, 1))
    if runner.state_pool is not None:
        fit = min(fit, runner.state_pool.num_slots)
    batches = tuple(b for b in batches if b <= fit)
    if context < 1 or not batches or not runner.kv_slot_pairs:
        yield None
        return
    tables = [np.arange(group * max(batches) * blocks_per_request,
                        (group + 1) * max(batches) * blocks_per_request, dtype=np.int32)
              .reshape(max(batches), blocks_per_request) for group in range(num_groups)]
    vocab_size = runner.model.arch.vocab_size
    inputs = {b: _step_input(b, context, runner.block_size, tables, vocab_size)
              for b in batches}
    firsts = {b: _step_input(b, context, runner.block_size, tables, vocab_size,
                             is_first=runner.state_pool is not None) for b in batches}
    written = _written_rows(inputs[max(batches)])
    saved = [[_rows(t, written) for t in pair] for pair in runner.kv_slot_pairs]
    try:
        yield DecodeSteps(runner, context, inputs, firsts)
    finally:
        for pair, before in zip(runner.kv_slot_pairs, saved, strict=True):
            for tensor, rows in zip(pair, before, strict=True):
                _flat_rows(tensor).index_copy_(1, written, rows)


def _step_input(batch: int, context: int, block_size: int, tables: list[np.ndarray],
                vocab_size: int, is_first: bool = False) -> StepInput:
    """`batch` requests, each decoding its token at position context - 1 over its blocks
    (request i: row i of every group's table), every row sampled."""
    position = context - 1
    rows = [(t[:batch, position // block_size].astype(np.int64) * block_size
             + position % block_size, np.ascontiguousarray(t[:batch])) for t in tables]
    requests = np.arange(batch, dtype=np.int64)
    empty = np.zeros(0, dtype=np.int64)
    return StepInput(
        token_ids=(requests * 7919 + 1) % vocab_size,  # distinct tokens, any will do
        positions=np.full(batch, position, dtype=np.int64), cache_index=rows[0][0],
        query_start_loc=np.arange(batch + 1, dtype=np.int64),
        context_lens=np.full(batch, context, dtype=np.int32), block_table=rows[0][1],
        num_decodes=batch, logits_rows=requests, sample_slots=requests,
        sample_positions=np.zeros(batch, dtype=np.int64),
        draft_token_ids=np.full(batch, -1, dtype=np.int64),
        num_sample_rows=np.ones(batch, dtype=np.int64), grammar_rows=empty,
        grammar_bitmask=np.zeros((0, 1), dtype=np.int32), prompt_logprobs=[],
        new_sequences=[], released_slots=[],
        group_block_tables=[table for _, table in rows[1:]],
        group_cache_index=[index for index, _ in rows[1:]],
        seq_slots=list(range(batch)),
        state_inits=[(slot, -1) for slot in range(batch)] if is_first else [])


def _written_rows(step: StepInput) -> torch.Tensor:
    """The cache rows (block * block_size + offset) a step writes, in every group."""
    index = np.concatenate([step.cache_index, *step.group_cache_index])
    return torch.from_numpy(np.unique(index))


def _flat_rows(tensor: torch.Tensor) -> torch.Tensor:
    """A cache tensor [Hkv, blocks, block_size, row] as [Hkv, blocks * block_size, row]."""
    heads, blocks, block_size, row = tensor.shape
    return tensor.view(heads, blocks * block_size, row)


def _rows(tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return _flat_rows(tensor).index_select(1, rows)
