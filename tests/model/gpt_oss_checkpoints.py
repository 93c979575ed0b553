"""Tiny random gpt-oss checkpoints (`GptOssForCausalLM`, saved as the hub's are) beside the
default model's tokenizer (SmolLM2's 49,152 tokens, as the other tiny checkpoints), and the
same weights as the `gpt-oss` GGUF llama.cpp's converter writes.

Shape: hidden 64, 4 layers `[S, F, S, F]` of 4 heads (2 KV) of 16, a window of 4 tokens, 4
experts of 64 (top 2), YaRN factor 32 over 4096 with `truncate: false` (the hub's). The sinks
are drawn from N(1, 1), far from zero, so attention that drops them moves the logits; biases
from N(0, 0.1); router rows N(0, 2), so each token's experts win by clear margins.

- `write_tiny_gpt_oss(path, mxfp4=False)`: bf16 weights, experts `gate_up_proj` [E, H, 2I]
  (gate and up interleaved) as transformers saves them; with `mxfp4` the experts are random
  MXFP4 bytes (`*_blocks` [E, rows, K/32, 16], `*_scales` [E, rows, K/32] in 120-123, small
  weights) and config.json carries the hub's `quantization_config`: transformers dequantizes
  them on the CPU, the oracle.
- `write_gpt_oss_gguf(hf_dir, out)`: llama.cpp's names and keys; experts MXFP4 (the same bytes
  where the checkpoint has them, in GGUF's nibble order, else quantized), gate and up apart;
  other weights `weight_type` (F32: the checkpoint's values exactly), norms, biases, sinks F32.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from nanoserve.bench.gguf_tokenizer import add_default_tokenizer
from nanoserve.bench.random_gpt_oss_gguf import add_gpt_oss_metadata
from nanoserve.model.gguf_file import GGUFFile
from nanoserve.model.loader import default_model_path
from nanoserve.model.mxfp4 import hf_mxfp4_to_gguf_blocks
from nanoserve.model.tokenizer import load_tokenizer_from_gguf

VOCAB = 49152
SEED = 5
SLIDING, FULL = "sliding_attention", "full_attention"
Q = gguf.GGMLQuantizationType
QUANT_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def tiny_gpt_oss_config(**overrides: Any) -> Any:
    import transformers

    return transformers.GptOssConfig(**{
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 64, "head_dim": 16,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4,
        "layer_types": [SLIDING, FULL, SLIDING, FULL], "sliding_window": 4,
        "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 2048,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                            "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                            "beta_slow": 1.0, "truncate": False},
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 1,
        "eos_token_id": 2, "pad_token_id": 0, "initializer_range": 0.05, **overrides})


def write_tiny_gpt_oss(path: Path, tokenizer: Any = None, *, mxfp4: bool = False,
                       **overrides: Any) -> Path:
    """The checkpoint in `path` (module docstring); `overrides` replace config fields."""
    import transformers
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    config = tiny_gpt_oss_config(**overrides)
    model = transformers.GptOssForCausalLM(config).to(torch.bfloat16)
    state = _spread(model.state_dict())
    if mxfp4:
        state = _mxfp4_experts(state, config)
    model.config.save_pretrained(path)
    if mxfp4:
        saved = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(
            {**saved, "quantization_config": QUANT_CONFIG}, indent=2))
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    if config.vocab_size == VOCAB:
        if tokenizer is None:
            tokenizer = load_tokenizer_from_gguf(GGUFFile(default_model_path()))
        tokenizer.save_pretrained(path)
    return path


def _spread(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sinks, biases, norms and router rows away from their inits (module docstring)."""
    gen = torch.Generator().manual_seed(SEED)
    out = {}
    for name, tensor in state.items():
        if name.endswith("sinks"):
            tensor = torch.randn(tensor.shape, generator=gen) + 1.0
        elif name.endswith("bias"):
            tensor = torch.randn(tensor.shape, generator=gen) * 0.1
        elif "norm" in name:
            tensor = torch.rand(tensor.shape, generator=gen) + 0.5
        elif name.endswith("router.weight"):
            tensor = torch.randn(tensor.shape, generator=gen) * 2.0
        elif name.endswith(("gate_up_proj", "down_proj")):
            tensor = torch.randn(tensor.shape, generator=gen) * 0.1
        out[name] = tensor.to(torch.bfloat16)
    return out


