"""Each sampler stage equals a plain per-row reference, on random batches with random per-row
parameters: masks bitwise equal, values within 1e-6."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from sampler_harness import (
    EOS,
    admit,
    batch_of,
    make_seq,
    ref_allowed,
    ref_bad_words,
    ref_draw,
    ref_kept,
    ref_logit_bias,
    ref_min_tokens,
    ref_penalties,
    signed64,
)

from nanoserve.sample.stages import (
    apply_allowed,
    apply_bad_words,
    apply_logit_bias,
    apply_min_tokens,
    apply_penalties,
)
from nanoserve.sample.truncation import min_p_threshold, truncate
from nanoserve.sampling_params import SamplingParams

VOCAB = 40
tokens = st.integers(0, VOCAB - 1)


@st.composite
def params(draw: st.DrawFn) -> SamplingParams:
    greedy = draw(st.booleans())
    p = SamplingParams(
        temperature=0.0 if greedy else draw(st.floats(0.2, 2.0)),
        top_k=draw(st.sampled_from([0, 0, 1, 3, 10, VOCAB])),
        top_p=draw(st.sampled_from([1.0, 1.0, 0.05, 0.5, 0.9])),
        min_p=draw(st.sampled_from([0.0, 0.0, 0.05, 0.3])),
        repetition_penalty=draw(st.sampled_from([1.0, 0.7, 1.3])),
        frequency_penalty=draw(st.sampled_from([0.0, -1.5, 0.8])),
        presence_penalty=draw(st.sampled_from([0.0, 1.2, -0.4])),
        logit_bias=draw(st.one_of(st.none(), st.dictionaries(tokens, st.floats(-150, 150),
                                                             max_size=5))),
        allowed_token_ids=draw(st.one_of(st.none(), st.lists(tokens, min_size=1, max_size=8))),
        min_tokens=draw(st.integers(0, 4)),
        stop_token_ids=draw(st.lists(tokens, max_size=3)),
        ignore_eos=draw(st.booleans()),
        max_tokens=32,
        seed=draw(st.integers(0, 2**64 - 1)),
    )
    p.bad_words_token_ids = draw(st.lists(st.lists(tokens, min_size=1, max_size=3), max_size=3))
    p.bad_words = ["x"] * len(p.bad_words_token_ids)  # only the ids are read
    if p.allowed_token_ids is not None:  # something stays drawable whatever was generated
        banned = {word[-1] for word in p.bad_words_token_ids}
        if p.min_tokens > 0:
            banned |= set(p.stop_token_ids) | (set() if p.ignore_eos else {EOS})
        assume(set(p.allowed_token_ids) - banned)
    return p


@st.composite
def batches(draw: st.DrawFn) -> tuple[list, torch.Tensor]:
    rows = draw(st.integers(1, 6))
    requests = [make_seq(draw(params()), draw(st.lists(tokens, min_size=1, max_size=12)),
                             draw(st.lists(tokens, max_size=8))) for _ in range(rows)]
    torch.manual_seed(draw(st.integers(0, 2**31)))
    logits = torch.randn(rows, VOCAB) * draw(st.sampled_from([0.5, 3.0]))
    return requests, logits


def assert_rows_match(ours: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(ours), torch.isinf(expected))
    finite = ~torch.isinf(expected)
    assert torch.allclose(ours[finite], expected[finite], atol=1e-6, rtol=1e-6)


@settings(max_examples=60, deadline=None)
@given(batches())
def test_masks_bias_and_penalties_match_references(batch_data: tuple) -> None:
    requests, logits = batch_data
    sampler = admit(requests, VOCAB)
    batch = batch_of(sampler, requests)
    cases = [
        (apply_allowed, lambda r, q: ref_allowed(r, q.params)),
        (apply_bad_words, lambda r, q: ref_bad_words(r, q.params, q.output_token_ids)),
        (apply_min_tokens, lambda r, q: ref_min_tokens(r, q.params, q.output_token_ids)),
        (apply_logit_bias, lambda r, q: ref_logit_bias(r, q.params)),
        (apply_penalties, lambda r, q: ref_penalties(r, q.params, q.prompt_token_ids,
                                                     q.output_token_ids)),
    ]
    for stage, reference in cases:
        ours = logits.clone()
        stage(ours, sampler.state, batch)
        for row, request in enumerate(requests):
            assert_rows_match(ours[row], reference(logits[row], request))


@settings(max_examples=60, deadline=None)
@given(batches(), st.sampled_from([(3,), (2, 5), (64,)]))
def test_truncation_keeps_what_a_full_sort_keeps(batch_data: tuple,
                                                 widths: tuple[int, ...]) -> None:
    requests, logits = batch_data
    ps = [r.params for r in requests]
    scaled = logits / torch.tensor([p.temperature or 1.0 for p in ps])[:, None]
    ids, vals = truncate(scaled, torch.tensor([p.top_k for p in ps]),
                         torch.tensor([p.top_p for p in ps]),
                         torch.tensor([min_p_threshold(p.min_p) for p in ps]), widths=widths)
    for row, p in enumerate(ps):
        finite = vals[row] > float("-inf")
        assert set(ids[row][finite].tolist()) == ref_kept(scaled[row], p)
        assert torch.equal(vals[row][finite], scaled[row][ids[row][finite]])


@settings(max_examples=40, deadline=None)
@given(batches())
def test_draws_and_greedy_rows_match_per_row_references(batch_data: tuple) -> None:
    requests, logits = batch_data
    sampler = admit(requests, VOCAB)
    processed = logits.clone()  # (before sampling, which counts the drawn tokens)
    for stage in (apply_allowed, apply_bad_words, apply_min_tokens, apply_logit_bias,
                  apply_penalties):
        stage(processed, sampler.state, batch_of(sampler, requests))
    out = sampler.sample(logits.clone(), batch_of(sampler, requests))
    for row, request in enumerate(requests):
        p = request.params
        if p.is_greedy:
            assert out.token_ids[row] == int(processed[row].argmax())
            continue
        scaled = processed[row] / p.temperature
        kept = ref_kept(scaled, p) if p.is_truncated else \
            {i for i in range(VOCAB) if scaled[i] > float("-inf")}
        expected = ref_draw(scaled, kept, signed64(request.seed),
                            len(request.output_token_ids))
        assert out.token_ids[row] == expected


def test_temperature_divides_logits() -> None:
    requests = [make_seq(SamplingParams(temperature=t, seed=1), [1]) for t in (0.5, 2.0)]
    sampler = admit(requests, VOCAB)
    state = sampler.state
    assert torch.allclose(state.temperature[:2], torch.tensor([0.5, 2.0]))
    greedy = make_seq(SamplingParams(temperature=1e-6), [1])
    assert greedy.params.is_greedy and greedy.params.top_k == 0
    tiny = SamplingParams(temperature=1e-3)
    assert tiny.temperature == 1e-2  # vLLM raises tiny temperatures to 0.01


@pytest.mark.parametrize(("fields", "message"), [
    (dict(allowed_token_ids=[5, 6], bad_words=["x", "y"]), "all banned by bad_words"),
    (dict(allowed_token_ids=[EOS, 7], stop_token_ids=[7], min_tokens=2), "min_tokens=2 bans"),
])
def test_allowed_tokens_that_leave_nothing_to_draw_are_refused(fields: dict,
                                                               message: str) -> None:
    p = SamplingParams(**{k: v for k, v in fields.items() if k != "bad_words"})
    if "bad_words" in fields:
        p.bad_words, p.bad_words_token_ids = fields["bad_words"], [[5], [6]]
    with pytest.raises(ValueError, match=message):
        admit([make_seq(p, [1])], VOCAB)
    p.min_tokens, p.bad_words_token_ids = 0, [[5]]
    admit([make_seq(p, [1])], VOCAB)  # one drawable token is enough
