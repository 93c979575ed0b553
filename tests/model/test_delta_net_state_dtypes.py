"""A 16-bit recurrent state in Gated DeltaNet's mixer (`model/delta_net_ops.py`,
`csrc/delta_net.h`; --mamba-ssm-cache-dtype): bfloat16 and float16 states give, bit for bit,
the float32 rule with its state rounded to the type after every token (reference and kernel);
so a token's bits still do not depend on chunks, batches or a resume from a snapshot; the
kernel stays within a rounding of the reference, and refuses other state types.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_delta_net import (
    BATCHED,
    IMPLS,
    SEQS,
    SHAPES,
    Layer,
    Rule,
    chunked,
    delta_rule_reference,
    kernel_rule,
    needs_kernel,
    random_tokens,
    run_calls,
)

DTYPES = [torch.bfloat16, torch.float16]


def in_dtype(layer: Layer, dtype: torch.dtype) -> Layer:
    """The layer with its recurrent states stored as `dtype` (rounded from float32)."""
    return Layer(layer.shape, layer.conv_weight, layer.neg_exp_a, layer.dt_bias,
                 layer.conv_states.clone(), layer.ssm_states.to(dtype, copy=True))


def resumed_base(shape: object, seed: int) -> Layer:
    """A layer whose slots hold states of a resumed sequence (not zeros: the rounding of the
    state read first shows)."""
    assert isinstance(shape, type(SHAPES[0]))
    base = Layer.random(shape, seed)
    base.ssm_states.normal_(generator=torch.Generator().manual_seed(seed + 1))
    base.conv_states.normal_(generator=torch.Generator().manual_seed(seed + 2))
    return base


@pytest.mark.parametrize("rule", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bfloat16", "float16"])
@pytest.mark.parametrize("shape", SHAPES, ids=["heads1x", "heads2x", "conv2"])
def test_a_16bit_state_is_the_float32_rule_rounded_after_each_token(
        rule: Rule, dtype: torch.dtype, shape: object) -> None:
    """Two sequences in one call with a 16-bit state, against the float32 state run one token
    a call with the state rounded to `dtype` between calls."""
    base = resumed_base(shape, seed=11)
    base.ssm_states.copy_(base.ssm_states.to(dtype))  # the same start both ways
    x, y = random_tokens(base.shape, 23, seed=12), random_tokens(base.shape, 9, seed=13)
    narrow = in_dtype(base, dtype)
    out = narrow.run(rule, type(x).cat([x, y]), [2, 5], [23, 9])
    wide = base.copy()
    steps = []
    for slot, tokens in ((2, x), (5, y)):
        for t in range(tokens.qkv.shape[0]):
            steps.append(wide.run(rule, tokens.rows(t, t + 1), [slot], [1]))
            wide.ssm_states.copy_(wide.ssm_states.to(dtype))
    assert narrow.ssm_states.dtype == dtype
    assert torch.equal(out, torch.cat(steps))
    assert torch.equal(narrow.ssm_states.float(), wide.ssm_states)
    assert torch.equal(narrow.conv_states, wide.conv_states)
    assert not torch.equal(narrow.ssm_states, base.ssm_states.to(dtype))


@pytest.mark.parametrize("rule", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bfloat16", "float16"])
def test_16bit_bits_do_not_depend_on_chunks_batches_or_snapshots(rule: Rule,
                                                                  dtype: torch.dtype) -> None:
    shape = SHAPES[1]
    base = in_dtype(Layer.random(shape), dtype)
    tokens = {name: random_tokens(shape, length, seed=i)
              for i, (name, (_, length)) in enumerate(SEQS.items())}
    alone: dict[str, tuple[torch.Tensor, ...]] = {}
    for name in SEQS:
        layer = in_dtype(base, dtype)
        out = run_calls(rule, layer, {name: tokens[name]}, [[(name, SEQS[name][1])]])[name]
        alone[name] = (out, *layer.state(SEQS[name][0]))
    for size in (1, 7):
        layer = in_dtype(base, dtype)
        out = run_calls(rule, layer, {"x": tokens["x"]}, chunked("x", size))["x"]
        for got, want in zip((out, *layer.state(2)), alone["x"], strict=True):
            assert torch.equal(got, want), f"chunks of {size}"
    layer = in_dtype(base, dtype)
    outs = run_calls(rule, layer, tokens, BATCHED)
    for name, (slot, _) in SEQS.items():
        for got, want in zip((outs[name], *layer.state(slot)), alone[name], strict=True):
            assert torch.equal(got, want), f"{name} batched"
    # a snapshot after token 29 of X, resumed in another slot, continues X bit for bit
    whole = in_dtype(base, dtype)
    x = tokens["x"]
    snaps = [-1] * 70
    snaps[29] = 7
    out = whole.run(rule, x, [2], [70], snaps)
    assert whole.ssm_states.dtype == dtype
    resumed = in_dtype(base, dtype)
    resumed.conv_states[4], resumed.ssm_states[4] = whole.conv_states[7], whole.ssm_states[7]
    assert torch.equal(resumed.run(rule, x.rows(30, 70), [4], [40]), out[30:])
    for got, want in zip(resumed.state(4), whole.state(2), strict=True):
        assert torch.equal(got, want)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=["bfloat16", "float16"])
def test_kernel_is_within_a_rounding_of_the_reference(dtype: torch.dtype) -> None:
    """The kernel's float32 sums differ from the reference's by ~1e-6, which moves a 16-bit
    state by one unit of its last place where a sum falls near a rounding boundary."""
    base = in_dtype(resumed_base(SHAPES[0], seed=21), dtype)
    tokens = random_tokens(base.shape, 40, seed=22)
    snaps = [-1] * 40
    snaps[3], snaps[20] = 7, 6
    results = []
    for rule in (delta_rule_reference, kernel_rule):
        layer = in_dtype(base, dtype)
        out = layer.run(rule, tokens, [2, 0, 4, 1], [17, 1, 2, 20], snaps)
        results.append((out, layer.conv_states, layer.ssm_states))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=2e-2, atol=2e-2)
    assert torch.equal(results[1][1], results[0][1])
    torch.testing.assert_close(results[1][2], results[0][2])  # dtype's own tolerances
    assert not torch.equal(results[0][2], base.ssm_states)


@needs_kernel
def test_kernel_refuses_other_state_types() -> None:
    layer = Layer.random(SHAPES[0])
    layer.ssm_states = layer.ssm_states.double()
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        layer.run(kernel_rule, random_tokens(SHAPES[0], 3, seed=0), [0], [3])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, *DTYPES], ids=["float32", "bfloat16",
                                                                   "float16"])
def test_every_strip_width_gives_the_same_bits(dtype: torch.dtype) -> None:
    """The kernel schedule's DeltaNet strip widths (csrc/schedule.h; what the tuner times):
    outputs, states and snapshots equal the default width's, on 72 value columns (a 64-column
    strip and an 8-column tail; two 32s and a tail; ...), a prefill and a decode in one call."""
    from nanoserve import native
    from nanoserve.kernel_tuning.schedule import DEFAULT, DELTA_NET_STRIP_COLUMNS

    shape = type(SHAPES[0])(conv_kernel=4, num_key_heads=2, num_value_heads=4,
                            key_head_dim=16, value_head_dim=72)
    base = in_dtype(resumed_base(shape, seed=21), dtype)
    tokens = random_tokens(shape, 10, seed=22)
    snapshots = [-1, -1, -1, 6, -1, -1, -1, -1, -1, 7]

    def run(columns: int) -> tuple[torch.Tensor, ...]:
        native.set_kernel_schedule(replace(DEFAULT, delta_net_strip_columns=columns).flat())
        layer = base.copy()
        out = layer.run(kernel_rule, tokens, [2, 5], [9, 1], snapshots)
        return out, layer.ssm_states, layer.conv_states

    try:
        expected = run(DEFAULT.delta_net_strip_columns)
        for columns in DELTA_NET_STRIP_COLUMNS:
            got = run(columns)
            assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), columns
    finally:
        native.set_kernel_schedule(DEFAULT.flat())
