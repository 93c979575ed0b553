"""The Messages event stream over raw HTTP, since the SDKs hide its framing: each event's name
and its data's type, the fields' JSON types, the order (message_start, ping, each block's
start / deltas / stop, message_delta, message_stop), and no `data: [DONE]`.

The server runs a tiny random-weight Qwen3 with reasoning tags, `--reasoning-parser qwen3` and
`--tool-call-parser hermes`; the `ScriptedOutput` logits processor (scripted_output.py) makes it
write a given text, so thinking, text and tool-call blocks come out of the real engine, parsers
and SSE deterministically. The official SDK reads the same streams back into the message the
non-streamed answer is.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from server_harness import RunningServer

HERE = Path(__file__).resolve().parent
MODEL = "tiny-thinker"
CALL_TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
             '{"city": "Paris"}}\n</tool_call>')
TOOLS = [{"name": "get_weather", "description": "The weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
NO_THINKING = {"type": "disabled"}


@pytest.fixture(scope="module")
def server(tiny_reasoning_model_dir: Path) -> Iterator[RunningServer]:
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("PYTHONPATH", str(HERE))  # where scripted_output lives
        server = RunningServer(str(tiny_reasoning_model_dir), "--served-model-name", MODEL,
                               "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes",
                               "--logits-processors", "scripted_output:ScriptedOutput")
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def tokenizer(tiny_reasoning_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_reasoning_model_dir))


def scripted_body(tokenizer: Any, text: str, **fields: Any) -> dict[str, Any]:
    """A request whose answer is `text`, then the end of the turn."""
    ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
    return {"model": MODEL, "max_tokens": 200, "stream": True,
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "extra_args": {"scripted_token_ids": ids}, **fields}


def read_events(server: RunningServer, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) pairs, with the framing checked: `event:` then `data:` then a blank
    line, the name equal to the data's type."""
    events = []
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=60,
                      headers={"anthropic-version": "2023-06-01"}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = list(response.iter_lines())
    for i in range(0, len(lines), 3):
        name, data, blank = [*lines[i:i + 3], "", "", ""][:3]
        assert name.startswith("event: ") and data.startswith("data: ") and blank == "", lines
        payload = json.loads(data[len("data: "):])
        assert payload["type"] == name[len("event: "):]
        events.append((payload["type"], payload))
    return events


def blocks_of(events: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each content block, from its start, deltas and stop (checked to nest and to count up)."""
    blocks: list[dict[str, Any]] = []
    open_index = None
    for name, data in events:
        if name == "content_block_start":
            assert open_index is None and data["index"] == len(blocks)
            open_index = data["index"]
            blocks.append({**data["content_block"], "deltas": []})
        elif name == "content_block_delta":
            assert data["index"] == open_index and isinstance(data["delta"], dict)
            blocks[-1]["deltas"].append(data["delta"])
        elif name == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
    assert open_index is None
    return blocks


def check_envelope(events: list[tuple[str, dict[str, Any]]], stop_reason: str) -> None:
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta",
                                                                        "message_stop"]
    assert set(names[2:-2]) <= {"content_block_start", "content_block_delta",
                                "content_block_stop"}
    message = events[0][1]["message"]
    assert message["id"].startswith("msg_") and message["type"] == "message"
    assert message["role"] == "assistant" and message["model"] == MODEL
    assert message["content"] == [] and message["stop_reason"] is None
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": stop_reason, "stop_sequence": None}
    for usage in (message["usage"], delta["usage"]):
        assert set(usage) == {"input_tokens", "output_tokens", "cache_creation_input_tokens",
                              "cache_read_input_tokens"}
        assert all(type(value) is int and value >= 0 for value in usage.values())
    assert delta["usage"]["output_tokens"] > 0 and message["usage"]["output_tokens"] == 0
    assert events[-1][1] == {"type": "message_stop"}


def test_a_text_answer(server: RunningServer, tokenizer: Any) -> None:
    events = read_events(server, scripted_body(tokenizer, "Hello there, friend.",
                                               thinking=NO_THINKING))
    check_envelope(events, "end_turn")
    (block,) = blocks_of(events)
    assert block["type"] == "text" and block["text"] == ""
    assert all(d["type"] == "text_delta" and isinstance(d["text"], str) for d in block["deltas"])
    assert "".join(d["text"] for d in block["deltas"]) == "Hello there, friend."


def test_thinking_then_text(server: RunningServer, tokenizer: Any) -> None:
    events = read_events(server, scripted_body(tokenizer, "I should greet.</think>Hello!",
                                               thinking={"type": "enabled",
                                                         "budget_tokens": 100}))
    check_envelope(events, "end_turn")
    thinking, text = blocks_of(events)
    assert thinking["type"] == "thinking" and thinking["thinking"] == ""
    assert {d["type"] for d in thinking["deltas"]} == {"thinking_delta"}
    assert "".join(d["thinking"] for d in thinking["deltas"]).strip() == "I should greet."
    assert "".join(d["text"] for d in text["deltas"]).strip() == "Hello!"


def test_a_tool_call(server: RunningServer, tokenizer: Any) -> None:
    events = read_events(server, scripted_body(tokenizer, CALL_TEXT, tools=TOOLS,
                                               thinking=NO_THINKING))
    check_envelope(events, "tool_use")
    text, call = blocks_of(events)
    assert "".join(d["text"] for d in text["deltas"]).strip() == "Let me check."
    assert call["type"] == "tool_use" and call["name"] == "get_weather"
    assert isinstance(call["id"], str) and call["id"] and call["input"] == {}
    assert {d["type"] for d in call["deltas"]} == {"input_json_delta"}
    assert json.loads("".join(d["partial_json"] for d in call["deltas"])) == {"city": "Paris"}


def test_the_sdk_reads_the_stream_into_the_whole_message(server: RunningServer,
                                                         tokenizer: Any) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    body = scripted_body(tokenizer, "Thinking it over.</think>" + CALL_TEXT, tools=TOOLS)
    fields = {"model": MODEL, "max_tokens": 200, "messages": body["messages"], "tools": TOOLS,
              "extra_body": {"extra_args": body["extra_args"]}}
    whole = client.messages.create(**fields)
    with client.messages.stream(**fields) as stream:
        streamed = stream.get_final_message()
    assert [b.type for b in whole.content] == ["thinking", "text", "tool_use"]
    assert [b.type for b in streamed.content] == ["thinking", "text", "tool_use"]
    assert whole.content[2].input == streamed.content[2].input == {"city": "Paris"}
    assert whole.content[2].name == streamed.content[2].name == "get_weather"
    assert whole.stop_reason == streamed.stop_reason == "tool_use"
    assert whole.usage.output_tokens == streamed.usage.output_tokens
