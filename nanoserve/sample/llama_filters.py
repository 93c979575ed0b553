"""llama.cpp's cuts as batched tensor functions: top-n-sigma, typical-p, top-p over the
survivors, XTC, and mirostat's kept sets. llama_draw.py says what each one keeps and in which
order they run; this file computes them.

Every function takes temperature-scaled logits and returns them with the cut tokens at -inf
(or the kept mask). A row's result depends only on that row: sums are float64, either
sequential along a row's candidates (`cumsum`, whose trailing -inf entries add exact zeros, so
the width the candidates came in does not matter) or `fixed_sum`'s blocks over a whole row.
Shortcuts (typical_whole, mirostat_v2_keep's widening, top_n_sigma's float32 compare) do the
same operations on the same values, on fewer tokens: the results are bit for bit the same.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from nanoserve.sample.truncation import NEG_INF, fixed_sum

MIROSTAT_M = 100  # llama.cpp's m: the best tokens mirostat 1 fits its Zipf exponent on
TYPICAL_WIDTHS = (64, 1024, 8192)  # typical_whole's candidates, then the whole vocabulary


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
    count = finite.sum(dim=-1)
    holes = bool((count < scaled.shape[1]).any())  # else the masks below change nothing
    count = count.clamp(min=1).double()
    x = scaled.double()
    if holes:
        x.masked_fill_(~finite, 0.0)
    mean = fixed_sum(x) / count
    dev = x.sub_(mean[:, None])  # x is not needed after this: in place
    if holes:
        dev.masked_fill_(~finite, 0.0)
    std = (fixed_sum(dev.mul_(dev)) / count).sqrt()
    floor = scaled.amax(dim=-1).double() - n * std
    # s < floor (float64) <=> s < the least float32 >= floor: one float32 compare
    least = floor.float()
    least = torch.where(least.double() < floor, torch.nextafter(
        least, torch.full_like(least, math.inf)), least)
    cut = (scaled < least[:, None]) & (n > 0)[:, None]
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


def sorted_descending(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each row of x [r, V] (float32) sorted descending, values only, as `dtype` (equal values
    are interchangeable, so any tie order gives the same sums). numpy's vectorized sort on the
    CPU (several times torch's)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and dtype == torch.float64:
        ascending = np.sort(x.detach().contiguous().numpy(), axis=-1)
        return torch.from_numpy(np.ascontiguousarray(ascending[:, ::-1], dtype=np.float64))
    return x.sort(dim=-1, descending=True).values.to(dtype)


def typical_whole(scaled: torch.Tensor, typical_p: torch.Tensor,
                  widths: tuple[int, ...] = TYPICAL_WIDTHS) -> tuple[torch.Tensor, torch.Tensor]:
    """`typical` on rows whose candidates are the whole row (nothing cut them before typical-p
    but -inf entries), typical_p < 1: the same kept set, with no sort of the row's tokens.
    scaled [r, V] float32 -> candidates (ids, vals) [r, K], sorted by value descending (-inf
    where cut or padding, id 0), as typical's kept set on truncate's whole-row candidates.

    The sums are typical's: sequential in descending value order (a sort of the values only),
    so H, p and the shift of every token are bit for bit typical's. Typical order is a sort by
    (shift, id), and the kept set is a prefix of it, read through the running mass. So: take
    the `width` smallest shifts (then wider, as truncate widens), b the largest of them; the
    tokens with shift < b are exactly the first ones in typical order. If their mass exceeds
    typical_p, the first token after them is cut, and so is every later one: exact. Else widen;
    at the whole row (or every finite token inside) it is typical itself. Rows with few finite
    tokens (after top-n-sigma) first narrow to the best `width` of them, in id order."""
    finite = scaled > NEG_INF
    count = finite.sum(dim=-1)
    rows, vocab = scaled.shape
    most = int(count.max()) if rows else 0
    narrow = next((w for w in widths if most <= w < vocab), None)
    if narrow is not None:  # every finite token is among the best `narrow`: work on those,
        ids = scaled.topk(narrow, dim=-1).indices.sort(dim=-1).values  # in id order (ties)
        some_ids, vals = typical_whole(scaled.gather(1, ids), typical_p, widths)
        return ids.gather(1, some_ids).masked_fill(vals == NEG_INF, 0), vals
    top = scaled.amax(dim=-1, keepdim=True)
    top = torch.where(top.isinf(), torch.zeros_like(top), top).double()
    holes = bool((count < vocab).any())  # some -inf: the masks below (else no change)
    # _masses and typical's entropy on truncate's whole-row candidates (descending order),
    # the same operations on the same values, in place where a value is not read again
    gap_o = sorted_descending(scaled, torch.float64).to(scaled.device).sub_(top)
    cut_o = gap_o == NEG_INF if holes else None
    weights_o = gap_o.exp()
    sums = torch.empty_like(weights_o)  # one buffer for both running sums (no new pages)
    total = torch.cumsum(weights_o, dim=-1, out=sums)[:, -1].clone()
    log_total = total.log()[:, None]
    p_o = weights_o.div_(total[:, None])
    terms = gap_o.sub_(log_total).mul_(p_o).neg_()  # -(p * log p)
    if cut_o is not None:
        terms.masked_fill_(cut_o, 0.0)
    entropy = torch.cumsum(terms, dim=-1, out=sums)[:, -1].clone()
    # per token, in id order: |-log p - H|, -log p = -(gap - log_total) = log_total - gap
    shifted = weights_o.copy_(scaled).sub_(top).neg_().add_(log_total)
    shifted = shifted.sub_(entropy[:, None]).abs_()
    if holes:
        shifted.masked_fill_(~finite, math.inf)
    ids = torch.zeros(rows, 1, dtype=torch.int64, device=scaled.device)
    vals = torch.full((rows, 1), NEG_INF, dtype=scaled.dtype, device=scaled.device)
    redo = torch.arange(rows, device=scaled.device)
    steps = [w for w in widths if w < vocab] + [vocab]
    for width in steps:
        inputs = [scaled, shifted, top, total, count, typical_p]
        if len(redo) < rows:  # only the rows still uncovered
            inputs = [x.index_select(0, redo) for x in inputs]
        some_ids, some_vals, covered = _typical_within(
            inputs[0], inputs[1], inputs[2], inputs[3], inputs[4], inputs[5], width)
        done = redo[covered]
        pad = some_ids.shape[1] - ids.shape[1]
        if pad > 0:
            ids, vals = F.pad(ids, (0, pad)), F.pad(vals, (0, pad), value=NEG_INF)
        ids[done, : some_ids.shape[1]] = some_ids[covered]
        vals[done, : some_ids.shape[1]] = some_vals[covered]
        redo = redo[~covered]
        if not len(redo):
            break
    return ids, vals


def _typical_within(scaled: torch.Tensor, shifted: torch.Tensor, top: torch.Tensor,
                    total: torch.Tensor, count: torch.Tensor, typical_p: torch.Tensor, width: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """typical_whole with the `width` smallest shifts: (ids, vals) [r, K] of the kept tokens
    (by value descending), and per row whether that was enough."""
    small, cand = shifted.topk(width, dim=-1, largest=False)  # [r, W]
    bound = small.amax(dim=-1, keepdim=True)
    whole = count <= width  # every finite token is a candidate
    first = (small < bound) | (whole[:, None] & (small < math.inf))  # a prefix of the order
    cand = cand.masked_fill(~first, scaled.shape[1])  # outsiders after every candidate
    by_id = cand.sort(dim=-1).values
    shift = shifted.gather(1, by_id.clamp(max=scaled.shape[1] - 1)).masked_fill(
        by_id == scaled.shape[1], math.inf)
    order = by_id.gather(1, shift.sort(dim=-1, stable=True).indices)  # (shift, id)
    inside = order < scaled.shape[1]
    safe = order.clamp(max=scaled.shape[1] - 1)
    p = (scaled.gather(1, safe).double() - top).exp() / total[:, None]  # typical's p, there
    mass = p.masked_fill(~inside, 0.0).cumsum(dim=-1)
    before = F.pad(mass[:, :-1], (1, 0))
    keep = inside & (before <= typical_p.double()[:, None])
    covered = whole | (mass[:, -1] > typical_p.double())
    kept = int(keep.sum(dim=-1).max()) if keep.numel() else 0
    vals = scaled.gather(1, safe).masked_fill(~keep, NEG_INF)
    vals, at = vals.sort(dim=-1, descending=True)
    kept = max(kept, 1)
    ids = safe.gather(1, at[:, :kept]).masked_fill(vals[:, :kept] == NEG_INF, 0)
    return ids, vals[:, :kept], covered


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
def mirostat_masses(scaled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(top [r, 1]: s_max, 0 for an all -inf row; weights exp(s - s_max) [r, V]; log Z [r],
    Z their fixed_sum), float64: log2 p = (s - top - log Z) / ln 2 (`mirostat_log2_p`)."""
    top = scaled.amax(dim=-1, keepdim=True).double()
    top = torch.where(top.isinf(), torch.zeros_like(top), top)
    weights = scaled.double().sub_(top).exp_()
    return top, weights, fixed_sum(weights).log()


