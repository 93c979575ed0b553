"""YaRN rope scaling (Qwen3 past 32k, gpt-oss): read from a config.json or from GGUF metadata,
the same frequencies and cos/sin scale as transformers, and the same logits and greedy tokens on a
prompt past the original context; an unknown rope type is refused by name."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_config
from helpers import hf_greedy, hf_model, make_engine, run_to_completion
from test_equivalence import assert_logits_match

from nanoserve.model.arch import ArchConfig, UnsupportedModelError
from nanoserve.model.rope import attention_scaling, inverse_frequencies
from nanoserve.sampling_params import SamplingParams

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
        "rope_theta": 1000000.0}


@pytest.fixture(scope="module")
def yarn_dir(tmp_path_factory: pytest.TempPathFactory, default_tokenizer: Any) -> Path:
    """A tiny Qwen3 whose 1,024 positions are YaRN over an original 256 (factor 4)."""
    import transformers

    config = tiny_config("qwen3")
    config.rope_parameters = dict(YARN)
    path = tmp_path_factory.mktemp("tiny-qwen3-yarn")
    torch.manual_seed(77)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    default_tokenizer.save_pretrained(path)
    return path


def test_frequencies_and_scale_equal_transformers(yarn_dir: Path) -> None:
    reference = hf_model(yarn_dir)
    arch = ArchConfig.from_hf_config(reference.config.to_dict())
    assert arch.rope_scaling.rope_type == "yarn"
    assert torch.equal(inverse_frequencies(arch), reference.model.rotary_emb.inv_freq)
    assert attention_scaling(arch) == reference.model.rotary_emb.attention_scaling > 1.0


def test_logits_and_greedy_tokens_past_the_original_context_equal_transformers(
        yarn_dir: Path) -> None:
    reference = hf_model(yarn_dir)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in (40, 600)]
    assert_logits_match(make_engine(str(yarn_dir)), reference, prompts)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = run_to_completion(make_engine(str(yarn_dir)), {"long": prompts[1]}, greedy)["long"]
    assert got == hf_greedy(reference, prompts[1], 12)


def gguf_metadata(**rope: Any) -> dict[str, Any]:
    """A Qwen3 GGUF's metadata (llama.cpp's key names), with `rope.scaling.*` keys."""
    meta: dict[str, Any] = {
        "general.architecture": "qwen3", "qwen3.block_count": 2, "qwen3.context_length": 1024,
        "qwen3.embedding_length": 64, "qwen3.feed_forward_length": 160,
        "qwen3.attention.head_count": 4, "qwen3.attention.head_count_kv": 2,
        "qwen3.attention.key_length": 32, "qwen3.rope.freq_base": 1000000.0,
        "qwen3.vocab_size": 49152}
    meta.update({f"qwen3.rope.scaling.{key}": value for key, value in rope.items()})
    return meta


def test_a_gguf_yarn_reads_as_the_same_config_json(yarn_dir: Path) -> None:
    """llama.cpp's keys (type, factor, original_context_length) give transformers' numbers;
    its attn_factor multiplies the scale derived from the factor (ggml's rope_yarn)."""
    reference = hf_model(yarn_dir)
    arch = ArchConfig.from_gguf_metadata(
        gguf_metadata(type="yarn", factor=4.0, original_context_length=256), True)
    assert torch.equal(inverse_frequencies(arch), reference.model.rotary_emb.inv_freq)
    assert attention_scaling(arch) == reference.model.rotary_emb.attention_scaling
    doubled = ArchConfig.from_gguf_metadata(
        gguf_metadata(type="yarn", factor=4.0, original_context_length=256, attn_factor=2.0),
        True)
    assert attention_scaling(doubled) == pytest.approx(2 * attention_scaling(arch))
    plain = ArchConfig.from_gguf_metadata(gguf_metadata(type="none"), True)
    assert plain.rope_scaling.rope_type == "default"


def test_an_unknown_rope_type_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedModelError, match="'longrope'"):
        ArchConfig.from_gguf_metadata(gguf_metadata(type="longrope", factor=2.0), True)
    config = tiny_config("qwen3").to_dict()
    config["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0}
    config.pop("rope_parameters", None)
    with pytest.raises(UnsupportedModelError, match="'dynamic'"):
        ArchConfig.from_hf_config(config)
