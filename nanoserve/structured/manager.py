"""What the engine core holds for structured outputs: one grammar per sequence, and the step's
token bitmask on the constrained rows.

A request with `structured_outputs` gets a `SequenceGrammar` at `add_request`: its compile goes
to the worker thread (cached by content, so the samples of an n > 1 request, each its own engine
request, share one compile), and the scheduler leaves the request waiting until the compile is
done while the others keep stepping. Then the sequence gets its own matcher, kept for the
request's life: a preempted request recomputes its KV cache but keeps its output tokens, so its
matcher is still where it was.

Each step `apply_bitmask` fills one bitmask row per constrained logits row and sets the
forbidden tokens' logits to -inf, before the sampler's pipeline (vLLM's order: the mask comes
before logprobs, bias, penalties and the draw), so a forbidden token can never be drawn. Rows
without a grammar are not touched, so a free request's tokens, and any seeded request's, are the
same as without the constrained ones beside them. Its cost, ~1.7 ms of a 75 ms step for 16
constrained rows of 32: docs/benchmarks.md, "Structured outputs: llguidance against xgrammar".
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from nanoserve.reasoning_section import ReasoningTokens
from nanoserve.sampling_params import StructuredOutputsParams
from nanoserve.structured.bitmask import allocate_bitmask, apply_bitmask, fill_bitmask_rows
from nanoserve.structured.grammar import CompiledGrammar, GrammarCompiler, GrammarMatcher
from nanoserve.structured.reasoning_gate import ReasoningGatedMatcher

Matcher = GrammarMatcher | ReasoningGatedMatcher


class SequenceGrammar:
    """One sequence's grammar: a compile in flight, then the sequence's own matcher (behind a
    reasoning gate when the grammar starts after the reasoning: `reasoning_gate.py`)."""

    def __init__(self, compiled: Future[CompiledGrammar],
                 make_gate: Callable[[GrammarMatcher], ReasoningGatedMatcher] | None = None
                 ) -> None:
        self.compiled = compiled
        self._make_gate = make_gate
        self._matcher: Matcher | None = None

    @property
    def is_ready(self) -> bool:
        """True once the compile succeeded (the request may be scheduled)."""
        return self.compiled.done() and self.failure is None

    @property
    def is_compiling(self) -> bool:
        return not self.compiled.done()

    @property
    def failure(self) -> str | None:
        """Why the compile failed; None while it runs or once it succeeded."""
        if not self.compiled.done():
            return None
        if self.compiled.cancelled():
            return "the grammar compile was cancelled (the engine is shutting down)"
        error = self.compiled.exception()
        return None if error is None else str(error)

    @property
    def matcher(self) -> Matcher:
        """The sequence's matcher, made from the compiled grammar on first use."""
        if self._matcher is None:
            matcher = self.compiled.result().new_matcher()
            self._matcher = matcher if self._make_gate is None else self._make_gate(matcher)
        return self._matcher

    def accept(self, token_id: int) -> bool:
        """Advance by a drawn token; False if the grammar forbids it (its mask did not)."""
        return self.matcher.accept(token_id)

    def is_terminated(self) -> bool:
        """True when the grammar is complete: only EOS may follow."""
        return self.matcher.is_terminated()


class StructuredOutputManager:
    """The engine core's grammar compiler and per-step bitmask (one row per sampling row;
    `max_num_rows`: the most a step samples, drafts included; `reasoning`: the model's
    reasoning tags, for grammars that start after them)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 max_num_rows: int, device: torch.device,
                 reasoning: ReasoningTokens | None = None) -> None:
        self.compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.reasoning = reasoning
        # [max_num_rows, ceil(vocab / 32)] int32, reused every step; pinned for a quick copy
        self.bitmask = allocate_bitmask(max_num_rows, vocab_size,
                                        pin_memory=device.type == "cuda")

    def grammar_for(self, params: StructuredOutputsParams) -> SequenceGrammar:
        """Start compiling `params` (or find it cached). Raises the `GrammarError` at once when
        the cache already knows the grammar is bad; otherwise a failure shows later, as
        `SequenceGrammar.failure`. A model without reasoning tags ignores `after_reasoning`."""
        grammar = SequenceGrammar(self.compiler.submit(params), self._gate(params))
        if grammar.failure is not None:
            grammar.compiled.result()  # raises the GrammarError (a ValueError)
        return grammar

    def _gate(self, params: StructuredOutputsParams
              ) -> Callable[[GrammarMatcher], ReasoningGatedMatcher] | None:
        reasoning, phase = self.reasoning, params.after_reasoning
        if reasoning is None or phase is None:
            return None
        eos = sorted(self.eos_token_ids)
        return lambda matcher: ReasoningGatedMatcher(matcher, phase, reasoning.start,
                                                     reasoning.end, eos)

    @torch.inference_mode()  # the model's logits are inference tensors: edited in that mode
    def apply_bitmask(self, logits: torch.Tensor,
                      grammars: Sequence[SequenceGrammar | None]) -> int:
        """Forbid, in place, what each row's grammar forbids (`grammars[i]` is row i's, None for
        a free row). logits: [num_rows, vocab]. Returns the number of constrained rows."""
        rows = [(grammar.matcher, i) for i, grammar in enumerate(grammars) if grammar is not None]
        if not rows:
            return 0
        fill_bitmask_rows(rows, self.bitmask)
        apply_bitmask(logits, self.bitmask[: logits.shape[0]], [i for _, i in rows])
        return len(rows)

    def fill_bitmask(self, windows: Sequence[tuple[SequenceGrammar | None, Sequence[int]]]
                     ) -> tuple[np.ndarray, np.ndarray]:
        """The constrained rows' masks, for a worker to apply: (rows [G] int64, their bitmask
        [G, ceil(vocab / 32)] int32). `windows[i]` is sampling request i's grammar (None: free)
        and its draft tokens; it owns 1 + len(drafts) consecutive rows. Row j of a window is
        filled from a copy of the matcher that has taken `drafts[:j]` (checked against the
        grammar when proposed: `valid_drafts`); the sequence's own matcher stays where it is."""
        rows: list[int] = []
        first_row = 0
        for grammar, drafts in windows:
            if grammar is not None:
                matcher = grammar.matcher.copy() if drafts else grammar.matcher
                for j in range(len(drafts) + 1):
                    matcher.fill_bitmask(self.bitmask, len(rows))
                    rows.append(first_row + j)
                    if j < len(drafts) and not matcher.accept(drafts[j]):
                        raise AssertionError(f"a checked draft token {drafts[j]} was refused")
            first_row += 1 + len(drafts)
        return np.asarray(rows, dtype=np.int64), self.bitmask[: len(rows)].numpy()

    def valid_drafts(self, grammar: SequenceGrammar, drafts: Sequence[int]) -> list[int]:
        """The drafts before the first one the grammar refuses, and before any end of
        sequence (the request would end there: what follows is never drawn)."""
        probe = grammar.matcher.copy()
        kept: list[int] = []
        for token in drafts:
            if token in self.eos_token_ids or not probe.accept(token):
                break
            kept.append(token)
        return kept

    @staticmethod
    def wait_for_any(grammars: Sequence[SequenceGrammar], timeout: float) -> None:
        """Sleep until one of the compiles is done, or `timeout` seconds (for a step loop that
        has nothing else to run: better than spinning on a core the compile needs)."""
        concurrent.futures.wait([g.compiled for g in grammars], timeout,
                                concurrent.futures.FIRST_COMPLETED)

    def close(self) -> None:
        self.compiler.close()
