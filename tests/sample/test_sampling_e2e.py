"""The sampler inside the engine: batch invariance on the real model, custom processors (entry
point and CLI flag), the thinking budget, logprobs, bad_words."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import hf_model, make_engine, run_to_completion

from nanoserve import LLM, SamplingParams
from nanoserve.engine.core import EngineCore

SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True)
PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 2]


def run_among(engine: EngineCore, others: int, other_params: SamplingParams) -> list[int]:
    for i in range(others):
        engine.add_request(f"other{i}", [100 + i] * (3 + i), other_params)
    tokens = run_to_completion(engine, {"seeded": PROMPT}, SEEDED)["seeded"]
    return tokens


@pytest.mark.slow
def test_seeded_request_is_batch_invariant_on_the_real_model() -> None:
    engine = make_engine(None)
    alone = run_to_completion(engine, {"seeded": PROMPT}, SEEDED)["seeded"]
    unseeded = SamplingParams(temperature=1.0, max_tokens=24)
    assert run_among(engine, 3, unseeded) == alone  # slot 3, batch of 4
    assert run_among(engine, 11, unseeded) == alone  # slot 11, batch of 12
    mixed = SamplingParams(temperature=0.7, top_k=40, repetition_penalty=1.2, max_tokens=24,
                           logprobs=3)
    assert run_among(engine, 6, mixed) == alone
    # greedy rows in a mixed batch are exactly the argmax: equal to greedy alone
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    alone_greedy = run_to_completion(make_engine(None), {"g": PROMPT}, greedy)["g"]
    for i in range(5):
        engine.add_request(f"noise{i}", [200 + i] * 5, SamplingParams(temperature=1.2,
                                                                     max_tokens=16))
    assert run_to_completion(engine, {"g": PROMPT}, greedy)["g"] == alone_greedy
    different_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=8, max_tokens=24,
                                    ignore_eos=True)
    assert run_to_completion(engine, {"s8": PROMPT}, different_seed)["s8"] != alone


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Any) -> LLM:
    return LLM(str(tiny_model_dir("llama")), device="cpu", kv_cache_memory_gb=0.05)


def has_repeated_ngram(ids: list[int], n: int) -> bool:
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    return len(grams) != len(set(grams))


def test_entry_point_processor_bans_repeated_ngrams(llm: LLM) -> None:
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    plain = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    baseline = llm.generate(prompt, plain)[0].outputs[0].token_ids
    assert has_repeated_ngram([5, 6, 7, 8, *baseline], 2), "baseline should repeat"
    banned = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                            extra_args={"no_repeat_ngram_size": 2})
    out = llm.generate(prompt, banned)[0].outputs[0].token_ids
    assert not has_repeated_ngram([5, 6, 7, 8, *out], 2)
    # requests without the argument in the same batch are untouched
    both = llm.generate([prompt, prompt], [plain, banned])
    assert both[0].outputs[0].token_ids == baseline
    assert both[1].outputs[0].token_ids == out


def test_bad_extra_args_refused_at_admission(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"extra_args\['no_repeat_ngram_size'\].*'three'"):
        llm.generate("hi", SamplingParams(extra_args={"no_repeat_ngram_size": "three"}))
    assert not llm.engine.has_unfinished()


BAN_MODULE = """
    from nanoserve.sample.logits_processor import LogitsProcessor

    class BanToken(LogitsProcessor):
        '''extra_args={"ban_token": id}: that token is never drawn.'''

        def __init__(self, num_slots, vocab_size, device):
            super().__init__(num_slots, vocab_size, device)
            self.token = [None] * num_slots

        @classmethod
        def validate_params(cls, params):
            token = (params.extra_args or {}).get("ban_token")
            if token is not None and not isinstance(token, int):
                raise ValueError(f"extra_args['ban_token'] must be a token id, got {token!r}")

        def add_request(self, seq):
            self.token[seq.slot] = (seq.params.extra_args or {}).get("ban_token")
            return self.token[seq.slot] is not None

        def apply(self, logits, batch):
            for row, slot in zip(batch.rows, batch.slots):
                logits[row, self.token[slot]] = float("-inf")
