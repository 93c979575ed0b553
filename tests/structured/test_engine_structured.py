"""Structured outputs in the engine core, on a tiny random Llama: every constrained output
matches its grammar, free rows beside it are untouched, compiles never hold up the batch, and
preemption, n > 1, aborts and failures keep one matcher per sequence."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
from helpers import make_engine

from nanoserve.engine.core import EngineCore
from nanoserve.engine.request import RequestStatus
from nanoserve.entrypoints.llm import LLM
from nanoserve.sampling_params import SamplingParams, StructuredOutputsParams
from nanoserve.structured.grammar import GrammarError

Params = StructuredOutputsParams
EOS = 2
# A random model never ends a string or an array by itself: bound them. No free whitespace
# either (it would indent forever).
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 130},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                  "maxItems": 2}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
PERSON_GRAMMAR = Params(json=PERSON, disable_any_whitespace=True)
GBNF = 'root ::= "(" num ("+" num)? ")"\nnum ::= [0-9] [0-9]? [0-9]?'


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir: Any) -> str:
    return str(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def engine(llama_dir: str) -> EngineCore:
    return make_engine(llama_dir)


def run(engine: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]
        ) -> dict[str, tuple[list[int], str | None]]:
    """Add every request, step until done: (output token ids, finish reason) per request."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    out: dict[str, tuple[list[int], str | None]] = {r: ([], None) for r in requests}
    while engine.has_unfinished():
        for o in engine.step():
            ids, _ = out[o.request_id]
            out[o.request_id] = (ids + o.new_token_ids, o.finish_reason)
    return out


def text_of(tokenizer: Any, ids: list[int]) -> str:
    assert ids[-1] == EOS, "a complete grammar ends with EOS"
    return str(tokenizer.decode(ids[:-1]))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constrained_outputs_match_and_stop(engine: EngineCore, default_tokenizer: Any,
                                            temperature: float) -> None:
    grammars = {"json": PERSON_GRAMMAR, "regex": Params(regex=r"[a-z]{2,5}-\d{3}"),
                "choice": Params(choice=["red", "green", "blue"]),
                "gbnf": Params(grammar=GBNF),
                "object": Params(json_object=True, disable_any_whitespace=True)}
    prompt = default_tokenizer.encode("Answer:")
    requests = {name: (prompt, SamplingParams(temperature=temperature, seed=7, max_tokens=80,
                                              structured_outputs=grammar))
                for name, grammar in grammars.items() if name != "object" or temperature == 0}
    out = run(engine, requests)
    for name, (ids, finish) in out.items():
        assert finish == "stop", (name, default_tokenizer.decode(ids))
    jsonschema.validate(json.loads(text_of(default_tokenizer, out["json"][0])), PERSON)
    assert re.fullmatch(r"[a-z]{2,5}-\d{3}", text_of(default_tokenizer, out["regex"][0]))
    assert text_of(default_tokenizer, out["choice"][0]) in ("red", "green", "blue")
    assert re.fullmatch(r"\(\d{1,3}(\+\d{1,3})?\)", text_of(default_tokenizer, out["gbnf"][0]))
    if "object" in out:
        assert isinstance(json.loads(text_of(default_tokenizer, out["object"][0])), dict)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_free_rows_keep_their_tokens_beside_constrained_ones(engine: EngineCore,
                                                             default_tokenizer: Any,
                                                             temperature: float) -> None:
    """The mask is per row: a free (or seeded) request draws what it draws alone."""
    prompt = default_tokenizer.encode("Once upon a time")
    free = SamplingParams(temperature=temperature, seed=11, max_tokens=12, ignore_eos=True)
    alone = run(engine, {"free": (prompt, free)})["free"][0]
    constrained = SamplingParams(temperature=temperature, seed=11, max_tokens=60,
                                 structured_outputs=PERSON_GRAMMAR)
    mixed = run(engine, {"c1": (prompt, constrained), "free": (prompt, free),
                         "c2": (default_tokenizer.encode("x"), constrained)})
    assert mixed["free"][0] == alone
    assert mixed["c1"][0] != alone[: len(mixed["c1"][0])]
    for name in ("c1", "c2"):
        jsonschema.validate(json.loads(text_of(default_tokenizer, mixed[name][0])), PERSON)


def test_seeded_constrained_output_is_batch_invariant(engine: EngineCore,
                                                      default_tokenizer: Any) -> None:
    prompt = default_tokenizer.encode("Make a person")
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=60,
                            structured_outputs=PERSON_GRAMMAR)
    alone = run(engine, {"c": (prompt, params)})["c"]
    others = {f"f{i}": (default_tokenizer.encode(f"story {i}"),
                        SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True))
              for i in range(3)}
    assert run(engine, {**others, "c": (prompt, params)})["c"] == alone


def test_compiles_run_while_free_requests_step(engine: EngineCore,
                                               default_tokenizer: Any) -> None:
    """A large, never-seen schema compiles on the worker; the free request is stepped (and
    gets tokens) in the meantime, and the constrained one only runs once it is ready."""
    big = {"type": "object", "properties": {
        f"field_{i}": {"type": "object", "properties": {
            f"x{j}": {"type": ["integer", "null"], "maximum": 9} for j in range(20)}}
        for i in range(150)}, "additionalProperties": False}
    prompt = default_tokenizer.encode("Hello")
    engine.add_request("big", prompt, SamplingParams(
        temperature=0, max_tokens=3, structured_outputs=Params(json=big)))
    engine.add_request("free", prompt, SamplingParams(temperature=0, max_tokens=40,
                                                      ignore_eos=True))
    first_step = {o.request_id for o in engine.step()}
    assert first_step == {"free"} and "big" in engine.compiling
    steps_while_compiling = 0
    counts = {"big": 0, "free": 1}
    finished: dict[str, str | None] = {}
    while engine.has_unfinished():
        compiling = "big" in engine.compiling
        for o in engine.step():
            counts[o.request_id] += len(o.new_token_ids)
            finished[o.request_id] = o.finish_reason
        steps_while_compiling += compiling
    assert counts["free"] == 40 and 1 <= counts["big"] <= 3
    assert finished["big"] in ("stop", "length")
    assert steps_while_compiling >= 1 and not engine.compiling


