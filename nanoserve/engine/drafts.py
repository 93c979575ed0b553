"""Where draft tokens come from: a proposer the engine core asks, after each step, for the next
tokens of each running request that can take them (speculative decoding).

A proposer gets data, never engine objects: the sequence's `SequenceData` (params, prompt and
output token ids, seed) and how many drafts it may propose. Whatever it proposes, the output is
the same: a draft is kept only where it equals the token the target model draws there
(sample/verify.py), so a bad proposer costs time, never tokens. `--speculative-config` names
the model-free ones (`ngram`, `suffix`: nanoserve/spec/) and the model's MTP head (`mtp`,
whose drafts the worker computes and the step's output brings: `hand_over_step_drafts`); any
other loads by 'module:Class' (`--draft-proposer`, `LLM(draft_proposer=...)`), as logits
processors do.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from nanoserve.engine.request import Request, RequestStatus
from nanoserve.plugins import import_named
from nanoserve.protocol import SchedulerStats
from nanoserve.sample.sequence import SequenceData
from nanoserve.spec.mtp import MtpProposer
from nanoserve.spec.ngram import NgramProposer
from nanoserve.spec.suffix import SuffixProposer
from nanoserve.speculative_config import SpeculativeConfig

# When drafting pays. A draft row costs a step a little while the step reads weights more
# than it computes (up to 4 rows on the 2-core CPU at context 256, +13% a row; 5 rows cost
# 2.25x one: `bench step --rows-curve`, docs/benchmarks.md) and a lot past that, and each
# row re-reads its context (+31% a row at 1,024 tokens), so drafts are proposed only
# while decode rows + drafts stay under `--speculative-max-rows` and no prompt chunk waits;
# and each request drafts only as far as its own recent acceptance makes worth it.
ACCEPTANCE_WEIGHT = 0.3  # of the latest drafting step in a request's acceptance average
MIN_DRAFT_ODDS = 0.3  # the j-th draft is proposed while acceptance ** j stays above this
PROBE_INTERVAL = 16  # steps after which a request that stopped drafting tries one draft


def draft_budget(num_decode_rows: int, is_prefill_waiting: bool, max_rows: int) -> int:
    """Draft tokens the next step may take in all: none beside a prompt chunk, else what
    keeps the step within `max_rows` rows."""
    return 0 if is_prefill_waiting else max(0, max_rows - num_decode_rows)


def worth_drafting(acceptance: float, steps_without_drafts: int, k: int) -> int:
    """How many drafts a request with this acceptance average should take (up to k): those
    whose odds of being kept, acceptance ** j, stay above MIN_DRAFT_ODDS; one now and then
    (a probe) when none would, so that a request whose text turns repetitive drafts again."""
    if acceptance >= 1.0:
        return k
    worth = 0 if acceptance <= 0.0 else int(math.log(MIN_DRAFT_ODDS) / math.log(acceptance))
    if worth == 0 and steps_without_drafts >= PROBE_INTERVAL:
        return 1
    return min(k, worth)


def sequence_of(request: Request) -> SequenceData:
    """What a proposer sees of a request."""
    return SequenceData(request.slot or 0, request.params, request.prompt_token_ids,
                        request.output_token_ids, request.sampling_seed, request.tenant)


def record_drafts(stats: SchedulerStats, requests: Sequence[Request],
                  num_drafts: Sequence[int], num_accepted: Sequence[int]) -> None:
    """After a step: each drafting request's acceptance average, and vLLM's spec_decode
    counters (its drafts, and those kept: the draws that equalled them, before any stop cut
    the window). `num_accepted` counts the committed row too (1 + drafts kept)."""
    for request, drafted, taken in zip(requests, num_drafts, num_accepted, strict=True):
        if not drafted:
            continue
        kept = taken - 1
        request.draft_acceptance = ((1 - ACCEPTANCE_WEIGHT) * request.draft_acceptance
                                    + ACCEPTANCE_WEIGHT * kept / drafted)
        stats.spec_decode_num_drafts += 1
        stats.spec_decode_num_draft_tokens += drafted
        stats.spec_decode_num_accepted_tokens += kept
        per_position = stats.spec_decode_num_accepted_tokens_per_pos
        per_position.extend([0] * (drafted - len(per_position)))
        for position in range(kept):
            per_position[position] += 1


def hand_over_finished(proposer: DraftProposer, requests: Sequence[Request]) -> None:
    """Each request that stopped or hit its length, to a proposer that keeps past outputs
    (`request_finished`)."""
    finished = getattr(proposer, "request_finished", None)
    if finished is None:
        return
    for request in requests:
        if request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            finished(sequence_of(request))


def hand_over_step_drafts(proposer: DraftProposer, requests: Sequence[Request],
                          drafts: Sequence[list[int]]) -> None:
    """The drafts the worker computed after a step (`StepOutput.draft_token_ids`, one list
    per sampling request in `requests`' order), to a proposer that takes them
    (`take_step_drafts`: the MTP head's)."""
    take = getattr(proposer, "take_step_drafts", None)
    if take is not None:
        take([r.slot for r in requests], drafts)


class DraftProposer(Protocol):
    """Proposes up to `num_tokens` tokens to follow a sequence's output so far. A proposer
    that learns across requests may also have `request_finished(seq)`, called with each
    request that finished (stopped or hit its length), its whole output in `seq`."""

    def propose(self, seq: SequenceData, num_tokens: int) -> Sequence[int]: ...


def load_draft_proposer(spec: Any) -> DraftProposer | None:
    """None, a speculative config (or its dict, as msgpack brings it to the engine process),
    an instance, a class, or 'module:Class' -> a proposer (or None); a ValueError that says
    what is wrong otherwise."""
    if spec is None:
        return None
    if isinstance(spec, (dict, SpeculativeConfig)):  # (a dict holds every field, checked)
        return model_free_proposer(spec if isinstance(spec, SpeculativeConfig)
                                   else SpeculativeConfig(**spec))
    if isinstance(spec, str):
        name = spec
        spec = import_named(name, "draft proposer")
        if spec is None:
            raise ValueError(f"draft proposer {name!r}: no such name in its module")
    proposer = spec() if isinstance(spec, type) else spec
    if not callable(getattr(proposer, "propose", None)):
        raise ValueError(f"draft proposer {proposer!r} has no propose(seq, num_tokens) method")
    return proposer


def model_free_proposer(config: SpeculativeConfig) -> DraftProposer:
    """The proposer `--speculative-config` names (nanoserve/spec/); for `mtp`, the core's
    side of the worker's MTP head."""
    if config.method == "mtp":
        return MtpProposer()
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    return SuffixProposer(config.suffix_decoding_max_tree_depth,
                          config.suffix_decoding_max_spec_factor,
                          config.suffix_decoding_min_token_prob,
                          config.suffix_decoding_max_cached_requests)


def propose_drafts(proposer: Any, running: Sequence[Request], is_prompt_waiting: bool, k: int,
                   max_rows: int, max_model_len: int,
                   valid_drafts: Callable[[Any, list[int]], list[int]]) -> None:
    """Set each running request's `draft_token_ids` from `proposer`: up to `k` each, within
    the step's `draft_budget` (none while a prompt waits or a chunk is left), the model's
    length and what the request's acceptance makes worth it; a request with a grammar keeps
    the drafts its grammar accepts (`valid_drafts`)."""
    is_prefill_waiting = is_prompt_waiting or any(
        r.num_computed_tokens < r.num_tokens - 1 for r in running)
    budget = draft_budget(len(running), is_prefill_waiting, max_rows)
    for request in running:
        # drafts must fit the model's length; a max_tokens inside the window is cut as any
        # stop is (scheduler.py)
        room = min(k, max_model_len - request.num_tokens, budget,
                   worth_drafting(request.draft_acceptance, request.steps_without_drafts, k))
        request.steps_without_drafts += 1
        if room > 0 and request.num_computed_tokens == request.num_tokens - 1 \
                and _can_take_drafts(request):
            drafts = list(proposer.propose(sequence_of(request), room))[:room]
            if request.grammar is not None:
                drafts = valid_drafts(request.grammar, drafts)
            request.draft_token_ids = drafts
            budget -= len(request.draft_token_ids)
            if request.draft_token_ids:
                request.steps_without_drafts = 0


def _can_take_drafts(request: Request) -> bool:
    """True unless the request samples nothing or uses a custom logits processor that cannot
    see draft rows (every built-in stage and the grammar mask take draft rows as a one-token
    decode after the drafts before them: sample/stages.py, core.py's `_fill_grammars`)."""
    return request.slot is not None and not request.is_pooling and not request.refuses_drafts
