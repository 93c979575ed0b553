"""min-p, top-k and top-p with one (partial) sort, and the draw: the PyTorch path.

Semantics, per row, on the temperature-scaled logits (vLLM's):
  1. min-p keeps tokens whose probability is at least min_p times the largest one, compared in
     log space: `s - s_max >= log(min_p)`, with log(min_p) computed once per request
     (`min_p_threshold`), so the test is one float subtraction and compare;
  2. top-k keeps tokens whose logit is at least the k-th largest (ties kept);
  3. top-p, on the distribution renormalized over what 1-2 kept, keeps the highest-probability
     tokens while the probability mass strictly above them is below top_p (tokens tied with
     the last kept one are kept too). The weights are exp(s - s_max) in float32, summed in
     float64 in a fixed order (sorted for the survivors of 1-2, `whole_mass` for the whole
     row), so the result does not depend on how many candidates were looked at.
So the kept set is always {tokens with s >= a cut value}. The draw is Gumbel-max over it with
counter-based noise (noise.py); equal scores go to the lowest token id.

A full sort of [rows, 49,152] costs as much as a model step on a small CPU (~2 ms a row here),
while top-p and min-p keep a handful of tokens in practice (on the default model's real logits
at temperature 0.7 and top_p 0.9: median 1, 99th percentile ~60). So the sort is partial:
`topk` of the first of `WIDTHS` (more if a row's top_k asks), and rows whose kept set might
reach past the candidates are redone with the next width, up to the whole vocabulary. The
result is exactly the full-sort result.

On the CPU the common path runs in C++ instead (fused.py); this file stays the reference it
must equal, the path for rows that ask for processed logprobs, and the path elsewhere.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from nanoserve.sample.noise import gumbel_noise
from nanoserve.sample.topk import chunked_topk

WIDTHS = (64, 1024, 8192)  # then the whole vocabulary
NEG_INF = float("-inf")


def min_p_threshold(min_p: float) -> float:
    """log(min_p), the min-p test's threshold on s - s_max (-inf: min-p off)."""
    return math.log(min_p) if min_p > 0 else NEG_INF


