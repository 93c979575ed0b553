"""Structured outputs with the real tokenizer and llguidance: whatever the mask lets through is
valid, bad grammars are refused by field, compiles are cached by content and run off-thread."""

from __future__ import annotations

import json
import os
import re
import sys
import threading
from typing import Any

import jsonschema
import llguidance
import pytest
import torch

from nanoserve.protocol import EngineRequest, decode_input, encode
from nanoserve.sampling_params import SamplingParams, StructuredOutputsParams
from nanoserve.structured.bitmask import (
    allocate_bitmask,
    apply_bitmask,
    fill_bitmask_rows,
)
from nanoserve.structured.grammar import (
    WORKER_THREAD_PREFIX,
    CompiledGrammar,
    GrammarCompiler,
    GrammarError,
    GrammarMatcher,
    check_grammar,
    content_key,
    grammar_spec,
)

VOCAB = 49152
EOS = 2  # <|im_end|>
Params = StructuredOutputsParams


@pytest.fixture(scope="module")
def compiler(default_tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler(default_tokenizer, VOCAB, [EOS])


def allowed_ids(bitmask: torch.Tensor, row: int = 0) -> set[int]:
    words = bitmask[row].tolist()
    return {32 * w + b for w, word in enumerate(words) for b in range(32) if (word >> b) & 1}


def random_walk(compiled: CompiledGrammar, seed: int, max_steps: int = 300) -> list[int]:
    """Draw tokens from random logits masked by the grammar until it ends (EOS or complete)."""
    matcher = compiled.new_matcher()
    gen = torch.Generator().manual_seed(seed)
    bitmask = allocate_bitmask(1, VOCAB)
    token_ids: list[int] = []
    for _ in range(max_steps):
        if matcher.is_terminated():
            return token_ids
        matcher.fill_bitmask(bitmask, 0)
        logits = torch.randn(1, VOCAB, generator=gen)
        apply_bitmask(logits, bitmask)
        token = int(logits.argmax())
        assert matcher.accept(token), matcher.error
        if token == EOS:
            assert matcher.is_terminated()
            return token_ids
        token_ids.append(token)
    raise AssertionError(f"no end after {max_steps} tokens")


BOUNDED_SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 130}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {
        "status": {"enum": ["draft", "published", "archived"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "is_public": {"type": "boolean"},
        "owner": {"type": "object", "properties": {"id": {"type": "integer", "maximum": 99,
                                                          "minimum": 0}},
                  "required": ["id"], "additionalProperties": False}},
     "required": ["status", "tags", "is_public", "owner"], "additionalProperties": False},
    {"$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -9, "maximum": 9},
        "y": {"type": "integer", "minimum": -9, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}},
     "type": "object", "properties": {"path": {"type": "array", "items": {"$ref": "#/$defs/point"},
                                               "minItems": 1, "maxItems": 3},
                                      "label": {"anyOf": [{"type": "null"},
                                                          {"const": "closed"}]}},
     "required": ["path", "label"], "additionalProperties": False},
]


@pytest.mark.parametrize("schema", BOUNDED_SCHEMAS)
@pytest.mark.parametrize("whitespace", [{"disable_any_whitespace": True},
                                        {"whitespace_pattern": r"[ \n]?"}])
def test_drawn_json_validates_against_its_schema(compiler: GrammarCompiler,
                                                 default_tokenizer: Any, schema: dict[str, Any],
                                                 whitespace: dict[str, Any]) -> None:
    compiled = compiler.compile(Params(json=schema, **whitespace))
    for seed in range(6):
        text = default_tokenizer.decode(random_walk(compiled, seed))
        jsonschema.validate(json.loads(text), schema)
        if whitespace.get("disable_any_whitespace"):
            assert not re.search(r"\s", text.replace(" ", "")), text


def test_schema_given_as_json_text(compiler: GrammarCompiler, default_tokenizer: Any) -> None:
    schema = BOUNDED_SCHEMAS[0]
    compiled = compiler.compile(Params(json=json.dumps(schema), disable_any_whitespace=True))
    text = default_tokenizer.decode(random_walk(compiled, 0))
    jsonschema.validate(json.loads(text), schema)


