"""llama-server's `prompt_progress`: asked with `"return_progress": true`, a stream sends one
chunk per prefill chunk of the prompt, each with no text and a top-level `prompt_progress`
object of four integers, as llama.cpp's server writes it (tools/server/server-task.cpp,
`result_prompt_progress::to_json`): `total` prompt tokens, `cache` (those served by the prefix
cache), `processed` (cached + computed so far, up to `total`), `time_ms` (since the prompt's
first chunk ran). llama-server sends them only in a stream; a request that is not streamed
ignores the field, here too (the engine is not even asked)."""

from __future__ import annotations

from nanoserve.protocol import PromptProgress


def progress_json(progress: PromptProgress) -> dict[str, int]:
    """The `prompt_progress` object, in llama-server's field order."""
    return {"total": progress.total, "cache": progress.cache, "processed": progress.processed,
            "time_ms": progress.time_ms}
