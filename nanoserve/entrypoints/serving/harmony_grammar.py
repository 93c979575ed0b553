"""Structured outputs and forced tool calls on a harmony model (gpt-oss): the grammar written
around harmony's messages, so that it constrains only the answer's message.

A harmony output is messages, not one text: reasoning on the `analysis` channel, then the
answer on `final`, or a call on `commentary` to `functions.NAME`. nanoserve's reasoning gate
(`structured/reasoning_gate.py`) waits for one `</think>` token, which harmony has not; harmony's
end of reasoning is several tokens (`<|end|><|start|>assistant<|channel|>final ...<|message|>`).
So, as llama.cpp does (`common/parsers/gpt-oss.cpp`), the grammar holds the whole output: any
number of analysis messages (free text up to `<|end|>`), then the answer's header, then the
request's constraint on the answer's body. The header is llama.cpp's: `<|channel|>final`, for a
response format optionally ` <|constrain|>json` (the model's own habit; either way the body is
the content), and for a forced call `<|channel|>commentary to=functions.NAME <|constrain|>json`,
which the `openai` parser reads back as a call (one call: harmony writes one per message, and the
output ends after it). The constraint is the request's JSON schema, JSON object, regex or choice,
as llguidance's Lark (`%json`); a GBNF or Lark grammar of the client's is left as it is, from the
first token (it would have to name harmony's tokens itself).
"""

from __future__ import annotations

import json
from typing import Any

from nanoserve.entrypoints.serving.tool_plan import ToolPlan
from nanoserve.sampling_params import StructuredOutputsParams
from nanoserve.structured.grammar import JSON_WHITESPACE

# the generation prompt ends in `<|start|>assistant`: the output starts at a message's channel
_ANALYSIS = ('analysis: <|channel|> "analysis" <|message|> ANALYSIS_TEXT <|end|> '
             '<|start|> "assistant"\n'
             "ANALYSIS_TEXT: /(?s:.*)/\n")
_FINAL_HEADER = '<|channel|> "final" (" " <|constrain|>? "json")? <|message|>'
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def harmony_grammar(plan: ToolPlan, structured: StructuredOutputsParams | None
                    ) -> StructuredOutputsParams | None:
    """The grammar of a harmony request: a forced call's (`plan` required or named), else the
    response format's around the final message; None where nothing is constrained."""
    if plan.structured is not None and plan.mode in ("required", "named"):
        names = [plan.function_name] if plan.mode == "named" else \
            [tool["function"]["name"] for tool in plan.tools or []]
        schemas = {tool["function"]["name"]: tool["function"].get("parameters")
                   or _EMPTY_PARAMETERS for tool in plan.tools or []}
        options = " | ".join(f"call_{i}" for i in range(len(names)))
        rules = "".join(
            f"call_{i}: <|channel|> {json.dumps(f'commentary to=functions.{name}')} "
            f'" " <|constrain|>? "json" <|message|> {_json(schemas[str(name)], plan.structured)}\n'
            for i, name in enumerate(names))
        return _lark(f"start: (analysis)* ({options})\n{rules}")
    if structured is None or structured.kind == "grammar":
        return structured
    return _lark(f"start: (analysis)* {_FINAL_HEADER} answer\nanswer: {_body(structured)}\n")


def _lark(rules: str) -> StructuredOutputsParams:
    return StructuredOutputsParams(grammar=rules + _ANALYSIS)


def _body(params: StructuredOutputsParams) -> str:
    """The response format's constraint as a Lark expression."""
    if params.kind == "json_object":
        return _json({"type": "object"}, params)
    if params.kind == "json":
        schema = params.json
        return _json(json.loads(schema) if isinstance(schema, str) else schema, params)
    if params.kind == "regex":
        return "/" + (params.regex or "").replace("/", "\\/") + "/"
    assert params.kind == "choice"
    return " | ".join(json.dumps(str(choice)) for choice in params.choice or [])


def _json(schema: Any, params: StructuredOutputsParams) -> str:
    """`%json` of `schema` with the request's whitespace options (`structured/grammar.py`'s)."""
    options: dict[str, Any] = ({"whitespace_flexible": False} if params.disable_any_whitespace
                               else {"whitespace_pattern": JSON_WHITESPACE})
    if params.whitespace_pattern is not None:
        options = {"whitespace_pattern": params.whitespace_pattern}
    if isinstance(schema, dict) and "x-guidance" not in schema:
        schema = {"x-guidance": options, **schema}
    return "%json " + json.dumps(schema)

