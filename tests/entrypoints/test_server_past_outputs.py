"""Suffix decoding's past outputs through the real server: a finished answer speeds up the next
requests of the same API key only, and changes no token.

`suffix_decoding_max_cached_requests` keeps each tenant's last outputs (a tenant: the digest of
the key a client sends). The same open question asked again with one key drafts its earlier
answer (most drafts accepted); asked with another key it finds no past output to follow.
Every answer is the same text.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from server_harness import RunningServer

pytestmark = pytest.mark.slow
QUESTION = "Write a short story about a lighthouse keeper who finds a message in a bottle."
ACCEPTED = "nanoserve:spec_decode_num_accepted_tokens_total"


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    running = RunningServer(
        "--speculative-config",
        '{"method": "suffix", "suffix_decoding_max_cached_requests": 8}',
        "--speculative-max-rows", "256")
    yield running
    assert running.stop() == 0


def ask(server: RunningServer, key: str) -> tuple[str, float]:
    """The answer under `key`, and how many drafts the server accepted while writing it."""
    before = server.metric(ACCEPTED)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
    answer = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": QUESTION}],
        temperature=0.0, max_tokens=120)
    return answer.choices[0].message.content or "", server.metric(ACCEPTED) - before


def test_past_outputs_are_kept_per_api_key(server: RunningServer) -> None:
    first, _ = ask(server, "alice-key")
    again, alice_accepted = ask(server, "alice-key")
    other, bob_accepted = ask(server, "bob-key")
    assert first == again == other
    num_tokens = 120
    assert alice_accepted > 0.6 * num_tokens, alice_accepted  # her first answer, drafted
    assert bob_accepted < 0.3 * alice_accepted, (bob_accepted, alice_accepted)
