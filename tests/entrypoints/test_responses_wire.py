"""The Responses API's event stream over raw HTTP, on the default model: the framing (`event:`
and `data:` lines, no `[DONE]`), the event names and their order, each event's field types, and
`sequence_number` counting up from 0. The SDKs hide all of this; Codex reads it directly."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from server_harness import API_KEY, RunningServer
from shared_server import shared_server

MODEL = "SmolLM2-135M-Instruct"
pytestmark = pytest.mark.slow
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
# fields every event of a type carries, with their types
FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "response.created": {"response": dict}, "response.in_progress": {"response": dict},
    "response.output_item.added": {"output_index": int, "item": dict},
    "response.content_part.added": {"item_id": str, "output_index": int, "content_index": int,
                                    "part": dict},
    "response.output_text.delta": {"item_id": str, "output_index": int, "content_index": int,
                                   "delta": str, "logprobs": list},
    "response.output_text.done": {"item_id": str, "output_index": int, "content_index": int,
                                  "text": str},
    "response.content_part.done": {"item_id": str, "output_index": int, "part": dict},
    "response.function_call_arguments.delta": {"item_id": str, "output_index": int,
                                               "delta": str},
    "response.function_call_arguments.done": {"item_id": str, "output_index": int,
                                              "arguments": str, "name": str},
    "response.output_item.done": {"output_index": int, "item": dict},
    "response.completed": {"response": dict}, "response.incomplete": {"response": dict},
}


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> RunningServer:
    # test_responses_api's server: a longer context and an API key (sent below) change nothing
    # in the events' framing
    return shared_server(request, "--max-model-len", "4096", api_key=API_KEY)


def stream(server: RunningServer, **fields: Any) -> list[dict[str, Any]]:
    """The stream's events, each checked for framing: an `event:` line naming the type of the
    `data:` line after it, blocks ended by a blank line."""
    body = {"model": MODEL, "stream": True, "temperature": 0, **fields}
    events = []
    with httpx.stream("POST", server.url + "/v1/responses", json=body, headers=server.headers,
                      timeout=120) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        text = answer.read().decode()
    assert text.endswith("\n\n") and "[DONE]" not in text
    for block in text.split("\n\n")[:-1]:
        name_line, data_line = block.split("\n")
        assert name_line.startswith("event: ") and data_line.startswith("data: ")
        event = json.loads(data_line[len("data: "):])
        assert event["type"] == name_line[len("event: "):]
        events.append(event)
    return events


def check_types(events: list[dict[str, Any]]) -> None:
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        for name, kind in FIELDS[event["type"]].items():
            assert isinstance(event[name], kind), (name, event)


def test_a_text_stream(server: RunningServer) -> None:
    events = stream(server, input="Name three colors.", max_output_tokens=12)
    check_types(events)
    names = [e["type"] for e in events]
    num_deltas = names.count("response.output_text.delta")
    assert num_deltas >= 1
    assert names == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * num_deltas,
                     "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", names[-1]]
    assert names[-1] in ("response.completed", "response.incomplete")
    created, added, last = events[0]["response"], events[2]["item"], events[-1]["response"]
    assert created["status"] == "in_progress" and created["output"] == []
    assert added["type"] == "message" and added["content"] == []
    assert added["status"] == "in_progress"
    assert {e.get("item_id", added["id"]) for e in events[2:-1]} == {added["id"]}
    assert {e["response"]["id"] for e in (events[0], events[1], events[-1])} == {created["id"]}
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    done = events[-4]
    assert done["text"] == text == last["output_text"]
    assert events[-2]["item"] == last["output"][0]
    assert last["output"][0]["content"] == [{"type": "output_text", "text": text,
                                              "annotations": [], "logprobs": []}]
    assert last["status"] == names[-1].removeprefix("response.")
    assert last["usage"]["output_tokens"] <= 12


def test_a_function_call_stream(server: RunningServer) -> None:
    events = stream(server, input="What is the weather in Paris?", tools=TOOLS,
                    tool_choice={"type": "function", "name": "get_weather"},
                    max_output_tokens=40)
    check_types(events)
    names = [e["type"] for e in events]
    num_deltas = names.count("response.function_call_arguments.delta")
    assert num_deltas >= 1
    assert names == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * num_deltas,
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"]
    added, done, last = events[2]["item"], events[-2]["item"], events[-1]["response"]
    assert added["type"] == "function_call" and added["arguments"] == ""
    assert added["name"] == "get_weather" and added["call_id"].startswith("call_")
    arguments = "".join(e["delta"] for e in events
                        if e["type"] == "response.function_call_arguments.delta")
    assert events[-3]["arguments"] == arguments == done["arguments"]
    json.loads(arguments)
    assert done == {**added, "arguments": arguments, "status": "completed"}
    assert last["output"] == [done] and last["output_text"] == ""


def test_an_error_before_the_stream_is_json(server: RunningServer) -> None:
    answer = server.post("/v1/responses", {"model": MODEL, "input": [], "stream": True})
    assert answer.status_code == 400
    assert answer.headers["content-type"].startswith("application/json")
    assert answer.json()["error"]["param"] == "input"
