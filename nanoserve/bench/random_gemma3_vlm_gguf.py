"""A Gemma 3 with images, as two GGUF files with random weights: the text model (`gemma3`)
and its vision tower as llama.cpp's mmproj (`clip`, projector `gemma3`), for `nanoserve bench
serve --image-size`. Nothing is downloaded. Keys, tensor names, types and transforms are those
llama.cpp's converter writes (conversion/gemma.py; norms stored as 1 + w, the tower's matrices
F16 and its embeddings F32), so `nanoserve serve --model TEXT --mmproj MMPROJ` and
`llama-server -m TEXT --mmproj MMPROJ` load the same pair:

    python -m nanoserve.bench.random_gemma3_vlm_gguf /tmp/gemma3-vlm

The shapes (GEMMA3_TEXT, SIGLIP_B14_448) are a user's, scaled to a 2-core CPU: the text model
is Gemma 3 270M's layers (~the default model's size) on the default model's vocabulary with
Gemma 3's image and turn tokens added; the tower a SigLIP of ViT-B width (12 layers of 768) on
448 x 448 images in 14 x 14 patches, 32 x 32 patches average-pooled 4 x 4 to 64 soft tokens.
The chat template is Google's Gemma 3 template, which writes an image part as
`<start_of_image>`. Random weights make no sense as text or images; a benchmark reads them.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from nanoserve.bench.gguf_tokenizer import add_default_tokenizer

# Gemma 3's image tokens and turn markers, appended to the default vocabulary in this order
# (ids 49152-49156), the rows padded to 49,160; llama.cpp's mtmd writes <start_of_image> and
# <end_of_image> around an image's embeddings itself, nanoserve expands <start_of_image> into
# them with <image_soft_token> placeholders
GEMMA3_ADDED_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>",
                       "<start_of_turn>", "<end_of_turn>")
NUM_TEXT_ROWS = 49160

# Google's Gemma 3 chat template (roles alternate; a system message opens the first user
# turn; `{"type": "image"}` parts render as <start_of_image>)
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}"
    "{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- else -%}{{ raise_exception('Invalid content type') }}"
    "{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")


@dataclass(frozen=True)
class Gemma3TextShape:
    """A Gemma 3 text model's widths (five windowed layers for each global one)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    sliding_window: int


@dataclass(frozen=True)
class SiglipShape:
    """A SigLIP tower's widths and its input; `scale` pools scale x scale patches a token."""

    hidden: int
    layers: int
    heads: int
    intermediate: int
    image_size: int
    patch_size: int
    scale: int = 4  # llama.cpp's default for gemma3: the key is written only when not 4

    @property
    def tokens_per_image(self) -> int:
        return (self.image_size // self.patch_size // self.scale) ** 2


GEMMA3_TEXT = Gemma3TextShape(hidden=640, layers=18, heads=4, kv_heads=1, head_dim=256,
                              intermediate=2048, sliding_window=512)  # Gemma 3 270M's
SIGLIP_B14_448 = SiglipShape(hidden=768, layers=12, heads=12, intermediate=3072,
                             image_size=448, patch_size=14)
# CLIP's mean and std (what the file states; Gemma 3's own are 0.5)
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_random_gemma3_text_gguf(out: Path, shape: Gemma3TextShape = GEMMA3_TEXT,
                                  qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.Q4_0,
                                  seed: int = 0) -> Path:
    """The text half: projections in `qtype`, the tied embedding Q8_0 (as random_gguf.py),
    norms F32 as 1 + w with w = 0; the default tokenizer with GEMMA3_ADDED_TOKENS and Google's
    template."""
    from nanoserve.model.gguf_file import GGUFFile
    from nanoserve.model.loader import default_model_path

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(out), "gemma3")
    writer.add_block_count(shape.layers)
    writer.add_context_length(32768)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_sliding_window(shape.sliding_window)
    writer.add_vocab_size(NUM_TEXT_ROWS)
    add_default_tokenizer(writer, GGUFFile(default_model_path()).metadata,
                          chat_template=GEMMA3_CHAT_TEMPLATE, vocab_size=NUM_TEXT_ROWS,
                          added_tokens=GEMMA3_ADDED_TOKENS)

    def matrix(name: str, rows: int, cols: int, kind: gguf.GGMLQuantizationType) -> None:
        values = rng.standard_normal((rows, cols), dtype=np.float32) * 0.02
        writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)

    def ones(name: str, size: int) -> None:
        writer.add_tensor(name, np.ones(size, dtype=np.float32))

    matrix("token_embd.weight", NUM_TEXT_ROWS, shape.hidden, gguf.GGMLQuantizationType.Q8_0)
    ones("output_norm.weight", shape.hidden)
    q_rows, kv_rows = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    for i in range(shape.layers):
        for name, rows, cols in (("attn_q", q_rows, shape.hidden),
                                 ("attn_k", kv_rows, shape.hidden),
                                 ("attn_v", kv_rows, shape.hidden),
                                 ("attn_output", shape.hidden, q_rows),
                                 ("ffn_gate", shape.intermediate, shape.hidden),
                                 ("ffn_up", shape.intermediate, shape.hidden),
                                 ("ffn_down", shape.hidden, shape.intermediate)):
            matrix(f"blk.{i}.{name}.weight", rows, cols, qtype)
        for norm in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            ones(f"blk.{i}.{norm}.weight", shape.hidden)
        for norm in ("attn_q_norm", "attn_k_norm"):
            ones(f"blk.{i}.{norm}.weight", shape.head_dim)
    _finish(writer)
    return out


