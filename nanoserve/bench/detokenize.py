"""`nanoserve bench detokenize`: per-token cost of incremental detokenization, beside a naive
re-decode of the whole output at every token, at several output lengths.

The incremental cost should stay flat as the output grows; the naive one grows with it.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from nanoserve.output.detokenizer import IncrementalDetokenizer, _OffsetStream

TEXT = ("Streaming text is where servers get the details wrong: a character split across "
        "tokens, an emoji 🦜 made of four bytes, 中文 in three, a stop string that arrives over "
        "several tokens. def f(x):\n    return x * 2  # and some code\n") * 200


def _per_token_us(run: Any, token_ids: list[int], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run(token_ids)
        best = min(best, time.perf_counter() - start)
    return best / len(token_ids) * 1e6


def run_detokenize_bench(args: argparse.Namespace) -> int:
    from nanoserve.model.gguf_file import GGUFFile
    from nanoserve.model.sources.fetch import local_model
    from nanoserve.model.tokenizer import load_tokenizer_from_dir, load_tokenizer_from_gguf

    path = local_model(args.model)
    tokenizer = load_tokenizer_from_dir(path) if path.is_dir() else \
        load_tokenizer_from_gguf(GGUFFile(path))
    prompt = tokenizer.encode("Tell me about streaming.", add_special_tokens=False)
    all_ids = tokenizer.encode(TEXT, add_special_tokens=False)

    def incremental(ids: list[int]) -> None:
        detok = IncrementalDetokenizer(tokenizer, prompt)
        for token in ids:
            detok.update([token])

    def offsets(ids: list[int]) -> None:
        stream = _OffsetStream(tokenizer, prompt, True)
        for token in ids:
            stream.step(token)

    def naive(ids: list[int]) -> None:
        for end in range(1, len(ids) + 1):
            tokenizer.decode(ids[:end], skip_special_tokens=True)

    print("µs per token (best of several runs)\n")
    print(f"{'output tokens':>14} {'DecodeStream':>13} {'offsets':>9} {'naive re-decode':>16}"
          f" {'naive / ours':>13}")
    for length in (int(n) for n in args.lengths.split(",")):
        ids = all_ids[:length]
        repeats = max(1, 2000 // length)
        ours = _per_token_us(incremental, ids, repeats)
        slow = _per_token_us(offsets, ids, repeats)
        full = _per_token_us(naive, ids, max(1, repeats // 4))
        print(f"{length:>14} {ours:13.1f} {slow:9.1f} {full:16.1f} {full / ours:12.1f}x")
    return 0