def _mxfp4_experts(state: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """The experts' float weights replaced by random MXFP4 blocks and scales."""
    gen = torch.Generator().manual_seed(SEED + 1)
    experts, hidden, inter = (config.num_local_experts, config.hidden_size,
                              config.intermediate_size)
    out = {k: v for k, v in state.items()
           if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts."
        for part, rows, cols in (("gate_up_proj", 2 * inter, hidden),
                                 ("down_proj", hidden, inter)):
            out[f"{p}{part}_blocks"] = torch.randint(0, 256, (experts, rows, cols // 32, 16),
                                                     generator=gen, dtype=torch.uint8)
            out[f"{p}{part}_scales"] = torch.randint(120, 124, (experts, rows, cols // 32),
                                                     generator=gen, dtype=torch.uint8)
    return out


# transformers' names (after `model.layers.N.`) -> llama.cpp's (after `blk.N.`)
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.sinks": "attn_sinks.weight",
    "mlp.router.weight": "ffn_gate_inp.weight",
    "mlp.router.bias": "ffn_gate_inp.bias",
    **{f"self_attn.{n}_proj.{s}": f"attn_{g}.{s}" for n, g in
       (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output")) for s in ("weight", "bias")},
}


def write_gpt_oss_gguf(hf_dir: Path, out_path: Path, weight_type: Q = Q.Q8_0) -> Path:
    """The checkpoint in `hf_dir` as llama.cpp's converter writes it (module docstring)."""
    from safetensors.torch import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    state = load_file(str(hf_dir / "model.safetensors"))
    writer = gguf.GGUFWriter(str(out_path), "gpt-oss")
    _add_metadata(writer, config)
    meta = GGUFFile(default_model_path()).metadata
    add_default_tokenizer(writer, meta, vocab_size=config["vocab_size"])
    tensors: dict[str, tuple[np.ndarray, Q]] = {
        "token_embd.weight": (_f32(state["model.embed_tokens.weight"]), weight_type),
        "output_norm.weight": (_f32(state["model.norm.weight"]), Q.F32),
        "output.weight": (_f32(state["lm_head.weight"]), weight_type),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for hf, name in _LAYER_NAMES.items():
            value = _f32(state[p + hf])
            is_float = value.ndim == 1 or "norm" in name or "ffn_gate_inp" in name
            tensors[f"blk.{i}.{name}"] = (value, Q.F32 if is_float else weight_type)
        tensors.update(_gguf_experts(state, p + "mlp.experts.", i))
    for name, (value, qtype) in tensors.items():
        if qtype in (Q.F32, Q.MXFP4) or value.dtype == np.uint8:
            writer.add_tensor(name, value, raw_dtype=None if qtype == Q.F32 else qtype)
        else:
            writer.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def _gguf_experts(state: dict[str, torch.Tensor], p: str, i: int
                  ) -> dict[str, tuple[np.ndarray, Q]]:
    """The experts as MXFP4 [E, rows, K/32 * 17] bytes, gate and up apart (even rows gate,
    odd up), with their biases F32."""
    out: dict[str, tuple[np.ndarray, Q]] = {}
    for part in ("gate_up_proj", "down_proj"):
        if p + part + "_blocks" in state:
            raw = hf_mxfp4_to_gguf_blocks(state[p + part + "_blocks"],
                                          state[p + part + "_scales"]).numpy()
        else:  # bf16 [E, in, out]: quantized as llama-quantize would
            weights = _f32(state[p + part]).transpose(0, 2, 1)  # [E, out, in]
            raw = gguf.quants.quantize(np.ascontiguousarray(weights), Q.MXFP4)
        bias = _f32(state[p + part + "_bias"])
        if part == "gate_up_proj":
            out[f"blk.{i}.ffn_gate_exps.weight"] = (np.ascontiguousarray(raw[:, 0::2]), Q.MXFP4)
            out[f"blk.{i}.ffn_up_exps.weight"] = (np.ascontiguousarray(raw[:, 1::2]), Q.MXFP4)
            out[f"blk.{i}.ffn_gate_exps.bias"] = (np.ascontiguousarray(bias[:, 0::2]), Q.F32)
            out[f"blk.{i}.ffn_up_exps.bias"] = (np.ascontiguousarray(bias[:, 1::2]), Q.F32)
        else:
            out[f"blk.{i}.ffn_down_exps.weight"] = (np.ascontiguousarray(raw), Q.MXFP4)
            out[f"blk.{i}.ffn_down_exps.bias"] = (bias, Q.F32)
    return out


def _add_metadata(writer: gguf.GGUFWriter, config: dict[str, Any]) -> None:
    """The `gpt-oss.*` keys llama.cpp's converter writes, the bench's file's (its keys read
    from the checkpoint's config.json)."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    add_gpt_oss_metadata(writer, {
        **config, "rope_theta": rope.get("rope_theta", config.get("rope_theta", 150000.0)),
        "rope_factor": rope["factor"],
        "rope_original_context": rope["original_max_position_embeddings"]})


def _f32(tensor: torch.Tensor) -> np.ndarray:
    return tensor.float().numpy()
