"""`nanoserve serve --data-parallel-size 2`: two engine cores behind one API server.

The workload is llm-d's shared prefix, scaled down: 8 groups of 8 chats, each group sharing a
~256-token system prompt, sent through the OpenAI SDK in waves (one chat of every group at
once, in a shuffled order, so that round robin scatters each group over both engines). One
engine alone sets the bar: an engine core in this process (`LLM`, the server's EngineCore)
fed the same waves as the token ids the server renders for them; `cache_aware` keeps >= 90 %
of its prefix-cache hits and `round_robin` measurably fewer; both engines serve (the `engine`
label of /metrics). The engines skip the model (`--zero-cost-engine`): the KV cache, prefix
cache, scheduler and routing are the real ones. With --kv-events-config each engine core
publishes its own events, on the configured ports plus its rank, named in /kv_event_sources
for vllm-router's discovery. Then the fault: one engine
core killed under 8 streams fails every client, and the whole server exits (vLLM's choice).
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import msgspec
import openai
import pytest
import zmq
from server_harness import (
    RunningServer,
    free_port_run,
    process_gone,
    stream_chat,
    wait_until,
)
from test_server_lifecycle import Starter, Streams, child_pids, start_server

pytestmark = [pytest.mark.server, pytest.mark.distributed]
__all__ = ["start_server"]  # the fixture, shared with test_server_lifecycle

NUM_GROUPS, PER_GROUP = 8, 8
WORDS = ("river", "stone", "cloud", "lantern", "meadow", "copper", "harbor", "violet",
         "thunder", "orchard", "glacier", "saddle", "pepper", "canyon", "marble", "falcon")
SEED = 1  # the same waves for each server and for the one engine
HITS, QUERIES = "nanoserve:prefix_cache_hits_total", "nanoserve:prefix_cache_queries_total"


def engine_pids(server: RunningServer) -> list[int]:
    """The launcher's spawned children (engine cores; with one API server, nothing else)."""
    return [pid for pid in child_pids(server.proc.pid)
            if b"spawn_main" in open(f"/proc/{pid}/cmdline", "rb").read()]


def per_engine(server: RunningServer, name: str) -> dict[str, float]:
    """One metric's value for each `engine` label."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            engine = line.split('engine="', 1)[1].split('"', 1)[0]
            values[engine] = values.get(engine, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def waves(seed: int) -> list[list[list[dict[str, str]]]]:
    """PER_GROUP waves of NUM_GROUPS chats: wave w holds chat w of every group, shuffled."""
    rng = random.Random(seed)
    systems = [" ".join(rng.choice(WORDS) for _ in range(250)) for _ in range(NUM_GROUPS)]
    result = []
    for w in range(PER_GROUP):
        wave = [[{"role": "system", "content": systems[g]},
                 {"role": "user", "content": f"question {w} of group {g}: {rng.choice(WORDS)}?"}]
                for g in range(NUM_GROUPS)]
        rng.shuffle(wave)
        result.append(wave)
    return result


def chat(client: openai.OpenAI, messages: Any) -> str:
    return stream_chat(client, "tiny", messages, max_tokens=4)


def send_waves(server: RunningServer) -> float:
    """Every wave, each after the last has finished; the prefix-cache hits they made."""
    client = server.client()
    before = server.metric(HITS)
    with ThreadPoolExecutor(NUM_GROUPS) as pool:
        for wave in waves(SEED):
            assert len(list(pool.map(lambda messages: chat(client, messages), wave))) == \
                NUM_GROUPS
    return server.metric(HITS) - before


@pytest.fixture(scope="module")
def servers(tiny_model_dir: Any) -> Iterator[dict[str, RunningServer]]:
    """Two engines under each policy, started side by side."""
    model = [str(tiny_model_dir("llama")), "--served-model-name", "tiny", "--zero-cost-engine",
             "--data-parallel-size", "2"]
    # engine core k binds each port plus k: one run of four free ports holds both pairs
    base = free_port_run(4)
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{base}",
              "replay_endpoint": f"tcp://127.0.0.1:{base + 2}"}
    extra = {"cache_aware": ["--kv-events-config", json.dumps(events)], "round_robin": []}
    started = {policy: RunningServer(*model, "--load-balance-method", policy, *flags,
                                     wait=False)
               for policy, flags in extra.items()}
    try:
        for server in started.values():
            server.wait_healthy()
        yield started
    finally:
        codes = [server.stop() for server in started.values()]
    assert codes == [0, 0]


@pytest.fixture(scope="module")
def single_hits(servers: dict[str, RunningServer], tiny_model_dir: Any) -> float:
    """One engine core's prefix-cache hits on the same waves (the ids the server renders)."""
    from nanoserve.entrypoints.llm import LLM
    from nanoserve.sampling_params import SamplingParams

    server = servers["cache_aware"]
    llm = LLM(str(tiny_model_dir("llama")), zero_cost_runner=True, device="cpu")
    params = SamplingParams(max_tokens=4, temperature=0)
    for wave in waves(SEED):
        ids = [server.post("/v1/chat/completions/render",
                           {"model": "tiny", "messages": messages}).json()["token_ids"]
               for messages in wave]
        llm.generate([{"prompt_token_ids": prompt} for prompt in ids], params)
    hits = llm.engine.stats.prefix_cache_hits
    assert hits >= (PER_GROUP - 1) * NUM_GROUPS * 16 * 12  # most of 16 blocks each time
    return float(hits)


