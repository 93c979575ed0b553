"""Models by hub name (model/sources/hub.py), downloaded by the real huggingface_hub from a hub
served on loopback (tests/hub_server.py): the file each spelling names, resumed and checked
transfers, the lock, offline mode and the one-line failures.

One hub serves the module; each test has its own empty cache (`HF_HOME`), so each download is
real. The default model's GGUF (~100 MB) is downloaded once; the transfer tests use a 24 MiB
file of random bytes (three of huggingface_hub's 10 MiB chunks).
"""

from __future__ import annotations

import errno
import filecmp
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from hub_server import LocalHub, checkpoint_repo_files, gguf_repo_files, start_hub

from nanoserve.config import hub_environment
from nanoserve.model.model_path import default_model_path
from nanoserve.model.sources.errors import ModelSourceError
from nanoserve.model.sources.fetch import local_model
from nanoserve.model.sources.hub import fetch_from_hub
from nanoserve.model.sources.hub_errors import explain
from nanoserve.model.sources.names import HubName, parse_model_name
from nanoserve.model.sources.progress import Progress

GGUF_REPO = "nanoserve-test/SmolLM2-135M-Instruct-GGUF"
STEM = "SmolLM2-135M-Instruct"
BIG_REPO, BIG = "nanoserve-test/big-GGUF", "big-Q4_K_M.gguf"
SPLIT_REPO = "nanoserve-test/split-GGUF"
FIRST_REPO = "nanoserve-test/no-default-GGUF"
TINY_REPO = "nanoserve-test/tiny-llama"
SHARDED_REPO = "nanoserve-test/sharded"
GATED_REPO = "nanoserve-test/gated-GGUF"
BIG_BYTES = os.urandom(24 << 20)
SPLIT_PARTS = [f"m-Q4_K_M-0000{i}-of-00003.gguf" for i in (1, 2, 3)]


@pytest.fixture(scope="module")
def hub(tiny_model_dir: Callable[[str], Path]) -> Iterator[LocalHub]:
    tiny = checkpoint_repo_files(tiny_model_dir("llama"))
    index = b'{"weight_map": {"a": "model-00001-of-00002.safetensors", ' \
            b'"b": "model-00002-of-00002.safetensors"}}'
    hub = start_hub({
        GGUF_REPO: gguf_repo_files(default_model_path(), STEM) | {"README.md": b"# SmolLM2"},
        BIG_REPO: {BIG: BIG_BYTES},
        SPLIT_REPO: {name: name.encode() * 1000 for name in SPLIT_PARTS}
        | {"m-Q8_0.gguf": b"q8" * 1000},
        FIRST_REPO: {"a-mmproj-F16.gguf": b"projector", "m-Q5_K_S.gguf": b"q5" * 1000,
                     "m-Q8_0.gguf": b"q8" * 1000},
        TINY_REPO: tiny | {"README.md": b"# tiny", "pytorch_model.bin": b"not read",
                           "onnx/model.onnx": b"not read"},
        SHARDED_REPO: {"config.json": b"{}", "model.safetensors.index.json": index,
                       "model-00001-of-00002.safetensors": b"1" * 100,
                       "model-00002-of-00002.safetensors": b"2" * 100,
                       "consolidated.safetensors": b"12" * 100},
        GATED_REPO: {"m-Q4_K_M.gguf": b"gated" * 1000, "README.md": b"# gated"},
    }, gated={GATED_REPO})
    yield hub
    hub.close()


