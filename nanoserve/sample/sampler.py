"""The sampler: one call per step turns the batch's logits into tokens (and logprobs).

Pipeline, in vLLM's order (bias adds and penalties scale, so the order is part of the
contract): raw logprobs -> float32 -> allowed_token_ids, bad_words -> min_tokens, logit_bias
-> repetition/frequency/presence penalties -> custom processors -> thinking budget ->
temperature (greedy rows take the argmax here) -> min-p -> top-k/top-p -> the draw ->
processed logprobs (rows with llama.cpp's draw samplers: llama_draw.py's chain from
temperature on); then the drafts each window accepts (verify.py). Each stage touches only
the rows that use it; a stage no row uses costs a numpy lookup. No Python loop over the batch
except where a stage needs a request's token history (bad_words, thinking budget), and then
only over the rows that use it. A draft row (a request's window of draft tokens, one row per
position) sees what a one-token decode after its pending drafts would see, in every stage.

On the CPU, the penalties and everything from temperature to the draw run in C++ (fused.py,
csrc/sampling.cpp), one row per task, reading each row in place once or twice, where the
PyTorch path makes ~20 passes over [rows, 49,152] temporaries: a batch of 32 took 16-17 ms to
sample before, 2-4 ms after (docs/benchmarks.md, "Sampler"). The PyTorch stages stay for
GPUs, machines without a compiler, rows that ask for processed logprobs (they need the final
logits) and rows the C++ path leaves undecided, and both draw the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from nanoserve.reasoning_section import ReasoningTokens
from nanoserve.sample.admission import SamplingAdmission
from nanoserve.sample.dry import apply_dry
from nanoserve.sample.fused import UNDECIDED, draw_rows, load_sampling_kernels
from nanoserve.sample.llama_draw import LlamaDrawState
from nanoserve.sample.logits_processor import LogitsProcessor, ProcessorBatch
from nanoserve.sample.logprobs import TokenLogprobs, gather_logprobs
from nanoserve.sample.noise import row_keys
from nanoserve.sample.penalty_window import apply_penalty_window
from nanoserve.sample.sequence import SequenceData
from nanoserve.sample.stages import (
    NEG_INF,
    SamplingBatch,
    apply_allowed,
    apply_bad_words,
    apply_logit_bias,
    apply_min_tokens,
    apply_penalties,
    apply_thinking_budget,
)
from nanoserve.sample.state import SamplingState
from nanoserve.sample.truncation import draw_candidates, draw_full, truncate
from nanoserve.sample.verify import count_accepted
from nanoserve.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprobs | None]  # one per row; None where not asked
    # per request (per row when the batch has no windows): 1 + its drafts accepted
    num_accepted: list[int]
    # the mirostat slots of the step: their mu after its committed tokens
    mirostat_mu: dict[int, float] = field(default_factory=dict)


class Sampler:
    """Per-slot state plus the pipeline; `sample` is the one call per step."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device,
                 eos_token_ids: tuple[int, ...] = (), reasoning: ReasoningTokens | None = None,
                 processor_classes: list[type[LogitsProcessor]] | None = None,
                 use_kernels: bool = True) -> None:
        """`use_kernels`: draw on the CPU with the C++ path (fused.py) where it builds."""
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.state = SamplingState(num_slots, vocab_size, device, reasoning)
        self.llama = LlamaDrawState(num_slots, device)  # llama.cpp's draw samplers, mu
        self.processors = [cls(num_slots, vocab_size, device) for cls in processor_classes or ()]
        self.processor_uses = [np.zeros(num_slots, dtype=bool) for _ in self.processors]
        self.kernels = load_sampling_kernels(device) if use_kernels else None

    def validate(self, params: SamplingParams) -> None:
        """Admission checks that need the sampler's view: processors' arguments, reasoning
        (the engine core's own `SamplingAdmission`, with this sampler's settings)."""
        SamplingAdmission(self.eos_token_ids, self.state.reasoning is not None,
                          tuple(map(type, self.processors))).check(params)

    def add_request(self, seq: SequenceData) -> None:
        """Write a sequence's parameters into its slot (on admission to the running batch)."""
        params = seq.params
        stop_ids = list(dict.fromkeys(
            [*([] if params.ignore_eos else self.eos_token_ids), *params.stop_token_ids]))
        self.state.add_request(seq, stop_ids)
        self.llama.add_request(seq)
        for processor, uses in zip(self.processors, self.processor_uses, strict=True):
            uses[seq.slot] = processor.add_request(seq)

    def remove_request(self, slot: int) -> None:
        self.state.remove_request(slot)
        self.llama.remove_request(slot)
        for processor, uses in zip(self.processors, self.processor_uses, strict=True):
            if uses[slot]:
                processor.remove_request(slot)
                uses[slot] = False

    def refuses_drafts(self, slot: int) -> bool:
        """True when the slot's sequence uses a custom processor that does not declare
        `supports_speculation`: its rows past draft tokens could not be drawn as a one-token
        decode would draw them, so the sequence takes no drafts. Every built-in stage reads a
        draft row's pending tokens (stages.py)."""
        return any(bool(flags[slot]) and not processor.supports_speculation
                   for processor, flags in zip(self.processors, self.processor_uses,
                                               strict=True))

    def make_batch(self, slots: np.ndarray, positions: np.ndarray | None = None,
                   draft_token_ids: np.ndarray | None = None,
                   num_sample_rows: np.ndarray | None = None) -> SamplingBatch:
        """The step's rows from each row's slot ([R] int64), the output index each draws ([R]
        int64; by default each slot's next output: a row per slot) and, for a step with draft
        tokens, the draft each row is checked against ([R], -1 on a window's last row) and the
        rows of each request's window ([requests])."""
        if positions is None:
            seq = self.state.seq
            positions = np.fromiter((len(seq(s).output_token_ids) for s in slots),
                                    dtype=np.int64, count=len(slots))
        offsets = None
        if num_sample_rows is not None and len(num_sample_rows) != len(slots):
            firsts = np.cumsum(num_sample_rows) - num_sample_rows
            offsets = np.arange(len(slots)) - np.repeat(firsts, num_sample_rows)
        return SamplingBatch(slots, torch.from_numpy(slots).to(self.device),
                             torch.from_numpy(positions).to(self.device), positions,
                             draft_token_ids if offsets is not None else None, offsets,
                             num_sample_rows if offsets is not None else None)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """logits [R, vocab] for the batch's rows -> one token per row."""
        state = self.state
        if self._is_plain(batch):
            return self._sample_plain(logits, batch)
        # 1) raw logprobs, before anything touches the logits
        raw_rows = batch.rows(state.uses["logprobs_raw"])
        raw = (logits.index_select(0, batch.rows_gpu(raw_rows)).float().log_softmax(-1)
               if len(raw_rows) else None)
        # 2) float32, and the stages before temperature
        logits = logits.float()
        apply_allowed(logits, state, batch)
        apply_bad_words(logits, state, batch)
        apply_min_tokens(logits, state, batch)
        apply_logit_bias(logits, state, batch)
        apply_penalties(logits, state, batch, self.kernels)
        apply_penalty_window(logits, state, batch)
        apply_dry(logits, state, batch)
        self._apply_processors(logits, batch)
        apply_thinking_budget(logits, state, batch)
        # 3) greedy rows take the argmax of the processed logits; random rows are drawn
        processed_rows = batch.rows(state.uses["logprobs_processed"])
        token_ids, final = self._choose_tokens(logits, batch, processed_rows)
        token_ids_cpu = token_ids.tolist()  # the step's one device -> host copy
        # 4) accept each window's drafts that equal the draws; count only committed tokens
        if batch.has_drafts:
            assert batch.draft_token_ids is not None and batch.num_sample_rows is not None
            assert batch.offsets is not None
            num_accepted = count_accepted(token_ids_cpu, batch.draft_token_ids,
                                          batch.num_sample_rows)
            committed = np.flatnonzero(
                batch.offsets < np.repeat(num_accepted, batch.num_sample_rows))
            at = batch.rows_gpu(committed)
            state.update_after_sample(batch.slots[committed], batch.slots_gpu[at],
                                      token_ids[at], [token_ids_cpu[r] for r in committed])
        else:
            num_accepted = [1] * (batch.num_rows if batch.num_sample_rows is None
                                  else len(batch.num_sample_rows))
            state.update_after_sample(batch.slots, batch.slots_gpu, token_ids, token_ids_cpu)
        return SamplerOutput(token_ids_cpu,
                             self._logprobs(batch, token_ids, raw_rows, raw, processed_rows,
                                            final), num_accepted,
                             self.llama.commit(batch, num_accepted))

    def _is_plain(self, batch: SamplingBatch) -> bool:
        """Every row greedy, without logprobs, stages, processors or drafts."""
        return (not batch.has_drafts and bool(self.state.plain[batch.slots].all())
                and not any(uses[batch.slots].any() for uses in self.processor_uses))

    def _sample_plain(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """The argmax of each row: what the pipeline gives such rows, as every stage leaves
        them alone and no state follows their tokens. Why a path of its own: right after a
        forward the pipeline's Python runs out of cold caches, ~10-50 us a numpy or torch call
        (docs/benchmarks.md, "The Python after the forward, ...": 0.33 -> 0.21 ms a step)."""
        token_ids: list[int] | None = None
        if self.kernels is not None and logits.device.type == "cpu" and logits.stride(1) == 1:
            # the C++ argmax: 8 us a row warm, where torch.argmax takes ~90 (not vectorized)
            drawn = draw_rows(self.kernels, logits, batch, self.state,
                              np.arange(batch.num_rows))
            if not (drawn == UNDECIDED).any():  # a NaN row: torch.argmax's answer
                token_ids = drawn.tolist()
        if token_ids is None:
            token_ids = logits.argmax(dim=-1).tolist()
        num_requests = (batch.num_rows if batch.num_sample_rows is None
                        else len(batch.num_sample_rows))
        return SamplerOutput(token_ids, [None] * batch.num_rows, [1] * num_requests)

    def _choose_tokens(self, logits: torch.Tensor, batch: SamplingBatch,
                       processed_rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's token [R], and the final logits of `processed_rows` (the rows that asked
        for processed logprobs). The C++ path (fused.py) takes every row it can, all but the
        random rows that need their final logits; the PyTorch path takes those and the rows the
        C++ path leaves undecided."""
        state = self.state
        num_rows = batch.num_rows
        is_random = state.uses["random"][batch.slots]  # [R] bool, host
        token_ids = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
        is_left = np.ones(num_rows, dtype=bool)  # rows for the PyTorch path (boolean masks:
        # np.setdiff1d and union1d cost ~0.1 ms each on 32 rows)
        if self.kernels is not None and logits.device.type == "cpu" and logits.stride(1) == 1:
            # the C++ path draws vLLM's samplers only: llama.cpp's draw samplers stay here
            is_left = is_random & (state.uses["logprobs_processed"][batch.slots]
                                   | state.uses["llama_draw"][batch.slots])
            rows = np.flatnonzero(~is_left)
            drawn = draw_rows(self.kernels, logits, batch, state, rows)
            token_ids.index_copy_(0, torch.from_numpy(rows), torch.from_numpy(drawn))
            is_left[rows[drawn == UNDECIDED]] = True
        greedy_rows = np.flatnonzero(is_left & ~is_random)
        random_rows = np.flatnonzero(is_left & is_random)
        if len(greedy_rows) == num_rows:  # all greedy: no row copies
            token_ids = logits.argmax(dim=-1)
        elif len(greedy_rows):
            at = batch.rows_gpu(greedy_rows)
            token_ids[at] = logits.index_select(0, at).argmax(dim=-1)
        final = logits.index_select(0, batch.rows_gpu(processed_rows)) \
            if len(processed_rows) else None
        if len(random_rows):
            drawn_random, final_random = self._draw(logits, batch, random_rows,
                                                    need_final=final is not None)
            token_ids.index_copy_(0, batch.rows_gpu(random_rows), drawn_random)
            if final is not None and final_random is not None:
                # processed rows that were drawn take their post-temperature/truncation logits
                position = np.full(num_rows, -1)
                position[random_rows] = np.arange(len(random_rows))
                taken = position[processed_rows]
                drawn_here = np.nonzero(taken >= 0)[0]
                final[torch.from_numpy(drawn_here)] = final_random[
                    torch.from_numpy(taken[drawn_here])]
        return token_ids, final

    def _apply_processors(self, logits: torch.Tensor, batch: SamplingBatch) -> None:
        for processor, uses in zip(self.processors, self.processor_uses, strict=True):
            rows = batch.rows(uses)
            if len(rows):
                slots = batch.slots[rows]
                seqs = [self.state.seq(s) for s in slots]
                num_pending = (batch.offsets[rows] if batch.offsets is not None
                               else np.zeros(len(rows), dtype=np.int64))
                if num_pending.any():  # draft rows see their pending tokens as output
                    seqs = [replace(seq, output_token_ids=batch.output_before(
                        int(row), seq.output_token_ids)) if pending else seq
                        for row, seq, pending in zip(rows, seqs, num_pending, strict=True)]
                processor.apply(logits, ProcessorBatch(rows, batch.rows_gpu(rows), slots,
                                                       seqs, num_pending))

    def _draw(self, logits: torch.Tensor, batch: SamplingBatch, rows: np.ndarray,
              need_final: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Temperature, truncation and the draw for the random rows -> their tokens [r], and
        (if asked) their final logits [r, V]. Rows with llama.cpp's draw samplers take
        llama_draw.py's chain; the others vLLM's (truncation.py)."""
        state = self.state
        device = logits.device
        drawn = torch.empty(len(rows), dtype=torch.int64, device=device)
        final = torch.empty(len(rows), logits.shape[1], device=device) if need_final else None
        slots_cpu = batch.slots[rows]
        is_llama = state.uses["llama_draw"][slots_cpu]
        truncated = state.uses["truncated"][slots_cpu] & ~is_llama
        for group, kind in ((np.flatnonzero(~truncated & ~is_llama), "full"),
                            (np.flatnonzero(truncated), "truncated"),
                            (np.flatnonzero(is_llama), "llama")):
            if not len(group):
                continue
            at = torch.from_numpy(group).to(device)  # positions among the random rows
            index = batch.rows_gpu(rows[group])  # rows of the batch
            slots = batch.slots_gpu[index]
            scaled = logits.index_select(0, index).div_(
                state.temperature.index_select(0, slots)[:, None])
            keys = row_keys(state.seed.index_select(0, slots),
                            batch.positions.index_select(0, index))
            if kind == "full":
                drawn[at] = draw_full(scaled, keys)
                if final is not None:
                    final[at] = scaled
                continue
            if kind == "llama":
                drawn[at], final_llama = self.llama.draw(scaled, rows[group], batch, state, keys,
                                                         need_final=final is not None)
                if final is not None and final_llama is not None:
                    final[at] = final_llama
                continue
            ids, vals = truncate(scaled, state.top_k.index_select(0, slots),
                                 state.top_p.index_select(0, slots),
                                 state.log_min_p.index_select(0, slots),
                                 max_top_k=int(state.top_k_cpu[slots_cpu[group]].max()))
            drawn[at] = draw_candidates(ids, vals, keys)
            if final is not None:
                # amax: a row's candidates may end in padding (id 0 at -inf, truncate's
                # widening for other rows), which must not overwrite token 0's value
                final[at] = torch.full_like(scaled, NEG_INF).scatter_reduce_(1, ids, vals,
                                                                             "amax")
        return drawn, final

    def _logprobs(self, batch: SamplingBatch, token_ids: torch.Tensor, raw_rows: np.ndarray,
                  raw: torch.Tensor | None, processed_rows: np.ndarray,
                  final: torch.Tensor | None) -> list[TokenLogprobs | None]:
        out: list[TokenLogprobs | None] = [None] * batch.num_rows
        for rows, values in ((raw_rows, raw), (processed_rows, final)):
            if values is None or not len(rows):
                continue
            lp = values.log_softmax(-1) if values is final else values
            chosen = token_ids.index_select(0, batch.rows_gpu(rows))
            num_top = [int(n) for n in self.state.logprobs[batch.slots[rows]]]
            for row, entry in zip(rows, gather_logprobs(lp, chosen, num_top), strict=True):
                out[row] = entry
        return out
