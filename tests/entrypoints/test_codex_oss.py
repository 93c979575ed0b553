"""The real Codex CLI's `codex exec --oss` (0.171) against `nanoserve serve` serving a tiny
random gpt-oss (the o200k_harmony tokenizer, gpt-oss's chat template) as `gpt-oss:20b`, the
model `--oss` asks a local Ollama for: a one-turn task finishes (exit 0, every request answered
2xx, the turn completed, the answer in the schema asked for).

What `--oss` sends, with `oss_provider = "ollama"` (config.toml or `--local-provider ollama`):
its built-in `ollama` provider, at `http://localhost:11434/v1` unless `CODEX_OSS_BASE_URL` (a
URL ending in `/v1`) or `CODEX_OSS_PORT` says otherwise (`OLLAMA_HOST` is not read, and a
built-in provider cannot be redefined under `[model_providers]`); no API key. Before the turn,
in this order: GET /v1/models (is a server there), GET /api/version (Codex refuses an Ollama
older than 0.13.4), GET /api/tags (is the model there: its name, exactly), and only when the
model is not listed POST /api/pull `{"model": ..., "stream": true}`, which must answer 200 and
an NDJSON line `{"status": "success"}`; then the turn itself, POST /v1/responses, streamed.

Codex runs as in test_codex.py (`codex_cli.py`: its config with everything that reaches out
off, the output schema whose grammar ends the answer) inside the loopback-only namespace. The
grammar holds only harmony's final message, so `harmony_opening.py` writes the random model's
short analysis and the final message's header; the answer after it is the model's own.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from agent_sandbox import SandboxResult
from codex_cli import codex_config, needs_codex, responses_turn_usage, run_codex_exec

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "model"))
from gpt_oss_checkpoints import write_tiny_gpt_oss  # noqa: E402

from nanoserve.bench.o200k_harmony import HARMONY_VOCAB_SIZE, harmony_tokenizer_dir  # noqa: E402

MODEL = "gpt-oss:20b"  # `--oss`'s model when no `-m` is given
pytestmark = pytest.mark.slow
CONFIG = codex_config('oss_provider = "ollama"\n')
# what Codex asks before its first turn (see the module)
PROBES = [("GET", "/v1/models"), ("GET", "/api/version"), ("GET", "/api/tags")]


def tiny_gpt_oss(path: Path) -> Path:
    """The tiny random gpt-oss with gpt-oss's tokenizer and template, its context long enough
    for Codex's prompt (4,783 tokens with 0.171)."""
    write_tiny_gpt_oss(path, vocab_size=HARMONY_VOCAB_SIZE, bos_token_id=199998,
                       eos_token_id=200002, pad_token_id=199999, max_position_embeddings=8192)
    for file in harmony_tokenizer_dir().iterdir():
        shutil.copy(file, path / file.name)
    return path


@pytest.fixture(scope="module")
def oss_run(tmp_path_factory: pytest.TempPathFactory) -> SandboxResult:
    needs_codex()
    model = tiny_gpt_oss(tmp_path_factory.mktemp("tiny-gpt-oss"))
    home = tmp_path_factory.mktemp("codex-oss-home")
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("PYTHONPATH", str(HERE))  # where harmony_opening lives
        return run_codex_exec(
            home, CONFIG, ["--oss"],
            server_args=[str(model), "--served-model-name", MODEL,
                         "--logits-processors", "harmony_opening:HarmonyOpening"],
            env={"CODEX_OSS_BASE_URL": "{url}/v1"})


def test_codex_oss_finishes_a_turn_on_a_model_served_as_gpt_oss(
        oss_run: SandboxResult) -> None:
    result = oss_run
    usage = responses_turn_usage(result, MODEL)
    asked = [(r.method, r.path) for r in result.requests]
    assert asked[:len(PROBES)] == PROBES, result.describe()
    assert ("POST", "/api/pull") not in asked, result.describe()  # it is listed: no pull
    assert 2000 < usage["input_tokens"] < 8192, usage
    # the analysis message came back as reasoning (its 7 tokens), not as the answer
    assert usage["reasoning_output_tokens"] > 0, usage