def test_any_whitespace_accepts_formatted_documents(compiler: GrammarCompiler,
                                                    default_tokenizer: Any) -> None:
    """The default (vLLM's any whitespace) takes json.dumps's and indented spellings alike."""
    schema = {"type": "object", "properties": {"a": {"type": "number"},
                                               "b": {"type": "array"}}, "required": ["a", "b"]}
    doc = {"a": -1.5e3, "b": [1, "two", None, {"c": True}]}
    spellings = (json.dumps(doc), json.dumps(doc, indent=2), json.dumps(doc, separators=(",", ":")))
    for text in spellings:
        for params in (Params(json=schema), Params(json_object=True)):
            matcher = compiler.compile(params).new_matcher()
            bitmask = allocate_bitmask(1, VOCAB)
            for token in default_tokenizer.encode(text):
                matcher.fill_bitmask(bitmask, 0)
                assert token in allowed_ids(bitmask), (text, token)
                assert matcher.accept(token)
            assert matcher.is_accepting()


def test_any_whitespace_comes_in_bounded_runs(compiler: GrammarCompiler,
                                              default_tokenizer: Any) -> None:
    """At most 20 whitespace characters between two JSON tokens: a model that would rather
    write newlines forever must get on with the document."""
    def accepts(text: str) -> bool:
        matcher = compiler.compile(Params(json_object=True)).new_matcher()
        return all(matcher.accept(t) for t in default_tokenizer.encode(text))

    assert accepts('{\n' + ' ' * 19 + '"a":\t\r\n 1}')
    assert not accepts('{\n' + ' ' * 20 + '"a": 1}')
    assert not accepts('{"a": [' + '\n' * 21)


def test_json_object_must_start_an_object(compiler: GrammarCompiler,
                                          default_tokenizer: Any) -> None:
    bitmask = allocate_bitmask(1, VOCAB)
    compiler.compile(Params(json_object=True)).new_matcher().fill_bitmask(bitmask, 0)
    texts = {default_tokenizer.decode([t]) for t in allowed_ids(bitmask)}
    assert texts and all(t.lstrip().startswith("{") or t.strip() == "" for t in texts)
    assert "[" not in texts and EOS not in allowed_ids(bitmask)


@pytest.mark.parametrize("pattern", [r"[a-z]{1,8}@[a-z]{2,6}\.(com|org)",
                                     r"(\d{3}-){2}\d{4}", r"(yes|no|maybe)!?"])
def test_drawn_text_fullmatches_the_regex(compiler: GrammarCompiler, default_tokenizer: Any,
                                          pattern: str) -> None:
    compiled = compiler.compile(Params(regex=pattern))
    for seed in range(8):
        text = default_tokenizer.decode(random_walk(compiled, seed))
        assert re.fullmatch(pattern, text), (pattern, text)


def test_drawn_text_is_one_of_the_choices(compiler: GrammarCompiler,
                                          default_tokenizer: Any) -> None:
    choices = ["yes", "yes please", "no", 'a "quoted" one', "café ☕", "1+1=2", "[x]"]
    compiled = compiler.compile(Params(choice=choices))
    seen = {default_tokenizer.decode(random_walk(compiled, seed)) for seed in range(40)}
    assert seen <= set(choices) and len(seen) >= 3


@pytest.mark.parametrize("grammar", [
    'root ::= greeting " " name\ngreeting ::= "hello" | "hi"\nname ::= [a-z]{1,5}',  # GBNF
    'start: greeting " " NAME\ngreeting: "hello" | "hi"\nNAME: /[a-z]{1,5}/',  # Lark
])
def test_drawn_text_is_in_the_grammars_language(compiler: GrammarCompiler,
                                                default_tokenizer: Any, grammar: str) -> None:
    compiled = compiler.compile(Params(grammar=grammar))
    for seed in range(8):
        text = default_tokenizer.decode(random_walk(compiled, seed))
        assert re.fullmatch(r"(hello|hi) [a-z]{1,5}", text), text


