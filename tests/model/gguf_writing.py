"""What every test that writes a tiny checkpoint as GGUF (the way llama.cpp's converter does)
shares: the shape keys read from the transformers config, and the file's writing."""

from __future__ import annotations

from typing import Any

import gguf


def add_shape(writer: gguf.GGUFWriter, cfg: Any, rope_theta: float,
              head_dim: int | None = None) -> None:
    """Layers, context, widths, heads, RoPE base, norm epsilon and vocabulary from `cfg`;
    `head_dim` where the file states it (an architecture whose heads are not hidden / heads)."""
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    if head_dim is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)


def tensor_name(hf_name: str, short_names: dict[str, str]) -> tuple[str, str | None]:
    """A transformers tensor's GGUF name, and for a layer's tensor its module ("self_attn.q_proj")
    that `short_names` maps to llama.cpp's short name ("attn_q"); None for the others."""
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight", None
    if hf_name == "model.norm.weight":
        return "output_norm.weight", None
    layer, rest = hf_name.removeprefix("model.layers.").split(".", 1)
    module = rest.rsplit(".", 1)[0]
    return f"blk.{layer}.{short_names[module]}.weight", module


def finish(writer: gguf.GGUFWriter) -> None:
    """Header, metadata and tensors to the file, then close it."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
