"""Speculation never changes an output: every proposer, every pipeline stage that reads the
output so far, every stop kind, greedy and seeded, all requests in one batch.

On the default model (its GGUF, the in-place paged path where draft rows equal one-token decodes
bit for bit), one offline `LLM` serves each (prompt, variant) pair together, once without
drafts and once per proposer: `ngram`, `suffix`, and two adversaries (tests/entrypoints/
scripted_drafts.py): the true continuation corrupted at random places, and random tokens.
Text, token ids, logprobs, cumulative logprob, finish and stop reason must equal the run
without drafts. The scripts make each variant's boundary land inside a window: a bad word, the
EOS that min_tokens bans, a stop token id, a stop string, max_tokens, all drafted and rejected
or cut mid-window; penalties, the n-gram processor, processed logprobs with a logit bias and a
grammar draft their own true continuation, so their rows must see the pending drafts to accept
them.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest

from nanoserve import LLM
from nanoserve.engine.drafts import load_draft_proposer
from nanoserve.sampling_params import SamplingParams, StructuredOutputsParams
from nanoserve.speculative_config import SpeculativeConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "entrypoints"))
from scripted_drafts import Adversarial

pytestmark = pytest.mark.slow
PROMPTS = [
    "Q: What is the capital of France?\nA:",  # greedy: ends in EOS at its 18th token
    "Copy this list exactly: apples, pears, plums, apples, pears, plums, apples, pears, plums",
    "1, 2, 3, 4, 5, 6, 7, 8,",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, logprobs=2)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=40, logprobs=2)
NO_ROW_BUDGET = 256  # take every draft: the row budget is the policy's (test_draft_policy.py)


def variants(free: dict[str, list[Any]]) -> dict[str, tuple[SamplingParams, str]]:
    """name -> (params, which output its drafts follow: "self" its own, "free" the
    unconstrained greedy one, which runs past the variant's boundary)."""
    first = free["greedy"][0].outputs[0]
    word = first.text.split()[3].strip(",.")  # a word the free output writes
    stop_id = first.token_ids[9]
    stop_text = first.text[len(first.text) // 3 : len(first.text) // 3 + 3]
    assert first.finish_reason == "stop", "the first prompt's free output should end in EOS"
    eos_at = len(first.token_ids) - 1
    return {
        "greedy": (GREEDY, "self"),
        "seeded": (SEEDED, "self"),
        "penalties": (dataclasses.replace(SEEDED, repetition_penalty=1.2,
                                          frequency_penalty=0.4, presence_penalty=0.3), "self"),
        "no_repeat_ngram": (dataclasses.replace(
            SEEDED, extra_args={"no_repeat_ngram_size": 3}), "self"),
        "processed_logprobs_bias": (dataclasses.replace(
            GREEDY, logprobs_mode="processed", logit_bias={11: 2.0, 28: -3.0}), "self"),
        "grammar": (dataclasses.replace(GREEDY, structured_outputs=StructuredOutputsParams(
            regex=r"(apples|pears|plums|[0-9]+)(, (apples|pears|plums|[0-9]+)){3,12}")),
                    "self"),
        "bad_words": (dataclasses.replace(GREEDY, bad_words=[word]), "free"),
        # EOS banned where the script drafts it; then lifted exactly at the EOS's position
        "min_tokens": (dataclasses.replace(GREEDY, min_tokens=eos_at + 3,
                                           max_tokens=eos_at + 6), "free"),
        "min_tokens_lifted": (dataclasses.replace(GREEDY, min_tokens=eos_at), "free"),
        "stop_token_id": (dataclasses.replace(GREEDY, stop_token_ids=[stop_id]), "free"),
        "max_tokens": (dataclasses.replace(GREEDY, max_tokens=13), "free"),
        "stop_string": (dataclasses.replace(GREEDY, stop=[stop_text]), "free"),
        "stop_string_kept": (dataclasses.replace(GREEDY, stop=[stop_text],
                                                 include_stop_str_in_output=True), "free"),
    }


def summary(out: Any) -> tuple[Any, ...]:
    c = out.outputs[0]
    return (c.text, c.token_ids, c.finish_reason, c.stop_reason, c.cumulative_logprob,
            c.logprobs, out.prompt_token_ids)


def generate(llm: LLM, params: list[SamplingParams], proposer: Any) -> list[Any]:
    llm.engine.proposer = load_draft_proposer(proposer)
    try:
        prompts = [p for p in PROMPTS for _ in range(len(params) // len(PROMPTS))]
        return llm.generate(prompts, params)
    finally:
        llm.engine.proposer = None


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(quantization="gguf", speculative_max_rows=NO_ROW_BUDGET)


@pytest.fixture(scope="module")
def matrix(llm: LLM) -> tuple[dict[str, tuple[SamplingParams, str]], list[SamplingParams],
                              list[Any]]:
    """The variants, each request's params (prompt-major), and the run without drafts."""
    free = {"greedy": llm.generate(PROMPTS, [dataclasses.replace(GREEDY, max_tokens=48)]
                                   * len(PROMPTS))}
    found = variants(free)
    params = [found[name][0] for _ in PROMPTS for name in found]
    plain = generate(llm, params, None)
    # each request's script: its own plain output, or the free one running past its boundary
    free_ids = [o.outputs[0].token_ids for o in free["greedy"]]
    scripted = []
    for i, (p, out) in enumerate(zip(params, plain, strict=True)):
        name = list(found)[i % len(found)]
        follows = out.outputs[0].token_ids if found[name][1] == "self" \
            else free_ids[i // len(found)]
        scripted.append(dataclasses.replace(p, extra_args={
            **(p.extra_args or {}), "draft_script": follows + [5] * 8}))
    return found, scripted, plain


@pytest.mark.parametrize("proposer", ["ngram", "suffix", "adversarial", "random"])
def test_every_variant_equals_the_run_without_drafts(llm: LLM, matrix: Any,
                                                     proposer: str) -> None:
    found, scripted, plain = matrix
    stats = llm.engine.stats
    before = (stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens)
    if proposer in ("ngram", "suffix"):
        params = [dataclasses.replace(p, extra_args={
            k: v for k, v in (p.extra_args or {}).items() if k != "draft_script"} or None)
            for p in scripted]
        got = generate(llm, params, SpeculativeConfig(method=proposer))
    elif proposer == "adversarial":
        got = generate(llm, scripted, Adversarial)
    else:
        got = generate(llm, [dataclasses.replace(p, extra_args={
            k: v for k, v in (p.extra_args or {}).items() if k != "draft_script"} or None)
            for p in scripted], Adversarial)
    names = [name for _ in PROMPTS for name in found]
    for name, a, b in zip(names, got, plain, strict=True):
        assert summary(a) == summary(b), name
    drafted = stats.spec_decode_num_draft_tokens - before[0]
    accepted = stats.spec_decode_num_accepted_tokens - before[1]
    assert drafted > 0
    if proposer != "random":
        assert accepted > 0.2 * drafted, (accepted, drafted)
    finishes = {b.outputs[0].finish_reason for b in plain}
    assert finishes == {"stop", "length"}


@pytest.mark.parametrize("name", ["penalties", "grammar", "stop_string", "min_tokens_lifted"])
def test_a_variant_alone_with_drafts_equals_the_batch_without(llm: LLM, matrix: Any,
                                                              name: str) -> None:
    """The same requests one at a time, each drafting by itself (the row budget all its own),
    give what the batch without drafts gave."""
    found, scripted, plain = matrix
    names = [n for _ in PROMPTS for n in found]
    for i, (n, params) in enumerate(zip(names, scripted, strict=True)):
        if n != name:
            continue
        llm.engine.proposer = load_draft_proposer(Adversarial)
        try:
            (alone,) = llm.generate(PROMPTS[i // len(found)], params)
        finally:
            llm.engine.proposer = None
        assert summary(alone) == summary(plain[i]), (name, i)
