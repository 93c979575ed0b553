"""Several models behind one port (`nanoserve serve --models-dir`): the real default model and
the real Gemma 3 270M, each loaded on demand as its own `nanoserve serve`, with the official
OpenAI, Anthropic and Ollama clients.

One router holds at most one model (`--models-max 1`), so every switch unloads the other;
a second holds both, for the fault test and Ollama's listing of loaded models."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
import psutil
import pytest
from playwright.sync_api import Browser, expect
from server_harness import RunningServer, process_gone, wait_until
from web_browser import browser, watched_page  # noqa: F401 (the browser fixture)

from nanoserve.model.loader import default_model_path

pytestmark = [pytest.mark.server, pytest.mark.slow]

SMOL = default_model_path().stem  # SmolLM2-135M-Instruct.Q4_1 (or the file's own stem)
GEMMA = "gemma-3-270m-q4_k_m"
TEMPLATES = Path(__file__).parents[2] / "examples"
HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory, gemma_270m_gguf: Path) -> Path:
    directory = tmp_path_factory.mktemp("models")
    (directory / f"{SMOL}.gguf").symlink_to(default_model_path())
    (directory / f"{GEMMA}.gguf").symlink_to(gemma_270m_gguf)
    # the GGUF file carries no chat template: Gemma's, beside it, as its server's template
    (directory / f"{GEMMA}.jinja").symlink_to(TEMPLATES / "template_gemma3.jinja")
    (directory / "notes.txt").write_text("not a model")
    return directory


def _states(server: RunningServer) -> dict[str, str]:
    body = httpx.get(server.url + "/v1/models", timeout=10).json()
    return {card["id"]: card["status"]["value"] for card in body["data"]}


def _model_pids(server: RunningServer) -> list[int]:
    return [p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)]


def _series(server: RunningServer, name: str, model: str) -> float:
    """`model`'s value of metric `name`, from the router's /metrics (its server's series)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f"nanoserve:{name}{{") and f'model_name="{model}"' in line)


def _tree_rss(server: RunningServer) -> int:
    router = psutil.Process(server.proc.pid)
    return int(router.memory_info().rss + sum(
        p.memory_info().rss for p in router.children(recursive=True) if p.is_running()))


def _router(models_dir: Path, models_max: int, keep_alive: int) -> Iterator[RunningServer]:
    server = RunningServer("--models-dir", str(models_dir), "--models-max", str(models_max),
                           "--keep-alive", str(keep_alive), "--max-model-len", "2048")
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def one_at_a_time(models_dir: Path) -> Iterator[RunningServer]:
    yield from _router(models_dir, models_max=1, keep_alive=4)


def test_every_model_is_listed_unloaded_and_unknown_names_are_404(
        one_at_a_time: RunningServer) -> None:
    assert _states(one_at_a_time) == {SMOL: "unloaded", GEMMA: "unloaded"}
    assert _model_pids(one_at_a_time) == []
    client = one_at_a_time.client()
    with pytest.raises(openai.NotFoundError, match="nope"):
        client.chat.completions.create(model="nope", messages=HELLO, max_tokens=2)
    answer = httpx.post(one_at_a_time.url + "/v1/messages", json={
        "model": "nope", "max_tokens": 2, "messages": HELLO}, timeout=10)
    assert answer.status_code == 404 and answer.json()["error"]["type"] == "not_found_error"
    answer = httpx.post(one_at_a_time.url + "/api/chat", json={"model": "nope",
                                                                "messages": HELLO}, timeout=10)
    assert answer.status_code == 404
    assert answer.json()["error"].startswith('model "nope" not found, try pulling it first')
    # more than one model: a request naming none is refused, naming them
    answer = httpx.post(one_at_a_time.url + "/v1/completions", json={"prompt": "Hi"},
                        timeout=10)
    assert answer.status_code == 400 and GEMMA in answer.json()["error"]["message"]


def test_each_model_answers_by_name_and_a_load_never_cuts_a_running_stream(
        one_at_a_time: RunningServer) -> None:
    client = one_at_a_time.client()
    rss_before = _tree_rss(one_at_a_time)
    # a long stream on SmolLM2; Gemma asked for while it runs must wait for it, not cut it
    first_chunk = threading.Event()
    smol_text: list[str] = []

    def smol_stream() -> None:
        stream = client.chat.completions.create(
            model=SMOL, messages=[{"role": "user", "content": "Count from 1 to 100."}],
            max_tokens=120, temperature=0, stream=True,
            stream_options={"include_usage": True})
        for chunk in stream:
            first_chunk.set()
            if chunk.choices:
                smol_text.append(chunk.choices[0].delta.content or "")
            if chunk.usage is not None:
                smol_text.append(f"<{chunk.usage.completion_tokens}>")

    runner = threading.Thread(target=smol_stream)
    runner.start()
    assert first_chunk.wait(300)
    assert _states(one_at_a_time)[SMOL] == "loaded"
    gemma = client.chat.completions.create(model=GEMMA, messages=HELLO, max_tokens=8,
                                           temperature=0)
    runner.join(60)
    assert smol_text[-1] == "<120>"  # the whole stream arrived
    assert gemma.model == GEMMA and gemma.choices[0].message.content
    assert _states(one_at_a_time) == {SMOL: "unloaded", GEMMA: "loaded"}

    # alternating requests on every API, concurrently: each answers by its model's name
    results: dict[int, str] = {}
    messages = anthropic.Anthropic(base_url=one_at_a_time.url, api_key="none", max_retries=0)

    def ask(i: int) -> None:
        model = (SMOL, GEMMA)[i % 2]
        if i % 3 == 0:
            results[i] = client.chat.completions.create(
                model=model, messages=HELLO, max_tokens=4, temperature=0).model
        elif i % 3 == 1:
            results[i] = client.completions.create(model=model, prompt="The sky is",
                                                   max_tokens=4, temperature=0).model
        else:
            results[i] = messages.messages.create(model=model, max_tokens=4,
                                                  messages=HELLO).model  # type: ignore[arg-type]

    # (four: each API and each model; every switch is a load of seconds on a CPU)
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert results == {i: (SMOL, GEMMA)[i % 2] for i in range(4)}

    # idle past --keep-alive: unloaded, its processes gone, the memory given back
    pids = _model_pids(one_at_a_time)
    assert pids
    wait_until(lambda: set(_states(one_at_a_time).values()) == {"unloaded"},
               "the idle model to unload", timeout=60)
    wait_until(lambda: all(process_gone(pid) for pid in pids), "its processes to exit")
    assert _tree_rss(one_at_a_time) <= rss_before * 1.10


@pytest.fixture(scope="module")
def both(models_dir: Path) -> Iterator[RunningServer]:
    yield from _router(models_dir, models_max=2, keep_alive=-1)


def test_load_and_unload_by_hand(both: RunningServer) -> None:
    for name in (SMOL, GEMMA):
        answer = both.post("/models/load", {"model": name}, timeout=300)
        assert answer.status_code == 200, answer.text
    assert _states(both) == {SMOL: "loaded", GEMMA: "loaded"}
    assert both.post("/models/load", {"model": "nope"}).status_code == 404
    # every API routes by its `model`: embeddings, rerank and Responses too
    client = both.client()
    vectors = client.embeddings.create(model=SMOL, input=["hello", "world"])
    assert vectors.model == SMOL and len(vectors.data) == 2
    ranked = both.post("/v1/rerank", {"model": GEMMA, "query": "sea",
                                      "documents": ["the ocean", "a desk"]})
    assert ranked.status_code == 200 and len(ranked.json()["results"]) == 2
    response = client.responses.create(model=GEMMA, input="Say hi.", max_output_tokens=8)
    assert response.model == GEMMA and response.output_text
    metrics = httpx.get(both.url + "/metrics", timeout=10).text
    for name in (SMOL, GEMMA):
        assert f'model_name="{name}"' in metrics
    assert metrics.count("# TYPE nanoserve:num_requests_running ") == 1


def test_every_name_of_a_model_is_answered_on_every_api(both: RunningServer) -> None:
    """The router and each model's server keep one name rule (model_names.py): the name, the
    name with Ollama's `:latest`, and the file's name reach the model on OpenAI's, Anthropic's
    and Ollama's routes; another tag is an unknown model, a 404 in each API's shape."""
    client = both.client()
    messages = anthropic.Anthropic(base_url=both.url, api_key="none", max_retries=0)
    talk = ollama.Client(host=both.url)
    for model in (SMOL, GEMMA):
        for name in (model, f"{model}:latest", f"{model}.gguf"):
            chat = client.chat.completions.create(model=name, messages=HELLO, max_tokens=2)
            assert chat.choices[0].message.content is not None, name
            message = messages.messages.create(model=name, max_tokens=2,
                                               messages=HELLO)  # type: ignore[arg-type]
            assert message.content, name
            reply = talk.chat(model=name, messages=HELLO, options={"num_predict": 2})
            assert reply.done, name
    unknown = f"{SMOL}:7b"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model=unknown, messages=HELLO, max_tokens=2)
    with pytest.raises(anthropic.NotFoundError) as refused:
        messages.messages.create(model=unknown, max_tokens=2,
                                 messages=HELLO)  # type: ignore[arg-type]
    assert refused.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(ollama.ResponseError, match="not found, try pulling it first") as lost:
        talk.chat(model=unknown, messages=HELLO)
    assert lost.value.status_code == 404


