"""Tiny random-weight Qwen3.5 checkpoints with Qwen3.5's real tokenizer and chat template, for
the tests of what a chat user sees (tests/entrypoints/test_qwen35_chat.py).

`write_tiny_qwen35(directory)` writes a `Qwen3_5ForCausalLM` (`moe=True`: a
`Qwen3_5MoeForCausalLM`) of four layers, three Gated DeltaNet ("linear_attention") and one gated
full attention, over the whole 248,320-row vocabulary, as safetensors beside the tokenizer of
`qwen35_tokenizer.py`. `family="qwen3"` writes a tiny `Qwen3ForCausalLM` of the same width with
the same tokenizer and template: a model the engine runs whatever its Qwen3.5 support, so the
chat tests can run on both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from qwen35_tokenizer import QWEN35_VOCAB_SIZE, qwen35_special_tokens, write_qwen35_tokenizer

FAMILIES = ("qwen3_5", "qwen3")
NUM_LAYERS = 4
FULL_ATTENTION_INTERVAL = 4  # Qwen3.5's: three Gated DeltaNet layers, then a full attention one
SEED = 35


def qwen35_layer_types(num_layers: int) -> list[str]:
    """Qwen3.5's layer kinds: every `FULL_ATTENTION_INTERVAL`-th layer full attention."""
    return ["full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
            for i in range(num_layers)]


def tiny_qwen35_config(*, moe: bool = False, family: str = "qwen3_5",
                       **overrides: Any) -> Any:
    """The transformers config: hidden 64, 4 layers, 2 query heads over 1 KV head of 32, an
    MLP of 128 (`moe`: 4 experts of 64, top 2, and a shared expert of 128); Qwen3.5's linear
    layers have 2 key heads and 4 value heads of 16 and a causal conv of 4. `overrides` replace
    any field (`layer_types` follows `num_hidden_layers` unless given too)."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    specials = qwen35_special_tokens()
    common: dict[str, Any] = dict(
        vocab_size=QWEN35_VOCAB_SIZE, hidden_size=64, intermediate_size=128,
        num_hidden_layers=NUM_LAYERS, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, max_position_embeddings=4096, rms_norm_eps=1e-6, bos_token_id=None,
        eos_token_id=specials["<|im_end|>"], pad_token_id=specials["<|endoftext|>"],
        tie_word_embeddings=True)
    if family == "qwen3":
        if moe:
            raise ValueError("moe=True is a Qwen3.5 MoE; family='qwen3' has no MoE here")
        return transformers.Qwen3Config(**{**common, **overrides})
    common.update(layer_types=qwen35_layer_types(overrides.get("num_hidden_layers", NUM_LAYERS)),
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                  linear_value_head_dim=16, linear_conv_kernel_dim=4)
    if moe:
        del common["intermediate_size"]
        return transformers.Qwen3_5MoeTextConfig(
            **{**common, "num_experts": 4, "num_experts_per_tok": 2,
               "moe_intermediate_size": 64, "shared_expert_intermediate_size": 128,
               **overrides})
    return transformers.Qwen3_5TextConfig(**{**common, **overrides})


def write_tiny_qwen35(directory: Path | str, *, moe: bool = False, family: str = "qwen3_5",
                      **overrides: Any) -> Path:
    """Writes the tiny checkpoint (config.json, model.safetensors in float32 from a fixed seed,
    generation_config.json) and the Qwen3.5 tokenizer with its chat template into `directory`
    (made if missing); returns it."""
    import transformers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = tiny_qwen35_config(moe=moe, family=family, **overrides)
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    write_qwen35_tokenizer(directory)
    return directory
