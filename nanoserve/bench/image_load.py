"""The image requests of `nanoserve bench serve --image-size WxH`: one random PNG per request,
sent as an OpenAI chat `image_url` data URL before the prompt's words.

Every request's image is its own (seeded by the request), so neither server's encoder cache
nor prefix cache finds it: each request pays for decoding, resizing and encoding its image.
The pictures are a coarse random grid stretched bilinearly to W x H (smooth colour fields, a
photo's compressibility: a 640 x 480 one is ~0.2-0.4 MB of PNG, not the 0.9 MB of noise).
"""

from __future__ import annotations

import base64
import io
import re
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

CHAT_PATH = "/v1/chat/completions"
_GRID = 16  # pixels of W x H per random grid cell before the stretch


def parse_image_size(text: str) -> tuple[int, int]:
    """'640x480' -> (640, 480); both sides positive."""
    match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if match is None or min(int(match[1]), int(match[2])) < 1:
        raise ValueError(f"--image-size needs WIDTHxHEIGHT in pixels, e.g. 640x480; got {text!r}")
    return int(match[1]), int(match[2])


def random_png(width: int, height: int, seed: int) -> bytes:
    """A `width` x `height` RGB PNG of a random grid (one cell per 16 x 16 pixels) stretched
    bilinearly; the same seed gives the same bytes."""
    rng = np.random.default_rng(seed)
    cells = rng.integers(0, 256, (max(1, height // _GRID), max(1, width // _GRID), 3),
                         dtype=np.uint8)
    image = Image.fromarray(cells).resize((width, height), Image.Resampling.BILINEAR)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def png_data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def image_chat_body(model: str, prompt: str, data_url: str, output_len: int
                    ) -> dict[str, Any]:
    """A streamed, greedy, EOS-ignoring chat request of one user turn: the image, then the
    prompt's text; exactly `output_len` tokens."""
    content = [{"type": "image_url", "image_url": {"url": data_url}},
               {"type": "text", "text": prompt}]
    return {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


def image_bodies(model: str, prompts: list[str], size: tuple[int, int], output_len: int,
                 seed: int) -> list[dict[str, Any]]:
    """One chat body per prompt, each with an image of its own (seeds `seed`, `seed + 1`, ...)."""
    return [image_chat_body(model, prompt, png_data_url(random_png(*size, seed + i)),
                            output_len) for i, prompt in enumerate(prompts)]


def mmproj_tokens_per_image(mmproj: Path) -> int:
    """The soft tokens an image becomes with this Gemma 3 mmproj GGUF:
    (image_size / patch_size / scale_factor)^2, llama.cpp's scale factor 4 when unstated."""
    from nanoserve.model.gguf_file import GGUFFile

    meta = GGUFFile(mmproj).metadata
    side = int(meta["clip.vision.image_size"]) // int(meta["clip.vision.patch_size"])
    return (side // int(meta.get("clip.vision.projector.scale_factor", 4))) ** 2
