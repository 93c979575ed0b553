"""DRY (nanoserve/sample/dry.py) against llama.cpp's `llama_sampler_dry_apply` transcribed as
it is written (a ring buffer read from the end, the reverse Z-algorithm, the maps), on crafted
repeats with exact logits, on random histories, on draft rows, and in a greedy decode; and the
breakers' processing (nanoserve/dry_breakers.py) on the default model's tokenizer."""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import numpy as np
import pytest
import torch
from sampler_harness import admit, batch_of, make_seq

from nanoserve import LLM
from nanoserve.dry_breakers import (
    MAX_BREAKER_BYTES,
    dry_breaker_token_ids,
    token_texts,
)
from nanoserve.sample.dry import (
    DryBreakers,
    _doubling_lengths,
    _reverse_z,
    apply_dry,
    repeat_lengths,
)
from nanoserve.sample.penalty_window import apply_penalty_window
from nanoserve.sampling_params import SamplingParams

VOCAB = 16


def ref_dry(row: np.ndarray, history: list[int], breakers: list[list[int]], p: SamplingParams
            ) -> np.ndarray:
    """llama.cpp's DRY apply, line by line: `rat(i)` is the i-th token from the end of the
    ring buffer of the last `dry_penalty_last_n` tokens."""
    row = row.copy()
    last = history if p.dry_penalty_last_n == -1 else history[-p.dry_penalty_last_n:]
    n = len(last)

    def rat(i: int) -> int:
        return last[n - 1 - i]

    allowed = p.dry_allowed_length
    if n <= allowed:
        return row
    processed: dict[int, list[list[int]]] = {}
    for head, *tail in breakers:
        processed.setdefault(head, []).append(tail)
    rep_limit = n
    for i in range(n):
        if rat(i) not in processed:
            continue
        longest = -1
        for tail in processed[rat(i)]:
            if longest < len(tail) <= i and all(tail[o] == rat(i - o - 1)
                                                for o in range(len(tail))):
                longest = len(tail)
        if longest >= 0:
            rep_limit = i - longest
            break
    if rep_limit < allowed:
        return row
    count = [0] * n
    last_index, lt, rt = n - 1, 0, 0
    for k in range(1, n):
        if k > rt:
            m = 0
            while m + k < n and rat(m) == rat(m + k):
                m += 1
            count[last_index - k] = min(m, rep_limit)
            if m > 0:
                lt, rt = k, k + m - 1
        else:
            pair = k - lt
            right_part_len = rt - k + 1
            if count[last_index - pair] < right_part_len:
                count[last_index - k] = min(count[last_index - pair], rep_limit)
            else:
                i = rt + 1
                while i < n and rat(i) == rat(i - k):
                    i += 1
                count[last_index - k] = min(i - k, rep_limit)
                lt, rt = k, i - 1
    max_repeat: dict[int, int] = {}
    for i in range(n - 1):
        if count[i] >= allowed:
            token = rat(n - 2 - i)
            max_repeat[token] = max(max_repeat.get(token, 0), count[i])
    base = np.float32(p.dry_base)
    max_exponent = 0
    if base > np.float32(1.000001):
        max_exponent = int(np.float32(88.7228391) / np.float32(math.log(float(base))))
    for token, repeat in max_repeat.items():
        if any(not tail for tail in processed.get(token, [])):
            continue  # a single-token breaker
        exponent = repeat - allowed
        if max_exponent > 0 and exponent > max_exponent:
            exponent = max_exponent
        penalty = np.float32(float(np.float32(p.dry_multiplier))
                             * math.pow(float(base), exponent))
        row[token] = np.float32(row[token] - penalty)
    return row


def dry_params(breakers: list[list[int]] | None = None, **kw: Any) -> SamplingParams:
    p = SamplingParams(**{"temperature": 0.0, "dry_multiplier": 0.8, **kw})
    p.dry_breaker_token_ids = breakers or []
    return p


def run_dry(p: SamplingParams, prompt: list[int], output: list[int] = (),
            logits: torch.Tensor | None = None) -> torch.Tensor:
    seqs = [make_seq(p, prompt, list(output))]
    sampler = admit(seqs, VOCAB)
    logits = torch.zeros(1, VOCAB) if logits is None else logits.clone()
    apply_dry(logits, sampler.state, batch_of(sampler, seqs))
    return logits[0]


def penalty(multiplier: float, base: float, exponent: int) -> np.float32:
    return np.float32(float(np.float32(multiplier)) * float(np.float32(base)) ** exponent)


