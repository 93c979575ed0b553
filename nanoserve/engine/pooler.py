"""Pooling on the worker: a step's final normed hidden states into prefill-only requests'
vectors (embeddings, or the logits a judging template is scored by).

Each request's vector is made from its own rows only, with per-row operations, so it does not
depend on what else is in the batch (a GEMM over more rows may round its last bits
differently; the tests hold a vector alone and in a batch of 8 to cosine >= 1 - 1e-5).

- "last": the hidden state of the prompt's last token (what decoder embedders such as
  Qwen3-Embedding and e5-mistral use; the model attends causally, so only the last token has
  read the whole input). It needs only the chunk that ends the prompt.
- "mean": the average over every prompt position. A long prompt is prefilled in chunks over
  several steps, so the worker keeps a float32 running sum per slot, started by the chunk at
  position 0 and read by the last one; a request that takes it gets no prefix-cache hits.
- task "score": the LM head's logits at the last position, for the asked token ids only.

Vectors are truncated to `dimensions` if asked, then L2-normalized (float32) when asked.
Every finished vector of the step comes to the host in one copy.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from nanoserve.protocol import PoolingRows

_NORM_EPS = 1e-12  # F.normalize's: a zero vector stays zero instead of becoming NaN


class Pooler:
    """Per-slot running sums of mean pooling, and the step's finished vectors."""

    def __init__(self) -> None:
        self.sums: dict[int, torch.Tensor] = {}  # by slot: [hidden] float32, mean pooling

    def release(self, slot: int) -> None:
        self.sums.pop(slot, None)

    def pool(self, hidden: torch.Tensor, entries: list[PoolingRows],
             compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> list[np.ndarray]:
        """hidden [T, hidden_size]: the step's final normed states. One float32 vector per
        entry that `is_last`, in order."""
        if not entries:
            return []
        # 1) means: each chunk's rows added to its slot's running sum
        for e in entries:
            if e.method == "mean":
                chunk = hidden[e.first_row : e.first_row + e.num_rows].float().sum(0)
                self.sums[e.slot] = chunk if e.is_first else self.sums[e.slot] + chunk
        done = [e for e in entries if e.is_last]
        if not done:
            return []
        # 2) the finished requests' raw vectors: one row each, copied to the host at once
        last_rows = torch.tensor([e.first_row + e.num_rows - 1 for e in done],
                                 device=hidden.device)
        embeds = [e for e in done if e.params.task == "embed"]
        scores = [i for i, e in enumerate(done) if e.params.task == "score"]
        vectors = hidden.index_select(0, last_rows).float()  # [D, hidden]
        if any(e.method == "mean" for e in embeds):
            vectors = torch.stack([self.sums.pop(e.slot) / e.num_prompt_tokens
                                   if e.method == "mean" else vectors[i]
                                   for i, e in enumerate(done)])
        logits = self._score_logits(hidden, last_rows, done, scores, compute_logits)
        vectors_cpu = vectors.cpu().numpy()
        # 3) per request: truncate, normalize
        out = []
        for i, e in enumerate(done):
            if e.params.task == "score":
                out.append(logits.pop(0))
                continue
            vector = vectors_cpu[i][: e.params.dimensions]
            if e.params.normalize:
                vector = vector / max(float(np.linalg.norm(vector)), _NORM_EPS)
            out.append(np.ascontiguousarray(vector, dtype=np.float32))
        return out

    @staticmethod
    def _score_logits(hidden: torch.Tensor, last_rows: torch.Tensor, done: list[PoolingRows],
                      scores: list[int], compute_logits: Callable[[torch.Tensor], torch.Tensor]
                      ) -> list[np.ndarray]:
        """The asked tokens' logits at the last position of each "score" entry, in order."""
        if not scores:
            return []
        logits = compute_logits(hidden.index_select(0, last_rows[scores]))  # [N, vocab]
        ids = [done[i].params.logit_token_ids or [] for i in scores]
        rows = torch.tensor([j for j, row_ids in enumerate(ids) for _ in row_ids],
                            device=logits.device)
        cols = torch.tensor([t for row_ids in ids for t in row_ids], device=logits.device)
        flat = logits[rows, cols].float().cpu().numpy()
        bounds = np.cumsum([0, *map(len, ids)])
        return [flat[bounds[j] : bounds[j + 1]].copy() for j in range(len(ids))]
