"""llama.cpp's samplers through the APIs their users send them on: llama-server's field names
on completions and chat completions (the OpenAI SDK's `extra_body`) and Ollama's `options`
(the ollama client), on the session's limited tiny-model server.

Each setting is checked by an effect it cannot fail to have: a top-n-sigma of almost zero or
a Mirostat target surprise of 0 leaves only the best token, so a hot draw turns greedy; a
typical-p of almost zero or XTC over every token leaves one token, so the seed stops mattering;
DRY and the penalties' window are checked on crafted prompts where `logit_bias` makes the
token they must penalize the greedy choice. Seeded outputs are the same alone and batched;
bad values are 400s naming the field. What each sampler computes is checked against reference
implementations in tests/sample/."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest
from limited_server import MODEL, error_of, shared_limited_server
from server_harness import RunningServer

pytestmark = pytest.mark.server

PROMPT = "The quick brown fox"
HOT = {"temperature": 1.5, "max_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, tiny_model_dir: Callable[[str], Path]
           ) -> RunningServer:
    return shared_limited_server(request, tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def complete(client: openai.OpenAI, prompt: str | list[int] = PROMPT, **fields: Any) -> str:
    """The completion's text (llama-server's fields go in `extra_body`, as the SDK sends
    fields it does not know)."""
    known = {k: fields.pop(k) for k in ("temperature", "max_tokens", "seed", "logit_bias")
             if k in fields}
    reply = client.completions.create(model=MODEL, prompt=prompt, extra_body=fields, **known)
    return reply.choices[0].text


def test_each_draw_sampler_reaches_the_draw(client: openai.OpenAI) -> None:
    greedy = complete(client, temperature=0, max_tokens=12, ignore_eos=True)
    hot = [complete(client, **HOT, seed=seed) for seed in (1, 2)]
    assert hot[0] != greedy and hot[0] != hot[1]  # the draw is random at this temperature
    # only the best token is left: the hot draw is the greedy one
    assert complete(client, **HOT, seed=1, top_n_sigma=1e-6) == greedy
    assert complete(client, **HOT, seed=1, mirostat=2, mirostat_tau=0.0) == greedy
    # one token is left, never the same as greedy's every time: the seed stops mattering
    for one_left in ({"typical_p": 1e-6}, {"xtc_probability": 1.0, "xtc_threshold": 0.0}):
        outputs = [complete(client, **HOT, seed=seed, **one_left) for seed in (1, 2)]
        assert outputs[0] == outputs[1] != greedy, one_left
    # XTC that never fires (probability 0 is off) changes nothing
    assert complete(client, **HOT, seed=1, xtc_probability=0.0, xtc_threshold=0.0) == hot[0]


def test_chat_completions_take_them_too(client: openai.OpenAI) -> None:
    def chat(**fields: Any) -> str | None:
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], temperature=1.5,
            max_tokens=8, seed=3, extra_body={"ignore_eos": True, **fields})
        return reply.choices[0].message.content

    greedy = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], temperature=0,
        max_tokens=8, extra_body={"ignore_eos": True}).choices[0].message.content
    assert chat(top_n_sigma=1e-6) == greedy
    assert chat(mirostat=2, mirostat_tau=0.0) == greedy


def _two_words(tokenizer: Any) -> tuple[int, int]:
    """Two ordinary word tokens (no DRY breaker in their text) and their texts."""
    a, b = (tokenizer.encode(word, add_special_tokens=False) for word in (" apple", " banana"))
    assert len(a) == len(b) == 1
    return a[0], b[0]


def test_the_penalties_window_covers_the_last_n_tokens_of_the_prompt(
        client: openai.OpenAI, default_tokenizer: Any) -> None:
    """llama.cpp's `repeat_last_n`: token a, favoured by a bias, is in the prompt ten times;
    a frequency penalty of 2 per occurrence sinks it below b when the window holds them, and
    leaves it first when the window is shorter than the run after them, or 0 (no penalties)."""
    a, b = _two_words(default_tokenizer)
    said = {a: " apple", b: " banana"}
    filler = 17  # a token neither a nor b
    prompt = [a] * 10 + [filler] * 6
    first = {"temperature": 0, "max_tokens": 1, "frequency_penalty": 2.0,
             "logit_bias": {str(a): 10, str(b): 5}}
    assert complete(client, prompt, **first, repeat_last_n=64) == said[b]
    assert complete(client, prompt, **first, repeat_last_n=-1) == said[b]
    assert complete(client, prompt, **first, repeat_last_n=6) == said[a]  # only the filler
    assert complete(client, prompt, **first, repeat_last_n=0) == said[a]  # no penalties
    # vLLM's frequency penalty (no window) counts the output only: a stays first
    assert complete(client, prompt, **first) == said[a]


def test_dry_stops_a_long_repeat_from_continuing(client: openai.OpenAI,
                                                 default_tokenizer: Any) -> None:
    """The prompt repeats (a, b, filler, filler) ten times and ends one token short of another
    round; the bias makes the next token of the round the greedy one, and DRY's penalty on a
    repeat of ~38 tokens (1.75 ** 36) takes it away."""
    a, b = _two_words(default_tokenizer)
    last = default_tokenizer.encode(" cherry", add_special_tokens=False)[0]
    prompt = [a, b, 17, last] * 10 + [a, b, 17]
    first = {"temperature": 0, "max_tokens": 1, "logit_bias": {str(last): 30}}
    assert complete(client, prompt, **first) == " cherry"
    dry = {"dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2}
    assert complete(client, prompt, **first, **dry) != " cherry"
    # a window shorter than the allowed length sees no repeat worth a penalty
    assert complete(client, prompt, **first, **dry, dry_penalty_last_n=2) == " cherry"


def test_seeded_outputs_are_the_same_alone_and_batched(client: openai.OpenAI) -> None:
    settings = [{"typical_p": 0.7}, {"top_n_sigma": 1.0}, {"mirostat": 2},
                {"mirostat": 1, "mirostat_tau": 3.0},
                {"xtc_probability": 0.5, "xtc_threshold": 0.05},
                {"dry_multiplier": 0.8, "frequency_penalty": 0.5, "repeat_last_n": 16}]
    requests = [{**HOT, "temperature": 1.0, "max_tokens": 16, "seed": 100 + i, **fields}
                for i, fields in enumerate(settings)]
    alone = [complete(client, **dict(r)) for r in requests]
    with ThreadPoolExecutor(len(requests)) as pool:
        batched = list(pool.map(lambda r: complete(client, **dict(r)), requests))
    assert batched == alone


def test_ollama_options_reach_them(server: RunningServer) -> None:
    ollama_client = ollama.Client(host=server.url)

    def generate(**options: Any) -> str:
        return ollama_client.generate(model=MODEL, prompt=PROMPT, raw=True, options={
            "num_predict": 10, **options}).response

    greedy = generate(temperature=0)
    assert generate(temperature=1.5, seed=1) != greedy
    assert generate(temperature=1.5, seed=1, mirostat=2, mirostat_tau=0.0) == greedy
    assert generate(temperature=1.5, seed=1, top_n_sigma=1e-6) == greedy
    typical = [generate(temperature=1.5, seed=seed, typical_p=1e-6) for seed in (1, 2)]
    assert typical[0] == typical[1]


@pytest.mark.parametrize(("fields", "param"), [
    ({"typical_p": 0}, "typical_p"), ({"xtc_threshold": 1.5}, "xtc_threshold"),
    ({"mirostat": 3}, "mirostat"), ({"dry_base": 0.5}, "dry_base"),
    ({"dry_sequence_breakers": [""]}, "dry_sequence_breakers"),
    ({"repeat_last_n": -2}, "repeat_last_n"), ({"dry_penalty_last_n": -5}, "dry_penalty_last_n"),
])
def test_bad_values_are_400s_naming_the_field(server: RunningServer, fields: dict[str, Any],
                                              param: str) -> None:
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": PROMPT}]})):
        reply = httpx.post(server.url + path, json={"model": MODEL, "max_tokens": 2, **body,
                                                    **fields}, timeout=60)
        assert error_of(reply, 400)["param"] == param, reply.text