def test_a_crafted_repeat_takes_the_exact_penalty() -> None:
    # "1 2 3" repeats: 4 would extend it to length 4 -> exponent 3 - 2 = 1
    got = run_dry(dry_params(), [1, 2, 3, 4, 5, 6, 1, 2], [3])
    want = torch.zeros(VOCAB)
    want[4] = -torch.tensor(penalty(0.8, 1.75, 1))
    assert torch.equal(got, want)
    # the output alone or the prompt alone: the history is both (llama-server's)
    assert torch.equal(run_dry(dry_params(), [1, 2, 3, 4, 5, 6, 1, 2, 3]), want)
    assert torch.equal(run_dry(dry_params(), [1], [2, 3, 4, 5, 6, 1, 2, 3])[4],
                       want[4])


def test_allowed_length_and_base_set_the_exponent() -> None:
    history = [1, 2, 3, 4, 5, 6, 1, 2, 3]  # the repeat "1 2 3" has length 3
    for allowed, exponent in ((0, 3), (1, 2), (2, 1), (3, 0)):
        got = run_dry(dry_params(dry_allowed_length=allowed, dry_base=2.5), history)
        assert got[4] == -torch.tensor(penalty(0.8, 2.5, exponent)), allowed
    assert not run_dry(dry_params(dry_allowed_length=4), history).any()
    # allowed_length 0: every token that follows another in the history is penalized
    zero = run_dry(dry_params(dry_allowed_length=0), history)
    assert set(torch.nonzero(zero).flatten().tolist()) == {2, 3, 4, 5, 6, 1}


def test_breakers_stop_a_match() -> None:
    history = [1, 7, 8, 3, 4, 1, 7, 8, 3]
    free = run_dry(dry_params(), history)
    assert free[4] == -torch.tensor(penalty(0.8, 1.75, 2))  # "1 7 8 3" repeats
    # "7 8" as a two-token breaker: only "3" follows the latest one, under allowed_length
    assert not run_dry(dry_params([[7, 8]]), history).any()
    assert not run_dry(dry_params([[8]]), history).any()
    # of a head's tails, the longest that follows it counts (the empty one included)
    assert not run_dry(dry_params([[7], [7, 8]]), history).any()
    assert run_dry(dry_params([[7]]), history)[4] < 0  # "8 3" after the 7
    # a head whose tail does not follow it breaks nothing
    assert torch.equal(run_dry(dry_params([[7, 9]]), history), free)
    # a breaker before the repeat limits nothing; one inside cuts it to the tokens after it
    cut = run_dry(dry_params([[1, 7]]), history)  # after "1 7": "8 3" (2 tokens)
    assert cut[4] == -torch.tensor(penalty(0.8, 1.75, 0))
    # a single-token breaker is never penalized itself
    loop = [5, 6, 9, 5, 6]
    assert run_dry(dry_params(), loop)[9] < 0
    assert run_dry(dry_params([[9]]), loop)[9] == 0


def test_penalty_last_n_is_the_window() -> None:
    history = [1, 2, 3, 4, 9, 9, 9, 9, 1, 2, 3]
    assert run_dry(dry_params(dry_allowed_length=3), history)[4] < 0
    assert run_dry(dry_params(dry_allowed_length=3, dry_penalty_last_n=11), history)[4] < 0
    # the first "1" left the window: "2 3" repeats, under allowed_length
    assert not run_dry(dry_params(dry_allowed_length=3, dry_penalty_last_n=10), history).any()


def random_history(rng: random.Random, length: int) -> list[int]:
    """Tokens from a few symbols with copies of earlier stretches (repeats of all lengths)."""
    tokens = [rng.randrange(6) for _ in range(3)]
    while len(tokens) < length:
        if rng.random() < 0.5:
            start = rng.randrange(len(tokens))
            tokens += tokens[start:start + rng.randint(1, 12)]
        else:
            tokens.append(rng.randrange(VOCAB))
    return tokens[:length]


def random_breakers(rng: random.Random) -> list[list[int]]:
    singles = [[t] for t in rng.sample(range(VOCAB), rng.randint(0, 2))]
    multi = [[rng.randrange(VOCAB) for _ in range(rng.randint(2, 3))]
             for _ in range(rng.randint(0, 3))]
    return singles + multi


