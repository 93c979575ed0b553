"""An agent's conversation with a Qwen3.5 hybrid, replayed turn by turn through the real server
and chat template with the official `openai` SDK: each turn after the first reports most of its
prompt as `usage.prompt_tokens_details.cached_tokens` (the DeltaNet states restored from the
snapshots of engine/state_cache.py), and its tokens and logprobs equal a server started with
`--no-prefix-caching` bit for bit (int8 weights, whose kernels' bits do not depend on the
batch; the float32 PyTorch matmuls' may).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_harness import RunningServer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "model"))
from qwen35_checkpoints import write_tiny_qwen35

ESSAY = Path(__file__).resolve().parent.parent / "data" / "essay.txt"


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[RunningServer, RunningServer]]:
    path = str(write_tiny_qwen35(tmp_path_factory.mktemp("tiny-qwen35-turns")))
    common = ("--served-model-name", "m", "--quantization", "int8", "--reasoning-parser",
              "qwen3")
    warm = RunningServer(path, *common, wait=False)
    cold = RunningServer(path, *common, "--no-prefix-caching")
    warm.wait_healthy()
    yield warm, cold
    assert warm.stop() == 0 and cold.stop() == 0


def ask(server: RunningServer, messages: list[dict[str, Any]]) -> tuple[Any, str, list[Any]]:
    answer = server.client().chat.completions.create(
        model="m", messages=messages, max_tokens=8, temperature=0, logprobs=True,
        top_logprobs=2, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    (choice,) = answer.choices
    steps = [(t.token, t.logprob, [(c.token, c.logprob) for c in t.top_logprobs])
             for t in choice.logprobs.content]
    return answer.usage, choice.message.content or "", steps


def test_each_turn_finds_the_last_one_cached_and_answers_as_a_cold_server(
        servers: tuple[RunningServer, RunningServer]) -> None:
    warm, cold = servers
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": ESSAY.read_text()[:3000]},
        {"role": "user", "content": "Summarize the essay."}]
    last_prompt = 0
    for turn in range(4):
        usage, content, steps = ask(warm, messages)
        cold_usage, cold_content, cold_steps = ask(cold, messages)
        assert (content, steps) == (cold_content, cold_steps), f"turn {turn}"
        assert cold_usage.prompt_tokens_details.cached_tokens == 0
        cached = usage.prompt_tokens_details.cached_tokens
        if turn:  # all of the last turn's prompt, to its last full blocks
            assert cached >= last_prompt - 32, (turn, cached, last_prompt)
            assert cached >= usage.prompt_tokens * 0.8
        last_prompt = usage.prompt_tokens
        messages += [{"role": "assistant", "content": content},
                     {"role": "user", "content": f"And point {turn + 2}?"}]
