"""Mirostat 1 and 2 (llama_draw.py): tokens and mu against a plain reference from llama.cpp's
definitions over many steps, draft windows drawn as one-token decodes with mu carried, and in
the engine: seeded output the same alone, batched and across a preemption."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from helpers import make_engine, run_to_completion
from sampler_harness import admit, make_seq, ref_draw
from scipy.stats import chisquare

from nanoserve.sampling_params import SamplingParams

NEG_INF = float("-inf")


def ref_mirostat(scaled: torch.Tensor, version: int, mu: float, tau: float, eta: float,
                 seed: int, position: int) -> tuple[int, float, set[int]]:
    """One llama.cpp mirostat step on one row: (token, mu after, kept set)."""
    values = scaled.double().numpy()
    finite = [int(t) for t in np.flatnonzero(np.isfinite(values))]
    order = sorted(finite, key=lambda t: (-values[t], t))
    top = values[order[0]]
    total = sum(math.exp(values[t] - top) for t in order)
    p = {t: math.exp(values[t] - top) / total for t in order}
    if version == 2:
        kept = [t for t in order if -math.log2(p[t]) <= mu] or order[:1]
    else:
        num = sum_tb = sum_tt = 0.0
        for i in range(min(99, len(order) - 1)):
            t_i = math.log((i + 2) / (i + 1))
            sum_tb += t_i * (values[order[i]] - values[order[i + 1]])  # log(p_i / p_i+1)
            sum_tt += t_i * t_i
            num += 1
        s_hat = sum_tb / sum_tt
        e = s_hat - 1
        k = ((e * 2 ** mu) / (1 - len(values) ** -e)) ** (1 / s_hat)
        k = max(1, min(int(k), len(order)))
        kept = [t for t in order if values[t] >= values[order[k - 1]]]
    token = ref_draw(scaled, set(kept), seed, position)
    mass = sum(p[t] for t in kept)
    surprise = -math.log2(p[token] / mass)
    return token, mu - eta * (surprise - tau), set(kept)


def random_logits(gen: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    logits = torch.randn(rows, vocab, generator=gen) * 2.0
    logits[:, :8] += 4.0  # a head, as a model's logits have
    logits[:, 100:140:5] = logits[:, 100:101]  # ties
    logits[:, 200:220] = NEG_INF  # banned tokens
    return logits


MIROSTAT = [SamplingParams(temperature=1.0, mirostat=2, seed=1),
            SamplingParams(temperature=0.8, mirostat=2, mirostat_tau=3.0, mirostat_eta=0.5,
                           top_k=5, typical_p=0.5, seed=2),  # the others are ignored
            SamplingParams(temperature=1.0, mirostat=1, seed=3),
            SamplingParams(temperature=1.2, mirostat=1, mirostat_tau=2.0, mirostat_eta=0.3,
                           seed=4)]


@pytest.mark.parametrize("vocab", [1000, 32000])
def test_tokens_and_mu_follow_the_reference_over_steps(vocab: int) -> None:
    others = [SamplingParams(temperature=1.0, top_p=0.9, seed=9), SamplingParams(temperature=0)]
    params = [*MIROSTAT, *others]
    sampler = admit([make_seq(p, [1]) for p in params], vocab)
    gen = torch.Generator().manual_seed(vocab)
    mu = [2 * p.mirostat_tau for p in MIROSTAT]
    cut_differs = 0
    for step in range(4 if vocab > 1000 else 12):
        logits = random_logits(gen, len(params), vocab)
        batch = sampler.make_batch(np.arange(len(params)), np.full(len(params), step))
        out = sampler.sample(logits.clone(), batch)
        for slot, p in enumerate(MIROSTAT):
            scaled = logits[slot] / torch.tensor(p.temperature, dtype=torch.float32)
            token, mu_after, kept = ref_mirostat(scaled, p.mirostat, mu[slot], p.mirostat_tau,
                                                 p.mirostat_eta, p.seed, step)
            assert out.token_ids[slot] == token, (p, step)
            assert out.mirostat_mu[slot] == pytest.approx(mu_after, rel=1e-9, abs=1e-9)
            mu[slot] = mu_after
            cut_differs += len(kept) not in (1, vocab - 20)
    assert sorted(out.mirostat_mu) == [0, 1, 2, 3]  # only mirostat slots report mu
    assert cut_differs > 0


def test_draws_follow_the_kept_distribution() -> None:
    """3,000 draws (one per output position) from one mu: frequencies of the renormalized
    kept set; the processed logprobs are the kept set's."""
    vocab, draws = 500, 3000
    base = random_logits(torch.Generator().manual_seed(1), 1, vocab)[0]
    for version, tau in ((2, 3.0), (1, 4.0)):
        params = SamplingParams(temperature=1.0, mirostat=version, mirostat_tau=tau, seed=5,
                                logprobs=1, logprobs_mode="processed")
        sampler = admit([make_seq(params, [1])], vocab)
        out = sampler.sample(base.repeat(draws, 1),
                             sampler.make_batch(np.zeros(draws, np.int64), np.arange(draws)))
        _, _, kept = ref_mirostat(base, version, 2 * tau, tau, 0.1, 5, 0)
        assert 1 < len(kept) < vocab // 2
        expected = torch.zeros(vocab, dtype=torch.float64)
        ids = torch.tensor(sorted(kept))
        expected[ids] = base[ids].double().softmax(-1)
        got = np.bincount(out.token_ids, minlength=vocab)
        assert got[(expected == 0).numpy()].sum() == 0
        big = (expected * draws >= 5).numpy()
        observed = np.append(got[big], got[~big].sum())
        wanted = np.append(expected.numpy()[big], expected.numpy()[~big].sum()) * draws
        _, p_value = chisquare(observed[wanted > 0], wanted[wanted > 0])
        assert p_value > 0.001, (version, p_value)
        entry = out.logprobs[0]
        assert entry is not None
        assert entry.logprob == pytest.approx(
            float(base[ids].log_softmax(-1)[sorted(kept).index(out.token_ids[0])]), abs=1e-5)


