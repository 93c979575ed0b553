"""Loading: HF directories (single and sharded), GGUF files (permuted Q/K, quantized, rope
factors), the default model, the GGUF tokenizer, and clear errors for what cannot load.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf_writing import add_shape, finish, tensor_name
from helpers import hf_model
from test_equivalence import prefill_logits

from nanoserve.bench.random_gguf import add_default_tokenizer
from nanoserve.model.arch import UnsupportedModelError
from nanoserve.model.gguf_file import GGUFFile
from nanoserve.model.loader import DEFAULT_MODEL_NAME, default_model_path, load_model
from nanoserve.model.weights import unpermute_rope_rows

CPU = torch.device("cpu")
PROMPT = [5, 17, 300, 4000, 12, 9, 8, 7, 6, 5, 4, 3, 1000, 2000, 3000, 40, 41, 42, 43, 44]


def engine_logits(model: str) -> torch.Tensor:
    from helpers import make_engine

    return prefill_logits(make_engine(model), PROMPT)


def reference_logits(path: Path) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(path)(torch.tensor([PROMPT])).logits[0]


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama Q/K rows (the loader must undo it)."""
    return (w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_gguf(hf_dir: Path, out: Path, qtype: gguf.GGMLQuantizationType,
               with_rope_factors: bool = True,
               qtype_of: dict[str, gguf.GGMLQuantizationType] | None = None) -> Path:
    """Convert a tiny Llama checkpoint to GGUF the way llama.cpp does; `qtype_of` gives some
    tensors (by GGUF short name, e.g. "attn_v") another type, as mixed-quant files do.

    Llama 3.1 rope scaling travels as the `rope_freqs.weight` tensor, which transformers' GGUF
    reader ignores; without it the file describes plain RoPE.
    """
    model = hf_model(hf_dir)
    cfg = model.config
    meta = GGUFFile(default_model_path()).metadata
    writer = gguf.GGUFWriter(str(out), "llama")
    add_shape(writer, cfg, cfg.rope_parameters["rope_theta"])
    add_default_tokenizer(writer, meta)

    head_dim = cfg.hidden_size // cfg.num_attention_heads
    base = 1.0 / (cfg.rope_parameters["rope_theta"]
                  ** (torch.arange(0, head_dim, 2).float() / head_dim))
    factors = (base / model.model.rotary_emb.inv_freq).numpy().astype(np.float32)
    if with_rope_factors:
        writer.add_tensor("rope_freqs.weight", factors)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        w = tensor.float().numpy()
        gguf_name, module = tensor_name(name, names)
        if module == "self_attn.q_proj":
            w = llama_cpp_permute(w, cfg.num_attention_heads)
        elif module == "self_attn.k_proj":
            w = llama_cpp_permute(w, cfg.num_key_value_heads)
        tensor_qtype = (qtype_of or {}).get(gguf_name.split(".")[-2], qtype)
        if w.ndim == 2 and tensor_qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, gguf.quants.quantize(w, tensor_qtype),
                              raw_dtype=tensor_qtype)
        else:
            writer.add_tensor(gguf_name, w)
    finish(writer)
    return out


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = torch.randn(4 * 8, 5)
    assert torch.equal(unpermute_rope_rows(torch.from_numpy(llama_cpp_permute(w.numpy(), 4)),
                                           4), w)


def test_sharded_safetensors_load_like_one_file(tiny_model_dir: Any, tmp_path: Path) -> None:
    import transformers

    src = tiny_model_dir("qwen2")
    sharded = tmp_path / "sharded"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(src))
    model.save_pretrained(sharded, max_shard_size="1MB")
    for f in src.glob("tokenizer*"):
        shutil.copy(f, sharded)
    assert (sharded / "model.safetensors.index.json").exists()
    assert torch.equal(engine_logits(str(sharded)), engine_logits(str(src)))


