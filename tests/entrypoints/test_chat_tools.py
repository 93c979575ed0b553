"""Tool calling on /v1/chat/completions: the request checks, the `required` schema, the deltas,
and the real server driven by the official `openai` SDK.

How the tiny random model is made to call tools: the `ScriptedOutput` logits processor
(scripted_output.py, loaded with `--logits-processors`) forces the tokens of a given text, so the
engine, sampler, detokenizer, parsers and SSE all run for real on a deterministic output. The
server's template is a Qwen 2.5-style one with tools (`--chat-template`), or a Qwen3-Coder-style
one, since the tiny model's SmolLM2 template ignores them. Grammar-forced output (`required`, a
named function) runs free:
the grammar built from the tools' schemas is all that makes the random model's arguments valid.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from server_harness import RunningServer

from nanoserve.entrypoints.cli import main, read_chat_template
from nanoserve.entrypoints.openai.chat_request import chat_input
from nanoserve.entrypoints.openai.protocol import ChatCompletionRequest
from nanoserve.entrypoints.serving.chat_choice import ChoiceParser
from nanoserve.entrypoints.serving.chat_input import ChatInput, ToolFunction, ToolInput
from nanoserve.entrypoints.serving.errors import APIError
from nanoserve.entrypoints.serving.tool_plan import MAX_REQUIRED_CALLS, plan_tools, required_schema
from nanoserve.parsers.tool_calls import make_tool_call_parser

HERE = Path(__file__).resolve().parent
MODEL = "tiny-llama"
CALL_ID = re.compile(r"call_[0-9a-f]{24}")
WEATHER_PARAMETERS = {"type": "object",
                      "properties": {"city": {"type": "string"},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                      "required": ["city"]}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# Qwen 2.5's tool template, shortened: tools in the system turn, earlier calls as
# <tool_call> blocks (arguments as objects), tool results as <tool_response>s.
QWEN_TOOLS_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You are a helpful assistant.

# Tools

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
# Qwen3-Coder's tool template, shortened: the tools and the call format in the system turn,
# earlier calls as <function=...> blocks of <parameter=...> values inside <tool_call>
QWEN3_CODER_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You are a helpful assistant.

# Tools

You have access to the following functions:

<tools>
{%- for tool in tools %}
<function>
<name>{{ tool.function.name }}</name>
<parameters>{{ tool.function.parameters | tojson }}</parameters>
</function>
{%- endfor %}
</tools>

If you choose to call a function ONLY reply in the following format with NO suffix:

<tool_call>
<function=example_function_name>
<parameter=example_parameter_1>
value_1
</parameter>
</function>
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}

{% endif %}
{%- for call in message.tool_calls %}<tool_call>
<function={{ call.function.name }}>
{% for name, value in call.function.arguments | items %}<parameter={{ name }}>
{{ value if value is string else value | tojson }}
</parameter>
{% endfor %}</function>
</tool_call>
{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


# -- the request checks, in-process ------------------------------------------------------


def request(**fields: Any) -> ChatInput:
    return chat_input(ChatCompletionRequest(messages=ASK, **fields))


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"tools": []}, "tools", "must not be an empty array"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "got 'sometimes'"),
    ({"tool_choice": "required"}, "tool_choice", "tools must be set"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope', which is not in tools (there: get_weather, get_time)"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "must be"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools.1.function.name", "given twice"),
    ({"tools": TOOLS}, "tool_choice", "--tool-call-parser"),  # auto, the default, needs one
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "nonsense"}}}}}],
      "tool_choice": "required"}, "tools.0.function.parameters", "not a usable JSON schema"),
])
def test_bad_tool_requests_name_the_field(fields: dict[str, Any], param: str,
                                          message: str) -> None:
    with pytest.raises(APIError, match=re.escape(message)) as caught:
        plan_tools(request(**fields), tool_call_parser=None)
    assert caught.value.status == 400 and caught.value.param == param


def test_plans_per_tool_choice() -> None:
    none = plan_tools(request(tools=TOOLS, tool_choice="none"), None)
    assert none.mode == "none" and none.tools and none.structured is None
    assert plan_tools(request(), None).mode == "none"
    auto = plan_tools(request(tools=TOOLS), "hermes")
    assert auto.mode == "auto" and auto.structured is None
    assert auto.tools == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": WEATHER_PARAMETERS}}, TOOLS[1]]
    named = plan_tools(request(tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "get_weather"}}), None)
    assert named.mode == "named" and named.function_name == "get_weather"
    assert named.structured is not None and named.structured.json == WEATHER_PARAMETERS
    assert named.structured.whitespace_pattern == r"[ \t\n\r]{0,20}"  # bounded, unlike vLLM's
    assert named.finish_reason(True, "stop") == "stop"
    required = plan_tools(request(tools=TOOLS, tool_choice="required"), None)
    assert required.structured is not None
    assert required.structured.json == required_schema(
        [t for t in request(tools=TOOLS).tools or []])
    assert required.finish_reason(True, "stop") == "tool_calls"
    assert required.finish_reason(True, "length") == "length"  # a cut-off call says so
    assert required.finish_reason(False, "stop") == "stop"


def test_required_schema_is_vllms() -> None:
    defs_tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}},
        "$defs": {"Item": {"type": "string"}}}}}
    tools = request(tools=[*TOOLS, defs_tool]).tools or []
    schema = required_schema(tools)
    # vLLM's, but bounded: at most one call per tool
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 3
    many = [ToolInput(ToolFunction(f"f{i}"), {}) for i in range(MAX_REQUIRED_CALLS + 4)]
    assert required_schema(many)["maxItems"] == MAX_REQUIRED_CALLS
    assert required_schema(tools, is_parallel_allowed=False)["maxItems"] == 1
    branches = schema["items"]["anyOf"]
    assert [b["properties"]["name"] for b in branches] == [
        {"type": "string", "enum": [name]} for name in ("get_weather", "get_time", "pick")]
    assert branches[0]["properties"]["parameters"] == WEATHER_PARAMETERS
    assert all(b["required"] == ["name", "parameters"] for b in branches)
    assert all(b["additionalProperties"] is False for b in branches)
    assert schema["$defs"] == {"Item": {"type": "string"}}
    assert "$defs" not in branches[2]["properties"]["parameters"]
    assert tools[2].function.parameters and "$defs" in tools[2].function.parameters  # untouched
    assert required_schema(tools, is_parallel_allowed=False)["maxItems"] == 1
    no_parameters = request(tools=[{"type": "function", "function": {"name": "now"}}]).tools
    assert required_schema(no_parameters or [])["items"]["anyOf"][0]["properties"][
        "parameters"] == {"type": "object", "properties": {}}


def test_deltas_are_openais_and_add_up_to_the_message() -> None:
    text = ('Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '</tool_call><tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    whole = ChoiceParser(None, make_tool_call_parser("hermes")).message(text)
    streaming = ChoiceParser(None, make_tool_call_parser("hermes"))
    deltas = [d for i in range(0, len(text), 7)
              for d in streaming.deltas(text[i:i + 7], is_final=i + 7 >= len(text))]
    assert streaming.has_calls
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict[str, str]] = {}
    for delta in deltas:
        assert set(delta) in ({"content"}, {"tool_calls"})
        for piece in delta.get("tool_calls", []):
            if "id" in piece:  # a call's first delta: id, type, name, empty arguments
                assert CALL_ID.fullmatch(piece["id"]) and piece["type"] == "function"
                assert piece["function"]["arguments"] == ""
                calls[piece["index"]] = {"name": piece["function"]["name"], "arguments": ""}
            else:
                assert set(piece["function"]) == {"arguments"}
                calls[piece["index"]]["arguments"] += piece["function"]["arguments"]
    assert content == whole["content"] == "Checking."
    assert [calls[0], calls[1]] == [c["function"] for c in whole["tool_calls"]]
    single = ChoiceParser(None, make_tool_call_parser("hermes"), is_parallel_allowed=False)
    assert [c["function"]["name"] for c in single.message(text)["tool_calls"]] == ["get_weather"]
    single = ChoiceParser(None, make_tool_call_parser("hermes"), is_parallel_allowed=False)
    names = [p["function"].get("name") for d in single.deltas(text, True)
             for p in d.get("tool_calls", [])]
    assert names == ["get_weather", None]


def test_chat_template_flag_takes_text_or_a_file(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert read_chat_template(QWEN_TOOLS_TEMPLATE) == QWEN_TOOLS_TEMPLATE
    path = tmp_path / "template.jinja"
    path.write_text(QWEN_TOOLS_TEMPLATE)
    assert read_chat_template(str(path)) == QWEN_TOOLS_TEMPLATE
    assert main(["serve", "--chat-template", str(tmp_path / "missing.jinja")]) == 1
    assert "chat template file" in capsys.readouterr().err
    assert main(["serve", "--chat-template", "{% for x in %}"]) == 1
    assert "not a valid Jinja template" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--tool-call-parser", "nope"])


# -- the real server -----------------------------------------------------------------------


def start_server(model: Path, *args: str, monkeypatch: pytest.MonkeyPatch) -> RunningServer:
    """Started, not yet healthy (`wait_healthy()`)."""
    monkeypatch.setenv("PYTHONPATH", str(HERE))  # where scripted_output lives
    return RunningServer(str(model), "--served-model-name", MODEL, "--logits-processors",
                         "scripted_output:ScriptedOutput", *args, wait=False)


@pytest.fixture(scope="module")
def servers(tiny_model_dir: Any) -> Iterator[dict[str, RunningServer]]:
    """The servers, started at once (each start is seconds of one core): "hermes" with
    --tool-call-parser hermes and the Qwen template, "plain" with no --tool-call-parser and
    the model's own template (which ignores tools), "qwen3_coder" with no --tool-call-parser
    and the Qwen3-Coder template."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        started = {"hermes": start_server(tiny_model_dir("llama"), "--tool-call-parser",
                                          "hermes", "--chat-template", QWEN_TOOLS_TEMPLATE,
                                          monkeypatch=monkeypatch),
                   "plain": start_server(tiny_model_dir("llama"), monkeypatch=monkeypatch),
                   "qwen3_coder": start_server(tiny_model_dir("llama"), "--chat-template",
                                               QWEN3_CODER_TEMPLATE, monkeypatch=monkeypatch)}
    try:
        for server in started.values():
            server.wait_healthy()
        yield started
    finally:
        exits = {name: server.stop() for name, server in started.items()}
    assert exits == {"hermes": 0, "plain": 0, "qwen3_coder": 0}


