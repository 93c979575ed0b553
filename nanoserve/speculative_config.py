"""`--speculative-config` / `LLM(speculative_config=...)`, as vLLM spells it: a JSON object with
a `method` and that method's fields; absent means no speculation. Bad values fail at start-up
with a message naming the field, the value and what is allowed.

The methods: `ngram` and `suffix` draft without a model (nanoserve/spec/); `mtp` runs the
checkpoint's own multi-token-prediction head (Qwen3.5's `mtp.*`: engine/mtp_drafter.py). vLLM's
older per-model names for it (`qwen3_next_mtp`, ...) are read as `mtp`, as vLLM reads them."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

_COMMON = ("method", "num_speculative_tokens")
METHOD_FIELDS = {  # the fields each method reads (vLLM's names)
    "ngram": (*_COMMON, "prompt_lookup_min", "prompt_lookup_max"),
    "suffix": (*_COMMON, "suffix_decoding_max_tree_depth", "suffix_decoding_max_spec_factor",
               "suffix_decoding_min_token_prob", "suffix_decoding_max_cached_requests"),
    "mtp": _COMMON,
}
# vLLM's per-model names of its MTP method, which it maps to "mtp"
MTP_ALIASES = ("qwen3_next_mtp", "qwen3_5_mtp", "qwen3_5_moe_mtp")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """A proposer and its settings: a model-free one (nanoserve/spec/) or the model's own MTP
    head (`mtp`)."""

    method: str
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 3
    prompt_lookup_max: int = 5
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # past outputs matched across requests of one tenant (API key); 0 = off (vLLM: 10000)
    suffix_decoding_max_cached_requests: int = 0

    def __post_init__(self) -> None:
        if self.method not in METHOD_FIELDS:
            raise ValueError(f"speculative_config.method must be one of "
                             f"{', '.join(METHOD_FIELDS)}, got {self.method!r}")
        _check_range("num_speculative_tokens", self.num_speculative_tokens, 1,
                     MAX_SPECULATIVE_TOKENS)
        _check_range("prompt_lookup_min", self.prompt_lookup_min, 1, 64)
        _check_range("prompt_lookup_max", self.prompt_lookup_max, self.prompt_lookup_min, 64)
        _check_range("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth, 2,
                     1024)
        if not 0.0 < self.suffix_decoding_max_spec_factor <= 64.0:
            raise ValueError("speculative_config.suffix_decoding_max_spec_factor must be in "
                             f"(0, 64], got {self.suffix_decoding_max_spec_factor}")
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0:
            raise ValueError("speculative_config.suffix_decoding_min_token_prob must be in "
                             f"[0, 1], got {self.suffix_decoding_min_token_prob}")
        _check_range("suffix_decoding_max_cached_requests",
                     self.suffix_decoding_max_cached_requests, 0, 100_000)

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig | None
              ) -> SpeculativeConfig | None:
        """The config of a flag's JSON text, a dict or a config (None: no speculation)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config must be a JSON object: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be an object, got {value!r}")
        if value.get("method") in MTP_ALIASES:
            value = {**value, "method": "mtp"}
        method = value.get("method")
        if method not in METHOD_FIELDS:
            raise ValueError(f"speculative_config.method must be one of "
                             f"{', '.join(METHOD_FIELDS)}, got {method!r}")
        allowed = METHOD_FIELDS[method]
        for key in value:
            if key not in allowed:
                raise ValueError(f"speculative_config.{key} is not a field of method "
                                 f"{method!r}; its fields: {', '.join(allowed)}")
        types = {f.name: f.type for f in fields(cls)}
        for key, given in value.items():
            wanted = float if types[key] == "float" else int if types[key] == "int" else str
            if isinstance(given, bool) or not isinstance(given, (wanted, int) if wanted is float
                                                         else wanted):
                raise ValueError(f"speculative_config.{key} must be {wanted.__name__}, "
                                 f"got {given!r}")
        return cls(**value)


def uses_mtp(spec: Any) -> bool:
    """Whether a scheduler's `draft_proposer` (a config, or its dict as msgpack brings it to
    an engine process) asks for the model's MTP head."""
    if isinstance(spec, SpeculativeConfig):
        return spec.method == "mtp"
    return isinstance(spec, dict) and spec.get("method") == "mtp"


def _check_range(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise ValueError(f"speculative_config.{name} must be in [{low}, {high}], got {value}")
