"""The sampler's logits stages before temperature, each applied only to the rows that use it.

Every stage takes the step's logits [R, vocab] (float32, owned by the sampler) and edits the
rows of its requests in place. Which rows: one numpy lookup of the stage's per-slot flags.
Penalties take the C++ kernel when the sampler has it (one pass per row, the same bits as the
PyTorch code here): on 3 rows of 49,152 they cost ~0.05 ms there against ~0.9 ms here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from nanoserve.sample.sequence import SequenceData
from nanoserve.sample.state import SamplingState, ThinkingState

NEG_INF = float("-inf")


@dataclass
class SamplingBatch:
    """The rows of one step: which slot each row belongs to and which token it draws.

    A request with draft tokens owns several consecutive rows, one per position of its window:
    row j of the window draws output token `num_output + j` as if `drafts[:j]` were already
    committed (its pending tokens). `draft_token_ids[r]` is the draft that row r's draw is
    checked against (-1 on a window's last row) and `offsets[r]` is j; a plain decode row has
    offset 0 and no pending tokens."""

    slots: np.ndarray  # [R] int64, host
    slots_gpu: torch.Tensor  # [R] int64, on the logits' device
    positions: torch.Tensor  # [R] int64, output index of the token each row draws
    positions_cpu: np.ndarray | None = None  # [R] int64, the same on the host
    draft_token_ids: np.ndarray | None = None  # [R] int64; None: no drafts this step
    offsets: np.ndarray | None = None  # [R] int64, each row's index in its window
    num_sample_rows: np.ndarray | None = None  # [requests] int64, rows per request

    @property
    def num_rows(self) -> int:
        return len(self.slots)

    @property
    def has_drafts(self) -> bool:
        return self.offsets is not None and bool(self.offsets.any())

    def rows(self, flags: np.ndarray) -> np.ndarray:
        """Row indices (host) whose slot has `flags` set."""
        return np.nonzero(flags[self.slots])[0]

    def rows_gpu(self, rows: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(rows).to(self.slots_gpu.device)

    def offset(self, row: int) -> int:
        return 0 if self.offsets is None else int(self.offsets[row])

    def pending(self, row: int) -> list[int]:
        """The draft tokens a row draws after: `drafts[:j]` of its window."""
        j = self.offset(row)
        if not j:
            return []
        assert self.draft_token_ids is not None
        return self.draft_token_ids[row - j : row].tolist()

    def output_before(self, row: int, output: Sequence[int]) -> Sequence[int]:
        """The output a row's draw follows: the committed `output` and its pending tokens."""
        pending = self.pending(row)
        return [*output, *pending] if pending else output


def ban(logits: torch.Tensor, rows: list[int], token_ids: list[int]) -> None:
    """Set logits[rows[i], token_ids[i]] to -inf for every i, in one indexed write."""
    if rows:
        device = logits.device
        logits.index_put_((torch.tensor(rows, device=device),
                           torch.tensor(token_ids, device=device)),
                          torch.tensor(NEG_INF, device=device))


def apply_allowed(logits: torch.Tensor, state: SamplingState, batch: SamplingBatch) -> None:
    """allowed_token_ids: everything else is -inf."""
    rows = batch.rows(state.uses["allowed"])
    if len(rows):
        index = batch.rows_gpu(rows)
        sub = logits.index_select(0, index)
        sub.masked_fill_(~state.allowed.index_select(0, batch.slots_gpu[index]), NEG_INF)
        logits.index_copy_(0, index, sub)


def apply_bad_words(logits: torch.Tensor, state: SamplingState, batch: SamplingBatch) -> None:
    """vLLM's bad_words: a word's last token is banned when its other tokens were just
    generated (a one-token word is always banned); a draft row's pending tokens count as
    generated."""
    ban_rows: list[int] = []
    ban_ids: list[int] = []
    for row in batch.rows(state.uses["bad_words"]):
        seq = state.seq(batch.slots[row])
        output = batch.output_before(row, seq.output_token_ids)
        for word in seq.params.bad_words_token_ids:
            prefix = word[:-1]
            if len(prefix) <= len(output) and output[len(output) - len(prefix):] == prefix:
                ban_rows.append(int(row))
                ban_ids.append(word[-1])
    ban(logits, ban_rows, ban_ids)


def apply_min_tokens(logits: torch.Tensor, state: SamplingState, batch: SamplingBatch) -> None:
    """Before min_tokens outputs, no EOS and no stop token id can be drawn (a row's position
    is its output index, pending draft tokens included)."""
    ban_rows: list[int] = []
    ban_ids: list[int] = []
    for row in batch.rows(state.uses["min_tokens"]):
        seq = state.seq(batch.slots[row])
        if _num_output_before(batch, row, seq) < seq.params.min_tokens:
            stop_ids = state.min_tokens_stop_ids[batch.slots[row]]
            ban_rows += [int(row)] * len(stop_ids)
            ban_ids += stop_ids
    ban(logits, ban_rows, ban_ids)


def _num_output_before(batch: SamplingBatch, row: int, seq: SequenceData) -> int:
    if batch.positions_cpu is not None:
        return int(batch.positions_cpu[row])
    return len(seq.output_token_ids) + batch.offset(row)


def apply_logit_bias(logits: torch.Tensor, state: SamplingState, batch: SamplingBatch) -> None:
    """Add each row's bias entries (OpenAI's logit_bias, clamped to [-100, 100])."""
    rows = batch.rows(state.uses["logit_bias"])
    if len(rows):
        index = batch.rows_gpu(rows)
        slots = batch.slots_gpu[index]
        # in place: the rows' [r, vocab] copy out and back cost 10x the few additions (padding
        # entries add 0.0 to token 0, which changes nothing whatever the order)
        logits.index_put_((index[:, None], state.bias_ids.index_select(0, slots)),
                          state.bias_values.index_select(0, slots), accumulate=True)


def apply_penalties(logits: torch.Tensor, state: SamplingState, batch: SamplingBatch,
                    kernels: ModuleType | None = None) -> None:
    """vLLM/OpenAI penalties: repetition over prompt and output tokens (divide positive
    logits, multiply negative ones); frequency (per occurrence) and presence (once) over output
    tokens, subtracted. With `kernels` (the C++ sampling extension) and logits on the CPU, one
    pass per row in place, the same float operations (~30x faster than the ~15 passes over
    [r, V] copies below on 3 rows of 49,152).

    Draft rows count their pending tokens as output: the rows are penalized one window offset
    at a time, the slots' counts raised by each offset's pending token before its rows and
    lowered again at the end, so every row reads exactly the counts a one-token decode after
    those tokens would (the same kernel, the same float operations)."""
    rows = batch.rows(state.uses["penalties"])
    if not len(rows):
        return
    # skip the kinds of penalty no row of the step asks for
    params = [state.seq(slot).params for slot in batch.slots[rows]]
    kinds = (any(p.repetition_penalty != 1.0 for p in params),
             any(p.frequency_penalty != 0.0 for p in params),
             any(p.presence_penalty != 0.0 for p in params))
    if not batch.has_drafts:
        _penalize(logits, state, batch, rows, kinds, kernels)
        return
    assert batch.offsets is not None and batch.draft_token_ids is not None
    offsets = batch.offsets[rows]
    raised: list[np.ndarray] = []  # rows whose pending token was counted, per offset
    for j in range(int(offsets.max()) + 1):
        at = rows[offsets == j]
        if j:  # these rows follow one more pending token: the draft on the row before
            _count(state, batch, at - 1, 1)
            raised.append(at - 1)
        _penalize(logits, state, batch, at, kinds, kernels)
    for before in raised:
        _count(state, batch, before, -1)


def _count(state: SamplingState, batch: SamplingBatch, rows: np.ndarray, delta: int) -> None:
    """Add `delta` to each row's slot's count of the draft token on that row."""
    index = batch.rows_gpu(rows)
    tokens = torch.from_numpy(batch.draft_token_ids[rows]).to(state.device)  # type: ignore[index]
    state.output_counts.index_put_(
        (batch.slots_gpu[index], tokens),
        torch.full((len(rows),), delta, dtype=torch.int32, device=state.device), accumulate=True)


def _penalize(logits: torch.Tensor, state: SamplingState, batch: SamplingBatch,
              rows: np.ndarray, kinds: tuple[bool, bool, bool],
              kernels: ModuleType | None) -> None:
    use_repetition, use_frequency, use_presence = kinds
    if kernels is not None and logits.device.type == "cpu" and logits.stride(1) == 1:
        kernels.apply_penalties(logits, torch.from_numpy(rows), batch.slots_gpu,
                                state.output_counts, state.prompt_mask, state.repetition,
                                state.frequency, state.presence, use_repetition, use_frequency,
                                use_presence)
        return
    index = batch.rows_gpu(rows)
    slots = batch.slots_gpu[index]
    sub = logits.index_select(0, index)  # [r, V]
    counts = state.output_counts.index_select(0, slots)  # [r, V] int32
    in_output = counts > 0
    if use_repetition:
        seen = in_output | state.prompt_mask.index_select(0, slots)
        repetition = state.repetition.index_select(0, slots)[:, None]
        sub = torch.where(seen, torch.where(sub > 0, sub / repetition, sub * repetition), sub)
    if use_frequency:
        sub -= state.frequency.index_select(0, slots)[:, None] * counts
    if use_presence:
        sub -= state.presence.index_select(0, slots)[:, None] * in_output
    logits.index_copy_(0, index, sub)


def apply_thinking_budget(logits: torch.Tensor, state: SamplingState,
                          batch: SamplingBatch) -> None:
    """Past the budget inside the reasoning section, only the end-of-reasoning token is left
    (a draft row's state: its slot's, advanced over the row's pending tokens)."""
    reasoning = state.reasoning
    if reasoning is None:
        return
    rows = []
    for row in batch.rows(state.uses["thinking"]):
        thinking = state.thinking[batch.slots[row]]
        pending = batch.pending(row)
        if pending:
            thinking = ThinkingState(thinking.phase, thinking.count, thinking.budget)
            for token in pending:
                thinking.advance(token, reasoning)
        if thinking.must_end:
            rows.append(int(row))
    if rows:
        index = torch.tensor(rows, device=logits.device)
        logits.index_fill_(0, index, NEG_INF)
        logits[index, reasoning.end] = 0.0
