"""The default model served on the avx2 tier, on the best tier this CPU has
(NANOSERVE_CPU_ISA=auto) and, on an AVX-512 CPU, on amx-emu (the AMX kernels on emulated
tiles): the same greedy and seeded completions with the same logprobs, bit for bit, one prompt
alone and prompts batched (long enough that prefill takes the wide form and the tiles), on the
default float16 KV cache and on an int8 one (whose scores the avx512 tier sums with
`vpdpbusd`), and /get_server_info names the tier and the kernel schedule each runs. Skipped,
with the reason, on a CPU with only avx2."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_harness import RunningServer

from nanoserve import native
from nanoserve.kernel_tuning.tuner import preferred_tier

PROMPTS = ["The capital of France is",
           "Write a short poem about the sea, in four lines, with a rhyme at the end of "
           "every second line, and give it a title:",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "Three facts about the moon: 1."]


@pytest.fixture(scope="module", params=["auto", "int8"], ids=["kv-auto", "kv-int8"])
def servers(request: pytest.FixtureRequest) -> Iterator[dict[str, RunningServer]]:
    best = native.available_tiers()[-1] if native.available_tiers() else "avx2"
    if best == "avx2":
        pytest.skip(f"this CPU has only the avx2 tier (it lacks "
                    f"{', '.join(native.tier_missing(native.TIERS[-1]))})")
    isas = ["avx2", "auto", *(["amx-emu"] if not native.tier_missing("amx-emu") else [])]
    # the default tuning (the suite's servers run without it): "auto" is the tuner's tier
    started = {isa: RunningServer("--kv-cache-dtype", request.param, "--kernel-tuning",
                                  "cached", env={"NANOSERVE_CPU_ISA": isa}, wait=False)
               for isa in isas}
    try:
        for server in started.values():
            server.wait_healthy()
        yield started
    finally:
        for server in started.values():
            server.stop()


def answers(server: RunningServer, prompts: list[str], **sampling: Any) -> list[Any]:
    response = server.client().completions.create(
        model=server.client().models.list().data[0].id, prompt=prompts, max_tokens=24,
        logprobs=3, **sampling)
    return [(c.index, c.text, c.finish_reason, c.logprobs.tokens, c.logprobs.token_logprobs,
             c.logprobs.top_logprobs) for c in response.choices]


def test_each_server_names_its_tier(servers: dict[str, RunningServer]) -> None:
    info = {isa: httpx.get(s.url + "/get_server_info", timeout=10).json()
            for isa, s in servers.items()}
    assert info["avx2"]["cpu_isa"] == "avx2"
    # auto: the best tier, unless the kernel tuner measured another faster on this CPU
    assert info["auto"]["cpu_isa"] == (preferred_tier("cached")
                                       or native.available_auto_tiers()[-1])
    if "amx-emu" in info:  # never chosen by auto; its emulated tiles' times are never tuned
        assert info["amx-emu"]["cpu_isa"] == "amx-emu"
    for served in info.values():  # the schedule the tuner chose (or read) for this CPU
        assert "prefetch" in served["kernel_schedule"]


@pytest.mark.parametrize("sampling", [{"temperature": 0.0},
                                      {"temperature": 0.8, "seed": 7}],
                         ids=["greedy", "seeded"])
def test_the_tiers_answer_bit_for_bit_alike(servers: dict[str, RunningServer],
                                            sampling: dict[str, Any]) -> None:
    for prompts in (PROMPTS[:1], PROMPTS):  # alone, then batched in one engine step
        reference = answers(servers["avx2"], prompts, **sampling)
        for isa in servers.keys() - {"avx2"}:
            assert answers(servers[isa], prompts, **sampling) == reference, isa
