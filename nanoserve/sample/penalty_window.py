"""llama.cpp's penalties over a window of the last `repeat_last_n` tokens of prompt and output.

A request with `repeat_last_n` set (N > 0, or -1 for the whole context) takes llama.cpp's
`penalties` sampler instead of vLLM's: repetition, frequency and presence all count the tokens
of one window, the last N of its history. The history is the prompt and the output, as in
llama-server, which feeds every prompt token to its sampler chain (`common_sampler_accept` after
the prompt is processed) before the first draw; a draft row's history ends with its pending
drafts. The window moves each step, so it is counted from the history each step (no per-slot
counts to keep): one `np.unique` per row, then one gather and one scatter for all the rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from nanoserve.sample.stages import SamplingBatch
from nanoserve.sample.state import SamplingState


def apply_penalty_window(logits: torch.Tensor, state: SamplingState,
                         batch: SamplingBatch) -> None:
    """Repetition, frequency and presence penalties over each row's window, in place.

    For each token t with count c > 0 in the window, llama.cpp's float32 operations, in order
    (each rounded to float32, no fused multiply-add):
        x = logits[row, t]
        x = x * repetition if x <= 0 else x / repetition
        x = x - (float(c) * frequency + presence)
    Tokens outside the window are left alone. The three values are the slot's, as written in
    the state's tensors."""
    rows = batch.rows(state.uses["penalty_window"])
    if not len(rows):
        return
    entry_rows, entry_ids, entry_counts = [], [], []
    for row in rows:
        seq = state.seq(batch.slots[row])
        window = history_tail(seq.prompt_token_ids,
                              batch.output_before(int(row), seq.output_token_ids),
                              seq.params.repeat_last_n or 0)
        ids, num_seen = np.unique(window, return_counts=True)
        entry_rows.append(np.full(len(ids), row, dtype=np.int64))
        entry_ids.append(ids)
        entry_counts.append(num_seen)
    device = logits.device
    index_rows = torch.from_numpy(np.concatenate(entry_rows)).to(device)  # [E]
    index_ids = torch.from_numpy(np.concatenate(entry_ids)).to(device)  # [E]
    counts = torch.from_numpy(np.concatenate(entry_counts).astype(np.float32)).to(device)
    slots = batch.slots_gpu[index_rows]
    repetition = state.repetition.index_select(0, slots)
    values = logits[index_rows, index_ids]
    values = torch.where(values <= 0, values * repetition, values / repetition)
    values -= counts * state.frequency.index_select(0, slots) \
        + state.presence.index_select(0, slots)
    logits[index_rows, index_ids] = values


def history_tail(prompt: Sequence[int], output: Sequence[int], num_tokens: int) -> np.ndarray:
    """The last `num_tokens` tokens of prompt + output (-1: all of them) as int64 [n], without
    copying more of either list than the window holds."""
    num_prompt = len(prompt)
    if num_tokens < 0 or num_tokens >= num_prompt + len(output):
        start = 0
    else:
        start = num_prompt + len(output) - num_tokens
    tail = np.empty(num_prompt + len(output) - start, dtype=np.int64)
    from_prompt = max(num_prompt - start, 0)
    tail[:from_prompt] = prompt[start:] if from_prompt else []
    tail[from_prompt:] = output[max(start - num_prompt, 0):]
    return tail
