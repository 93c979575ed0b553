"""What the sampler knows of one running sequence: data only, never the engine's request.

The engine builds one `SequenceData` when a request is admitted to a slot and hands it to
`Sampler.add_request`; the sampler's stages and custom logits processors read it until the slot
is released. The token-id lists are the engine's own, shared rather than copied: the engine
appends each sampled token to `output_token_ids` in place, so the view stays current without
any per-step work. Read them; never change them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nanoserve.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class SequenceData:
    """One sequence in its sampler slot (vLLM's (index, params, prompt_ids, output_ids))."""

    slot: int  # row of the sampler's per-slot state
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # grows by one token per step, appended by the engine
    seed: int  # the seed of the draw: params.seed, or one drawn at admission
    # who asked: the digest of the API key the request presented ("" without one); draft
    # proposers that learn across requests keep what they learn per tenant
    tenant: str = ""
    # mirostat's mu after the committed output (None: a fresh request, mu starts at 2 * tau);
    # the engine keeps it across a preemption (StepOutput.mirostat_mu)
    mirostat_mu: float | None = None
