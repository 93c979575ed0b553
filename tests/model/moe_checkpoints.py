"""Mixture-of-experts checkpoints the MoE tests write: tiny random Qwen3-MoE and Qwen2-MoE
models from transformers (safetensors and GGUF), and the default model upcycled to a qwen2moe
GGUF whose every expert is its dense MLP (exactly the dense model, see `upcycle_default_model`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from conftest import _spread_norm_weights
from gguf_writing import add_shape, finish

from nanoserve.model.gguf_file import GGUFFile
from nanoserve.model.loader import default_model_path
from nanoserve.model.weights import unpermute_rope_rows

Q = gguf.GGMLQuantizationType
VOCAB = 49152  # the default model's tokenizer


def tiny_moe_config(kind: str) -> Any:
    """Small MoE configs: `qwen3_moe` (8 experts, top 2, renormalised, layer 1 dense by
    mlp_only_layers), `qwen3_moe_unnormed` (4 experts, top 3 not renormalised, every second
    layer MoE by decoder_sparse_step) and `qwen2_moe` (qkv bias, a gated shared expert)."""
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=160, moe_intermediate_size=32,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, initializer_range=0.05,
        tie_word_embeddings=False)
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, head_dim=32, num_hidden_layers=3,
                                           num_experts=8, num_experts_per_tok=2,
                                           norm_topk_prob=True, mlp_only_layers=[1])
    if kind == "qwen3_moe_unnormed":
        return transformers.Qwen3MoeConfig(**common, head_dim=32, num_hidden_layers=4,
                                           num_experts=4, num_experts_per_tok=3,
                                           norm_topk_prob=False, decoder_sparse_step=2)
    if kind == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**common, num_hidden_layers=2, num_experts=4,
                                           num_experts_per_tok=2, norm_topk_prob=False,
                                           shared_expert_intermediate_size=64,
                                           rope_theta=1000000.0)
    raise ValueError(kind)


def write_tiny_moe(kind: str, path: Path, tokenizer: Any, seed: int = 1234) -> Path:
    """A tiny random MoE checkpoint of `kind` in `path` (config, safetensors, tokenizer). The
    routers are scaled up so that each token's experts are chosen by clear margins."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_moe_config(kind))
    _spread_norm_weights(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _copy_tokenizer(writer: gguf.GGUFWriter, meta: dict[str, Any]) -> None:
    """The default model's tokenizer, as its GGUF file holds it."""
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    writer.add_unk_token_id(meta["tokenizer.ggml.unknown_token_id"])
    writer.add_pad_token_id(meta["tokenizer.ggml.padding_token_id"])
    writer.add_add_bos_token(meta["tokenizer.ggml.add_bos_token"])
    writer.add_add_space_prefix(meta["tokenizer.ggml.add_space_prefix"])
    writer.add_chat_template(meta["tokenizer.chat_template"])


# a transformers MoE model's parameter (after `model.layers.N.`) -> the GGUF name after `blk.N.`
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight":
    "ffn_norm.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    **{f"self_attn.{p}_proj.{kind}": f"attn_{'output' if p == 'o' else p}.{kind}"
       for p in "qkvo" for kind in ("weight", "bias")},
}


