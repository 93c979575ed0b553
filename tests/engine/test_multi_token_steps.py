"""Steps that commit several tokens per request, driven by test-only draft sources
(tests/entrypoints/scripted_drafts.py) before any real proposer exists.

Whatever is drafted, outputs equal the one-token-per-step run: token ids, logprobs, finish and
stop reasons, and (offline, through the output path) text, with EOS, a stop token id,
`max_tokens` and a stop string each landing inside a multi-token window. On the default model's
`gguf` mode every token of a window is attended as a decode is, so the rows are bit for bit the
one-token run's.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from helpers import make_engine

from nanoserve import LLM
from nanoserve.engine.core import EngineCore
from nanoserve.engine.drafts import load_draft_proposer
from nanoserve.protocol import StepInput, StepOutput
from nanoserve.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "entrypoints"))
from scripted_drafts import GARBAGE_TOKEN, Garbage, ScriptedDrafts

pytestmark = pytest.mark.slow
PROMPTS = {
    "fox": "The quick brown fox",
    "count": "1, 2, 3, 4, 5,",
    "story": "Once upon a time, in a small village at the edge of a great forest, there lived",
    "capital": "Q: What is the capital of France?\nA:",
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, logprobs=2)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=20, logprobs=2)


class RecordingExecutor:
    """The engine's own executor, with each step's sampled rows and committed counts kept."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.steps: list[tuple[StepInput, StepOutput]] = []

    def execute_step(self, step: StepInput) -> StepOutput:
        out = self.inner.execute_step(step)
        self.steps.append((step, out))
        return out

    def shutdown(self) -> None:
        self.inner.shutdown()


# the seam under test takes every draft: no row budget (engine/drafts.py's policy is tested
# in tests/engine/test_draft_policy.py)
NO_ROW_BUDGET = 256


@pytest.fixture(scope="module")
def engine() -> EngineCore:
    engine = make_engine(None, quantization="gguf")
    engine.config = replace(engine.config, scheduler=replace(
        engine.config.scheduler, speculative_max_rows=NO_ROW_BUDGET))
    return engine


@pytest.fixture(scope="module")
def prompts(engine: EngineCore) -> dict[str, list[int]]:
    return {name: engine.model_info.tokenizer.encode(text) for name, text in PROMPTS.items()}


def run(engine: EngineCore, prompts: dict[str, list[int]], params: dict[str, SamplingParams],
        proposer: Any = None) -> tuple[dict[str, Any], RecordingExecutor]:
    """Every prompt at once; each request's tokens, logprobs and finish, and the steps."""
    engine.proposer = load_draft_proposer(proposer)
    recorder = RecordingExecutor(engine.executor)
    engine.executor = recorder
    results: dict[str, Any] = {}
    try:
        for name, ids in prompts.items():
            engine.add_request(name, ids, params[name])
        while engine.has_unfinished():
            for out in engine.step():
                result = results.setdefault(out.request_id, {"ids": [], "logprobs": []})
                result["ids"] += out.new_token_ids
                result["logprobs"] += [(e.token_id, e.logprob, e.top_ids, e.top_logprobs)
                                       for e in out.new_logprobs or ()]
                result["finish"] = (out.finish_reason, out.stop_reason)
    finally:
        engine.executor, engine.proposer = recorder.inner, None
    return results, recorder


def scripted(params: SamplingParams, script: list[int], garbage_every: int = 0
             ) -> SamplingParams:
    return replace(params, extra_args={"draft_script": script,
                                       "draft_garbage_every": garbage_every})


