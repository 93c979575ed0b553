"""A base model without a chat template, as a new user serves it: the real Gemma 3 270M GGUF
(which carries none) with no `--chat-template`. Ollama's generate completes the prompt as
/v1/completions does (Ollama's default template is the prompt itself), with `system` and a
blank line before it; every chat route answers a 400 that says how to give the model a
template and which routes work without one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest
from server_harness import RunningServer

from nanoserve.entrypoints.serving.chat_prompt import NO_CHAT_TEMPLATE

pytestmark = [pytest.mark.server, pytest.mark.slow]

MODEL = "gemma-base"
PROMPT = "Once upon a time"
SAMPLED = {"temperature": 0.8, "seed": 42}
HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def server(gemma_270m_gguf: Path) -> Iterator[RunningServer]:
    server = RunningServer(str(gemma_270m_gguf), "--served-model-name", MODEL,
                           "--max-model-len", "1024")
    yield server
    assert server.stop() == 0


def test_generate_completes_the_prompt_as_completions_does(server: RunningServer) -> None:
    talk = ollama.Client(host=server.url)
    completions = server.client().completions
    for prompt, system in ((PROMPT, None), (PROMPT, "You write fairy tales.")):
        expected = completions.create(
            model=MODEL, prompt=f"{system}\n\n{prompt}" if system else prompt, max_tokens=24,
            **SAMPLED).choices[0].text
        assert expected
        reply = talk.generate(model=MODEL, prompt=prompt, system=system,
                              options={**SAMPLED, "num_predict": 24})
        assert reply.response == expected
        streamed = "".join(part.response for part in talk.generate(
            model=MODEL, prompt=prompt, system=system, stream=True,
            options={**SAMPLED, "num_predict": 24}))
        assert streamed == expected


def test_chat_on_every_api_is_a_400_that_says_what_to_do(server: RunningServer) -> None:
    assert "--chat-template" in NO_CHAT_TEMPLATE and "/v1/completions" in NO_CHAT_TEMPLATE
    assert "http" not in NO_CHAT_TEMPLATE  # no link to a website
    with pytest.raises(openai.BadRequestError) as chat:
        server.client().chat.completions.create(model=MODEL, messages=HELLO,  # type: ignore[arg-type]
                                                max_tokens=4)
    assert chat.value.body["message"] == NO_CHAT_TEMPLATE  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match=r"NAME\.jinja beside"):
        server.client().responses.create(model=MODEL, input="Say hello.")
    with pytest.raises(anthropic.BadRequestError, match="--chat-template FILE"):
        anthropic.Anthropic(base_url=server.url, api_key="none").messages.create(
            model=MODEL, max_tokens=4, messages=HELLO)  # type: ignore[arg-type]
    with pytest.raises(ollama.ResponseError) as ollama_chat:
        ollama.Client(host=server.url).chat(model=MODEL, messages=HELLO)
    assert ollama_chat.value.status_code == 400 and ollama_chat.value.error == NO_CHAT_TEMPLATE
    rendered = httpx.post(server.url + "/v1/chat/completions/render", timeout=30,
                          json={"model": MODEL, "messages": HELLO})
    assert rendered.status_code == 400