def test_the_chat_page_picks_the_model_and_the_dashboard_shows_each(
        both: RunningServer, browser: Browser, request: pytest.FixtureRequest,  # noqa: F811
        tmp_path: Path) -> None:
    for name in (SMOL, GEMMA):
        assert both.post("/models/load", {"model": name}, timeout=300).status_code == 200
    gemma_tokens = _series(both, "generation_tokens_total", GEMMA)
    smol_tokens = _series(both, "generation_tokens_total", SMOL)
    with watched_page(browser, both.url, request, tmp_path) as web:
        page = web.page
        page.goto(both.url + "/")
        page.wait_for_selector("body[data-ready=true]")
        picker = page.locator("#model-picker")
        expect(picker).to_be_visible()
        assert picker.locator("option").all_inner_texts() == [f"{SMOL} (loaded)",
                                                              f"{GEMMA} (loaded)"]
        picker.select_option(GEMMA)
        page.wait_for_selector("body[data-ready=true]")
        page.fill("#max_tokens", "6")
        page.fill("#input", "Hello!")
        page.press("#input", "Enter")
        answer = page.locator("#messages article.assistant").last
        expect(answer).to_have_attribute("data-state", "done", timeout=120_000)
        page.goto(both.url + f"/dashboard?model={GEMMA}")
        expect(page.locator("#title")).to_contain_text(GEMMA)
        expect(page.locator("#model-filter")).to_have_value(GEMMA)
        assert web.errors == [] and web.foreign_requests() == []
    assert _series(both, "generation_tokens_total", GEMMA) > gemma_tokens
    assert _series(both, "generation_tokens_total", SMOL) == smol_tokens


