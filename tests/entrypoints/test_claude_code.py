"""The real Claude Code CLI (npm `@anthropic-ai/claude-code`) in print mode against
`nanoserve serve`: it finishes a one-turn task with no protocol error (exit 0, every request it
made answered below 400, its JSON result a success).

Claude Code runs, with the server, in a network namespace with nothing but loopback
(`agent_sandbox.py`), its telemetry, update checks, error reports and other non-essential
traffic off and HOME a fresh directory; every model it asks for is the served model. Each
answer ends after 16 tokens (`ending_output.py`): Claude Code samples with the model's defaults,
and an answer past its output limit is retried, which on a CPU makes a test minutes long.

Its whole default request does not fit the default model's 8,192-token context: 12 tools whose
definitions the server writes into the system prompt (the SmolLM2 template has no tool format
of its own) make 12.7k prompt tokens. So the default model gets Claude Code with one tool
(`--tools Read`: 2.6k tokens), twice, the second session reading most of its prompt from the
prefix cache; the full default request goes to a tiny random-weight Llama with a 32k context,
and to the real Gemma 3 270M (32k context) with the Gemma chat format of examples/, twice,
over one `--kv-cache-disk` folder with a restart between.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from agent_sandbox import SandboxResult, run_in_sandbox, sandbox_problem

from nanoserve.config import DEFAULT_MODEL_NAME

pytestmark = [pytest.mark.slow, pytest.mark.server]

HERE = Path(__file__).resolve().parent
CLAUDE = HERE.parents[1] / ".venv" / "agents" / "node_modules" / ".bin" / "claude"
KEY = "claude-code-test-key"
TASKS = ["Answer with one word: what colour is the sky?", "Say hello in French."]


@pytest.fixture(autouse=True)
def _needs_claude_code() -> None:
    problem = sandbox_problem()
    if problem is not None:
        pytest.skip(f"no loopback-only network namespace: {problem}")
    if not CLAUDE.exists():
        pytest.skip("Claude Code is not installed (make test installs it under .venv/agents)")


def claude_code_env(home: Path, model: str) -> dict[str, str]:
    """Claude Code pointed at the sandbox's server (`{url}`), with nothing sent elsewhere."""
    return {
        "HOME": str(home), "ANTHROPIC_BASE_URL": "{url}", "ANTHROPIC_AUTH_TOKEN": "{api_key}",
        "ANTHROPIC_MODEL": model, "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model, "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,
        "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        # a one-word answer is short; on a CPU the 32,000 asked for by default would run until
        # the context is full whenever a small model does not stop by itself
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "64",
    }


