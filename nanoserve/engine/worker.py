"""What one rank does in a step: the forward, pooling, the grammar mask, the sampler.

A worker sees only the step input (protocol.py's `StepInput`): flat token ids, positions,
cache rows, block tables, the rows to sample and the slots added and released. It never sees
a `Request` or the scheduler, so the same worker can run in another process. It keeps the
sampler's per-slot state and its own copy of each running sequence's token ids (the stages
that read a sequence's history, and custom logits processors, read them), appending the tokens
each step commits.
"""

from __future__ import annotations

import time

import torch

from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine.pooler import Pooler
from nanoserve.engine.zero_cost_runner import ZeroCostRunner
from nanoserve.profiling import scope
from nanoserve.protocol import StepInput, StepOutput, TokenLogprobs
from nanoserve.sample.logprobs import prompt_logprobs
from nanoserve.sample.sampler import Sampler
from nanoserve.sample.sequence import SequenceData
from nanoserve.structured.bitmask import apply_bitmask


class Worker:
    """A model runner (model + KV cache) and a sampler, driven one `StepInput` at a time."""

    def __init__(self, runner: ModelRunner | ZeroCostRunner, sampler: Sampler) -> None:
        self.runner = runner
        self.sampler = sampler
        self.output_token_ids: dict[int, list[int]] = {}  # by slot, the worker's own copy
        self.pooler = Pooler()  # prefill-only requests' vectors (and means' running sums)

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        # 1) slots: the released ones are cleared before the new ones are written
        for slot in step.released_slots:
            self.sampler.remove_request(slot)
            self.output_token_ids.pop(slot, None)
            self.pooler.release(slot)
        for new in step.new_sequences:
            output_ids = list(new.output_token_ids)
            self.output_token_ids[new.slot] = output_ids
            self.sampler.add_request(SequenceData(new.slot, new.params, new.prompt_token_ids,
                                                  output_ids, new.seed))
        # 2) the forward, and the logits of the rows that sample
        with scope("nanoserve.model"):
            logits, prompt_logits, hidden = self.runner.execute_step(step)  # [S, vocab]
            pooled = self.pooler.pool(hidden, step.pooling, self.runner.compute_logits)
        prompts: list[list[TokenLogprobs]] = [
            prompt_logprobs(rows, entry.target_token_ids, entry.num_logprobs)
            for rows, entry in zip(prompt_logits, step.prompt_logprobs, strict=True)]
        # 3) the grammar mask (filled by the core), then the sampler
        start = time.perf_counter()
        if len(step.grammar_rows):
            with scope("nanoserve.grammar"):
                apply_bitmask(logits, torch.from_numpy(step.grammar_bitmask),
                              torch.from_numpy(step.grammar_rows), packed=True)
        with scope("nanoserve.sample"):
            batch = self.sampler.make_batch(step.sample_slots, step.sample_positions,
                                            step.draft_token_ids, step.num_sample_rows)
            sampled = self.sampler.sample(logits, batch)
        self._append_committed(step, sampled.token_ids, sampled.num_accepted)
        return StepOutput(sampled.token_ids, sampled.num_accepted, sampled.logprobs, prompts,
                          time.perf_counter() - start, pooled)

    def _append_committed(self, step: StepInput, token_ids: list[int],
                          num_accepted: list[int]) -> None:
        """Each sampling request's committed tokens, onto the worker's copy of its output."""
        slots = step.sample_slots
        row = 0
        for num_rows, taken in zip(step.num_sample_rows.tolist(), num_accepted, strict=True):
            self.output_token_ids[int(slots[row])].extend(token_ids[row : row + taken])
            row += num_rows
