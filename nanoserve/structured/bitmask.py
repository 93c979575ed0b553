"""The token bitmask: one row of int32 words per logits row; bit i of word w allows token 32w+i.

Matchers fill rows on the CPU (`GrammarMatcher.fill_bitmask`); `apply_bitmask` sets the logits
of forbidden tokens to -inf on the constrained rows, on the CPU or (after one copy of the mask)
on CUDA, right before the sampler's pipeline.

Measured on [16, 49152] float32 logits (the 2-core dev machine under other engineers' load,
medians of five interleaved runs; the GPU an H200, CUDA events): xgrammar's and llguidance's eager
fallback, which shifts each word by 0..31 and calls `masked_fill_`, took 1.8 ms on grammar-like
masks and 7 ms on random ones (the CPU `masked_fill_` branches per element); xgrammar's C++ CPU
kernel 1.8 ms; llguidance's `torch.compile` kernel 0.4 ms after a first call of 7-48 s. Ours
reads each byte of the mask as 8 biases (0 or -inf) from a [256, 8] table and adds them: one
gather and one add, branch-free, 0.4-0.56 ms on either kind of mask, beside a 50-90 ms decode
step at batch 16. On CUDA the same code takes 90-110 µs (97-119 µs with the copy of a pinned
mask) where a bool-mask `masked_fill_` takes 55-80 and xgrammar's CUDA kernel 17: a fused kernel
is the thing to write if GPU steps ever get short enough for that to matter.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Protocol

import torch

BITS_PER_WORD = 32
# For every byte value, what adding its 8 bits to 8 logits does: 0 where the bit is set, -inf
# where not. The words are read as little-endian bytes, so byte j of word w covers tokens
# 32w + 8j .. 32w + 8j + 7 in bit order.
_BYTE_BIAS = torch.where(((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool(),
                         0.0, float("-inf"))  # [256, 8]
_byte_bias_on: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
assert sys.byteorder == "little", "the bitmask's words are unpacked as little-endian bytes"


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row."""
    return (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD


def allocate_bitmask(num_rows: int, vocab_size: int, pin_memory: bool = False) -> torch.Tensor:
    """An all-allowed CPU bitmask, [num_rows, ceil(vocab_size / 32)] int32 (pinned for a
    non-blocking copy to the GPU)."""
    return torch.full((num_rows, bitmask_width(vocab_size)), -1, dtype=torch.int32,
                      pin_memory=pin_memory)


class RowFiller(Protocol):
    """What fills a mask row: a `GrammarMatcher`, or one behind a reasoning gate."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...


def fill_bitmask_rows(matchers: Sequence[tuple[RowFiller, int]],
                      bitmask: torch.Tensor) -> None:
    """Fill `bitmask[row]` from each (matcher, row): the constrained rows of a step."""
    for matcher, row in matchers:
        matcher.fill_bitmask(bitmask, row)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                  rows: Sequence[int] | torch.Tensor | None = None, packed: bool = False) -> None:
    """Set `logits[r, t]` to -inf where bit t of `bitmask[r]` is 0, for r in `rows` (all rows
    when None). In place. logits: [num_rows, vocab] float on any device; bitmask: [>= num_rows,
    words] int32 (CPU or the logits' device). Tokens past the mask's 32 * words are forbidden.
    `packed`: bitmask row i belongs to logits row `rows[i]` (the engine core fills only the
    constrained rows and sends them so)."""
    # logits: [num_rows, vocab]
    device, vocab = logits.device, logits.shape[1]
    words = bitmask.to(device, non_blocking=True)  # [num_rows, num_words]
    index = None
    if rows is not None:
        index = torch.as_tensor(rows, dtype=torch.long).to(device, non_blocking=True)
        if index.numel() == 0:
            return
        if not packed:
            words = words.index_select(0, index)  # [len(rows), num_words]
    elif words.shape[0] != logits.shape[0]:
        words = words[: logits.shape[0]]
    key = (device, logits.dtype)
    table = _byte_bias_on.get(key)
    if table is None:
        table = _byte_bias_on.setdefault(key, _BYTE_BIAS.to(device, logits.dtype))
    # one row of 8 biases per byte: [len(rows) * 4 * num_words, 8] -> [len(rows), 32 * num_words]
    byte_ids = words.contiguous().view(torch.uint8).view(-1).long()
    bias = table.index_select(0, byte_ids).view(words.shape[0], -1)
    if bias.shape[1] < vocab:  # tokens past the mask were never in the grammar
        bias = torch.nn.functional.pad(bias, (0, vocab - bias.shape[1]), value=float("-inf"))
    bias = bias[:, :vocab]
    if index is None:
        logits.add_(bias)
    else:
        logits.index_add_(0, index, bias)
