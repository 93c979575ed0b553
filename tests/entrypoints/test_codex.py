"""The real Codex CLI (`@openai/codex`, `codex exec`) against `nanoserve serve` on the default
model, through the Responses API: a one-turn task finishes without a protocol error (exit 0,
every request answered 200, the turn completed, the answer in the schema Codex asked for).

Codex runs with a temporary CODEX_HOME holding a config.toml whose only model provider is the
server (`wire_api = "responses"`, the key from `env_key`), with update checks, analytics,
feedback and telemetry off, inside a network namespace with nothing but loopback
(`agent_sandbox.py`), so it cannot reach anything else even if it tried.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from agent_sandbox import SandboxResult, run_in_sandbox, sandbox_problem
from server_harness import API_KEY

MODEL = "SmolLM2-135M-Instruct"
CODEX = Path(__file__).resolve().parents[2] / ".venv" / "agents" / "node_modules" / ".bin" / "codex"
pytestmark = pytest.mark.slow
CONFIG = f"""\
model = "{MODEL}"
model_provider = "nanoserve"
approval_policy = "never"
sandbox_mode = "read-only"
check_for_update_on_startup = false
cli_auth_credentials_store = "file"

[model_providers.nanoserve]
name = "nanoserve"
wire_api = "responses"
env_key = "NANOSERVE_API_KEY"
request_max_retries = 0
stream_max_retries = 0
supports_websockets = false

[analytics]
enabled = false

[feedback]
enabled = false

[otel]
exporter = "none"

[history]
persistence = "none"

[features]
plugins = false
apps = false
shell_snapshot = false
"""
TASK = "Greet me in one short sentence. Do not run any commands."
# `codex exec --output-schema`: Codex sends it as `text.format` (a strict JSON schema), which
# the server's grammar holds the answer to, so the turn ends. Without it the default model
# samples at temperature 1.0 (it has no generation defaults and Codex sends no temperature),
# and now and then writes until the context is full: Codex then fails the turn with
# "Incomplete response returned, reason: max_output_tokens" -- the protocol working, the
# 135M model not stopping.
ANSWER_SCHEMA = {"type": "object", "properties": {"greeting": {"type": "string",
                                                               "maxLength": 60}},
                 "required": ["greeting"], "additionalProperties": False}


def events(stdout: str) -> list[dict[str, Any]]:
    """`codex exec --json`'s events, one JSON object a line."""
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def _needs_codex() -> None:
    problem = sandbox_problem()
    if problem is not None:
        pytest.skip(f"no loopback-only namespace: {problem}")
    if not CODEX.exists():
        pytest.skip("Codex CLI not installed: npm install --prefix .venv/agents --no-audit "
                    "--no-fund @openai/codex@0.171.0")


def run_codex(home: Path, server_args: list[str] | None = None) -> SandboxResult:
    """`codex exec` of TASK against a fresh server, with `home` as CODEX_HOME and HOME."""
    (home / "config.toml").write_text(CONFIG)
    schema = home / "answer.schema.json"
    schema.write_text(json.dumps(ANSWER_SCHEMA))
    work = home / "work"
    work.mkdir(exist_ok=True)
    return run_in_sandbox(
        [str(CODEX), "exec", "--json", "--strict-config", "--skip-git-repo-check",
         "--output-schema", str(schema), "-c",
         'model_providers.nanoserve.base_url="{url}/v1"', TASK],
        server_args=server_args or [],
        env={"CODEX_HOME": str(home), "HOME": str(home), "NANOSERVE_API_KEY": "{api_key}",
             "NO_COLOR": "1", "RUST_LOG": "warn"},
        api_key=API_KEY, cwd=work, timeout=420)


@pytest.fixture(scope="module")
def codex_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """CODEX_HOME (and the folder of the server's `--kv-cache-disk`) of the module's runs."""
    return tmp_path_factory.mktemp("codex-home")


def disk_tier(home: Path) -> list[str]:
    return ["--kv-cache-disk", str(home / "kv")]


@pytest.fixture(scope="module")
def codex_run(codex_home: Path) -> SandboxResult:
    """The module's first `codex exec`, its server's prefix cache left on disk at its stop."""
    _needs_codex()
    return run_codex(codex_home, disk_tier(codex_home))


def test_codex_exec_finishes_a_turn(codex_run: SandboxResult) -> None:
    result = codex_run
    assert result.returncode == 0, result.describe()
    assert not result.failed_requests, result.describe()
    turns = [r for r in result.requests if r.method == "POST" and r.path == "/v1/responses"]
    assert turns and all(r.status == 200 for r in turns), result.describe()
    body = json.loads(turns[0].body)
    assert body["model"] == MODEL and body["stream"] is True and body["tools"]
    assert body["text"]["format"]["schema"] == ANSWER_SCHEMA
    seen = events(result.stdout)
    kinds = [e.get("type") for e in seen]
    assert "turn.completed" in kinds, result.describe()
    assert "turn.failed" not in kinds and "error" not in kinds, result.describe()
    answers = [e["item"]["text"] for e in seen if e.get("type") == "item.completed"
               and e["item"].get("type") == "agent_message"]
    assert answers, result.describe()
    jsonschema.validate(json.loads(answers[-1]), ANSWER_SCHEMA)
    usage = [e for e in seen if e.get("type") == "turn.completed"][-1]["usage"]
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
