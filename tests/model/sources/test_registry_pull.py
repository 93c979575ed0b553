"""Pulling Ollama names from an OCI registry (model/sources/registry.py) into the store
(store.py): against a registry served on loopback (registry_server.py) holding the real default
model's GGUF as `smollm2:135m`, into a store in a temporary folder."""

from __future__ import annotations

import filecmp
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from registry_server import RegistryServer

from nanoserve.model.model_path import default_model_path
from nanoserve.model.sources.errors import (
    ModelNotFoundError,
    ModelNotPulledError,
    ModelSourceError,
)
from nanoserve.model.sources.fetch import local_model, pull_model
from nanoserve.model.sources.names import RegistryName, parse_model_name
from nanoserve.model.sources.progress import Progress
from nanoserve.model.sources.registry import pull_from_registry
from nanoserve.model.sources.store import (
    PulledModel,
    find_pulled,
    list_pulled,
    models_home,
    record_pulled,
    remove_pulled,
)

NAME = "smollm2:135m"


@pytest.fixture(scope="module")
def registry() -> Iterator[RegistryServer]:
    with RegistryServer() as server:
        server.add_model(NAME, default_model_path())
        # the same GGUF under a second tag, with a layer of its own
        server.add_model("smollm2:latest", default_model_path(), system="Be brief.")
        yield server


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
          registry: RegistryServer) -> Iterator[Path]:
    monkeypatch.setenv("NANOSERVE_MODELS", str(tmp_path / "store"))
    monkeypatch.setenv("NANOSERVE_REGISTRY", registry.url)
    yield tmp_path / "store"
    registry.hooks.clear()


def _pull(text: str, events: list[Progress] | None = None) -> PulledModel:
    name = parse_model_name(text)
    assert isinstance(name, RegistryName)
    return pull_from_registry(name, progress=(events if events is not None else []).append)


def _model_digest(registry: RegistryServer, tag: str = "135m") -> str:
    import json

    manifest = json.loads(registry.manifests[("library/smollm2", tag)])
    return str(manifest["layers"][0]["digest"])


