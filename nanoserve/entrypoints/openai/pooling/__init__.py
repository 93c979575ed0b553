"""Prefill-only endpoints beside generation: /v1/embeddings, /v1/rerank (and /rerank), /score."""
