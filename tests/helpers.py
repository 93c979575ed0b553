"""Helpers the tests share: the transformers reference and small engine drivers."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nanoserve.bench.throughput import load_transformers
from nanoserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from nanoserve.engine.build import build_engine_core
from nanoserve.engine.core import EngineCore
from nanoserve.model.gguf_file import GGUFPart
from nanoserve.sampling_params import SamplingParams


def hf_model(path: Path | str) -> Any:
    """The transformers reference, float32, for a directory or a .gguf file (read from a copy
    without its vocabulary: see `gguf_without_vocabulary`)."""
    path = Path(path)
    if path.suffix != ".gguf":
        return load_transformers(path)
    with tempfile.TemporaryDirectory(prefix="nanoserve-hf-") as directory:
        return load_transformers(gguf_without_vocabulary(path, Path(directory) / path.name))


# transformers reads a GGUF file with gguf's reader, which parses every item of these arrays in
# Python, twice a load: 40 s of Gemma 3 270M's 48 (262,144 tokens). A model needs only their count
VOCABULARY_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores",
                     "tokenizer.ggml.token_type", "tokenizer.ggml.merges")


def gguf_without_vocabulary(path: Path, dest: Path) -> Path:
    """A copy of the one-file GGUF `path` at `dest`: the same tensors (their bytes as they are)
    and metadata, less the vocabulary's arrays, plus `{arch}.vocab_size` (which transformers
    otherwise takes from the token list) where the file lacks it."""
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

    source = GGUFPart(path)
    arch = source.metadata["general.architecture"]
    writer = GGUFWriter(dest, arch)
    for key, value in source.metadata.items():
        if key in VOCABULARY_ARRAYS or key == "general.architecture":
            continue
        type_id, item_type = source.metadata_types[key]
        writer.add_key_value(key, value, GGUFValueType(type_id),
                             None if item_type is None else GGUFValueType(item_type))
    if f"{arch}.vocab_size" not in source.metadata:
        writer.add_uint32(f"{arch}.vocab_size", len(source.metadata["tokenizer.ggml.tokens"]))
    for tensor in source.tensors.values():
        ggml_type = GGMLQuantizationType(tensor.ggml_type)
        if ggml_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            dtype = np.float32 if ggml_type == GGMLQuantizationType.F32 else np.float16
            writer.add_tensor(tensor.name, tensor.data.view(dtype).reshape(tensor.shape))
        else:
            writer.add_tensor(tensor.name, tensor.data.reshape(*tensor.shape[:-1], -1),
                              raw_dtype=ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dest


@torch.inference_mode()
def hf_greedy(model: Any, prompt_ids: list[int], num_new: int) -> list[int]:
    """Greedy decoding with transformers' own KV cache, EOS ignored: the reference tokens."""
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    for _ in range(num_new - 1):
        out = model(torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def make_engine(model: str | Path | None, *, num_blocks: int | None = None,
                max_num_batched_tokens: int = 2048,
                max_num_seqs: int = SchedulerConfig.max_num_seqs,
                max_model_len: int | None = None, enable_prefix_caching: bool = True,
                block_size: int = CacheConfig.block_size,
                quantization: str = "none", kv_cache_dtype: str = "auto",
                mmproj: Path | None = None, scheduling_policy: str = "fcfs") -> EngineCore:
    """An engine on the CPU in float32; exact weights ("none") unless asked otherwise, since
    most tests compare it with transformers."""
    return build_engine_core(EngineConfig(
        model=ModelConfig(model=None if model is None else str(model),
                          mmproj=None if mmproj is None else str(mmproj), device="cpu",
                          dtype="float32", max_model_len=max_model_len,
                          quantization=quantization),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                          kv_cache_memory_bytes=64 << 20, kv_cache_dtype=kv_cache_dtype,
                          enable_prefix_caching=enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens,
                                  scheduling_policy=scheduling_policy),
    ))


def run_to_completion(engine: EngineCore, prompts: dict[str, list[int]],
                      params: SamplingParams) -> dict[str, list[int]]:
    """Add every prompt, step until done; the output token ids per request id."""
    for request_id, ids in prompts.items():
        engine.add_request(request_id, ids, params)
    outputs: dict[str, list[int]] = {request_id: [] for request_id in prompts}
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id in outputs:  # requests added beforehand are not collected
                outputs[out.request_id].extend(out.new_token_ids)
    return outputs


def seeded_logprob_run(engine: EngineCore, prompts: dict[str, list[int]]) -> dict[str, Any]:
    """Each prompt's outputs as (new token ids, new logprobs) per step, sampled with a seed,
    top-p and 3 logprobs: what a bit-for-bit comparison across chunks and batches compares."""
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=12,
                            ignore_eos=True, logprobs=3)
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
    got: dict[str, list[Any]] = {rid: [] for rid in prompts}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].append((out.new_token_ids, out.new_logprobs))
    return got


def run_one_request(engine: EngineCore, prompt: list[int],
                    params: SamplingParams) -> tuple[list[Any], int]:
    """(each step's new token ids and logprobs, the tokens the prefix cache gave) of one
    request: what a prefix-cache or disk-tier test compares with a cold engine's."""
    engine.add_request("r", prompt, params)
    got, cached = [], 0
    while engine.has_unfinished():
        for out in engine.step():
            got.append((out.new_token_ids, out.new_logprobs))
            cached = out.num_cached_tokens
    return got, cached
