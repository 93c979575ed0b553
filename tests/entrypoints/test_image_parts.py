"""Image parts in-process: each wire format's image shape translated into the neutral image
part (its URL, and its place named as the client wrote it), Anthropic's and Responses' tool
results giving their images to a user turn after the tool messages (vLLM's way), and the
template messages a vision model's chat template reads (Qwen3.5's own template renders them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from nanoserve.entrypoints.anthropic.messages_request import messages_input
from nanoserve.entrypoints.anthropic.protocol import MessagesRequest
from nanoserve.entrypoints.ollama.chat_request import chat_input as ollama_chat_input
from nanoserve.entrypoints.ollama.chat_request import generate_input
from nanoserve.entrypoints.ollama.protocol import OllamaChatRequest, OllamaGenerateRequest
from nanoserve.entrypoints.openai.chat_request import chat_input
from nanoserve.entrypoints.openai.protocol import ChatCompletionRequest
from nanoserve.entrypoints.responses.protocol import ResponsesRequest
from nanoserve.entrypoints.responses.request import responses_input
from nanoserve.entrypoints.serving.chat_input import ChatInput, MessageInput, image_parts
from nanoserve.entrypoints.serving.chat_prompt import message_dicts
from nanoserve.entrypoints.serving.errors import APIError

QWEN35_TEMPLATE = Path(__file__).parents[1] / "data" / "qwen3_5_chat_template.jinja"
URL_A, URL_B, URL_C = "data:image/png;base64,QUFB", "https://example.com/b.png", \
    "data:image/gif;base64,Q0ND"
CALL = {"type": "tool_use", "id": "toolu_1", "name": "read", "input": {"path": "a.png"}}
CALL_2 = {**CALL, "id": "toolu_2"}


def images_of(chat: ChatInput) -> list[tuple[str, str | None]]:
    return [(where, part.image_url) for where, part in image_parts(chat.messages)]


def roles(chat: ChatInput) -> list[str]:
    return [message.role for message in chat.messages]


def refusal(call: Any) -> APIError:
    with pytest.raises(APIError) as caught:
        call()
    assert caught.value.status == 400
    return caught.value


def test_chat_completions_takes_both_image_url_forms() -> None:
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Compare"},
                                     {"type": "image_url", "image_url": {"url": URL_A,
                                                                         "detail": "high"}},
                                     {"type": "image_url", "image_url": URL_B}]}]})
    assert images_of(chat_input(req)) == [("messages.1.content.1", URL_A),
                                          ("messages.1.content.2", URL_B)]


def test_responses_input_image_and_a_tool_outputs_images() -> None:
    req = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Look"},
                                     {"type": "input_image", "image_url": URL_A}]},
        {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [
            {"type": "input_text", "text": "done"},
            {"type": "input_image", "image_url": {"url": URL_B}}]}]})
    chat = responses_input(req).chat
    assert roles(chat) == ["user", "assistant", "tool", "user"]
    assert chat.messages[2].content == "done"
    assert images_of(chat) == [("input.0.content.1", URL_A), ("input.2.output.1", URL_B)]
    by_file = ResponsesRequest.model_validate({"input": [{"role": "user", "content": [
        {"type": "input_image", "file_id": "file-1"}]}]})
    error = refusal(lambda: responses_input(by_file))
    assert error.param == "input.0.content.0.file_id"


def anthropic(messages: list[dict[str, Any]]) -> ChatInput:
    return messages_input(MessagesRequest.model_validate(
        {"model": "m", "max_tokens": 8, "messages": messages}))


def image(data: str = "QUFB", media_type: str = "image/png") -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": media_type,
                                        "data": data}}


def test_anthropic_images_in_a_turn_and_in_tool_results() -> None:
    """Two tool results with images, then text: the tool messages stay one run (templates
    group it), their images follow in one user turn in their order, then the text."""
    chat = anthropic([
        {"role": "user", "content": [{"type": "text", "text": "Read both"},
                                     {"type": "image", "source": {"type": "url", "url": URL_B}}]},
        {"role": "assistant", "content": [CALL, CALL_2]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "a.png"}, image("QUFB")]},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": [image("Q0ND",
                                                                                "image/gif")]},
            {"type": "text", "text": "What differs?"}]}])
    assert roles(chat) == ["user", "assistant", "tool", "tool", "user"]
    assert [message.content for message in chat.messages[2:4]] == ["a.png", ""]
    assert images_of(chat) == [("messages.0.content.1", URL_B),
                               ("messages.2.content.0.content.1", URL_A),
                               ("messages.2.content.1.content.0", URL_C)]
    last = chat.messages[4].content
    assert isinstance(last, tuple) and [part.type for part in last] == ["image", "image", "text"]


def test_anthropic_refuses_other_media_types_and_images_where_it_takes_none() -> None:
    error = refusal(lambda: anthropic([{"role": "user", "content": [image("QUFB",
                                                                          "image/bmp")]}]))
    assert error.param == "messages.0.content.0.source.media_type"
    assert "'image/bmp' is not supported; send one of image/jpeg, image/png, image/gif, " \
           "image/webp" in error.message
    error = refusal(lambda: anthropic([{"role": "user", "content": "Hi"},
                                       {"role": "assistant", "content": [image()]}]))
    assert error.param == "messages.1.content.0"


def test_ollama_images_follow_the_text() -> None:
    chat = ollama_chat_input(OllamaChatRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "Look", "images": ["QUFB", URL_C]}]}), "m", False)
    content = chat.messages[0].content
    assert isinstance(content, tuple) and [part.type for part in content] == \
        ["text", "image", "image"]
    assert images_of(chat) == [("messages.0.images.0", "data:;base64,QUFB"),
                               ("messages.0.images.1", URL_C)]
    generate = OllamaGenerateRequest.model_validate({"model": "m", "prompt": "Look",
                                                     "images": ["QUFB"], "system": "Brief."})
    assert images_of(generate_input(generate, "m", False)) == [("images.0",
                                                                "data:;base64,QUFB")]
    raw = generate.model_copy(update={"raw": True})
    assert refusal(lambda: generate_input(raw, "m", False)).param == "images"


def test_template_messages_keep_parts_in_order_for_a_vision_model(default_tokenizer: Any
                                                                  ) -> None:
    """Text parts join as before; a message with images keeps its parts as a list, which a
    vision model's template renders in order (Qwen3.5's: a vision pad per image)."""
    chat = anthropic([{"role": "user", "content": [
        {"type": "text", "text": "First"}, image(), {"type": "text", "text": "then"},
        image("Q0ND", "image/gif")]}])
    messages = message_dicts(chat.messages, accepts_images=True)
    assert messages[0]["content"] == [{"type": "text", "text": "First"}, {"type": "image"},
                                      {"type": "text", "text": "then"}, {"type": "image"}]
    text_only = [MessageInput("user", anthropic([{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]).messages[0].content)]
    assert message_dicts(text_only, accepts_images=True)[0]["content"] == "a\nb"
    rendered = default_tokenizer.apply_chat_template(
        messages, chat_template=QWEN35_TEMPLATE.read_text(), tokenize=False,
        add_generation_prompt=True)
    pad = "<|vision_start|><|image_pad|><|vision_end|>"
    assert f"First{pad}then{pad}" in rendered, rendered
    error = refusal(lambda: message_dicts(chat.messages))  # a text-only model
    assert error.message == "At most 0 image(s) may be provided in one prompt."
    assert error.param == "messages.0.content.1"
