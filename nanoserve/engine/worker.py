"""What one rank does in a step: the forward, pooling, the grammar mask, the sampler.

One class on every rank: rank 0's worker samples; a tensor-parallel rank above 0 has no sampler
(`sampler=None`) and `follow`s each step: the forward and every logits computation rank 0 makes
in it, so the ranks meet in the same collectives in the same order. A worker sees only the step
input (protocol.py's `StepInput`): flat token ids, positions, cache rows, block tables, the
rows to sample and the slots added and released. It never sees a `Request` or the scheduler, so
the same worker can run in another process. It keeps the sampler's per-slot state and its own
copy of each running sequence's token ids (the stages that read a sequence's history, and
custom logits processors, read them), appending the tokens each step commits.
"""

from __future__ import annotations

import time

import torch

from nanoserve.engine.model_runner import ModelRunner
from nanoserve.engine.mtp_drafter import MtpDrafter
from nanoserve.engine.pooler import Pooler
from nanoserve.engine.zero_cost_runner import ZeroCostRunner
from nanoserve.profiling import scope
from nanoserve.protocol import StepInput, StepOutput, TokenLogprobs
from nanoserve.sample.logprobs import prompt_logprobs
from nanoserve.sample.sampler import Sampler
from nanoserve.sample.sequence import SequenceData
from nanoserve.structured.bitmask import apply_bitmask


class Worker:
    """A model runner (model + KV cache) and, on rank 0, a sampler, driven one `StepInput` at
    a time."""

    def __init__(self, runner: ModelRunner | ZeroCostRunner, sampler: Sampler | None,
                 drafter: MtpDrafter | None = None) -> None:
        """`drafter`: the model's MTP head, run after each draw (`--speculative-config
        '{"method": "mtp"}'`), its drafts sent back with the step's output."""
        self.runner = runner
        self.sampler = sampler
        self.drafter = drafter
        self.output_token_ids: dict[int, list[int]] = {}  # by slot, the worker's own copy
        self.pooler = Pooler()  # prefill-only requests' vectors (and means' running sums)

    @torch.inference_mode()
    def follow(self, step: StepInput) -> None:
        """A rank above 0: the forward and every logits computation rank 0 makes for this step
        (each gathers over the group): the sampled and prompt-logprob rows inside the forward,
        then "score" pooling rows, in the order rank 0's Pooler asks for them."""
        _, _, hidden = self.runner.execute_step(step)
        score_rows = [e.first_row + e.num_rows - 1 for e in step.pooling
                      if e.is_last and e.params.task == "score"]
        if score_rows:
            self.runner.compute_logits(hidden.index_select(0, torch.tensor(score_rows)))

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        """Rank 0's step: the forward, pooling, the grammar mask, the draw and (with a
        drafter) the next drafts."""
        sampler = self.sampler
        assert sampler is not None, "a rank without a sampler follows the steps (follow)"
        # 1) slots: the released ones are cleared before the new ones are written
        for slot in step.released_slots:
            sampler.remove_request(slot)
            self.output_token_ids.pop(slot, None)
            self.pooler.release(slot)
        for new in step.new_sequences:
            output_ids = list(new.output_token_ids)
            self.output_token_ids[new.slot] = output_ids
            sampler.add_request(SequenceData(new.slot, new.params, new.prompt_token_ids,
                                             output_ids, new.seed,
                                             mirostat_mu=new.mirostat_mu))
        # the core decides drafts; which new slots a custom processor keeps from them is the
        # sampler's to know (a processor's add_request), so it goes back with the output
        refusing = [new.slot for new in step.new_sequences
                    if sampler.refuses_drafts(new.slot)]
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
            batch = sampler.make_batch(step.sample_slots, step.sample_positions,
                                            step.draft_token_ids, step.num_sample_rows)
            sampled = sampler.sample(logits, batch)
        self._append_committed(step, sampled.token_ids, sampled.num_accepted)
        sample_seconds = time.perf_counter() - start
        # 4) the next drafts, from the model's MTP head (it reads this step's states and draws)
        drafts: list[list[int]] = []
        if self.drafter is not None:
            with scope("nanoserve.mtp"):
                drafts = self.drafter.propose(step, hidden, sampled.token_ids,
                                              sampled.num_accepted)
        return StepOutput(sampled.token_ids, sampled.num_accepted, sampled.logprobs, prompts,
                          sample_seconds, pooled, refusing, drafts, sampled.mirostat_mu)

    def _append_committed(self, step: StepInput, token_ids: list[int],
                          num_accepted: list[int]) -> None:
        """Each sampling request's committed tokens, onto the worker's copy of its output."""
        slots = step.sample_slots
        row = 0
        for num_rows, taken in zip(step.num_sample_rows.tolist(), num_accepted, strict=True):
            self.output_token_ids[int(slots[row])].extend(token_ids[row : row + taken])
            row += num_rows
