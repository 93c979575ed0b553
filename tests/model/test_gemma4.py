"""Gemma 4 computes what transformers computes: tiny random checkpoints of each shape of the
family (gemma4_checkpoints.py: E2B-like with per-layer embeddings, KV sharing and a double-wide
MLP; 26B-A4B-like with K = V global layers and the MoE block; 31B-like dense with K = V), every
norm, layer scalar and router scale away from 1, equal transformers in prefill logits and in
greedy tokens alone, batched, chunked and preempted, with prompts far past the 4-token window;
config.json in transformers', the hub's and the multimodal spelling reads the same; as GGUF
files (Q8_0 and Q4_0, llama.cpp's layout) the int8 kernels give seeded outputs with logprobs
bit for bit across chunks and batches; the cache's blocks for a 16k context are counted, the
KV-shared layers owning none; and a prefix hit, in RAM or from the disk tier, answers as a cold
engine."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from gemma4_checkpoints import SPELLINGS, WRITERS
from gemma4_gguf import write_gemma4_gguf
from helpers import hf_model, make_engine, run_one_request, seeded_logprob_run
from test_equivalence import assert_logits_match, assert_tokens_match

from nanoserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from nanoserve.engine.build import build_engine_core
from nanoserve.engine.core import EngineCore
from nanoserve.engine.model_runner import kv_bytes_per_block
from nanoserve.model.arch import ArchConfig
from nanoserve.model.kv_groups import kv_layer_groups
from nanoserve.sampling_params import SamplingParams

VOCAB = 49152
KINDS = tuple(WRITERS)


@pytest.fixture(scope="module")
def gemma4_dir(tmp_path_factory: pytest.TempPathFactory, default_tokenizer: Any) -> Any:
    made: dict[tuple[Any, ...], Path] = {}

    def make(kind: str, spelling: str = "transformers", **overrides: Any) -> Path:
        key = (kind, spelling, *sorted(overrides.items()))
        if key not in made:
            path = tmp_path_factory.mktemp(f"gemma4-{kind}-{spelling}")
            made[key] = WRITERS[kind](path, default_tokenizer, spelling=spelling, **overrides)
        return made[key]

    return make


@pytest.mark.parametrize("kind", KINDS)
def test_every_spelling_reads_the_same_shape(kind: str, gemma4_dir: Any) -> None:
    archs = [ArchConfig.from_hf_config(json.loads((gemma4_dir(kind, s) / "config.json")
                                                  .read_text())) for s in SPELLINGS]
    assert archs[0].family == "gemma4" and archs[0].gemma4 is not None
    assert all(a == archs[0] for a in archs[1:])
    layers = archs[0].gemma4
    assert max(layers.head_dims) == 32 and min(layers.head_dims) == 16
    if kind == "e2b":
        assert layers.kv_sources == (0, 1, 2, 1, 1, 2) and layers.per_layer_input_size == 8
        assert layers.intermediate_sizes == (128, 128, 128, 256, 256, 256)
    if kind == "moe":
        assert layers.k_eq_v == (False, False, True, False, False, True)
        assert layers.kv_heads == (2, 2, 1, 2, 2, 1) and layers.num_experts == 4


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_logits_and_greedy_tokens_equal_transformers(kind: str,
                                                             gemma4_dir: Any) -> None:
    path = gemma4_dir(kind)
    reference = hf_model(path)
    assert_logits_match(make_engine(path), reference,
                        [[5, 17, 300, 4000] * k for k in (1, 9, 40)])
    # (the 31B-like's six KV groups, five windowed, each hold a window's worth per request:
    # 48 blocks still force preemption and hold the 512-token context)
    # (8 new tokens, as the default model's test: they cross block boundaries and read
    # decode-written entries; the suite's time is the bound)
    assert_tokens_match(str(path), reference, VOCAB, num_new=8,
                        num_blocks=48 if kind == "dense" else 36)


def test_the_multimodal_spelling_runs_the_same_text_model(gemma4_dir: Any) -> None:
    reference = hf_model(gemma4_dir("e2b"))
    assert_logits_match(make_engine(gemma4_dir("e2b", "multimodal")), reference,
                        [[5, 17, 300, 4000] * 9])


@pytest.mark.parametrize(("kind", "qtype"), [("e2b", gguf.GGMLQuantizationType.Q8_0),
                                             ("e2b", gguf.GGMLQuantizationType.Q4_0),
                                             ("moe", gguf.GGMLQuantizationType.Q8_0)])
def test_gguf_seeded_outputs_and_logprobs_equal_across_chunks_and_batches(
        kind: str, qtype: gguf.GGMLQuantizationType, gemma4_dir: Any, tmp_path: Path) -> None:
    """llama.cpp's layout through the int8 kernels (the fused op table): bit for bit alone,
    batched and in chunks of 5 and 512 tokens. (Per-layer inputs 32 wide: a projection
    of 8 columns is no whole Q8_0 block, stored F16 and multiplied in float32, whose bits may
    depend on the batch; the real E2B's are 256 wide.)"""
    checkpoint = (gemma4_dir(kind, hidden_size_per_layer_input=32) if kind == "e2b"
                  else gemma4_dir(kind))
    path = write_gemma4_gguf(checkpoint, tmp_path / f"{kind}.gguf", qtype)
    rng = random.Random(3)
    prompts = {f"p{n}": [rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 37, 90)}
    engine = make_engine(path, quantization="gguf")
    alone = {rid: seeded_logprob_run(engine, {rid: ids})[rid] for rid, ids in prompts.items()}
    assert engine.runner.plan.use_fused_ops
    for budget in (5, 512):
        together = seeded_logprob_run(make_engine(path, max_num_batched_tokens=budget,
                                           quantization="gguf"), prompts)
        assert together == alone, f"chunks of {budget} changed a token or a logprob"


def test_a_q8_0_file_stays_close_to_transformers(gemma4_dir: Any, tmp_path: Path) -> None:
    """The GGUF reader puts every tensor where transformers has it: a Q8_0 file's logits
    (dequantized, the exact path) near the float checkpoint's."""
    path = write_gemma4_gguf(gemma4_dir("e2b"), tmp_path / "e2b.gguf",
                             gguf.GGMLQuantizationType.F32)
    assert_logits_match(make_engine(path), hf_model(gemma4_dir("e2b")),
                        [[5, 17, 300, 4000] * 9])


def test_the_cache_for_16k_tokens_is_counted_by_shape_and_sharing(gemma4_dir: Any) -> None:
    """E2B-like: 3 of 6 layers own a cache (the KV-shared ones none); two windowed (rows of
    2 heads x 16) and one global (2 x 32) in groups of one layer. A 16k context holds
    1024 blocks of 16 for the global group and a window's worth (1 + 1 block) for each
    windowed one; each block costs a row of each shape."""
    arch = ArchConfig.from_hf_config(json.loads((gemma4_dir("e2b") / "config.json")
                                                .read_text()))
    groups = kv_layer_groups(arch)
    assert groups.layers == ((0,), (1,), (2,)) and groups.windows == (4, 4, 0)
    assert groups.shapes == ((2, 16), (2, 16), (2, 32))
    assert groups.slot_of_layer == [0, 0, 0, 0, 0, 0]
    assert groups.group_of_layer == [0, 1, 2, 1, 1, 2]
    block_size, context = 16, 16384
    blocks = context // block_size + 2 * (-(-4 // block_size) + 1)
    assert blocks == 1028
    assert groups.tokens_held(blocks, block_size) == context
    per_block = kv_bytes_per_block(arch, block_size, torch.float32)
    assert per_block == 2 * block_size * (2 * 16 + 2 * 32) * 4  # K and V, both shapes
    engine = make_engine(gemma4_dir("e2b"), num_blocks=blocks)
    runner = engine.runner
    assert runner.kv_block_nbytes == per_block
    shared = [runner.kv_caches[i] for i in (3, 4, 5)]
    assert shared[0] is runner.kv_caches[1] and shared[2] is runner.kv_caches[2]
    assert len(runner.kv_slot_pairs) == 2  # a pair per shape, one layer a group


def _one_request(core: EngineCore, prompt: list[int]) -> tuple[list[Any], int]:
    """(tokens and logprobs, cached tokens) of one greedy request."""
    return run_one_request(core, prompt, SamplingParams(temperature=0.0, max_tokens=6,
                                                        ignore_eos=True, logprobs=2))


def test_a_prefix_hit_and_the_disk_tier_answer_as_a_cold_engine(gemma4_dir: Any,
                                                                 tmp_path: Path) -> None:
    """E2B-like, int8: a prompt's blocks (both row shapes; the shared layers' none) found
    again in RAM, and after a restart on disk, give the cold engine's tokens and logprobs."""
    def engine(prefix_caching: bool, disk: Path | None) -> EngineCore:
        return build_engine_core(EngineConfig(
            model=ModelConfig(model=str(gemma4_dir("e2b")), device="cpu", dtype="float32",
                              quantization="int8"),
            cache=CacheConfig(kv_cache_memory_bytes=64 << 20,
                              enable_prefix_caching=prefix_caching,
                              kv_cache_disk=None if disk is None else str(disk)),
            scheduler=SchedulerConfig()))

    prompt = [random.Random(0).randrange(3, VOCAB) for _ in range(200)]
    full_blocks = (len(prompt) - 1) // 16 * 16
    cold, _ = _one_request(engine(False, None), prompt)
    first = engine(True, tmp_path)
    assert _one_request(first, prompt) == (cold, 0)
    assert _one_request(first, prompt) == (cold, full_blocks)  # a hit in RAM
    first.shutdown()  # its blocks written to the disk tier
    again = engine(True, tmp_path)
    assert _one_request(again, prompt) == (cold, full_blocks)
    assert again.stats.kv_disk_hits == full_blocks // 16 * 3  # a block per KV layer group


def _write_k_quant_gguf(hf_dir: Path, out: Path) -> Path:
    """The checkpoint's layout with every matrix as random K-quant blocks (Q4_K and Q6_K,
    as a community Q4_K_M file mixes them; the embedding Q6_K): gguf has no K quantizer, so
    the values are the blocks', not the checkpoint's."""
    from gemma4_gguf import add_converted_tensor, converted_tensors, read_checkpoint
    from gguf_writing import finish
    from test_quant_kernels import make_raw

    from nanoserve.bench.gguf_tokenizer import add_default_tokenizer
    from nanoserve.bench.random_gemma4_gguf import add_gemma4_metadata, rope_freqs
    from nanoserve.model.gguf_file import GGUFFile
    from nanoserve.model.loader import default_model_path

    q = gguf.GGMLQuantizationType
    config, state = read_checkpoint(hf_dir)
    writer = gguf.GGUFWriter(str(out), "gemma4")
    add_gemma4_metadata(writer, config, gguf.LlamaFileType.MOSTLY_Q4_K_M)
    add_default_tokenizer(writer, GGUFFile(default_model_path()).metadata,
                          vocab_size=config["vocab_size"])
    tensors = {"rope_freqs.weight": rope_freqs(config),
               **converted_tensors(state, config["num_hidden_layers"], config["vocab_size"])}
    for i, (name, value) in enumerate(tensors.items()):
        if value.ndim != 2 or name.endswith("_norm.weight"):
            add_converted_tensor(writer, name, value, q.F32)
            continue
        qtype = q.Q6_K if name == "token_embd.weight" or i % 3 == 0 else q.Q4_K
        writer.add_tensor(name, make_raw(qtype, *value.shape, seed=i), raw_dtype=qtype)
    finish(writer)
    return out


def test_k_quant_files_run_bit_for_bit_across_chunks_and_batches(gemma4_dir: Any,
                                                                 tmp_path: Path) -> None:
    """Q4_K and Q6_K blocks (a 31B-like model 256 wide, so every row is whole 256-blocks)
    through the int8 kernels, seeded outputs with logprobs equal alone and in chunks."""
    checkpoint = gemma4_dir("dense", hidden_size=256, head_dim=32, global_head_dim=64,
                            intermediate_size=256)
    path = _write_k_quant_gguf(checkpoint, tmp_path / "k-quants.gguf")
    rng = random.Random(5)
    prompts = {f"p{n}": [rng.randrange(3, VOCAB) for _ in range(n)] for n in (4, 41)}
    engine = make_engine(path, quantization="gguf")
    alone = {rid: seeded_logprob_run(engine, {rid: ids})[rid] for rid, ids in prompts.items()}
    assert engine.runner.plan.use_fused_ops
    together = seeded_logprob_run(make_engine(path, max_num_batched_tokens=16,
                                              quantization="gguf"), prompts)
    assert together == alone
