"""Gated DeltaNet's mixer (`model/delta_net_ops.py`, `csrc/delta_net.cpp`): the reference and
the C++ kernel against transformers' Qwen3.5 functions, a token's bits independent of how its
sequence is cut into calls and batched, snapshots equal to the state a shorter run leaves, and
the kernel within 1e-5 of the reference.

Tolerances: transformers within 1e-5 (other sum orders, FMA; measured <= 6e-7); the kernel and
the reference within 1e-5 of each other; chunking, batching and snapshots bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    causal_conv1d_fn,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from nanoserve.model.delta_net_ops import delta_rule_reference, kernels
from nanoserve.model.linear_arch import LinearAttentionConfig

NUM_SLOTS, NUM_LAYERS, LAYER = 8, 2, 1  # the layer under test is the second of the pools
SHAPES = [  # key heads == value heads; value heads 2x key heads; a 32-column strip and a tail
    LinearAttentionConfig(conv_kernel=4, num_key_heads=2, num_value_heads=2, key_head_dim=16,
                          value_head_dim=40),
    LinearAttentionConfig(conv_kernel=3, num_key_heads=2, num_value_heads=4, key_head_dim=16,
                          value_head_dim=16),
    LinearAttentionConfig(conv_kernel=2, num_key_heads=1, num_value_heads=2, key_head_dim=8,
                          value_head_dim=8),
]
Rule = Callable[..., torch.Tensor]


def kernel_rule(*args: object) -> torch.Tensor:
    """The C++ kernel with delta_rule_reference's signature (no fallback)."""
    native = kernels()
    assert native is not None
    *tensors, shape = args
    assert isinstance(shape, LinearAttentionConfig)
    return native.delta_rule(*tensors, shape.num_key_heads, shape.v_heads_tiled)


needs_kernel = pytest.mark.skipif(kernels() is None, reason="delta_net kernel unavailable")
IMPLS = [pytest.param(delta_rule_reference, id="reference"),
         pytest.param(kernel_rule, id="kernel", marks=needs_kernel)]


class Tokens(NamedTuple):
    """Projections of tokens, one row each: qkv [L, conv_dim], a and b [L, value_heads]."""

    qkv: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor

    def rows(self, first: int, last: int) -> Tokens:
        return Tokens(*(x[first:last] for x in self))

    @staticmethod
    def cat(parts: list[Tokens]) -> Tokens:
        return Tokens(*(torch.cat([p[i] for p in parts]) for i in range(3)))


