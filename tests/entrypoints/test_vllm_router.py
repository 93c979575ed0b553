"""Two replicas behind vLLM's own router (`vllm-router`, a dev dependency), which routes by
the KV-cache events each replica publishes (--kv-events-config): every stream completes,
both replicas serve, and their summed prefix-cache hits reach 90 % of one server's on the
same kind of workload; with `cache_aware` (the router's own guess from the text) too. With
`round_robin` they fall short: the control that shows the workload tells them apart.
`kv_discovered` is `kv_aware` with no event-source flags at all: the router finds each
replica's model, block size and publisher itself (/get_server_info, /kv_event_sources).

The workload is llm-d's shared prefix, scaled down: groups of requests that share a long
system prompt, sent in waves (one request of every group at once), so a router that ignored
the caches would scatter each group over both replicas. One server alone is measured first,
on other prompts of the same shape (its cache then holds nothing of the routed prompts).
"""

from __future__ import annotations

import json
import random
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_harness import RunningServer, free_port, stream_chat, wait_until

pytestmark = [pytest.mark.server, pytest.mark.slow]

MODEL = "tiny-router-model"
NUM_GROUPS, PER_GROUP = 3, 4  # an odd wave: round-robin splits every group
WORDS = ("river", "stone", "cloud", "lantern", "meadow", "copper", "harbor", "violet",
         "thunder", "orchard", "glacier", "saddle", "pepper", "canyon", "marble", "falcon")
# prompt tokens found in, and looked up in, each replica's prefix cache
HITS, QUERIES = "nanoserve:prefix_cache_hits_total", "nanoserve:prefix_cache_queries_total"


def router_binary() -> str:
    import shutil
    import sys

    found = shutil.which("vllm-router", path=str(Path(sys.executable).parent))
    assert found, "vllm-router is a dev dependency (pip install -e '.[dev]')"
    return found


def waves(seed: int) -> list[list[list[dict[str, str]]]]:
    """PER_GROUP waves of NUM_GROUPS chats: wave w holds request w of every group."""
    rng = random.Random(seed)
    systems = [" ".join(rng.choice(WORDS) for _ in range(160)) for _ in range(NUM_GROUPS)]
    return [[[{"role": "system", "content": systems[g]},
              {"role": "user", "content": f"question {w} of group {g}: {rng.choice(WORDS)}?"}]
             for g in range(NUM_GROUPS)] for w in range(PER_GROUP)]


def send_waves(client: openai.OpenAI, seed: int, settle: Any = None) -> int:
    done = 0
    with ThreadPoolExecutor(NUM_GROUPS) as pool:
        for wave in waves(seed):
            done += len(list(pool.map(
                lambda chat: stream_chat(client, MODEL, chat, max_tokens=3), wave)))
            if settle:
                settle()  # the router hears this wave's blocks before it routes the next
    return done


@pytest.fixture(scope="module")
def replicas(tiny_model_dir: Any) -> Iterator[list[tuple[RunningServer, int]]]:
    started = []
    for _ in range(2):
        events, replay = free_port(), free_port()
        config = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://127.0.0.1:{events}",
                  "replay_endpoint": f"tcp://127.0.0.1:{replay}"}
        server = RunningServer(str(tiny_model_dir("llama")), "--served-model-name", MODEL,
                               "--kv-events-config", json.dumps(config), wait=False)
        started.append((server, events, replay))
    for server, _, _ in started:
        server.wait_healthy()
    yield [(server, events, replay) for server, events, replay in started]
    assert [server.stop() for server, _, _ in started] == [0, 0]


@pytest.fixture(scope="module")
def single_hits(replicas: Any) -> float:
    """One server alone, on prompts of the same shape: its prefix-cache hits."""
    (one, _, _), _ = replicas
    hits_before = one.metric(HITS)
    assert send_waves(one.client(), seed=1) == NUM_GROUPS * PER_GROUP
    hits = one.metric(HITS) - hits_before
    assert hits > 0
    return hits


@pytest.mark.parametrize(("policy", "seed"), [("kv_aware", 2), ("kv_discovered", 5),
                                              ("cache_aware", 3), ("round_robin", 4)])
def test_router_keeps_prefixes_together(replicas: Any, single_hits: float, policy: str,
                                        seed: int, tmp_path: Path) -> None:
    (one, _, _), (two, _, _) = replicas
    # both behind the router, which subscribes to each one's events
    port, prometheus = free_port(), free_port()
    discovered = policy == "kv_discovered"
    policy = "kv_aware" if discovered else policy
    cmd = [router_binary(), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus),
           "--worker-urls", one.url, two.url]
    if policy == "kv_aware" and not discovered:  # refused for the router's other policies
        cmd += ["--kv-event-block-size", "16", "--kv-event-model", MODEL]
        # the router joins after the replicas published the single-server phase's events:
        # it asks each replay socket for what it missed
        for server, events, replay in replicas:
            cmd += ["--kv-event-source", f"{server.url}=tcp://127.0.0.1:{events}",
                    "--kv-event-replay-source", f"{server.url}=tcp://127.0.0.1:{replay}"]
    log = open(tmp_path / "router.log", "w")  # noqa: SIM115 - closed below
    router = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        # healthy, or exited (its log then says why)
        wait_until(lambda: router.poll() is not None or _healthy(url), "the router to answer",
                   timeout=60)
        assert router.poll() is None, (tmp_path / "router.log").read_text()[-3000:]
        before = [(s.metric(HITS), s.metric(QUERIES)) for s, _, _ in replicas]
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        assert send_waves(client, seed=seed, settle=lambda: _settle(replicas)) == \
            NUM_GROUPS * PER_GROUP
        after = [(s.metric(HITS), s.metric(QUERIES)) for s, _, _ in replicas]
        # the router's own count of prompts whose blocks it found in a replica's events
        found = _router_hits(httpx.get(f"http://127.0.0.1:{prometheus}/metrics").text)
    finally:
        router.terminate()
        router.wait(timeout=30)
        log.close()
    served = [a[1] - b[1] for a, b in zip(after, before, strict=True)]  # prompt tokens
    routed_hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    router_log = (tmp_path / "router.log").read_text()[-3000:]
    assert min(served) > 0, (served, router_log)
    kept = routed_hits / single_hits
    if policy == "round_robin":
        assert kept < 0.9, (routed_hits, single_hits, served)
    else:
        assert kept >= 0.9, (routed_hits, single_hits, served, router_log)
    if policy == "kv_aware":  # it routed on what the events told it
        assert found >= (PER_GROUP - 1) * NUM_GROUPS, (found, router_log)


def _router_hits(metrics: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("vllm_router_kv_placement_lookups_total")
               and 'result="hit"' in line)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _settle(replicas: Any) -> None:
    """Both replicas idle: every block of the wave is stored and its event sent."""
    wait_until(lambda: all(s.metric("nanoserve:num_requests_running") == 0
                           for s, _, _ in replicas), "the replicas to go idle", timeout=30)
