"""llama.cpp's top-n-sigma, typical-p and XTC in the batched sampler (llama_draw.py), against
plain references written from llama.cpp's definitions one row at a time with full sorts.

The kept sets must be equal exactly, the draws must follow the kept distribution (chi-squared),
a seeded row must draw the same alone and in a batch of other settings, and XTC's coin must
fire at its probability, per position and seed.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from sampler_harness import admit, make_seq, ref_draw
from scipy.stats import binomtest, chisquare

from nanoserve.sample.llama_draw import XTC_SALT
from nanoserve.sample.noise import row_keys, row_uniforms
from nanoserve.sample.sampler import Sampler
from nanoserve.sample.truncation import min_p_threshold
from nanoserve.sampling_params import SamplingParams

NEG_INF = float("-inf")


def recorded_logits(rng: np.random.Generator, rows: int, vocab: int) -> torch.Tensor:
    """Logits shaped like a model's: a normal body, a few strong tokens, runs of exact ties
    and some banned (-inf) tokens."""
    logits = rng.normal(0.0, 2.0, size=(rows, vocab)).astype(np.float32)
    for row in logits:
        strong = rng.choice(vocab, size=rng.integers(1, 6), replace=False)
        row[strong] += rng.uniform(3.0, 8.0, size=len(strong)).astype(np.float32)
        tied = rng.choice(vocab, size=8, replace=False)
        row[tied[1:4]] = row[tied[0]]  # ties in the body
        row[tied[5]] = row[strong[0]]  # a tie at the top
        row[rng.choice(vocab, size=vocab // 50, replace=False)] = NEG_INF
    return torch.from_numpy(logits)


# -- references, one row at a time, from llama.cpp's definitions ---------------------------------
def softmax_over(scaled: np.ndarray, kept: list[int]) -> dict[int, float]:
    values = np.array([float(scaled[i]) for i in kept])
    weights = np.exp(values - values.max())
    return dict(zip(kept, (weights / np.cumsum(weights)[-1]).tolist(), strict=True))


def ref_top_n_sigma(scaled: np.ndarray, n: float) -> np.ndarray:
    if n <= 0:
        return scaled
    finite = scaled[np.isfinite(scaled)].astype(np.float64)
    mean = finite.sum() / len(finite)
    std = math.sqrt(((finite - mean) ** 2).sum() / len(finite))
    out = scaled.copy()
    out[scaled.astype(np.float64) < finite.max() - n * std] = NEG_INF
    return out


def ref_min_p_top_k(scaled: np.ndarray, p: SamplingParams) -> set[int]:
    """truncation.py's min-p (in float32 log space) and top-k (ties kept)."""
    keep = np.isfinite(scaled)
    if p.min_p > 0:
        keep &= scaled - scaled.max() >= np.float32(min_p_threshold(p.min_p))
    if p.top_k > 0:
        keep &= scaled >= np.sort(scaled)[::-1][min(p.top_k, len(scaled)) - 1]
    return set(np.flatnonzero(keep).tolist())


def ref_typical(scaled: np.ndarray, kept: set[int], typical_p: float) -> set[int]:
    if typical_p >= 1.0:
        return kept
    p = softmax_over(scaled, sorted(kept))
    entropy = -sum(q * math.log(q) for q in p.values() if q > 0)
    order = sorted(p, key=lambda t: (abs(-math.log(p[t]) - entropy), t))
    out, mass = set(), 0.0
    for token in order:
        out.add(token)
        mass += p[token]
        if mass > typical_p:  # llama.cpp: stop after the first running sum above typical_p
            break
    return out


def ref_top_p(scaled: np.ndarray, kept: set[int], top_p: float) -> set[int]:
    if top_p >= 1.0:
        return kept
    order = sorted(kept, key=lambda t: -scaled[t])
    p = softmax_over(scaled, order)
    out, mass, i = set(), 0.0, 0
    while i < len(order) and mass < top_p:  # the mass strictly above this value is < top_p
        j = i
        while j < len(order) and scaled[order[j]] == scaled[order[i]]:
            out.add(order[j])
            mass += p[order[j]]
            j += 1
        i = j
    return out


def ref_xtc(scaled: np.ndarray, kept: set[int], fires: bool, threshold: float) -> set[int]:
    if not fires or len(kept) < 2:
        return kept
    p = softmax_over(scaled, sorted(kept))
    order = sorted(kept, key=lambda t: (-scaled[t], t))  # llama.cpp's sorted candidates
    last = 0
    for i, token in enumerate(order):
        if p[token] < threshold:
            break
        last = i
    return set(order[last:]) if last > 0 else kept


