"""Decides, each step, which tokens of which requests the next forward pass computes.

Each step has a token budget (`max_num_batched_tokens`) and a cap on running requests
(`max_num_seqs`). Running requests go first (a decode takes one token and the draft tokens it
holds; a prompt still being prefilled takes the next chunk), then waiting requests are admitted
in arrival order, their prompts chunked to fit what is left of the budget. With
`--scheduling-policy priority` (vLLM's), both queues are ordered by (priority, arrival), lower
first: a request of a lower value is admitted before any waiting one of a higher value, runs
before it in a step, and the running request of the highest value (the latest among equals)
is preempted first. A request whose
grammar is still compiling waits while the others are scheduled past it. When the KV cache runs
out of blocks the newest running request is preempted: its blocks are freed and it is
recomputed from the start, not swapped out, since its full blocks usually survive in the
prefix cache. Pooling requests (embeddings, scores) are prompts that never sample: they finish
once their prompt is computed (`finishes_pooling`; the engine core then frees them and hands
out their vectors).

`update_after_step` commits a variable number of tokens per sampling request (1 + its accepted
drafts, cut at the first stop, each fed to its grammar's matcher) and rolls the rest back:
`num_computed_tokens` counts only the committed tokens' keys and values, the blocks stay
allocated, and only full blocks of committed tokens are offered to the prefix cache.
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from nanoserve.config import SchedulerConfig
from nanoserve.engine.kv_cache import KVCacheManager
from nanoserve.engine.prefill_pacer import PrefillPacer
from nanoserve.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class ScheduledRequest:
    """One request's share of a step: tokens [start, start + num_new_tokens) of its sequence."""

    request: Request
    start: int  # = request.num_computed_tokens when scheduled
    num_new_tokens: int  # known tokens computed, plus the draft tokens
    draft_token_ids: list[int] = field(default_factory=list)  # scored after the known tokens

    @property
    def samples(self) -> bool:
        """True when this step computes the request's last known token, so a new one is drawn
        (never for a pooling request: it ends with its prompt, see `finishes_pooling`)."""
        return self.start + self.num_new_tokens - len(self.draft_token_ids) \
            == self.request.num_tokens and not self.request.is_pooling

    @property
    def finishes_pooling(self) -> bool:
        """True when this step computes the rest of a pooling request's prompt."""
        return self.request.is_pooling \
            and self.start + self.num_new_tokens == self.request.num_tokens

    @property
    def num_sample_rows(self) -> int:
        """Rows this request samples: one per draft token, plus one after the last."""
        return 1 + len(self.draft_token_ids) if self.samples else 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)  # given a slot in this step
    preempted: list[Request] = field(default_factory=list)  # lost their slot in this step
    num_decodes: int = 0  # scheduled requests computing only their next token (and drafts)
    prompt_units: float = 0.0  # the prompt chunks' cost for the pacer (0 without one)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Waiting and running queues over one KV cache; no tensors here."""

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager,
                 max_model_len: int, pacer: PrefillPacer | None = None) -> None:
        self.config = config
        self.pacer = pacer  # cuts prompt chunks beside decodes (`--prefill-pacing`)
        self._allowance: float | None = None  # the pacer's units left in the step scheduling
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.free_slots = list(range(config.max_num_seqs - 1, -1, -1))
        self.released_slots: list[int] = []  # freed since the engine last looked
        self.num_preemptions = 0
        self.by_priority = config.scheduling_policy == "priority"
        self._arrivals = 0  # each request's arrival number, its place among equal priorities

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        if request.is_pooling and request.num_prompt_tokens > self.max_model_len:
            raise ValueError(
                f"the input has {request.num_prompt_tokens} tokens, but max_model_len is "
                f"{self.max_model_len}; shorten the input or raise max_model_len")
        if not request.is_pooling and request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"the prompt has {request.num_prompt_tokens} tokens, but max_model_len is "
                f"{self.max_model_len}: it leaves no room for an output token; shorten the "
                "prompt or raise max_model_len")
        if request.num_prompt_tokens == 0:
            raise ValueError("the prompt is empty: give at least one token")
        self.requests[request.request_id] = request
        request.arrival = self._arrivals
        self._arrivals += 1
        if self.by_priority:
            self._insert_waiting(request)
        else:
            self.waiting.append(request)

    def _insert_waiting(self, request: Request) -> None:
        """Into the waiting queue at its place by (priority, arrival)."""
        self.waiting.insert(bisect.bisect(self.waiting, _order(request), key=_order), request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """The next forward's work: which requests, and which of their tokens.

        Takes nothing: it reads the queues, the KV cache and the config. Returns the step's
        `ScheduledRequest`s (the running requests first, oldest admitted first, then those
        admitted now, in queue order), the requests given a slot and those preempted in this
        step. Promises: the scheduled tokens, drafts included, fit `max_num_batched_tokens`,
        the running requests `max_num_seqs`, and every scheduled token has its KV slot
        allocated. Only an admitted request's prefix-cache hits count as computed here;
        `update_after_step` advances the rest after the forward.

        1) Running requests: each takes its remaining known tokens (at most
           `long_prefill_token_threshold` when set) up to what is left of the budget (a
           prompt's next chunk, or a decode's token plus as many drafts as fit). In a step
           with decodes the pacer's allowance caps the chunks of prompts longer than the
           budget too, each at least its floor of tokens (engine/prefill_pacer.py). When
           blocks run out the newest running request is preempted (blocks freed, slot
           released, back to the front of the waiting queue); if that is the request itself,
           the pass ends.
        2) Waiting requests, in queue order, not in a step that preempted: one waiting for
           its n > 1 leader's prompt blocks or for its grammar is passed over and keeps its
           place; the first that cannot get its blocks ends the pass.
        """
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self._allowance = self._prompt_allowance()
        if self.by_priority:  # the lowest priority last: scheduled last, preempted first
            self.running.sort(key=_order)
        # 1) running requests, oldest first; preempt the newest when blocks run out
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(self._capped(request.num_tokens - request.num_computed_tokens), budget)
            num_new = self._paced(request, request.num_computed_tokens, num_new)
            num_new = whole_images(request, request.num_computed_tokens, num_new, budget)
            if num_new == 0:  # its next image does not fit what is left of this step
                i += 1
                continue
            # drafts ride on a decode, as many as the budget leaves room for
            drafts = request.draft_token_ids[: budget - 1] if num_new == 1 else []
            num_new += len(drafts)
            while not self.kv_cache.allocate_slots(request, num_new):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                out.scheduled.append(ScheduledRequest(request, request.num_computed_tokens,
                                                      num_new, drafts))
                self._count(out, request, request.num_computed_tokens, num_new - len(drafts))
                budget -= num_new
                i += 1
                continue
            break  # the request itself was preempted; everything after it is gone too
        # 2) waiting requests, in order, while budget, slots and blocks last (not in a step
        #    that had to preempt: the cache is full). A sample of an n > 1 request waits for
        #    its leader's prompt blocks, so it reuses them instead of computing them again;
        #    a request whose grammar is still compiling waits for it.
        skipped: list[Request] = []
        while (self.waiting and budget > 0 and not out.preempted
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            if request.waits_for_leader or request.waits_for_grammar:
                skipped.append(self.waiting.popleft())
                continue
            computed_blocks, num_cached = self.kv_cache.get_computed_blocks(request)
            num_new = min(self._capped(request.num_tokens - num_cached), budget)
            num_new = self._paced(request, num_cached, num_new)
            num_new = whole_images(request, num_cached, num_new, budget)
            if num_new == 0 or not self.kv_cache.allocate_slots(request, num_new,
                                                                computed_blocks):
                break
            self.waiting.popleft()
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_cached
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            request.slot = self.free_slots.pop()
            self.running.append(request)
            out.admitted.append(request)
            out.scheduled.append(ScheduledRequest(request, num_cached, num_new))
            self._count(out, request, num_cached, num_new)
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return out

    def _capped(self, num_new: int) -> int:
        """A request's new tokens for this step, at most --long-prefill-token-threshold."""
        threshold = self.config.long_prefill_token_threshold
        return threshold if 0 < threshold < num_new else num_new

    def _prompt_allowance(self) -> float | None:
        """The pacer's units for this step's prompt chunks: None (no cap) without a pacer or
        when no running request is decoding."""
        if self.pacer is None or not any(
                r.num_tokens - r.num_computed_tokens == 1 for r in self.running):
            return None
        return self.pacer.allowance()

    def _paced(self, request: Request, start: int, num_new: int) -> int:
        """A long prompt's chunk of `num_new` tokens from `start` cut to what is left of the
        pacer's allowance, but never below the pacer's floor, so it moves each step. Only a
        request longer than the step budget is long (one chunked anyway, as vLLM's
        long-prefill threshold counts it): a shorter prompt stalls the streams for one step
        at most, and cutting it would only make it wait (at 32 streams, a 128-token prompt
        paced to 32-token chunks doubled the time to first token)."""
        if (self._allowance is None or num_new <= 1 or self.pacer is None
                or request.num_tokens <= self.config.max_num_batched_tokens):
            return num_new
        return self.pacer.chunk(start, num_new, self._allowance)

    def _count(self, out: SchedulerOutput, request: Request, start: int,
               num_tokens: int) -> None:
        """Book a scheduled request as a decode (its last known token) or as a prompt chunk
        (its units spent)."""
        if request.num_tokens - start == 1:
            out.num_decodes += 1
        elif self.pacer is not None:
            units = self.pacer.units(start, num_tokens)
            out.prompt_units += units
            if self._allowance is not None:
                self._allowance = max(0.0, self._allowance - units)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.kv_cache.free(request)
        self._release_slot(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.num_preemptions += 1
        if self.by_priority:
            self._insert_waiting(request)
        else:
            self.waiting.appendleft(request)
        out.preempted.append(request)

    def update_after_step(self, out: SchedulerOutput,
                          new_token_ids: Sequence[int | Sequence[int]]) -> list[list[int]]:
        """Advance every scheduled request and commit its new tokens (`new_token_ids`: for each
        sampling request, in scheduled order, one token or the tokens it may commit: 1 + its
        accepted drafts). Tokens after a stop are dropped; a request that hits one finishes.
        Returns the tokens each sampling request committed, in the same order."""
        sampled = iter(new_token_ids)
        committed: list[list[int]] = []
        for s in out.scheduled:
            request = s.request
            if not s.samples:
                request.num_computed_tokens += s.num_new_tokens
                self.kv_cache.cache_blocks(request)
                continue
            tokens = next(sampled)
            tokens = [tokens] if isinstance(tokens, int) else list(tokens)
            # rejected drafts roll back: their keys and values are overwritten later
            num_rejected = len(s.draft_token_ids) - (len(tokens) - 1)
            request.num_computed_tokens += s.num_new_tokens - num_rejected
            request.draft_token_ids = []
            taken = self._commit(request, tokens)
            if not request.is_finished:
                self.kv_cache.cache_blocks(request)
            committed.append(taken)
        return committed

    def _commit(self, request: Request, tokens: list[int]) -> list[int]:
        """Append `tokens` one by one until one stops the request; the ones appended."""
        for n, token in enumerate(tokens, 1):
            request.append_output_token(token)
            status = self._stop_status(request)
            if request.grammar is not None:
                status = self._advance_grammar(request, status)
            if status is not None:
                # a stop inside the window: the tokens after it were never generated, so
                # their keys and values do not count (nor go to the prefix cache)
                request.num_computed_tokens = min(request.num_computed_tokens,
                                                  request.num_tokens - 1)
                self.kv_cache.cache_blocks(request)
                self.finish(request, status)
                return tokens[:n]
        return tokens

    def _stop_status(self, request: Request) -> RequestStatus | None:
        params = request.params
        token = request.output_token_ids[-1]
        if not params.ignore_eos and token in request.eos_token_ids:
            request.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if token in request.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _advance_grammar(self, request: Request,
                         status: RequestStatus | None) -> RequestStatus | None:
        """Feed the drawn token to the request's matcher; the request's status after it.

        A grammar that completes on a text token does not finish the request: its mask then
        allows only EOS, which the next step draws, so the output ends as a natural stop does
        (and the output path's removal of the stop token removes the EOS, not the text's last
        token). With ignore_eos that EOS does not stop the request; the complete grammar does.
        """
        assert request.grammar is not None
        token = request.output_token_ids[-1]
        if not request.grammar.accept(token):
            # the bitmask allowed it, so this is a bug (in the mask, or a stage after it that
            # left no allowed token, e.g. min_tokens banning the EOS a complete grammar needs)
            logger.error("request %s: its grammar refused token %d after %d output tokens: %s",
                         request.request_id, token, request.num_output_tokens,
                         request.grammar.matcher.error.split("\n", 1)[0])
            request.stop_reason = None
            return RequestStatus.FINISHED_ERROR
        if (status != RequestStatus.FINISHED_STOPPED and token in request.eos_token_ids
                and request.grammar.is_terminated()):
            request.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        return status

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take the request out of the queues and free its blocks and slot (also for aborts)."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self._release_slot(request)
        elif not request.is_finished:
            self.waiting.remove(request)
        request.status = status
        request.grammar = None  # its matcher goes with it
        self.kv_cache.free(request)
        self.requests.pop(request.request_id, None)

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def _release_slot(self, request: Request) -> None:
        assert request.slot is not None
        self.free_slots.append(request.slot)
        self.released_slots.append(request.slot)
        request.slot = None


def whole_images(request: Request, start: int, num_new: int, budget: int) -> int:
    """`num_new` tokens from `start`, changed so the chunk never ends inside an image: cut
    before an image it would split, or, where it starts inside one (a prefix hit ended there),
    stretched to the image's end if `budget` holds it, else 0 (it waits for a step with room).
    An image is computed in one step: Gemma 3's placeholders attend each other both ways, and
    a chunk cannot attend tokens of the next (vLLM keeps such spans whole too)."""
    end = start + num_new
    for image in request.images:
        if image.offset < end < image.end:
            if image.offset > start:
                return image.offset - start
            return image.end - start if image.end - start <= budget else 0
    return num_new


def _order(request: Request) -> tuple[int, int]:
    """A request's place under the priority policy: lower priority values first, then earlier
    arrivals."""
    return request.params.priority, request.arrival
