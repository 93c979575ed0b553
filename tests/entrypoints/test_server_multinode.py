"""`nanoserve serve --nnodes 2`: two commands on loopback, as two nodes would run them.

Node 0 (`--node-rank 0`) runs the engine core, rank 0, and the API; node 1 (`--node-rank 1
--headless`) runs rank 1 only, and finds rank 0 at --master-addr:--master-port. Their greedy
tokens and logprobs equal `LLM(tensor_parallel_size=2)` on one node (the same shards, the same
collectives), and SIGTERM to node 0 stops node 1 too, leaving nothing running. The tiny Llama
(4 heads, 2 KV heads, intermediate 160) splits over 2 ranks on the exact path. The bad flag
combinations are refused at start-up, by flag and value, before anything starts.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from server_harness import RunningServer, free_port, process_gone, wait_until
from test_server_lifecycle import child_pids, engine_pid

from nanoserve.engine_args import EngineArgs
from nanoserve.entrypoints.llm import LLM
from nanoserve.sampling_params import SamplingParams

pytestmark = pytest.mark.distributed

EXACT = ("--quantization", "none", "--dtype", "float32", "--device", "cpu",
         "--max-model-len", "256")
PROMPTS = [[1000 + i for i in range(9)], [3000 + 5 * i for i in range(21)], [42, 7, 4242]]
CLI = [sys.executable, "-m", "nanoserve.entrypoints.cli", "serve"]


def node_flags(rank: int, port: int) -> list[str]:
    return ["--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", str(rank),
            "--master-addr", "127.0.0.1", "--master-port", str(port)]


def test_two_nodes_on_loopback_equal_one_node_and_stop_together(
        tiny_model_dir: Any, tmp_path: Path) -> None:
    model = str(tiny_model_dir("llama"))
    port = free_port()
    with open(tmp_path / "node1.log", "w") as log:
        node1 = subprocess.Popen([*CLI, model, *EXACT, *node_flags(1, port), "--headless"],
                                 stdout=log, stderr=subprocess.STDOUT)
    node0 = RunningServer(model, *EXACT, *node_flags(0, port), log=tmp_path / "node0.log",
                          wait=False)
    try:
        # the one-node reference loads while the two nodes start (the machine has 2 cores)
        params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
        llm = LLM(model, tensor_parallel_size=2, device="cpu", dtype="float32",
                  quantization="none", max_model_len=256)
        expected = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                use_tqdm=False)
        llm.engine.shutdown()
        node0.wait_healthy(timeout=90)
        ranks = child_pids(node1.pid)
        assert len(ranks) == 1 and node1.poll() is None  # rank 1, a child of node 1
        for prompt, want in zip(PROMPTS, expected, strict=True):
            body = {"model": node0.client().models.list().data[0].id, "prompt": prompt,
                    "max_tokens": 12, "temperature": 0, "logprobs": 2, "ignore_eos": True}
            got = node0.post("/v1/completions", body).json()["choices"][0]
            out = want.outputs[0]
            assert got["text"] == out.text
            chosen = [lp[t].logprob for lp, t in zip(out.logprobs or [], out.token_ids,
                                                     strict=True)]
            assert got["logprobs"]["token_logprobs"] == pytest.approx(chosen, abs=1e-6)
        # SIGTERM to node 0: its engine core tells rank 1 to stop, and node 1 exits too
        engine = engine_pid(node0)
        assert node0.stop(timeout=30) == 0
        assert node1.wait(timeout=20) == 0
        wait_until(lambda: all(process_gone(pid) for pid in [engine, *ranks]),
                   "rank 0 and rank 1 to exit")
    finally:
        node0.stop(timeout=10)
        if node1.poll() is None:
            node1.kill()
            node1.wait()


@pytest.mark.parametrize(("flags", "message"), [
    ({"nnodes": 2, "node_rank": 2}, "--node-rank 2 is outside [0, 2)"),
    ({"tensor_parallel_size": 3, "nnodes": 2}, "--tensor-parallel-size 3 does not divide over "
     "--nnodes 2"),
    ({"headless": True}, "--headless is for the nodes other than 0"),
    ({"nnodes": 2, "master_port": 29500}, "--nnodes 2 needs --master-addr"),
    ({"nnodes": 2, "master_addr": "127.0.0.1"}, "--nnodes 2 needs --master-port"),
    ({"nnodes": 2, "node_rank": 1, "master_addr": "127.0.0.1", "master_port": 29500},
     "--node-rank 1 runs only tensor-parallel ranks: add --headless"),
])
def test_bad_multinode_flags_are_named(flags: dict[str, Any], message: str) -> None:
    args = {"tensor_parallel_size": 2, **flags}
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineArgs(**args).to_config()


def test_a_bad_node_rank_stops_serve_at_start_up() -> None:
    """Exit status 2 and the flag and its value in one line, before a model loads or a port
    is bound."""
    done = subprocess.run([*CLI, "--port", str(free_port()), *node_flags(2, free_port())],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "nanoserve serve: error: --node-rank 2 is outside [0, 2) (--nnodes 2)" in done.stderr
