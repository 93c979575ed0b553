"""Test-only sources of draft tokens, to drive steps that commit several tokens per request
before any real proposer exists (`--draft-proposer scripted_drafts:ScriptedDrafts`, this
directory on PYTHONPATH; or `LLM(draft_proposer=ScriptedDrafts)`).

`extra_args={"draft_script": [...]}` gives a request's script: at output length L the proposer
drafts `script[L : L + k]`. A script of the true continuation (the output of a run without
drafts) is accepted whole; `"draft_garbage_every": m` replaces every m-th drafted position
with a token the model would not write, so windows commit 1 to k + 1 tokens. `Garbage` drafts
only such tokens; `Adversarial` corrupts the script at random places, or drafts random tokens.
Whatever is drafted, the output must equal the run without drafts.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from nanoserve.sample.sequence import SequenceData

GARBAGE_TOKEN = 49151  # the vocabulary's last id: never the model's likeliest token here
VOCAB_SIZE = 49152  # the default model's


class ScriptedDrafts:
    """Drafts the next tokens of each request's `draft_script` (see the module)."""

    def propose(self, seq: SequenceData, num_tokens: int) -> Sequence[int]:
        extra = seq.params.extra_args or {}
        script = extra.get("draft_script")
        if script is None:
            return []
        every = int(extra.get("draft_garbage_every", 0))
        start = len(seq.output_token_ids)
        return [GARBAGE_TOKEN if every and (start + i) % every == every - 1 else token
                for i, token in enumerate(script[start : start + num_tokens])]


class Garbage:
    """Drafts tokens the model would not write: every draft is rejected."""

    def propose(self, seq: SequenceData, num_tokens: int) -> Sequence[int]:
        return [GARBAGE_TOKEN] * num_tokens


class Adversarial:
    """The true continuation corrupted at random places: `draft_script` as in ScriptedDrafts,
    each drafted position replaced by a random token with probability `draft_corrupt_rate`
    (default 0.25); random tokens alone for a request without a script. The randomness is
    keyed by (seed, output length), so a run is repeatable."""

    def propose(self, seq: SequenceData, num_tokens: int) -> Sequence[int]:
        extra = seq.params.extra_args or {}
        start = len(seq.output_token_ids)
        rng = random.Random(seq.seed * 100_003 + start)
        script = extra.get("draft_script")
        if script is None:
            return [rng.randrange(VOCAB_SIZE) for _ in range(num_tokens)]
        rate = float(extra.get("draft_corrupt_rate", 0.25))
        return [rng.randrange(VOCAB_SIZE) if rng.random() < rate else token
                for token in script[start : start + num_tokens]]
