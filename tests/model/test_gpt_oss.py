"""gpt-oss computes what transformers computes: tiny random checkpoints (gpt_oss_checkpoints.py:
sinks far from zero, biases everywhere, 4 experts top 2, a 4-token window, YaRN untruncated) in
bf16 and with MXFP4 experts (transformers dequantizes them: the oracle) equal transformers in
prefill logits and in greedy tokens alone, batched, chunked past the window and preempted; the
same weights as llama.cpp's GGUF (MXFP4 experts, gate and up apart) read into the same places;
through the int8 kernels (Q8_0 and MXFP4) seeded outputs with logprobs are bit for bit across
chunks and batches; and the sinks matter (a model whose sinks are dropped answers otherwise)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import gguf
import pytest
from gpt_oss_checkpoints import VOCAB, write_gpt_oss_gguf, write_tiny_gpt_oss
from helpers import hf_model, make_engine, seeded_logprob_run
from test_equivalence import assert_logits_match, assert_tokens_match, prefill_logits

from nanoserve.model.arch import ArchConfig
from nanoserve.model.quant_linear import QuantizedWeight

Q = gguf.GGMLQuantizationType
PROMPTS = [[5, 17, 300, 4000] * k for k in (1, 9, 40)]  # 4 to 160 tokens, past the window


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory: pytest.TempPathFactory, default_tokenizer: Any) -> Any:
    made: dict[bool, Path] = {}

    def make(mxfp4: bool = False) -> Path:
        if mxfp4 not in made:
            path = tmp_path_factory.mktemp(f"gpt-oss-{'mxfp4' if mxfp4 else 'bf16'}")
            made[mxfp4] = write_tiny_gpt_oss(path, default_tokenizer, mxfp4=mxfp4)
        return made[mxfp4]

    return make


def test_the_config_reads_as_gpt_oss(gpt_oss_dir: Any) -> None:
    arch = ArchConfig.from_hf_config(json.loads((gpt_oss_dir(True) / "config.json")
                                                .read_text()))
    assert arch.family == "gpt_oss" and arch.gpt_oss is not None
    assert [arch.layer_window(i) for i in range(4)] == [4, 0, 4, 0]
    assert arch.rope_scaling.rope_type == "yarn" and not arch.rope_scaling.truncate
    assert arch.gpt_oss.num_experts == 4 and arch.gpt_oss.num_experts_per_tok == 2
    assert arch.has_qkv_bias and not arch.tie_word_embeddings


@pytest.mark.parametrize("mxfp4", [False, True], ids=["bf16", "mxfp4"])
def test_prefill_logits_and_greedy_tokens_equal_transformers(mxfp4: bool,
                                                             gpt_oss_dir: Any) -> None:
    path = gpt_oss_dir(mxfp4)
    reference = hf_model(path)
    assert_logits_match(make_engine(path), reference, PROMPTS)
    assert_tokens_match(str(path), reference, VOCAB, num_new=8)


def test_the_sinks_matter(gpt_oss_dir: Any) -> None:
    """The same engine with every sink at -inf (none in any denominator) gives other logits:
    an attention path that dropped them would not pass the test above."""
    engine = make_engine(gpt_oss_dir())
    ids = PROMPTS[1]
    with_sinks = prefill_logits(engine, ids)
    for layer in engine.runner.model.decoder_layers:
        layer.sinks.data.fill_(-float("inf"))
    engine.runner.plan._bound_layers.clear()  # (the bound layers copied the sinks)
    without = prefill_logits(engine, ids)
    rel = ((with_sinks - without).abs().max() / with_sinks.abs().max()).item()
    assert rel > 1e-2, f"dropping the sinks moved the logits by only {rel:.1e}"


def test_the_gguf_layout_reads_into_the_same_places(gpt_oss_dir: Any, tmp_path: Path) -> None:
    """llama.cpp's names, split gate/up, MXFP4 experts in GGUF's nibble order: an F32 file
    (experts the checkpoint's own MXFP4 bytes) dequantized equals transformers."""
    path = write_gpt_oss_gguf(gpt_oss_dir(True), tmp_path / "tiny.gguf", Q.F32)
    assert_logits_match(make_engine(path), hf_model(gpt_oss_dir(True)), PROMPTS)


@pytest.mark.parametrize("source", ["gguf", "safetensors"])
def test_seeded_outputs_through_the_kernels_equal_across_chunks_and_batches(
        source: str, gpt_oss_dir: Any, tmp_path: Path) -> None:
    """The int8 kernels (MXFP4 experts; Q8_0 elsewhere in the GGUF file): bit for bit alone,
    batched and in chunks of 5 and 512 tokens, from either source."""
    path = (write_gpt_oss_gguf(gpt_oss_dir(True), tmp_path / "tiny.gguf", Q.Q8_0)
            if source == "gguf" else gpt_oss_dir(True))
    rng = random.Random(3)
    prompts = {f"p{n}": [rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 37, 90)}
    engine = make_engine(path, quantization="gguf")
    alone = {rid: seeded_logprob_run(engine, {rid: ids})[rid] for rid, ids in prompts.items()}
    expert = engine.runner.model.decoder_layers[0].moe.experts[0]
    assert isinstance(expert.gate_up_proj, QuantizedWeight)  # (MXFP4 through the kernel)
    assert engine.runner.plan.use_fused_ops == (source == "gguf")  # (a checkpoint's rest: float)
    for budget in (5, 512):
        together = seeded_logprob_run(make_engine(path, max_num_batched_tokens=budget,
                                                  quantization="gguf"), prompts)
        assert together == alone, f"chunks of {budget} changed a token or a logprob"