def _tower_tensors(shape: SiglipShape, text_hidden: int) -> dict[str, tuple[int, ...]]:
    """The tower's and projector's tensors by their Hugging Face names (the hub spelling the
    converter maps), with their PyTorch-order shapes."""
    hidden, side = shape.hidden, shape.image_size // shape.patch_size
    embeddings = "vision_tower.vision_model.embeddings."
    shapes: dict[str, tuple[int, ...]] = {
        f"{embeddings}patch_embedding.weight": (hidden, 3, shape.patch_size, shape.patch_size),
        f"{embeddings}patch_embedding.bias": (hidden,),
        f"{embeddings}position_embedding.weight": (side * side, hidden),
        "vision_tower.vision_model.post_layernorm.weight": (hidden,),
        "vision_tower.vision_model.post_layernorm.bias": (hidden,),
        "multi_modal_projector.mm_input_projection.weight": (hidden, text_hidden),
        "multi_modal_projector.mm_soft_emb_norm.weight": (hidden,)}
    for i in range(shape.layers):
        layer = f"vision_tower.vision_model.encoder.layers.{i}."
        for module, rows, cols in (("self_attn.q_proj", hidden, hidden),
                                   ("self_attn.k_proj", hidden, hidden),
                                   ("self_attn.v_proj", hidden, hidden),
                                   ("self_attn.out_proj", hidden, hidden),
                                   ("mlp.fc1", shape.intermediate, hidden),
                                   ("mlp.fc2", hidden, shape.intermediate)):
            shapes[f"{layer}{module}.weight"] = (rows, cols)
            shapes[f"{layer}{module}.bias"] = (rows,)
        for norm in ("layer_norm1", "layer_norm2"):
            shapes[f"{layer}{norm}.weight"] = (hidden,)
            shapes[f"{layer}{norm}.bias"] = (hidden,)
    return shapes


def write_random_gemma3_mmproj(out: Path, shape: SiglipShape = SIGLIP_B14_448,
                               text_hidden: int = GEMMA3_TEXT.hidden, seed: int = 0) -> Path:
    """The vision half as the converter's mmproj: matrices and the projection F16, the
    embeddings and 1-D tensors F32; layer norms 1 and biases 0, soft_emb_norm stored as
    1 + w with w = 0."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(out), "clip")
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(text_hidden)
    writer.add_vision_image_size(shape.image_size)
    writer.add_vision_patch_size(shape.patch_size)
    writer.add_vision_embedding_length(shape.hidden)
    writer.add_vision_feed_forward_length(shape.intermediate)
    writer.add_vision_block_count(shape.layers)
    writer.add_vision_head_count(shape.heads)
    writer.add_vision_image_mean(list(IMAGE_MEAN))
    writer.add_vision_image_std(list(IMAGE_STD))
    writer.add_clip_projector_type(gguf.VisionProjectorType.GEMMA3)
    writer.add_vision_attention_layernorm_eps(1e-6)
    writer.add_vision_use_gelu(True)
    if shape.scale != 4:
        writer.add_vision_projector_scale_factor(shape.scale)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, shape.layers)
    for name, dims in _tower_tensors(shape, text_hidden).items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"gguf's mmproj tensor map has no name for {name}")
        if "norm" in name and name.endswith(".weight"):  # 1 + w (soft_emb_norm) or LayerNorm
            values = np.ones(dims, dtype=np.float32)
        elif name.endswith(".bias"):
            values = np.zeros(dims, dtype=np.float32)
        else:
            values = rng.standard_normal(dims, dtype=np.float32) * 0.02
        is_f16 = "input_projection" in name or (len(dims) >= 2 and ".embeddings." not in name)
        writer.add_tensor(gguf_name, values.astype(np.float16 if is_f16 else np.float32))
    _finish(writer)
    return out


def write_random_gemma3_vlm(out_dir: Path, seed: int = 0) -> tuple[Path, Path]:
    """Both files into `out_dir` (created): the text GGUF and its mmproj, named after their
    shapes."""
    out_dir.mkdir(parents=True, exist_ok=True)
    text = write_random_gemma3_text_gguf(out_dir / "gemma3-270m-shape-q4_0.gguf", seed=seed)
    mmproj = write_random_gemma3_mmproj(out_dir / "mmproj-siglip-b14-448-f16.gguf",
                                        seed=seed + 1)
    return text, mmproj


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanoserve.bench.random_gemma3_vlm_gguf",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for path in write_random_gemma3_vlm(args.out_dir, args.seed):
        print(f"{path}: {path.stat().st_size / 1e6:.0f} MB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