def coin(seed: int, position: int) -> float:
    return float(row_uniforms(torch.tensor([seed]), torch.tensor([position]), XTC_SALT)[0])


def ref_chain(logits: torch.Tensor, p: SamplingParams, seed: int, position: int) -> set[int]:
    """The kept set of llama_draw.py's chain (not mirostat) for one row."""
    scaled = (logits / torch.tensor(p.temperature, dtype=torch.float32)).numpy()
    scaled = ref_top_n_sigma(scaled, p.top_n_sigma)
    kept = ref_min_p_top_k(scaled, p)
    kept = ref_typical(scaled, kept, p.typical_p)
    kept = ref_top_p(scaled, kept, p.top_p)
    fires = p.xtc_probability > 0 and coin(seed, position) <= p.xtc_probability
    return ref_xtc(scaled, kept, fires, p.xtc_threshold)


# -- the sampler's side --------------------------------------------------------------------------
def kept_sets(sampler: Sampler, logits: torch.Tensor, slots: np.ndarray,
              positions: np.ndarray) -> tuple[list[int], list[set[int]]]:
    """The sampler's tokens and post-sampler kept sets (its processed logprobs' logits)."""
    batch = sampler.make_batch(slots, positions)
    temperature = sampler.state.temperature[batch.slots_gpu][:, None]
    keys = row_keys(sampler.state.seed[batch.slots_gpu], batch.positions)
    drawn, final = sampler.llama.draw(logits / temperature, np.arange(len(slots)), batch,
                                      sampler.state, keys, need_final=True)
    assert final is not None
    return drawn.tolist(), [set(torch.nonzero(row > NEG_INF)[:, 0].tolist()) for row in final]


PARAMS = [
    SamplingParams(temperature=1.0, top_n_sigma=1.0),
    SamplingParams(temperature=0.7, top_n_sigma=2.5, top_k=40),
    SamplingParams(temperature=1.0, typical_p=0.5),
    SamplingParams(temperature=1.3, typical_p=0.9, min_p=0.01),
    SamplingParams(temperature=1.0, typical_p=0.95, top_p=0.8),
    SamplingParams(temperature=1.0, xtc_probability=1.0, xtc_threshold=0.02),
    SamplingParams(temperature=0.8, xtc_probability=0.5, xtc_threshold=0.1, top_k=30),
    SamplingParams(temperature=1.1, top_n_sigma=1.5, min_p=0.02, top_k=60, typical_p=0.7,
                   top_p=0.9, xtc_probability=0.7, xtc_threshold=0.05),
]


