"""The core's side of the MTP head as a proposer (`--speculative-config '{"method": "mtp"}'`):
the drafts are computed in the worker, right after the step's draw (engine/mtp_drafter.py), and
come back with the step's output; this proposer hands the core's draft policy
(engine/drafts.py's `propose_drafts`) those of the last step, as n-gram drafts are handed.
"""

from __future__ import annotations

from collections.abc import Sequence

from nanoserve.sample.sequence import SequenceData


class MtpProposer:
    """The last step's drafts of each sampling request, by slot."""

    def __init__(self) -> None:
        self._drafts: dict[int, list[int]] = {}

    def take_step_drafts(self, slots: Sequence[int], drafts: Sequence[list[int]]) -> None:
        """After a step: its sampling requests' slots and their drafts (the worker's
        `StepOutput.draft_token_ids`, [] each where none came). The drafts of requests that
        did not sample this step are forgotten: they were made for an earlier state."""
        if len(drafts) != len(slots):
            drafts = [[] for _ in slots]
        self._drafts = dict(zip(slots, drafts, strict=True))

    def propose(self, seq: SequenceData, num_tokens: int) -> Sequence[int]:
        """The head's first `num_tokens` drafts for the request in `seq.slot`."""
        return self._drafts.get(seq.slot, [])[:num_tokens]
