"""OutputProcessor: the frontend's one loop per step over the engine's outputs.

`process` walks the step's EngineCoreOutputs once and, for each, detokenizes the new tokens
(one or several: a step that accepted draft tokens brings several),
checks stop strings (holding back text that might begin one), formats logprobs, and updates the
user-facing RequestOutput of the request it belongs to (a request with n > 1 is n engine
requests, one per sample). It returns the updates to hand out, shaped by each request's
output_kind, and the engine requests that a stop string (or a forced call list's repeated call,
`repeats.py`) finished, which the caller aborts in the engine at once so their blocks are freed.
A request that asked for `return_progress` also gets its prompt's progress (sample 0's, the one
that computes the prompt) on its next update; an engine output that carries only that (a prefill
chunk: no tokens, no finish) touches neither the text nor the timings.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from nanoserve.output.detokenizer import IncrementalDetokenizer
from nanoserve.output.logprobs import LogprobsFormatter
from nanoserve.output.repeats import RepeatedItemChecker
from nanoserve.output.stop import StopStringChecker
from nanoserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from nanoserve.protocol import EngineCoreOutput, PromptProgress
from nanoserve.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class SampleState:
    """One sample (one engine request) of a user request."""

    engine_id: str
    request_id: str  # the user request it belongs to
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    stops: StopStringChecker
    repeats: RepeatedItemChecker | None  # a forced call list's (params.is_call_list)
    completion: CompletionOutput  # the whole sample so far (text: all that may be sent)
    text: str = ""  # all detokenized text, held-back tail included
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    num_sent_logprobs: int = 0
    finish_sent: bool = False

    @property
    def finished(self) -> bool:
        return self.completion.finish_reason is not None


@dataclass
class RequestState:
    """A user request: its prompt, its samples, its timings."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[SampleState] = field(default_factory=list)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    num_cached_tokens: int = 0
    prompt_logprobs: list[Any] | None = None
    prompt_logprobs_sent: bool = False
    prompt_progress: PromptProgress | None = None  # the latest, until an update carries it

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)


@dataclass
class StepResult:
    outputs: list[RequestOutput]  # updates to hand out, one per user request that changed
    to_abort: list[str]  # engine requests that a stop string or a repeat finished


class TimingObserver(Protocol):
    """Receives request timings as they happen (the server's Prometheus histograms)."""

    def first_token(self, seconds: float, num_prompt_tokens: int) -> None: ...

    def inter_token(self, seconds: float, num_tokens: int) -> None: ...

    def generated(self, num_tokens: int) -> None: ...

    def finished(self, state: RequestState) -> None: ...

    def pooled(self, seconds: float, num_prompt_tokens: int) -> None:
        """A prefill-only (embedding, score) request ended after `seconds` (no tokens)."""