@pytest.mark.parametrize("vocab", [1000, 49152])
def test_kept_sets_and_draws_equal_the_references(vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    seqs = [make_seq(dataclasses.replace(p, seed=100 + i), [1]) for i, p in enumerate(PARAMS)]
    sampler = admit(seqs, vocab)
    positions_per = 2 if vocab > 1000 else 12
    slots = np.repeat(np.arange(len(PARAMS)), positions_per)
    positions = np.tile(np.arange(positions_per) * 7, len(PARAMS))
    logits = recorded_logits(rng, len(slots), vocab)
    tokens, kept = kept_sets(sampler, logits, slots, positions)
    changed = 0
    for row, (slot, position) in enumerate(zip(slots, positions, strict=True)):
        p = PARAMS[slot]
        want = ref_chain(logits[row], p, 100 + slot, int(position))
        assert kept[row] == want, (p, row)
        scaled = logits[row] / torch.tensor(p.temperature, dtype=torch.float32)
        assert tokens[row] == ref_draw(scaled, want, 100 + slot, int(position))
        plain = ref_top_p(scaled.numpy(), ref_min_p_top_k(scaled.numpy(), p), p.top_p)
        changed += want != plain
    assert changed >= len(slots) // 2, "llama.cpp's samplers barely cut: a weak test"


def test_draws_follow_the_kept_distribution() -> None:
    """3,000 seeded draws per row (one per output position) against the reference's kept
    set renormalized; XTC at probability 0.5 is the mixture of its two kept sets."""
    vocab, draws = 1000, 3000
    rng = np.random.default_rng(3)
    base = recorded_logits(rng, 1, vocab)[0]
    params = [SamplingParams(temperature=1.0, top_n_sigma=1.0, seed=1),
              SamplingParams(temperature=1.5, typical_p=0.6, seed=2),
              SamplingParams(temperature=1.0, xtc_probability=0.5, xtc_threshold=0.05,
                             top_k=20, seed=3)]
    sampler = admit([make_seq(p, [1]) for p in params], vocab)
    slots = np.repeat(np.arange(len(params)), draws)
    positions = np.tile(np.arange(draws), len(params))
    out = sampler.sample(base.repeat(len(slots), 1), sampler.make_batch(slots, positions))
    tokens = np.asarray(out.token_ids)
    for i, p in enumerate(params):
        scaled = (base / torch.tensor(p.temperature, dtype=torch.float32)).numpy()
        expected = np.zeros(vocab)
        for fires, share in ((False, 1 - p.xtc_probability), (True, p.xtc_probability)):
            if share == 0:
                continue
            kept = ref_chain(base, p, 0, 0) if not p.xtc_probability else ref_xtc(
                scaled, ref_min_p_top_k(scaled, p), fires, p.xtc_threshold)
            for token, q in softmax_over(scaled, sorted(kept)).items():
                expected[token] += share * q
        got = np.bincount(tokens[slots == i], minlength=vocab)
        assert got[expected == 0].sum() == 0
        big = expected * draws >= 5  # small bins pooled into one
        observed = np.append(got[big], got[~big].sum())
        wanted = np.append(expected[big], expected[~big].sum()) * draws
        keep = wanted > 0
        _, p_value = chisquare(observed[keep], wanted[keep])
        assert p_value > 0.001, (p, p_value)


def test_seeded_rows_draw_the_same_alone_and_in_a_mixed_batch() -> None:
    vocab = 4096
    rng = np.random.default_rng(5)
    others = [SamplingParams(temperature=0.9, top_p=0.8), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.2, top_k=5, logprobs=2, logprobs_mode="processed"),
              SamplingParams(temperature=1.0, mirostat=2, mirostat_tau=3.0)]
    mixed = [dataclasses.replace(p, seed=50 + i) for i, p in enumerate([*PARAMS, *others])]
    seqs = [make_seq(p, [1, 2], [3] * (i % 4)) for i, p in enumerate(mixed)]
    logits = recorded_logits(rng, len(seqs), vocab)
    for use_kernels in (True, False):
        batched = Sampler(len(seqs), vocab, torch.device("cpu"), (0,), use_kernels=use_kernels)
        for slot, seq in enumerate(seqs):
            batched.add_request(dataclasses.replace(seq, slot=slot))
        order = np.random.default_rng(1).permutation(len(seqs))  # rows in another order
        got = batched.sample(logits[order].clone(), batched.make_batch(order)).token_ids
        for row, slot in enumerate(order):
            alone = admit([seqs[slot]], vocab)
            want = alone.sample(logits[slot : slot + 1].clone(), alone.make_batch(np.arange(1)))
            assert got[row] == want.token_ids[0], mixed[slot]


def test_xtc_coin_fires_at_its_probability_per_position_and_seed() -> None:
    """With a threshold every step meets, XTC changes the kept set exactly when the coin
    fires: over 2,000 positions that happens at xtc_probability (binomial test), the pattern
    is the coin's own (not the draw's noise) and another seed gives another pattern."""
    vocab, num = 200, 2000
    logits = torch.zeros(1, vocab)
    logits[0, :3] = torch.tensor([4.0, 3.5, 3.0])  # three tokens well above 1%
    probability = 0.3
    params = [SamplingParams(temperature=1.0, xtc_probability=probability, xtc_threshold=0.01,
                             seed=seed) for seed in (7, 8)]
    sampler = admit([make_seq(p, [1]) for p in params], vocab)
    fired = []
    for slot in (0, 1):
        _, kept = kept_sets(sampler, logits.repeat(num, 1), np.full(num, slot),
                            np.arange(num))
        fired.append(np.array([len(k) < vocab for k in kept]))
    want = np.array([coin(7, position) <= probability for position in range(num)])
    assert np.array_equal(fired[0], want)
    assert binomtest(int(fired[0].sum()), num, probability).pvalue > 0.001
    assert binomtest(int(fired[1].sum()), num, probability).pvalue > 0.001
    assert (fired[0] != fired[1]).mean() > 0.2  # the seed drives the coin