def test_gguf_with_permuted_qk_and_rope_factors_matches_transformers(
        tiny_model_dir: Any, tmp_path: Path) -> None:
    src = tiny_model_dir("llama")
    path = write_gguf(src, tmp_path / "tiny-f32.gguf", gguf.GGMLQuantizationType.F32)
    ours, theirs = engine_logits(str(path)), reference_logits(src)
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() < 1e-4


def test_quantized_gguf_matches_transformers_reading_the_same_file(
        tiny_model_dir: Any, tmp_path: Path) -> None:
    path = write_gguf(tiny_model_dir("llama"), tmp_path / "tiny-q8.gguf",
                      gguf.GGMLQuantizationType.Q8_0, with_rope_factors=False)
    ours, theirs = engine_logits(str(path)), reference_logits(path)
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() < 1e-4


def test_default_model_loads_with_its_chat_template() -> None:
    loaded = load_model(None, CPU, torch.float32)
    assert loaded.name == DEFAULT_MODEL_NAME and loaded.path.suffix == ".gguf"
    assert loaded.arch.num_layers == 30 and loaded.arch.tie_word_embeddings
    assert loaded.eos_token_ids == (2,)
    text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_gguf_tokenizer_equals_transformers_gguf_tokenizer(default_tokenizer: Any) -> None:
    from transformers import AutoTokenizer

    path = default_model_path()
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = ["Hello world", "  two leading spaces", "digits 12345 and 3.14159, year 2024",
             "<|im_start|>user\nhi<|im_end|>", "emoji 🦜 and 中文 鹦鹉说：答案是42。",
             "tabs\tand\nnewlines\n\n  x", "don't you'll I'm", "<think>x</think>", "ÿþ\x00\x7f"]
    for text in texts:
        ids = default_tokenizer.encode(text)
        assert ids == reference.encode(text), text
        assert default_tokenizer.decode(ids) == reference.decode(ids)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    assert default_tokenizer.apply_chat_template(msgs, tokenize=False) == \
        reference.apply_chat_template(msgs, tokenize=False)


def test_missing_path_names_it() -> None:
    with pytest.raises(FileNotFoundError, match=r"'/no/such/model'.*\.gguf"):
        load_model("/no/such/model", CPU, torch.float32)


def test_directory_without_a_model(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_model(str(tmp_path), CPU, torch.float32)


def _write_config(path: Path, **overrides: Any) -> Path:
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 10,
           "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
           "num_attention_heads": 2, **overrides}
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = _write_config(tmp_path / "m", model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModelError, match=r"'GPT2LMHeadModel'.*llama"):
        load_model(str(path), CPU, torch.float32)


def test_quantized_checkpoint_refused(tmp_path: Path) -> None:
    path = _write_config(tmp_path / "m", quantization_config={"quant_method": "awq"})
    with pytest.raises(UnsupportedModelError, match="quant_method='awq'"):
        load_model(str(path), CPU, torch.float32)


def test_unsupported_rope_scaling(tmp_path: Path) -> None:
    path = _write_config(tmp_path / "m", rope_scaling={"rope_type": "longrope", "factor": 4.0})
    with pytest.raises(UnsupportedModelError, match="'longrope'"):
        load_model(str(path), CPU, torch.float32)


def test_gguf_with_an_unsupported_quantization(tmp_path: Path) -> None:
    path = tmp_path / "q8_1.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    qtype = gguf.GGMLQuantizationType.Q8_1  # gguf has no dequantizer for it
    writer.add_tensor("token_embd.weight", np.zeros((4, 40), dtype=np.uint8), raw_dtype=qtype)
    finish(writer)
    with pytest.raises(ValueError, match="Q8_1"):
        GGUFFile(path).dequantize("token_embd.weight")


def test_gguf_with_an_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gemma.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    finish(writer)
    with pytest.raises(UnsupportedModelError, match="'gemma'"):
        load_model(str(path), CPU, torch.float32)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"NOTGGUF" * 10)
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_model(str(path), CPU, torch.float32)