def test_a_draft_window_draws_as_one_token_decodes_with_mu_carried() -> None:
    """Each mirostat request's window against one-token decodes after drafts[:j]: the same
    draws up to the first rejected draft, and the slot's mu after the window equals the
    decode's after the committed tokens; the next plain step agrees too."""
    vocab, k = 300, 4
    gen = torch.Generator().manual_seed(3)
    params = [*MIROSTAT, SamplingParams(temperature=1.0, typical_p=0.7, seed=6)]
    seqs = [make_seq(p, [1], [2, 3]) for p in params]
    drafts = [[int(t) for t in torch.randint(0, 8, (n,), generator=gen)]
              for n in (k, k - 1, k, 2, k)]
    counts = np.array([1 + len(d) for d in drafts])
    logits = random_logits(gen, int(counts.sum()), vocab)
    draft_ids = np.concatenate([[*d, -1] for d in drafts]).astype(np.int64)
    favoured = np.flatnonzero(draft_ids >= 0)
    logits[favoured, draft_ids[favoured]] += 9.0  # most drafts are drawn
    windowed = admit(seqs, vocab)
    slots = np.repeat(np.arange(len(seqs)), counts)
    positions = np.concatenate([np.arange(2, 2 + n) for n in counts])
    got = windowed.sample(logits.clone(), windowed.make_batch(slots, positions, draft_ids,
                                                              counts))
    decoder = admit(seqs, vocab)
    row = 0
    for slot, (window, taken) in enumerate(zip(drafts, got.num_accepted, strict=True)):
        for j in range(taken):  # the rows that count: the committed ones
            step = decoder.sample(logits[row + j : row + j + 1].clone(), decoder.make_batch(
                np.array([slot]), np.array([2 + j])))
            assert got.token_ids[row + j] == step.token_ids[0], (slot, j)
            if j + 1 < taken:  # commit the draft for the next decode, as the engine would
                assert step.token_ids[0] == window[j]
        if slot < len(MIROSTAT):
            assert got.mirostat_mu[slot] == pytest.approx(step.mirostat_mu[slot], abs=1e-12)
        row += len(window) + 1
    assert sum(got.num_accepted) > len(seqs) + 4, "few drafts accepted: a weak test"
    assert torch.equal(windowed.llama.mu, decoder.llama.mu)


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir: Any) -> str:
    return str(tiny_model_dir("llama"))


