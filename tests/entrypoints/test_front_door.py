"""The README's commands, run as a user would run them: the test reads README.md's fenced code
blocks, so what is tested is what the README says today.

- The first block is `make serve` / `make test` (CI runs the README's test command).
- `make serve` (make's PORT on a free port, in a session of its own) serves the default model;
  the curl block, the OpenAI SDK block and the Ollama block get answers from it, and the Open
  WebUI settings list the model. A SIGTERM to its whole process group ends every process of it.
- "Serve your own model" on a tiny Hugging Face directory, and "several models" on a folder of
  that directory and a tiny GGUF file, each answering; a SIGHUP (the first) and a SIGTERM (the
  second) to the whole process group end every process, with status 0 and no traceback.
- What the README tells Claude Code and Codex users to set is what the tests that run the real
  clients set (`test_claude_code.py`, `test_codex.py`); the agents themselves run only there,
  in a loopback-only network namespace.
- The speed table's command is one `nanoserve bench serve` accepts, as are the README's other
  `nanoserve` lines.

One server per command, started once for the module; the default model's ~8 s start is most of
the module's time.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path

import gguf
import httpx
import pytest
from hub_server import LocalHub, checkpoint_repo_files, start_hub
from process_tree import group_members, still_running, tree
from server_harness import free_port, wait_until

from nanoserve.config import DEFAULT_MODEL_NAME

pytestmark = [pytest.mark.slow, pytest.mark.server]

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
README = REPO / "README.md"
README_URL = "127.0.0.1:8000"  # the address the README's examples use
# the README's placeholders for the user's own model, and what this test puts there
OWN_GGUF, OWN_DIR = "/path/to/model.gguf", "/path/to/Qwen3-0.6B"
STOP_TIMEOUT_S = 60.0


def readme_blocks() -> list[tuple[str, str]]:
    """(language, text) of each fenced code block of the README, in order."""
    return [(m[1], m[2]) for m in
            re.finditer(r"^```(\w*)\n(.*?)^```", README.read_text(), re.M | re.S)]


def readme_block(needle: str, language: str | None = None) -> str:
    """The one README block that contains `needle` (and is in `language`)."""
    found = [text for lang, text in readme_blocks()
             if needle in text and (language is None or lang == language)]
    assert len(found) == 1, f"{len(found)} README blocks hold {needle!r}"
    return found[0]


def command_lines(block: str, starts: str) -> list[str]:
    """The block's lines that start with `starts` (comments and continuations joined)."""
    joined = block.replace("\\\n", " ")
    return [line.split(" #")[0].strip() for line in joined.splitlines()
            if line.startswith(starts)]


