"""SamplingParams: what a request asks of the sampler and the stop checks, with vLLM's defaults.

Every field is validated on construction; a bad value raises ValueError naming the field, the
value and what is allowed. Text-valued fields (`stop`, `bad_words`) are turned into token ids by
the frontend (`update_from_tokenizer`): only ids cross into the engine.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from nanoserve.dry_breakers import dry_breaker_token_ids
from nanoserve.reasoning_section import STARTS, ReasoningStart

SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM)
MIN_TEMPERATURE = 1e-2  # smaller positive temperatures are raised to this (vLLM)
MAX_LOGIT_BIAS = 100.0  # OpenAI's range; larger biases are clamped
MAX_LOGPROBS = 20  # the server's default cap on top-N logprobs
# The sampler keeps per-slot parameters in float32 and int64 tensors: a larger value (JSON
# allows 1e308) would fail in the engine's step and stop the engine for every request.
MAX_FLOAT32 = 3.4028234663852886e38
MAX_INT64 = 2**63 - 1
MAX_DRY_BREAKERS = 64  # each costs the API process a scan of the vocabulary (~10 ms) once
# generation_config.json keys that give request defaults (vLLM's `--generation-config auto`)
GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens",
    # a GGUF's llama.cpp sampling defaults (model/frontend.py names them so)
    **{name: name for name in ("repeat_last_n", "xtc_probability", "xtc_threshold", "mirostat",
                               "mirostat_tau", "mirostat_eta")},
}


STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """What the output must match (vLLM's `StructuredOutputsParams`): exactly one kind is set.

    The grammar itself is compiled in the engine (`nanoserve/structured/`); here only
    the shape of the request is checked, so a bad schema or regex is refused there, by name.
    """

    json: dict[str, Any] | str | None = None  # a JSON schema, as an object or its JSON text
    regex: str | None = None  # the whole output matches it
    choice: list[str] | None = None  # the whole output is one of these strings
    grammar: str | None = None  # a context-free grammar: GBNF (llama.cpp's EBNF) or Lark
    json_object: bool | None = None  # any JSON object (OpenAI's response_format json_object)
    disable_any_whitespace: bool = False  # JSON without whitespace between tokens
    whitespace_pattern: str | None = None  # JSON's whitespace as this regex (vLLM)
    # Set by a server with a --reasoning-parser (None: the grammar holds from the first token):
    # the grammar holds only after the reasoning section, which stays free text.
    # "inside": the output starts inside it; "opening": a first `<think>` opens it, any other
    # first token begins the answer (`reasoning_section.py`)
    after_reasoning: ReasoningStart | None = None

    def __post_init__(self) -> None:
        kinds = self.kinds_set
        _check(len(kinds) == 1, "structured_outputs", kinds,
               "exactly one of " + ", ".join(STRUCTURED_OUTPUT_KINDS))
        if self.json is not None:
            _check(isinstance(self.json, dict | str), "structured_outputs.json",
                   type(self.json).__name__, "a JSON schema (an object or its JSON text)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                _check(isinstance(value, str) and value != "", f"structured_outputs.{name}",
                       value, "a non-empty string")
        if self.choice is not None:
            _check(isinstance(self.choice, list) and len(self.choice) > 0
                   and all(isinstance(c, str) and c != "" for c in self.choice),
                   "structured_outputs.choice", self.choice,
                   "a non-empty list of non-empty strings")
        if self.whitespace_pattern is not None:
            _check(isinstance(self.whitespace_pattern, str),
                   "structured_outputs.whitespace_pattern", self.whitespace_pattern,
                   "a regular expression string")
        _check(self.after_reasoning is None or self.after_reasoning in STARTS,
               "structured_outputs.after_reasoning", self.after_reasoning,
               'null, "inside" or "opening"')

    @property
    def kinds_set(self) -> list[str]:
        """The names of the constraint fields that are set (one, once validated)."""
        return [name for name in STRUCTURED_OUTPUT_KINDS
                if getattr(self, name) is not None and getattr(self, name) is not False]

    @property
    def kind(self) -> str:
        """'json', 'regex', 'choice', 'grammar' or 'json_object'."""
        return self.kinds_set[0]


class RequestOutputKind(enum.IntEnum):
    """What each update of a request carries (vLLM's output_kind)."""

    CUMULATIVE = 0  # everything so far
    DELTA = 1  # only what is new since the last update
    FINAL_ONLY = 2  # one update, when the request finishes


@dataclass
class SamplingParams:
    """Per-request generation settings (vLLM's names, meanings and defaults)."""

    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    seed: int | None = None  # None = a fresh random seed for the request
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    min_tokens: int = 0
    max_tokens: int | None = 16  # None = up to the model's context length
    stop: list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logprobs: int | None = None  # top-N per sampled token (plus the sampled one)
    prompt_logprobs: int | None = None
    logprobs_mode: Literal["raw", "processed"] = "raw"
    thinking_token_budget: int | None = None
    extra_args: dict[str, Any] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None  # grammar the output must match
    # the frontend's: the output is a forced JSON list of calls, ended at an exact repeat
    # (output/repeats.py); the engine ignores it
    is_call_list: bool = False
    # vLLM's `cache_salt`: mixed into the first block's prefix-cache key, so only requests with
    # the same salt share cached blocks (a multi-user server's prompts cannot be probed by
    # timing); read by the engine's KV-cache manager and the data-parallel router
    cache_salt: str | None = None
    # llama-server's `return_progress`: the engine reports each prefill chunk of the prompt
    # (protocol.PromptProgress), which a stream sends as `prompt_progress`
    return_progress: bool = False
    # vLLM's request `priority` (its own argument there): with --scheduling-policy priority,
    # lower first, ties by arrival (engine/scheduler.py); 0 under fcfs
    priority: int = 0
    # llama.cpp's samplers, in llama-server's names and with its defaults, all off by default.
    # Where they act (nanoserve/sample/): DRY and the penalties' window on the logits with the
    # penalties (every row); top-n-sigma, typical-p, XTC and mirostat in the draw, so only at
    # temperature > 0 (temperature 0 is greedy, vLLM's meaning).
    # The penalties' window: None vLLM's (repetition over prompt and output, frequency and
    # presence over the output); N > 0 llama.cpp's (all three over the last N tokens of prompt
    # and output), -1 the whole context so, 0 no penalties
    repeat_last_n: int | None = None
    typical_p: float = 1.0
    top_n_sigma: float = -1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: list[str] | None = None  # None: llama.cpp's ["\n", ":", "\"", "*"]
    # filled by update_from_tokenizer (the frontend), read by the sampler
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)
    # DRY's breakers as token sequences [head, *tail] (llama.cpp's processed breakers)
    dry_breaker_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # a set in meaning (repeats dropped): a hostile list of 500,000 repeats would be scanned
        # every step
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids or []))
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self._validate()
        if 0 < self.temperature < MIN_TEMPERATURE and self.temperature >= SAMPLING_EPS:
            self.temperature = MIN_TEMPERATURE
        if self.temperature < SAMPLING_EPS:  # greedy: truncation means nothing
            self.temperature = 0.0
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
            self.typical_p, self.top_n_sigma, self.xtc_probability, self.mirostat = \
                1.0, -1.0, 0.0, 0
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias:
            self.logit_bias = {int(t): max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, float(b)))
                               for t, b in self.logit_bias.items()}

    def _validate(self) -> None:
        _check(self.n >= 1, "n", self.n, "an integer >= 1")
        _check(0.0 <= self.temperature <= MAX_FLOAT32, "temperature", self.temperature,
               ">= 0 (0 means greedy) and finite (at most 3.4e38)")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "in (0, 1]")
        _check(self.top_k >= -1, "top_k", self.top_k, "-1, 0 (off) or a positive integer")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, value, "in [-2, 2]")
        _check(0.0 < self.repetition_penalty <= MAX_FLOAT32, "repetition_penalty",
               self.repetition_penalty, "> 0 (1 means off) and finite (at most 3.4e38)")
        for name in ("n", "top_k", "min_tokens", "max_tokens", "logprobs", "prompt_logprobs",
                     "thinking_token_budget"):
            value = getattr(self, name)
            _check(value is None or value <= MAX_INT64, name, value, "a 64-bit integer")
        if self.seed is not None:
            _check(-(2**63) <= self.seed < 2**64, "seed", self.seed, "a 64-bit integer")
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, ">= 0")
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, "max_tokens", self.max_tokens, ">= 1")
            _check(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
                   f"<= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check(value >= 0, name, value, ">= 0")
        _check(self.logprobs_mode in ("raw", "processed"), "logprobs_mode", self.logprobs_mode,
               "'raw' or 'processed'")
        if self.thinking_token_budget is not None:
            _check(self.thinking_token_budget >= 0, "thinking_token_budget",
                   self.thinking_token_budget, ">= 0")
        if self.allowed_token_ids is not None:
            _check(len(self.allowed_token_ids) > 0, "allowed_token_ids", [],
                   "a non-empty list (omit it to allow every token)")
        for stop in self.stop or ():
            _check(isinstance(stop, str) and stop != "", "stop", stop, "non-empty strings")
        if self.cache_salt is not None:
            _check(isinstance(self.cache_salt, str) and self.cache_salt != "", "cache_salt",
                   self.cache_salt, "a non-empty string")
        _check(isinstance(self.return_progress, bool), "return_progress", self.return_progress,
               "true or false")
        _check(isinstance(self.priority, int) and -MAX_INT64 - 1 <= self.priority <= MAX_INT64,
               "priority", self.priority, "a 64-bit integer")
        self._validate_llama_samplers()
        if self.extra_args:  # they cross to the engine as msgpack, whose integers are 64-bit
            wide = _wide_int(self.extra_args)
            _check(wide is None, "extra_args", wide, "JSON whose integers fit in 64 bits")

    def _validate_llama_samplers(self) -> None:
        if self.repeat_last_n is not None:
            _check(-1 <= self.repeat_last_n <= MAX_INT64, "repeat_last_n", self.repeat_last_n,
                   "-1 (the whole context), 0 (no penalties) or a positive window")
        _check(0.0 < self.typical_p <= 1.0, "typical_p", self.typical_p, "in (0, 1] (1 is off)")
        _check(-MAX_FLOAT32 <= self.top_n_sigma <= MAX_FLOAT32, "top_n_sigma", self.top_n_sigma,
               "a finite number (<= 0 is off)")
        for name in ("xtc_probability", "xtc_threshold"):
            _check(0.0 <= getattr(self, name) <= 1.0, name, getattr(self, name), "in [0, 1]")
        _check(self.mirostat in (0, 1, 2), "mirostat", self.mirostat,
               "0 (off), 1 (Mirostat) or 2 (Mirostat 2.0)")
        for name in ("mirostat_tau", "mirostat_eta", "dry_multiplier"):
            _check(0.0 <= getattr(self, name) <= MAX_FLOAT32, name, getattr(self, name),
                   ">= 0 and finite")
        _check(1.0 <= self.dry_base <= MAX_FLOAT32, "dry_base", self.dry_base,
               ">= 1 and finite")
        _check(0 <= self.dry_allowed_length <= MAX_INT64, "dry_allowed_length",
               self.dry_allowed_length, ">= 0")
        _check(-1 <= self.dry_penalty_last_n <= MAX_INT64, "dry_penalty_last_n",
               self.dry_penalty_last_n, "-1 (the whole context), 0 (off) or a positive window")
        breakers = self.dry_sequence_breakers or []
        _check(len(breakers) <= MAX_DRY_BREAKERS, "dry_sequence_breakers", len(breakers),
               f"at most {MAX_DRY_BREAKERS} strings (each is matched against the vocabulary)")
        for breaker in breakers:
            _check(isinstance(breaker, str) and breaker != "", "dry_sequence_breakers", breaker,
                   "a list of non-empty strings")

    # -- derived ------------------------------------------------------------------------------
    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repeat_last_n != 0 and (
            self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0)

    @property
    def has_penalty_window(self) -> bool:
        """The penalties look at a window of prompt and output (llama.cpp's), not vLLM's."""
        return self.has_penalties and self.repeat_last_n is not None

    @property
    def uses_dry(self) -> bool:
        return self.dry_multiplier > 0.0 and self.dry_penalty_last_n != 0

    @property
    def uses_llama_draw(self) -> bool:
        """Top-n-sigma, typical-p, XTC or mirostat changes this request's draw."""
        return not self.is_greedy and (
            self.typical_p < 1.0 or self.top_n_sigma > 0.0 or self.mirostat != 0
            or (self.xtc_probability > 0.0 and self.xtc_threshold <= 0.5))

    @property
    def is_truncated(self) -> bool:
        """True when top-k, top-p or min-p cut the distribution before the draw."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def check_token_ids(self, vocab_size: int) -> None:
        """Refuse token ids outside the vocabulary, naming the field."""
        for name, ids in (("logit_bias", list(self.logit_bias or ())),
                          ("allowed_token_ids", self.allowed_token_ids or []),
                          ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            _check(not bad, name, bad[:1], f"token ids in [0, {vocab_size})")

    def check_limits(self, vocab_size: int, max_logprobs: int,
                     logprobs_field: str = "logprobs") -> None:
        """What the server's settings allow: token ids in the vocabulary, logprob counts up to
        --max-logprobs (`logprobs_field`: the client's name for the output's count, chat's
        top_logprobs). One check with one wording, run by the API when it builds the params
        and by the engine core when it admits them (a client of the engine's own)."""
        self.check_token_ids(vocab_size)
        for name, asked in ((logprobs_field, self.logprobs),
                            ("prompt_logprobs", self.prompt_logprobs)):
            _check(asked is None or asked <= max_logprobs, name, asked,
                   f"<= {max_logprobs} (--max-logprobs)")

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Tokenize `bad_words` as vLLM does: each word as written and with a leading space;
        with DRY on, turn its sequence breakers into token sequences (dry_breakers.py).

        vLLM keeps the spaced spelling only when it has as many tokens as the plain one, which
        lets " told" (one token) through when "told" is two; we ban every distinct spelling.
        """
        self.bad_words_token_ids = []
        for word in self.bad_words or ():
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if plain:
                self.bad_words_token_ids.append(plain)
            if spaced and spaced != plain:
                self.bad_words_token_ids.append(spaced)
        self.dry_breaker_token_ids = []
        if self.uses_dry:  # llama.cpp's processed breakers (a vocabulary scan, cached)
            self.dry_breaker_token_ids = dry_breaker_token_ids(tokenizer,
                                                               self.dry_sequence_breakers)

    @classmethod
    def from_generation_config(cls, generation_config: dict[str, Any],
                               **overrides: Any) -> SamplingParams:
        """The model's defaults (generation_config.json) under the caller's explicit values."""
        values = {ours: generation_config[theirs]
                  for theirs, ours in GENERATION_CONFIG_FIELDS.items()
                  if generation_config.get(theirs) is not None}
        if generation_config.get("do_sample") is False:
            values["temperature"] = 0.0
        known = {f.name for f in fields(cls)}
        values.update({k: v for k, v in overrides.items() if k in known and v is not None})
        return cls(**values)


def _wide_int(value: Any) -> int | None:
    """The first integer in `value` (nested lists and dicts) that msgpack cannot hold."""
    if isinstance(value, int) and not isinstance(value, bool):
        return None if -(2**63) <= value < 2**64 else value
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) \
        else ()
    for item in items:
        wide = _wide_int(item)
        if wide is not None:
            return wide
    return None


def _check(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
