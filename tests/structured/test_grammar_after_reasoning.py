"""A grammar that starts where the reasoning ends (`structured/reasoning_gate.py`), in the engine
core on a tiny random Qwen3 with `<think>` and `</think>` tokens: the reasoning is free text
that cannot end the sample, the answer after `</think>` matches the grammar, and an output that
does not open a section is the grammar's from its first token."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from helpers import make_engine

from nanoserve.engine.core import EngineCore
from nanoserve.reasoning_section import ReasoningTokens
from nanoserve.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object",
          "properties": {"ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}
BUDGET = 24


@pytest.fixture(scope="module")
def engine(tiny_reasoning_model_dir: Path) -> EngineCore:
    return make_engine(tiny_reasoning_model_dir)


@pytest.fixture(scope="module")
def tokenizer(tiny_reasoning_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_reasoning_model_dir))


def generate(engine: EngineCore, prompt: list[int], params: SamplingParams,
             request_id: str) -> tuple[list[int], str | None]:
    engine.add_request(request_id, prompt, params)
    ids: list[int] = []
    finish = None
    while engine.has_unfinished():
        for out in engine.step():
            ids += out.new_token_ids
            finish = out.finish_reason
    return ids, finish


def params(after: str | None, seed: int, **extra: Any) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=200,
                          thinking_token_budget=BUDGET,
                          structured_outputs=StructuredOutputsParams(
                              json=SCHEMA, disable_any_whitespace=True, after_reasoning=after),
                          **extra)


def answer(tokenizer: Any, ids: list[int]) -> Any:
    assert ids[-1] == tokenizer.eos_token_id, "a complete grammar ends with EOS"
    return json.loads(tokenizer.decode(ids[:-1]))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_reasoning_is_free_and_the_answer_after_it_matches(
        engine: EngineCore, tokenizer: Any, seed: int) -> None:
    tags = ReasoningTokens.of(tokenizer)
    assert tags is not None
    prompt = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n")
    ids, finish = generate(engine, prompt, params("inside", seed), f"inside-{seed}")
    assert finish == "stop"
    end = ids.index(tags.end)
    assert end == BUDGET  # the budget closed it; random text never closes it by itself
    reasoning = tokenizer.decode(ids[:end])
    assert not reasoning.lstrip().startswith("{")  # free text: no grammar held it
    assert tokenizer.eos_token_id not in ids[:end]
    jsonschema.validate(answer(tokenizer, ids[end + 1:]), SCHEMA)
    # without the gate the same request is the grammar's from the first token
    ids, _ = generate(engine, prompt, params(None, seed), f"from-start-{seed}")
    assert tags.end not in ids
    jsonschema.validate(answer(tokenizer, ids), SCHEMA)


def test_an_output_that_opens_no_section_is_the_answer(engine: EngineCore,
                                                       tokenizer: Any) -> None:
    tags = ReasoningTokens.of(tokenizer)
    assert tags is not None
    prompt = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    ids, _ = generate(engine, prompt, params("opening", 5), "direct")
    assert tags.start not in ids and tags.end not in ids
    jsonschema.validate(answer(tokenizer, ids), SCHEMA)
    # a first `<think>` (pushed by a bias) opens it: free until `</think>`, then the grammar
    bias = {tags.start: 100.0}
    ids, _ = generate(engine, prompt, params("opening", 5, logit_bias=bias), "opened")
    assert ids[0] == tags.start
    end = ids.index(tags.end)
    jsonschema.validate(answer(tokenizer, ids[end + 1:]), SCHEMA)
    assert tags.start not in ids[end + 1:]  # the grammar keeps the biased tag out


def test_the_gate_survives_preemption(tiny_reasoning_model_dir: Path, tokenizer: Any) -> None:
    """A tight cache preempts and recomputes requests mid-reasoning and mid-answer; each keeps
    its place in the gate and ends with a matching answer."""
    engine = make_engine(tiny_reasoning_model_dir, num_blocks=10, max_model_len=128,
                         max_num_batched_tokens=64)
    tags = ReasoningTokens.of(tokenizer)
    assert tags is not None
    prompt = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n")
    for i in range(6):
        engine.add_request(f"r{i}", prompt, params("inside", 10 + i))
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(6)}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
    assert engine.scheduler.num_preemptions > 0
    for ids in outputs.values():
        end = ids.index(tags.end)
        jsonschema.validate(answer(tokenizer, ids[end + 1:]), SCHEMA)
