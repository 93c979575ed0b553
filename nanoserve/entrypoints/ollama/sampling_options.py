"""Ollama's sampling options that this server does not implement: accepted at the value that
changes nothing, since clients send Ollama's defaults, and refused with a 400 naming the option
at any other, so a request never gets sampling other than what it asked for in silence.

- `tfs_z` 1: tail-free sampling is not implemented (vLLM lacks it; llama.cpp removed it).
- `penalize_newline` true, or any value without a penalty: a newline is penalized as any token.

Ollama's `typical_p`, `mirostat` (with `mirostat_tau`, `mirostat_eta`) and `repeat_last_n`
(64 where left out, as Ollama's) are run, as are llama-server's names for DRY, XTC and
top-n-sigma (serving/llama_sampler_fields.py). `num_keep` is accepted: it says what survives
Ollama's context shift, and this server never shifts a context (the output stops at its end).
"""

from __future__ import annotations

from nanoserve.entrypoints.ollama.protocol import OllamaOptions
from nanoserve.entrypoints.serving.errors import bad_request


def check_sampling_options(options: OllamaOptions | None) -> None:
    """A 400 naming the first option set to a value that would change sampling here."""
    if options is None:
        return
    if options.tfs_z is not None and options.tfs_z != 1.0:
        raise bad_request(f"options.tfs_z={options.tfs_z:g} asks for tail-free sampling, which "
                          "this server does not implement; send 1 (off) or leave it out",
                          "options.tfs_z")
    if options.penalize_newline is False and _has_penalty(options):
        raise bad_request("options.penalize_newline=false exempts newlines from the penalties, "
                          "which this server does not implement; send true or leave it out",
                          "options.penalize_newline")


def _has_penalty(options: OllamaOptions) -> bool:
    return any(value is not None and value != neutral for value, neutral in (
        (options.repeat_penalty, 1.0), (options.presence_penalty, 0.0),
        (options.frequency_penalty, 0.0)))