@pytest.mark.parametrize("params,field,problem", [
    (Params(json={"type": "foo"}), "structured_outputs.json", "Invalid type: foo"),
    (Params(json={"type": "string", "format": "weird"}), "structured_outputs.json",
     "Unknown format: weird"),
    (Params(json={"properties": {"a": {"$ref": "#/nope"}}}), "structured_outputs.json", "/nope"),
    (Params(json={"not": {"type": "string"}}), "structured_outputs.json", "not"),
    (Params(json={"type": "string", "minLength": 3, "maxLength": 1}), "structured_outputs.json",
     "minLength"),
    (Params(json="{not json"), "structured_outputs.json", "not JSON text"),
    (Params(json="[1, 2]"), "structured_outputs.json", "a JSON schema is an object"),
    (Params(regex="(ab"), "structured_outputs.regex", "unclosed group"),
    (Params(grammar="root ::= missing"), "structured_outputs.grammar", "missing"),
    (Params(grammar="start: x"), "structured_outputs.grammar", "unknown name"),
    # tokens the model lacks: refused only by a check with its tokenizer
    (Params(grammar="start: <|no_such_token|>"), "structured_outputs.grammar",
     "unknown special token"),
    (Params(grammar="start: <[1-99999999]>"), "structured_outputs.grammar", "too large"),
    (Params(json_object=True, whitespace_pattern="(["), "structured_outputs.whitespace_pattern",
     "unclosed"),
])
def test_bad_grammars_are_refused_naming_the_field(compiler: GrammarCompiler, params: Params,
                                                   field: str, problem: str) -> None:
    def api_check(params: Params) -> None:  # the API server's, with the model's tokenizer
        check_grammar(params, compiler.tokenizer)

    for check in (api_check, compiler.compile):  # in the API server, and in the engine
        with pytest.raises(GrammarError) as info:
            check(params)
        assert isinstance(info.value, ValueError) and info.value.field == field
        assert str(info.value).startswith(f"{field} is not valid: ") and problem in str(info.value)
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("fields,message", [
    ({}, "structured_outputs must be exactly one of json, regex, choice, grammar, json_object"),
    ({"regex": "a", "choice": ["a"]}, "got ['regex', 'choice']"),
    ({"json_object": False}, "got []"),
    ({"choice": []}, "structured_outputs.choice must be a non-empty list"),
    ({"choice": ["a", ""]}, "structured_outputs.choice must be a non-empty list"),
    ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
    ({"json": 3}, "structured_outputs.json must be a JSON schema"),
])
def test_params_need_exactly_one_valid_kind(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        Params(**fields)
    assert message in str(info.value)


def test_sampling_params_carry_structured_outputs_across_the_process_boundary() -> None:
    schema = {"type": "object", "properties": {"z": {}, "a": {}}}  # key order is meaning
    for so in (Params(json=schema, disable_any_whitespace=True), Params(choice=["x", "y"]),
               None):
        request = EngineRequest("r", [1, 2], SamplingParams(structured_outputs=so), 0)
        decoded = decode_input(encode(request))
        assert isinstance(decoded, EngineRequest)
        assert decoded.params.structured_outputs == so
    params = SamplingParams(structured_outputs={"regex": "a+"})  # type: ignore[arg-type]
    assert params.structured_outputs == Params(regex="a+")
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a", "grammar": "b"})  # type: ignore[arg-type]


def test_equal_content_compiles_once_on_the_worker_thread(default_tokenizer: Any) -> None:
    compiler = GrammarCompiler(default_tokenizer, VOCAB, [EOS])
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    future = compiler.submit(Params(json=schema))
    first = future.result()
    assert first.compiled_by.startswith(WORKER_THREAD_PREFIX)
    assert first.compiled_by != threading.current_thread().name
    assert compiler.submit(Params(json=json.loads(json.dumps(schema)))).result() is first
    assert compiler.compile(Params(json=schema)) is first
    # different content: the whitespace rule, the key order, the kind
    others = [Params(json=schema, disable_any_whitespace=True),
              Params(json={"properties": schema["properties"], "type": "object"}),
              Params(regex="a"), Params(grammar='root ::= "a"'), Params(choice=["a"])]
    compiled = [compiler.compile(p) for p in others]
    assert len({id(c) for c in [first, *compiled]}) == len(others) + 1
    compiler.close()


def test_the_cache_forgets_the_least_recently_used(default_tokenizer: Any) -> None:
    compiler = GrammarCompiler(default_tokenizer, VOCAB, [EOS], max_cached=2)
    a, b, c = (Params(regex=r) for r in ("a", "b", "c"))
    first_a = compiler.compile(a)
    compiler.compile(b)
    assert compiler.compile(a) is first_a  # a is now the most recent
    compiler.compile(c)  # b goes
    assert compiler.compile(a) is first_a
    compiler.close()


def test_matchers_of_one_grammar_are_independent(compiler: GrammarCompiler,
                                                 default_tokenizer: Any) -> None:
    """n > 1 and preempted sequences: each sequence's matcher moves alone."""
    compiled = compiler.compile(Params(choice=["alpha", "beta"]))
    one, two = compiled.new_matcher(), compiled.new_matcher()
    bitmask = allocate_bitmask(2, VOCAB)
    for token in default_tokenizer.encode("beta"):
        assert one.accept(token)
    fill_bitmask_rows([(one, 0), (two, 1)], bitmask)
    assert allowed_ids(bitmask, 0) == {EOS} and one.is_terminated()
    assert EOS not in allowed_ids(bitmask, 1) and not two.is_terminated()


def test_rollback_and_reset_return_to_earlier_masks(compiler: GrammarCompiler,
                                                    default_tokenizer: Any) -> None:
    matcher = compiler.compile(Params(json=BOUNDED_SCHEMAS[0])).new_matcher()
    token_ids = default_tokenizer.encode('{"name": "Ann", "age": 7}')
    masks = []
    bitmask = allocate_bitmask(1, VOCAB)
    for token in token_ids:
        matcher.fill_bitmask(bitmask, 0)
        masks.append(bitmask.clone())
        assert matcher.accept(token)
    assert matcher.is_terminated() and matcher.num_accepted == len(token_ids)
    matcher.rollback(4)
    matcher.fill_bitmask(bitmask, 0)
    assert torch.equal(bitmask, masks[-4]) and not matcher.is_terminated()
    with pytest.raises(ValueError, match=r"can roll back 0\.\."):
        matcher.rollback(len(token_ids))
    assert matcher.reset(token_ids[:3])  # a preempted sequence's matcher rebuilt
    matcher.fill_bitmask(bitmask, 0)
    assert torch.equal(bitmask, masks[3]) and matcher.num_accepted == 3
    assert matcher.reset()
    matcher.fill_bitmask(bitmask, 0)
    assert torch.equal(bitmask, masks[0])


def test_a_forbidden_token_is_refused(compiler: GrammarCompiler, default_tokenizer: Any) -> None:
    matcher: GrammarMatcher = compiler.compile(Params(regex=r"\d+")).new_matcher()
    assert not matcher.accept(default_tokenizer.encode("x")[0])
    assert matcher.error


def test_every_eos_id_ends_an_accepting_grammar(default_tokenizer: Any) -> None:
    compiler = GrammarCompiler(default_tokenizer, VOCAB, [EOS, 0])
    matcher = compiler.compile(Params(regex=r"\d+")).new_matcher()
    assert matcher.accept(default_tokenizer.encode("7")[0]) and matcher.is_accepting()
    bitmask = allocate_bitmask(1, VOCAB)
    matcher.fill_bitmask(bitmask, 0)
    assert {EOS, 0} <= allowed_ids(bitmask)
    compiler.close()


def reference_apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    for r in rows:
        for t in range(logits.shape[1]):
            word = t // 32
            if word >= bitmask.shape[1] or not (int(bitmask[r, word]) >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize("rows", [None, [1, 3], []])
@pytest.mark.parametrize("vocab", [96, 100, 130])  # 130: logits wider than the 128-bit mask
def test_apply_bitmask_forbids_exactly_the_cleared_bits(rows: list[int] | None,
                                                        vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(4, vocab, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, 4), dtype=torch.int32, generator=gen)
    bitmask[0] = -1  # all allowed
    bitmask[2] = 0  # none allowed
    want = reference_apply(logits, bitmask, list(range(4)) if rows is None else rows)
    apply_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_apply_bitmask_on_cuda_equals_the_cpu() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(16, VOCAB + 64, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (16, VOCAB // 32), dtype=torch.int32,
                            generator=gen)
    for rows in (None, [0, 5, 15]):
        on_cpu, on_gpu = logits.clone(), logits.cuda()
        apply_bitmask(on_cpu, bitmask, rows)
        apply_bitmask(on_gpu, bitmask.pin_memory(), rows)
        assert torch.equal(on_gpu.cpu(), on_cpu)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_the_worker_runs_below_the_step_loop(default_tokenizer: Any) -> None:
    compiler = GrammarCompiler(default_tokenizer, VOCAB, [EOS], worker_nice=5)
    compiler.compile(Params(choice=["a"]))
    here = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    workers = [t for t in threading.enumerate() if t.name.startswith(WORKER_THREAD_PREFIX)]
    assert workers and here == os.getpriority(os.PRIO_PROCESS, 0)
    for worker in workers:  # this compiler's (nice + 5) and the module's (nice + 10)
        assert worker.native_id is not None
        assert os.getpriority(os.PRIO_PROCESS, worker.native_id) >= min(19, here + 5)
    compiler.close()


@pytest.mark.parametrize("params", [
    Params(json=BOUNDED_SCHEMAS[1]), Params(json=json.dumps(BOUNDED_SCHEMAS[2], indent=2)),
    Params(json={"type": "object"}, disable_any_whitespace=True), Params(json_object=True),
    Params(json={"properties": {}}, whitespace_pattern=" ?"),
])
def test_json_spec_equals_llguidances_own(params: Params) -> None:
    """The spec written around the schema's text is what llguidance's builder makes."""
    ours = json.loads(grammar_spec(params, content_key(params).split("\n", 1)[1]))
    schema = json.loads(params.json) if isinstance(params.json, str) else params.json
    options = json.loads(grammar_spec(params))["grammars"][0]["json_schema"]["x-guidance"]
    theirs = json.loads(llguidance.LLMatcher.grammar_from_json_schema(
        schema or {"type": "object"}, defaults=options))
    assert ours["grammars"][0]["json_schema"] == theirs["grammars"][0]["json_schema"]


def test_a_required_call_list_may_end_after_each_complete_call(compiler: GrammarCompiler,
                                                               default_tokenizer: Any) -> None:
    """The grammar `tool_choice="required"` sends: after every complete call, `]` (and then
    EOS) is allowed, so the model can always end the list; a call cut short cannot end it."""
    from nanoserve.entrypoints.serving.chat_input import ToolFunction, ToolInput
    from nanoserve.entrypoints.serving.tool_plan import TOOL_JSON_WHITESPACE, required_schema

    tools = [ToolInput(ToolFunction(name, None, {"type": "object", "properties": {
        "x": {"type": "string"}}}), {}) for name in ("a", "b", "c")]
    compiled = compiler.compile(Params(json=required_schema(tools),
                                       whitespace_pattern=TOOL_JSON_WHITESPACE))
    calls = ['{"name": "a", "parameters": {"x": "1"}}', '{"name": "c", "parameters": {}}',
             '{"name": "a", "parameters": {"x": "2"}}']
    def accepted(text: str) -> bool:
        matcher = compiled.new_matcher()
        ids = default_tokenizer.encode(text, add_special_tokens=False)
        assert all(matcher.accept(t) for t in ids), text
        return matcher.is_accepting()

    for count in range(1, len(calls) + 1):
        listed = "[" + ", ".join(calls[:count])
        assert accepted(listed + "]") and not accepted(listed)
        assert not accepted(listed[:-1])  # the call's object is not closed yet