def test_a_killed_engine_core_fails_only_its_model_and_the_next_request_reloads_it(
        both: RunningServer) -> None:
    for name in (SMOL, GEMMA):
        assert both.post("/models/load", {"model": name}, timeout=300).status_code == 200
    client = both.client()
    outcomes: dict[str, list[Any]] = {SMOL: [], GEMMA: []}

    def ask(model: str) -> None:
        try:  # SmolLM2's run until its engine core is killed; Gemma's end on their own
            client.completions.create(model=model, prompt="Once upon a time",
                                      max_tokens=1500 if model == SMOL else 48,
                                      temperature=0, extra_body={"ignore_eos": True})
            outcomes[model].append("ok")
        except openai.APIStatusError as e:
            outcomes[model].append(e.status_code)

    threads = [threading.Thread(target=ask, args=(model,))
               for model in (SMOL, GEMMA, SMOL, GEMMA)]
    for thread in threads:
        thread.start()
    wait_until(lambda: _series(both, "num_requests_running", SMOL) == 2,
               "SmolLM2's requests to run", timeout=120)
    smol_server = next(p for p in psutil.Process(both.proc.pid).children()
                       if any(SMOL in part for part in p.cmdline()))
    engine_core = next(p for p in smol_server.children()
                       if "spawn_main" in " ".join(p.cmdline()))  # not the resource tracker
    os.kill(engine_core.pid, signal.SIGKILL)
    for thread in threads:
        thread.join(300)
    assert outcomes[SMOL] == [503, 503]
    assert outcomes[GEMMA] == ["ok", "ok"]
    wait_until(lambda: _states(both)[SMOL] == "unloaded", "the dead model to be unloaded")
    assert _states(both)[GEMMA] == "loaded"
    again = client.completions.create(model=SMOL, prompt="Hi", max_tokens=3, temperature=0)
    assert again.model == SMOL and _states(both)[SMOL] == "loaded"


