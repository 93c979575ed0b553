"""`LLM.chat`'s images: a conversation's image parts (OpenAI's shapes: `image_url` with a data:
URL; vLLM's LLM.chat takes the same) made the engine's, through the server's own intake and
placement (serving/images.py, serving/image_prompt.py), so an offline prompt's ids and pixels
are the server's. A bad image is a ValueError naming the part, as the server's 400 does."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pydantic import ValidationError

from nanoserve.entrypoints.openai.chat_request import chat_input
from nanoserve.entrypoints.openai.protocol import ChatCompletionRequest
from nanoserve.entrypoints.serving.chat_prompt import message_dicts
from nanoserve.entrypoints.serving.errors import APIError
from nanoserve.entrypoints.serving.image_prompt import (
    PromptIds,
    expand_images,
    image_token_counts,
    place_images,
)
from nanoserve.entrypoints.serving.images import load_images
from nanoserve.server_config import ImageLimits


def has_image_parts(conversation: Sequence[dict[str, Any]]) -> bool:
    return any(isinstance(m.get("content"), list) and any(
        isinstance(p, dict) and p.get("type") in ("image_url", "input_image")
        for p in m["content"]) for m in conversation)


def chat_with_images(conversation: Sequence[dict[str, Any]], tokenizer: Any,
                     processor: Any, template_kwargs: dict[str, Any]) -> tuple[str, PromptIds]:
    """The rendered prompt and its ids with the images tied to their placeholders."""
    try:
        request = ChatCompletionRequest.model_validate({"messages": list(conversation)})
        messages = list(chat_input(request).messages)
    except ValidationError as e:
        raise ValueError(f"messages: {e}") from None
    try:  # (on a thread of its own: a caller's running event loop, Jupyter's, is left alone)
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, _prompt(messages, tokenizer, processor,
                                                    template_kwargs)).result()
    except APIError as e:
        raise ValueError(e.message if e.param is None else f"{e.param}: {e.message}") from None


async def _prompt(messages: list[Any], tokenizer: Any, processor: Any,
                  template_kwargs: dict[str, Any]) -> tuple[str, PromptIds]:
    images = await load_images(messages, ImageLimits(), accepts_images=processor is not None)
    counts = image_token_counts(processor, images)
    text = tokenizer.apply_chat_template(message_dicts(messages, accepts_images=True),
                                         tokenize=False, **template_kwargs)
    text = expand_images(processor, text, counts)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return text, await place_images(processor, images, ids, counts)
