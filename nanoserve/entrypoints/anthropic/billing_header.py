"""Claude Code's billing line, taken off the start of a system prompt before templating.

Claude Code begins its system prompt with a line such as
`x-anthropic-billing-header: cc_version=2.1.3.abc; cc_entrypoint=cli; cch=4f2a1;` whose `cch`
changes from request to request. It is the prompt's first text, so two requests of one session
share no prefix at all and the prefix cache never hits: every turn re-reads the whole context
(on a CPU, minutes at 30k tokens). Anthropic's API strips it; so does vLLM, and a server that
does measured 13.7x faster follow-ups at 60k tokens (waybarrios/vllm-mlx PR #277). On by
default; `nanoserve serve --keep-billing-header` keeps the line for a model that should see it.
"""

from __future__ import annotations

BILLING_HEADER = "x-anthropic-billing-header:"


def strip_billing_header(texts: list[str]) -> list[str]:
    """The system prompt's text blocks without a leading billing line (its block dropped when
    nothing else is in it). The line counts only at the very start, as Claude Code writes it."""
    if not texts or not texts[0].lstrip().startswith(BILLING_HEADER):
        return texts
    _, _, rest = texts[0].lstrip().partition("\n")
    return ([rest] if rest.strip() else []) + texts[1:]