@pytest.fixture(autouse=True)
def hub_env(hub: LocalHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty cache and store per test, the hub as the endpoint, no token, online; the hub's
    log starts empty."""
    import huggingface_hub.constants

    hub.clear_log()
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("NANOSERVE_MODELS", str(tmp_path / "models"))
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE",
                 "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    # huggingface_hub's user agent looks up its registry of AI agents once a process, at the
    # endpoint it read at import (maybe the real hub's): never leave loopback
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_TELEMETRY", True)


def fetch(text: str, **kwargs: Any) -> Path:
    name = parse_model_name(text, kwargs.pop("revision", None))
    assert isinstance(name, HubName), text
    return fetch_from_hub(name, **kwargs)


def failure(text: str, **kwargs: Any) -> str:
    """The one line a failed fetch of `text` answers."""
    with pytest.raises(ModelSourceError) as caught:
        fetch(text, **kwargs)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"model {text!r}"), message
    return message


def test_each_gguf_spelling_is_the_file_of_its_quant(hub: LocalHub) -> None:
    events: list[Progress] = []
    default = local_model(GGUF_REPO, progress=events.append)  # Q4_K_M, llama.cpp's default
    assert default.name == f"{STEM}-Q4_K_M.gguf" and default.is_symlink()
    assert filecmp.cmp(default, default_model_path(), shallow=False)
    sha256 = hub.file(GGUF_REPO, default.name).sha256
    assert default.resolve().name == sha256  # huggingface_hub's cache: blobs/<sha256>
    size = default_model_path().stat().st_size
    transfer = [e for e in events if e.digest == f"sha256:{sha256}"]
    assert transfer[-1] == Progress(f"pulling {sha256[:12]}", f"sha256:{sha256}", size, size)
    assert [e.status for e in events if e.digest is None] == [
        "pulling manifest", "verifying sha256 digest", "success"]
    assert fetch(f"hf.co/{GGUF_REPO}:Q8_0").name == f"{STEM}-Q8_0.gguf"
    assert fetch(f"{GGUF_REPO}:q4_k_m") == default
    # the two names hold the same bytes: one blob, downloaded once; README.md never
    assert fetch(f"{GGUF_REPO}:Q8_0").resolve() == default.resolve()
    assert hub.num_gets(GGUF_REPO, f"{STEM}-Q8_0.gguf") == 0
    assert hub.num_gets(GGUF_REPO, "README.md") == 0


def test_without_the_default_quant_the_first_model_gguf(hub: LocalHub) -> None:
    assert fetch(FIRST_REPO).name == "m-Q5_K_S.gguf"  # not the projector listed before it


def test_a_split_gguf_is_fetched_whole_and_named_by_its_first_part(hub: LocalHub) -> None:
    first = fetch(SPLIT_REPO)
    assert first.name == SPLIT_PARTS[0]
    for part in SPLIT_PARTS:
        assert (first.parent / part).read_bytes() == part.encode() * 1000
    assert hub.num_gets(SPLIT_REPO, "m-Q8_0.gguf") == 0


def test_a_checkpoint_is_its_loader_files(hub: LocalHub,
                                          tiny_model_dir: Callable[[str], Path]) -> None:
    snapshot = fetch(TINY_REPO)
    assert snapshot.is_dir() and snapshot.parent.name == "snapshots"
    source = tiny_model_dir("llama")  # config, generation config, weights, tokenizer, template
    assert {p.name for p in snapshot.iterdir()} == {p.name for p in source.iterdir()}
    for path in source.iterdir():
        assert filecmp.cmp(snapshot / path.name, path, shallow=False), path.name
    for unread in ("README.md", "pytorch_model.bin", "onnx/model.onnx"):
        assert hub.num_gets(TINY_REPO, unread) == 0


def test_a_sharded_checkpoint_is_the_shards_its_index_names(hub: LocalHub) -> None:
    snapshot = fetch(SHARDED_REPO)
    assert sorted(p.name for p in snapshot.iterdir()) == [
        "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json"]


def test_a_missing_quant_lists_the_quants_offered(hub: LocalHub) -> None:
    message = failure(f"{GGUF_REPO}:Q6_K")
    assert f"has no Q6_K file; it offers Q4_K_M, Q8_0; name one of them, as {GGUF_REPO}:Q4_K_M" \
        in message
    assert "it offers Q4_K_M, Q8_0" in failure(f"hf.co/{GGUF_REPO}:Q4_K")  # a whole word only
    assert "holds no .gguf file" in failure(f"{TINY_REPO}:Q8_0")


def test_a_transfer_cut_halfway_resumes_with_a_range_request(hub: LocalHub) -> None:
    hub.cut_next_get(BIG_REPO, BIG)
    path = fetch(BIG_REPO)
    # huggingface_hub's http_get asks for the rest from what it wrote (whole 10 MiB chunks)
    assert hub.ranges(BIG_REPO, BIG) == [f"bytes={10 << 20}-"]
    assert path.read_bytes() == BIG_BYTES


class CtrlC(BaseException):
    """What Ctrl-C raises in the middle of a transfer (a BaseException, as KeyboardInterrupt)."""


def test_a_download_stopped_midway_resumes_in_the_next_process(hub: LocalHub) -> None:
    def stop_after_a_chunk(event: Progress) -> None:
        if (event.completed or 0) > 10 << 20:  # the second chunk, before it is written
            raise CtrlC

    with pytest.raises(CtrlC):
        fetch(BIG_REPO, progress=stop_after_a_chunk)
    blobs = hub_environment().cache_dir / "models--nanoserve-test--big-GGUF" / "blobs"
    [partial] = blobs.iterdir()
    assert partial.name.endswith(".incomplete") and partial.stat().st_size == 10 << 20
    events: list[Progress] = []
    assert fetch(BIG_REPO, progress=events.append).read_bytes() == BIG_BYTES
    assert hub.ranges(BIG_REPO, BIG) == [f"bytes={10 << 20}-"]
    assert next(e.completed for e in events if e.digest) == 10 << 20  # the bar starts there
    assert not partial.exists()


def test_a_corrupted_byte_fails_the_checksum_and_leaves_nothing(hub: LocalHub) -> None:
    hub.corrupt_next_get(BIG_REPO, BIG)
    message = failure(BIG_REPO)
    assert f"{BIG} failed its checksum" in message and "run again" in message
    storage = hub_environment().cache_dir / "models--nanoserve-test--big-GGUF"
    assert list((storage / "blobs").iterdir()) == []
    assert not any(p.is_file() for p in (storage / "snapshots").rglob("*"))
    assert "nothing of" in offline_failure(BIG_REPO)  # nor a ref a later start would follow
    assert fetch(BIG_REPO).read_bytes() == BIG_BYTES  # downloaded anew
    assert hub.ranges(BIG_REPO, BIG) == []


def test_a_corrupted_git_file_is_deleted_with_its_link(hub: LocalHub) -> None:
    hub.corrupt_next_get(TINY_REPO, "config.json")
    assert "config.json failed its checksum (git sha1" in failure(TINY_REPO)
    storage = hub_environment().cache_dir / "models--nanoserve-test--tiny-llama"
    blob = storage / "blobs" / hub.file(TINY_REPO, "config.json").blob_id
    assert not blob.exists() and not list(storage.glob("snapshots/*/config.json"))
    source = hub.file(TINY_REPO, "config.json").source
    assert isinstance(source, Path)
    assert (fetch(TINY_REPO) / "config.json").read_bytes() == source.read_bytes()


def test_a_gated_repository_needs_a_token(hub: LocalHub, monkeypatch: pytest.MonkeyPatch) -> None:
    message = failure(GATED_REPO)
    assert "is gated: its files need a Hugging Face token" in message
    assert "--hf-token or set HF_TOKEN" in message
    assert "has no access" in failure(GATED_REPO, token="hf_wrong")
    assert fetch(GATED_REPO, token=hub.token).read_bytes() == b"gated" * 1000
    monkeypatch.setenv("HF_TOKEN", hub.token)  # read by huggingface_hub itself
    monkeypatch.setenv("HF_HOME", str(hub_environment().cache_dir.parent / "again"))
    assert fetch(GATED_REPO).read_bytes() == b"gated" * 1000


def offline_failure(text: str) -> str:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        return failure(text)


def test_offline_serves_the_cache_and_names_what_is_missing(
        hub: LocalHub, monkeypatch: pytest.MonkeyPatch) -> None:
    online = fetch(SPLIT_REPO)
    seen = len(hub.requests)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert fetch(SPLIT_REPO) == online and len(hub.requests) == seen  # not one request
    assert "the cache (HF_HUB_OFFLINE is set) has no Q8_0 file; it offers Q4_K_M" in failure(
        f"{SPLIT_REPO}:Q8_0")
    assert (f"HF_HUB_OFFLINE is set and nothing of {TINY_REPO} (revision main) is in the cache"
            in failure(TINY_REPO))
    assert "unset HF_HUB_OFFLINE" in failure(TINY_REPO)


def test_an_unreachable_hub_serves_the_cache(hub: LocalHub, monkeypatch: pytest.MonkeyPatch,
                                             closed_port_url: str) -> None:
    online = fetch(SPLIT_REPO)
    monkeypatch.setenv("HF_ENDPOINT", closed_port_url)
    assert fetch(SPLIT_REPO) == online


def test_a_revision_is_its_own_files(hub: LocalHub) -> None:
    commit = hub.add_repo(FIRST_REPO, {"m-Q4_K_M.gguf": b"v1" * 1000}, revision="v1")
    assert fetch(FIRST_REPO, revision="v1").read_bytes() == b"v1" * 1000
    assert fetch(FIRST_REPO, revision=commit).read_bytes() == b"v1" * 1000
    assert fetch(FIRST_REPO).name == "m-Q5_K_S.gguf"
    assert "has no revision 'v2'" in failure(FIRST_REPO, revision="v2")


@pytest.fixture
def closed_port_url() -> str:
    import socket

    with socket.socket() as s:  # a port just freed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_unknown_repositories_and_unreachable_hubs_are_one_line_errors(
        hub: LocalHub, monkeypatch: pytest.MonkeyPatch, closed_port_url: str) -> None:
    assert f"no repository nanoserve-test/nope at {hub.url}" in failure("nanoserve-test/nope")
    monkeypatch.setenv("HF_ENDPOINT", closed_port_url)
    message = failure(GGUF_REPO)
    assert f"the hub {closed_port_url} cannot be reached" in message
    assert "Connection refused" in message and "HF_ENDPOINT" in message


@pytest.mark.parametrize(("error", "cause", "fix"), [
    (OSError(errno.ENOSPC, "No space left on device"), "the disk holding", "HF_HUB_CACHE"),
    (httpx2.RemoteProtocolError("peer closed connection"), "the transfer was interrupted",
     "resumes where it stopped"),
    (OSError("Consistency check failed: file should be of size 9 but has size 4"),
     "the transfer was interrupted", "resumes where it stopped"),
])
def test_a_full_disk_and_a_cut_transfer_are_one_line(error: BaseException, cause: str,
                                                       fix: str) -> None:
    message = str(explain(HubName("org/m"), error, hub_environment(), None))
    assert message.startswith(f"model 'org/m': {cause}") and fix in message


FETCH_IN_A_PROCESS = """
from nanoserve.model.sources.hub import fetch_from_hub
from nanoserve.model.sources.names import HubName
print(fetch_from_hub(HubName({repo!r})))
"""


def test_two_processes_download_a_blob_once(hub: LocalHub) -> None:
    release = hub.hold_gets(BIG_REPO, BIG)
    script = FETCH_IN_A_PROCESS.format(repo=BIG_REPO)
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              env=os.environ | {"HF_HUB_DISABLE_TELEMETRY": "1"})
             for _ in range(2)]
    try:
        # both asked the hub for the list; one is held in its transfer, the other at the lock
        wait_for(lambda: sum(r.path.startswith(f"/api/models/{BIG_REPO}")
                             for r in hub.requests) == 2 and hub.num_gets(BIG_REPO, BIG) == 1)
        time.sleep(0.3)
    finally:
        release.set()
    paths = [proc.communicate(timeout=60)[0].strip() for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0]
    assert paths[0] == paths[1] and Path(paths[0]).read_bytes() == BIG_BYTES
    assert hub.num_gets(BIG_REPO, BIG) == 1


def wait_for(condition: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
