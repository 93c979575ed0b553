"""A hybrid model's layer weights (Qwen3.5/3.6), from Hugging Face names into the model's.

- A Gated DeltaNet layer (`model.layers.N.linear_attn.*`): in_proj_qkv and in_proj_z fused into
  `in_proj`, in_proj_b and in_proj_a into `ba_proj` (Qwen3-Next's fused in_proj_qkvz and
  in_proj_ba, whose rows go key head by key head, put in that order: `ungroup_qkvz`), the
  conv's [conv_dim, 1, kernel] weight as [conv_dim, kernel], A_log as -exp(A_log) in float32
  (transformers computes the same product every step; a GGUF file stores it so:
  `neg_exp_a`), dt_bias and the gated norm's weight as they are.
- A gated attention layer (`self_attn.*`): q_proj's rows hold, per head, the head's query then
  its output gate (transformers views them as [H, 2 * D] and chunks); they become q's rows and
  `attn_gate_proj`'s. Partial rotary: RoPE turns the first `rotary_dim` dims of a head in
  rotate-half pairs (i, i + rotary_dim / 2). The layer's rope kernels turn every dim in pairs
  (i, i + D / 2), so q's and k's dims (and the q/k norm weights) are put in the order that
  makes those the same pairs (`rotary_order`), with frequency 0 (cos 1, sin 0: the value
  itself, exactly) on the dims RoPE leaves alone. q · k is a sum over the same products in
  another order; v and the output are untouched.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from nanoserve.model.arch import ArchConfig
from nanoserve.model.quantization import RawBlocks, as_float, fuse_rows

ReadTensor = torch.Tensor | RawBlocks  # a checkpoint's tensor as read (weights.py)
Loaded = torch.Tensor | RawBlocks | list[RawBlocks]


def pop_delta_net(state: dict[str, ReadTensor], prefix: str, target: str, arch: ArchConfig
                  ) -> dict[str, Loaded]:
    """Layer `prefix` (`model.layers.N.`)'s mixer tensors out of `state`, under the
    DeltaNetLayer's names after `target` (`layers.N.`)."""
    shape = arch.linear
    assert shape is not None
    la = prefix + "linear_attn."
    conv = as_float(state.pop(la + "conv1d.weight")).reshape(shape.conv_dim, shape.conv_kernel)
    if la + "neg_exp_a" in state:
        neg_exp_a = as_float(state.pop(la + "neg_exp_a"))
    else:
        neg_exp_a = -as_float(state.pop(la + "A_log")).float().exp()
    in_proj: Loaded
    ba_proj: Loaded
    if la + "in_proj_qkvz.weight" in state:  # Qwen3-Next: fused, key head by key head
        in_proj, ba_proj = ungroup_qkvz(state.pop(la + "in_proj_qkvz.weight"),
                                        state.pop(la + "in_proj_ba.weight"), arch)
    else:
        in_proj = fuse_rows([state.pop(la + "in_proj_qkv.weight"),
                             state.pop(la + "in_proj_z.weight")])
        ba_proj = fuse_rows([state.pop(la + "in_proj_b.weight"),
                             state.pop(la + "in_proj_a.weight")])
    return {
        target + "in_proj": in_proj, target + "ba_proj": ba_proj,
        target + "conv_weight": conv, target + "neg_exp_a": neg_exp_a.reshape(-1),
        target + "dt_bias": as_float(state.pop(la + "dt_bias")).reshape(-1),
        target + "norm": state.pop(la + "norm.weight"),
        target + "out_proj": state.pop(la + "out_proj.weight"),
    }


def ungroup_qkvz(qkvz: ReadTensor, ba: ReadTensor, arch: ArchConfig
                 ) -> tuple[ReadTensor, ReadTensor]:
    """Qwen3-Next's in_proj_qkvz (per key head: its q, its k, then the v and z of its value
    heads) and in_proj_ba (per key head: its value heads' b, then their a) -> Qwen3.5's row
    order: every q, every k, every v, every z; every b, every a (value heads grouped)."""
    shape = arch.linear
    assert shape is not None
    dk, dv = shape.key_head_dim, shape.value_head_dim
    per_key = shape.num_value_heads // shape.num_key_heads
    widths = (dk, dk, per_key * dv, per_key * dv)
    rows = torch.arange(shape.num_key_heads * sum(widths)).view(shape.num_key_heads, -1)
    parts = rows.split(widths, dim=1)  # each [key heads, width]
    ba_rows = torch.arange(2 * shape.num_value_heads).view(shape.num_key_heads, 2, per_key)
    return (take_rows(qkvz, torch.cat([part.reshape(-1) for part in parts])),
            take_rows(ba, ba_rows.transpose(0, 1).reshape(-1)))


def split_gated_query(q_proj: ReadTensor, arch: ArchConfig) -> tuple[ReadTensor, ReadTensor]:
    """q_proj's rows [H, 2, D] (each head's query, then its gate) -> (query rows, gate rows)."""
    rows = torch.arange(arch.num_heads * 2 * arch.head_dim).view(arch.num_heads, 2,
                                                                 arch.head_dim)
    return (take_rows(q_proj, rows[:, 0].reshape(-1)),
            take_rows(q_proj, rows[:, 1].reshape(-1)))


def rotary_order(arch: ArchConfig) -> torch.Tensor:
    """Where each of a head's dims is put so full rotate-half RoPE turns partial RoPE's pairs:
    order[j] is the original dim at position j. The rotary dims' first half goes to the front
    of each half of the head, their second half to the front of the second half, the rest
    fill in after, in order."""
    dim, rot = arch.head_dim, arch.rotary_dim
    half, rot_half = dim // 2, rot // 2
    passing = list(range(rot, dim))
    first = list(range(rot_half)) + passing[: half - rot_half]
    second = list(range(rot_half, rot)) + passing[half - rot_half :]
    return torch.tensor(first + second)


def reorder_heads(value: ReadTensor, arch: ArchConfig, num_heads: int) -> ReadTensor:
    """A q or k projection's rows (or a q/k norm weight) in `rotary_order`, head by head."""
    order = rotary_order(arch)
    if isinstance(value, torch.Tensor) and value.dim() == 1:  # a norm's weight [D]
        return value[order]
    heads = torch.arange(num_heads)[:, None] * arch.head_dim
    return take_rows(value, (heads + order[None, :]).reshape(-1))


def take_rows(value: ReadTensor, index: torch.Tensor) -> ReadTensor:
    """The rows `index` of a weight: a tensor, or raw GGUF blocks (whole rows, still raw)."""
    if isinstance(value, RawBlocks):
        return replace(value, data=value.rows()[index], shape=(len(index), value.shape[1]))
    return value[index]
