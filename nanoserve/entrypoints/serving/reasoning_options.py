"""How much a chat request may reason, and where its grammar starts.

The effort clients send (chat completions' `reasoning_effort`, Responses' `reasoning.effort`,
Ollama's `think` levels, all as `ChatInput.reasoning_effort`) becomes, on a server with a
`--reasoning-parser`, the template's `enable_thinking`: False for `none`, True for any other
effort (Gemma 4's template thinks only when told to, Qwen3's unless told not to); and, on a model
with `<think>` tokens, a thinking-token budget (`EFFORT_BUDGETS`; the sampler then forces
`</think>` there), 0 for `none` for the templates that cannot turn thinking off.
What the request gives itself wins: its `thinking_token_budget`, its `enable_thinking`. The
effort also reaches the template as `reasoning_effort` (vLLM passes it so; gpt-oss's reads it).
Without a reasoning parser the effort is checked and changes nothing: Codex and other clients
send one with every request. gpt-oss's harmony template gets `low`, `medium` or `high`: `none`
and `minimal` become `low` (harmony cannot turn reasoning off), `xhigh` becomes `high`.

With a reasoning parser that splits the output, a grammar (`response_format`, tools forced by
`tool_choice`) constrains only the answer after the reasoning section: `grammar_after_reasoning`
says how the output begins, for the engine's gate (`structured/reasoning_gate.py`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from nanoserve.entrypoints.serving.chat_input import ChatInput
from nanoserve.entrypoints.serving.errors import bad_request
from nanoserve.entrypoints.serving.harmony_template import HARMONY_EFFORTS
from nanoserve.entrypoints.serving.server_context import ServerContext
from nanoserve.parsers.harmony import is_harmony_parser
from nanoserve.parsers.reasoning import prompt_ends_in_reasoning
from nanoserve.reasoning_section import INSIDE, OPENING, ReasoningStart

# effort -> thinking tokens before `</think>` is forced (None: no cap but max_tokens). OpenAI's
# efforts; Ollama's `think` levels are low, medium and high. Sized for today's local reasoning
# models (Qwen3 answers most questions within 1-4k thinking tokens and is given up to 32k).
EFFORT_BUDGETS: dict[str, int | None] = {
    "none": 0, "minimal": 256, "low": 1024, "medium": 4096, "high": 16384, "xhigh": None}


def with_reasoning_effort(ctx: ServerContext, chat: ChatInput) -> ChatInput:
    """`chat` with its effort turned into a budget and template switches (see the module);
    a 400 naming `reasoning_effort` for an effort that is not one of `EFFORT_BUDGETS`."""
    effort = chat.reasoning_effort
    if effort is None:
        return chat
    if effort not in EFFORT_BUDGETS:
        raise bad_request(f"reasoning_effort must be one of {', '.join(EFFORT_BUDGETS)}, got "
                          f"{effort!r}", "reasoning_effort")
    if ctx.reasoning_parser is None:
        return chat
    # harmony's template takes low/medium/high only, and has no "off" (harmony_template.py)
    template_effort = HARMONY_EFFORTS[effort] if is_harmony_parser(ctx.reasoning_parser) \
        else effort
    kwargs: dict[str, Any] = {"reasoning_effort": template_effort, **(chat.template.kwargs or {})}
    kwargs.setdefault("enable_thinking", effort != "none")
    sampling = chat.sampling
    if sampling.thinking_token_budget is None and ctx.has_reasoning_tokens:
        sampling = replace(sampling, thinking_token_budget=EFFORT_BUDGETS[effort])
    return replace(chat, sampling=sampling, template=replace(chat.template, kwargs=kwargs))


def reasoning_start(chat: ChatInput, prompt: str,
                    reasoning_parser: str | None) -> ReasoningStart | None:
    """How a sample's output begins where the server splits reasoning from content: INSIDE the
    section (the template opened it, or `deepseek_r1`, whose models often omit `<think>`) or
    OPENING (a first `<think>` opens it); None where nothing is split."""
    if reasoning_parser is None or not chat.include_reasoning:
        return None
    if reasoning_parser == "deepseek_r1" or prompt_ends_in_reasoning(prompt, reasoning_parser):
        return INSIDE
    return OPENING


def grammar_after_reasoning(ctx: ServerContext, chat: ChatInput,
                            prompt: str) -> ReasoningStart | None:
    """Where a grammar on this request starts: after the reasoning section (how the output
    begins, `StructuredOutputsParams.after_reasoning`) or, None, at the first token."""
    if not ctx.has_reasoning_tokens:
        return None
    return reasoning_start(chat, prompt, ctx.reasoning_parser)