@pytest.mark.parametrize("seed", range(4))
def test_random_histories_equal_llama_cpp(seed: int) -> None:
    rng = random.Random(seed)
    params, seqs, histories = [], [], []
    for _ in range(60):
        p = dry_params(random_breakers(rng), dry_multiplier=rng.choice([0.8, 2.5]),
                       dry_base=rng.choice([1.0, 1.0000005, 1.75, 3.0]),
                       dry_allowed_length=rng.choice([0, 1, 2, 3]),
                       dry_penalty_last_n=rng.choice([-1, 1, 4, 17]))
        history = random_history(rng, rng.randint(1, 90))
        split = rng.randint(1, len(history))
        params.append(p)
        histories.append(history)
        seqs.append(make_seq(p, history[:split], history[split:]))
    sampler = admit(seqs, VOCAB)
    logits = torch.randn(len(seqs), VOCAB, generator=torch.Generator().manual_seed(seed))
    want = np.stack([ref_dry(row, h, p.dry_breaker_token_ids, p)
                     for row, h, p in zip(logits.numpy(), histories, params, strict=True)])
    apply_dry(logits, sampler.state, batch_of(sampler, seqs))
    assert np.array_equal(logits.numpy(), want)
    assert (logits.numpy() != torch.randn(  # the stage did penalize
        len(seqs), VOCAB, generator=torch.Generator().manual_seed(seed)).numpy()).sum() > 50


@pytest.mark.parametrize("base", [1.0000005, 1.75])
def test_long_repeats_equal_llama_cpp(base: float) -> None:
    """A history that repeats one stretch, no breaker: the numpy rounds hand over to the Z
    algorithm (1.75: at the exponent's clamp, 1.0000005: none)."""
    stretch = [3, 1, 4, 1, 5, 9, 2]
    history = (stretch * 60)[:400]
    p = dry_params(dry_base=base)
    row = np.linspace(-2, 2, VOCAB, dtype=np.float32)
    got = run_dry(p, history[:5], history[5:], torch.from_numpy(row)[None])
    assert np.array_equal(got.numpy(), ref_dry(row, history, [], p))
    assert (got.numpy() < row).sum() == 1  # only the loop's next token (1, after "... 2 3")


def test_repeat_lengths_equal_the_z_algorithm() -> None:
    rng = random.Random(5)
    for _ in range(200):
        history = np.array(random_history(rng, rng.randint(2, 150)), dtype=np.int64)
        cap = rng.choice([0, 1, 3, 64, 65, 1000])
        assert np.array_equal(repeat_lengths(history, cap),
                              np.minimum(_reverse_z(history.tolist()), cap))


def test_the_prefix_doubling_equals_the_z_algorithm() -> None:
    """The gallop's fallback alone, on random and near-periodic histories (one or two tokens
    changed), at caps below, at and past powers of two and the history."""
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(2, 130)
        stretch = [rng.randrange(4) for _ in range(rng.randint(1, 9))]
        history = (stretch * n)[:n] if rng.random() < 0.6 else random_history(rng, n)
        for _ in range(rng.randint(0, 2)):
            history[rng.randrange(n)] = rng.randrange(4)
        tokens = np.array(history, dtype=np.int64)
        want = _reverse_z(history)
        for cap in (0, 1, 2, 3, 4, 31, 32, 33, n - 1, n, 1000):
            assert np.array_equal(_doubling_lengths(tokens, cap), np.minimum(want, cap))
            assert np.array_equal(repeat_lengths(tokens, cap), np.minimum(want, cap))


@pytest.mark.parametrize(("stretch", "base"), [([7], 1.1), ([7], 1.75), ([3, 1, 4], 1.1),
                                               (list(range(2, 15)), 1.05)])
def test_long_loops_equal_llama_cpp(stretch: list[int], base: float) -> None:
    """Loops long enough for the prefix doubling to take over (1.1: the exponent clamps at
    930, past the history; 1.75: at 158), with a breaker inside the history or none."""
    history = (stretch * 700)[:700]
    row = np.linspace(-2, 2, VOCAB, dtype=np.float32)
    for breakers in ([], [[15]]):
        p = dry_params(breakers, dry_base=base, dry_allowed_length=3)
        tokens = [*history[:200], 15, *history[200:]] if breakers else history
        got = run_dry(p, tokens[:9], tokens[9:], torch.from_numpy(row)[None])
        assert np.array_equal(got.numpy(), ref_dry(row, tokens, breakers, p))
        assert (got.numpy() < row).sum() == 1