def truncate(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
             log_min_p: torch.Tensor, widths: tuple[int, ...] = WIDTHS,
             max_top_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate token ids [r, K] and their logits [r, K], -inf where cut.

    scaled: [r, V] temperature-scaled logits; top_k (0 = off) [r]; top_p [r]; log_min_p [r]
    (`min_p_threshold`, float32). `max_top_k` (the largest top_k, known on the host) saves a
    device sync. Deciding whether to widen is the one sync left: a single boolean, only in
    steps with truncated rows.
    """
    vocab = scaled.shape[1]
    k_needed = max_top_k if max_top_k is not None else (
        int(top_k.max()) if top_k.numel() else 0)
    steps = [w for w in widths if w > k_needed and w < vocab] + [vocab]
    # Rows with top-p alone normalize over the whole vocabulary: computed once, for any width
    top_p_alone = (top_p < 1.0) & (top_k <= 0) & (log_min_p == NEG_INF)
    whole = torch.ones_like(top_p, dtype=torch.float64)
    if bool(top_p_alone.any()):
        alone = torch.nonzero(top_p_alone).squeeze(1)
        whole[alone] = whole_mass(scaled[alone])
    ids, vals, covered = _truncate_within(scaled, top_k, top_p, log_min_p, whole, steps[0])
    for width in steps[1:]:
        if bool(covered.all()):
            break
        redo = torch.nonzero(~covered).squeeze(1)  # rare: widen for those rows only
        more_ids, more_vals, more_covered = _truncate_within(
            scaled[redo], top_k[redo], top_p[redo], log_min_p[redo], whole[redo], width)
        pad = width - ids.shape[1]
        ids = F.pad(ids, (0, pad))
        vals = F.pad(vals, (0, pad), value=NEG_INF)
        ids[redo], vals[redo] = more_ids, more_vals
        covered[redo] = more_covered
    return ids, vals


def _truncate_within(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     log_min_p: torch.Tensor, whole: torch.Tensor, width: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Truncate using only the `width` best tokens; also say, per row, whether that was enough.
    `whole`: each row's `whole_mass` (read for rows with top-p alone)."""
    vals, ids = chunked_topk(scaled, width)  # [r, K], descending
    gap = vals - vals[:, :1]  # s - s_max
    # 1) min-p, 2) top-k (ties at the k-th value kept): the survivors, a prefix of the row
    keep = (gap >= log_min_p[:, None]) & (vals > NEG_INF)
    has_k = top_k > 0
    kth = vals.gather(1, (top_k.clamp(1, width) - 1)[:, None])
    keep &= ~has_k[:, None] | (vals >= kth)
    survivors_inside = ~keep[:, -1]  # the last candidate is cut, so is everything after it
    # 3) top-p over the survivors, or over the whole vocabulary when nothing else cuts
    cut = has_k | (log_min_p > NEG_INF)
    weights = gap.exp().masked_fill(~keep, 0.0).double()
    mass = weights.cumsum(dim=-1)  # sequential: the same sums whatever the width
    total = torch.where(cut, mass[:, -1], whole)
    above = F.pad(mass[:, :-1], (1, 0)) / total[:, None]  # mass before each position
    has_p = top_p < 1.0
    within = keep & (above < top_p.double()[:, None])
    last = vals.masked_fill(~within, float("inf")).amin(dim=-1)  # the last kept value
    keep &= ~has_p[:, None] | (vals >= last[:, None])
    # 4) was `width` enough? Every finite token is a candidate, or the cut lies inside
    if width == scaled.shape[1]:
        covered = torch.ones_like(has_k)
    else:
        tail = vals[:, -1]
        top_p_inside = has_p & (mass[:, -1] / total >= top_p) & (last > tail)
        covered = (tail == NEG_INF) | torch.where(cut, survivors_inside, top_p_inside)
    return ids, vals.masked_fill(~keep, NEG_INF), covered


def whole_mass(scaled: torch.Tensor) -> torch.Tensor:
    """Sum over each row of exp(s - s_max), float64 [r]. Two sums of fixed shape (blocks of
    128, then the blocks), so a row's sum does not depend on the other rows or the thread count:
    one sum over few long rows is split across threads, in an order that depends on both."""
    top = scaled.amax(dim=-1, keepdim=True)
    top = torch.where(top.isinf(), torch.zeros_like(top), top)  # all -inf rows stay finite
    return fixed_sum((scaled - top).exp_().double())


def fixed_sum(x: torch.Tensor) -> torch.Tensor:
    """Each row's sum of x [r, V] (float64) in a fixed order: blocks of 128, then the blocks,
    whatever the other rows or the thread count (`whole_mass`; llama_filters.py's sums)."""
    if x.shape[1] % 128:
        x = F.pad(x, (0, -x.shape[1] % 128))  # zeros add nothing
    return x.view(x.shape[0], -1, 128).sum(dim=-1).sum(dim=-1)


def draw_full(scaled: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Untruncated rows: Gumbel-max over the whole vocabulary. -> token ids [r]."""
    token_ids = torch.arange(scaled.shape[1], device=scaled.device)
    return (scaled + gumbel_noise(keys, token_ids)).argmax(dim=-1)  # first max: lowest id


def draw_candidates(ids: torch.Tensor, vals: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Truncated rows: Gumbel-max over the kept candidates (equal scores: the lowest token id,
    whatever order the candidates came in). -> token ids [r]."""
    scores = vals + gumbel_noise(keys, ids)
    best = scores.amax(dim=-1, keepdim=True)
    return ids.masked_fill(scores != best, torch.iinfo(ids.dtype).max).amin(dim=-1)