@pytest.fixture(scope="module")
def hermes_server(servers: dict[str, RunningServer]) -> RunningServer:
    return servers["hermes"]


@pytest.fixture(scope="module")
def plain_server(servers: dict[str, RunningServer]) -> RunningServer:
    """No --tool-call-parser, the model's own template (which ignores tools)."""
    return servers["plain"]


@pytest.fixture(scope="module")
def qwen3_coder_server(servers: dict[str, RunningServer]) -> RunningServer:
    """No --tool-call-parser, the Qwen3-Coder template (which implies qwen3_coder)."""
    return servers["qwen3_coder"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir("llama")))


def scripted(tokenizer: Any, text: str) -> dict[str, Any]:
    """extra_body that makes the model write `text`, then stop (EOS)."""
    ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
    return {"extra_args": {"scripted_token_ids": ids}}


def create(server: RunningServer, text: str | None, tokenizer: Any,
           **kwargs: Any) -> Any:
    body = scripted(tokenizer, text) if text is not None else {}
    script_len = len(body["extra_args"]["scripted_token_ids"]) if body else 0
    return server.client().chat.completions.create(
        model=MODEL, messages=kwargs.pop("messages", ASK), max_tokens=script_len + 8,
        temperature=0.8, extra_body=body, **kwargs)


