"""Tiny random Gemma 4 checkpoints (`Gemma4ForCausalLM` of a `Gemma4TextConfig`, saved with
save_pretrained) beside the default model's tokenizer (SmolLM2's 49,152 tokens, the vocabulary
the other tiny checkpoints use), one per shape of the family:

- `write_tiny_gemma4_e2b`: E2B's parts: per-layer embeddings (8 a layer), KV sharing (the last
  3 of 6 layers `[S, S, F, S, S, F]` reuse layers 1 and 2), the double-wide MLP of the sharing
  layers, head_dim 16 sliding / 32 full, a window of 4 tokens, logit softcap 30
- `write_tiny_gemma4_moe`: 26B-A4B's: K = V full-attention layers with 1 KV head (2 on the
  sliding ones), the MoE block (4 experts of 32, top 2) beside the dense MLP
- `write_tiny_gemma4_dense`: 31B's: K = V full-attention layers with 2 KV heads (4 sliding),
  no per-layer embeddings, sharing or experts

transformers applies `num_global_key_value_heads` only to K = V models, so only those two have
full layers with fewer KV heads. Every norm weight, `layer_scalar` and the router's `scale` and
`per_expert_scale` are drawn from U(0.5, 1.5), away from their initial 1, so a term left out or
read from the wrong tensor changes the logits.

`spelling` writes config.json (and the weights' names) the way a checkpoint may come:
"transformers" as save_pretrained writes it (the full layers' head_dim and KV heads in
`per_layer_config`), "hub" as the hub's Gemma 4 text configs spell them (`global_head_dim`,
`num_global_key_value_heads`), "multimodal" as the hub's `Gemma4ForConditionalGeneration`
(the hub spelling inside `text_config`, weights under `model.language_model.*`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import torch

from nanoserve.model.gguf_file import GGUFFile
from nanoserve.model.loader import default_model_path
from nanoserve.model.tokenizer import load_tokenizer_from_gguf

VOCAB = 49152  # the default model's tokenizer
SLIDING, FULL = "sliding_attention", "full_attention"
Spelling = Literal["transformers", "hub", "multimodal"]
SPELLINGS: tuple[Spelling, ...] = ("transformers", "hub", "multimodal")
SEED = 4


def _common(**overrides: Any) -> dict[str, Any]:
    """What the three share: hidden 64, 6 layers of 4 heads, 16 wide sliding / 32 full, a
    window of 4, softcap 30, the default tokenizer's special ids (bos 1, eos 2, pad 0)."""
    return {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "global_head_dim": 32, "sliding_window": 4,
            "layer_types": [SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL],
            "max_position_embeddings": 1024, "rms_norm_eps": 1e-6,
            "final_logit_softcapping": 30.0, "bos_token_id": 1, "eos_token_id": 2,
            "pad_token_id": 0, "initializer_range": 0.05, "hidden_size_per_layer_input": 0,
            **overrides}


def tiny_gemma4_e2b_config(**overrides: Any) -> Any:
    import transformers

    vocab_size = overrides.get("vocab_size", VOCAB)
    return transformers.Gemma4TextConfig(**_common(**{
        "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": vocab_size,
        "num_kv_shared_layers": 3, "use_double_wide_mlp": True, **overrides}))


