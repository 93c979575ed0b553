"""Models by name on a `--models-dir` router: the official `ollama` client's pull (streamed
progress), list and delete, then a chat with the pulled name; `nanoserve pull/list/rm` beside a
running router; a hub name through `/api/pull`; a name nobody pulled as a 404 that says how to
pull it; and a router started empty with `--allow-pull` that pulls the hub name a request names
while another model serves.

Every server pulls from a registry served on loopback by the test (registry_server.py, the real
default GGUF as `smollm2:135m`) and a hub served so too (tests/hub_server.py), into a store and
a hub cache in temporary folders; nothing reaches a real host.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import psutil
import pytest
from hub_server import LocalHub, gguf_repo_files, serve_hub
from server_harness import RunningServer, process_gone, stream_chat, wait_until

from nanoserve.entrypoints.cli import main
from nanoserve.model.model_path import default_model_path
from nanoserve.model.sources.store import PulledModel, record_pulled

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model" / "sources"))
from registry_server import RegistryServer

pytestmark = [pytest.mark.server, pytest.mark.slow]

NAME = "smollm2:135m"
HUB_REPO = "nanoserve-test/SmolLM2-135M-Instruct-GGUF"
HUB_NAME = f"hf.co/{HUB_REPO}:Q8_0"
TINY = "test/tiny-llama"  # the second model: the tiny checkpoint, recorded as a hub pull
HELLO: Any = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def registry() -> Iterator[RegistryServer]:
    with RegistryServer() as server:
        server.add_model(NAME, default_model_path())
        yield server


@pytest.fixture(scope="module")
def hub() -> Iterator[LocalHub]:
    with serve_hub({HUB_REPO: gguf_repo_files(default_model_path(), "SmolLM2-135M-Instruct")}) \
            as local:
        yield local


def _model_digest(registry: RegistryServer) -> str:
    manifest = json.loads(registry.manifests[("library/smollm2", "135m")])
    return str(manifest["layers"][0]["digest"])


def _cards(server: RunningServer) -> dict[str, dict[str, Any]]:
    body = httpx.get(server.url + "/v1/models", timeout=10).json()
    return {card["id"]: card for card in body["data"]}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("store")


@pytest.fixture(scope="module")
def router(registry: RegistryServer, hub: LocalHub, store: Path,
           tmp_path_factory: pytest.TempPathFactory,
           tiny_model_dir: Any) -> Iterator[RunningServer]:
    """A router of a directory holding the tiny model (never loaded here), pulling from the
    test's registry and hub into `store` (and a hub cache of its own), without --allow-pull."""
    models = tmp_path_factory.mktemp("models")
    (models / "tiny").symlink_to(tiny_model_dir("llama"))
    server = RunningServer("--models-dir", str(models), "--keep-alive", "-1",
                           "--max-model-len", "1024",
                           env={"NANOSERVE_REGISTRY": registry.url,
                                "NANOSERVE_MODELS": str(store), "HF_ENDPOINT": hub.url,
                                "HF_HOME": str(tmp_path_factory.mktemp("hf-home"))})
    yield server
    assert server.stop() == 0


def test_a_name_nobody_pulled_is_a_404_that_says_how_to_pull_it(
        router: RunningServer, registry: RegistryServer) -> None:
    asked = len(registry.requests)
    with pytest.raises(openai.NotFoundError, match=f"`nanoserve pull {NAME}`"):
        router.client().chat.completions.create(model=NAME, messages=HELLO, max_tokens=2)
    answer = httpx.post(router.url + "/v1/messages", timeout=10, json={
        "model": NAME, "max_tokens": 2, "messages": HELLO})
    assert answer.status_code == 404 and answer.json()["error"]["type"] == "not_found_error"
    assert f"nanoserve pull {NAME}" in answer.json()["error"]["message"]
    with pytest.raises(ollama.ResponseError) as lost:
        ollama.Client(host=router.url).chat(model=NAME, messages=HELLO)
    assert lost.value.status_code == 404
    assert lost.value.error.startswith(f'model "{NAME}" not found, try pulling it first '
                                       f"(`ollama pull {NAME}`")
    assert len(registry.requests) == asked  # no download behind a chat request


