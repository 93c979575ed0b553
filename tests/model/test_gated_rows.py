"""A hybrid's two gates in our own C++ (`csrc/gated_rows.h`, through fused_ops.py's table):
`gated_rms_norm` (a Gated DeltaNet's output norm per value head, times silu(z)) and
`sigmoid_mul` (Qwen3.5's attention output gate) against the exact table's PyTorch formulas,
within 1e-5 relative (another summation order, another exp polynomial); their bits the same
whatever the thread count; bad shapes refused with the argument named.
"""

from __future__ import annotations

import pytest
import torch

from nanoserve.model.fused_ops import fused_ops, kernels
from nanoserve.model.layer_ops import EXACT_OPS

if kernels() is None:
    pytest.skip("fused_ops kernel unavailable", allow_module_level=True)

OPS = fused_ops()
EPS = 1e-6
# (rows, heads, head_dim): a decode of Qwen3.5-0.8B's 16 heads of 128, masked tails, a batch,
# a prefill chunk past the one-thread bound
GATED_SHAPES = [(1, 16, 128), (3, 3, 13), (5, 2, 7), (8, 4, 16), (300, 16, 128)]
# (rows, features): a decode of 8 heads of 256, a tail, a prefill chunk
SIGMOID_SHAPES = [(1, 2048), (3, 13), (64, 520), (300, 1024)]


def assert_close(ours: torch.Tensor, ref: torch.Tensor, rtol: float) -> None:
    torch.testing.assert_close(ours, ref, rtol=rtol, atol=rtol * ref.abs().max().item())


def in_projection(rows: int, value_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """core [rows, value_dim] and z, the strided columns of an in_proj-like product (the
    Python layer's split view), as the layer hands them to the norm."""
    gen = torch.Generator().manual_seed(seed)
    core = 2 * torch.randn(rows, value_dim, generator=gen)
    proj = 4 * torch.randn(rows, 3 * value_dim, generator=gen)
    return core, proj[:, 2 * value_dim:]


@pytest.mark.parametrize(("rows", "heads", "head_dim"), GATED_SHAPES)
def test_gated_rms_norm_matches_torch(rows: int, heads: int, head_dim: int) -> None:
    core, z = in_projection(rows, heads * head_dim, seed=rows * 100 + head_dim)
    assert z.stride(0) == 3 * z.shape[1]  # a split view, its rows apart
    z[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # exp's clamps, silu's zero
    weight = torch.rand(head_dim, generator=torch.Generator().manual_seed(1)) + 0.5
    ours = OPS.gated_rms_norm(core, z, weight, EPS)
    assert ours.shape == core.shape and ours.is_contiguous()
    assert_close(ours, EXACT_OPS.gated_rms_norm(core, z, weight, EPS), 1e-5)


@pytest.mark.parametrize(("rows", "features"), SIGMOID_SHAPES)
def test_sigmoid_mul_matches_torch(rows: int, features: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + features)
    x = torch.randn(rows, features, generator=gen)
    gate = 4 * torch.randn(rows, features, generator=gen)
    gate[0, :3] = torch.tensor([-100.0, 100.0, 0.0])
    ours = OPS.sigmoid_mul(x, gate)
    assert_close(ours, EXACT_OPS.sigmoid_mul(x, gate), 1e-5)
    assert ours[0, 1] == x[0, 1] and ours[0, 2] == x[0, 2] / 2  # sigmoid(100) = 1, (0) = 1/2


def test_the_bits_do_not_depend_on_the_thread_count() -> None:
    """A row's arithmetic is fixed: one thread and several give the same bits (what lets the
    native stack split rows as it likes and still equal the Python layer)."""
    core, z = in_projection(300, 16 * 128, seed=7)
    weight = torch.rand(128, generator=torch.Generator().manual_seed(2)) + 0.5
    gate = torch.randn(300, 16 * 128, generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = OPS.gated_rms_norm(core, z, weight, EPS), OPS.sigmoid_mul(core, gate)
        torch.set_num_threads(max(2, threads))
        split = OPS.gated_rms_norm(core, z, weight, EPS), OPS.sigmoid_mul(core, gate)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(alone, split, strict=True))
    # and a row is the same alone as among others
    assert torch.equal(OPS.gated_rms_norm(core[5:6], z[5:6], weight, EPS), alone[0][5:6])


def test_bad_shapes_are_refused_with_the_argument_named() -> None:
    core, z = in_projection(4, 32, seed=0)
    weight = torch.ones(8)
    with pytest.raises(RuntimeError, match="weight must"):
        OPS.gated_rms_norm(core, z, torch.ones(5), EPS)  # 5 does not divide 32
    with pytest.raises(RuntimeError, match="z is "):
        OPS.gated_rms_norm(core, z[:3], weight, EPS)
    with pytest.raises(RuntimeError, match="x must"):
        OPS.gated_rms_norm(core.t(), z, weight, EPS)  # columns not contiguous
    with pytest.raises(RuntimeError, match="gate is "):
        OPS.sigmoid_mul(core, core[:, :16])
    with pytest.raises(RuntimeError, match="x must"):
        OPS.sigmoid_mul(core.double(), core)