def test_preempted_requests_keep_their_matchers(llama_dir: str, default_tokenizer: Any) -> None:
    engine = make_engine(llama_dir, num_blocks=10, max_model_len=128,
                         max_num_batched_tokens=64)
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=60,
                            structured_outputs=PERSON_GRAMMAR)
    prompts = {f"r{i}": (default_tokenizer.encode(f"Person number {i} is " * 3), params)
               for i in range(5)}
    out = run(engine, prompts)
    assert engine.scheduler.num_preemptions > 0
    for ids, finish in out.values():
        assert finish == "stop"
        jsonschema.validate(json.loads(text_of(default_tokenizer, ids)), PERSON)
    assert engine.kv_cache.num_free_blocks == 10


def test_ignore_eos_still_ends_at_the_grammars_end(engine: EngineCore,
                                                   default_tokenizer: Any) -> None:
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True,
                            structured_outputs=Params(choice=["yes", "no"]))
    ids, finish = run(engine, {"c": (default_tokenizer.encode("?"), params)})["c"]
    assert finish == "stop" and text_of(default_tokenizer, ids) in ("yes", "no")


def test_a_grammar_cut_off_by_max_tokens_ends_with_length(engine: EngineCore,
                                                          default_tokenizer: Any) -> None:
    params = SamplingParams(temperature=0, max_tokens=4, structured_outputs=PERSON_GRAMMAR)
    ids, finish = run(engine, {"c": (default_tokenizer.encode("?"), params)})["c"]
    assert finish == "length" and len(ids) == 4
    assert default_tokenizer.decode(ids).startswith('{"')


def test_aborts_drop_matchers_and_pending_compiles(engine: EngineCore,
                                                   default_tokenizer: Any) -> None:
    prompt = default_tokenizer.encode("Hi")
    schema = {"type": "object", "properties": {f"abort_{i}": {"type": "integer"}
                                               for i in range(300)}}
    engine.add_request("compiling", prompt, SamplingParams(
        max_tokens=5, structured_outputs=Params(json=schema)))
    engine.add_request("running", prompt, SamplingParams(
        max_tokens=50, structured_outputs=PERSON_GRAMMAR))
    engine.step()
    running = engine.scheduler.requests["running"]
    assert running.grammar is not None
    assert engine.abort("compiling") and engine.abort("running")
    assert running.grammar is None and running.status == RequestStatus.FINISHED_ABORTED
    while engine.has_unfinished():
        engine.step()
    engine.step()
    assert not engine.compiling and not engine.scheduler.requests


def test_bad_grammars(engine: EngineCore, default_tokenizer: Any) -> None:
    """A compile that fails on the worker finishes its request with "error" and no tokens;
    once the cache knows the grammar is bad, adding it again is a ValueError at once."""
    prompt = default_tokenizer.encode("Hi")
    bad = SamplingParams(max_tokens=5, structured_outputs=Params(regex="(unclosed"))
    out = run(engine, {"bad": (prompt, bad), "good": (prompt, SamplingParams(max_tokens=3))})
    assert out["bad"] == ([], "error") and len(out["good"][0]) == 3
    with pytest.raises(GrammarError, match=r"structured_outputs\.regex .*unclosed group"):
        engine.add_request("again", prompt, bad)
    assert not engine.has_unfinished()


def test_a_refused_token_finishes_with_an_error(engine: EngineCore,
                                                default_tokenizer: Any) -> None:
    """min_tokens bans the EOS that a complete grammar needs: whatever the sampler then draws,
    the matcher refuses it, and the request ends with "error" instead of breaking the JSON."""
    params = SamplingParams(temperature=0, max_tokens=20, min_tokens=5,
                            structured_outputs=Params(choice=["yes"]))
    ids, finish = run(engine, {"c": (default_tokenizer.encode("?"), params)})["c"]
    assert finish == "error" and default_tokenizer.decode(ids[:-1]) == "yes"


def test_offline_generate_with_n_samples(llama_dir: str) -> None:
    llm = LLM(llama_dir, device="cpu", kv_cache_memory_gb=0.05)
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=60,
                            structured_outputs=PERSON_GRAMMAR)
    (out,) = llm.generate(["Three people:"], params, use_tqdm=False)
    texts = [sample.text for sample in out.outputs]
    assert len(texts) == 3 and len(set(texts)) > 1
    for sample in out.outputs:
        assert sample.finish_reason == "stop"
        jsonschema.validate(json.loads(sample.text), PERSON)
    with pytest.raises(ValueError, match=r"structured_outputs\.json is not valid: .*strnig"):
        llm.generate("x", SamplingParams(structured_outputs=Params(json={"type": "strnig"})))
    with pytest.raises(ValueError, match="unknown special token"):  # the tokenizer knows
        llm.generate("x", SamplingParams(structured_outputs=Params(grammar="start: <|nope|>")))