def user_env() -> dict[str, str]:
    """A shell where `nanoserve` and `python` are the virtualenv's, as after activating it."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}


class GroupServer:
    """A README command that serves, run by bash in a session (process group) of its own."""

    def __init__(self, command: str, port: int, log: Path, cwd: Path = REPO,
                 env: dict[str, str] | None = None) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(["bash", "-c", command], cwd=cwd,
                                         env={**user_env(), **(env or {})},
                                         stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.pgid = self.proc.pid

    def wait_healthy(self, timeout: float = 240.0) -> None:
        def healthy() -> bool:
            assert self.proc.poll() is None, f"exited while starting:\n{self.log()}"
            try:
                return httpx.get(self.url + "/health", timeout=1.0).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, f"{self.url}/health", timeout=timeout, interval=0.2)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop_group(self, sig: signal.Signals = signal.SIGTERM) -> int:
        """`sig` to the whole process group (SIGTERM: as systemd's KillMode=control-group
        sends it; SIGHUP: a closed terminal); waits until every process of the group is gone
        (killing them if they stay) and fails naming those that stayed. Returns the group
        leader's exit status."""
        started = tree(self.pgid)
        os.killpg(self.pgid, sig)

        def gone() -> bool:
            return not group_members(self.pgid) and not still_running(started)

        try:
            wait_until(gone, "every process of the server to exit", timeout=STOP_TIMEOUT_S,
                       interval=0.1)
        except AssertionError:
            left = group_members(self.pgid) + still_running(started)
            self.kill(started)
            raise AssertionError(f"still running {STOP_TIMEOUT_S:.0f} s after a group "
                                 f"{sig.name}: {left}\n{self.log()}") from None
        return self.proc.wait(timeout=10)

    def kill(self, pids: set[int] | None = None) -> None:
        """Clean-up after a failed test: nothing of the server outlives the module."""
        for pid in (tree(self.pgid) if pids is None else pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory,
            tiny_model_dir: Callable[[str], Path]) -> Iterator[dict[str, GroupServer]]:
    """The module's three servers, started together (each start is seconds of mostly one core,
    and the machine has two); each test waits for its own to be healthy.

    - "make serve": the README's first line, on a free port. `-o .venv/.installed`: make does
      not remake the install (`make test` has just made it; a pyproject.toml edited since would
      otherwise start a reinstall inside the test).
    - "own model": the README's `nanoserve serve /path/to/Qwen3-0.6B` on a tiny directory.
    - "several models": the README's `--models-dir` block over a tiny directory and a tiny GGUF.
    - each `nanoserve serve org/repo` of the README, fetched from a hub on loopback that holds
      the tiny models under those names.
    """
    if not (REPO / ".venv" / "bin" / "nanoserve").exists():
        pytest.skip("no .venv: `make serve` needs `make install` first")
    logs = tmp_path_factory.mktemp("front-door")
    started: dict[str, GroupServer] = {}
    hub: LocalHub | None = None
    try:
        line = readme_blocks()[0][1].splitlines()[0]
        port = free_port()
        started["make serve"] = GroupServer(f"{line} PORT={port} -o .venv/.installed", port,
                                            logs / "make-serve.log")
        models = own_models(logs, tiny_model_dir)
        block = readme_block(f"nanoserve serve {OWN_DIR}", "sh")
        [line] = [line for line in command_lines(block, "nanoserve serve") if OWN_DIR in line]
        port = free_port()
        started["own model"] = GroupServer(f"{with_own_models(line, models)} --port {port}",
                                           port, logs / "own-model.log")
        hub = readme_hub(models)
        hub_env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(logs / "hf-home"),
                   "HF_HUB_DISABLE_TELEMETRY": "1",  # what it pulls stays out of the router's
                   "NANOSERVE_MODELS": str(logs / "pulled")}
        for line in command_lines(block, "nanoserve serve"):
            if "/path/to/" not in line:  # a name: fetched from the hub on loopback
                port = free_port()
                started[name_of(line)] = GroupServer(f"{line} --port {port}", port,
                                                     logs / f"{port}.log", env=hub_env)
        block = with_own_models(readme_block("--models-dir", "sh"), models)
        [setup] = command_lines(block, "mkdir")
        [serve] = command_lines(block, "nanoserve serve")
        subprocess.run(["bash", "-c", setup], cwd=logs, check=True, timeout=30)
        port = free_port()
        started["several models"] = GroupServer(f"{serve} --port {port}", port,
                                                logs / "several-models.log", cwd=logs)
        yield started
    finally:
        for server in started.values():
            server.kill()
        if hub is not None:
            hub.close()


@pytest.fixture
def make_serve(servers: dict[str, GroupServer]) -> GroupServer:
    servers["make serve"].wait_healthy()
    return servers["make serve"]


def in_readme_terms(text: str, port: int) -> str:
    return text.replace(README_URL, f"127.0.0.1:{port}")


def port_of(server: GroupServer) -> int:
    return int(server.url.rsplit(":", 1)[1])


# the blocks


def test_the_readme_opens_with_make_serve_and_make_test() -> None:
    assert readme_blocks()[0] == ("sh", "make serve\nmake test\n")


def test_the_curl_block_gets_a_chat_completion(make_serve: GroupServer) -> None:
    block = in_readme_terms(readme_block("curl ", "sh"), port_of(make_serve))
    out = subprocess.run(["bash", "-c", block], capture_output=True, text=True, timeout=120,
                         env=user_env())
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    assert reply["object"] == "chat.completion" and reply["model"] == DEFAULT_MODEL_NAME
    assert reply["choices"][0]["message"]["content"].strip()
    assert 0 < reply["usage"]["completion_tokens"] <= 32


def test_the_openai_sdk_block_streams_an_answer(make_serve: GroupServer) -> None:
    code = in_readme_terms(readme_block("from openai import OpenAI", "python"),
                           port_of(make_serve))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.split()) >= 3, out.stdout


def test_the_ollama_block_gets_an_answer(make_serve: GroupServer) -> None:
    block = in_readme_terms(readme_block("import ollama"), port_of(make_serve))
    assert "OLLAMA_HOST=http://127.0.0.1:" in block  # the variable Ollama's clients read
    out = subprocess.run(["bash", "-c", block], capture_output=True, text=True, timeout=120,
                         env=user_env())
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()


