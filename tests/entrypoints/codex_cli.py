"""The real Codex CLI (`@openai/codex`, `codex exec`) run against `nanoserve serve` inside the
loopback-only namespace (`agent_sandbox.py`): what its tests share, the config text, the task,
the answer's schema and the reading of `codex exec --json`'s events.

`codex_config(own_keys, own_tables)` is a config.toml with update checks, analytics, feedback,
telemetry, history and the features that reach out (plugins, apps) off, around the test's own
keys (its provider); `run_codex_exec` writes it to a temporary CODEX_HOME and runs one
`codex exec` of TASK with `--output-schema`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from agent_sandbox import SandboxResult, run_in_sandbox, sandbox_problem

CODEX = Path(__file__).resolve().parents[2] / ".venv" / "agents" / "node_modules" / ".bin" / "codex"
_KEYS = """\
approval_policy = "never"
sandbox_mode = "read-only"
check_for_update_on_startup = false
cli_auth_credentials_store = "file"
"""
_TABLES = """
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


def codex_config(own_keys: str, own_tables: str = "") -> str:
    """config.toml: the test's top-level keys and tables with the shared ones (see the
    module); TOML puts every top-level key before the first table."""
    return own_keys + _KEYS + own_tables + _TABLES


def events(stdout: str) -> list[dict[str, Any]]:
    """`codex exec --json`'s events, one JSON object a line."""
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def needs_codex() -> None:
    """Skip the test where Codex or the loopback-only namespace is missing."""
    problem = sandbox_problem()
    if problem is not None:
        pytest.skip(f"no loopback-only namespace: {problem}")
    if not CODEX.exists():
        pytest.skip("Codex CLI not installed: npm install --prefix .venv/agents --no-audit "
                    "--no-fund @openai/codex@0.171.0")


def run_codex_exec(home: Path, config: str, args: Sequence[str], *,
                   server_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                   api_key: str | None = None) -> SandboxResult:
    """`codex exec --json *args TASK` against a fresh server (`server_args`, `api_key`), with
    `config` as config.toml in `home`, its CODEX_HOME and HOME; `{url}` and `{api_key}` in
    `args` and `env` are the server's (`run_in_sandbox`)."""
    (home / "config.toml").write_text(config)
    schema = home / "answer.schema.json"
    schema.write_text(json.dumps(ANSWER_SCHEMA))
    work = home / "work"
    work.mkdir(exist_ok=True)
    return run_in_sandbox(
        [str(CODEX), "exec", "--json", "--strict-config", "--skip-git-repo-check",
         "--output-schema", str(schema), *args, TASK],
        server_args=server_args,
        env={"CODEX_HOME": str(home), "HOME": str(home), "NO_COLOR": "1", "RUST_LOG": "warn",
             **(env or {})},
        api_key=api_key, cwd=work, timeout=420)


def finished_turn(result: SandboxResult) -> list[dict[str, Any]]:
    """The run's events, once they show a turn that finished: exit 0, every request answered
    below 400, `turn.completed` without `turn.failed` or `error`, and a last answer in
    ANSWER_SCHEMA."""
    import jsonschema

    assert result.returncode == 0, result.describe()
    assert not result.failed_requests, result.describe()
    seen = events(result.stdout)
    kinds = [e.get("type") for e in seen]
    assert "turn.completed" in kinds, result.describe()
    assert "turn.failed" not in kinds and "error" not in kinds, result.describe()
    answers = [e["item"]["text"] for e in seen if e.get("type") == "item.completed"
               and e["item"].get("type") == "agent_message"]
    assert answers, result.describe()
    jsonschema.validate(json.loads(answers[-1]), ANSWER_SCHEMA)
    return seen


def responses_turn_usage(result: SandboxResult, model: str) -> dict[str, Any]:
    """A finished turn's usage (`finished_turn`), once every `/v1/responses` request was
    answered 200 and the first asked for `model`, streamed, with tools and ANSWER_SCHEMA."""
    seen = finished_turn(result)
    turns = [r for r in result.requests if r.method == "POST" and r.path == "/v1/responses"]
    assert turns and all(r.status == 200 for r in turns), result.describe()
    body = json.loads(turns[0].body)
    assert body["model"] == model and body["stream"] is True and body["tools"]
    assert body["text"]["format"]["schema"] == ANSWER_SCHEMA
    usage: dict[str, Any] = [e for e in seen if e.get("type") == "turn.completed"][-1]["usage"]
    return usage