def test_the_ollama_client_lists_runs_and_unloads_the_models(both: RunningServer) -> None:
    client = ollama.Client(host=both.url)
    listed = {m.model: m.details for m in client.list().models}
    assert set(listed) == {SMOL, GEMMA}
    assert listed[SMOL] is not None and listed[SMOL].quantization_level == "Q4_1"
    assert listed[GEMMA] is not None and listed[GEMMA].family == "gemma3"
    # an empty generate with keep_alive 0 unloads, without loading first
    unloaded = client.generate(model=SMOL, prompt="", keep_alive=0)
    assert unloaded.done_reason == "unload" and _states(both)[SMOL] == "unloaded"
    parts = list(client.generate(model=SMOL, prompt="The sky is", stream=True,
                                 options={"temperature": 0, "num_predict": 4}))
    assert parts[-1].done and parts[-1].eval_count == 4
    reply = client.chat(model=f"{GEMMA}:latest", messages=HELLO,
                        options={"temperature": 0, "num_predict": 4})
    assert reply.message.content and reply.model == f"{GEMMA}:latest"
    running = {m.model: m for m in client.ps().models}
    assert set(running) == {SMOL, GEMMA} and running[SMOL].context_length == 2048
    assert client.show(SMOL).details.quantization_level == "Q4_1"  # type: ignore[union-attr]
    # keep_alive 0 on a real request: the model unloads once its answer is out
    client.generate(model=GEMMA, prompt="Hi", keep_alive=0, options={"num_predict": 2})
    wait_until(lambda: _states(both)[GEMMA] == "unloaded", "Gemma to unload")
    assert {m.model for m in client.ps().models} == {SMOL}


def test_a_keyed_router_asks_for_the_key_before_anything_loads(models_dir: Path) -> None:
    server = RunningServer("--models-dir", str(models_dir), api_key="router-key")
    try:
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        for path in ("/v1/models", "/api/tags", "/metrics"):
            assert httpx.get(server.url + path, timeout=10).status_code == 401, path
        refused = httpx.post(server.url + "/v1/chat/completions", timeout=10,
                             json={"model": SMOL, "messages": HELLO})
        assert refused.status_code == 401 and _model_pids(server) == []
        # in each API's own error shape
        assert "error" in httpx.get(server.url + "/api/tags", timeout=10).json()
        assert isinstance(httpx.get(server.url + "/api/tags", timeout=10).json()["error"], str)
        messages = httpx.post(server.url + "/v1/messages", timeout=10,
                              json={"model": SMOL, "max_tokens": 2, "messages": HELLO})
        assert messages.json()["error"]["type"] == "authentication_error"
        keyed = httpx.get(server.url + "/v1/models", headers=server.headers, timeout=10)
        assert keyed.status_code == 200 and len(keyed.json()["data"]) == 2
    finally:
        assert server.stop() == 0