def collect_stream(server: RunningServer, text: str, tokenizer: Any,
                   **kwargs: Any) -> tuple[str | None, list[dict[str, str]], str | None]:
    """(content, calls, final finish_reason) of a streamed request, with each call's first
    delta checked: index, id, type and name, arguments empty."""
    content, finish = "", None
    calls: list[dict[str, str]] = []
    for chunk in create(server, text, tokenizer, stream=True, **kwargs):
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        for piece in choice.delta.tool_calls or []:
            if piece.id is not None:
                assert CALL_ID.fullmatch(piece.id) and piece.type == "function"
                assert piece.function.arguments == "" and piece.index == len(calls)
                calls.append({"name": piece.function.name, "arguments": ""})
            else:
                assert piece.function.name is None
                calls[piece.index]["arguments"] += piece.function.arguments
        finish = choice.finish_reason or finish
    return content or None, calls, finish


def as_calls(message: Any) -> list[dict[str, str]]:
    for call in message.tool_calls or []:
        assert CALL_ID.fullmatch(call.id) and call.type == "function"
    return [{"name": c.function.name, "arguments": c.function.arguments}
            for c in message.tool_calls or []]


PARIS = '{"city": "Paris", "unit": "celsius"}'
HERMES_OUTPUT = (f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}'
                 '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": '
                 '"CET"}}\n</tool_call>')