def mirostat_log2_p(scaled: torch.Tensor, top: torch.Tensor, log_z: torch.Tensor
                    ) -> torch.Tensor:
    """log2 p of the softmax over the whole row, float64, for scaled [r, K] (any of the row's
    tokens) with the row's `mirostat_masses`; -inf where s is -inf."""
    return (scaled.double() - top - log_z[:, None]) / math.log(2.0)


def mirostat_v2_keep(scaled: torch.Tensor, top: torch.Tensor, log_z: torch.Tensor,
                     mu: torch.Tensor, widths: tuple[int, ...] = TYPICAL_WIDTHS
                     ) -> torch.Tensor:
    """Mirostat 2.0's kept set [r, V]: the tokens whose surprise -log2 p is at most mu; when
    there are none, the most likely token (the lowest id among equals).

    The surprise falls as s grows (every rounding step is monotone), so the kept set is
    {s >= t}, t the least kept value: found on the `width` best tokens (as truncate widens);
    when the last of them is not kept, neither is any token outside them: exact."""
    rows, vocab = scaled.shape
    least = torch.full((rows,), math.inf, dtype=scaled.dtype, device=scaled.device)
    redo = torch.arange(rows, device=scaled.device)
    for width in [w for w in widths if w < vocab] + [vocab]:
        rest = scaled if len(redo) == rows else scaled.index_select(0, redo)
        vals = rest.topk(width, dim=-1).values  # descending
        kept = -mirostat_log2_p(vals, top[redo], log_z[redo]) <= mu[redo][:, None]
        least[redo] = vals.masked_fill(~kept, math.inf).amin(dim=-1)
        redo = redo[kept[:, -1]] if width < vocab else redo[:0]
        if not len(redo):
            break
    keep = scaled >= least[:, None]
    empty = least == math.inf
    if bool(empty.any()):
        best = F.one_hot(scaled.argmax(dim=-1), vocab).bool()
        keep |= best & empty[:, None]
    return keep