def write_tiny_moe_gguf(hf_dir: Path, out: Path, qtype: Q = Q.F32) -> Path:
    """The tiny MoE checkpoint in `hf_dir` as a `qwen3moe` / `qwen2moe` GGUF, the way
    llama.cpp's converter writes one: experts stacked [E, rows, columns], the shared expert's
    gate a vector. Matmul weights (2-D and the stacked experts) in `qtype`, the rest F32. A
    layer that transformers keeps dense keeps its `ffn_gate/up/down` (nanoserve reads which
    layers are MoE from the file's routers)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    cfg = model.config
    arch = "qwen3moe" if cfg.model_type == "qwen3_moe" else "qwen2moe"
    writer = gguf.GGUFWriter(str(out), arch)
    add_shape(writer, cfg, cfg.rope_parameters["rope_theta"])
    if arch == "qwen3moe":
        writer.add_key_length(cfg.head_dim)
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if cfg.norm_topk_prob != (arch == "qwen3moe"):  # llama.cpp's default for the arch
        writer.add_expert_weights_norm(cfg.norm_topk_prob)
    _copy_tokenizer(writer, GGUFFile(default_model_path()).metadata)
    for name, tensor in model.state_dict().items():
        for gguf_name, value in _gguf_tensors(name, tensor.float().numpy()):
            is_matmul = value.ndim == 3 or (value.ndim == 2 and "ffn_gate_inp" not in gguf_name
                                            and gguf_name != "token_embd.weight")
            if is_matmul and qtype != Q.F32:
                writer.add_tensor(gguf_name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
            else:
                writer.add_tensor(gguf_name, value)
    finish(writer)
    return out


def _gguf_tensors(name: str, value: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """A transformers parameter as the GGUF tensors that hold it (experts' gate and up are one
    [E, 2 I, H] parameter in transformers 5: two stacked tensors in GGUF)."""
    if name == "model.embed_tokens.weight":
        return [("token_embd.weight", value)]
    if name == "model.norm.weight":
        return [("output_norm.weight", value)]
    if name == "lm_head.weight":
        return [("output.weight", value)]
    layer, rest = name.removeprefix("model.layers.").split(".", 1)
    if rest == "mlp.experts.gate_up_proj":
        gate, up = np.split(value, 2, axis=1)
        return [(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(gate)),
                (f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(up))]
    if rest == "mlp.shared_expert_gate.weight":
        return [(f"blk.{layer}.ffn_gate_inp_shexp.weight", value.reshape(-1))]
    return [(f"blk.{layer}.{_LAYER_NAMES[rest]}", value)]


# The upcycled default model: every MoE layer's experts are copies of its dense MLP.
UPCYCLED_EXPERTS, UPCYCLED_TOP_K = 4, 2
ROUTER_SCALE = 1e8  # router logits this far apart saturate the softmax: probabilities 1 and 0


def upcycle_default_model(out: Path, seed: int = 0) -> Path:
    """The default model (SmolLM2, Llama, Q4_1) rewritten as a `qwen2moe` GGUF that computes
    exactly what it computes, on the quantized path too:

    - attention: Qwen2's, with q/k/v biases of zero (x + 0 is x) and Q/K rows un-permuted
      (llama.cpp permutes Llama's, not Qwen's), whole rows of blocks: no requantization
    - experts: each of the 4 is the layer's own ffn_gate/up/down, the same Q4_1 blocks
    - router: random directions times 1e8, so the softmax saturates: a token's first expert
      gets probability exactly 1.0 and its second exactly 0.0 (exp underflows), and
      1.0 * y + 0.0 * y == y, renormalised or not (llama.cpp and transformers read qwen2moe
      without renormalising; nanoserve does as they do). Tokens still spread over the experts.
    - shared expert: its down projection all zero blocks, so it adds exactly 0 (a sigmoid
      gate of a linear function can be exactly neither 0 nor 1)
    """
    source = GGUFFile(default_model_path())
    meta = source.metadata
    hidden, heads = meta["llama.embedding_length"], meta["llama.attention.head_count"]
    kv_heads = meta["llama.attention.head_count_kv"]
    head_dim = hidden // heads
    writer = gguf.GGUFWriter(str(out), "qwen2moe")
    for key, add in (("block_count", writer.add_block_count),
                     ("context_length", writer.add_context_length),
                     ("embedding_length", writer.add_embedding_length),
                     ("feed_forward_length", writer.add_feed_forward_length),
                     ("attention.head_count", writer.add_head_count),
                     ("attention.head_count_kv", writer.add_head_count_kv),
                     ("rope.freq_base", writer.add_rope_freq_base),
                     ("attention.layer_norm_rms_epsilon", writer.add_layer_norm_rms_eps),
                     ("vocab_size", writer.add_vocab_size)):
        add(meta[f"llama.{key}"])
    writer.add_expert_count(UPCYCLED_EXPERTS)
    writer.add_expert_used_count(UPCYCLED_TOP_K)
    writer.add_expert_feed_forward_length(meta["llama.feed_forward_length"])
    shared_size = 32
    writer.add_expert_shared_feed_forward_length(shared_size)
    _copy_tokenizer(writer, meta)
    rng = np.random.default_rng(seed)

    def raw(name: str) -> tuple[np.ndarray, Q]:
        tensor = source.tensors[name]
        return np.array(tensor.data).reshape(tensor.shape[0], -1), Q(tensor.ggml_type)

    for name, tensor in source.tensors.items():
        if ".ffn_gate." in name or ".ffn_up." in name or ".ffn_down." in name:
            continue  # written as experts below
        if len(tensor.shape) == 1:
            writer.add_tensor(name, source.dequantize(name).numpy())
            continue
        rows, qtype = raw(name)
        if ".attn_q." in name or ".attn_k." in name:
            rows = unpermute_rope_rows(torch.from_numpy(rows), tensor.shape[0] // head_dim).numpy()
        writer.add_tensor(name, rows, raw_dtype=qtype)
    for layer in range(meta["llama.block_count"]):
        blk = f"blk.{layer}."
        for proj, size in (("attn_q", heads * head_dim), ("attn_k", kv_heads * head_dim),
                           ("attn_v", kv_heads * head_dim)):
            writer.add_tensor(f"{blk}{proj}.bias", np.zeros(size, dtype=np.float32))
        for part in ("gate", "up", "down"):
            rows, qtype = raw(f"{blk}ffn_{part}.weight")
            writer.add_tensor(f"{blk}ffn_{part}_exps.weight",
                              np.stack([rows] * UPCYCLED_EXPERTS), raw_dtype=qtype)
        router = rng.standard_normal((UPCYCLED_EXPERTS, hidden)) * ROUTER_SCALE
        writer.add_tensor(f"{blk}ffn_gate_inp.weight", router.astype(np.float32))
        gate_up = gguf.quants.quantize(
            rng.standard_normal((shared_size, hidden)).astype(np.float32), Q.Q4_1)
        writer.add_tensor(f"{blk}ffn_gate_shexp.weight", gate_up, raw_dtype=Q.Q4_1)
        writer.add_tensor(f"{blk}ffn_up_shexp.weight", gate_up, raw_dtype=Q.Q4_1)
        zeros = gguf.quants.quantize(np.zeros((hidden, shared_size), np.float32), Q.Q4_1)
        writer.add_tensor(f"{blk}ffn_down_shexp.weight", zeros, raw_dtype=Q.Q4_1)
        writer.add_tensor(f"{blk}ffn_gate_inp_shexp.weight",
                          rng.standard_normal(hidden).astype(np.float32))
    finish(writer)
    return out
