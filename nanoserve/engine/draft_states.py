"""Speculative decoding on a hybrid model, the core's side: how a verify step's rejected drafts
leave the DeltaNet states untouched (vLLM's way).

A KV cache rolls a rejected draft back by forgetting its rows (`num_computed_tokens` stops
before them). A DeltaNet state has no rows: the forward of a verify chunk (rows: the last known
token, then drafts 1..n) leaves it past every draft. So the step also copies the state after
each row but the last into the request's draft slots (engine/state_pool.py), and once the core
knows how many drafts were kept, the next step's `state_inits` start with the copy of the state
after the last accepted row into the live slot (none when all were kept: the live state is it).
The bonus token drawn after the accepted drafts is not computed yet, as for the KV cache.

The prefix cache's snapshots at block boundaries inside a verify chunk are decided here too,
after acceptance, from the same draft slots: only positions whose tokens were committed are
published, so a rejected draft's state never reaches the cache (engine/state_cache.py).

The copies run at the very start of the next step, before its admitted requests' states are set
and before its forward writes any slot, so a draft slot is read before anything overwrites it;
and the kernels give a token the same bits whatever call it is computed in, so a kept state
equals the one decoding one token a step leaves (model/delta_net_ops.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from nanoserve.engine.kv_cache import KVCacheManager
from nanoserve.engine.scheduler import ScheduledRequest
from nanoserve.engine.state_cache import StateSnapshots

StateCopy = tuple[int, int]  # (destination slot, source slot), as in StepInput.state_inits


class DraftStates:
    """Draft slots [first_slot, first_slot + live slots * num_drafts): live slot s's are
    `first_slot + s * num_drafts + row`, row < num_drafts."""

    def __init__(self, first_slot: int, num_drafts: int) -> None:
        self.first_slot = first_slot
        self.num_drafts = num_drafts
        self.pending: list[StateCopy] = []  # for the next step's state_inits, in order
        self._verifying: dict[str, int] = {}  # request id -> its live slot, this step

    def draft_slot(self, slot: int, row: int) -> int:
        """Where the state after row `row` of live slot `slot`'s verify chunk is kept."""
        assert 0 <= row < self.num_drafts, "a verify chunk has at most num_drafts drafts"
        return self.first_slot + slot * self.num_drafts + row

    def take_pending(self) -> list[StateCopy]:
        """The copies the last step's acceptance asks for, once (they lead the next step's
        `state_inits`)."""
        pending, self.pending = self.pending, []
        return pending

    def plan(self, scheduled: Sequence[ScheduledRequest], first_rows: Sequence[int],
             snapshots: list[tuple[int, int]]) -> None:
        """Add to `snapshots` (the step's `state_snapshots`: (row, slot)) the state after
        every row but the last of each verify chunk, into its draft slots."""
        self._verifying.clear()
        for s, first_row in zip(scheduled, first_rows, strict=True):
            if not s.draft_token_ids:
                continue
            slot = s.request.slot
            assert slot is not None, "a scheduled request holds a slot"
            snapshots.extend((first_row + row, self.draft_slot(slot, row))
                             for row in range(len(s.draft_token_ids)))
            self._verifying[s.request.request_id] = slot

    def commit(self, sampled: Sequence[ScheduledRequest], num_accepted: Sequence[int],
               states: StateSnapshots | None, kv_cache: KVCacheManager) -> None:
        """After the scheduler committed the step (`num_accepted`: 1 + drafts kept, per
        sampling request in `sampled`): queue the copy of each verify chunk's last accepted
        state into its live slot, and the prefix cache's snapshots of the chunk's committed
        positions (a request that stopped inside its window commits fewer: its
        `num_computed_tokens` says how many)."""
        for s, taken in zip(sampled, num_accepted, strict=True):
            num_drafts = len(s.draft_token_ids)
            if not num_drafts:
                continue
            slot = self._verifying.pop(s.request.request_id)
            last = taken - 1  # the row whose state the sequence now has

            def source(row: int, slot: int = slot, num_drafts: int = num_drafts) -> int:
                return slot if row == num_drafts else self.draft_slot(slot, row)

            if last < num_drafts and not s.request.is_finished:
                self.pending.append((slot, source(last)))
            if states is None:
                continue
            end = min(s.request.num_computed_tokens, s.start + taken)
            planned = states.plan(kv_cache.block_hashes(s.request), s.start, end,
                                  s.request.num_prompt_tokens)
            self.pending.extend((snapshot, source(token - s.start))
                                for token, snapshot in planned)
