"""Steps that commit several tokens, through the real server and the official `openai` SDK.

The server runs with the test-only proposer (scripted_drafts.py): a request that carries
`extra_args.draft_script` (the true continuation, as the offline engine writes it, with junk
after it) is verified several tokens a step; one without a script runs a token a step. Both
must answer alike, field by field: text, finish and stop reasons, logprobs, usage, the streamed
text and the token counter, with a stop string, a stop token id, EOS and `max_tokens` each
landing inside a window.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from scripted_drafts import GARBAGE_TOKEN
from server_harness import RunningServer

from nanoserve import LLM, SamplingParams

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent
MODEL = "SmolLM2-135M-Instruct"
COUNT = "1, 2, 3, 4, 5,"
QUESTION = "Q: What is the capital of France?\nA:"  # greedy: an answer, then EOS


@pytest.fixture(scope="module")
def server_and_scripts() -> Iterator[tuple[RunningServer, dict[str, list[int]]]]:
    """The server, and each prompt's greedy continuation (40 tokens or to EOS) from the
    offline engine, computed here while the server starts in its own processes."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("PYTHONPATH", str(HERE))  # where scripted_drafts lives
        running = RunningServer("--draft-proposer", "scripted_drafts:ScriptedDrafts",
                                "--speculative-max-rows", "256",  # every draft taken
                                wait=False)
    try:
        llm = LLM(quantization="gguf")
        params = SamplingParams(temperature=0.0, max_tokens=40)
        scripts = {prompt: out.outputs[0].token_ids + [GARBAGE_TOKEN] * 8
                   for prompt, out in zip((COUNT, QUESTION),
                                          llm.generate([COUNT, QUESTION], params), strict=True)}
        del llm
        running.wait_healthy()
        yield running, scripts
    finally:
        code = running.stop()
    assert code == 0


@pytest.fixture(scope="module")
def server(server_and_scripts: tuple[RunningServer, dict[str, list[int]]]) -> RunningServer:
    return server_and_scripts[0]


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def scripts(server_and_scripts: tuple[RunningServer, dict[str, list[int]]]
            ) -> dict[str, list[int]]:
    return server_and_scripts[1]


def _fields(completion: Any) -> tuple[Any, ...]:
    choice = completion.choices[0]
    logprobs = choice.logprobs
    return (choice.text, choice.finish_reason, getattr(choice, "stop_reason", None),
            logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs,
            completion.usage.completion_tokens, completion.usage.prompt_tokens)


CASES = {
    "length": (COUNT, {"max_tokens": 13}),
    "stop_string": (COUNT, {"max_tokens": 40, "stop": [" 9,"]}),
    "stop_token_id": (COUNT, {"max_tokens": 40, "extra_stop_token_ids_at": 9}),
    "eos": (QUESTION, {"max_tokens": 40}),
}


def _case(name: str, scripts: dict[str, list[int]]) -> tuple[str, dict[str, Any]]:
    prompt, fields = CASES[name]
    fields = dict(fields)
    at = fields.pop("extra_stop_token_ids_at", None)
    if at is not None:  # the continuation's 10th token stops it
        fields["extra_body"] = {"stop_token_ids": [scripts[prompt][at]]}
    return prompt, fields


def _merge_extra(script: list[int] | None, fields: dict[str, Any]) -> dict[str, Any]:
    body = dict(fields.pop("extra_body", {}))
    if script is not None:
        body["extra_args"] = {"draft_script": script}
    return {**fields, "extra_body": body}


@pytest.mark.parametrize("name", list(CASES))
def test_drafted_completion_equals_the_one_token_one(client: openai.OpenAI, server: Any,
                                                     scripts: dict[str, list[int]],
                                                     name: str) -> None:
    prompt, fields = _case(name, scripts)
    plain = client.completions.create(model=MODEL, prompt=prompt, temperature=0, logprobs=2,
                                      **_merge_extra(None, dict(fields)))
    before = server.metric("nanoserve:generation_tokens_total")
    drafted = client.completions.create(model=MODEL, prompt=prompt, temperature=0, logprobs=2,
                                        **_merge_extra(scripts[prompt], dict(fields)))
    counted = server.metric("nanoserve:generation_tokens_total") - before
    assert _fields(drafted) == _fields(plain)
    assert counted == drafted.usage.completion_tokens  # tokens after a stop are not counted
    expected_finish = "length" if name == "length" else "stop"
    assert plain.choices[0].finish_reason == expected_finish


@pytest.mark.parametrize("name", ["stop_string", "eos"])
def test_drafted_stream_equals_the_one_token_stream(client: openai.OpenAI,
                                                    scripts: dict[str, list[int]],
                                                    name: str) -> None:
    prompt, fields = _case(name, scripts)

    def stream(script: list[int] | None) -> tuple[str, str | None, Any]:
        chunks = list(client.completions.create(
            model=MODEL, prompt=prompt, temperature=0, stream=True,
            stream_options={"include_usage": True}, **_merge_extra(script, dict(fields))))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        return text, finish, chunks[-1].usage.completion_tokens

    assert stream(scripts[prompt]) == stream(None)


def test_drafted_chat_equals_the_one_token_chat(client: openai.OpenAI,
                                                server: RunningServer) -> None:
    """The chat's script is its answer tokenized again (not always the ids the model wrote:
    the drafts that differ are rejected, and the answer stays the same)."""
    messages = [{"role": "user", "content": "Count from 1 to 10."}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                           max_tokens=30)
    tokens = server.post("/tokenize", {"model": MODEL, "prompt": plain.choices[0].message.content,
                                       "add_special_tokens": False}).json()["tokens"]
    drafted = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=30,
        extra_body={"extra_args": {"draft_script": tokens}})
    assert drafted.choices[0].message.content == plain.choices[0].message.content
    assert drafted.choices[0].finish_reason == plain.choices[0].finish_reason
    # (the second finds the first's prompt in the prefix cache: only cached_tokens differs)
    assert (drafted.usage.prompt_tokens, drafted.usage.completion_tokens) == (
        plain.usage.prompt_tokens, plain.usage.completion_tokens)
