"""Schemathesis against the real server on a tiny model: for every route in /openapi.json,
generated requests (valid ones, and for routes with a body also invalid ones) must never get a
5xx, a status the schema does not list, or a body that does not match the schema, and must
not hang (each call is bounded). vLLM's tests/entrypoints/openai/test_openai_schema.py does the
same with schemathesis; here the examples are derandomized, so a run is repeatable.

The number of cases run per route is printed (and kept in the JUnit report as a property).
One server and ~400 requests: about a minute (marked `server`, so `make test-fast` skips it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from server_harness import RunningServer

ROUTES = [("GET", "/health"), ("GET", "/version"), ("GET", "/v1/models"), ("GET", "/metrics"),
          ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
          ("POST", "/tokenize"), ("POST", "/detokenize"),
          ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"),
          ("POST", "/v1/responses"), ("POST", "/v1/embeddings"), ("POST", "/v1/rerank"),
          ("POST", "/rerank"), ("POST", "/v2/rerank"), ("POST", "/score"),
          ("POST", "/v1/chat/completions/render"), ("POST", "/v1/completions/render"),
          ("GET", "/get_server_info"), ("GET", "/kv_event_sources"),
          ("GET", "/api/version"), ("GET", "/api/tags"), ("GET", "/api/ps"),
          ("POST", "/api/show"), ("POST", "/api/chat"), ("POST", "/api/generate"),
          ("POST", "/api/embed"), ("POST", "/api/embeddings"), ("POST", "/infill")]
# examples per generation mode for routes with a body (a route without one has one case);
# the routes that share another's handler (aliases, count_tokens, renders) get fewer. Fewer than the
# earlier 50/20 and 20/10: every route and mode still runs and every route still gets 200s
# beside its 400s, in 31 s instead of 54 s on one core
MAX_EXAMPLES = {GenerationMode.POSITIVE: 30, GenerationMode.NEGATIVE: 10}
FEWER_EXAMPLES = {GenerationMode.POSITIVE: 12, GenerationMode.NEGATIVE: 5}
ALIASES = {"/rerank", "/v2/rerank", "/v1/messages/count_tokens", "/score",
           "/v1/chat/completions/render", "/v1/completions/render"}
MODEL = "tiny"
CALL_TIMEOUT_S = 30.0  # a call past this is a hang: the server bounds requests at 5 s
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Any) -> Iterator[RunningServer]:
    # small limits keep each generated request cheap: a short context, few samples, and a
    # deadline that also bounds what a fuzzed grammar or prompt can cost
    running = RunningServer(str(tiny_model_dir("llama")), "--max-model-len", "64",
                            "--max-n", "2", "--max-in-flight", "16", "--request-timeout", "5",
                            "--max-request-body-bytes", "200000", "--served-model-name", MODEL)
    yield running
    assert running.stop() == 0


@pytest.fixture(scope="module")
def schema(server: RunningServer) -> Any:
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


def test_schema_lists_every_route(schema: Any) -> None:
    served = sorted((op.ok().method.upper(), op.ok().path) for op in schema.get_all_operations())
    assert served == sorted(ROUTES), "a new route: add it to ROUTES so it is fuzzed"


@pytest.mark.parametrize(("method", "path"), ROUTES, ids=[f"{m} {p}" for m, p in ROUTES])
def test_generated_requests(schema: Any, method: str, path: str,
                            record_property: Any, request: pytest.FixtureRequest) -> None:
    operation = schema[path][method]
    session = requests.Session()
    modes = list(MAX_EXAMPLES) if operation.body else [GenerationMode.POSITIVE]
    statuses: Counter[int] = Counter()
    examples = FEWER_EXAMPLES if path in ALIASES else MAX_EXAMPLES
    counts = {mode.value: _fuzz(operation, mode, session, statuses, examples[mode])
              for mode in modes}
    total = sum(counts.values())
    record_property("generated_cases", total)
    line = (f"schemathesis {method} {path}: {total} cases ({_join(counts)}), statuses "
            f"{_join(dict(sorted(statuses.items())))}; no 5xx, no schema mismatch")
    print(line)
    _report(request, line)
    assert total >= 1


def _fuzz(operation: Any, mode: GenerationMode, session: requests.Session,
          statuses: Counter[int], max_examples: int) -> int:
    """Run the generated cases of one mode; the number run."""
    count = 0
    @settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: schemathesis.Case) -> None:
        nonlocal count
        count += 1
        if mode == GenerationMode.POSITIVE and isinstance(case.body, dict) \
                and "model" in case.body:  # past the model check, else most cases are a 404
            case.body["model"] = MODEL
        response = case.call_and_validate(session=session, timeout=CALL_TIMEOUT_S,
                                          checks=CHECKS)
        statuses[response.status_code] += 1

    run()
    return count


def _join(counts: dict[Any, int]) -> str:
    return ", ".join(f"{key}: {value}" for key, value in counts.items())


def _report(request: pytest.FixtureRequest, line: str) -> None:
    """Show the count in pytest's output even when output is captured (as in `make test`)."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line("\n" + line)