def test_draft_rows_equal_one_token_decodes() -> None:
    """DRY and the penalties' window at row j of a window read the drafts d[:j] as output."""
    rng = random.Random(11)
    requests = []
    for i in range(24):
        p = dry_params(random_breakers(rng), dry_allowed_length=rng.choice([0, 1, 2]),
                       dry_penalty_last_n=rng.choice([-1, 5]),
                       repeat_last_n=rng.choice([-1, 1, 6]) if i % 2 else None,
                       frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=1.3)
        history = random_history(rng, rng.randint(4, 40))
        requests.append((make_seq(p, history[:3], history[3:]),
                         [rng.randrange(6) for _ in range(rng.randint(0, 4))]))
    windowed = admit([seq for seq, _ in requests], VOCAB)
    plain_seqs = [dataclasses.replace(seq, output_token_ids=[*seq.output_token_ids, *d[:j]])
                  for seq, d in requests for j in range(len(d) + 1)]
    plain = admit(plain_seqs, VOCAB)
    num_rows = len(plain_seqs)
    slots = np.repeat(np.arange(len(requests)), [1 + len(d) for _, d in requests])
    positions = np.concatenate([np.arange(len(s.output_token_ids),
                                          len(s.output_token_ids) + len(d) + 1)
                                for s, d in requests])
    drafts = np.concatenate([[*d, -1] for _, d in requests]).astype(np.int64)
    counts = np.array([1 + len(d) for _, d in requests], dtype=np.int64)
    batch = windowed.make_batch(slots, positions, drafts, counts)
    assert batch.has_drafts
    logits = torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(3))
    got, want = logits.clone(), logits.clone()
    for stage in (apply_penalty_window, apply_dry):
        stage(got, windowed.state, batch)
        stage(want, plain.state, batch_of(plain, plain_seqs))
    assert torch.equal(got, want)
    assert (got != logits).any(dim=1).sum() > num_rows // 2


def test_breakers_on_the_default_tokenizer(default_tokenizer: Any) -> None:
    texts = token_texts(default_tokenizer)
    newline, colon = default_tokenizer.encode("\n:", add_special_tokens=False)
    for breaker, token in (("\n", newline), (":", colon)):
        found = dry_breaker_token_ids(default_tokenizer, [breaker])
        assert [token] in found
        # every token whose text holds the breaker, as a breaker alone
        assert found == [[t] for t, text in enumerate(texts) if breaker.encode() in text]
    # a breaker of several tokens: heads end with its start, the tail tokenizes the rest
    user = dry_breaker_token_ids(default_tokenizer, ["User:"])
    rest = {tuple(s[1:]) for s in user}
    assert (*default_tokenizer.encode("ser:", add_special_tokens=False),) in rest
    assert all(any(texts[s[0]].endswith(b"User"[:k]) for k in range(1, 5))
               for s in user if len(s) > 1)
    defaults = dry_breaker_token_ids(default_tokenizer, None)
    assert [newline] in defaults and [colon] in defaults
    long = "x" * (MAX_BREAKER_BYTES - 1) + ":" + "yz"
    assert dry_breaker_token_ids(default_tokenizer, [long]) == \
        dry_breaker_token_ids(default_tokenizer, [long[:MAX_BREAKER_BYTES]])
    p = SamplingParams(dry_multiplier=0.8)
    p.update_from_tokenizer(default_tokenizer)
    assert p.dry_breaker_token_ids == defaults
    off = SamplingParams()
    off.update_from_tokenizer(default_tokenizer)
    assert off.dry_breaker_token_ids == []


def test_the_breakers_lookup_tables() -> None:
    breakers = DryBreakers.build([[3], [3, 4, 5], [6, 7], [99]], VOCAB)
    assert breakers.is_head[[3, 6]].all() and breakers.is_head.sum() == 2
    assert breakers.is_single[3] and not breakers.is_single[6]
    assert [t.tolist() for t in breakers.tails[3]] == [[4, 5]]


def has_repeated_ngram(ids: list[int], n: int) -> bool:
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return len(grams) != len(set(grams))


def test_a_greedy_decode_leaves_its_loop(tiny_model_dir: Any) -> None:
    llm = LLM(str(tiny_model_dir("llama")), device="cpu", kv_cache_memory_gb=0.05)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    baseline = llm.generate(prompt, plain)[0].outputs[0].token_ids
    assert has_repeated_ngram([5, 6, 7, 8, *baseline], 3), "the baseline should loop"
    dry = dataclasses.replace(plain, dry_multiplier=100.0, dry_sequence_breakers=[])
    out = llm.generate(prompt, dry)[0].outputs[0].token_ids
    assert not has_repeated_ngram([5, 6, 7, 8, *out], 3)
    assert out[:2] == baseline[:2]  # nothing repeats yet: greedy as before
