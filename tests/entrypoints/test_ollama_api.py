"""Ollama's API (`/api/*`) on the real server and the default model, driven by the official
`ollama` client: the listings describe the served file, chat and generate say what the OpenAI
routes say for the same greedy request (whole and streamed), formats hold, embeddings equal
/v1/embeddings', the options cap and stop the output, and every refusal is Ollama's error
shape with the right status. Plus `parse_keep_alive` on its own.

One server for the file: the default model with no flags, shared with the modules that start
the same (`shared_server.py`).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import numpy as np
import ollama
import openai
import pytest
from server_harness import RunningServer
from shared_server import shared_server

from nanoserve.config import DEFAULT_MODEL_NAME
from nanoserve.entrypoints.ollama.keep_alive import DEFAULT_KEEP_ALIVE_S, parse_keep_alive
from nanoserve.entrypoints.serving.errors import APIError

MODEL = DEFAULT_MODEL_NAME
GREEDY = {"temperature": 0, "seed": 7}
ASK = [{"role": "user", "content": "Name three colors of the rainbow."}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> RunningServer:
    return shared_server(request)  # the default model, no flags


@pytest.fixture(scope="module")
def client(server: RunningServer) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=120)


@pytest.fixture(scope="module")
def oai(server: RunningServer) -> openai.OpenAI:
    return server.client(timeout=120)


def openai_text(oai: openai.OpenAI, messages: list[dict[str, Any]], max_tokens: int) -> str:
    reply = oai.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                        max_tokens=max_tokens, temperature=0, seed=7)
    return reply.choices[0].message.content or ""


# parse_keep_alive: no server


@pytest.mark.parametrize(("value", "seconds"), [
    (None, DEFAULT_KEEP_ALIVE_S), ("5m", 300.0), ("1h30m", 5400.0), ("10s", 10.0),
    ("1.5h", 5400.0), ("300ms", 0.3), ("2m30.5s", 150.5), ("0", 0.0), ("0s", 0.0), (0, 0.0),
    (90, 90.0), (2.5, 2.5), ("300", 300.0), (" 5m ", 300.0), ("+1m", 60.0),
    (-1, None), ("-1m", None), ("-5", None)])
def test_keep_alive_as_seconds(value: object, seconds: float | None) -> None:
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["", "5x", "m", "5 m", "1h-3m", "forever", "1e400",
                                   float("nan"), float("inf"), True, [5], {"m": 5}])
def test_keep_alive_refuses_what_is_no_duration(value: object) -> None:
    with pytest.raises(APIError) as refused:
        parse_keep_alive(value)
    assert refused.value.status == 400 and refused.value.param == "keep_alive"
    assert "keep_alive must be a duration" in refused.value.message


# the listings


def test_version_tags_ps_and_show_describe_the_served_file(server: RunningServer,
                                                           client: ollama.Client) -> None:
    version = httpx.get(server.url + "/api/version", timeout=10).json()["version"]
    # the Ollama release whose API the routes answer: Codex's --oss refuses one below 0.13.4
    assert tuple(int(part) for part in version.split(".")) >= (0, 13, 4)
    listed = client.list().models
    assert [m.model for m in listed] == [MODEL]
    details = listed[0].details
    assert details is not None
    assert (details.format, details.family, details.quantization_level,
            details.parameter_size) == ("gguf", "llama", "Q4_1", "135M")
    assert listed[0].size and listed[0].size > 50_000_000  # the Q4_1 file: ~98 MB
    assert listed[0].digest and len(listed[0].digest) == 64
    running = client.ps().models
    assert [(m.model, m.size_vram, m.context_length) for m in running] == [(MODEL, 0, 8192)]
    assert running[0].digest == listed[0].digest and running[0].expires_at is not None
    shown = client.show(MODEL)
    assert shown.modelinfo is not None
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["llama.context_length"] == 8192
    assert shown.capabilities is not None and "completion" in shown.capabilities
    assert "thinking" not in shown.capabilities  # no --reasoning-parser
    assert shown.template and "<|im_start|>" in shown.template
    assert shown.modelfile and shown.modelfile.count("FROM ") == 1
    assert client.show(MODEL + ":latest").details == shown.details


def test_an_unknown_model_is_a_404(client: ollama.Client) -> None:
    for call in (lambda: client.show("llama3.2"),
                 lambda: client.chat(model="llama3.2", messages=ASK, stream=False),
                 lambda: client.generate(model="llama3.2", prompt="Hi"),
                 lambda: client.embed(model="llama3.2", input="Hi")):
        with pytest.raises(ollama.ResponseError) as refused:
            call()
        assert refused.value.status_code == 404
        assert 'model "llama3.2" not found' in refused.value.error


def test_a_pull_of_the_served_model_is_done_at_once(client: ollama.Client) -> None:
    """Clients that pull before they chat: the served model is here, so its pull succeeds
    (streamed or not); another name is a 404, saying where models are pulled."""
    assert [p.status for p in client.pull(MODEL, stream=True)] == ["success"]
    assert client.pull(MODEL + ":latest").status == "success"
    for name in ("llama3.2", "gpt-oss:20b"):
        with pytest.raises(ollama.ResponseError, match="--models-dir") as refused:
            client.pull(name)
        assert refused.value.status_code == 404


# chat and generate: the same text as the OpenAI routes


def test_chat_says_what_chat_completions_says(client: ollama.Client,
                                              oai: openai.OpenAI) -> None:
    expected = openai_text(oai, ASK, 16)
    whole = client.chat(model=MODEL, messages=ASK, stream=False,
                        options={**GREEDY, "num_predict": 16})
    assert whole.message.role == "assistant" and whole.message.content == expected
    assert whole.done and whole.done_reason == "length" and whole.eval_count == 16
    assert whole.prompt_eval_count and whole.prompt_eval_count > 5
    assert whole.total_duration and whole.eval_duration and whole.prompt_eval_duration
    parts = list(client.chat(model=MODEL, messages=ASK, stream=True,
                             options={**GREEDY, "num_predict": 16}))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content or "" for p in parts) == expected
    assert (parts[-1].done_reason, parts[-1].eval_count) == ("length", 16)


def test_generate_is_a_user_turn_through_the_template(client: ollama.Client,
                                                      oai: openai.OpenAI) -> None:
    system = "You answer in one short sentence."
    prompt = "Why is the sky blue?"
    expected = openai_text(oai, [{"role": "system", "content": system},
                                 {"role": "user", "content": prompt}], 12)
    whole = client.generate(model=MODEL, prompt=prompt, system=system, stream=False,
                            options={**GREEDY, "num_predict": 12})
    assert whole.response == expected and whole.done_reason == "length"
    streamed = list(client.generate(model=MODEL, prompt=prompt, system=system, stream=True,
                                    options={**GREEDY, "num_predict": 12}))
    assert "".join(p.response or "" for p in streamed) == expected
    assert streamed[-1].done and streamed[-1].eval_count == 12


def test_raw_generate_is_a_completion(client: ollama.Client, oai: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    expected = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                      temperature=0).choices[0].text
    raw = client.generate(model=MODEL, prompt=prompt, raw=True, options={**GREEDY,
                                                                         "num_predict": 8})
    assert raw.response == expected


def test_tool_turns_render_as_chat_completions_renders_them(server: RunningServer,
                                                            oai: openai.OpenAI) -> None:
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}]
    asked = {"role": "user", "content": "What is the weather in Paris?"}
    result = "18 degrees and sunny"
    # raw HTTP: the ollama client rewrites the tools' schemas (its own field order), which
    # changes the prompt's text; this compares the translation of the same tools
    ours = server.post("/api/chat", {
        "model": MODEL, "tools": tools, "stream": False,
        "options": {**GREEDY, "num_predict": 12},
        "messages": [asked, {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                     {"role": "tool", "content": result, "tool_name": "get_weather"}]}).json()
    theirs = oai.chat.completions.create(
        model=MODEL, tools=tools, max_tokens=12, temperature=0, seed=7,  # type: ignore[arg-type]
        messages=[asked, {"role": "assistant", "content": "", "tool_calls": [  # type: ignore[list-item]
            {"id": "call_1_0", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                  {"role": "tool", "content": result, "tool_call_id": "call_1_0"}])
    their_message = theirs.choices[0].message
    assert ours["message"]["content"] == (their_message.content or "")
    assert [call["function"]["name"] for call in ours["message"].get("tool_calls", [])] == [
        call.function.name for call in their_message.tool_calls or []]  # type: ignore[union-attr]
    for call in ours["message"].get("tool_calls", []):  # Ollama's shape: arguments an object
        assert isinstance(call["function"]["arguments"], dict)


# formats and options


def test_a_schema_format_holds(client: ollama.Client) -> None:
    reply = client.chat(model=MODEL, format=PERSON, options={**GREEDY, "num_predict": 60},
                        messages=[{"role": "user", "content": "Invent a person as JSON."}])
    jsonschema.validate(json.loads(reply.message.content or ""), PERSON)
    generated = client.generate(model=MODEL, format="json",
                                prompt="Reply with a JSON object with one key, ok, set to true.",
                                options={**GREEDY, "num_predict": 80})
    assert generated.done_reason == "stop" and isinstance(json.loads(generated.response), dict)


def test_stop_strings_stop_and_num_ctx_bounds(client: ollama.Client) -> None:
    free = client.generate(model=MODEL, prompt="Count from one to ten in words.",
                           options={**GREEDY, "num_predict": 24}).response
    words = free.split()
    assert len(words) > 3, free
    stop = words[2]
    stopped = client.generate(model=MODEL, prompt="Count from one to ten in words.",
                              options={**GREEDY, "num_predict": 24, "stop": [stop]})
    assert stopped.response == free[:free.index(stop)] and stopped.done_reason == "stop"
    roomy = client.generate(model=MODEL, prompt="Hi", options={**GREEDY, "num_predict": 2,
                                                               "num_ctx": 131072})
    assert roomy.eval_count == 2  # past the server's context: held to it, as Ollama does
    with pytest.raises(ollama.ResponseError) as refused:
        client.generate(model=MODEL, prompt="Count from one to ten in words.",
                        options={"num_ctx": 4})
    assert refused.value.status_code == 400 and "options.num_ctx" in refused.value.error


# embeddings


def test_embed_equals_v1_embeddings(client: ollama.Client, oai: openai.OpenAI) -> None:
    texts = ["The cat sat on the mat.", "Paris is the capital of France."]
    theirs = np.array([d.embedding for d in oai.embeddings.create(
        model=MODEL, input=texts, encoding_format="float").data])
    several = client.embed(model=MODEL, input=texts)
    assert np.allclose(np.array(several.embeddings), theirs, atol=1e-5)
    assert several.prompt_eval_count and several.prompt_eval_count > 8
    one = client.embed(model=MODEL, input=texts[0])
    assert np.allclose(np.array(one.embeddings), theirs[:1], atol=1e-5)
    legacy = client.embeddings(model=MODEL, prompt=texts[1])
    assert np.allclose(np.array(legacy.embedding), theirs[1], atol=1e-5)


# loading, unloading and refusals


def test_empty_requests_only_load_or_unload(client: ollama.Client) -> None:
    assert client.generate(model=MODEL).done_reason == "load"
    assert client.generate(model=MODEL, keep_alive=0).done_reason == "unload"
    assert client.chat(model=MODEL, messages=[], keep_alive="5m").done_reason == "load"
    assert client.chat(model=MODEL, messages=[], keep_alive=0).done_reason == "unload"
    assert client.embed(model=MODEL, input="").embeddings == []


@pytest.mark.parametrize(("path", "body", "status", "says"), [
    ("/api/chat", {"messages": ASK, "think": True}, 400,
     f'"{MODEL}" does not support thinking'),
    ("/api/chat", {"messages": [{**ASK[0], "images": ["iVBORw0KGgo="]}]}, 400,
     "messages.0.images.0: At most 0 image(s) may be provided in one prompt."),
    ("/api/generate", {"prompt": "Hi", "images": ["iVBORw0KGgo="]}, 400,
     "images.0: At most 0 image(s) may be provided in one prompt."),
    ("/api/generate", {"prompt": "Hi", "images": ["iVBORw0KGgo="], "raw": True}, 400,
     "images need the chat template, which raw: true skips"),
    ("/api/generate", {"prompt": "def f(", "suffix": "return x"}, 400, "does not support insert"),
    ("/api/generate", {"prompt": "Hi", "keep_alive": "soon"}, 400,
     "keep_alive must be a duration"),
    ("/api/chat", {"messages": ASK, "options": {"temperature": -1}}, 400,
     "options.temperature must be >= 0"),
    ("/api/chat", {"messages": ASK, "options": {"num_predict": 0}}, 400,
     "options.num_predict must be >= 1"),
    ("/api/chat", {"messages": ASK, "format": "yaml"}, 400, 'format must be "json"'),
    ("/api/chat", {"messages": ASK, "format": {"type": "wizard"}}, 400, "format"),
    ("/api/chat", {"model": None, "messages": ASK}, 400, "model is required"),
    ("/api/pull", {"model": "llama3.2"}, 404, "cannot pull 'llama3.2' here"),
    ("/api/pull", {"model": None}, 400, "model is required"),
])
def test_refusals_are_ollamas_error_shape(server: RunningServer, path: str,
                                          body: dict[str, Any], status: int,
                                          says: str) -> None:
    response = server.post(path, {"model": MODEL, "stream": False, **body})
    assert response.status_code == status, response.text
    assert list(response.json()) == ["error"] and says in response.json()["error"]


@pytest.mark.parametrize(("options", "says"), [
    ({"tfs_z": 0.9}, "options.tfs_z=0.9 asks for tail-free sampling"),
    ({"presence_penalty": 0.5, "penalize_newline": False}, "options.penalize_newline"),
    # llama.cpp's samplers are run, their ranges checked in this API's words
    ({"typical_p": 1.5}, "options.typical_p must be in (0, 1]"),
    ({"mirostat": 3}, "options.mirostat must be 0 (off), 1 (Mirostat) or 2"),
    ({"repeat_last_n": -2}, "options.repeat_last_n must be -1"),
    ({"dry_multiplier": 0.8, "dry_base": 0.5}, "options.dry_base must be >= 1"),
])
def test_options_that_would_change_sampling_are_refused_by_name(
        client: ollama.Client, options: dict[str, Any], says: str) -> None:
    """An option this server does not implement, or a value out of its range, is a 400
    naming it, never dropped."""
    with pytest.raises(ollama.ResponseError) as refused:
        client.generate(model=MODEL, prompt="Hi", options=options)
    assert refused.value.status_code == 400 and says in refused.value.error


def test_options_at_their_neutral_values_change_nothing(client: ollama.Client) -> None:
    """Clients send Ollama's defaults: at their neutral values the options are accepted and
    the answer is the one without them."""
    plain = client.generate(model=MODEL, prompt="The sky is",
                            options={**GREEDY, "num_predict": 8}).response
    neutral = {"typical_p": 1.0, "tfs_z": 1.0, "mirostat": 0, "mirostat_tau": 5.0,
               "mirostat_eta": 0.1, "repeat_last_n": 64, "penalize_newline": True,
               "num_keep": 4, "num_thread": 2, "num_batch": 512}
    assert client.generate(model=MODEL, prompt="The sky is",
                           options={**GREEDY, "num_predict": 8, **neutral}).response == plain
    # a window over the whole context, and Ollama's default window of 64
    for window in (-1, 64, None):
        assert client.generate(model=MODEL, prompt="The sky is", options={
            **GREEDY, "num_predict": 8, "repeat_penalty": 1.1, "repeat_last_n": window}).done


def test_a_body_without_the_json_type_is_read_as_json(server: RunningServer) -> None:
    # Ollama's docs' curl examples send curl's form type: Ollama reads the body as JSON
    body = json.dumps({"model": MODEL, "prompt": "Hi", "stream": False,
                       "options": {"num_predict": 2}})
    response = httpx.post(server.url + "/api/generate", content=body, timeout=60,
                          headers={"content-type": "application/x-www-form-urlencoded"})
    assert response.status_code == 200 and response.json()["eval_count"] == 2
