"""OutputProcessor: the one loop per step over the engine's outputs, in the frontend.

For each EngineCoreOutput it detokenizes the new tokens and updates the request's
RequestOutput; finished requests are handed back to the caller.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from nanoserve.engine.core import EngineCoreOutput
from nanoserve.output.detokenizer import IncrementalDetokenizer
from nanoserve.outputs import CompletionOutput, RequestMetrics, RequestOutput


@dataclass
class RequestState:
    """The frontend's view of one request: its text so far and its timings."""

    output: RequestOutput
    detokenizer: IncrementalDetokenizer


class OutputProcessor:
    """Holds a RequestState per live request; `process` is the single loop over a step."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None,
                    prompt_token_ids: list[int]) -> None:
        completion = CompletionOutput(index=0, text="", token_ids=[])
        output = RequestOutput(request_id, prompt, prompt_token_ids, [completion],
                               metrics=RequestMetrics(arrival_time=time.monotonic()))
        self.states[request_id] = RequestState(
            output, IncrementalDetokenizer(self.tokenizer, prompt_token_ids))

    def process(self, engine_outputs: list[EngineCoreOutput]) -> list[tuple[RequestOutput, str]]:
        """One pass over this step's outputs: (updated RequestOutput, new text) for each.

        Finished requests are dropped from the processor after this call.
        """
        now = time.monotonic()
        updates = []
        for eo in engine_outputs:
            state = self.states[eo.request_id]
            output = state.output
            completion = output.outputs[0]
            metrics = output.metrics
            assert metrics is not None
            # 1) tokens and text
            completion.token_ids.extend(eo.new_token_ids)
            delta = state.detokenizer.update(eo.new_token_ids)
            completion.text = state.detokenizer.output_text
            # 2) timings
            if metrics.first_token_time is None:
                metrics.first_token_time = now
                output.num_cached_tokens = eo.num_cached_tokens
            metrics.last_token_time = now
            metrics.num_generation_tokens += len(eo.new_token_ids)
            # 3) finish
            if eo.finish_reason is not None:
                completion.finish_reason = eo.finish_reason
                completion.stop_reason = eo.stop_reason
                output.finished = True
                metrics.finished_time = now
                del self.states[eo.request_id]
            updates.append((output, delta))
        return updates

    def abort(self, request_id: str) -> RequestOutput | None:
        state = self.states.pop(request_id, None)
        if state is None:
            return None
        state.output.outputs[0].finish_reason = "abort"
        state.output.finished = True
        return state.output
