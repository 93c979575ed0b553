"""Ollama's sampling options that this server does not implement: accepted at the value that
changes nothing, since clients send Ollama's defaults, and refused with a 400 naming the option
at any other, so a request never gets sampling other than what it asked for in silence.

- `typical_p` 1, `tfs_z` 1: locally typical and tail-free sampling are not implemented (vLLM
  has neither; llama.cpp has removed tail-free sampling).
- `mirostat` 0 (`mirostat_tau` and `mirostat_eta` are then unread): Mirostat is not implemented.
- `repeat_last_n` -1, or any value without a penalty: the penalties here never look at a window
  of the last N tokens (`repeat_penalty` covers the whole prompt and output, the presence and
  frequency penalties the output).
- `penalize_newline` true, or any value without a penalty: a newline is penalized as any token.

`num_keep` is accepted: it says what survives Ollama's context shift, and this server never
shifts a context (the output stops at its end).
"""

from __future__ import annotations

from nanoserve.entrypoints.ollama.protocol import OllamaOptions
from nanoserve.entrypoints.serving.errors import bad_request

WHOLE_CONTEXT = -1  # repeat_last_n: the penalties look back over everything


def check_sampling_options(options: OllamaOptions | None) -> None:
    """A 400 naming the first option set to a value that would change sampling here."""
    if options is None:
        return
    for name, neutral, what in (("typical_p", 1.0, "locally typical sampling"),
                                ("tfs_z", 1.0, "tail-free sampling"),
                                ("mirostat", 0, "Mirostat sampling")):
        value = getattr(options, name)
        if value is not None and value != neutral:
            raise bad_request(f"options.{name}={value:g} asks for {what}, which this server "
                              f"does not implement; send {neutral:g} (off) or leave it out",
                              f"options.{name}")
    if not _has_penalty(options):
        return
    window = options.repeat_last_n
    if window is not None and window != WHOLE_CONTEXT:
        raise bad_request(f"options.repeat_last_n={window} limits the penalties to the last "
                          f"{window} tokens, which this server does not implement: "
                          "repeat_penalty covers the whole prompt and output here, presence and "
                          "frequency penalties the output; send -1 or leave it out",
                          "options.repeat_last_n")
    if options.penalize_newline is False:
        raise bad_request("options.penalize_newline=false exempts newlines from the penalties, "
                          "which this server does not implement; send true or leave it out",
                          "options.penalize_newline")


def _has_penalty(options: OllamaOptions) -> bool:
    return any(value is not None and value != neutral for value, neutral in (
        (options.repeat_penalty, 1.0), (options.presence_penalty, 0.0),
        (options.frequency_penalty, 0.0)))