def test_open_webuis_two_settings_list_the_model(make_serve: GroupServer) -> None:
    """Open WebUI cannot be installed here: what it does with the README's URL and key on
    saving the connection is `GET {url}/models` with the key as a bearer token."""
    readme = README.read_text()
    settings = readme[readme.index("**Open WebUI**"):].split("\n\n")[0]
    url = re.search(r"URL `(http://[^`]+)`", settings)
    key = re.search(r"key\s+`([^`]+)`", settings)
    assert url and key, settings
    models = httpx.get(in_readme_terms(url[1], port_of(make_serve)) + "/models",
                       headers={"Authorization": f"Bearer {key[1]}"}, timeout=10).json()
    assert [m["id"] for m in models["data"]] == [DEFAULT_MODEL_NAME]


def test_a_group_sigterm_ends_every_process_of_make_serve(make_serve: GroupServer) -> None:
    """Last of the module's tests on this server (tests run in file order). GNU make forwards
    the SIGTERM it gets to the server, which so gets two at once: one stop, a drain, no
    traceback (make itself then dies of the signal, as make does)."""
    assert len(group_members(make_serve.pgid)) >= 3  # make, the launcher, the engine core
    make_serve.stop_group(signal.SIGTERM)
    assert "Traceback" not in make_serve.log(), make_serve.log()


# your own model, several models


def own_models(folder: Path, tiny_model_dir: Callable[[str], Path]) -> dict[str, Path]:
    """The README's placeholders made real: a tiny Qwen3 directory named Qwen3-0.6B and a tiny
    random-weight Llama GGUF named model.gguf, in `folder`."""
    from nanoserve.bench.random_gguf import Shape, write_random_gguf

    hf_dir = folder / Path(OWN_DIR).name
    shutil.copytree(tiny_model_dir("qwen3"), hf_dir)
    gguf_file = write_random_gguf(folder / Path(OWN_GGUF).name, Shape(128, 2, 4, 2, 256),
                                  gguf.GGMLQuantizationType.Q8_0)
    return {OWN_DIR: hf_dir, OWN_GGUF: gguf_file}


def name_of(line: str) -> str:
    """The model a README `nanoserve serve NAME` line names."""
    return shlex.split(line)[2]


def readme_hub(models: dict[str, Path]) -> LocalHub:
    """A hub on loopback holding each repository the README serves by name: a GGUF repository
    the tiny GGUF (as its Q4_K_M file), a checkpoint's the tiny directory."""
    block = readme_block(f"nanoserve serve {OWN_DIR}", "sh")
    repos: dict[str, dict[str, bytes | Path]] = {}
    for line in command_lines(block, "nanoserve serve"):
        if "/path/to/" not in line:
            repo = name_of(line).split(":")[0]
            repos[repo] = ({f"{repo.split('/')[1]}-Q4_K_M.gguf": models[OWN_GGUF]}
                           if "GGUF" in repo else dict(checkpoint_repo_files(models[OWN_DIR])))
    assert len(repos) >= 2, "the README serves a GGUF and a checkpoint by name"
    return start_hub(repos)


def with_own_models(text: str, models: dict[str, Path]) -> str:
    for placeholder, path in models.items():
        text = text.replace(placeholder, str(path))
    return text


def test_serve_your_own_hugging_face_directory(servers: dict[str, GroupServer]) -> None:
    server = servers["own model"]
    server.wait_healthy()
    # served under the path it was given, answering to the directory's name too
    [listed] = httpx.get(server.url + "/v1/models", timeout=10).json()["data"]
    assert Path(listed["id"]).name == "Qwen3-0.6B"
    reply = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": "Qwen3-0.6B", "prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4
    # a terminal's hang-up to the group ends it as a SIGTERM does: every process, status 0
    assert server.stop_group(signal.SIGHUP) == 0, server.log()
    assert "Traceback" not in server.log(), server.log()


def test_serve_a_model_by_its_hub_name(servers: dict[str, GroupServer]) -> None:
    by_name = {name: server for name, server in servers.items() if "/" in name}
    assert len(by_name) >= 2
    for name, server in by_name.items():
        server.wait_healthy()
        [listed] = httpx.get(server.url + "/v1/models", timeout=10).json()["data"]
        assert listed["id"] == name  # served as it was named, as vLLM does
        reply = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": name, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert reply.status_code == 200, reply.text
        assert "pulling manifest" in server.log()  # the download's progress, on the terminal
        assert server.stop_group(signal.SIGTERM) == 0, server.log()


