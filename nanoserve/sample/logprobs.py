"""Log-probabilities of chosen tokens: their value, their rank, and the top-N alternatives."""

from __future__ import annotations

import torch

from nanoserve.protocol import TokenLogprobs
from nanoserve.sample.topk import chunked_topk


def gather_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor,
                    num_top: list[int]) -> list[TokenLogprobs]:
    """logprobs: [r, V] (log-softmaxed), chosen: [r] token ids, num_top: N per row."""
    chosen_lp = logprobs.gather(1, chosen[:, None])  # [r, 1]
    ranks = (logprobs > chosen_lp).sum(dim=-1) + 1
    width = max(num_top, default=0)
    if width:
        top_lp, top_ids = chunked_topk(logprobs, width)
        top_lp_rows, top_id_rows = top_lp.tolist(), top_ids.tolist()
    else:
        top_lp_rows = top_id_rows = [[] for _ in num_top]
    return [
        TokenLogprobs(token, lp, rank, ids[:n], lps[:n])
        for token, lp, rank, ids, lps, n in zip(
            chosen.tolist(), chosen_lp.squeeze(1).tolist(), ranks.tolist(), top_id_rows,
            top_lp_rows, num_top, strict=True)
    ]


def prompt_logprobs(logits: torch.Tensor, next_token_ids: list[int],
                    num_top: int) -> list[TokenLogprobs]:
    """Raw logprobs of each prompt token given the ones before it.

    logits: [n, V] at positions whose next tokens are `next_token_ids` (n of them).
    """
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = torch.tensor(next_token_ids, device=logits.device)
    return gather_logprobs(logprobs, chosen, [num_top] * len(next_token_ids))
