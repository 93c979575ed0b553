"""Hand-built step inputs for the attention backends' tests: what the engine core would send."""

from __future__ import annotations

import numpy as np

from nanoserve.protocol import StepInput


def make_step_input(starts: list[int], num_tokens: list[int], block_table: np.ndarray,
                    block_size: int) -> StepInput:
    """Request i computes num_tokens[i] tokens from position starts[i], its blocks in row i of
    `block_table` [R, max_blocks]; the single-token requests come first (the decodes)."""
    num_decodes = next((i for i, n in enumerate(num_tokens) if n != 1), len(num_tokens))
    assert all(n > 1 for n in num_tokens[num_decodes:]), "decodes come first"
    table = np.asarray(block_table, dtype=np.int32)
    positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, num_tokens,
                                                                     strict=True)])
    owner = np.repeat(np.arange(len(starts)), num_tokens)
    cache_index = (table[owner, positions // block_size].astype(np.int64) * block_size
                   + positions % block_size)
    query_start_loc = np.zeros(len(starts) + 1, dtype=np.int64)
    np.cumsum(num_tokens, out=query_start_loc[1:])
    empty = np.zeros(0, dtype=np.int64)
    return StepInput(
        token_ids=np.zeros(len(positions), dtype=np.int64), positions=positions.astype(np.int64),
        cache_index=cache_index, query_start_loc=query_start_loc,
        context_lens=(np.asarray(starts) + np.asarray(num_tokens)).astype(np.int32),
        block_table=table, num_decodes=num_decodes, logits_rows=empty, sample_slots=empty,
        sample_positions=empty, draft_token_ids=empty, num_sample_rows=empty,
        grammar_rows=empty, grammar_bitmask=np.zeros((0, 1), dtype=np.int32),
        prompt_logprobs=[], new_sequences=[], released_slots=[])
