"""Several API keys (`--api-key` repeated or comma-separated, `--api-key-file`) and TLS
(`--ssl-certfile`, `--ssl-keyfile`), on one server and on a `--models-dir` router: the real
server over HTTPS with a certificate trustme's CA signed for localhost, which the clients here
trust, as a user's would after adding their CA."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trustme
from server_harness import RunningServer

from nanoserve.server_config import check_tls_files, read_api_keys

KEYS = ("first-key", "second-key")  # given as --api-key, one of them repeated
FILE_KEYS = ("third-key", "fourth-key")  # in the key file
WRONG = "not-one-of-them"
# asyncio waits this long for a TLS client's close_notify before it gives a connection up; a
# stop that waited on an idle client would take at least this
ASYNCIO_TLS_CLOSE_WAIT_S = 30.0


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A CA, and a certificate it signed for localhost with its key: PEM files."""
    directory = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    files = {"ca": directory / "ca.pem", "cert": directory / "cert.pem",
             "key": directory / "key.pem"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    cert.cert_chain_pems[0].write_to_path(str(files["cert"]))
    cert.private_key_pem.write_to_path(str(files["key"]))
    return files


def key_file(directory: Path) -> Path:
    path = directory / "keys.txt"
    path.write_text(f"# the team's keys\n\n  {FILE_KEYS[0]}  \n{FILE_KEYS[1]}\n")
    return path


def tls_args(files: dict[str, Path]) -> list[str]:
    return ["--ssl-certfile", str(files["cert"]), "--ssl-keyfile", str(files["key"])]


@pytest.fixture(scope="module")
def keyed_tls_server(tiny_model_dir: Any, tls_files: dict[str, Path],
                     tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    keys = key_file(tmp_path_factory.mktemp("keys"))
    server = RunningServer(str(tiny_model_dir("llama")), "--served-model-name", "tiny",
                           "--api-key", KEYS[0], "--api-key", f"{KEYS[1]},{KEYS[0]}",
                           "--api-key-file", str(keys), *tls_args(tls_files),
                           ca_file=tls_files["ca"])
    yield server
    assert server.stop() == 0


def test_keys_come_from_each_flag_and_the_file(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    path = key_file(tmp_path)
    assert read_api_keys(["a", "b, c", "a"], str(path)) == ("a", "b", "c", *FILE_KEYS)
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert read_api_keys(None, None) == ("from-env",)  # the environment only without flags
    assert read_api_keys(["a"], None) == ("a",)
    monkeypatch.delenv("VLLM_API_KEY")
    assert read_api_keys(None, None) == ()


@pytest.mark.parametrize("given, file_text, message", [
    ([" , "], None, "--api-key must name a key, got ' , '"),
    (None, "# only a comment\n\n", "holds no key (one key a line)"),
    (None, "\xff\xfe", "cannot be read"),
])
def test_a_key_source_that_gives_nothing_is_refused(tmp_path: Path, given: list[str] | None,
                                                    file_text: str | None,
                                                    message: str) -> None:
    path = None
    if file_text is not None:
        path = tmp_path / "keys.txt"
        path.write_bytes(file_text.encode("latin-1"))
    with pytest.raises(ValueError, match=re.escape(message)):
        read_api_keys(given, None if path is None else str(path))


def test_tls_files_are_checked_before_the_model_loads(tmp_path: Path,
                                                      tls_files: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="--ssl-keyfile needs --ssl-certfile"):
        check_tls_files(None, str(tls_files["key"]), None)
    with pytest.raises(ValueError, match=r"--ssl-certfile '.*missing\.pem': no such file"):
        check_tls_files(str(tmp_path / "missing.pem"), None, None)
    # through the command: one line, and no model loaded (it would take seconds)
    run = subprocess.run([sys.executable, "-m", "nanoserve.entrypoints.cli", "serve",
                          "--ssl-certfile", str(tmp_path / "missing.pem")],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert "--ssl-certfile" in run.stderr and "no such file" in run.stderr
    missing_keys = subprocess.run([sys.executable, "-m", "nanoserve.entrypoints.cli", "serve",
                                   "--api-key-file", str(tmp_path / "none.txt")],
                                  capture_output=True, text=True, timeout=60)
    assert missing_keys.returncode != 0 and "--api-key-file" in missing_keys.stderr


@pytest.mark.server
def test_every_key_works_over_tls_and_another_is_refused_on_every_route(
        keyed_tls_server: RunningServer) -> None:
    server = keyed_tls_server
    for key in (*KEYS, *FILE_KEYS):  # the official SDK, trusting the test's CA
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0,
                               http_client=httpx.Client(verify=server.verify))
        reply = client.chat.completions.create(
            model="tiny", max_tokens=3, messages=[{"role": "user", "content": "Hi"}])
        assert reply.choices[0].message.content is not None, key
        keyed = httpx.get(server.url + "/v1/models", verify=server.verify,
                          headers={"x-api-key": key})
        assert keyed.status_code == 200, key
    schema = httpx.get(server.url + "/openapi.json", verify=server.verify,
                       headers={"Authorization": f"Bearer {KEYS[1]}"}).json()
    routes = [(method.upper(), path) for path, operations in schema["paths"].items()
              for method in operations if path != "/health"]
    assert len(routes) >= 10
    for method, path in [*routes, ("GET", "/openapi.json")]:
        for headers in ({"Authorization": f"Bearer {WRONG}"}, {"x-api-key": WRONG}):
            response = httpx.request(method, server.url + path, headers=headers,
                                     verify=server.verify,
                                     json={} if method == "POST" else None)
            assert response.status_code == 401, (method, path, headers)
    assert httpx.get(server.url + "/health", verify=server.verify).status_code == 200


@pytest.mark.server
def test_plain_http_and_an_untrusting_client_get_no_answer(
        keyed_tls_server: RunningServer) -> None:
    plain = keyed_tls_server.url.replace("https://", "http://")
    with pytest.raises(httpx.HTTPError):  # the TLS port speaks no plain HTTP
        httpx.get(plain + "/health", timeout=10).raise_for_status()
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(keyed_tls_server.url + "/health", timeout=10)  # the system's CAs only
    assert httpx.get(keyed_tls_server.url + "/health",
                     verify=keyed_tls_server.verify).status_code == 200


@pytest.mark.server
@pytest.mark.slow
def test_a_router_serves_tls_and_its_model_servers_plain_http(
        tiny_model_dir: Any, tls_files: dict[str, Path],
        tmp_path_factory: pytest.TempPathFactory) -> None:
    models = tmp_path_factory.mktemp("models")
    (models / "tiny").symlink_to(tiny_model_dir("llama"))
    server = RunningServer("--models-dir", str(models), "--api-key", KEYS[0],
                           *tls_args(tls_files), ca_file=tls_files["ca"])
    try:
        assert server.url.startswith("https://")
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[0], max_retries=0,
                               http_client=httpx.Client(verify=server.verify))
        reply = client.completions.create(model="tiny", prompt="Hello", max_tokens=3)
        assert reply.choices[0].text is not None  # the model's server started, answered
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key=WRONG, max_retries=0,
                          http_client=httpx.Client(verify=server.verify)).models.list()
    finally:
        # the client above still holds its pooled connection: the stop does not wait on it
        started = time.monotonic()
        assert server.stop() == 0
        assert time.monotonic() - started < ASYNCIO_TLS_CLOSE_WAIT_S / 2


@pytest.mark.server
def test_a_stop_over_tls_finishes_the_stream_and_waits_on_no_idle_client(
        tiny_model_dir: Any, tls_files: dict[str, Path]) -> None:
    """A stopping `--ssl-*` server lets a stream in flight finish whole, then exits without
    waiting for the goodbyes of clients that keep their connections pooled (it waited 30 s on
    each: asyncio's wait for a TLS close_notify that an idle client never reads)."""
    server = RunningServer(str(tiny_model_dir("llama")), "--served-model-name", "tiny",
                           *tls_args(tls_files), ca_file=tls_files["ca"])
    try:
        idle = server.client()
        assert idle.models.list().data  # its connection stays in the pool, idle
        stream = server.client().completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=48, temperature=0,
            stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        texts = [next(chunks).choices[0].text]
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        finish = None
        for chunk in chunks:
            texts.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "length" and len(texts) == 48  # every token of the stream arrived
        assert server.proc.wait(timeout=2 * ASYNCIO_TLS_CLOSE_WAIT_S) == 0
        assert time.monotonic() - started < ASYNCIO_TLS_CLOSE_WAIT_S / 2
    finally:
        server.stop()