class OutputProcessor:
    """Per-request frontend state and the one loop over each step's outputs."""

    def __init__(self, tokenizer: Any, observer: TimingObserver | None = None) -> None:
        self.tokenizer = tokenizer
        self.observer = observer
        self.logprobs = LogprobsFormatter(tokenizer)
        self.requests: dict[str, RequestState] = {}
        self.samples: dict[str, SampleState] = {}  # by engine request id

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams) -> list[tuple[str, SamplingParams, str | None]]:
        """Register a request; returns its engine requests: (id, params, prefill leader id).

        With n > 1, sample i gets seed + i (when seeded) and waits for sample 0's prompt blocks,
        which it then shares through the prefix cache.
        """
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        state = RequestState(request_id, prompt, prompt_token_ids, params)
        engine_requests = []
        for i in range(params.n):
            engine_id = request_id if params.n == 1 else f"{i}_{request_id}"
            sample_params = params if params.n == 1 else replace(
                params, n=1, seed=None if params.seed is None else (params.seed + i) % 2**64)
            sample = SampleState(
                engine_id, request_id, i, sample_params,
                IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                       params.skip_special_tokens,
                                       params.spaces_between_special_tokens),
                StopStringChecker(params.stop or [], params.include_stop_str_in_output),
                RepeatedItemChecker(_after_reasoning(params)) if params.is_call_list else None,
                CompletionOutput(i, "", [], logprobs=[] if params.logprobs is not None
                                 else None,
                                 cumulative_logprob=0.0 if params.logprobs is not None
                                 else None))
            state.samples.append(sample)
            self.samples[engine_id] = sample
            leader = None if i == 0 else state.samples[0].engine_id
            engine_requests.append((engine_id, sample_params, leader))
        self.requests[request_id] = state
        return engine_requests

    def engine_ids(self, request_id: str) -> list[str]:
        state = self.requests.get(request_id)
        return [] if state is None else [s.engine_id for s in state.samples]

    def process(self, engine_outputs: list[EngineCoreOutput]) -> StepResult:
        """The one loop: each engine output once; then one update per changed request."""
        now = time.monotonic()
        changed: dict[str, RequestState] = {}
        to_abort: list[str] = []
        for eo in engine_outputs:
            sample = self.samples.get(eo.request_id)
            if sample is None:
                continue  # aborted by the caller in the meantime
            state = self.requests[sample.request_id]
            if eo.prompt_progress is not None and sample.index == 0:
                state.prompt_progress = eo.prompt_progress
                changed[state.request_id] = state
            if not eo.new_token_ids and eo.finish_reason is None:
                continue  # a prefill chunk's progress, nothing else
            is_stopped, num_tokens = self._update_sample(sample, eo)
            if is_stopped:
                to_abort.append(eo.request_id)
            self._record_timing(state, eo, now, num_tokens)
            changed[state.request_id] = state
        outputs = []
        for state in changed.values():
            update = self._make_output(state)
            if update is not None:
                outputs.append(update)
            if state.finished:
                state.metrics.finished_time = now
                if self.observer is not None:
                    self.observer.finished(state)
                self._forget(state)
        return StepResult(outputs, to_abort)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a user request as aborted; its final output (the caller stops the engine)."""
        state = self.requests.get(request_id)
        if state is None:
            return None
        for sample in state.samples:
            if not sample.finished:
                sample.completion.finish_reason = "abort"
                sample.completion.text = sample.text[: len(sample.text)
                                                     - self._held_back(sample)]
        state.metrics.finished_time = time.monotonic()
        if self.observer is not None:
            self.observer.finished(state)
        self._forget(state)
        return self._snapshot(state, cumulative=True)

    # -- one sample ---------------------------------------------------------------------------
    def _update_sample(self, sample: SampleState, eo: EngineCoreOutput) -> tuple[bool, int]:
        """Add the output's tokens and text: (True if a stop string or a repeat finished the
        sample, the number of the output's tokens kept). Several tokens (a step that accepted draft
        tokens) are taken one at a time, as steps of one token each would have brought them,
        so a stop string inside them ends the sample at the same token: the tokens after it
        are dropped (from the text, token ids, logprobs and counts alike)."""
        if len(eo.new_token_ids) <= 1:
            return self._add_tokens(sample, eo), len(eo.new_token_ids)
        num_tokens = len(eo.new_token_ids)
        for j, token_id in enumerate(eo.new_token_ids):
            is_last = j == num_tokens - 1
            one = EngineCoreOutput(
                eo.request_id, [token_id], eo.finish_reason if is_last else None,
                eo.stop_reason if is_last else None, eo.num_cached_tokens,
                None if eo.new_logprobs is None else eo.new_logprobs[j : j + 1])
            if self._add_tokens(sample, one):
                return True, j + 1
        return False, num_tokens

    def _add_tokens(self, sample: SampleState, eo: EngineCoreOutput) -> bool:
        """Add the output's tokens and text; True if a stop string or a repeated call finished
        the sample."""
        params = sample.params
        completion = sample.completion
        completion.token_ids.extend(eo.new_token_ids)
        if eo.new_logprobs is not None and completion.logprobs is not None:
            for entry in eo.new_logprobs:
                completion.logprobs.append(self.logprobs.position(entry))
                completion.cumulative_logprob = (completion.cumulative_logprob or 0.0) \
                    + entry.logprob
        # a stop token ends the text before it (unless include_stop_str_in_output)
        tokens = eo.new_token_ids
        if eo.finish_reason == "stop" and not params.include_stop_str_in_output:
            tokens = tokens[:-1]
        delta = sample.detokenizer.update(tokens)
        if eo.finish_reason is not None:
            delta += sample.detokenizer.flush()
        sample.text += delta
        match = None
        if len(completion.token_ids) >= params.min_tokens:
            match = sample.stops.find(sample.text, len(delta))
        repeat_at = None if sample.repeats is None else sample.repeats.scan(sample.text)
        if match is not None:  # (checked even when the engine finished it this step)
            sample.text = sample.text[: match.text_end]
            completion.finish_reason, completion.stop_reason = "stop", match.stop
        elif repeat_at is not None:  # a call list's repeated call: the list ends before it
            sample.text = sample.text[:repeat_at]
            completion.finish_reason, completion.stop_reason = "stop", None
        elif eo.finish_reason is not None:
            completion.finish_reason, completion.stop_reason = eo.finish_reason, eo.stop_reason
        held = 0 if completion.finish_reason is not None else self._held_back(sample)
        completion.text = sample.text[: len(sample.text) - held]
        return (match is not None or repeat_at is not None) and eo.finish_reason is None

    @staticmethod
    def _held_back(sample: SampleState) -> int:
        """The trailing characters not to send yet: a stop string's possible beginning, or a
        call that may yet repeat an earlier one."""
        held = sample.stops.held_back(sample.text)
        if sample.repeats is not None:
            held = max(held, sample.repeats.held_back(sample.text))
        return held

    def _record_timing(self, state: RequestState, eo: EngineCoreOutput, now: float,
                       num_tokens: int) -> None:
        metrics = state.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
            state.num_cached_tokens = eo.num_cached_tokens
            if self.observer is not None:
                self.observer.first_token(now - metrics.arrival_time,
                                          len(state.prompt_token_ids))
        elif self.observer is not None and metrics.last_token_time is not None:
            self.observer.inter_token(now - metrics.last_token_time, num_tokens)
        metrics.last_token_time = now
        metrics.num_generation_tokens += num_tokens
        if self.observer is not None:  # counted as they come, so a dashboard's rate is live
            self.observer.generated(num_tokens)
        if eo.prompt_logprobs is not None and state.prompt_logprobs is None:
            state.prompt_logprobs = [None] + [self.logprobs.position(e)
                                              for e in eo.prompt_logprobs]

    # -- the update a request's caller sees ----------------------------------------------------
    def _make_output(self, state: RequestState) -> RequestOutput | None:
        kind = state.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY:
            return self._snapshot(state, cumulative=True) if state.finished else None
        if kind == RequestOutputKind.CUMULATIVE:
            return self._snapshot(state, cumulative=True)
        return self._snapshot(state, cumulative=False)

    def _snapshot(self, state: RequestState, cumulative: bool) -> RequestOutput | None:
        outputs = []
        for sample in state.samples:
            c = sample.completion
            if cumulative:
                outputs.append(replace(c, token_ids=list(c.token_ids),
                                       logprobs=None if c.logprobs is None else list(c.logprobs)))
            else:
                new_text = c.text[sample.num_sent_chars :]
                new_tokens = c.token_ids[sample.num_sent_tokens :]
                if not new_text and not new_tokens and (sample.finish_sent or not c.finished):
                    continue
                outputs.append(replace(
                    c, text=new_text, token_ids=new_tokens,
                    logprobs=None if c.logprobs is None
                    else c.logprobs[sample.num_sent_logprobs :]))
            sample.num_sent_chars = len(c.text)
            sample.num_sent_tokens = len(c.token_ids)
            sample.num_sent_logprobs = len(c.logprobs or ())
            sample.finish_sent = c.finished
        if not outputs and state.prompt_progress is None:
            return None
        progress, state.prompt_progress = state.prompt_progress, None
        prompt_logprobs = None
        if state.prompt_logprobs is not None and (cumulative or not state.prompt_logprobs_sent):
            prompt_logprobs = state.prompt_logprobs
            state.prompt_logprobs_sent = True
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, outputs,
                             finished=state.finished, num_cached_tokens=state.num_cached_tokens,
                             metrics=state.metrics, prompt_logprobs=prompt_logprobs,
                             prompt_progress=progress)

    def _forget(self, state: RequestState) -> None:
        self.requests.pop(state.request_id, None)
        for sample in state.samples:
            self.samples.pop(sample.engine_id, None)


def _after_reasoning(params: SamplingParams) -> str | None:
    structured = params.structured_outputs
    return None if structured is None else structured.after_reasoning
