"""llama.cpp's cuts as batched tensor functions: top-n-sigma, typical-p, top-p over the
survivors, XTC, and mirostat's kept sets. llama_draw.py says what each one keeps and in which
order they run; this file computes them.

Every function takes temperature-scaled logits and returns them with the cut tokens at -inf
(or the kept mask). A row's result depends only on that row: sums are float64, either
sequential along a row's candidates (`cumsum`, whose trailing -inf entries add exact zeros, so
the width the candidates came in does not matter) or `fixed_sum`'s blocks over a whole row.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")
MIROSTAT_M = 100  # llama.cpp's m: the best tokens mirostat 1 fits its Zipf exponent on


def fixed_sum(x: torch.Tensor) -> torch.Tensor:
    """Each row's sum of x [r, V] (float64) in a fixed order: blocks of 128, then the blocks
    (truncation.whole_mass's order), whatever the other rows or the thread count."""
    if x.shape[1] % 128:
        x = F.pad(x, (0, -x.shape[1] % 128))  # zeros add nothing
    return x.view(x.shape[0], -1, 128).sum(dim=-1).sum(dim=-1)


def _masses(vals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gap [r, K], weights [r, K], total [r]) float64 over each row's finite candidates:
    gap = s - s_max, weights = exp(gap) (0 where cut), total their sequential sum."""
    top = vals.amax(dim=-1, keepdim=True)
    top = torch.where(top.isinf(), torch.zeros_like(top), top)  # an all -inf row stays finite
    gap = vals.double() - top.double()
    weights = gap.exp()
    return gap, weights, weights.cumsum(dim=-1)[:, -1]


def top_n_sigma(scaled: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Keep s >= max - n * std, max and the population std over the row's finite logits
    (llama.cpp's), where n > 0. scaled [r, V] float32, n [r] float64 -> scaled, cut."""
    finite = scaled > NEG_INF
    count = finite.sum(dim=-1).clamp(min=1).double()
    x = scaled.double().masked_fill(~finite, 0.0)
    mean = fixed_sum(x) / count
    dev = (x - mean[:, None]).masked_fill(~finite, 0.0)
    std = (fixed_sum(dev * dev) / count).sqrt()
    floor = scaled.amax(dim=-1).double() - n * std
    cut = (scaled.double() < floor[:, None]) & (n > 0)[:, None]
    return scaled.masked_fill(cut, NEG_INF)


def typical(ids: torch.Tensor, vals: torch.Tensor, typical_p: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling over the candidates (ids, vals) [r, K]: with p the softmax
    over the finite ones and H its entropy, order them by |-log p - H| ascending (ties: the
    lowest token id first) and keep each one whose mass before it in that order is at most
    typical_p (llama.cpp stops after the first whose running sum exceeds typical_p; so at
    least one). Rows with typical_p >= 1 are left alone. -> vals, cut."""
    finite = vals > NEG_INF
    gap, weights, total = _masses(vals)
    log_total = total.log()[:, None]
    log_p = gap - log_total  # exact where p itself would underflow
    p = weights / total[:, None]
    entropy = -(p * log_p).masked_fill(~finite, 0.0).cumsum(dim=-1)[:, -1]
    shifted = (-log_p - entropy[:, None]).abs().masked_fill(~finite, math.inf)
    by_id = ids.argsort(dim=-1)
    order = by_id.gather(1, shifted.gather(1, by_id).sort(dim=-1, stable=True).indices)
    mass = p.gather(1, order).cumsum(dim=-1)
    before = F.pad(mass[:, :-1], (1, 0))  # mass of the tokens ahead in the typical order
    keep = torch.zeros_like(finite).scatter_(1, order, before <= typical_p.double()[:, None])
    keep = (keep & finite) | (typical_p >= 1.0)[:, None]
    return vals.masked_fill(~keep, NEG_INF)


def top_p_survivors(vals: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """truncation.py's top-p on candidates sorted by value (descending, holes at -inf),
    renormalized over the finite ones: keep a token while the mass strictly above it is below
    top_p, and every token tied with the last one kept. Rows with top_p >= 1 are left alone."""
    finite = vals > NEG_INF
    _, weights, total = _masses(vals)
    above = F.pad(weights.cumsum(dim=-1)[:, :-1], (1, 0)) / total[:, None]
    within = finite & (above < top_p.double()[:, None])
    last = vals.masked_fill(~within, math.inf).amin(dim=-1, keepdim=True)
    keep = finite & ((vals >= last) | (top_p >= 1.0)[:, None])
    return vals.masked_fill(~keep, NEG_INF)


def xtc(ids: torch.Tensor, vals: torch.Tensor, fires: torch.Tensor,
        threshold: torch.Tensor) -> torch.Tensor:
    """Exclude Top Choices where `fires` [r] (the row's coin came up): with p the softmax over
    the finite candidates, if two or more tokens have p >= threshold, drop all of them but the
    least likely one (ties: the highest token id stays, llama.cpp's last in its order). -> vals."""
    finite = vals > NEG_INF
    _, weights, total = _masses(vals)
    above = finite & (weights / total[:, None] >= threshold.double()[:, None])
    lowest = vals.masked_fill(~above, math.inf).amin(dim=-1, keepdim=True)
    stays = ids.masked_fill(~(above & (vals == lowest)), -1).amax(dim=-1, keepdim=True)
    applies = fires & (finite.sum(dim=-1) >= 2) & (above.sum(dim=-1) >= 2)
    return vals.masked_fill(applies[:, None] & above & (ids != stays), NEG_INF)


# -- mirostat ------------------------------------------------------------------------------------
def mirostat_log2_p(scaled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log2 p [r, V] of the softmax over the whole row, weights exp(s - s_max) [r, V]),
    float64; -inf / 0 where s is -inf."""
    top = scaled.amax(dim=-1, keepdim=True).double()
    top = torch.where(top.isinf(), torch.zeros_like(top), top)
    gap = scaled.double() - top
    weights = gap.exp()
    return (gap - fixed_sum(weights).log()[:, None]) / math.log(2.0), weights


def mirostat_v2_keep(scaled: torch.Tensor, log2_p: torch.Tensor,
                     mu: torch.Tensor) -> torch.Tensor:
    """Mirostat 2.0's kept set [r, V]: the tokens whose surprise -log2 p is at most mu; when
    there are none, the most likely token (the lowest id among equals)."""
    keep = -log2_p <= mu[:, None]
    empty = ~keep.any(dim=-1)
    if bool(empty.any()):
        best = F.one_hot(scaled.argmax(dim=-1), scaled.shape[1]).bool()
        keep |= best & empty[:, None]
    return keep


def zipf_exponents(scaled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mirostat 1's inputs that do not depend on mu: (s_hat [r], the row sorted descending
    [r, V], its number of finite logits [r]). s_hat is llama.cpp's least-squares Zipf exponent
    over the best m = 100 tokens: sum t_i b_i / sum t_i^2 with t_i = log((i + 2) / (i + 1)) and
    b_i = log(p_i / p_{i+1}) = s_i - s_{i+1}, for i < min(m - 1, finite - 1)."""
    ordered = scaled.sort(dim=-1, descending=True).values
    size = (ordered > NEG_INF).sum(dim=-1)
    width = min(MIROSTAT_M, ordered.shape[1])
    best = ordered[:, :width].double()
    i = torch.arange(width - 1, device=scaled.device)
    t = torch.log((i + 2.0) / (i + 1.0)).double()
    used = i[None, :] < (size - 1)[:, None]
    b = (best[:, :-1] - best[:, 1:]).masked_fill(~used, 0.0)
    tt = (t * t)[None, :].masked_fill(~used, 0.0)
    s_hat = (t[None, :] * b).cumsum(dim=-1)[:, -1] / tt.cumsum(dim=-1)[:, -1]
    return s_hat, ordered, size


def mirostat_v1_keep(scaled: torch.Tensor, s_hat: torch.Tensor, ordered: torch.Tensor,
                     size: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """Mirostat 1's kept set [r, V]: top-k with k = ((e * 2^mu) / (1 - V^-e))^(1 / s_hat),
    e = s_hat - 1, V the vocabulary; floored, at least 1 and at most the finite logits (a
    k that is not a number, where too few tokens fit a Zipf law, keeps them all). Ties with
    the k-th value are kept (truncation.py's top-k)."""
    eps = s_hat - 1.0
    k = ((eps * torch.pow(2.0, mu)) / (1.0 - float(scaled.shape[1]) ** (-eps))) ** (1.0 / s_hat)
    k = torch.where(k.isnan(), size.double(), k)
    k = k.clamp(min=1.0).floor().clamp(max=size.clamp(min=1).double()).long()
    kth = ordered.gather(1, (k - 1)[:, None])
    return scaled >= kth
