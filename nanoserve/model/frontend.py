"""What an API process needs of a model without its weights: the tokenizer and the sampling
defaults. It imports no torch (nor the model's modules), so an API process starts without
loading it: ~2.7 s less of a core at each server's start on a 2-core Zen 3, while the engine
core process imports it beside (docs/benchmarks.md, "A server's start and stop")."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanoserve.model.fim_tokens import FimTokens
from nanoserve.model.gguf_file import GGUFFile
from nanoserve.model.model_path import resolve_model_path
from nanoserve.model.tokenizer import load_tokenizer_from_dir, load_tokenizer_from_gguf
from nanoserve.model.vision.gemma3_images import Gemma3ImageProcessor
from nanoserve.model.vision.qwen35_images import Qwen35ImageProcessor

# GGUF's recommended-sampling keys -> generation_config.json names
_GGUF_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
    # llama.cpp's samplers, by SamplingParams' (llama-server's) names
    "general.sampling.penalty_last_n": "repeat_last_n",
    "general.sampling.xtc_probability": "xtc_probability",
    "general.sampling.xtc_threshold": "xtc_threshold",
    "general.sampling.mirostat": "mirostat", "general.sampling.mirostat_tau": "mirostat_tau",
    "general.sampling.mirostat_eta": "mirostat_eta",
}


@dataclass
class FrontendModel:
    """What an API server needs of a model without its weights: tokenizer and defaults, and
    where the model sees images, how an image becomes its pixels and placeholder tokens."""

    tokenizer: Any
    generation_config: dict[str, Any]
    path: Path
    image_processor: ImageProcessor | None = None
    fim_tokens: FimTokens = field(default_factory=FimTokens)  # none: cannot infill


def load_frontend(model: str | None, mmproj: str | None = None) -> FrontendModel:
    path = resolve_model_path(model)
    mmproj_path = None if mmproj is None else Path(mmproj)
    if path.is_dir():
        gen_file = path / "generation_config.json"
        defaults = json.loads(gen_file.read_text()) if gen_file.exists() else {}
        tokenizer = load_tokenizer_from_dir(path)
        metadata = None
    else:
        gguf = GGUFFile(path)
        tokenizer = load_tokenizer_from_gguf(gguf)
        defaults = gguf_sampling_defaults(gguf.metadata)
        metadata = gguf.metadata
    return FrontendModel(tokenizer, defaults, path,
                         load_image_processor(path, tokenizer, mmproj_path),
                         FimTokens.find(tokenizer, metadata))


ImageProcessor = Gemma3ImageProcessor | Qwen35ImageProcessor


def load_image_processor(path: Path, tokenizer: Any,
                         mmproj: Path | None = None) -> ImageProcessor | None:
    """The model's image processor (Gemma 3's or Qwen3.5's): from `mmproj` (llama.cpp's
    projector GGUF) where given, else from a checkpoint directory's config; None for a model
    that reads text only."""
    kinds: tuple[type[Gemma3ImageProcessor] | type[Qwen35ImageProcessor], ...] = (
        Gemma3ImageProcessor, Qwen35ImageProcessor)
    if mmproj is not None:
        metadata = GGUFFile(mmproj).metadata
        return next((p for kind in kinds
                     if (p := kind.from_mmproj(metadata, tokenizer)) is not None), None)
    if path.is_dir():
        return next((p for kind in kinds
                     if (p := kind.from_hf_dir(path, tokenizer)) is not None), None)
    return None


def gguf_sampling_defaults(meta: dict[str, Any]) -> dict[str, Any]:
    """A GGUF file's recommended sampling settings, as generation_config.json would say them."""
    return {name: meta[key] for key, name in _GGUF_SAMPLING_KEYS.items() if key in meta}
