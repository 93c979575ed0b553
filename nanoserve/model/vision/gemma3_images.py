"""Gemma 3's image preprocessing and prompt expansion, as transformers computes them.

The API process runs `resize` (Pillow) and `expand_prompt`; the uint8 [S, S, 3] pixels cross
the process boundary and the engine runs `normalize`. `normalize(resize(image))` equals
transformers' `Gemma3ImageProcessorPil` `pixel_values` bit for bit (pan-and-scan off, its
default): RGB conversion with transparency composited over white, a bilinear stretch to S x S
on the uint8 image, then `u8 * (1/255)` in float64 cast to float32, `(x - mean) / std` in
float32. Imports numpy and Pillow only: the API process must stay free of torch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from nanoserve.model.vision.processor_values import triple, vocabulary

# transformers' defaults where a checkpoint leaves them out (a config.json saved with
# `use_diff` omits values equal to them): Gemma3Config, SiglipVisionConfig and
# Gemma3ImageProcessorPil (IMAGENET_STANDARD_MEAN / _STD)
_DEFAULT_TOKENS_PER_IMAGE = 256
_DEFAULT_IMAGE_TOKEN_ID, _DEFAULT_BOI_TOKEN_ID, _DEFAULT_EOI_TOKEN_ID = 262_144, 255_999, 256_000
_DEFAULT_IMAGE_SIZE = 224
_DEFAULT_MEAN = (0.5, 0.5, 0.5)
_DEFAULT_STD = (0.5, 0.5, 0.5)
# llama.cpp's pooling factor for a `gemma3` mmproj when `clip.vision.projector.scale_factor` is
# absent ("used by all model sizes in gemma 3 family", tools/mtmd/clip.cpp)
_DEFAULT_SCALE_FACTOR = 4
# the token texts Gemma 3's tokenizer uses (and llama.cpp's mtmd for boi/eoi)
BOI_TOKEN, IMAGE_TOKEN, EOI_TOKEN = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
# 1/255 as transformers' `rescale_factor`, applied in float64 before the cast to float32
_RESCALE = 1 / 255


@dataclass(frozen=True)
class Gemma3ImageProcessor:
    """What turns one image into Gemma 3's pixels and a prompt's image marker into its
    placeholder tokens; built once from the checkpoint (HF directory or mmproj GGUF)."""

    image_size: int  # S: the tower's input side (896 in real Gemma 3)
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    tokens_per_image: int  # soft tokens an image becomes (256 real)
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    image_token: str
    boi_token: str
    eoi_token: str

    @classmethod
    def from_hf_dir(cls, path: Path, tokenizer: Any) -> Gemma3ImageProcessor | None:
        """The processor of a Hugging Face Gemma 3 directory whose config.json has model_type
        "gemma3" and a vision_config; None for any other model. Mean and std come from
        preprocessor_config.json where present (else transformers' defaults, 0.5); the image
        side is the tower's (vision_config.image_size); the three token texts are looked up in
        `tokenizer`'s vocabulary by the ids the config names."""
        config = json.loads((path / "config.json").read_text())
        vision = config.get("vision_config")
        if config.get("model_type") != "gemma3" or vision is None:
            return None
        image_size = int(vision.get("image_size", _DEFAULT_IMAGE_SIZE))
        mean, std = _DEFAULT_MEAN, _DEFAULT_STD
        preprocessor_file = path / "preprocessor_config.json"
        if preprocessor_file.exists():
            preprocessor = json.loads(preprocessor_file.read_text())
            mean = triple(preprocessor.get("image_mean") or mean)
            std = triple(preprocessor.get("image_std") or std)
            size = preprocessor.get("size") or {}
            if size.get("height", image_size) != image_size or \
                    size.get("width", image_size) != image_size:
                raise ValueError(
                    f"{preprocessor_file}: size {size} differs from the vision tower's "
                    f"image_size {image_size} in config.json; expected both to be equal")
        ids = (int(config.get("image_token_index", _DEFAULT_IMAGE_TOKEN_ID)),
               int(config.get("boi_token_index", _DEFAULT_BOI_TOKEN_ID)),
               int(config.get("eoi_token_index", _DEFAULT_EOI_TOKEN_ID)))
        by_id = {token_id: text for text, token_id in vocabulary(tokenizer).items()
                 if token_id in ids}
        missing = [token_id for token_id in ids if token_id not in by_id]
        if missing:
            raise ValueError(f"{path}: the tokenizer has no token with id(s) {missing}, which "
                             "config.json names as Gemma 3's image tokens (image_token_index, "
                             "boi_token_index, eoi_token_index)")
        return cls(image_size=image_size, image_mean=mean, image_std=std,
                   tokens_per_image=int(config.get("mm_tokens_per_image",
                                                   _DEFAULT_TOKENS_PER_IMAGE)),
                   image_token_id=ids[0], boi_token_id=ids[1], eoi_token_id=ids[2],
                   image_token=by_id[ids[0]], boi_token=by_id[ids[1]], eoi_token=by_id[ids[2]])

    @classmethod
    def from_mmproj(cls, metadata: dict[str, Any], tokenizer: Any) -> Gemma3ImageProcessor | None:
        """The processor of a llama.cpp mmproj GGUF (its metadata) whose projector type is
        "gemma3"; None for any other projector. Tokens per image are
        (image_size / patch_size / scale_factor)^2; the three tokens' ids are looked up in the
        text model's `tokenizer` by their texts."""
        projector = metadata.get("clip.projector_type", metadata.get("clip.vision.projector_type"))
        if projector != "gemma3":
            return None
        image_size = int(metadata["clip.vision.image_size"])
        patch_size = int(metadata["clip.vision.patch_size"])
        scale = int(metadata.get("clip.vision.projector.scale_factor", _DEFAULT_SCALE_FACTOR))
        vocab = vocabulary(tokenizer)
        missing = [text for text in (IMAGE_TOKEN, BOI_TOKEN, EOI_TOKEN) if text not in vocab]
        if missing:
            raise ValueError(f"the text model's tokenizer has no token {missing}: Gemma 3's image "
                             "tokens, which an mmproj of projector type gemma3 needs")
        return cls(image_size=image_size,
                   image_mean=triple(metadata.get("clip.vision.image_mean", _DEFAULT_MEAN)),
                   image_std=triple(metadata.get("clip.vision.image_std", _DEFAULT_STD)),
                   tokens_per_image=(image_size // patch_size // scale) ** 2,
                   image_token_id=vocab[IMAGE_TOKEN], boi_token_id=vocab[BOI_TOKEN],
                   eoi_token_id=vocab[EOI_TOKEN], image_token=IMAGE_TOKEN,
                   boi_token=BOI_TOKEN, eoi_token=EOI_TOKEN)

    def resize(self, image: Image.Image) -> np.ndarray:
        """uint8 [S, S, 3]: `image` in RGB (transparency over white) stretched to S x S with
        Pillow's bilinear filter, as transformers' PIL backend does it."""
        rgb = to_rgb(image)
        resized = rgb.resize((self.image_size, self.image_size),
                             resample=Image.Resampling.BILINEAR)
        return np.asarray(resized, dtype=np.uint8)

    def normalize(self, pixels: np.ndarray) -> np.ndarray:
        """float32 [3, S, S]: uint8 [S, S, 3] pixels as `(u8 / 255 - mean) / std`, in
        transformers' order and dtypes (the 1/255 in float64, the rest in float32)."""
        side = self.image_size
        if pixels.dtype != np.uint8 or pixels.shape != (side, side, 3):
            raise ValueError(f"expected uint8 pixels of shape ({side}, {side}, 3), got "
                             f"{pixels.dtype} {pixels.shape}")
        scaled = (pixels.astype(np.float64) * _RESCALE).astype(np.float32)
        mean = np.asarray(self.image_mean, dtype=np.float32)
        std = np.asarray(self.image_std, dtype=np.float32)
        return np.ascontiguousarray(((scaled - mean) / std).transpose(2, 0, 1))

    @property
    def image_sequence(self) -> str:
        """The text one image marker becomes (transformers' `full_image_sequence`)."""
        soft_tokens = self.image_token * self.tokens_per_image
        return f"\n\n{self.boi_token}{soft_tokens}{self.eoi_token}\n\n"

    def num_tokens(self, height: int, width: int) -> int:
        """The placeholder tokens an image becomes: `tokens_per_image`, whatever its size."""
        return self.tokens_per_image

    def expand_prompt(self, text: str, token_counts: Sequence[int] = ()) -> str:
        """`text` (a rendered prompt) with each `boi_token` replaced by `image_sequence`, as
        transformers' Gemma3Processor does without pan-and-scan (`token_counts`, each
        image's `num_tokens`, are all `tokens_per_image`)."""
        return text.replace(self.boi_token, self.image_sequence)


def to_rgb(image: Image.Image) -> Image.Image:
    """`image` as RGB the way transformers' `convert_to_rgb` does it: an image with an alpha
    band (RGBA, LA, PA) or a transparency entry (P or RGB with tRNS) is composited over
    white; any other mode (L, P, CMYK, I, ...) goes through Pillow's own `convert("RGB")`."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")

