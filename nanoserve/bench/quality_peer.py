"""`nanoserve bench quality --vs-llama-cpp`: perplexity counted the way llama.cpp's
`llama-perplexity` counts it, beside that tool's own figure on the same GGUF file and text.

llama-perplexity tokenizes the text with a BOS in front, cuts it into chunks of `n_ctx` tokens
(the first token of each chunk replaced by BOS), and scores only the second half of each chunk:
the tokens at positions n_ctx/2 + 1 .. n_ctx - 1, each given the tokens before it in its chunk.
`chunked_perplexity` sends the same chunks through the engine as requests with prompt logprobs;
the tool is built from the same llama.cpp source tree as the llama-server peer
(llama_server.py), as its `llama-perplexity` target.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

from nanoserve.bench.llama_server import binary_path, default_cache_dir, ensure_llama_server
from nanoserve.engine.core import EngineCore
from nanoserve.sampling_params import SamplingParams

_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+)")


def llama_chunks(token_ids: list[int], n_ctx: int, bos_id: int | None) -> list[list[int]]:
    """The text's whole chunks of n_ctx tokens, each opened by BOS where the model has one."""
    chunks = [token_ids[i : i + n_ctx] for i in range(0, len(token_ids) - n_ctx + 1, n_ctx)]
    return [[bos_id, *chunk[1:]] if bos_id is not None else chunk for chunk in chunks]


def chunked_perplexity(engine: EngineCore, chunks: list[list[int]]) -> tuple[float, int]:
    """exp(mean NLL) over every chunk's second half, and the number of tokens scored. Each
    chunk is one request; prompt logprob k is that of prompt token k + 1."""
    params = SamplingParams(prompt_logprobs=0, max_tokens=1)
    for i, chunk in enumerate(chunks):
        engine.add_request(f"ppl-{i}", chunk, params)
    nll, count = 0.0, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.prompt_logprobs is None:
                continue
            # entry k is prompt token k + 1's: tokens n_ctx/2 + 1 .. n_ctx - 1 are entries
            # n_ctx/2 .. n_ctx - 2 (llama.cpp's logits at n_ctx/2 .. n_ctx - 2)
            scored = out.prompt_logprobs[(len(out.prompt_logprobs) + 1) // 2 :]
            nll -= sum(lp.logprob for lp in scored)
            count += len(scored)
    return math.exp(nll / count), count


def perplexity_binary(cache_dir: Path | None = None) -> Path:
    """llama.cpp's `llama-perplexity`, built beside llama-server on first use."""
    cache_dir = cache_dir or default_cache_dir()
    tool = binary_path(cache_dir).with_name("llama-perplexity")
    if not tool.is_file():
        ensure_llama_server(cache_dir)  # the source tree, configured and built
        print("building llama.cpp's llama-perplexity (a few minutes)", file=sys.stderr)
        subprocess.run(["cmake", "--build", str(tool.parents[1]), "--target",
                        "llama-perplexity", "-j", "2"], check=True, stdout=sys.stderr)
    return tool


def llama_cpp_perplexity(model: Path, text: Path, n_ctx: int, threads: int) -> float:
    """llama-perplexity's final estimate on the file and text (its default batch)."""
    result = subprocess.run([str(perplexity_binary()), "-m", str(model), "-f", str(text),
                             "-c", str(n_ctx), "-t", str(threads)],
                            capture_output=True, text=True, check=False)
    found = _FINAL.search(result.stdout + result.stderr)
    if result.returncode != 0 or found is None:
        raise RuntimeError(f"llama-perplexity failed ({result.returncode}): "
                           f"{result.stderr[-2000:]}")
    return float(found.group(1))


def run_vs_llama_cpp(llm: object, mode: str, text: Path, n_ctx: int, threads: int) -> str:
    """One table row: this mode's perplexity counted as llama-perplexity counts it, and the
    tool's own on the same file (llm: an offline LLM holding a GGUF model)."""
    tokenizer, engine = llm.tokenizer, llm.engine  # type: ignore[attr-defined]
    model_path = engine.model_info.path
    if model_path.suffix != ".gguf":
        raise ValueError(f"--vs-llama-cpp needs a GGUF model file, not {model_path}")
    ids = tokenizer.encode(text.read_text(encoding="utf-8"))  # with a BOS, as llama.cpp
    ours, count = chunked_perplexity(engine, llama_chunks(ids, n_ctx, tokenizer.bos_token_id))
    theirs = llama_cpp_perplexity(model_path, text, n_ctx, threads)
    return (f"| {mode} | {ours:.4f} | {theirs:.4f} | {ours / theirs - 1:+.2%} | {count} |")
