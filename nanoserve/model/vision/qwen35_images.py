"""Qwen3.5's (and Qwen3.6's) image preprocessing and prompt expansion, as transformers computes
them (`Qwen2VLImageProcessorPil` with Qwen3.5's preprocessor_config.json, `Qwen3VLProcessor`).

The API process runs `resize` (Pillow) and `expand_prompt`; the uint8 [H, W, 3] pixels cross the
process boundary (H and W are multiples of 32 and differ per image) and the engine runs
`normalize`, which makes the float32 patches the ViT reads (about 33x the uint8 bytes: 3 x 2
temporal copies x 4 bytes / 3). `normalize(resize(image))` equals transformers'
`pixel_values` and `image_grid_thw` bit for bit: RGB conversion with transparency over white,
"smart resize" (each side rounded to a multiple of patch * merge = 32 px, the area kept within
[min_pixels, max_pixels], the aspect ratio kept as closely as that allows) with Pillow's
bicubic filter on the uint8 image, `u8 * (1/255)` in float64 cast to float32, `(x - mean) / std`
in float32, the one image copied along time to fill the temporal patch of 2, and the patches
flattened merge-window-major (the 2 x 2 patches that merge into one token are consecutive).

Token cap: Qwen3.5's shipped preprocessor allows up to 16,777,216 px (16,384 tokens) per image.
By default the processor caps an image at `DEFAULT_MAX_IMAGE_TOKENS` = 4096 tokens (4,194,304 px,
2048 x 2048), llama.cpp mtmd's limit for the Qwen-VL family: a 4K screenshot then costs 4096
tokens of context and one encoder pass instead of 16,384, while staying far above the 1024
tokens llama.cpp advises for grounding. A preprocessor_config.json (or mmproj) bound below the
cap wins; `max_image_tokens=None` keeps the checkpoint's own bound (transformers' behaviour).
Imports numpy and Pillow only: the API process must stay free of torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from nanoserve.model.vision.gemma3_images import to_rgb
from nanoserve.model.vision.processor_values import triple, vocabulary

MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
MMPROJ_PROJECTOR = "qwen3vl_merger"
DEFAULT_MAX_IMAGE_TOKENS = 4096
# Qwen3.5's preprocessor_config.json (Qwen/Qwen3.5-*), used where a checkpoint or an mmproj
# states none: patch 16, merge 2, temporal patch 2, mean/std 0.5, 256^2 to 4096^2 pixels
_DEFAULT_PATCH_SIZE, _DEFAULT_MERGE_SIZE, TEMPORAL_PATCH_SIZE = 16, 2, 2
_DEFAULT_MIN_PIXELS, _DEFAULT_MAX_PIXELS = 65_536, 16_777_216
_DEFAULT_MEAN = (0.5, 0.5, 0.5)
_DEFAULT_STD = (0.5, 0.5, 0.5)
# transformers' smart_resize refuses images more elongated than this
MAX_ASPECT_RATIO = 200
# Qwen3.5's token texts (its tokenizer's; what llama.cpp's mtmd uses for qwen3vl_merger)
VISION_START_TOKEN, IMAGE_TOKEN, VISION_END_TOKEN = (
    "<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
# Qwen3_5Config's defaults where config.json leaves the ids out
_DEFAULT_IDS = {"image_token_id": 248_056, "vision_start_token_id": 248_053,
                "vision_end_token_id": 248_054}
# 1/255 as transformers' `rescale_factor`, applied in float64 before the cast to float32
_RESCALE = 1 / 255


@dataclass(frozen=True)
class Qwen35ImageProcessor:
    """What turns one image into Qwen3.5's patches and a prompt's image marker into its
    placeholder tokens; built once from the checkpoint (HF directory or mmproj GGUF)."""

    patch_size: int  # 16
    merge_size: int  # 2: merge x merge patches become one token
    min_pixels: int  # the resized image's least area
    max_pixels: int  # its greatest area, after the token cap
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int

    @property
    def factor(self) -> int:
        """The pixels one merged token spans per side (32): each resized side's multiple."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """The width of one row of `pixel_values`: 3 channels x 2 frames x patch x patch."""
        return 3 * TEMPORAL_PATCH_SIZE * self.patch_size * self.patch_size

    @classmethod
    def from_hf_dir(cls, path: Path, tokenizer: Any, *,
                    max_image_tokens: int | None = DEFAULT_MAX_IMAGE_TOKENS,
                    ) -> Qwen35ImageProcessor | None:
        """The processor of a Hugging Face Qwen3.5 directory whose config.json has model_type
        "qwen3_5" or "qwen3_5_moe" and a vision_config; None for any other model. Patch and
        merge sizes come from vision_config; mean, std and the pixel bounds (`size`, or the
        older `min_pixels`/`max_pixels`) from preprocessor_config.json where present, else
        Qwen3.5's shipped values; the three token ids from config.json, checked against
        `tokenizer`'s vocabulary. `max_image_tokens` caps max_pixels (module docstring)."""
        config = json.loads((path / "config.json").read_text())
        vision = config.get("vision_config")
        if config.get("model_type") not in MODEL_TYPES or vision is None:
            return None
        preprocessor: dict[str, Any] = {}
        preprocessor_file = path / "preprocessor_config.json"
        if preprocessor_file.exists():
            preprocessor = json.loads(preprocessor_file.read_text())
        temporal = int(vision.get("temporal_patch_size", TEMPORAL_PATCH_SIZE))
        if temporal != TEMPORAL_PATCH_SIZE:
            raise ValueError(f"{path}: vision_config.temporal_patch_size {temporal} is not "
                             f"supported; Qwen3.5's is {TEMPORAL_PATCH_SIZE}")
        size = preprocessor.get("size") or {}
        ids = {name: int(config.get(name, default)) for name, default in _DEFAULT_IDS.items()}
        id_to_text = {token_id: text for text, token_id in vocabulary(tokenizer).items()}
        expected = dict(zip(ids.values(), (IMAGE_TOKEN, VISION_START_TOKEN, VISION_END_TOKEN),
                            strict=True))
        wrong = {i: text for i, text in expected.items() if id_to_text.get(i) != text}
        if wrong:
            raise ValueError(f"{path}: the tokenizer lacks the tokens config.json names as "
                             f"Qwen3.5's image tokens (image_token_id, vision_start_token_id, "
                             f"vision_end_token_id): expected {wrong} (id: text)")
        return cls.of(
            patch_size=int(vision.get("patch_size", _DEFAULT_PATCH_SIZE)),
            merge_size=int(vision.get("spatial_merge_size", _DEFAULT_MERGE_SIZE)),
            min_pixels=int(size.get("shortest_edge",
                                    preprocessor.get("min_pixels", _DEFAULT_MIN_PIXELS))),
            max_pixels=int(size.get("longest_edge",
                                    preprocessor.get("max_pixels", _DEFAULT_MAX_PIXELS))),
            image_mean=triple(preprocessor.get("image_mean") or _DEFAULT_MEAN),
            image_std=triple(preprocessor.get("image_std") or _DEFAULT_STD),
            ids=ids, max_image_tokens=max_image_tokens)

    @classmethod
    def from_mmproj(cls, metadata: dict[str, Any], tokenizer: Any, *,
                    max_image_tokens: int | None = DEFAULT_MAX_IMAGE_TOKENS,
                    ) -> Qwen35ImageProcessor | None:
        """The processor of a llama.cpp mmproj GGUF (its metadata) whose projector type is
        "qwen3vl_merger"; None for any other projector. Patch and merge sizes, mean and std
        come from the file, the pixel bounds from `clip.vision.image_min_pixels`/
        `image_max_pixels` where written (llama.cpp's converter writes none for Qwen3.5), else
        Qwen3.5's shipped values; the token ids are looked up in the text model's `tokenizer`
        by their texts."""
        projector = metadata.get("clip.projector_type", metadata.get("clip.vision.projector_type"))
        if projector != MMPROJ_PROJECTOR:
            return None
        vocab = vocabulary(tokenizer)
        texts = (IMAGE_TOKEN, VISION_START_TOKEN, VISION_END_TOKEN)
        missing = [text for text in texts if text not in vocab]
        if missing:
            raise ValueError(f"the text model's tokenizer has no token {missing}: Qwen3.5's image "
                             f"tokens, which an mmproj of projector type {MMPROJ_PROJECTOR} needs")
        ids = dict(zip(_DEFAULT_IDS, (vocab[text] for text in texts), strict=True))
        return cls.of(
            patch_size=int(metadata["clip.vision.patch_size"]),
            merge_size=int(metadata.get("clip.vision.spatial_merge_size", _DEFAULT_MERGE_SIZE)),
            min_pixels=int(metadata.get("clip.vision.image_min_pixels", _DEFAULT_MIN_PIXELS)),
            max_pixels=int(metadata.get("clip.vision.image_max_pixels", _DEFAULT_MAX_PIXELS)),
            image_mean=triple(metadata.get("clip.vision.image_mean", _DEFAULT_MEAN)),
            image_std=triple(metadata.get("clip.vision.image_std", _DEFAULT_STD)),
            ids=ids, max_image_tokens=max_image_tokens)

    @classmethod
    def of(cls, *, patch_size: int, merge_size: int, min_pixels: int, max_pixels: int,
           image_mean: tuple[float, float, float], image_std: tuple[float, float, float],
           ids: dict[str, int], max_image_tokens: int | None) -> Qwen35ImageProcessor:
        """The processor with `max_pixels` lowered to `max_image_tokens` tokens' worth."""
        if max_image_tokens is not None:
            if max_image_tokens < 1:
                raise ValueError(f"max_image_tokens must be at least 1, got {max_image_tokens}")
            max_pixels = min(max_pixels, max_image_tokens * (patch_size * merge_size) ** 2)
        return cls(patch_size=patch_size, merge_size=merge_size, min_pixels=min_pixels,
                   max_pixels=max_pixels, image_mean=image_mean, image_std=image_std, **ids)

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """(H, W) an image of `height` x `width` is resized to: transformers' `smart_resize`
        (Python's round-half-even included). A ValueError for an image more elongated than
        200:1, which the model does not take."""
        if max(height, width) > MAX_ASPECT_RATIO * min(height, width):
            raise ValueError(f"the image's aspect ratio ({width} x {height} px) is more than "
                             f"{MAX_ASPECT_RATIO}:1, which this model does not take")
        factor = self.factor
        h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return h_bar, w_bar

    def num_tokens(self, height: int, width: int) -> int:
        """The placeholder tokens an image of `height` x `width` pixels becomes (its original
        size or its resized one: resizing an already resized size changes nothing)."""
        resized_height, resized_width = self.resized_size(height, width)
        return resized_height * resized_width // self.factor ** 2

    def resize(self, image: Image.Image) -> np.ndarray:
        """uint8 [H, W, 3]: `image` in RGB (transparency over white) resized to
        `resized_size` with Pillow's bicubic filter, as transformers' PIL backend does it."""
        rgb = to_rgb(image)
        height, width = self.resized_size(rgb.height, rgb.width)
        resized = rgb.resize((width, height), resample=Image.Resampling.BICUBIC)
        return np.asarray(resized, dtype=np.uint8)

    def normalize(self, pixels: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        """(pixel_values float32 [h * w, 3 * 2 * patch * patch], grid_thw (1, h, w)) of uint8
        [H, W, 3] pixels from `resize` (h = H / patch, w = W / patch): `(u8 / 255 - mean) / std`
        in transformers' dtypes, each patch's row ordered (channel, frame, row, column) with
        the frame copied, rows ordered merge-window-major: (h/m, w/m, m, m) for merge m."""
        factor, patch, merge = self.factor, self.patch_size, self.merge_size
        if (pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != 3
                or pixels.shape[0] % factor or pixels.shape[1] % factor or pixels.size == 0):
            raise ValueError(f"expected uint8 pixels of shape (H, W, 3) with H and W multiples "
                             f"of {factor}, got {pixels.dtype} {pixels.shape}")
        scaled = (pixels.astype(np.float64) * _RESCALE).astype(np.float32)
        mean = np.asarray(self.image_mean, dtype=np.float32)
        std = np.asarray(self.image_std, dtype=np.float32)
        normed = (scaled - mean) / std  # [H, W, 3]
        grid_h, grid_w = pixels.shape[0] // patch, pixels.shape[1] // patch
        # [H, W, C] -> (h/m, m, p, w/m, m, p, C) -> (h/m, w/m, m, m, C, p, p)
        patches = normed.reshape(grid_h // merge, merge, patch, grid_w // merge, merge, patch, 3)
        patches = patches.transpose(0, 3, 1, 4, 6, 2, 5)
        # the one image fills both frames of the temporal patch: (..., C, T, p, p)
        frames = np.broadcast_to(patches[:, :, :, :, :, None],
                                 (*patches.shape[:5], TEMPORAL_PATCH_SIZE, patch, patch))
        return (np.ascontiguousarray(frames.reshape(grid_h * grid_w, self.patch_dim)),
                (1, grid_h, grid_w))

    @property
    def image_marker(self) -> str:
        """What the chat template renders for one image."""
        return f"{VISION_START_TOKEN}{IMAGE_TOKEN}{VISION_END_TOKEN}"

    def expand_prompt(self, text: str, token_counts: Sequence[int]) -> str:
        """`text` (a rendered prompt) with the i-th image marker's `<|image_pad|>` repeated
        `token_counts[i]` times, as transformers' Qwen3VLProcessor does. A ValueError when
        the prompt's markers and the counts differ in number."""
        parts = text.split(self.image_marker)
        if len(parts) - 1 != len(token_counts):
            raise ValueError(f"the prompt has {len(parts) - 1} image marker(s) "
                             f"({self.image_marker}) for {len(token_counts)} image(s)")
        pieces = [parts[0]]
        for count, part in zip(token_counts, parts[1:], strict=True):
            pieces.append(f"{VISION_START_TOKEN}{IMAGE_TOKEN * count}{VISION_END_TOKEN}{part}")
        return "".join(pieces)

