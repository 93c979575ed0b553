"""The tiny Qwen3.5 checkpoints (qwen35_checkpoints.py) are what they claim: config.json's model
type, architecture and layer kinds, the whole vocabulary in float32, `<|im_end|>` as EOS, the
tokenizer beside them; and nanoserve reads their shape from config.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from qwen35_checkpoints import qwen35_layer_types, write_tiny_qwen35
from qwen35_tokenizer import QWEN35_VOCAB_SIZE
from safetensors import safe_open

from nanoserve.model.arch import ArchConfig

LINEAR, FULL = "linear_attention", "full_attention"


@pytest.mark.parametrize(("options", "model_type", "architecture", "layer_types"), [
    ({}, "qwen3_5_text", "Qwen3_5ForCausalLM", [LINEAR, LINEAR, LINEAR, FULL]),
    ({"moe": True}, "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", [LINEAR, LINEAR, LINEAR, FULL]),
    ({"family": "qwen3"}, "qwen3", "Qwen3ForCausalLM", [FULL] * 4),
])
def test_the_written_checkpoint(options: dict[str, Any], model_type: str, architecture: str,
                                layer_types: list[str], tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = write_tiny_qwen35(tmp_path / "tiny", **options)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == model_type
    assert config["architectures"] == [architecture]
    assert config["layer_types"] == layer_types
    assert config["vocab_size"] == QWEN35_VOCAB_SIZE == 248320
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"],
            config["head_dim"]) == (64, 2, 1, 32)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    assert config["eos_token_id"] == tokenizer.eos_token_id == 248046
    assert "<tool_call>" in tokenizer.chat_template
    with safe_open(str(path / "model.safetensors"), "pt") as weights:
        embedding = weights.get_tensor("model.embed_tokens.weight")
    assert tuple(embedding.shape) == (248320, 64) and str(embedding.dtype) == "torch.float32"
    arch = ArchConfig.from_hf_config(config)
    assert arch.vocab_size == 248320 and arch.num_layers == 4
    assert arch.eos_token_ids == (248046,)
    if model_type.startswith("qwen3_5"):
        assert arch.family == "qwen3_5" and arch.linear_layers == (0, 1, 2)
        assert (config["linear_num_key_heads"], config["linear_num_value_heads"],
                config["linear_key_head_dim"], config["linear_conv_kernel_dim"]) == (2, 4, 16, 4)
    else:
        assert arch.family == "qwen3" and arch.linear_layers == ()


def test_overrides_and_layer_kinds_follow_the_layer_count(tmp_path: Path) -> None:
    path = write_tiny_qwen35(tmp_path / "eight", num_hidden_layers=8, hidden_size=32)
    config = json.loads((path / "config.json").read_text())
    assert config["hidden_size"] == 32
    assert config["layer_types"] == qwen35_layer_types(8) == [LINEAR] * 3 + [FULL] + (
        [LINEAR] * 3 + [FULL])
    with pytest.raises(ValueError, match="family must be one of"):
        write_tiny_qwen35(tmp_path / "bad", family="llama")