SEEDED = SamplingParams(temperature=1.0, mirostat=2, mirostat_tau=3.0, mirostat_eta=1.0,
                        seed=11, max_tokens=16, ignore_eos=True)
PROMPT = [5, 6, 7, 8, 9, 10]


def test_seeded_mirostat_is_batch_invariant_and_survives_preemption(llama_dir: str) -> None:
    alone = run_to_completion(make_engine(llama_dir), {"m": PROMPT}, SEEDED)["m"]
    batched = make_engine(llama_dir)
    for i in range(3):
        batched.add_request(f"o{i}", [20 + i] * (4 + i), SamplingParams(
            temperature=0.9, top_p=0.9, mirostat=i % 3, max_tokens=16))
    assert run_to_completion(batched, {"m": PROMPT}, SEEDED)["m"] == alone
    # few blocks: long requests run first, the mirostat request (newest) is preempted
    tight = make_engine(llama_dir, num_blocks=10, block_size=16, max_num_batched_tokens=64)
    preempted: list[tuple[str, int]] = []  # (request, its output tokens then)
    preempt = tight.scheduler._preempt
    tight.scheduler._preempt = lambda request, out: (  # type: ignore[method-assign]
        preempted.append((request.request_id, request.num_output_tokens)),
        preempt(request, out))[-1]
    for i in range(2):
        tight.add_request(f"long{i}", [30 + i] * 56, SamplingParams(
            temperature=0.0, max_tokens=40, ignore_eos=True))
    assert run_to_completion(tight, {"m": PROMPT}, SEEDED)["m"] == alone
    assert any(rid == "m" and num > 0 for rid, num in preempted), preempted


def test_v2_kept_set_widens_and_equals_the_whole_row_compare() -> None:
    """mirostat_v2_keep looks at the best 64 tokens first and widens while the last of them
    is kept: the same set as -log2 p <= mu over the whole row, for mu keeping a few, more
    than 64 (and more than 1,024) tokens, none (the best one, the lowest id among equals),
    with ties at the top and in the body."""
    from nanoserve.sample.llama_filters import mirostat_log2_p, mirostat_masses, mirostat_v2_keep

    vocab = 5000
    rng = np.random.default_rng(4)
    logits = torch.from_numpy(rng.normal(0.0, 1.0, (5, vocab)).astype(np.float32))
    logits = torch.round(logits * 8) / 8  # ties everywhere
    logits[:, 10] = logits[:, 20] = logits.amax(dim=-1) + 1.0  # a tie at the top
    logits[0, rng.choice(vocab, 50, replace=False)] = NEG_INF
    top, _, log_z = mirostat_masses(logits)
    surprise = -mirostat_log2_p(logits, top, log_z)
    for mu_value in (0.5, 6.0, 11.5, 12.2, 30.0):
        mu = torch.full((5,), mu_value, dtype=torch.float64)
        want = surprise <= mu[:, None]
        for row in range(5):
            if not bool(want[row].any()):
                want[row, 10] = True
        assert torch.equal(mirostat_v2_keep(logits, top, log_z, mu), want), mu_value
    assert int((surprise <= 12.2).sum(dim=-1).min()) > 1024  # that mu widened past 1,024
