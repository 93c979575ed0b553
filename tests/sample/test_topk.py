"""chunked_topk gives torch.topk's values, and indices that point at them."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve.sample.topk import chunked_topk


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 5), vocab=st.integers(1, 5000), k_frac=st.floats(0.0, 1.0),
       levels=st.sampled_from([0, 3, 1000]), neg_inf_frac=st.sampled_from([0.0, 0.5, 0.999]),
       seed=st.integers(0, 2**31 - 1))
def test_equals_torch_topk(rows: int, vocab: int, k_frac: float, levels: int,
                           neg_inf_frac: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen)
    if levels:  # few distinct values: many ties
        x = (x * levels).round() / levels
    x[torch.rand(rows, vocab, generator=gen) < neg_inf_frac] = float("-inf")
    k = max(1, min(vocab, round(k_frac * 80)))
    want_values, _ = torch.topk(x, k, dim=-1)
    values, ids = chunked_topk(x, k)
    assert torch.equal(values, want_values)
    assert torch.equal(x.gather(1, ids), values)
    assert all(len(set(row)) == k for row in ids.tolist())  # no index twice


def test_large_vocabulary_takes_the_chunked_path() -> None:
    x = torch.randn(3, 49152, generator=torch.Generator().manual_seed(0))
    for k in (1, 20, 64, 1024):
        values, ids = chunked_topk(x, k)
        assert torch.equal(values, torch.topk(x, k, dim=-1).values)
        assert torch.equal(x.gather(1, ids), values)


def test_rows_with_fewer_finite_values_than_k_get_indices_inside_the_vocabulary() -> None:
    # hypothesis found it: 297 entries (a padded last chunk), 2 finite, k = 17
    x = torch.full((2, 297), float("-inf"))
    x[0, [5, 200]] = torch.tensor([1.0, 2.0])
    x[1, 296] = 0.5
    values, ids = chunked_topk(x, 17)
    assert torch.equal(values, torch.topk(x, 17, dim=-1).values)
    assert int(ids.max()) < 297
    assert torch.equal(x.gather(1, ids), values)
    assert all(len(set(row)) == 17 for row in ids.tolist())