def test_a_pull_its_clients_left_stops_and_the_next_resumes_it(
        router: RunningServer, registry: RegistryServer, store: Path) -> None:
    digest = _model_digest(registry)
    size = default_model_path().stat().st_size
    hooks = registry.hold(digest, size // 2)
    with httpx.stream("POST", router.url + "/api/pull", json={"model": NAME},
                      timeout=60) as answer:
        lines = answer.iter_lines()  # kept: a closed iterator closes the connection
        assert any(json.loads(line).get("digest") == digest for line in lines)
        assert hooks.held.wait(60)
        assert _cards(router)[NAME]["status"]["waiting"] == 1
    wait_until(lambda: _cards(router)[NAME]["status"]["waiting"] == 0, "the client to leave")
    hooks.released.set()  # the pull's next MiB: it stops there, its partial file kept
    wait_until(lambda: NAME not in _cards(router), "the pull to stop")
    kept = (store / "blobs" / f"sha256-{digest[7:]}-partial").stat().st_size
    assert 0 < kept < size and not (store / "blobs" / f"sha256-{digest[7:]}").exists()

    events = list(ollama.Client(host=router.url).pull(NAME, stream=True))
    assert registry.blob_gets(digest)[-1] == f"bytes={kept}-"
    mine = [e for e in events if e.digest == digest]
    assert mine[0].completed == kept and mine[-1].completed == mine[-1].total == size
    assert events[0].status == "pulling manifest"
    assert [e.status for e in events[-3:]] == ["verifying sha256 digest", "writing manifest",
                                               "success"]


def test_the_ollama_client_pulls_lists_chats_with_and_deletes_a_model(
        router: RunningServer, registry: RegistryServer, store: Path) -> None:
    client = ollama.Client(host=router.url, timeout=300)
    digest = _model_digest(registry)
    size = default_model_path().stat().st_size
    events = list(client.pull(NAME, stream=True))
    assert events[0].status == "pulling manifest" and events[-1].status == "success"
    mine = [e for e in events if e.digest == digest]
    assert mine[0].status == f"pulling {digest[7:19]}"
    assert mine[-1].completed == mine[-1].total == size
    assert [e.status for e in events[-3:]] == ["verifying sha256 digest", "writing manifest",
                                               "success"]
    listed = {m.model: m for m in client.list().models}
    assert set(listed) == {NAME, "tiny"}
    assert listed[NAME].digest == digest[7:] and (listed[NAME].size or 0) > size
    details = listed[NAME].details
    assert details is not None and details.family == "llama"
    assert _cards(router)[NAME]["status"]["value"] == "unloaded"

    reply = client.chat(model=NAME, messages=HELLO, options={"temperature": 0,
                                                             "num_predict": 4})
    assert reply.model == NAME and reply.message.content
    chat = router.client().chat.completions.create(model=NAME, messages=HELLO, max_tokens=3)
    assert chat.model == NAME and chat.choices[0].message.content
    assert client.pull(NAME).status == "success"  # here already: checked, nothing fetched

    with pytest.raises(ollama.ResponseError, match="no model library/smollm2 with the tag"):
        list(client.pull("smollm2:7b", stream=True))  # the error line of a stream
    with pytest.raises(ollama.ResponseError, match="with the tag '7b'") as failed:
        client.pull("smollm2:7b")
    assert failed.value.status_code == 500  # Ollama's status for a failed pull
    with pytest.raises(ollama.ResponseError, match="invalid model name"):
        client.pull("not a name")

    servers = [p.pid for p in psutil.Process(router.proc.pid).children()
               if any(NAME in part for part in p.cmdline())]
    assert len(servers) == 1
    assert client.delete(NAME).status == "success"  # unloaded, and out of the store
    wait_until(lambda: process_gone(servers[0]), "the model's server to stop")
    assert {m.model for m in client.list().models} == {"tiny"} and NAME not in _cards(router)
    assert list((store / "blobs").iterdir()) == []
    with pytest.raises(ollama.ResponseError, match=f"model '{NAME}' not found") as gone:
        client.delete(NAME)
    assert gone.value.status_code == 404
    with pytest.raises(ollama.ResponseError, match="a model of --models-dir"):
        client.delete("tiny")
    with pytest.raises(ollama.ResponseError, match="not found, try pulling it first"):
        client.chat(model=NAME, messages=HELLO)


def test_a_hub_name_is_pulled_listed_and_deleted_through_ollamas_api(
        router: RunningServer) -> None:
    client = ollama.Client(host=router.url, timeout=300)
    events = list(client.pull(HUB_NAME, stream=True))
    size = default_model_path().stat().st_size
    assert events[0].status == "pulling manifest" and events[-1].status == "success"
    assert any(e.completed == e.total == size for e in events)
    assert HUB_NAME in {m.model for m in client.list().models}
    card = _cards(router)[HUB_NAME]
    assert card["status"]["value"] == "unloaded" and "hf-home" in card["path"]
    assert client.delete(HUB_NAME).status == "success"
    assert HUB_NAME not in {m.model for m in client.list().models}
    assert Path(card["path"]).is_file()  # the hub's cache is shared with other tools: kept


def test_what_nanoserve_pull_and_rm_do_a_running_router_sees(
        router: RunningServer, registry: RegistryServer, store: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NANOSERVE_MODELS", str(store))
    monkeypatch.setenv("NANOSERVE_REGISTRY", registry.url)
    assert main(["pull", NAME]) == 0
    assert _cards(router)[NAME]["status"]["value"] == "unloaded"
    assert NAME in {m.model for m in ollama.Client(host=router.url).list().models}
    assert main(["rm", NAME]) == 0
    assert NAME not in _cards(router)


def test_a_router_started_empty_pulls_what_a_request_names_while_another_model_serves(
        hub: LocalHub, tmp_path: Path, tiny_model_dir: Any) -> None:
    """A hub name asked for by a chat: pulled (its transfer held until the other model has
    loaded and streamed to its end), loaded, answered."""
    store = tmp_path / "store"
    tiny = tiny_model_dir("llama")
    with pytest.MonkeyPatch.context() as env:  # a model pulled earlier: the second model
        env.setenv("NANOSERVE_MODELS", str(store))
        record_pulled(PulledModel(TINY, "tests: tiny_model_dir", tiny, 0, "", 0.0))
    (tmp_path / "empty").mkdir()
    log = tmp_path / "router.log"
    server = RunningServer("--models-dir", str(tmp_path / "empty"), "--allow-pull",
                           "--keep-alive", "-1", "--max-model-len", "1024", "--log-level",
                           "info", log=log, env={"HF_ENDPOINT": hub.url,
                                                 "HF_HOME": str(tmp_path / "hf-home"),
                                                 "NANOSERVE_MODELS": str(store)})
    gguf = "SmolLM2-135M-Instruct-Q8_0.gguf"
    released = hub.hold_gets(HUB_REPO, gguf)  # the model file's bytes wait until released
    try:
        assert set(_cards(server)) == {TINY}
        answers: list[Any] = []
        asking = threading.Thread(target=lambda: answers.append(
            server.client().chat.completions.create(model=HUB_NAME, messages=HELLO,
                                                    max_tokens=4, temperature=0)))
        asking.start()
        wait_until(lambda: hub.num_gets(HUB_REPO, gguf) > 0, "the model file's transfer")
        pulling = wait_until(lambda: _cards(server).get(HUB_NAME), "the pull in /v1/models")
        assert pulling["status"]["value"] == "pulling"
        # the other model loads and streams to its end while the pull is held
        assert stream_chat(server.client(), TINY, HELLO, max_tokens=48) in ("stop", "length")
        assert asking.is_alive() and not answers
        released.set()
        asking.join(300)
        assert answers and answers[0].model == HUB_NAME
        assert answers[0].choices[0].message.content
        assert _cards(server)[HUB_NAME]["status"]["value"] == "loaded"
        text = log.read_text()
        sha256 = hub.file(HUB_REPO, gguf).sha256
        assert sha256 and f"pulling {HUB_NAME}: pulling {sha256[:12]}" in text
        assert f"pulling {HUB_NAME}: success" in text
    finally:
        released.set()
        assert server.stop() == 0
