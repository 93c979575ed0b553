"""When the engine drafts: a row budget per step, and a per-request acceptance average that
stops a request whose drafts miss, then probes it again now and then."""

from __future__ import annotations

from nanoserve.engine.drafts import PROBE_INTERVAL, draft_budget, worth_drafting


def test_no_drafts_beside_a_prompt_chunk_or_past_the_row_budget() -> None:
    assert draft_budget(1, is_prefill_waiting=False, max_rows=8) == 7
    assert draft_budget(1, is_prefill_waiting=True, max_rows=8) == 0
    assert draft_budget(8, is_prefill_waiting=False, max_rows=8) == 0
    assert draft_budget(32, is_prefill_waiting=False, max_rows=8) == 0


def test_acceptance_sets_how_far_a_request_drafts() -> None:
    assert worth_drafting(1.0, 0, k=4) == 4  # never drafted, or every draft kept
    assert worth_drafting(0.8, 0, k=4) == 4  # 0.8 ** 5 = 0.33: all four still pay
    assert worth_drafting(0.5, 0, k=4) == 1  # 0.5 ** 2 = 0.25: only the first
    assert worth_drafting(0.1, 0, k=4) == 0
    assert worth_drafting(0.0, PROBE_INTERVAL - 1, k=4) == 0
    assert worth_drafting(0.0, PROBE_INTERVAL, k=4) == 1  # a probe
