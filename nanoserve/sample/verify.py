"""Which draft tokens a step accepts: a draft is kept if and only if it equals the target's own
draw at its position (each row drawn by the full pipeline with its own seeded key), and the
first mismatch is replaced by that draw. So the committed tokens are exactly the ones the
one-token-per-step run would have drawn, greedy or seeded.
"""

from __future__ import annotations

import numpy as np


def count_accepted(sampled_token_ids: list[int], draft_token_ids: np.ndarray,
                   num_sample_rows: np.ndarray) -> list[int]:
    """Tokens each request commits: 1 + its drafts accepted before the first mismatch.

    `sampled_token_ids` [S] and `draft_token_ids` [S] (-1 on each request's last row) are the
    step's rows; `num_sample_rows` [num_requests] says how many rows each request owns."""
    if len(num_sample_rows) == len(sampled_token_ids):  # no drafts this step
        return [1] * len(sampled_token_ids)
    counts: list[int] = []
    row = 0
    for num_rows in num_sample_rows.tolist():
        taken = 1
        while taken < num_rows and sampled_token_ids[row + taken - 1] == int(
                draft_token_ids[row + taken - 1]):
            taken += 1
        counts.append(taken)
        row += num_rows
    return counts