EXPECTED_CALLS = [{"name": "get_weather", "arguments": PARIS},
                  {"name": "get_time", "arguments": '{"zone": "CET"}'}]


@pytest.mark.slow
def test_tools_and_their_history_render_through_the_template(hermes_server: RunningServer,
                                                              tokenizer: Any) -> None:
    history = [*ASK,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
    ids = hermes_server.post("/tokenize", {"messages": history, "tools": TOOLS}).json()["tokens"]
    prompt = hermes_server.post("/detokenize", {"tokens": ids}).json()["prompt"]
    assert '"name": "get_weather"' in prompt.split("<|im_end|>")[0]  # the system turn
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call>") in prompt  # the arguments reached the template as an object
    assert "<tool_response>\n18 degrees\n</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    out = create(hermes_server, "It is 18 degrees.", tokenizer, messages=history, tools=TOOLS)
    assert out.choices[0].message.content == "It is 18 degrees."
    assert out.choices[0].message.tool_calls is None
    assert out.choices[0].finish_reason == "stop"


@pytest.mark.slow
def test_auto_reads_hermes_calls_streamed_or_not(hermes_server: RunningServer,
                                                 tokenizer: Any) -> None:
    out = create(hermes_server, HERMES_OUTPUT, tokenizer, tools=TOOLS)
    (choice,) = out.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check.\n"
    assert as_calls(choice.message) == EXPECTED_CALLS
    assert json.loads(choice.message.tool_calls[0].function.arguments)["city"] == "Paris"
    assert collect_stream(hermes_server, HERMES_OUTPUT, tokenizer, tools=TOOLS) == (
        "Let me check.\n", EXPECTED_CALLS, "tool_calls")
    one = create(hermes_server, HERMES_OUTPUT, tokenizer, tools=TOOLS, parallel_tool_calls=False)
    assert as_calls(one.choices[0].message) == EXPECTED_CALLS[:1]
    assert collect_stream(hermes_server, HERMES_OUTPUT, tokenizer, tools=TOOLS,
                          parallel_tool_calls=False)[1] == EXPECTED_CALLS[:1]


QWEN3_CODER_OUTPUT = ("Let me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
                      "Paris\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n"
                      "</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=utc>\nTrue\n"
                      "</parameter>\n</function>\n</tool_call>")
QWEN3_CODER_CALLS = [{"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'},
                     {"name": "get_time", "arguments": '{"utc": true}'}]


@pytest.mark.slow
def test_auto_reads_qwen3_coder_calls_streamed_or_not(qwen3_coder_server: RunningServer,
                                                      tokenizer: Any) -> None:
    """Without --tool-call-parser the Qwen3-Coder template implies qwen3_coder; the tools'
    schemas type the values (days an integer, utc a boolean from Python's `True`)."""
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5 degrees"}]
    ids = qwen3_coder_server.post("/tokenize", {"messages": history,
                                                "tools": BOUNDED_TOOLS}).json()["tokens"]
    prompt = qwen3_coder_server.post("/detokenize", {"tokens": ids}).json()["prompt"]
    assert ("<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n2"
            "\n</parameter>\n</function>") in prompt
    out = create(qwen3_coder_server, QWEN3_CODER_OUTPUT, tokenizer, tools=BOUNDED_TOOLS)
    (choice,) = out.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check.\n\n"
    assert as_calls(choice.message) == QWEN3_CODER_CALLS
    for call in QWEN3_CODER_CALLS:
        check_bounded_call(call)
    assert collect_stream(qwen3_coder_server, QWEN3_CODER_OUTPUT, tokenizer,
                          tools=BOUNDED_TOOLS) == ("Let me check.\n\n", QWEN3_CODER_CALLS,
                                                   "tool_calls")


@pytest.mark.slow
def test_auto_without_calls_and_none_give_text(hermes_server: RunningServer,
                                               tokenizer: Any) -> None:
    plain = create(hermes_server, "Paris is sunny <tool today.", tokenizer, tools=TOOLS)
    assert plain.choices[0].message.content == "Paris is sunny <tool today."
    assert plain.choices[0].finish_reason == "stop" and plain.choices[0].message.tool_calls is None
    none = create(hermes_server, HERMES_OUTPUT, tokenizer, tools=TOOLS, tool_choice="none")
    assert none.choices[0].message.content == HERMES_OUTPUT
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "stop"
    assert collect_stream(hermes_server, HERMES_OUTPUT, tokenizer, tools=TOOLS,
                          tool_choice="none") == (HERMES_OUTPUT, [], "stop")


@pytest.mark.slow
def test_required_and_named_parse_the_forced_forms(plain_server: RunningServer,
                                                   tokenizer: Any) -> None:
    """The output these modes' grammars force, scripted: parsed without any --tool-call-parser."""
    array = f'[{{"name": "get_weather", "parameters": {PARIS}}}]'
    required = create(plain_server, array, tokenizer, tools=TOOLS, tool_choice="required")
    assert required.choices[0].finish_reason == "tool_calls"
    assert required.choices[0].message.content is None
    assert as_calls(required.choices[0].message) == EXPECTED_CALLS[:1]
    assert collect_stream(plain_server, array, tokenizer, tools=TOOLS,
                          tool_choice="required") == (None, EXPECTED_CALLS[:1], "tool_calls")
    named_choice = {"type": "function", "function": {"name": "get_weather"}}
    named = create(plain_server, PARIS, tokenizer, tools=TOOLS, tool_choice=named_choice)
    assert named.choices[0].finish_reason == "stop"
    assert as_calls(named.choices[0].message) == EXPECTED_CALLS[:1]
    assert collect_stream(plain_server, PARIS, tokenizer, tools=TOOLS,
                          tool_choice=named_choice) == (None, EXPECTED_CALLS[:1], "stop")


def test_a_required_list_that_repeats_a_call_ends_before_the_repeat(
        plain_server: RunningServer, tokenizer: Any) -> None:
    """The model writes one call, the same call again, then another: the answer is the first
    call alone, finished "tool_calls", and the engine stops at the repeat (the tokens after it
    are never made), streamed or not."""
    first = f'{{"name": "get_weather", "parameters": {PARIS}}}'
    array = f'[{first},\n{first}, {{"name": "get_time", "parameters": {{"zone": "CET"}}}}]'
    script = len(scripted(tokenizer, array)["extra_args"]["scripted_token_ids"])
    whole = create(plain_server, array, tokenizer, tools=TOOLS, tool_choice="required")
    assert whole.choices[0].finish_reason == "tool_calls"
    assert as_calls(whole.choices[0].message) == EXPECTED_CALLS[:1]
    upto_repeat = len(tokenizer.encode(f"[{first},\n{first}", add_special_tokens=False))
    assert whole.usage.completion_tokens <= upto_repeat + 1 < script
    assert collect_stream(plain_server, array, tokenizer, tools=TOOLS,
                          tool_choice="required") == (None, EXPECTED_CALLS[:1], "tool_calls")


@pytest.mark.slow
@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]},
     "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]},
     "tools.0.function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "none", "parallel_tool_calls": "sometimes"},
     "parallel_tool_calls"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages.1.tool_calls.0.function.arguments"),
    ({"messages": [*ASK, {"role": "tool", "content": "18"}]}, "messages.1.tool_call_id"),
])
def test_bad_requests_are_400s_naming_the_field(plain_server: RunningServer,
                                                body: dict[str, Any], param: str) -> None:
    response = plain_server.post("/v1/chat/completions",
                                 {"messages": ASK, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.slow
def test_auto_and_none_work_without_a_parser_flag(plain_server: RunningServer,
                                                  tokenizer: Any) -> None:
    """Without --tool-call-parser the template implies one (hermes, for a template with no
    tool format): "auto" reads its calls, "none" leaves the same text as content."""
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    out = create(plain_server, call, tokenizer, tools=TOOLS)
    assert out.choices[0].finish_reason == "tool_calls"
    assert as_calls(out.choices[0].message) == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    out = create(plain_server, call, tokenizer, tools=TOOLS, tool_choice="none")
    assert out.choices[0].message.content == call and not out.choices[0].message.tool_calls


@pytest.mark.slow
def test_a_template_without_tools_is_given_them_in_the_system_message(
        plain_server: RunningServer, hermes_server: RunningServer, tokenizer: Any) -> None:
    """The tiny model's template (the default model's) never reads `tools`: the tools, an
    earlier call and its result reach the prompt in the Hermes form all the same; a template
    that renders tools itself gets them as before."""
    turns = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]

    def prompt(server: RunningServer, **fields: Any) -> str:
        response = server.post("/tokenize", {"messages": turns, **fields})
        assert response.status_code == 200, response.text
        return str(tokenizer.decode(response.json()["tokens"]))

    text = prompt(plain_server, tools=TOOLS)
    assert "<tools>" in text and '"name": "get_time"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\n18 degrees\n</tool_response>" in text
    assert "<tools>" not in prompt(plain_server)  # no tools asked for: none described
    assert prompt(hermes_server, tools=TOOLS).count("get_time") == 1  # the template's own


@pytest.mark.slow
def test_required_lists_end_with_tool_calls_at_temperature(plain_server: RunningServer) -> None:
    """One tool: one call, then the list closes (unbounded, a weak model repeats the call
    until max_tokens and ends "length")."""
    for seed in range(3):
        out = plain_server.client().chat.completions.create(
            model=MODEL, messages=ASK, tools=BOUNDED_TOOLS[:1], tool_choice="required",
            max_tokens=200, temperature=0.8, seed=seed)
        assert out.choices[0].finish_reason == "tool_calls"
        (call,) = as_calls(out.choices[0].message)
        check_bounded_call(call)


BOUNDED_TOOLS: list[dict[str, Any]] = [  # short forced outputs, whatever the model's weights
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city", "days"],
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["utc"],
        "properties": {"utc": {"type": "boolean"}}}}},
]