def test_several_models_in_one_server(servers: dict[str, GroupServer]) -> None:
    server = servers["several models"]
    server.wait_healthy()
    listed = httpx.get(server.url + "/v1/models", timeout=10).json()["data"]
    assert sorted(m["id"] for m in listed) == ["Qwen3-0.6B", "model"]  # as the README names them
    reply = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": "model", "prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4
    # the router, the model's own server (a session of its own) and its engine core
    assert len(tree(server.pgid)) >= 3
    assert server.stop_group(signal.SIGTERM) == 0, server.log()
    assert "Traceback" not in server.log(), server.log()


# what the README tells the agents' users to set


def exported(block: str) -> dict[str, str]:
    """NAME=VALUE pairs of a block's `export` lines, as a shell would set them."""
    values: dict[str, str] = {}
    for line in command_lines(block, "export "):
        for word in shlex.split(line, comments=True)[1:]:
            name, _, value = word.partition("=")
            values[name] = value
    return values


def test_claude_code_gets_what_its_tests_give_it(tmp_path: Path) -> None:
    from test_claude_code import claude_code_env

    readme = exported(readme_block("ANTHROPIC_BASE_URL", "sh"))
    harness = claude_code_env(tmp_path, DEFAULT_MODEL_NAME)
    # the harness's {url} and {api_key} are the README's address and a key of the user's own
    filled = {"{url}": f"http://{README_URL}", "{api_key}": readme["ANTHROPIC_AUTH_TOKEN"]}
    assert {name: filled.get(value, value) for name, value in harness.items()
            if name in readme} == readme
    # every variable that points Claude Code at the server is in the README; the harness's
    # others keep a test short and quiet (HOME, output cap, update checks, error reports)
    assert {name for name in harness if name.startswith("ANTHROPIC_")} <= set(readme)
    [run] = command_lines(readme_block("ANTHROPIC_BASE_URL", "sh"), "claude ")
    assert shlex.split(run)[1:4] == ["-p", "--tools", "Read"]  # the one-tool run that fits


def test_codex_gets_what_its_tests_give_it() -> None:
    import test_codex

    readme = tomllib.loads(readme_block("[model_providers.nanoserve]", "toml"))
    harness = tomllib.loads(test_codex.CONFIG)
    assert readme["model"] == harness["model"] == DEFAULT_MODEL_NAME
    assert readme["model_provider"] == harness["model_provider"]
    provider = readme["model_providers"][readme["model_provider"]]
    theirs = harness["model_providers"][harness["model_provider"]]
    assert {key: theirs[key] for key in provider if key != "base_url"} == \
        {key: value for key, value in provider.items() if key != "base_url"}
    # the harness gives the base URL on the command line, the key in env_key's variable
    source = (HERE / "test_codex.py").read_text()
    base_url = re.search(r"model_providers\.nanoserve\.base_url=\"\{url\}([^\"]*)\"", source)
    assert base_url and provider["base_url"] == f"http://{README_URL}{base_url[1]}"
    assert f'"{provider["env_key"]}": "{{api_key}}"' in source


# commands that are parsed, not run


def test_the_speed_tables_command_is_one_bench_serve_accepts() -> None:
    from nanoserve.entrypoints.cli import build_parser

    [line] = command_lines(readme_block("nanoserve bench serve", "sh"), "nanoserve bench")
    args = build_parser().parse_args(shlex.split(line)[1:])
    assert args.compare_llama_server and args.concurrency == "1,8"
    readme = README.read_text()
    after = readme[readme.index(line):]
    table = after[after.index("\n|"):].split("\n\n")[0]
    levels = {int(m) for m in re.findall(r"^\| [^|]+ \| (\d+) \|", table, re.M)}
    assert levels == {1, 8}  # the table's stream counts are the command's levels


def test_every_nanoserve_line_of_the_readme_parses() -> None:
    from nanoserve.entrypoints.cli import build_parser

    lines = [line for _, block in readme_blocks() for line in command_lines(block, "nanoserve ")]
    assert len(lines) >= 4
    for line in lines:
        args = build_parser().parse_args(shlex.split(line)[1:])
        assert callable(args.func), line
