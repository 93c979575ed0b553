"""min-p, top-k and top-p with one (partial) sort, and the draw.

Semantics, per row, on the temperature-scaled logits (vLLM's):
  1. min-p keeps tokens whose probability is at least min_p times the largest one;
  2. top-k keeps tokens whose logit is at least the k-th largest (ties kept);
  3. top-p, on the distribution renormalized over what 1-2 kept, keeps the highest-probability
     tokens while the probability mass strictly above them is below top_p.
The draw is Gumbel-max over the kept tokens with counter-based noise (noise.py).

A full sort of [rows, 49,152] costs as much as a model step on a small CPU (~2 ms a row here),
while top-p and min-p keep a handful of tokens in practice (on the default model's real logits
at temperature 0.7 and top_p 0.9: median 1, 99th percentile ~60). So the sort is partial:
`topk` of the first of `WIDTHS` (more if a row's top_k asks), and rows whose kept set might
reach past the candidates are redone with the next width, up to the whole vocabulary. The
result is exactly the full-sort result.
"""

from __future__ import annotations

import torch

from nanoserve.sample.noise import gumbel_noise
from nanoserve.sample.topk import chunked_topk

WIDTHS = (64, 1024, 8192)  # then the whole vocabulary
NEG_INF = float("-inf")


def truncate(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
             min_p: torch.Tensor, widths: tuple[int, ...] = WIDTHS,
             max_top_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidate token ids [r, K] and their logits [r, K], -inf where cut.

    scaled: [r, V] temperature-scaled logits; top_k (0 = off) [r]; top_p, min_p [r].
    `max_top_k` (the largest top_k, known on the host) saves a device sync. Deciding whether
    to widen is the one sync left: a single boolean, only in steps with truncated rows.
    """
    vocab = scaled.shape[1]
    k_needed = max_top_k if max_top_k is not None else (
        int(top_k.max()) if top_k.numel() else 0)
    steps = [w for w in widths if w > k_needed and w < vocab] + [vocab]
    # Rows with top-p alone normalize over the whole vocabulary: computed once, kept for widening
    top_p_alone = (top_p < 1.0) & (top_k <= 0) & (min_p <= 0)
    whole = (_logsumexp(scaled) if steps[0] < vocab and bool(top_p_alone.any())
             else torch.zeros_like(top_p))
    ids, vals, covered = _truncate_within(scaled, top_k, top_p, min_p, whole, steps[0])
    for width in steps[1:]:
        if bool(covered.all()):
            break
        redo = torch.nonzero(~covered).squeeze(1)  # rare: widen for those rows only
        more_ids, more_vals, more_covered = _truncate_within(
            scaled[redo], top_k[redo], top_p[redo], min_p[redo], whole[redo], width)
        pad = width - ids.shape[1]
        ids = torch.nn.functional.pad(ids, (0, pad))
        vals = torch.nn.functional.pad(vals, (0, pad), value=NEG_INF)
        ids[redo], vals[redo] = more_ids, more_vals
        covered[redo] = more_covered
    return ids, vals


def _truncate_within(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     min_p: torch.Tensor, whole: torch.Tensor, width: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Truncate using only the `width` best tokens; also say, per row, whether that was enough.
    `whole`: each row's logsumexp over the whole vocabulary (read for rows with top-p alone)."""
    vals, ids = chunked_topk(scaled, width)  # [r, K], descending
    is_full = width == scaled.shape[1]
    # 1) min-p, as a ratio to the best token (the normalizer cancels)
    ratio_ok = (vals - vals[:, :1]).exp() >= min_p[:, None]
    keep = ratio_ok & (vals > NEG_INF)
    # 2) top-k, ties at the k-th value kept
    has_k = top_k > 0
    kth = vals.gather(1, (top_k.clamp(1, width) - 1)[:, None])
    keep &= ~has_k[:, None] | (vals >= kth)
    # 3) top-p over the survivors, renormalized
    cut = has_k | (min_p > 0)  # survivors lie inside the candidates (once covered)
    survivors = vals.masked_fill(~keep, NEG_INF)
    has_p = top_p < 1.0
    if is_full:
        whole = torch.logsumexp(vals, dim=-1)
    lse = torch.where(cut, torch.logsumexp(survivors, dim=-1), whole)
    probs = (survivors - lse[:, None]).exp()
    mass = probs.cumsum(dim=-1)
    keep &= ~has_p[:, None] | ((mass - probs) < top_p[:, None])
    # 4) was `width` enough? (it always is with top-k, or when it is the whole vocabulary)
    if is_full:
        covered = torch.ones_like(has_k)
    else:
        # min-p alone decides (its survivors end inside the candidates), else top-p alone
        # (the candidates hold its mass); an untruncated row is simply redone in full
        min_p_done = ~ratio_ok[:, -1]
        top_p_done = has_p & (mass[:, -1] >= top_p)
        covered = has_k | torch.where(min_p > 0, min_p_done, top_p_done)
    return ids, vals.masked_fill(~keep, NEG_INF), covered


def _logsumexp(x: torch.Tensor) -> torch.Tensor:
    """torch.logsumexp over the last dimension, its result bit for bit, in fewer passes over
    [r, V] (it is ~40% of `truncate` on the CPU otherwise)."""
    top = x.amax(dim=-1, keepdim=True)
    top = torch.where(top.isinf(), torch.zeros_like(top), top)  # all -inf rows stay -inf
    return (x - top).exp_().sum(dim=-1).log_().add_(top.squeeze(1))


def draw_full(scaled: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Untruncated rows: Gumbel-max over the whole vocabulary. -> token ids [r]."""
    token_ids = torch.arange(scaled.shape[1], device=scaled.device)
    return (scaled + gumbel_noise(keys, token_ids)).argmax(dim=-1)


def draw_candidates(ids: torch.Tensor, vals: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Truncated rows: Gumbel-max over the kept candidates. -> token ids [r]."""
    winner = (vals + gumbel_noise(keys, ids)).argmax(dim=-1, keepdim=True)
    return ids.gather(1, winner).squeeze(1)