def check_bounded_call(call: dict[str, str]) -> None:
    """The call names a declared tool and its arguments validate against that tool's schema."""
    (tool,) = [t["function"] for t in BOUNDED_TOOLS if t["function"]["name"] == call["name"]]
    jsonschema.validate(json.loads(call["arguments"]), tool["parameters"])


@pytest.mark.slow
def test_required_is_forced_by_the_grammar(plain_server: RunningServer) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, messages=ASK, tools=BOUNDED_TOOLS,
                                  tool_choice="required", max_tokens=200, temperature=0)
    out = plain_server.client().chat.completions.create(**kwargs)
    assert out.choices[0].finish_reason == "tool_calls"
    calls = as_calls(out.choices[0].message)
    assert calls
    for call in calls:
        check_bounded_call(call)
    assert len(calls) <= len(BOUNDED_TOOLS)  # at most as many calls as tools
    one = plain_server.client().chat.completions.create(**kwargs, parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls) == 1
    stream = plain_server.client().chat.completions.create(**kwargs, stream=True)
    streamed_arguments = "".join(p.function.arguments or "" for c in stream if c.choices
                                 for p in c.choices[0].delta.tool_calls or [])
    assert streamed_arguments == "".join(c["arguments"] for c in calls)


@pytest.mark.slow
def test_named_function_is_forced_by_the_grammar(plain_server: RunningServer) -> None:
    kwargs: dict[str, Any] = dict(
        model=MODEL, messages=ASK, tools=BOUNDED_TOOLS, max_tokens=200, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    out = plain_server.client().chat.completions.create(**kwargs)
    assert out.choices[0].finish_reason == "stop"
    (call,) = as_calls(out.choices[0].message)
    check_bounded_call(call)
