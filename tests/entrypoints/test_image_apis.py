"""Images on every API, on the real server and the default (text-only) model, driven by the
official SDKs: an image in each API's own shape (chat completions' `image_url`, both forms;
Responses' `input_image`; Anthropic's image block, in a user turn and inside a `tool_result`;
Ollama's `images` on chat and generate) is a 400 in that API's error shape carrying vLLM's
"At most 0 image(s) may be provided in one prompt." and naming the part as the client wrote
it; what only a wire format can get wrong (Anthropic's media types, Responses' `file_id`,
Ollama's `raw`) is named too; bad image bytes, huge headers and remote URLs never reach a
decoder or the network; and after all of it the server still answers a plain chat.

How each refusal reads when the model takes images (decoding, fetching, limits) is
test_image_input.py's, in-process. One server: the default model with no flags, shared with
the modules that start the same (`shared_server.py`).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest
from image_files import png_header
from PIL import Image
from server_harness import RunningServer, wait_until
from shared_server import shared_server

from nanoserve.config import DEFAULT_MODEL_NAME

pytestmark = pytest.mark.slow

MODEL = DEFAULT_MODEL_NAME
AT_MOST_0 = "At most 0 image(s) may be provided in one prompt."


def png_bytes() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(out, "PNG")
    return out.getvalue()




PNG = png_bytes()
B64 = base64.b64encode(PNG).decode()
DATA_URL = f"data:image/png;base64,{B64}"
ASK = "What is in this picture?"
CALL = {"type": "tool_use", "id": "toolu_1", "name": "read", "input": {"path": "shot.png"}}
TOOLS = [{"name": "read", "description": "Read a file",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]


def anthropic_image(data: str = B64, media_type: str = "image/png") -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": media_type,
                                        "data": data}}


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> RunningServer:
    return shared_server(request)  # the default model, no flags


@pytest.fixture(scope="module")
def oai(server: RunningServer) -> openai.OpenAI:
    return server.client(timeout=60)


@pytest.fixture(scope="module")
def claude(server: RunningServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def llama(server: RunningServer) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=60)


def openai_error(call: Callable[[], Any]) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    body = caught.value.body
    assert isinstance(body, dict), body
    return body


def anthropic_message(call: Callable[[], Any]) -> str:
    with pytest.raises(anthropic.BadRequestError) as caught:
        call()
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "error", body
    assert body["error"]["type"] == "invalid_request_error", body
    return str(body["error"]["message"])


def ollama_message(call: Callable[[], Any]) -> str:
    with pytest.raises(ollama.ResponseError) as caught:
        call()
    assert caught.value.status_code == 400, caught.value
    return caught.value.error


# each API's own shape -----------------------------------------------------------------------


@pytest.mark.parametrize("image_url", [{"url": DATA_URL, "detail": "low"}, DATA_URL],
                         ids=["object", "bare-string"])
def test_chat_completions_image_url(oai: openai.OpenAI, image_url: Any) -> None:
    messages: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [
        {"type": "text", "text": ASK}, {"type": "image_url", "image_url": image_url}]}]
    for stream in (False, True):
        error = openai_error(lambda stream=stream: oai.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, stream=stream))
        assert error["message"] == AT_MOST_0 and error["param"] == "messages.1.content.1", error


def test_responses_input_image(oai: openai.OpenAI) -> None:
    content: Any = [{"type": "input_text", "text": ASK},
                    {"type": "input_image", "image_url": DATA_URL, "detail": "auto"}]
    error = openai_error(lambda: oai.responses.create(
        model=MODEL, input=[{"role": "user", "content": content}], max_output_tokens=8))
    assert error["message"] == AT_MOST_0 and error["param"] == "input.0.content.1", error
    by_file: Any = [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]
    error = openai_error(lambda: oai.responses.create(model=MODEL, input=by_file))
    assert error["param"] == "input.0.content.0.file_id", error
    assert "file_id is not supported; send the image as image_url" in error["message"]


def test_anthropic_image_blocks(claude: anthropic.Anthropic) -> None:
    """In a user turn, inside a tool_result (Claude Code's Read tool on a screenshot), and
    counted by count_tokens the same way."""
    turn: Any = [{"role": "user", "content": [{"type": "text", "text": ASK},
                                              anthropic_image()]}]
    says = anthropic_message(lambda: claude.messages.create(model=MODEL, max_tokens=8,
                                                            messages=turn))
    assert says == f"messages.0.content.1: {AT_MOST_0}"
    says = anthropic_message(lambda: claude.messages.count_tokens(model=MODEL, messages=turn))
    assert says == f"messages.0.content.1: {AT_MOST_0}"
    url_turn: Any = [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]
    says = anthropic_message(lambda: claude.messages.create(model=MODEL, max_tokens=8,
                                                            messages=url_turn))
    assert says == f"messages.0.content.0: {AT_MOST_0}"
    read: Any = [{"role": "user", "content": "Look at shot.png"},
                 {"role": "assistant", "content": [CALL]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                               "content": [{"type": "text", "text": "shot.png"},
                                                           anthropic_image()]}]}]
    says = anthropic_message(lambda: claude.messages.create(model=MODEL, max_tokens=8,
                                                            messages=read, tools=TOOLS))
    assert says == f"messages.2.content.0.content.1: {AT_MOST_0}"


def test_anthropic_media_types_are_anthropics(claude: anthropic.Anthropic) -> None:
    turn: Any = [{"role": "user", "content": [anthropic_image(media_type="image/bmp")]}]
    says = anthropic_message(lambda: claude.messages.create(model=MODEL, max_tokens=8,
                                                            messages=turn))
    assert says.startswith("messages.0.content.0.source.media_type: 'image/bmp' is not "
                           "supported; send one of image/jpeg, image/png, image/gif, "
                           "image/webp"), says


def test_ollama_images(llama: ollama.Client) -> None:
    says = ollama_message(lambda: llama.chat(model=MODEL, messages=[
        {"role": "user", "content": ASK, "images": [PNG]}]))
    assert says == f"messages.0.images.0: {AT_MOST_0}"
    says = ollama_message(lambda: llama.generate(model=MODEL, prompt=ASK, images=[PNG, PNG]))
    assert says == f"images.0: {AT_MOST_0}"
    says = ollama_message(lambda: llama.generate(model=MODEL, prompt=ASK, images=[PNG],
                                                 raw=True))
    assert says.startswith("images need the chat template, which raw: true skips"), says


# bad images never reach a decoder or the network; the server is unharmed -------------------


@pytest.mark.parametrize("url", [
    f"data:image/png;base64,{base64.b64encode(PNG[:len(PNG) // 2]).decode()}",  # truncated
    f"data:image/png;base64,{base64.b64encode(png_header(20_000, 20_000)).decode()}",
    "data:text/plain;base64,aGVsbG8=",
    "data:image/png;base64,!!!",
    "https://example.com/cat.png",  # no --allowed-media-domains: never fetched
    "file:///etc/passwd",
], ids=["truncated", "20000x20000", "text-plain", "bad-base64", "remote", "file"])
def test_bad_images_are_refused_by_the_count_first(server: RunningServer, url: str) -> None:
    """A text-only model takes no image, so the first check (the count) answers: what the
    client is told to fix is the one thing that would make any of these work."""
    response = server.post("/v1/chat/completions", {"model": MODEL, "max_tokens": 8, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]},
        timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"] == {"message": AT_MOST_0, "type": "BadRequestError",
                                        "param": "messages.0.content.0", "code": 400}


def test_tokenize_refuses_images_too(server: RunningServer) -> None:
    response = server.post("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": DATA_URL}}]}]})
    assert response.status_code == 400 and AT_MOST_0 in response.text, response.text


def test_the_server_still_answers_after_every_refusal(server: RunningServer,
                                                      oai: openai.OpenAI) -> None:
    """Runs after the refusals above (file order): nothing leaked, nothing stalled."""
    reply = oai.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                        messages=[{"role": "user", "content": "Hi"}])
    assert reply.choices[0].message.content and reply.usage is not None
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    wait_until(lambda: server.metric("nanoserve:num_requests_running") == 0,
               "no request left running")
