"""Structured outputs through the API: every request shape vLLM takes becomes the one grammar it
names, a bad one is a 400 naming the client's field, and (slow: the real server on the default
model, driven by the official `openai` SDK) every output parses and follows its schema, regex,
choice or grammar, at temperature 0 and 1."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import jsonschema
import llguidance
import openai
import pydantic
import pytest
from server_harness import API_KEY, RunningServer
from shared_server import shared_server

from nanoserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from nanoserve.entrypoints.serving.errors import APIError
from nanoserve.entrypoints.serving.structured_outputs import structured_outputs
from nanoserve.sampling_params import StructuredOutputsParams

MODEL = "SmolLM2-135M-Instruct"
Params = StructuredOutputsParams
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
MESSAGES = [{"role": "user", "content": "x"}]


def shape(body: dict[str, Any], chat: bool = True) -> StructuredOutputsParams | None:
    req: Any = (ChatCompletionRequest(messages=MESSAGES, **body) if chat
                else CompletionRequest(prompt="x", **body))
    return asyncio.run(structured_outputs(req))


@pytest.mark.parametrize(("body", "expected"), [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, Params(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": SCHEMA, "strict": True}}}, Params(json=SCHEMA)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}},
     Params(json_object=True)),
    ({"structured_outputs": {"regex": "[ab]+"}}, Params(regex="[ab]+")),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True,
                             "disable_fallback": True}},
     Params(json=SCHEMA, disable_any_whitespace=True)),
    ({"structured_outputs": {"json_object": True, "whitespace_pattern": " ?"}},
     Params(json_object=True, whitespace_pattern=" ?")),
    ({"guided_json": json.dumps(SCHEMA), "guided_whitespace_pattern": "\n?"},
     Params(json=json.dumps(SCHEMA), whitespace_pattern="\n?")),
    ({"guided_regex": r"\d+", "guided_decoding_backend": "xgrammar"}, Params(regex=r"\d+")),
    ({"guided_choice": ["yes", "no"]}, Params(choice=["yes", "no"])),
    ({"guided_grammar": 'root ::= "a"'}, Params(grammar='root ::= "a"')),
])
@pytest.mark.parametrize("chat", [True, False])
def test_request_shapes_become_one_grammar(body: dict[str, Any],
                                           expected: StructuredOutputsParams | None,
                                           chat: bool) -> None:
    assert shape(body, chat) == expected


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"response_format": {"type": "xml"}}, "response_format.type", "must be 'text'"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema",
     "must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.name", "non-empty string"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "strnig"}}}},
     "response_format.json_schema.schema", "is not valid: Invalid type: strnig"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "object", "if": {}, "then": {}}}}},
     "response_format.json_schema.schema", "Unimplemented keys"),
    ({"guided_json": {"type": "string", "pattern": "(?<=a)b"}}, "guided_json", "look-around"),
    ({"guided_json": "{not json"}, "guided_json", "not JSON text"),
    ({"guided_regex": "(a"}, "guided_regex", "unclosed group"),
    ({"guided_regex": ""}, "guided_regex", "non-empty string"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_grammar": 'root ::= "a'}, "guided_grammar", "GBNF"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "give one"),
    ({"guided_regex": "a", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern",
     "guided_json only"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "response_format and guided_regex both"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one of"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": "(x"}},
     "structured_outputs.whitespace_pattern", "unclosed group"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag",
     "not supported"),
    ({"structured_outputs": {"regx": "a"}}, "structured_outputs.regx", "has no field"),
    ({"structured_outputs": {"json_object": True, "disable_any_whitespace": "yes"}},
     "structured_outputs.disable_any_whitespace", "boolean"),
])
def test_bad_shapes_and_grammars_are_400s_naming_the_field(body: dict[str, Any], param: str,
                                                           message: str) -> None:
    with pytest.raises(APIError) as caught:
        shape(body)
    assert caught.value.status == 400 and caught.value.param == param
    assert message in caught.value.message


# -- the real server on the default model (slow) --------------------------------------------------
def bounded(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": schema, "required": list(schema),
            "additionalProperties": False}


NAME = {"type": "string", "minLength": 1, "maxLength": 24}
ADDRESS = bounded({"street": NAME, "city": NAME, "zip": {"type": "string",
                                                         "pattern": "^[0-9]{5}$"}})
JSON_SCHEMAS: dict[str, dict[str, Any]] = {
    "person": bounded({"name": NAME, "age": {"type": "integer", "minimum": 0,
                                             "maximum": 120}}),
    "nested": bounded({"user": bounded({"id": {"type": "integer", "minimum": 1,
                                               "maximum": 9999},
                                        "email": {"type": "string",
                                                  "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"}}),
                       "active": {"type": "boolean"}}),
    "string_array": bounded({"fruits": {"type": "array", "items": NAME, "minItems": 2,
                                        "maxItems": 4}}),
    "enums": bounded({"color": {"enum": ["red", "green", "blue"]},
                      "size": {"type": "string", "enum": ["S", "M", "L", "XL"]}}),
    "date_ranges": bounded({"year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                            "month": {"type": "integer", "minimum": 1, "maximum": 12},
                            "day": {"type": "integer", "minimum": 1, "maximum": 31}}),
    "patterns": bounded({"phone": {"type": "string", "pattern": "^\\d{3}-\\d{3}-\\d{4}$"},
                         "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}}),
    "optional": {"type": "object", "properties": {"title": NAME, "subtitle": NAME,
                                                  "pages": {"type": "integer", "minimum": 1,
                                                            "maximum": 2000}},
                 "required": ["title"], "additionalProperties": False},
    "nullable": bounded({"middle_name": {"type": ["string", "null"], "maxLength": 20},
                         "score": {"anyOf": [{"type": "number", "minimum": 0,
                                              "maximum": 10}, {"type": "null"}]}}),
    "refs": {"$defs": {"address": ADDRESS}, **bounded({
        "home": {"$ref": "#/$defs/address"}, "work": {"$ref": "#/$defs/address"}})},
    "order_items": bounded({"items": {"type": "array", "minItems": 1, "maxItems": 3,
                                      "items": bounded({
                                          "sku": {"type": "string", "pattern": "^SKU-[0-9]{3}$"},
                                          "quantity": {"type": "integer", "minimum": 1,
                                                       "maximum": 99}})}}),
    "const_and_flags": bounded({"version": {"const": "1.0"}, "enabled": {"type": "boolean"},
                                "debug": {"type": "boolean"}}),
    "numbers": bounded({"temperature": {"type": "number", "minimum": -50, "maximum": 60},
                        "humidity": {"type": "number", "minimum": 0, "maximum": 100}}),
    "variants": bounded({"shape": {"anyOf": [
        bounded({"kind": {"const": "circle"}, "radius": {"type": "integer", "minimum": 1,
                                                         "maximum": 100}}),
        bounded({"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1,
                                                       "maximum": 100}})]}}),
    "top_level_array": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                   "maximum": 100},
                        "minItems": 3, "maxItems": 5},
    "deep": bounded({"a": bounded({"b": bounded({"c": bounded({"d": NAME})})})}),
    "string_lengths": bounded({"code": {"type": "string", "minLength": 3, "maxLength": 6},
                               "note": {"type": "string", "maxLength": 40}}),
    "mixed_array": bounded({"values": {"type": "array", "maxItems": 4, "items": {
        "anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]}}}),
}
GBNF = '''root ::= expr
expr ::= term (("+" | "-") term)?
term ::= num | "(" num "*" num ")"
num ::= [1-9] [0-9]?'''


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> RunningServer:
    # test_server_api's server (its API key changes nothing here: every call sends it)
    return shared_server(request, "--max-model-len", "4096", api_key=API_KEY)


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return server.client(timeout=600)


def ask(name: str, schema: dict[str, Any]) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Reply with one JSON value for '{name}' that follows "
                                        f"this JSON schema: {json.dumps(schema)}"}]


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_json_schema_output_validates(server: RunningServer, temperature: float) -> None:
    """All schemas at once (one batch), through chat's response_format and, for every other
    schema, completions' guided_json: each output parses, validates and stops by itself."""
    async def one(i: int, name: str, schema: dict[str, Any]) -> tuple[str, str, str | None]:
        async with server.async_client() as client:
            if i % 2 == 0:
                chat = await client.chat.completions.create(
                    model=MODEL, messages=ask(name, schema), temperature=temperature, seed=i,
                    max_tokens=600, response_format={"type": "json_schema", "json_schema": {
                        "name": name, "schema": schema, "strict": True}})
                return name, chat.choices[0].message.content or "", chat.choices[0].finish_reason
            done = await client.completions.create(
                model=MODEL, prompt=ask(name, schema)[0]["content"] + "\n", seed=i,
                temperature=temperature, max_tokens=600, extra_body={"guided_json": schema})
            return name, done.choices[0].text, done.choices[0].finish_reason

    async def everything() -> list[tuple[str, str, str | None]]:
        return await asyncio.gather(*(one(i, name, schema)
                                      for i, (name, schema) in enumerate(JSON_SCHEMAS.items())))

    for name, text, finish in asyncio.run(everything()):
        assert finish == "stop", (name, text)
        jsonschema.validate(json.loads(text), JSON_SCHEMAS[name])


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_regex_choice_and_grammar_outputs(client: openai.OpenAI, temperature: float) -> None:
    regex = r"(Mon|Tue|Wed) [0-2][0-9]:[0-5][0-9]"
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "When shall we meet?"}],
        temperature=temperature, max_tokens=50, extra_body={"structured_outputs": {
            "regex": regex}})
    assert re.fullmatch(regex, chat.choices[0].message.content or "")
    choices = ["positive", "negative", "neutral"]
    done = client.completions.create(model=MODEL, prompt="I loved this film! Sentiment:",
                                     temperature=temperature, max_tokens=20, n=3,
                                     extra_body={"guided_choice": choices})
    assert all(c.text in choices and c.finish_reason == "stop" for c in done.choices)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a small sum."}],
        temperature=temperature, max_tokens=50, extra_body={"guided_grammar": GBNF})
    text = chat.choices[0].message.content or ""
    assert chat.choices[0].finish_reason == "stop"
    assert in_grammar(GBNF, text), text
    assert not in_grammar(GBNF, text + "+"), "the checker itself must refuse a wrong text"


