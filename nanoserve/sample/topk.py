"""`torch.topk` over a large vocabulary, in two small passes instead of one large one.

The vocabulary is cut into equal chunks. The k-th largest chunk maximum m is at most the k-th
largest value (the k best chunks each hold a value >= m), and every value outside the k best
chunks is at most m; so the k largest values all lie in the k best chunks. One `amax` over the
chunks, a `topk` over the chunk maxima and a `topk` over the k gathered chunks give the same
values as `torch.topk` over the whole rows (the order of equal values may differ), at 0.5-0.7x
its time on [32, 49152] float32 here. The last chunk is padded with -inf; where that padding
ties into a row's k best (fewer than k finite values), the plain `torch.topk` answers instead.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def chunked_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest entries of each row of x [r, V], descending."""
    rows, vocab = x.shape
    # chunks of ~sqrt(V / k) entries balance the two topk passes (a power of two, >= 8)
    chunk = 1 << max(3, round(math.log2(math.sqrt(vocab / max(k, 1)))))
    num_chunks = -(-vocab // chunk)
    if rows == 0 or num_chunks < 2 * k:
        return torch.topk(x, k, dim=-1)
    pad = num_chunks * chunk - vocab
    padded = F.pad(x, (0, pad), value=float("-inf")) if pad else x.contiguous()
    blocks = padded.view(rows, num_chunks, chunk)
    best = blocks.amax(dim=-1).topk(k, dim=-1).indices  # [r, k] chunk numbers
    candidates = blocks.gather(1, best[:, :, None].expand(rows, k, chunk)).view(rows, k * chunk)
    values, at = candidates.topk(k, dim=-1)
    ids = best.gather(1, at // chunk) * chunk + at % chunk
    if pad and bool((ids >= vocab).any()):
        # a row with fewer than k values above -inf (a grammar's mask, bad_words) can take
        # a -inf padding entry as a tie: such steps go through the plain topk
        return torch.topk(x, k, dim=-1)
    return values, ids
