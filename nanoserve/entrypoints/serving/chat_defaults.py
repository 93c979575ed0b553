"""Sampling defaults for people: what the chat page and `nanoserve chat` start from.

The API keeps vLLM's defaults (temperature 1.0, no tail cut) under the model's generation config:
a program that calls it says what it wants. A person typing into a chat box says nothing, so the
chat starts from the model's own recommendation (generation_config.json, or a GGUF file's
`general.sampling.*` keys) when the model gives a temperature, and otherwise from a preset that
cuts the tail of the distribution, close to llama.cpp's chat defaults (temperature 0.8, top_p
0.95, min_p 0.05).

Measured on the default model (SmolLM2-135M-Instruct Q4_1, which names no sampling settings),
"What is the capital of France?", 24 tokens, 64 seeds: at the bare temperature 0.7 that
`nanoserve chat` used before, 24 of the 64 answers name Paris; with the preset below, 31; greedy
(temperature 0), none (it lists French place names). Every setting stays editable (the page's
fields, the CLI's flags).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# temperature 0.7 with top_p 0.95 and min_p 0.05: the unlikely tail, where small models' rambling
# starts, is never drawn, and answers still vary
PRESET = {"temperature": 0.7, "top_p": 0.95, "top_k": 0, "min_p": 0.05,
          "repetition_penalty": 1.0}
# what a model that recommends a temperature means by the settings it leaves out: no cut
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
DEFAULT_MAX_TOKENS = 1024  # a long answer; the context length caps it (page and CLI alike)


@dataclass(frozen=True)
class ChatDefaults:
    """The sampling settings a chat starts from, and where they came from."""

    temperature: float
    top_p: float
    top_k: int  # 0 = off
    min_p: float
    repetition_penalty: float
    max_tokens: int
    source: str  # "model": the model's generation config; "preset": PRESET (the model has none)

    def sampling(self) -> dict[str, Any]:
        """The settings alone, as request fields (without `source`)."""
        values = asdict(self)
        del values["source"]
        return values


def chat_defaults(generation_config: dict[str, Any], max_model_len: int | None = None
                  ) -> ChatDefaults:
    """The model's recommendation when it names a temperature (or `do_sample: false`, greedy),
    with no cut where it names none; else PRESET, under any other value the model gives (a
    repetition penalty alone is kept, with the preset's temperature). `max_tokens` is the model's
    `max_new_tokens`, else DEFAULT_MAX_TOKENS, at most half of `max_model_len` (room for the
    conversation)."""
    given = {name: generation_config[name] for name in PRESET
             if generation_config.get(name) is not None}
    if generation_config.get("do_sample") is False:
        given["temperature"] = 0.0
    base = NEUTRAL if "temperature" in given else PRESET
    values = {**base, **given}
    max_tokens = int(generation_config.get("max_new_tokens") or DEFAULT_MAX_TOKENS)
    if max_model_len is not None:
        max_tokens = max(1, min(max_tokens, max_model_len // 2))
    return ChatDefaults(temperature=float(values["temperature"]), top_p=float(values["top_p"]),
                        top_k=int(values["top_k"]), min_p=float(values["min_p"]),
                        repetition_penalty=float(values["repetition_penalty"]),
                        max_tokens=max_tokens, source="model" if base is NEUTRAL else "preset")


def describe(values: dict[str, Any], source: str) -> str:
    """One line naming the settings a chat runs with (those that cut nothing left out) and where
    its defaults came from."""
    shown = [f"temperature {values['temperature']:g}"]
    for name in ("top_p", "top_k", "min_p", "repetition_penalty"):
        if values[name] != NEUTRAL[name] and not (name == "top_k" and values[name] == -1):
            shown.append(f"{name} {values[name]:g}")
    shown.append(f"max_tokens {values['max_tokens']}")
    origin = "the model's defaults" if source == "model" else "the chat preset"
    return f"sampling: {', '.join(shown)} (from {origin}; flags change them)"
