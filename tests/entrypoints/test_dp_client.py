"""The API side of data parallelism without engine processes: DPEngineClient on real ZMQ
sockets, with plain PULL/PUSH sockets standing where the two engine cores' sockets would be.
Also the flags' start-up errors and the `engine` label of /metrics."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from nanoserve.engine.core_client import EngineCoreClient
from nanoserve.engine.dp_router import RoutingConfig
from nanoserve.engine.launch import make_addresses
from nanoserve.engine_args import EngineArgs
from nanoserve.entrypoints.serving.dp_client import DPEngineClient
from nanoserve.entrypoints.serving.metrics import Metrics
from nanoserve.protocol import (
    AbortRequests,
    EngineCoreOutput,
    EngineOutputs,
    EngineRequest,
    SchedulerStats,
    decode_input,
    encode,
)
from nanoserve.sampling_params import SamplingParams

PROMPT_A = list(range(100, 164))  # 4 full blocks of 16
PROMPT_B = list(range(500, 564))


class Engines:
    """Two engines' input sockets (what each engine core receives) and a socket that pushes
    to the API server's output, as the engine cores do."""

    def __init__(self) -> None:
        self.addresses = make_addresses(num_clients=1, num_engines=2)
        self.context = zmq.Context()
        self.inputs = []
        for address in self.addresses.inputs:
            sock = self.context.socket(zmq.PULL)
            sock.bind(address)
            self.inputs.append(sock)
        self.output = self.context.socket(zmq.PUSH)
        self.output.connect(self.addresses.outputs[0])

    def received(self, engine: int) -> list[Any]:
        """Every message engine `engine` has been sent so far."""
        messages = []
        while self.inputs[engine].poll(200):
            messages.append(decode_input(self.inputs[engine].recv()))
        return messages

    def close(self) -> None:
        self.context.destroy(linger=0)
        self.addresses.cleanup()


@pytest.fixture
def engines() -> Iterator[Engines]:
    made = Engines()
    yield made
    made.close()


def request(request_id: str, prompt: list[int], leader: str | None = None) -> EngineRequest:
    return EngineRequest(request_id, prompt, SamplingParams(max_tokens=4), 0, leader)


def test_prefixes_stay_samples_stay_and_aborts_go_where_requests_run(engines: Engines) -> None:
    async def scenario() -> None:
        client = DPEngineClient(EngineCoreClient(engines.addresses, 0),
                                RoutingConfig("cache_aware"), block_size=16)
        try:
            # n = 2: both samples on one engine, beside their leader
            first = await client.add([request("a-0", PROMPT_A), request("a-1", PROMPT_A, "a-0")])
            other = await client.add([request("b", PROMPT_B)])  # a miss: the idle engine
            again = await client.add([request("a2", PROMPT_A[:48] + [7] * 16)])  # 3 of 4 blocks
            assert other != first and again == first
            assert client.num_in_flight[first] == 3 and client.num_in_flight[other] == 1
            sent = {k: [m.request_id for m in engines.received(k)] for k in (0, 1)}
            assert sent[first] == ["a-0", "a-1", "a2"] and sent[other] == ["b"]
            # an abort goes only to the engine that holds each request
            client.abort_nowait(["a-1", "b"])
            assert engines.received(first) == [AbortRequests(["a-1"])]
            assert engines.received(other) == [AbortRequests(["b"])]
            client.abort_nowait(["a-1"])  # already aborted: nothing is sent
            assert engines.received(first) == []
            # a finish from the engine forgets the request; its stats are that engine's own
            stats = SchedulerStats(num_running=1, prefix_cache_hits=48)
            engines.output.send(encode(EngineOutputs(
                [EngineCoreOutput("a-0", [5], "length")], stats, 0.0, engine_index=first)))
            await asyncio.wait_for(client.recv(), timeout=10)
            assert client.engine_of == {"a2": first}
            assert client.engine_stats[first] == stats
            assert client.engine_stats[other] == SchedulerStats()
        finally:
            client.close()

    asyncio.run(scenario())


def test_round_robin_alternates_whatever_the_prompt(engines: Engines) -> None:
    async def scenario() -> list[int]:
        client = DPEngineClient(EngineCoreClient(engines.addresses, 0),
                                RoutingConfig("round_robin"), block_size=16)
        try:
            return [await client.add([request(f"r{i}", PROMPT_A)]) for i in range(4)]
        finally:
            client.close()

    assert asyncio.run(scenario()) == [0, 1, 0, 1]


def test_metrics_carry_an_engine_label() -> None:
    stats = [SchedulerStats(num_running=2, prefix_cache_hits=32),
             SchedulerStats(num_running=1, prefix_cache_hits=16)]
    text = Metrics("m", lambda: stats).render().decode()
    assert 'nanoserve:num_requests_running{engine="0",model_name="m"} 2.0' in text
    assert 'nanoserve:num_requests_running{engine="1",model_name="m"} 1.0' in text
    assert 'nanoserve:prefix_cache_hits_total{engine="1",model_name="m"} 16.0' in text


@pytest.mark.parametrize(("flags", "message"), [
    ({"data_parallel_size": 0}, "--data-parallel-size must be >= 1, got 0"),
    ({"load_balance_method": "random"},
     "--load-balance-method 'random' is not one of cache_aware, round_robin"),
    ({"data_parallel_size": 2, "nnodes": 2, "tensor_parallel_size": 2,
      "master_addr": "127.0.0.1", "master_port": 29500},
     "--data-parallel-size 2 runs its engine cores on one host: not with --nnodes 2"),
    ({"data_parallel_size": 2,
      "kv_events_config": '{"enable_kv_cache_events": true, "endpoint": "ipc:///tmp/kv"}'},
     "kv_events_config endpoint 'ipc:///tmp/kv': data-parallel engine cores publish on its "
     "port plus their rank, so it must be tcp://HOST:PORT"),
])
def test_bad_data_parallel_flags_are_named(flags: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineArgs(**flags).to_config()


def test_llm_refuses_data_parallelism() -> None:
    from nanoserve.entrypoints.llm import LLM

    with pytest.raises(ValueError, match="data_parallel_size=2: LLM runs one engine core"):
        LLM(data_parallel_size=2)