def in_grammar(gbnf: str, text: str) -> bool:
    """Whether llguidance's byte-level parser (no tokenizer) takes `text` as a whole match."""
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))
    matcher = llguidance.LLMatcher(tokenizer, llguidance.grammar_from("grammar", gbnf),
                                   log_level=0)
    return all(matcher.consume_token(b) for b in text.encode()) and matcher.is_accepting()


class _ByteTokenizer:
    """One token per byte (and an EOS): the smallest tokenizer llguidance takes."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    country: str = pydantic.Field(max_length=30)
    population_millions: int = pydantic.Field(ge=0, le=50)
    is_capital: bool


@pytest.mark.slow
def test_sdk_parse_returns_the_pydantic_object(client: openai.OpenAI) -> None:
    completion = client.beta.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe Paris."}],
        response_format=City, temperature=0, max_tokens=200)
    city = completion.choices[0].message.parsed
    assert isinstance(city, City) and city.name


@pytest.mark.slow
def test_streamed_output_equals_the_whole(client: openai.OpenAI) -> None:
    schema = JSON_SCHEMAS["order_items"]
    kwargs: dict[str, Any] = dict(model=MODEL, messages=ask("order", schema), temperature=0,
                                  max_tokens=300, response_format={
                                      "type": "json_schema",
                                      "json_schema": {"name": "order", "schema": schema}})
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    stream = client.chat.completions.create(stream=True, **kwargs)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole
    prompt = "Phone number: "
    extra = {"guided_regex": r"\(\d{3}\) \d{3}-\d{4}"}
    text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30,
                                     temperature=0, extra_body=extra).choices[0].text
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, stream=True,
                                       temperature=0, extra_body=extra)
    assert "".join(c.choices[0].text for c in stream) == text


@pytest.mark.slow
def test_free_and_constrained_requests_in_one_batch(server: RunningServer) -> None:
    """A greedy free request batched with constrained ones says what it says alone, and the
    seeded constrained ones say what they say without it, following their schema.

    Warmed up first, so that every run finds the same things cached: the schema's grammar (the
    constrained requests step beside the free one from its first token) and each prompt's KV
    blocks. A prompt prefilled whole and one prefilled after a prefix-cache hit differ by ~3e-5
    in their logits (the attention sums in another order), which the default weights' int8
    activation rounding turns into another greedy token after a few dozen; that is the cache's
    doing, not the batch's (with `--no-prefix-caching` every run here says the same)."""
    free: dict[str, Any] = dict(model=MODEL, temperature=0, max_tokens=40,
                                messages=[{"role": "user", "content": "Tell me about cats."}])
    schema = {"type": "array", "minItems": 1, "maxItems": 3, "items": JSON_SCHEMAS["person"]}

    async def run(num_constrained: int, with_free: bool = True) -> tuple[str, list[str]]:
        async with server.async_client() as client:
            constrained = [client.chat.completions.create(
                model=MODEL, messages=ask("people", schema), temperature=1.0, seed=i,
                max_tokens=300, extra_body={"guided_json": schema})
                for i in range(num_constrained)]
            results = await asyncio.gather(*(
                [client.chat.completions.create(**free)] if with_free else []), *constrained)
        texts = [r.choices[0].message.content or "" for r in results]
        return (texts[0] if with_free else ""), texts[len(texts) - num_constrained:]

    client = server.client()
    client.chat.completions.create(**{**free, "max_tokens": 1})
    client.chat.completions.create(model=MODEL, messages=ask("people", schema), max_tokens=1,
                                   extra_body={"guided_json": schema})
    alone, _ = asyncio.run(run(0))
    _, json_alone = asyncio.run(run(3, with_free=False))
    mixed, json_mixed = asyncio.run(run(3))
    assert mixed == alone and not alone.lstrip().startswith("[")
    assert json_mixed == json_alone
    for text in json_mixed:
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.slow
def test_server_refuses_bad_grammars_by_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "x", "schema": {"type": "strnig"}}})
    assert caught.value.body["param"] == "response_format.json_schema.schema"  # type: ignore[index]
    tool = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                       tools=[tool], tool_choice="required",  # type: ignore[list-item]
                                       extra_body={"guided_regex": "a+"})
    assert caught.value.body["param"] == "guided_regex"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="x", max_tokens=5,
                                  extra_body={"structured_outputs": {"grammar": 'root ::= "a'}})
    assert caught.value.body["param"] == "structured_outputs.grammar"  # type: ignore[index]