def test_processed_logprobs_keep_token_0_when_other_rows_widen() -> None:
    """truncate pads a row's candidates with id 0 at -inf when another row needs more of
    them; the final logits must keep token 0's value (vLLM's path and llama.cpp's)."""
    vocab = 5000
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    logits[[0, 2], 0] = 10.0  # token 0 leads rows 0 and 2
    processed = {"logprobs": 1, "logprobs_mode": "processed", "seed": 1}
    params = [SamplingParams(temperature=1.0, top_k=5, **processed),
              SamplingParams(temperature=1.0, top_p=0.999, **processed),  # widens
              SamplingParams(temperature=1.0, top_k=5, typical_p=0.99, **processed),
              SamplingParams(temperature=1.0, top_p=0.999, typical_p=0.99, **processed)]
    sampler = admit([make_seq(p, [1]) for p in params], vocab)
    out = sampler.sample(logits.clone(), sampler.make_batch(np.arange(4)))
    for row in (0, 2):
        entry = out.logprobs[row]
        assert entry is not None and entry.top_ids == [0] and entry.top_logprobs[0] > -1.0


# -- the shortcuts against the plain computations they replace -----------------------------------
def test_typical_whole_equals_typical_on_the_whole_row_when_it_must_widen() -> None:
    """typical_whole (no sort of the tokens, candidates widened as needed) keeps exactly what
    typical keeps on truncate's whole-row candidates, with the same values: flat rows whose
    typical set passes the first widths (widths 2, 3, 7 force every widening, up to the
    whole row), ties in the body and the shift, rows with holes (the narrow path) and rows
    with holes beside rows without."""
    from nanoserve.sample.llama_filters import top_n_sigma, typical, typical_whole
    from nanoserve.sample.truncation import truncate

    vocab, rows = 3000, 6
    rng = np.random.default_rng(11)
    flat = torch.from_numpy(rng.normal(0.0, 0.3, (rows, vocab)).astype(np.float32))
    ties = torch.round(recorded_logits(rng, rows, vocab) * 2) / 2
    holes = top_n_sigma(recorded_logits(rng, rows, vocab), torch.full((rows,), 1.0,
                                                                      dtype=torch.float64))
    mixed = torch.cat([flat[:3], holes[3:]])  # rows with and without holes, together
    typical_p = torch.tensor([0.2, 0.5, 0.9, 0.95, 0.99, 0.999], dtype=torch.float64)
    for logits in (flat, ties, holes, mixed):
        ids, vals = truncate(logits, torch.zeros(rows, dtype=torch.int64), torch.ones(rows),
                             torch.full((rows,), NEG_INF))
        want = torch.full_like(logits, NEG_INF).scatter_reduce_(
            1, ids, typical(ids, vals, typical_p), "amax")
        for widths in ((64, 1024, 8192), (2, 3, 7), (1,)):
            got_ids, got_vals = typical_whole(logits, typical_p, widths)
            got = torch.full_like(logits, NEG_INF).scatter_reduce_(1, got_ids, got_vals, "amax")
            assert torch.equal(got, want), widths
            assert bool((got_vals[:, :-1] >= got_vals[:, 1:]).all())  # by value, descending
    kept = (want > NEG_INF).sum(dim=-1)
    assert int(kept.max()) > 7  # the last rows needed more than the small widths


def test_top_n_sigma_float32_compare_at_the_floor() -> None:
    """top_n_sigma compares float32 logits with the least float32 at or above the float64
    floor: the same cut as the float64 compare, with the floor on a logit and one ulp either
    side."""
    from nanoserve.sample.llama_filters import top_n_sigma
    from nanoserve.sample.truncation import fixed_sum

    rng = np.random.default_rng(12)
    logits = recorded_logits(rng, 4, 2000)
    x = logits.double()
    finite = x > NEG_INF
    count = finite.sum(dim=-1).double()
    mean = fixed_sum(x.masked_fill(~finite, 0.0)) / count
    std = (fixed_sum((x - mean[:, None]).masked_fill(~finite, 0.0) ** 2) / count).sqrt()
    top = logits.amax(dim=-1).double()
    exact = (top - logits[:, 7].double()) / std  # the floor lands on (or next to) token 7
    for n in (exact, torch.nextafter(exact, exact + 1), torch.nextafter(exact, exact - 1)):
        floor = top - n * std
        want = logits.masked_fill(logits.double() < floor[:, None], NEG_INF)
        assert torch.equal(top_n_sigma(logits, n), want)
