"""llama-server's `prompt_progress` for the requests that ask (`return_progress`), made from a
step's scheduled prompt chunks after its forward (the core's `_step` calls it)."""

from __future__ import annotations

import time

from nanoserve.engine.scheduler import ScheduledRequest
from nanoserve.protocol import EngineCoreOutput, PromptProgress


def prompt_progress(scheduled: list[ScheduledRequest], outputs: list[EngineCoreOutput],
                     started: float) -> list[EngineCoreOutput]:
    """llama-server's `prompt_progress` for each request that asked (`return_progress`) and
    whose first pass over its prompt computed a chunk this step (`started`: when the step's
    forward began): set on the output of the chunk that ends the prompt (its first token);
    the other chunks' come back, each on a new output with no tokens."""
    asking = [s for s in scheduled if s.request.params.return_progress
              and s.start < s.request.num_prompt_tokens]
    if not asking:
        return []
    by_id = {o.request_id: o for o in outputs}
    now = time.perf_counter()
    extra: list[EngineCoreOutput] = []
    for s in asking:
        request, out = s.request, by_id.get(s.request.request_id)
        # a preempted request recomputing a prompt it has answered from reports nothing
        if request.num_output_tokens > (0 if out is None else len(out.new_token_ids)):
            continue
        if request.prompt_started is None:
            request.prompt_started = started
        progress = PromptProgress(
            request.num_prompt_tokens, request.num_cached_tokens,
            min(s.start + s.num_new_tokens, request.num_prompt_tokens),
            int((now - request.prompt_started) * 1000))
        if out is None:
            extra.append(EngineCoreOutput(request.request_id, [],
                                          num_cached_tokens=request.num_cached_tokens,
                                          prompt_progress=progress))
        else:
            out.prompt_progress = progress
    return extra
