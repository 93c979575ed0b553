"""The names this module held before it was split by concern, for importers outside the API
layer (`entrypoints/serve.py` takes `ServerContext` from here). Each lives in the module that
owns it now; import from there:

- `server_context.py`: ServerContext (model name and capacity checks)
- `request_params.py`: sampling_params (SamplingParams from the sampling fields)
- `token_limits.py`: resolve_max_tokens, check_prompt_ids
- `logprob_format.py`: MIN_LOGPROB, clamp_logprob, token_bytes, chosen, top_entries
- `usage.py`: usage
- `disconnect.py`: until_disconnect, collect
- `sse.py`: sse_with_errors (and sse_event)
"""

from nanoserve.entrypoints.openai.disconnect import collect, until_disconnect
from nanoserve.entrypoints.openai.logprob_format import (
    MIN_LOGPROB,
    chosen,
    clamp_logprob,
    token_bytes,
    top_entries,
)
from nanoserve.entrypoints.openai.request_params import sampling_params
from nanoserve.entrypoints.openai.server_context import ServerContext
from nanoserve.entrypoints.openai.sse import sse_with_errors
from nanoserve.entrypoints.openai.token_limits import check_prompt_ids, resolve_max_tokens
from nanoserve.entrypoints.openai.usage import usage

__all__ = [
    "MIN_LOGPROB", "ServerContext", "check_prompt_ids", "chosen", "clamp_logprob", "collect",
    "resolve_max_tokens", "sampling_params", "sse_with_errors", "token_bytes", "top_entries",
    "until_disconnect", "usage",
]