def test_a_pull_fetches_checks_and_records_the_model_as_ollama_reports_it(
        registry: RegistryServer, store: Path) -> None:
    events: list[Progress] = []
    pulled = _pull(NAME, events)
    digest = _model_digest(registry)
    assert pulled.name == NAME and pulled.digest == digest
    assert pulled.path == store / "blobs" / f"sha256-{digest[7:]}"
    assert filecmp.cmp(pulled.path, default_model_path(), shallow=False)
    assert pulled.source == f"{registry.url}/library/smollm2:135m"
    host = registry.url.removeprefix("http://")
    assert (store / "manifests" / host / "library" / "smollm2" / "135m").is_file()
    assert not list((store / "blobs").glob("*-partial"))
    # Ollama's events, in its order: the manifest, each blob up to its total, then the end
    statuses = [e.status for e in events]
    assert statuses[0] == "pulling manifest"
    assert statuses[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    mine = [e for e in events if e.digest == digest]
    assert mine[0].status == f"pulling {digest[7:19]}" and mine[0].completed == 0
    assert mine[-1].completed == mine[-1].total == default_model_path().stat().st_size
    assert [e.to_json() for e in events[-1:]] == [{"status": "success"}]
    assert find_pulled(NAME) == pulled and list_pulled() == [pulled]
    # a name that is pulled loads without the network; pulled again, nothing is fetched again
    assert local_model(NAME, may_download=False) == pulled.path
    gets = len(registry.blob_gets(digest))
    again = pull_model(NAME)
    assert again.path == pulled.path and len(registry.blob_gets(digest)) == gets


def test_a_cut_transfer_resumes_from_its_partial_file(registry: RegistryServer,
                                                       store: Path) -> None:
    digest = _model_digest(registry)
    size = default_model_path().stat().st_size
    registry.cut(digest, size // 2)
    with pytest.raises(ModelSourceError, match=r"was cut at \d+ of \d+ bytes.*pull again"):
        _pull(NAME)
    partial = store / "blobs" / f"sha256-{digest[7:]}-partial"
    kept = partial.stat().st_size
    assert 0 < kept <= size // 2
    assert find_pulled(NAME) is None and not (store / "blobs" / f"sha256-{digest[7:]}").exists()
    with pytest.raises(ModelNotPulledError, match="nanoserve pull smollm2:135m"):
        local_model(NAME, may_download=False)  # a partial file is never loaded

    events: list[Progress] = []
    pulled = _pull(NAME, events)
    assert registry.blob_gets(digest)[-1] == f"bytes={kept}-"
    assert next(e.completed for e in events if e.digest == digest) == kept
    assert filecmp.cmp(pulled.path, default_model_path(), shallow=False)
    assert not partial.exists()


def test_a_corrupted_byte_fails_the_check_and_nothing_is_kept(registry: RegistryServer,
                                                               store: Path) -> None:
    digest = _model_digest(registry)
    registry.corrupt(digest, 12_345_678)
    with pytest.raises(ModelSourceError, match=f"blob {digest} failed its sha256 check.*"
                                               "deleted"):
        _pull(NAME)
    assert not list((store / "blobs").glob(f"sha256-{digest[7:]}*"))
    assert find_pulled(NAME) is None and not list(store.glob("manifests/**/135m"))
    registry.repair(digest)
    pulled = _pull(NAME)
    # a kept blob damaged on disk: a pull hashes it again, deletes it, and the next fetches it
    with open(pulled.path, "r+b") as file:
        file.seek(1000)
        byte = file.read(1)
        file.seek(1000)
        file.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ModelSourceError, match=r"damaged on disk.*pull again"):
        _pull(NAME)
    assert not pulled.path.exists()
    assert filecmp.cmp(_pull(NAME).path, default_model_path(), shallow=False)


def test_failures_name_the_model_the_cause_and_the_fix(registry: RegistryServer, store: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ModelNotFoundError, match=r"smollm2:7b.*no model library/smollm2 "
                                                 r"with the tag '7b'.*check the name"):
        _pull("smollm2:7b")
    with pytest.raises(ModelNotFoundError, match="'nope:latest'"):
        pull_model("nope")
    registry.require_login = True
    try:
        with pytest.raises(ModelSourceError, match=r"refused the manifest \(HTTP 401.*public"):
            _pull(NAME)
    finally:
        registry.require_login = False
    # a name's own host: a loopback one over http, the configured registry not asked
    host = registry.url.removeprefix("http://")
    assert _pull(f"{host}/library/smollm2:135m").source.startswith(registry.url)
    monkeypatch.setenv("NANOSERVE_REGISTRY", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(ModelSourceError, match=r"cannot reach the registry http://127\.0\.0\.1:9"
                                               r".*check the network"):
        _pull(NAME)
    monkeypatch.setenv("NANOSERVE_REGISTRY", "http://registry.example.com")
    with pytest.raises(ModelSourceError, match=r"plain http to another machine.*use https"):
        _pull(NAME)
    assert list_pulled() == [find_pulled(f"{host}/library/smollm2:135m")]


def test_list_and_rm_free_only_what_no_other_model_uses(registry: RegistryServer,
                                                        store: Path) -> None:
    # two names of one GGUF pulled at once: its blob is fetched once
    digest = _model_digest(registry)
    gets = len(registry.blob_gets(digest))
    threads = [threading.Thread(target=_pull, args=(name,)) for name in (NAME, "smollm2")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(registry.blob_gets(digest)) == gets + 1
    assert [m.name for m in list_pulled()] == ["smollm2:135m", "smollm2:latest"]
    blobs = {p.name for p in (store / "blobs").iterdir()}
    assert len(blobs) == 7  # smollm2:135m's 5, smollm2:latest's own system and config
    assert remove_pulled(NAME)
    assert find_pulled(NAME) is None and (store / "blobs" / f"sha256-{digest[7:]}").exists()
    assert not list(store.glob("manifests/**/135m"))
    assert remove_pulled("smollm2")  # `smollm2:latest`, as Ollama reads it
    assert list_pulled() == [] and list((store / "blobs").iterdir()) == []
    assert not (store / "manifests").exists() or not any((store / "manifests").iterdir())
    assert not remove_pulled("smollm2")


def test_the_store_is_where_its_variable_or_the_cache_dir_says(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NANOSERVE_MODELS", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert models_home() == tmp_path / "cache" / "nanoserve" / "models"
    monkeypatch.setenv("NANOSERVE_MODELS", str(tmp_path / "mine"))
    assert models_home() == tmp_path / "mine"
    # a hub pull's record points into huggingface_hub's cache: removed, its files stay there
    snapshot = tmp_path / "hub" / "snapshot"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    hub = PulledModel(name="org/repo", source="http://hub/org/repo", path=snapshot, size=2,
                      digest="", modified_at=1.0)
    record_pulled(hub)
    assert find_pulled("org/repo") == hub and find_pulled("org/repo:latest") == hub
    assert remove_pulled("org/repo") and find_pulled("org/repo") is None
    assert (snapshot / "config.json").is_file()
