"""Structured outputs: grammars compiled off the step loop, and one matcher per sequence.

A request's `StructuredOutputsParams` (JSON schema, regex, choice, GBNF/Lark grammar or any JSON
object) becomes a llguidance grammar. `GrammarCompiler.submit` compiles it on a worker thread,
cached by content, so a large schema never stalls the step loop; each sequence then gets its own
`GrammarMatcher` (a copy of the compiled template) that fills its row of the token bitmask
before a step and accepts the token drawn after it. Applying the bitmask to the logits is in
`bitmask.py`. llguidance's errors name the problem (`Unknown format: weird`, `unclosed group`);
we pass them on.

llguidance, not xgrammar (both are vLLM backends): a 130x smaller install (7.7 MB, no deps,
against triton's 999 MB), 10-200x faster compiles and no torch import. xgrammar fills masks 4-6x
faster, but that is 0.15 against 0.05 ms of a 50-90 ms decode step at 16 sequences. Figures in
docs/benchmarks.md, "Structured outputs: llguidance against xgrammar".
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance

from nanoserve.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:  # the API process checks grammars without torch; the engine fills masks
    import torch

WORKER_THREAD_PREFIX = "nanoserve-grammar"
# The grammar worker's nice value (the step loop's is 0): where the cores are all busy, the
# kernel gives a compile what the step loop leaves, so a large schema compiling does not slow
# the other requests' steps; the request waiting for it waits longer instead. Figures:
# docs/benchmarks.md, "Structured outputs: llguidance against xgrammar" (the nice value).
WORKER_NICE = 10
# Shown in llguidance's errors but ours, not the user's: source echoes and caret lines.
_ERROR_NOISE = re.compile(r"^\s*(\d+ \||\^+\s*$)")
_REGEX_POSITION = re.compile(r"^at \d+\(\d+\): (?=invalid regex)")
# vLLM's "any whitespace" between JSON tokens, in runs of at most 20 characters (a newline and
# the indent of a document pretty-printed 4-9 levels deep). Unbounded, the default model at
# temperature 0 wrote "[" and then newlines until max_tokens for 1 of the 17 schemas of
# tests/entrypoints/test_structured_outputs.py; bounded, all 17 stop by themselves at
# temperature 0 and 1.
JSON_WHITESPACE = r"[ \t\n\r]{0,20}"


class GrammarError(ValueError):
    """A grammar that cannot be compiled; `field` names the request field at fault."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} is not valid: {problem}")
        self.field = field
        self.problem = problem


def _field(params: StructuredOutputsParams) -> str:
    return f"structured_outputs.{params.kind}"


def _readable(message: str) -> str:
    """llguidance's multi-line error as one line, without its echo of the internal grammar."""
    lines = [line.strip() for line in message.splitlines()]
    text = " ".join(line for line in lines if line and not _ERROR_NOISE.match(line))
    return _REGEX_POSITION.sub("", text)  # a position in our wrapper grammar, not the user's


def grammar_spec(params: StructuredOutputsParams, value_text: str | None = None) -> str:
    """The llguidance grammar text for `params` (vLLM's guidance backend's choices).

    JSON allows any whitespace between tokens (in runs of at most 20: `JSON_WHITESPACE`)
    unless `disable_any_whitespace`, or the whitespace that `whitespace_pattern` matches; the
    GBNF-to-Lark conversion is Python and raises here. `value_text`: the JSON text of a dict
    schema when the caller has it (`content_key` made it), so it is not serialized again.
    """
    kind, field = params.kind, _field(params)
    if kind in ("json", "json_object"):
        schema: Any = {"type": "object"} if kind == "json_object" else params.json
        if kind == "json_object":
            value_text = None
        elif isinstance(schema, str):
            value_text = schema
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(field, f"not JSON text ({e})") from None
        if not isinstance(schema, dict):
            raise GrammarError(field, f"a JSON schema is an object, got {type(schema).__name__}")
        options: dict[str, Any] = ({"whitespace_flexible": False}
                                   if params.disable_any_whitespace
                                   else {"whitespace_pattern": JSON_WHITESPACE})
        if params.whitespace_pattern is not None:
            _check_regex(params.whitespace_pattern, "structured_outputs.whitespace_pattern")
            options = {"whitespace_pattern": params.whitespace_pattern}
        if "x-guidance" in schema:  # the schema's own options win: let llguidance merge them
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)  # type: ignore[arg-type]
        return json_schema_spec(value_text or json.dumps(schema), options)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex or "")
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(params.choice))
    try:  # GBNF (llama.cpp's EBNF) or Lark: llguidance tells them apart
        return llguidance.grammar_from("grammar", params.grammar or "")
    except ValueError as e:
        raise GrammarError(field, _readable(str(e))) from None


