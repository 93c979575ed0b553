"""The tool-call parser a chat template implies, read from its text."""

from __future__ import annotations

from typing import Any

from nanoserve.parsers.tool_format import DEFAULT_TOOL_CALL_PARSER, template_tool_format

QWEN_STYLE = """{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}
{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}
{{- '</tools>\\n<tool_call>...</tool_call>' }}{%- endif %}"""
LLAMA3_STYLE = """{%- if tools is not none %}{{- '<|start_header_id|>system<|end_header_id|>' }}
{%- endif %}{{- '<|python_tag|>' + tool_call.name }}"""


def test_a_template_that_writes_tool_call_tags_is_hermes() -> None:
    found = template_tool_format(QWEN_STYLE)
    assert (found.parser, found.reads_tools) == ("hermes", True)


def test_a_llama3_tool_template_is_llama3_json() -> None:
    found = template_tool_format(LLAMA3_STYLE)
    assert (found.parser, found.reads_tools) == ("llama3_json", True)


def test_the_default_model_template_has_no_tool_format(default_tokenizer: Any) -> None:
    """SmolLM2's template ignores `tools`: the default parser, and the tools are described by
    the server (openai/tool_prompt.py)."""
    found = template_tool_format(default_tokenizer.chat_template)
    assert (found.parser, found.reads_tools) == (DEFAULT_TOOL_CALL_PARSER, False)
    assert template_tool_format(None).parser == DEFAULT_TOOL_CALL_PARSER