@dataclass
class Layer:
    """One layer's weights and a pool of states (the layer under test at LAYER)."""

    shape: LinearAttentionConfig
    conv_weight: torch.Tensor  # [conv_dim, conv_kernel]
    neg_exp_a: torch.Tensor  # [value_heads]
    dt_bias: torch.Tensor
    conv_states: torch.Tensor  # [NUM_SLOTS, NUM_LAYERS, conv_dim, conv_kernel - 1]
    ssm_states: torch.Tensor  # [NUM_SLOTS, NUM_LAYERS, value_heads, dk, dv]

    @classmethod
    def random(cls, shape: LinearAttentionConfig, seed: int = 0) -> Layer:
        gen = torch.Generator().manual_seed(seed)
        heads = shape.num_value_heads
        # decays of exp(-0.01 .. -1) a token: the state carries far enough to be tested
        return cls(shape, torch.randn(shape.conv_dim, shape.conv_kernel, generator=gen) * 0.5,
                   -torch.empty(heads).uniform_(0.01, 1.0, generator=gen),
                   torch.randn(heads, generator=gen) * 0.5,
                   torch.zeros(NUM_SLOTS, NUM_LAYERS, shape.conv_dim, shape.conv_kernel - 1),
                   torch.zeros(NUM_SLOTS, NUM_LAYERS, heads, shape.key_head_dim,
                               shape.value_head_dim))

    def copy(self) -> Layer:
        return Layer(self.shape, self.conv_weight, self.neg_exp_a, self.dt_bias,
                     self.conv_states.clone(), self.ssm_states.clone())

    def run(self, rule: Rule, tokens: Tokens, slots: list[int], lengths: list[int],
            snapshots: list[int] | None = None) -> torch.Tensor:
        """One call: sequences of `lengths` tokens, rows in order, at `slots`."""
        starts = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        snaps = snapshots if snapshots is not None else [-1] * tokens.qkv.shape[0]
        return rule(*tokens, self.conv_weight, self.neg_exp_a, self.dt_bias,
                    self.conv_states, self.ssm_states, LAYER,
                    torch.tensor(slots, dtype=torch.int32), starts,
                    torch.tensor(snaps, dtype=torch.int32), self.shape)

    def state(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv_states[slot, LAYER].clone(), self.ssm_states[slot, LAYER].clone()


def random_tokens(shape: LinearAttentionConfig, length: int, seed: int) -> Tokens:
    gen = torch.Generator().manual_seed(seed)
    return Tokens(torch.randn(length, shape.conv_dim, generator=gen),
                  torch.randn(length, shape.num_value_heads, generator=gen),
                  torch.randn(length, shape.num_value_heads, generator=gen))


def transformers_mixer(layer: Layer, tokens: Tokens, rule: Rule
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3_5GatedDeltaNet.forward's conv and rule for one fresh sequence (grouped heads):
    core [L, value_dim] and the final recurrent state [value_heads, dk, dv]."""
    s, (qkv, a, b) = layer.shape, tokens
    x = causal_conv1d_fn(qkv.t()[None], layer.conv_weight, None, activation="silu")[0].t()
    q, k, v = x.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
    g = layer.neg_exp_a * F.softplus(a + layer.dt_bias)
    out, state = rule(q.reshape(1, -1, s.num_key_heads, s.key_head_dim),
                      k.reshape(1, -1, s.num_key_heads, s.key_head_dim),
                      v.reshape(1, -1, s.num_value_heads, s.value_head_dim), g=g[None],
                      beta=b.sigmoid()[None], initial_state=None, output_final_state=True,
                      use_qk_l2norm_in_kernel=True)
    return out.reshape(-1, s.value_dim), state[0]


def tiled_order(shape: LinearAttentionConfig) -> torch.Tensor:
    """For each tiled value head j, the grouped (transformers) head with its key head and place
    in the group: key head j % key heads, place j // key heads."""
    group = shape.num_value_heads // shape.num_key_heads
    return torch.tensor([(j % shape.num_key_heads) * group + j // shape.num_key_heads
                         for j in range(shape.num_value_heads)])


def to_tiled(layer: Layer, tokens: Tokens) -> tuple[Layer, Tokens]:
    """The same layer and tokens with value heads in the tiled order (v channels, a, b, the
    per-head weights and the v rows of the conv all permuted)."""
    s, (qkv, a, b) = layer.shape, tokens
    order = tiled_order(s)
    v_channels = (2 * s.key_dim + order[:, None] * s.value_head_dim
                  + torch.arange(s.value_head_dim)).reshape(-1)
    channels = torch.cat([torch.arange(2 * s.key_dim), v_channels])
    tiled = LinearAttentionConfig(s.conv_kernel, s.num_key_heads, s.num_value_heads,
                                  s.key_head_dim, s.value_head_dim, v_heads_tiled=True)
    return (Layer(tiled, layer.conv_weight[channels].contiguous(), layer.neg_exp_a[order],
                  layer.dt_bias[order], layer.conv_states.clone(), layer.ssm_states.clone()),
            Tokens(qkv[:, channels].contiguous(), a[:, order].contiguous(),
                   b[:, order].contiguous()))


@pytest.mark.parametrize("rule", IMPLS)
@pytest.mark.parametrize("shape", SHAPES, ids=["heads1x", "heads2x", "conv2"])
@pytest.mark.parametrize("is_tiled", [False, True], ids=["grouped", "tiled"])
@pytest.mark.parametrize("library", [torch_recurrent_gated_delta_rule,
                                     torch_chunk_gated_delta_rule], ids=["recurrent", "chunk"])
def test_matches_transformers(rule: Rule, shape: LinearAttentionConfig, is_tiled: bool,
                              library: Rule) -> None:
    layer = Layer.random(shape)
    tokens = random_tokens(shape, 20, seed=1)
    want, want_state = transformers_mixer(layer, tokens, library)
    ours, tokens = to_tiled(layer, tokens) if is_tiled else (layer, tokens)
    # two calls, so the conv's state carries across a call boundary too
    out = torch.cat([ours.run(rule, tokens.rows(0, 9), [3], [9]),
                     ours.run(rule, tokens.rows(9, 20), [3], [11])])
    conv_state, state = ours.state(3)
    if is_tiled:  # back to transformers' head order
        order = tiled_order(shape)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order))
        out = out.view(20, -1, shape.value_head_dim)[:, inverse].reshape(20, -1)
        state = state[inverse]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-5)
    # the conv state is the last conv_kernel - 1 inputs, oldest first
    assert torch.equal(conv_state, tokens.qkv[-(shape.conv_kernel - 1):].t())
    assert not ours.ssm_states[:, 0].any() and not ours.conv_states[:, 0].any()  # other layer


