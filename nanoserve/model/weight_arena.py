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

import ctypes
import functools
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
_TRIM_EVERY = 1 << 30


@functools.cache
def _malloc_trim() -> object | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc's
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> None:
    """Hands the C heap's free pages back to the system (glibc's malloc_trim; nothing
    elsewhere). While a model loads, each raw copy of a weight is freed once its packed form
    is made; buffers of a few MB come from the heap once glibc's mmap threshold has risen,
    and a freed raw copy (8.8 MB of a 20B MoE expert) leaves a hole the next packed one
    (10.4 MB) does not fit, so the heap grows by what was freed: loading the gpt-oss-20b-shaped
    file reached 24 GB and was killed on a 24 GB machine. Trimming every ~1 GB of weights
    keeps the peak at the model plus the raw copies not yet packed (the 20B-shaped file:
13.9 GB of resident memory, none of it the file's pages)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)  # type: ignore[operator]


class HeapTrim:
    """Calls `release_freed_memory` after each ~1 G elements (or bytes) of weights handled."""

    def __init__(self) -> None:
        self.count = 0

    def after(self, amount: int) -> None:
        self.count += amount
        if self.count > _TRIM_EVERY:
            self.count = 0
            release_freed_memory()


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
    A tied head is the embedding's own object: it moves once and both names keep it. Each
    weight's owners take the moved one as soon as it is copied, so its old bytes are freed
    then: the load's peak is the model plus one weight, not twice the model (a 20B MoE's
    12 GB on a 24 GB machine)."""
    owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    weights: dict[int, QuantizedWeight] = {}
    for owner, attr in _read_order(model):
        weight = getattr(owner, attr)
        if (isinstance(weight, QuantizedWeight) and weight.is_packed
                and weight.data.device.type == "cpu"):
            owners.setdefault(id(weight), []).append((owner, attr))
            weights.setdefault(id(weight), weight)
    if not weights:
        return 0
    # the arena's layout: every weight's data in read order, then the wide forms
    layout = [(key, "data", w.data.numel()) for key, w in weights.items()] + [
        (key, "wide", w.wide.numel()) for key, w in weights.items() if w.wide is not None]
    offsets: dict[tuple[int, str], int] = {}
    total = 0
    for key, part, numel in layout:
        offsets[(key, part)] = total
        total += -(-numel // _ALIGN) * _ALIGN
    arena = hugepage_buffer(total)
    tied = id(model.embed_tokens)
    trim = HeapTrim()  # the moved weights' old pages given back as the copy goes
    for key in list(weights):
        weight = weights.pop(key)
        trim.after(weight.data.numel())

        def moved(tensor: torch.Tensor, part: str, key: int = key) -> torch.Tensor:
            start = offsets[(key, part)]
            view = arena[start : start + tensor.numel()].view(tensor.shape)
            view.copy_(tensor)  # touches the pages now, at load, not in the first step
            return view

        new = replace(weight, data=moved(weight.data, "data"),
                      wide=None if weight.wide is None else moved(weight.wide, "wide"))
        for owner, attr in owners.pop(key):
            setattr(owner, attr, new)
        if key == tied:  # a tied head: the embedding keeps the same object
            model.embed_tokens = new  # type: ignore[assignment]
        del weight, new
    release_freed_memory()
    return sum(numel for _, _, numel in layout)