def json_schema_spec(schema_text: str, options: dict[str, Any]) -> str:
    """What `LLMatcher.grammar_from_json_schema(schema, defaults=options)` returns, written
    around the schema's JSON text (an object without "x-guidance") instead of walking the
    Python dict: that walk holds the GIL (5 ms for a 1,200-property schema, the step loop
    waiting on it), the string join takes microseconds."""
    body = schema_text.strip()
    assert body.startswith("{") and body.endswith("}"), "the JSON text of an object"
    rest = body[1:].strip()
    schema = '{"x-guidance":' + json.dumps(options) + ("," if rest != "}" else "") + rest
    return '{"grammars":[{"name":"json_schema","json_schema":' + schema + "}]}"


def _check_regex(pattern: str, field: str) -> None:
    message = llguidance.LLMatcher.validate_grammar(
        llguidance.LLMatcher.grammar_from_regex(pattern))
    if message:
        raise GrammarError(field, _readable(message))


def check_grammar(params: StructuredOutputsParams,
                  tokenizer: GrammarTokenizer | None = None) -> None:
    """Refuse a grammar that cannot compile, without compiling it (for the API server). Only
    a check with the model's `tokenizer` refuses a GBNF/Lark grammar that names a token the
    model lacks (`<|no_such_token|>`, `<[99999999]>`), which would otherwise fail in the engine;
    it costs what the check without one costs (0.5 ms for a small grammar, 45-55 ms for a
    1,200-property schema on the dev machine)."""
    ll_tokenizer = None if tokenizer is None else tokenizer.get()
    message = llguidance.LLMatcher.validate_grammar(grammar_spec(params), ll_tokenizer)
    if message:
        raise GrammarError(_field(params), _readable(message))


def content_key(params: StructuredOutputsParams) -> str:
    """Equal for requests whose grammars are equal (the JSON schema's key order counts: it is
    the order the properties are written in): the kind and options as JSON, a newline, then
    the value's text (a dict or list as JSON, which the compile reuses)."""
    value = getattr(params, params.kind)
    value_text = value if isinstance(value, str) else json.dumps(value)
    options = json.dumps([params.kind, params.disable_any_whitespace, params.whitespace_pattern])
    return options + "\n" + value_text


class GrammarMatcher:
    """One sequence's place in its grammar: fills its bitmask row, accepts its drawn tokens."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher
        self.num_accepted = 0  # tokens accepted since the start (what rollback can undo)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (int32 words, bit i of word w =
        token 32 * w + i; a terminated matcher allows only EOS)."""
        import torch  # loaded already in the engine, the only process that fills masks

        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2:
            raise ValueError("the bitmask must be a 2-D int32 CPU tensor")
        words = bitmask[row]
        if not words.is_contiguous():
            raise ValueError("bitmask rows must be contiguous")
        # llguidance writes straight into the row (and drops the GIL while it computes)
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)

    def accept(self, token_id: int) -> bool:
        """Advance by one drawn token; False (and an error state) if the grammar forbids it."""
        if not self._matcher.consume_token(token_id):
            return False
        self.num_accepted += 1
        return True

    def copy(self) -> GrammarMatcher:
        """An independent matcher at the same place (~20 µs): draft tokens are tried on a copy,
        since llguidance's rollback does not restore a matcher that an EOS stopped."""
        copied = GrammarMatcher(self._matcher.deep_copy())
        copied.num_accepted = self.num_accepted
        return copied

    def is_terminated(self) -> bool:
        """True when the grammar is complete and allows nothing more (the request stops)."""
        return self._matcher.is_stopped()

    def is_accepting(self) -> bool:
        """True when the output so far is a whole match (EOS is allowed next)."""
        return self._matcher.is_accepting()

    @property
    def error(self) -> str:
        """Why the matcher stopped on a forbidden token; empty while all is well."""
        return self._matcher.get_error()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative drafts, stop-string trims)."""
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"can roll back 0..{self.num_accepted} tokens, not {num_tokens}")
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise RuntimeError(f"grammar rollback failed: {self.error}")
        self.num_accepted -= num_tokens

    def reset(self, token_ids: Sequence[int] = ()) -> bool:
        """Back to the grammar's start, then accept `token_ids` (a sequence whose outputs are
        recomputed keeps its matcher; this rebuilds one that was lost). False if refused."""
        self._matcher.reset()
        self.num_accepted = 0
        return all(self.accept(t) for t in token_ids)


@dataclass(frozen=True)
class CompiledGrammar:
    """A compiled grammar, shared by every sequence that asks for the same content."""

    key: str
    template: llguidance.LLMatcher  # never advanced: each sequence gets a copy
    compile_seconds: float
    compiled_by: str  # the thread's name (the worker's, never the step loop's)

    def new_matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start (a ~20 µs copy; compiling again is ~1.4 ms)."""
        return GrammarMatcher(self.template.deep_copy())