# Three sequences (slot, length): X, the one cut in every way, and two others beside it.
SEQS = {"x": (2, 70), "y": (0, 45), "z": (5, 23)}
# calls of (sequence, tokens): prefill chunks beside one-token decodes of the others
BATCHED = [[("y", 10), ("x", 16)], [("y", 1), ("z", 23), ("x", 5)], [("x", 1), ("y", 1)],
           [("z", 0), ("y", 33), ("x", 40)], [("x", 8)]]


def run_calls(rule: Rule, layer: Layer, tokens: dict[str, Tokens],
              calls: list[list[tuple[str, int]]]) -> dict[str, torch.Tensor]:
    """Each call a flat batch of the named sequences' next tokens; their outputs, in order."""
    done = dict.fromkeys(tokens, 0)
    outs: dict[str, list[torch.Tensor]] = {name: [] for name in tokens}
    for call in calls:
        batch = Tokens.cat([tokens[n].rows(done[n], done[n] + count) for n, count in call])
        out = layer.run(rule, batch, [SEQS[n][0] for n, _ in call], [c for _, c in call])
        for (name, count), piece in zip(call, out.split([c for _, c in call]), strict=True):
            outs[name].append(piece)
            done[name] += count
    assert all(done[name] == tokens[name].qkv.shape[0] for name in tokens if outs[name])
    return {name: torch.cat(pieces) for name, pieces in outs.items() if pieces}


def chunked(name: str, size: int) -> list[list[tuple[str, int]]]:
    length = SEQS[name][1]
    return [[(name, min(size, length - i))] for i in range(0, length, size)]


@pytest.mark.parametrize("rule", IMPLS)
@pytest.mark.parametrize("shape", SHAPES[:2], ids=["heads1x", "heads2x"])
def test_bits_do_not_depend_on_chunks_or_batch(rule: Rule, shape: LinearAttentionConfig) -> None:
    base = Layer.random(shape)
    tokens = {name: random_tokens(shape, length, seed=i)
              for i, (name, (_, length)) in enumerate(SEQS.items())}
    alone: dict[str, tuple[torch.Tensor, ...]] = {}  # output, conv state, ssm state
    for name in SEQS:  # each sequence whole, alone
        layer = base.copy()
        out = run_calls(rule, layer, {name: tokens[name]}, [[(name, SEQS[name][1])]])[name]
        alone[name] = (out, *layer.state(SEQS[name][0]))
    for size in (1, 7, 16):
        layer = base.copy()
        out = run_calls(rule, layer, {"x": tokens["x"]}, chunked("x", size))["x"]
        for got, want in zip((out, *layer.state(2)), alone["x"], strict=True):
            assert torch.equal(got, want), f"chunks of {size}"
    layer = base.copy()
    outs = run_calls(rule, layer, tokens, BATCHED)
    for name, (slot, _) in SEQS.items():
        for got, want in zip((outs[name], *layer.state(slot)), alone[name], strict=True):
            assert torch.equal(got, want), f"{name} batched"