"""


def test_cli_flag_loads_a_custom_processor(tiny_model_dir: Any, tmp_path: Path,
                                           llm: LLM) -> None:
    (tmp_path / "ban_module.py").write_text(textwrap.dedent(BAN_MODULE))
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    baseline = llm.generate("Once upon", greedy)[0].outputs[0]
    victim = baseline.token_ids[0]

    def generate(*extra: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "PYTHONPATH": str(tmp_path)}
        return subprocess.run(
            [sys.executable, "-m", "nanoserve.entrypoints.cli", "generate", "Once upon",
             "--model", str(tiny_model_dir("llama")), "--temperature", "0", "--max-tokens",
             "12", "--ignore-eos", *extra], capture_output=True, text=True, env=env, timeout=300)

    flags = {"plain": (),
             "banned": ("--logits-processors", "ban_module:BanToken", "--extra-args",
                        f'{{"ban_token": {victim}}}'),
             "bad": ("--logits-processors", "ban_module:BanToken", "--extra-args",
                     '{"ban_token": "x"}'),
             "missing": ("--logits-processors", "no_such_module:Nope")}
    # the four runs at once: each is seconds of start-up on one core
    with ThreadPoolExecutor(len(flags)) as pool:
        runs = dict(zip(flags, pool.map(lambda extra: generate(*extra), flags.values()),
                        strict=True))
    plain, banned, bad, missing = runs["plain"], runs["banned"], runs["bad"], runs["missing"]
    assert plain.returncode == 0 and plain.stdout.strip() == ("Once upon" + baseline.text)
    assert banned.returncode == 0, banned.stderr
    assert banned.stdout != plain.stdout
    victim_text = llm.get_tokenizer().decode([victim])
    assert not banned.stdout.startswith("Once upon" + victim_text)
    assert bad.returncode == 1 and "extra_args['ban_token']" in bad.stderr
    assert missing.returncode == 1 and "cannot import 'no_such_module'" in missing.stderr


def test_thinking_budget_forces_the_end_tag(tiny_reasoning_model_dir: Path) -> None:
    llm = LLM(str(tiny_reasoning_model_dir), device="cpu", kv_cache_memory_gb=0.05)
    vocab = llm.get_tokenizer().get_vocab()
    start, end = vocab["<think>"], vocab["</think>"]
    prompt = {"prompt_token_ids": [10, 11, 12, start]}  # the template opened the section
    for budget in (0, 3, 7):
        params = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True,
                                thinking_token_budget=budget,
                                logit_bias={end: -100.0}, bad_words=["</think>"])
        ids = llm.generate(prompt, params)[0].outputs[0].token_ids
        assert end not in ids[:budget] and ids[budget] == end, (budget, ids)
    # outside a reasoning section the budget does nothing
    free = SamplingParams(temperature=0.0, max_tokens=6, thinking_token_budget=0,
                          logit_bias={end: -100.0, start: -100.0})
    assert end not in llm.generate({"prompt_token_ids": [10, 11]}, free)[0].outputs[0].token_ids


def test_thinking_budget_needs_reasoning_tags(llm: LLM) -> None:
    with pytest.raises(ValueError, match="reasoning tags"):
        llm.generate("hi", SamplingParams(thinking_token_budget=4))


def test_bad_words_never_appear(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    text = llm.generate("The", greedy)[0].outputs[0].text
    word = text.split()[0]
    out = llm.generate("The", SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                              bad_words=[word]))[0].outputs[0]
    assert word not in out.text.split()


def test_logprobs_raw_and_processed(llm: LLM, tiny_model_dir: Any) -> None:
    prompt = [3, 14, 15, 92, 65, 35]
    raw = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=5,
                         prompt_logprobs=3)
    engine = llm.engine
    engine.add_request("lp", prompt, raw)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    reference = hf_model(tiny_model_dir("llama"))
    tokens = [o.new_token_ids[0] for o in outs]
    with torch.inference_mode():
        full = reference(torch.tensor([prompt + tokens])).logits[0].log_softmax(-1)
    # prompt logprobs: token i given the ones before, for i = 1..
    first = outs[0].prompt_logprobs
    assert first is not None and len(first) == len(prompt) - 1
    for i, entry in enumerate(first):
        assert entry.token_id == prompt[i + 1]
        assert entry.logprob == pytest.approx(float(full[i, prompt[i + 1]]), abs=1e-4)
        assert len(entry.top_ids) == 3 and entry.top_ids[0] == int(full[i].argmax())
    # sampled-token logprobs: greedy, so rank 1, and the top-5 as transformers sees them
    for step, out in enumerate(outs):
        (entry,) = out.new_logprobs
        row = full[len(prompt) - 1 + step]
        assert entry.rank == 1 and entry.token_id == int(row.argmax())
        assert entry.top_ids == row.topk(5).indices.tolist()
        assert entry.logprob == pytest.approx(float(row.max()), abs=1e-4)
    # processed: after temperature and top-k the distribution has k tokens
    processed = SamplingParams(temperature=0.5, top_k=2, max_tokens=3, seed=1, logprobs=4,
                               logprobs_mode="processed")
    out = llm.generate({"prompt_token_ids": prompt}, processed)[0]
    assert out.outputs[0].token_ids
    engine.add_request("lp2", prompt, processed)
    entries = []
    while engine.has_unfinished():
        entries += [o.new_logprobs[0] for o in engine.step()]
    for entry in entries:
        finite = [lp for lp in entry.top_logprobs if lp > float("-inf")]
        assert len(finite) == 2 and entry.rank <= 2
        assert sum(torch.tensor(finite).exp()) == pytest.approx(1.0, abs=1e-5)


def test_logprobs_above_the_cap_are_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"logprobs must be <= 20"):
        llm.generate("x", SamplingParams(logprobs=21))
