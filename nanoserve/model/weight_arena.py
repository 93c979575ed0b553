"""The packed weights of a CPU model in one buffer on 2 MiB pages, in the order a step reads them.

A batch-1 decode step streams every packed weight once (~102 MB for the default model), each
projection a few hundred KB. Kept where the loader made them, they sit on 4 KiB pages: a TLB
miss every 4 KiB of a stream that outruns the page walks, and the hardware prefetcher starts
over at each page. Moved into one anonymous mapping advised `MADV_HUGEPAGE` (transparent huge
pages, where the kernel offers them; plain pages elsewhere, the same bytes), layer by layer as
the forward reads them (qkv, o, gate_up, down, then the LM head; the wide forms, read only by
batches of 16 rows and more, after them all), each step reads one region of few large pages.

Measured on the 2-core EPYC, interleaved rounds: the 30 layers' four projections at one row
3.93 -> 3.37 ms (-14%), a batch-1 greedy decode 7.76 -> 6.77 ms a token (-13%); details in
docs/benchmarks.md (issue 22). The bytes are the same, so every output is too.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from nanoserve.model.quant_linear import QuantizedWeight

if TYPE_CHECKING:
    from nanoserve.model.llama import CausalLM

HUGE_PAGE_BYTES = 2 << 20
_ALIGN = 64  # a cache line: each weight starts on one


def hugepage_buffer(num_bytes: int) -> torch.Tensor:
    """A zero-filled uint8 tensor [num_bytes] that starts on a 2 MiB boundary of a private
    anonymous mapping advised for huge pages (a shared one would be shmem, which THP skips)."""
    mapping = mmap.mmap(-1, num_bytes + HUGE_PAGE_BYTES,
                        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # advice only: where THP is off the pages stay small
        mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds `mapping` alive
    start = -whole.data_ptr() % HUGE_PAGE_BYTES
    return whole[start : start + num_bytes]


def _read_order(model: CausalLM) -> Iterator[tuple[torch.nn.Module, str]]:
    """(owner, attribute) of each matmul weight, in the order a forward multiplies by them."""
    for layer in model.decoder_layers:
        for attr in layer.MATMUL_WEIGHTS:  # (a hybrid's DeltaNet layer has its own)
            yield layer, attr
        if layer.moe is not None:  # a MoE layer's experts (its gate_up and down are None)
            for mlp in layer.moe.gated_mlps():
                yield mlp, "gate_up_proj"
                yield mlp, "down_proj"
    yield model, "lm_head"


def gather_packed_weights(model: CausalLM) -> int:
    """Move every packed weight of `model` (and its wide form) into one huge-page buffer, in
    read order; returns the bytes moved (0 when the model has no packed weight on the CPU).
    A tied head is the embedding's own object: it moves once and both names keep it."""
    owners = [(owner, attr, weight) for owner, attr in _read_order(model)
              if isinstance(weight := getattr(owner, attr), QuantizedWeight)
              and weight.is_packed and weight.data.device.type == "cpu"]
    weights = list({id(w): w for _, _, w in owners}.values())
    tensors = [w.data for w in weights] + [w.wide for w in weights if w.wide is not None]
    if not tensors:
        return 0
    sizes = [-(-t.numel() // _ALIGN) * _ALIGN for t in tensors]
    arena = hugepage_buffer(sum(sizes))
    moved: dict[int, torch.Tensor] = {}
    offset = 0
    for tensor, size in zip(tensors, sizes, strict=True):
        view = arena[offset : offset + tensor.numel()].view(tensor.shape)
        view.copy_(tensor)  # touches the pages now, at load, not in the first step
        moved[id(tensor)] = view
        offset += size
    new = {id(w): replace(w, data=moved[id(w.data)],
                          wide=None if w.wide is None else moved[id(w.wide)]) for w in weights}
    for owner, attr, weight in owners:
        setattr(owner, attr, new[id(weight)])
    if id(model.embed_tokens) in new:  # a tied head: the embedding keeps the same object
        model.embed_tokens = new[id(model.embed_tokens)]  # type: ignore[assignment]
    return sum(t.numel() for t in tensors)