@needs_kernel
def test_kernel_bits_do_not_depend_on_threads() -> None:
    base = Layer.random(SHAPES[0])
    tokens = {name: random_tokens(SHAPES[0], length, seed=i)
              for i, (name, (_, length)) in enumerate(SEQS.items())}
    results = []
    threads = torch.get_num_threads()
    for count in (1, 3):
        layer = base.copy()
        torch.set_num_threads(count)
        try:
            outs = run_calls(kernel_rule, layer, tokens, BATCHED)
        finally:
            torch.set_num_threads(threads)
        results.append((*outs.values(), layer.conv_states, layer.ssm_states))
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)


SNAPSHOT_AT = {1: 6, 29: 7, 30: 3, 52: 4, 69: 1}  # token of X -> the slot its state goes to


@pytest.mark.parametrize("rule", IMPLS)
def test_snapshots_are_the_state_after_their_token(rule: Rule) -> None:
    shape = SHAPES[1]
    base = Layer.random(shape)
    x, y = random_tokens(shape, 70, seed=3), random_tokens(shape, 12, seed=4)
    whole = base.copy()  # X in two calls, the second beside Y, snapshots on the way
    outs = []
    for first, last in ((0, 30), (30, 70)):
        snaps = [SNAPSHOT_AT.get(t, -1) for t in range(first, last)]
        batch = Tokens.cat([x.rows(first, last), y.rows(0, 6)])
        outs.append(whole.run(rule, batch, [2, 0], [last - first, 6], snaps + [-1] * 6))
    out = torch.cat([o[:-6] for o in outs])
    for t, snapshot in SNAPSHOT_AT.items():
        stopped = base.copy()
        stopped.run(rule, x.rows(0, t + 1), [2], [t + 1])
        for got, want in zip(whole.state(snapshot), stopped.state(2), strict=True):
            assert torch.equal(got, want), f"snapshot after token {t}"
        if t + 1 < 70:  # resume from a copy of the snapshot, in another slot
            resumed = base.copy()
            resumed.conv_states[5], resumed.ssm_states[5] = (whole.conv_states[snapshot],
                                                             whole.ssm_states[snapshot])
            rest = resumed.run(rule, x.rows(t + 1, 70), [5], [69 - t])
            assert torch.equal(rest, out[t + 1:]), f"resumed after token {t}"
            for got, want in zip(resumed.state(5), whole.state(2), strict=True):
                assert torch.equal(got, want)


QWEN35_08B = LinearAttentionConfig(conv_kernel=4, num_key_heads=16, num_value_heads=16,
                                   key_head_dim=128, value_head_dim=128)


@needs_kernel
@pytest.mark.parametrize("shape", [*SHAPES, QWEN35_08B], ids=["heads1x", "heads2x", "conv2",
                                                              "qwen3.5-0.8b"])
def test_kernel_matches_reference(shape: LinearAttentionConfig) -> None:
    base = Layer.random(shape)
    base.ssm_states.normal_(generator=torch.Generator().manual_seed(5))  # a resumed state
    base.conv_states.normal_(generator=torch.Generator().manual_seed(6))
    tokens = random_tokens(shape, 40, seed=7)
    snaps = [-1] * 40
    snaps[3], snaps[20] = 7, 6
    results = []
    for rule in (delta_rule_reference, kernel_rule):
        layer = base.copy()  # a prefill chunk of 17, two decodes, a chunk of 20
        out = layer.run(rule, tokens, [2, 0, 4, 1], [17, 1, 2, 20], snaps)
        results.append((out, layer.conv_states, layer.ssm_states))
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(results[0][2], base.ssm_states)  # the call did change the states


@needs_kernel
def test_kernel_refuses_slots_outside_the_pool() -> None:
    layer = Layer.random(SHAPES[0])
    tokens = random_tokens(SHAPES[0], 3, seed=0)
    with pytest.raises(RuntimeError, match="slots"):
        layer.run(kernel_rule, tokens, [NUM_SLOTS], [3])
    with pytest.raises(RuntimeError, match="snapshots"):
        layer.run(kernel_rule, tokens, [0], [3], [-1, NUM_SLOTS, -1])