BAD_GRAMMARS: list[tuple[dict[str, Any], str, str]] = [  # (body, the 400's param, its message)
    ({"structured_outputs": {"grammar": 'root ::= "a'}}, "structured_outputs.grammar",
     "Failed to convert the grammar from GBNF"),
    ({"guided_grammar": "root ::= term\nterm ::= missing"}, "guided_grammar",
     "Rule 'missing' not found"),
    # tokens the model lacks: only a check with its tokenizer refuses these
    ({"guided_grammar": "start: <|no_such_token|>"}, "guided_grammar",
     "unknown special token"),
    ({"structured_outputs": {"grammar": "start: <[1-99999999]>"}}, "structured_outputs.grammar",
     "Token range end too large"),
    ({"guided_regex": "(a"}, "guided_regex", "unclosed group"),
    ({"structured_outputs": {"regex": "a{3,1}"}}, "structured_outputs.regex",
     "invalid repetition count"),
    ({"guided_json": {"type": "strnig"}}, "guided_json", "Invalid type: strnig"),
    ({"structured_outputs": {"json": {"type": "integer", "minimum": 5, "maximum": 2}}},
     "structured_outputs.json", "Unsatisfiable schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "minItems": 3, "maxItems": 1}}}},
     "response_format.json_schema.schema", "Unsatisfiable schema"),
]


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_both_endpoints_refuse_bad_grammars_by_field(client: openai.OpenAI, endpoint: str,
                                                     stream: bool) -> None:
    """Every bad grammar is a 400 naming the client's field, before any stream starts, on
    /v1/completions as on /v1/chat/completions (never a 200 that finishes with "error")."""
    for body, param, message in BAD_GRAMMARS:
        with pytest.raises(openai.BadRequestError) as caught:
            if endpoint == "completions":
                client.completions.create(model=MODEL, prompt="x", max_tokens=5, stream=stream,
                                          extra_body=body)
            else:
                client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                               stream=stream, extra_body=body)
        error: Any = caught.value.body
        assert caught.value.status_code == 400
        assert error["param"] == param and message in error["message"], (body, error)