def zipf_exponents(scaled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mirostat 1's inputs that do not depend on mu: (s_hat [r], the row's number of finite
    logits [r]). s_hat is llama.cpp's least-squares Zipf exponent over the best m = 100
    tokens: sum t_i b_i / sum t_i^2 with t_i = log((i + 2) / (i + 1)) and
    b_i = log(p_i / p_{i+1}) = s_i - s_{i+1}, for i < min(m - 1, finite - 1)."""
    size = (scaled > NEG_INF).sum(dim=-1)
    width = min(MIROSTAT_M, scaled.shape[1])
    best = scaled.topk(width, dim=-1).values.double()  # the sorted row's first m values
    i = torch.arange(width - 1, device=scaled.device)
    t = torch.log((i + 2.0) / (i + 1.0)).double()
    used = i[None, :] < (size - 1)[:, None]
    b = (best[:, :-1] - best[:, 1:]).masked_fill(~used, 0.0)
    tt = (t * t)[None, :].masked_fill(~used, 0.0)
    s_hat = (t[None, :] * b).cumsum(dim=-1)[:, -1] / tt.cumsum(dim=-1)[:, -1]
    return s_hat, size


def mirostat_v1_keep(scaled: torch.Tensor, s_hat: torch.Tensor, size: torch.Tensor,
                     mu: torch.Tensor) -> torch.Tensor:
    """Mirostat 1's kept set [r, V]: top-k with k = ((e * 2^mu) / (1 - V^-e))^(1 / s_hat),
    e = s_hat - 1, V the vocabulary; floored, at least 1 and at most the finite logits (a
    k that is not a number, where too few tokens fit a Zipf law, keeps them all). Ties with
    the k-th value are kept (truncation.py's top-k)."""
    eps = s_hat - 1.0
    k = ((eps * torch.pow(2.0, mu)) / (1.0 - float(scaled.shape[1]) ** (-eps))) ** (1.0 / s_hat)
    k = torch.where(k.isnan(), size.double(), k)
    k = k.clamp(min=1.0).floor().clamp(max=size.clamp(min=1).double()).long()
    best = scaled.topk(int(k.max()), dim=-1).values  # the sorted row's first k values
    kth = best.gather(1, (k - 1)[:, None])
    return scaled >= kth
