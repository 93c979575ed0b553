"""The tool-call parser a chat template implies, read from its text."""

from __future__ import annotations

import json
from typing import Any

import jinja2

from nanoserve.parsers.tool_calls import make_tool_call_parser
from nanoserve.parsers.tool_format import DEFAULT_TOOL_CALL_PARSER, template_tool_format

QWEN_STYLE = """{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}
{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}
{{- '</tools>\\n<tool_call>...</tool_call>' }}{%- endif %}"""
LLAMA3_STYLE = """{%- if tools is not none %}{{- '<|start_header_id|>system<|end_header_id|>' }}
{%- endif %}{{- '<|python_tag|>' + tool_call.name }}"""

# Qwen3-Coder's tool sections, shortened: the tools and the call format in the system turn, and
# earlier turns' calls in that format (which writes `<tool_call>` too)
QWEN3_CODER_STYLE = """{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n\\n<tools>' }}
{%- for tool in tools %}
{{- '\\n<function>\\n<name>' ~ tool.function.name ~ '</name>\\n</function>' }}
{%- endfor %}{{- '\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the format:' }}
{{- '\\n<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>' }}
{{- '\\nvalue_1\\n</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' }}{%- endif %}
{%- for message in messages %}{%- for tool_call in message.tool_calls or [] %}
{%- set tool_call = tool_call.function %}
{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}
{%- for args_name, args_value in tool_call.arguments|items %}
{{- '<parameter=' + args_name + '>\\n' + args_value | string + '\\n</parameter>\\n' }}
{%- endfor %}{{- '</function>\\n</tool_call>' }}{%- endfor %}{%- endfor %}"""


def test_a_template_that_writes_tool_call_tags_is_hermes() -> None:
    found = template_tool_format(QWEN_STYLE)
    assert (found.parser, found.reads_tools) == ("hermes", True)


def test_a_llama3_tool_template_is_llama3_json() -> None:
    found = template_tool_format(LLAMA3_STYLE)
    assert (found.parser, found.reads_tools) == ("llama3_json", True)


def test_a_qwen3_coder_template_is_qwen3_coder_though_it_writes_tool_call_tags() -> None:
    found = template_tool_format(QWEN3_CODER_STYLE)
    assert (found.parser, found.reads_tools) == ("qwen3_coder", True)
    assert "<tool_call>" in QWEN3_CODER_STYLE


def test_the_qwen3_coder_parser_reads_the_calls_its_template_writes() -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "detailed": {"type": "boolean"}}}}}]
    arguments = {"city": "Paris", "days": 3, "detailed": False}
    call = {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    text = jinja2.Template(QWEN3_CODER_STYLE).render(
        tools=tools, messages=[{"role": "assistant", "tool_calls": [call]}])
    assert text.endswith("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                         "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=detailed>"
                         "\nFalse\n</parameter>\n</function>\n</tool_call>")
    written = text[text.index("<|im_end|>") + len("<|im_end|>\n"):]
    _, (parsed,) = make_tool_call_parser("qwen3_coder", tools).parse(written)
    assert parsed.name == "get_weather" and json.loads(parsed.arguments) == arguments


def test_the_default_model_template_has_no_tool_format(default_tokenizer: Any) -> None:
    """SmolLM2's template ignores `tools`: the default parser, and the tools are described by
    the server (serving/tool_prompt.py)."""
    found = template_tool_format(default_tokenizer.chat_template)
    assert (found.parser, found.reads_tools) == (DEFAULT_TOOL_CALL_PARSER, False)
    assert template_tool_format(None).parser == DEFAULT_TOOL_CALL_PARSER