def run_claude(tmp_path: Path, model: str, tasks: Sequence[str], claude_args: Sequence[str],
               server_args: Sequence[str]) -> tuple[SandboxResult, list[dict[str, Any]]]:
    """`claude -p <task>` for each task in turn against one server; the JSON results."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    runs = [" ".join([shlex.quote(str(CLAUDE)), "-p", shlex.quote(task), "--output-format",
                      "json", *map(shlex.quote, claude_args)]) for task in tasks]
    result = run_in_sandbox(["sh", "-c", " && ".join(runs)],
                            server_args=["--log-level", "info", *server_args], api_key=KEY,
                            cwd=work, timeout=600, env=claude_code_env(home, model))
    assert result.returncode == 0, result.describe()
    assert not result.failed_requests, result.describe()
    messages = [r for r in result.requests if r.path.split("?")[0] == "/v1/messages"]
    assert len(messages) >= len(tasks), result.describe()
    answers = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    assert len(answers) == len(tasks), result.describe()
    for answer in answers:
        assert answer["type"] == "result" and answer["subtype"] == "success", answer
        assert not answer["is_error"] and answer["stop_reason"] == "end_turn", answer
    return result, answers


def prompt_size(usage: dict[str, int]) -> int:
    return usage["input_tokens"] + usage["cache_read_input_tokens"]


def test_on_the_default_model_with_one_tool(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(HERE))  # where ending_output lives
    result, answers = run_claude(tmp_path, DEFAULT_MODEL_NAME, TASKS, ["--tools", "Read"],
                                 ["--logits-processors", "ending_output:EndsSoon"])
    sent = json.loads(result.requests[-1].body)
    assert sent["model"] == DEFAULT_MODEL_NAME and [t["name"] for t in sent["tools"]]
    assert sent["system"][0]["text"].startswith("x-anthropic-billing-header:")
    first, second = (answer["usage"] for answer in answers)
    assert 1000 < prompt_size(first) < 8192 - 64
    # the second session's prompt differs from the first only after its system prompt (and in
    # the billing line, which the server takes off): most of it comes from the prefix cache
    assert second["cache_read_input_tokens"] >= 0.7 * prompt_size(second), second


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory: pytest.TempPathFactory,
                       default_tokenizer: Any) -> Path:
    """A tiny random-weight Llama (tests/conftest.py's shape) with a 32k context."""
    import torch
    import transformers

    path = tmp_path_factory.mktemp("tiny-llama-32k")
    torch.manual_seed(1234)
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,
        bos_token_id=1, eos_token_id=2, initializer_range=0.05, tie_word_embeddings=True)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    default_tokenizer.save_pretrained(path)
    return path


def test_the_whole_default_request_on_a_long_context(tmp_path: Path, long_context_model: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(HERE))  # where ending_output lives
    result, (answer,) = run_claude(
        tmp_path, "tiny-long", TASKS[:1], [],
        [str(long_context_model), "--served-model-name", "tiny-long",
         "--logits-processors", "ending_output:EndsSoon"])
    sent = json.loads(result.requests[-1].body)
    assert len(sent["tools"]) > 5 and "system" in {m["role"] for m in sent["messages"]}
    assert prompt_size(answer["usage"]) > 8192  # more than the default model holds


def test_the_whole_default_request_after_a_restart_comes_from_the_disk_tier(
        tmp_path: Path, gemma_270m_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 3 270M (its 32k context holds the whole default request, its windowed layers
    attend 512 keys) with the Gemma chat format from examples/ and `--kv-cache-disk`: the
    first server answers the whole request; a second, started after the first stopped, reads
    most of it from the files the first left. Prints each server's time to the first token of
    that request (a figure, not a check: tests do not time)."""
    monkeypatch.setenv("PYTHONPATH", str(HERE))
    template = HERE.parents[1] / "examples" / "template_gemma3.jinja"
    server = [str(gemma_270m_gguf), "--served-model-name", "gemma3", "--chat-template",
              str(template), "--logits-processors", "ending_output:EndsSoonGemma",
              "--kv-cache-disk", str(tmp_path / "kv")]
    # the same folders both times: the working directory is in Claude Code's system prompt
    runs = [run_claude(tmp_path, "gemma3", TASKS[:1], [], server) for _ in range(2)]
    (first, (cold,)), (_, (warm,)) = runs
    sent = json.loads(first.requests[-1].body)
    assert len(sent["tools"]) > 5 and "system" in {m["role"] for m in sent["messages"]}
    assert prompt_size(cold["usage"]) > 8192  # more than the default model holds
    assert cold["usage"]["cache_read_input_tokens"] == 0
    assert warm["usage"]["cache_read_input_tokens"] >= 0.7 * prompt_size(warm["usage"]), warm
    firsts = [max((r for r in result.requests if r.path.startswith("/v1/messages")),
                  key=lambda r: len(r.body)).first_token_s for result, _ in runs]
    print(f"\nClaude Code's default request ({prompt_size(warm['usage'])} tokens) on Gemma 3 "
          f"270M: first token {firsts[0]:.2f} s cold, {firsts[1]:.2f} s after a restart "
          f"({firsts[1] / firsts[0]:.2f}x)")