@pytest.mark.parametrize("policy", ["cache_aware", "round_robin"])
def test_two_engines_keep_prefixes_together(servers: dict[str, RunningServer],
                                            single_hits: float, policy: str) -> None:
    server = servers[policy]
    assert len(engine_pids(server)) == 2
    hits = send_waves(server)
    served = per_engine(server, QUERIES)
    assert sorted(served) == ["0", "1"] and min(served.values()) > 0, served  # both serve
    assert sum(per_engine(server, HITS).values()) == server.metric(HITS)
    kept = hits / single_hits
    if policy == "cache_aware":
        assert kept >= 0.9, (hits, single_hits, served)
    else:  # a group split over both engines misses twice: ~6/7 of one engine's hits
        assert kept < 0.9, (hits, single_hits, served)


def test_each_engine_publishes_its_own_kv_events(servers: dict[str, RunningServer]) -> None:
    server = servers["cache_aware"]
    sources = httpx.get(server.url + "/kv_event_sources", timeout=10).json()
    assert sorted(sources) == ["0", "1"]
    port = int(sources["0"]["endpoint"].rsplit(":", 1)[1])
    assert sources["1"]["endpoint"].endswith(f":{port + 1}")
    send_waves(server)  # (whatever ran before) both engines store blocks
    context = zmq.Context()
    try:
        for rank, source in sources.items():
            # each engine's replay socket gives back its batches from the first, its rank in each
            dealer = context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.RCVTIMEO, 5000)
            dealer.connect(source["replay_endpoint"])
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            batches = []
            while (frames := dealer.recv_multipart())[1:] != \
                    [b"", (-1).to_bytes(8, "big", signed=True), b""]:
                batches.append(msgspec.msgpack.decode(frames[3]))
            assert batches and all(batch[2] == int(rank) for batch in batches), rank
            assert any(event["type"] == "BlockStored" for _, events, _ in batches
                       for event in events)
    finally:
        context.destroy(linger=0)


def test_one_engine_killed_under_8_streams_stops_the_server(
        tiny_model_dir: Any, start_server: Starter) -> None:
    """Every stream (on either engine) ends with an error within 5 s of the kill, /health
    says 503 or the server has gone, it exits non-zero, and the other engine core is gone."""
    server = start_server(str(tiny_model_dir("llama")), "--data-parallel-size", "2")
    engines = engine_pids(server)
    assert len(engines) == 2
    streams = Streams(server, 8)
    streams.wait_all_started()
    assert all(not errors for errors in streams.errors), "a stream failed before the kill"
    running = per_engine(server, "nanoserve:num_requests_running")
    assert running["0"] > 0 and running["1"] > 0, running  # streams on both engines
    killed_at = time.monotonic()
    os.kill(engines[1], signal.SIGKILL)
    streams.assert_all_told(server, killed_at, within=5.0)
    wait_until(lambda: process_gone(engines[0]), "the other engine core to exit", timeout=10)


def test_colliding_event_ports_are_refused_at_start_with_the_reason(tiny_model_dir: Any) -> None:
    """Ports one apart collide under the offset rule: the server refuses them before any
    engine starts, and the harness shows why it exited."""
    base = free_port_run(3)
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{base}",
              "replay_endpoint": f"tcp://127.0.0.1:{base + 1}"}
    with pytest.raises(RuntimeError, match="exited with 1 while starting") as refused:
        RunningServer(str(tiny_model_dir("llama")), "--zero-cost-engine",
                      "--data-parallel-size", "2", "--kv-events-config", json.dumps(events))
    assert f"collide at port {base + 1}" in str(refused.value)