@pytest.fixture(scope="module")
def plain_runs(engine: EngineCore, prompts: dict[str, list[int]]
               ) -> dict[str, tuple[dict[str, Any], RecordingExecutor]]:
    """The one-token runs the drafted ones are held to, greedy and seeded."""
    return {kind: run(engine, prompts, dict.fromkeys(prompts, base))
            for kind, base in (("greedy", GREEDY), ("seeded", SEEDED))}


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
@pytest.mark.parametrize("drafts", ["true", "mixed", "garbage"])
def test_drafted_run_equals_the_one_token_run(
        engine: EngineCore, prompts: dict[str, list[int]], kind: str, drafts: str,
        plain_runs: dict[str, tuple[dict[str, Any], RecordingExecutor]]) -> None:
    base = GREEDY if kind == "greedy" else SEEDED
    plain, plain_steps = plain_runs[kind]
    if drafts == "garbage":
        params, proposer = dict.fromkeys(prompts, base), Garbage
    else:
        every = 3 if drafts == "mixed" else 0
        params = {name: scripted(base, plain[name]["ids"] + [GARBAGE_TOKEN] * 8, every)
                  for name in prompts}
        proposer = ScriptedDrafts
    got, steps = run(engine, prompts, params, proposer)
    assert got == plain
    committed = [n for _, out in steps.steps for n in out.num_accepted]
    drafted = [len(s.draft_token_ids) - len(s.num_sample_rows) for s, _ in steps.steps]
    assert sum(drafted) > 0, "the proposer drafted nothing"
    if drafts == "garbage":
        assert max(committed) == 1 and len(steps.steps) == len(plain_steps.steps)
    else:  # windows of 1 to k + 1 tokens, in fewer steps
        assert len(steps.steps) < len(plain_steps.steps)
        if drafts == "true":
            assert max(committed) == 5  # k = 4 drafts, all accepted, and the bonus token
        else:  # every third drafted position is garbage: windows of 1, 2 and 3 tokens
            assert {1, 2, 3} <= set(committed) and max(committed) == 3


def _landed_inside(recorder: RecordingExecutor, results: dict[str, Any]) -> bool:
    """True if a step sampled more acceptable tokens for a request than it committed: the stop
    came inside the window and the tokens after it were dropped."""
    return sum(n for _, out in recorder.steps for n in out.num_accepted) > sum(
        len(r["ids"]) for r in results.values())


@pytest.mark.parametrize("stop", ["eos", "stop_token_id", "max_tokens"])
def test_a_stop_inside_a_window_ends_the_output_there(
        engine: EngineCore, prompts: dict[str, list[int]], stop: str) -> None:
    long = replace(GREEDY, max_tokens=40)
    free, _ = run(engine, prompts, dict.fromkeys(prompts, long))
    if stop == "eos":  # the prompts whose greedy output ends in EOS
        names = [n for n in prompts if free[n]["finish"] == ("stop", None)]
        params = dict.fromkeys(names, long)
    elif stop == "stop_token_id":  # each output's 7th token stops it
        names = list(prompts)
        params = {n: replace(long, stop_token_ids=[free[n]["ids"][6]]) for n in names}
    else:
        names = list(prompts)
        params = {n: replace(long, max_tokens=6 + i) for i, n in enumerate(names)}
    assert names, "some greedy output should end in EOS"
    chosen = {n: prompts[n] for n in names}
    plain, _ = run(engine, chosen, params)
    # the script goes on past the stop: the windows draft (and accept) tokens beyond it
    drafted = {n: scripted(params[n], free[n]["ids"] + [GARBAGE_TOKEN] * 8) for n in names}
    got, recorder = run(engine, chosen, drafted, ScriptedDrafts)
    assert got == plain
    assert _landed_inside(recorder, got)


@pytest.fixture(scope="module")
def llms() -> tuple[LLM, LLM]:
    return LLM(quantization="gguf"), LLM(quantization="gguf", draft_proposer=ScriptedDrafts,
                                         speculative_max_rows=NO_ROW_BUDGET)


def test_a_stop_string_inside_a_window_offline(llms: tuple[LLM, LLM]) -> None:
    """Through the offline LLM and its output processor: text, ids, logprobs, finish."""
    plain_llm, drafting_llm = llms
    prompt = PROMPTS["count"]
    free = plain_llm.generate(prompt, replace(GREEDY, max_tokens=30))[0].outputs[0]
    stop = free.text[8:11]  # ends inside the output, several tokens in
    params = replace(GREEDY, max_tokens=30, stop=[stop])
    plain = plain_llm.generate(prompt, params)[0].outputs[0]
    drafted = drafting_llm.generate(prompt, scripted(params, free.token_ids + [5] * 8))
    got = drafted[0].outputs[0]
    assert plain.finish_reason == "stop" and plain.stop_reason == stop
    assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
        plain.text, plain.token_ids, plain.finish_reason, plain.stop_reason)
    assert got.logprobs == plain.logprobs and got.cumulative_logprob == plain.cumulative_logprob
    assert len(got.token_ids) < len(free.token_ids)