def tiny_gemma4_moe_config(**overrides: Any) -> Any:
    import transformers

    return transformers.Gemma4TextConfig(**_common(**{
        "attention_k_eq_v": True, "num_global_key_value_heads": 1, "enable_moe_block": True,
        "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32, **overrides}))


def tiny_gemma4_dense_config(**overrides: Any) -> Any:
    import transformers

    return transformers.Gemma4TextConfig(**_common(**{
        "num_attention_heads": 8, "num_key_value_heads": 4, "attention_k_eq_v": True,
        "num_global_key_value_heads": 2, "layer_types": [SLIDING] * 5 + [FULL], **overrides}))


def write_tiny_gemma4_e2b(path: Path, tokenizer: Any = None, *,
                          spelling: Spelling = "transformers", **overrides: Any) -> Path:
    """The E2B-like checkpoint in `path` (module docstring); `overrides` replace config
    fields (a `vocab_size` other than the default tokenizer's writes no tokenizer)."""
    return _write(path, tiny_gemma4_e2b_config(**overrides), tokenizer, spelling)


def write_tiny_gemma4_moe(path: Path, tokenizer: Any = None, *,
                          spelling: Spelling = "transformers", **overrides: Any) -> Path:
    """The 26B-A4B-like checkpoint in `path` (module docstring)."""
    return _write(path, tiny_gemma4_moe_config(**overrides), tokenizer, spelling)


def write_tiny_gemma4_dense(path: Path, tokenizer: Any = None, *,
                            spelling: Spelling = "transformers", **overrides: Any) -> Path:
    """The 31B-like checkpoint in `path` (module docstring)."""
    return _write(path, tiny_gemma4_dense_config(**overrides), tokenizer, spelling)


WRITERS = {"e2b": write_tiny_gemma4_e2b, "moe": write_tiny_gemma4_moe,
           "dense": write_tiny_gemma4_dense}


def _write(path: Path, config: Any, tokenizer: Any, spelling: Spelling) -> Path:
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    model = transformers.Gemma4ForCausalLM(config)
    spread_gemma4_scales(model)
    model.save_pretrained(path)
    if config.vocab_size == VOCAB:
        if tokenizer is None:
            tokenizer = load_tokenizer_from_gguf(GGUFFile(default_model_path()))
        tokenizer.save_pretrained(path)
    if spelling != "transformers":
        respell_checkpoint(path, spelling)
    return path


def spread_gemma4_scales(model: torch.nn.Module) -> None:
    """Norm weights, layer scalars and router scales from U(0.5, 1.5) (the layer scalars are
    buffers, so the state dict's tensors are set in place); router rows of a larger spread
    than the init's, so each token's experts win by clear margins."""
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if "norm" in name or name.endswith(("layer_scalar", "router.scale",
                                                "per_expert_scale")):
                tensor.uniform_(0.5, 1.5)
            elif name.endswith("router.proj.weight"):
                tensor.normal_(0.0, 2.0)


def hub_text_config(config: dict[str, Any]) -> dict[str, Any]:
    """A transformers-written text config.json in the hub's spelling: the full layers' head
    width and KV heads as `global_head_dim` and `num_global_key_value_heads` (None when the
    full layers keep the sliding ones' count), not `per_layer_config`."""
    hub = {k: v for k, v in config.items() if k not in ("per_layer_config", "architectures")}
    full = [str(i) for i, kind in enumerate(config["layer_types"]) if kind == FULL]
    overrides = config["per_layer_config"][full[0]]
    hub["global_head_dim"] = overrides["head_dim"]
    hub["num_global_key_value_heads"] = overrides.get("num_key_value_heads")
    return hub


def respell_checkpoint(path: Path, spelling: Spelling) -> None:
    """Rewrites the checkpoint in `path` (as save_pretrained wrote it) into `spelling`."""
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    text = hub_text_config(config)
    if spelling == "hub":
        config_file.write_text(json.dumps({**text, "architectures": ["Gemma4ForCausalLM"]},
                                          indent=2))
        return
    text.pop("transformers_version", None)
    config_file.write_text(json.dumps({
        "architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
        "text_config": text, "vision_config": None, "audio_config": None,
        "tie_word_embeddings": True, "transformers_version": config["transformers_version"],
    }, indent=2))
    from safetensors.torch import load_file, save_file

    weights = path / "model.safetensors"
    state = load_file(str(weights))
    save_file({name.replace("model.", "model.language_model.", 1): tensor
               for name, tensor in state.items()}, str(weights), metadata={"format": "pt"})