def _lower_priority(nice: int) -> None:
    """Add `nice` to the calling (worker) thread's nice value (Linux schedules threads one by
    one; elsewhere this may lower the whole process, so it is left alone)."""
    if not sys.platform.startswith("linux"):
        return
    thread = threading.get_native_id()
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, thread,
                       min(19, os.getpriority(os.PRIO_PROCESS, thread) + nice))


class GrammarTokenizer:
    """llguidance's tokenizer for a Hugging Face one, built by the first `get` (0.3-1 s, once),
    so start-up does not wait for it. `vocab_size` is the width of the model's logits rows
    (may exceed the tokenizer's); no `eos_token_ids`: the tokenizer's own EOS."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._built: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def get(self) -> llguidance.LLTokenizer:
        """The llguidance tokenizer (thread-safe; built on the caller's thread if need be)."""
        with self._lock:
            if self._built is None:
                self._built = _ll_tokenizer(self._hf_tokenizer, self.vocab_size,
                                            self.eos_token_ids)
            return self._built


def _ll_tokenizer(tokenizer: Any, vocab_size: int,
                  eos_token_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """What `llguidance.hf.from_tokenizer` builds, from anything with a `backend_tokenizer`
    (a transformers fast tokenizer, or the engine's `EngineTokenizer`) and without importing
    transformers: the pipeline serialized (padding and truncation off), and the EOS."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("structured outputs need a fast (Rust `tokenizers`) tokenizer")
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    eos = list(eos_token_ids) or tokenizer.eos_token_id
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos)


class GrammarCompiler:
    """Compiles grammars on a worker thread, cached by content (LRU over `max_cached`).

    Built from the tokenizer once; llguidance's own (`GrammarTokenizer`) is made by the first
    compile, on the worker. The worker runs at a lower priority (`worker_nice`, see
    `WORKER_NICE`).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                 max_workers: int = 1, max_cached: int = 256,
                 worker_nice: int = WORKER_NICE) -> None:
        self.tokenizer = GrammarTokenizer(tokenizer, vocab_size, eos_token_ids)
        self.max_cached = max_cached
        self._cache: OrderedDict[str, Future[CompiledGrammar]] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix=WORKER_THREAD_PREFIX,
                                            initializer=_lower_priority,
                                            initargs=(worker_nice,))

    def submit(self, params: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """The compiled grammar for `params`, now if cached, else when the worker is done. A
        bad grammar's future raises `GrammarError` naming the field."""
        key = content_key(params)
        with self._cache_lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._executor.submit(self._compile, key, params)
            self._cache[key] = future
            if len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
            return future

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """`submit` and wait (for callers off the step loop, and tests)."""
        return self.submit(params).result()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _compile(self, key: str, params: StructuredOutputsParams) -> CompiledGrammar:
        start = time.perf_counter()
        spec = grammar_spec(params, value_text=key.split("\n", 1)[1])
        # building the matcher is the compile (llguidance drops the GIL for most of it: a
        # thread beside it was kept waiting 5% of the time, at most 3 ms at once)
        template = llguidance.LLMatcher(self.tokenizer.get(), spec, log_level=0)
        if template.is_error():
            raise GrammarError(_field(params), _readable(template.get_error()))
        return CompiledGrammar(key, template, time.perf_counter() - start,
                               threading.current_thread().name)
