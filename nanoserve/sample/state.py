"""Per-slot sampling state: each running request's parameters as rows of preallocated tensors.

A request's parameters are written once, when it is admitted to a slot; each step only gathers
the rows of the batch. Alongside the tensors, a host-side boolean array per stage says which
slots use it, so a step finds the rows of each stage with one numpy lookup and skips a stage
that no row uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

import numpy as np
import torch

from nanoserve.reasoning_section import ReasoningTokens
from nanoserve.sample.sequence import SequenceData
from nanoserve.sample.truncation import NEG_INF, min_p_threshold
from nanoserve.sampling_params import SamplingParams

# stages whose rows are chosen per step
STAGES = ("allowed", "bad_words", "min_tokens", "logit_bias", "penalties", "penalty_window",
          "dry", "thinking", "random", "truncated", "llama_draw", "logprobs_raw",
          "logprobs_processed")


class SamplingState:
    """Slot-indexed sampling parameters, token counts and stage flags."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device,
                 reasoning: ReasoningTokens | None = None) -> None:
        self.num_slots = num_slots
        self.vocab_size = vocab_size
        self.device = device
        self.reasoning = reasoning
        self.temperature = torch.ones(num_slots, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.top_k_cpu = np.zeros(num_slots, dtype=np.int64)  # sizes the partial sort, no sync
        self.top_p = torch.ones(num_slots, dtype=torch.float32, device=device)
        # min-p as its test's threshold, log(min_p), computed once so both draw paths read it
        self.log_min_p = torch.full((num_slots,), NEG_INF, dtype=torch.float32, device=device)
        self.presence = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.frequency = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.repetition = torch.ones(num_slots, dtype=torch.float32, device=device)
        self.seed = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.uses = {stage: np.zeros(num_slots, dtype=bool) for stage in STAGES}
        # slots that use none of the stages: greedy, no logprobs (the sampler's plain path)
        self.plain = np.ones(num_slots, dtype=bool)
        self.seqs: list[SequenceData | None] = [None] * num_slots
        self.bias_ids = torch.zeros(num_slots, 1, dtype=torch.int64, device=device)
        self.bias_values = torch.zeros(num_slots, 1, dtype=torch.float32, device=device)
        # host-side per-slot lists
        self.min_tokens_stop_ids: list[list[int]] = [[] for _ in range(num_slots)]
        self.logprobs = np.zeros(num_slots, dtype=np.int64)  # top-N asked, per slot
        self.thinking = [ThinkingState() for _ in range(num_slots)]

    # -- [slots, vocab] tables, allocated the first time a request needs one ------------------
    @cached_property
    def output_counts(self) -> torch.Tensor:
        """int32: output tokens seen per slot (penalties)."""
        return self._table(torch.int32, 0)

    @cached_property
    def prompt_mask(self) -> torch.Tensor:
        """bool: prompt tokens per slot (repetition penalty)."""
        return self._table(torch.bool, False)

    @cached_property
    def allowed(self) -> torch.Tensor:
        """bool: allowed_token_ids per slot."""
        return self._table(torch.bool, True)

    def _table(self, dtype: torch.dtype, fill: int | bool) -> torch.Tensor:
        return torch.full((self.num_slots, self.vocab_size), fill, dtype=dtype,
                          device=self.device)

    # -- admission and release ----------------------------------------------------------------
    def add_request(self, seq: SequenceData, stop_ids_for_min_tokens: list[int]) -> None:
        """Write the sequence's parameters into its slot (on admission, once; again only after
        a preemption, when the slot was given up)."""
        slot, p, seed = seq.slot, seq.params, seq.seed
        self.seqs[slot] = seq
        self.temperature[slot] = p.temperature if not p.is_greedy else 1.0
        self.top_k[slot] = p.top_k
        self.top_k_cpu[slot] = p.top_k
        self.top_p[slot] = p.top_p
        self.log_min_p[slot] = min_p_threshold(p.min_p)
        self.seed[slot] = seed - (1 << 64) if seed >= (1 << 63) else seed
        uses = self.uses
        uses["random"][slot] = not p.is_greedy
        uses["truncated"][slot] = not p.is_greedy and p.is_truncated
        # llama.cpp's draw samplers (top-n-sigma, typical-p, XTC, mirostat): the PyTorch path
        uses["llama_draw"][slot] = p.uses_llama_draw
        uses["dry"][slot] = p.uses_dry
        uses["bad_words"][slot] = bool(p.bad_words_token_ids)
        uses["min_tokens"][slot] = p.min_tokens > 0 and bool(stop_ids_for_min_tokens)
        self.min_tokens_stop_ids[slot] = stop_ids_for_min_tokens
        self.logprobs[slot] = p.logprobs or 0
        uses["logprobs_raw"][slot] = p.logprobs is not None and p.logprobs_mode == "raw"
        uses["logprobs_processed"][slot] = (p.logprobs is not None
                                            and p.logprobs_mode == "processed")
        self._write_allowed(slot, p)
        self._write_bias(slot, p)
        self._write_penalties(seq)
        self._write_thinking(seq)
        self.plain[slot] = not any(flags[slot] for flags in uses.values())

    def seq(self, slot: int) -> SequenceData:
        """The sequence that occupies `slot`."""
        seq = self.seqs[slot]
        assert seq is not None, f"sampler slot {slot} is empty"
        return seq

    def remove_request(self, slot: int) -> None:
        self.seqs[slot] = None
        for flags in self.uses.values():
            flags[slot] = False
        self.plain[slot] = True

    def _write_allowed(self, slot: int, p: SamplingParams) -> None:
        self.uses["allowed"][slot] = p.allowed_token_ids is not None
        if p.allowed_token_ids is not None:
            row = self.allowed[slot]
            row.fill_(False)
            row[torch.tensor(p.allowed_token_ids, device=self.device)] = True

    def _write_bias(self, slot: int, p: SamplingParams) -> None:
        self.uses["logit_bias"][slot] = bool(p.logit_bias)
        if not p.logit_bias:
            return
        width = len(p.logit_bias)
        if width > self.bias_ids.shape[1]:  # grow the table (padding adds 0.0 to token 0)
            grow = width - self.bias_ids.shape[1]
            self.bias_ids = torch.nn.functional.pad(self.bias_ids, (0, grow))
            self.bias_values = torch.nn.functional.pad(self.bias_values, (0, grow))
        self.bias_ids[slot].zero_()
        self.bias_values[slot].zero_()
        self.bias_ids[slot, :width] = torch.tensor(list(p.logit_bias), device=self.device)
        self.bias_values[slot, :width] = torch.tensor(list(p.logit_bias.values()),
                                                      device=self.device)

    def _write_penalties(self, seq: SequenceData) -> None:
        slot, p = seq.slot, seq.params
        # a window (llama.cpp's repeat_last_n) counts its tokens each step from the history
        # (penalty_window.py); vLLM's penalties keep counts in the [slots, vocab] tables
        self.uses["penalty_window"][slot] = p.has_penalty_window
        self.uses["penalties"][slot] = p.has_penalties and not p.has_penalty_window
        self.presence[slot] = p.presence_penalty
        self.frequency[slot] = p.frequency_penalty
        self.repetition[slot] = p.repetition_penalty
        if not self.uses["penalties"][slot]:
            return
        # counted here once; each step then adds its sampled token (update_after_sample)
        counts = self.output_counts[slot]
        counts.zero_()
        if seq.output_token_ids:
            ids = torch.tensor(seq.output_token_ids, device=self.device)
            counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        mask = self.prompt_mask[slot]
        mask.zero_()
        mask[torch.tensor(seq.prompt_token_ids, device=self.device)] = True

    def _write_thinking(self, seq: SequenceData) -> None:
        budget = seq.params.thinking_token_budget
        uses = budget is not None and self.reasoning is not None
        self.uses["thinking"][seq.slot] = uses
        if uses:
            assert self.reasoning is not None and budget is not None
            self.thinking[seq.slot] = ThinkingState.scan(
                seq.prompt_token_ids, seq.output_token_ids, self.reasoning, budget)

    # -- per step -------------------------------------------------------------------------------
    def update_after_sample(self, slots: np.ndarray, slots_gpu: torch.Tensor,
                            token_ids: torch.Tensor, token_ids_cpu: list[int]) -> None:
        """Count the sampled tokens (penalty rows only) and advance reasoning states."""
        rows = np.nonzero(self.uses["penalties"][slots])[0]
        if len(rows):
            index = torch.from_numpy(rows).to(self.device)
            self.output_counts.index_put_(
                (slots_gpu[index], token_ids[index]),
                torch.ones(len(rows), dtype=torch.int32, device=self.device), accumulate=True)
        if self.reasoning is not None:
            for row in np.nonzero(self.uses["thinking"][slots])[0]:
                self.thinking[slots[row]].advance(token_ids_cpu[row], self.reasoning)


class ThinkingState:
    """Where a request stands in its reasoning section, for the thinking-token budget."""

    __slots__ = ("budget", "count", "phase")

    def __init__(self, phase: str = "before", count: int = 0, budget: int = 0) -> None:
        self.phase = phase  # "before" | "inside" | "done"
        self.count = count  # tokens generated inside the section so far
        self.budget = budget

    @classmethod
    def scan(cls, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int],
             tokens: ReasoningTokens, budget: int) -> ThinkingState:
        """The state after the prompt and the output so far: the prompt leaves the section
        open when a chat template writes `<think>` into it; earlier turns' closed sections do
        not count. Also rebuilds the state after a preemption."""
        state = cls(budget=budget)
        for token in prompt_token_ids:
            if token == tokens.start:
                state.phase = "inside"
            elif token == tokens.end:
                state.phase = "before"
        for token in output_token_ids:
            state.advance(token, tokens)
        return state

    @property
    def must_end(self) -> bool:
        return self.phase == "inside" and self.count >= self.budget

    def advance(self, token: int, tokens: ReasoningTokens) -> None:
        if token == tokens.start and self.phase == "before":
            self.phase, self.count = "inside", 0
        elif token == tokens.end:
            self.phase = "done"
        elif self.phase == "inside":
            self.count += 1
