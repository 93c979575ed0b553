"""Which tool-call format a chat template teaches its model, read from the template's text.

Agents send `tools` with `tool_choice="auto"` and never pass a server flag, so without
`--tool-call-parser` the server picks the parser the template implies:

- a template that writes harmony's `<|channel|>` and `<|start|>` (gpt-oss) → `openai`, whose
  parser reads the reasoning too (`parsers/harmony.py`; the server then defaults
  `--reasoning-parser` to `openai_gptoss`, `serving/server_context.py`);
- a template that writes `<|tool_call>` (Gemma 4) → `gemma4`;
- a template that writes `<function=` and `<parameter=` tags (Qwen3-Coder, Qwen3.5/3.6) →
  `qwen3_coder`, checked before `hermes` since these templates write `<tool_call>` blocks around
  them;
- another template that writes `<tool_call>` (Hermes 2 Pro, Qwen 2.5/3, SmolLM3) → `hermes`;
- a Llama 3.1+ template (`<|python_tag|>`, or `<|start_header_id|>` with tools) → `llama3_json`;
- any other template → `hermes`, the documented default: it is the format most open models
  with tool training write, and a text without `<tool_call>` blocks is left as content, so a
  model that never calls a tool loses nothing to the parser.

A template that never reads its `tools` variable (SmolLM2's, most base chat templates) would
drop the tools silently and the model would never know them. For those the server describes
the tools in the system message in the Hermes form and writes earlier calls and tool results
in it too (`serving/chat_prompt.py`), as llama.cpp's server does with its generic tool format.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_TOOL_CALL_PARSER = "hermes"
_READS_TOOLS = re.compile(r"\btools\b")


@dataclass(frozen=True)
class TemplateToolFormat:
    """The parser a template implies, and whether the template renders tools itself."""

    parser: str
    reads_tools: bool
    reason: str  # for the start-up log line


def is_harmony_template(template: str | None) -> bool:
    """Whether a chat template's Jinja source writes harmony's messages (gpt-oss)."""
    return template is not None and "<|channel|>" in template and "<|start|>" in template


def template_tool_format(template: str | None) -> TemplateToolFormat:
    """The tool format of a chat template's Jinja source (None: the model has no template)."""
    text = template or ""
    reads_tools = bool(_READS_TOOLS.search(text))
    if is_harmony_template(text):
        return TemplateToolFormat("openai", reads_tools,
                                  "the chat template is harmony's (<|channel|>, <|start|>)")
    if "<|tool_call>" in text:
        return TemplateToolFormat("gemma4", reads_tools, "the chat template writes <|tool_call>")
    if "<function=" in text and "<parameter=" in text:
        return TemplateToolFormat("qwen3_coder", reads_tools,
                                  "the chat template writes <function=...> and <parameter=...>")
    if "<tool_call>" in text:
        return TemplateToolFormat("hermes", reads_tools, "the chat template writes <tool_call>")
    if "<|python_tag|>" in text or ("<|start_header_id|>" in text and reads_tools):
        return TemplateToolFormat("llama3_json", reads_tools,
                                  "the chat template is Llama 3's tool format")
    return TemplateToolFormat(DEFAULT_TOOL_CALL_PARSER, reads_tools,
                              "the chat template has no tool format of its own (the default)")
