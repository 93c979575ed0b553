"""No token changes: the default model's outputs, recorded before the engine's refactors.

`tests/data/golden_outputs.json` holds, for 8 prompts, the greedy and the seeded outputs (token
ids, each token's logprob and top-2 alternatives, finish reasons) of the default model in
`gguf` and `none` modes, each request run alone and all of them batched together. It was
written by this module (`python tests/engine/test_golden_outputs.py`) on the engine before
issue 13's refactors; the engine of today must reproduce it bit for bit. Rewrite it only for a
change that is meant to change tokens, and say so in the commit; record it with the three
variables tests/conftest.py sets (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
MKL_ENABLE_INSTRUCTIONS=AVX2), or an AVX-512 CPU records float32 sums in another order.
Last rewritten for the tiled attention (csrc/flash_tiles.h), which reorders attention's sums.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from nanoserve.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from helpers import make_engine

FIXTURE = Path(__file__).resolve().parent.parent / "data" / "golden_outputs.json"
TEXTS = (
    "The quick brown fox",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Lighthouses were built along dangerous coasts because",
    "1, 2, 3, 4, 5,",
    "Q: What is the capital of France?\nA:",
    "Once upon a time, in a small village at the edge of a great forest, there lived",
    '{"name": "nanoserve", "language":',
)
MODES = ("gguf", "none")
MAX_TOKENS = 24


def sampling_params(kind: str, index: int) -> SamplingParams:
    if kind == "greedy":
        return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2)
    return SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=1234 + index,
                          max_tokens=MAX_TOKENS, logprobs=2)


def run(mode: str, prompts: list[list[int]], batched: bool) -> dict[str, Any]:
    """Every (kind, prompt) request's output, run one at a time or all in one batch."""
    engine = make_engine(None, quantization=mode)
    requests = {f"{kind}-{i}": (ids, sampling_params(kind, i))
                for kind in ("greedy", "seeded") for i, ids in enumerate(prompts)}
    results: dict[str, Any] = {rid: {"token_ids": [], "logprobs": [], "finish_reason": None}
                               for rid in requests}
    groups = [list(requests)] if batched else [[rid] for rid in requests]
    for group in groups:
        for rid in group:
            engine.add_request(rid, *requests[rid])
        while engine.has_unfinished():
            for out in engine.step():
                result = results[out.request_id]
                result["token_ids"].extend(out.new_token_ids)
                for entry in out.new_logprobs or ():
                    result["logprobs"].append(
                        [entry.token_id, entry.logprob, entry.rank, entry.top_ids,
                         entry.top_logprobs])
                if out.finish_reason is not None:
                    result["finish_reason"] = out.finish_reason
    return results


def prompt_ids() -> list[list[int]]:
    from nanoserve.model.gguf_file import GGUFFile
    from nanoserve.model.loader import default_model_path
    from nanoserve.model.tokenizer import load_tokenizer_from_gguf

    tokenizer = load_tokenizer_from_gguf(GGUFFile(default_model_path()))
    return [tokenizer.encode(text) for text in TEXTS]


def record() -> dict[str, Any]:
    prompts = prompt_ids()
    return {"prompts": prompts, "outputs": {
        mode: {"alone": run(mode, prompts, batched=False),
               "batched": run(mode, prompts, batched=True)} for mode in MODES}}


@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("batched", [False, True], ids=["alone", "batched"])
def test_engine_reproduces_the_recorded_outputs(golden: dict[str, Any], mode: str,
                                                batched: bool) -> None:
    expected = golden["outputs"][mode]["batched" if batched else "alone"]
    got = run(mode, golden["prompts"], batched)
    for rid, want in expected.items():
        assert got[rid] == want, f"{mode} {rid} {'batched' if batched else 'alone'} changed"


def test_fixture_covers_both_kinds_and_finish_reasons(golden: dict[str, Any]) -> None:
    outputs = golden["outputs"]["gguf"]["alone"]
    assert len(golden["prompts"]) == 8 and len(outputs) == 16
    assert all(len(o["logprobs"]) == len(o["token_ids"]) for o in outputs.values())
    assert {o["finish_reason"] for o in outputs.values()} <= {"stop", "length"}


if __name__ == "__main__":
    FIXTURE.write_text(json.dumps(record(), indent=None, separators=(",", ":")) + "\n")
    print(f"wrote {FIXTURE}")
