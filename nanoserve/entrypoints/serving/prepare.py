"""A chat request's preparation, shared by every chat API (chat completions, Responses, Anthropic's
Messages, Ollama's chat and generate): the checks in the order their errors take, the tool plan
and grammar, the prompt through the chat template and its ids, and the request's one
SamplingParams, built and checked once here and carried to the engine as they are."""

from __future__ import annotations

from dataclasses import replace

from nanoserve.entrypoints.serving.chat_input import ChatInput
from nanoserve.entrypoints.serving.chat_prompt import render_prompt
from nanoserve.entrypoints.serving.errors import bad_request
from nanoserve.entrypoints.serving.harmony_grammar import harmony_grammar
from nanoserve.entrypoints.serving.image_prompt import (
    expand_images,
    image_token_counts,
    place_images,
)
from nanoserve.entrypoints.serving.images import collect_images
from nanoserve.entrypoints.serving.reasoning_options import (
    grammar_after_reasoning,
    with_reasoning_effort,
)
from nanoserve.entrypoints.serving.request_params import sampling_params
from nanoserve.entrypoints.serving.server_context import ServerContext
from nanoserve.entrypoints.serving.structured_outputs import structured_outputs
from nanoserve.entrypoints.serving.token_limits import resolve_max_tokens
from nanoserve.entrypoints.serving.tool_plan import ToolPlan, plan_tools
from nanoserve.sampling_params import RequestOutputKind, SamplingParams


async def prepare_chat(ctx: ServerContext, chat: ChatInput, admit: bool = True,
                       raw_prompt: str | None = None, prompt_ids: list[int] | None = None
                       ) -> tuple[str, list[int], SamplingParams, ToolPlan]:
    """The checks, in the order their errors take, then the prompt, its ids and the params;
    `admit=False` (a render) skips the checks of what is in flight (429, 503). A `raw_prompt`
    (Ollama's `raw` generate) goes to the model as it is, tokenized as /v1/completions
    tokenizes a prompt, in place of the chat template's; `prompt_ids` (a fill-in-the-middle
    prompt) go as they are."""
    chat = with_reasoning_effort(ctx, chat)
    plan = plan_tools(chat, ctx.tool_call_parser)
    structured = await structured_outputs(chat.response_format,
                                          has_tool_grammar=plan.structured is not None,
                                          tokenizer=ctx.grammar_tokenizer)
    if admit:
        ctx.check_capacity(n=chat.sampling.n)
    else:
        ctx.check_request_size(n=chat.sampling.n)
    if prompt_ids is None:
        prompt, ids = await chat_prompt_ids(ctx, chat, raw_prompt)
    else:
        prompt, ids = ctx.tokenizer.decode(prompt_ids, skip_special_tokens=False), prompt_ids
    fields = chat.sampling
    max_tokens = resolve_max_tokens(ctx, len(ids), fields.max_tokens,
                                    is_cap=fields.max_tokens_is_cap,
                                    context_limit=fields.context_limit,
                                    context_field=fields.context_field)
    kind = RequestOutputKind.DELTA if fields.stream else RequestOutputKind.FINAL_ONLY
    grammar = plan.structured if plan.structured is not None else structured
    is_call_list = plan.structured is not None and plan.mode == "required"
    after = grammar_after_reasoning(ctx, chat, prompt)
    if ctx.is_harmony:  # the grammar holds harmony's messages, the reasoning with them
        grammar, is_call_list = harmony_grammar(plan, structured), False
    elif grammar is not None and after is not None:
        grammar = replace(grammar, after_reasoning=after)
    params = sampling_params(ctx, fields, max_tokens=max_tokens, output_kind=kind,
                             structured=grammar,
                             # a forced list of calls, ended at an exact repeat
                             is_call_list=is_call_list)
    return prompt, ids, params, plan


async def chat_prompt_ids(ctx: ServerContext, chat: ChatInput, raw_prompt: str | None = None
                          ) -> tuple[str, list[int]]:
    """The prompt and its ids, as the engine gets them: the chat template's (or `raw_prompt`
    as it is), each image's marker expanded to its placeholders and the images tied to them
    (a `PromptIds`); what `count_tokens` and `/tokenize` count too."""
    images = await collect_images(ctx, chat)
    if raw_prompt is not None:
        if images:  # a raw prompt has no image markers: never drop the images in silence
            raise bad_request("images need the model's chat template, which places them in "
                              "the prompt; this prompt goes to the model as it is (raw, or a "
                              "model without a chat template)", images[0].where)
        return raw_prompt, ctx.tokenizer.encode(raw_prompt, add_special_tokens=True)
    prompt = render_prompt(ctx, chat)
    if not images:
        return prompt, ctx.tokenizer.encode(prompt, add_special_tokens=False)
    counts = image_token_counts(ctx.image_processor, images)
    # each image's marker becomes its placeholder tokens, as transformers' processors do
    prompt = expand_images(ctx.image_processor, prompt, counts)
    ids = ctx.tokenizer.encode(prompt, add_special_tokens=False)
    return prompt, await place_images(ctx.image_processor, images, ids, counts)
