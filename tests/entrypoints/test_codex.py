"""The real Codex CLI (`@openai/codex`, `codex exec`) against `nanoserve serve` on the default
model, through the Responses API: a one-turn task finishes without a protocol error (exit 0,
every request answered 200, the turn completed, the answer in the schema Codex asked for).

Codex runs with a temporary CODEX_HOME holding a config.toml whose only model provider is the
server (`wire_api = "responses"`, the key from `env_key`), with update checks, analytics,
feedback and telemetry off (`codex_cli.py`), inside a network namespace with nothing but loopback
(`agent_sandbox.py`), so it cannot reach anything else even if it tried.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from agent_sandbox import SandboxResult
from codex_cli import (
    codex_config,
    events,
    needs_codex,
    responses_turn_usage,
    run_codex_exec,
)
from server_harness import API_KEY

MODEL = "SmolLM2-135M-Instruct"
pytestmark = pytest.mark.slow
CONFIG = codex_config(f"""\
model = "{MODEL}"
model_provider = "nanoserve"
""", """
[model_providers.nanoserve]
name = "nanoserve"
wire_api = "responses"
env_key = "NANOSERVE_API_KEY"
request_max_retries = 0
stream_max_retries = 0
supports_websockets = false
""")


def run_codex(home: Path, server_args: list[str] | None = None) -> SandboxResult:
    """`codex exec` of TASK against a fresh server, with `home` as CODEX_HOME and HOME."""
    return run_codex_exec(
        home, CONFIG, ["-c", 'model_providers.nanoserve.base_url="{url}/v1"'],
        server_args=server_args or [], env={"NANOSERVE_API_KEY": "{api_key}"},
        api_key=API_KEY)


@pytest.fixture(scope="module")
def codex_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """CODEX_HOME (and the folder of the server's `--kv-cache-disk`) of the module's runs."""
    return tmp_path_factory.mktemp("codex-home")


def disk_tier(home: Path) -> list[str]:
    return ["--kv-cache-disk", str(home / "kv")]


@pytest.fixture(scope="module")
def codex_run(codex_home: Path) -> SandboxResult:
    """The module's first `codex exec`, its server's prefix cache left on disk at its stop."""
    needs_codex()
    return run_codex(codex_home, disk_tier(codex_home))


def test_codex_exec_finishes_a_turn(codex_run: SandboxResult) -> None:
    result = codex_run
    usage = responses_turn_usage(result, MODEL)
    # Codex's fixed prompt (its instructions, its tools described in the system message by
    # the server, the environment) fits the default model's 8192 tokens: 6,586 with 0.171
    assert 2000 < usage["input_tokens"] < 8192, usage


def test_codex_after_a_restart_reads_its_prompt_from_the_disk_tier(
        codex_run: SandboxResult, codex_home: Path) -> None:
    """A second `codex exec`, against a server of its own over the first's `--kv-cache-disk`
    folder (started after the first stopped): its turn's prompt comes mostly from the files.
    Prints each server's time to the first token (a figure, not a check)."""
    runs = [codex_run, run_codex(codex_home, disk_tier(codex_home))]
    usages = []
    for result in runs:
        assert result.returncode == 0 and not result.failed_requests, result.describe()
        usages.append([e for e in events(result.stdout)
                       if e.get("type") == "turn.completed"][-1]["usage"])
    cold, warm = usages
    assert cold["cached_input_tokens"] == 0, cold
    assert warm["cached_input_tokens"] >= 0.7 * warm["input_tokens"], warm
    firsts = [next(r for r in result.requests if r.path == "/v1/responses").first_token_s
              for result in runs]
    print(f"\nCodex's first turn ({warm['input_tokens']} tokens) on the default model: first "
          f"token {firsts[0]:.2f} s cold, {firsts[1]:.2f} s after a restart "
          f"({firsts[1] / firsts[0]:.2f}x)")
