"""The vision tower, run once per distinct image: the feature rows a step writes over its
images' placeholder embeddings, from an LRU cache keyed by each image's content hash.

Agents resend the same screenshot every turn, and a prompt whose prefix cache misses past an
image (a preemption's recompute, an eviction) needs its features again: the tower costs far
more than a prefill of its placeholders on a CPU, so its rows are kept (vLLM's encoder cache,
llama-cpp-python's complaint in #2222). Worker side: it sees a step's `StepImage`s only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch

from nanoserve.protocol import StepImage

# Feature rows kept: 256 MiB holds ~100 images of a 2,560-wide Gemma 3 4B (256 rows each in
# float32), more than the turns of the conversations a CPU serves at once.
ENCODER_CACHE_BYTES = 256 * 2**20

# (the step's rows [R] int64, their features [R, hidden])
ImageRows = tuple[torch.Tensor, torch.Tensor]


class ImageEncoder:
    """`tower` (pixel_values [N, 3, S, S] -> features [N, rows, hidden]) behind a cache of
    its outputs by content hash; `normalize` turns a `StepImage`'s uint8 pixels [S, S, 3]
    into the tower's float32 [3, S, S] (the model's image processor, model/vision/)."""

    def __init__(self, tower: torch.nn.Module,
                 normalize: Callable[[np.ndarray], np.ndarray], device: torch.device,
                 dtype: torch.dtype, max_bytes: int = ENCODER_CACHE_BYTES) -> None:
        self.tower = tower
        self.normalize = normalize
        self.device = device
        self.dtype = dtype
        self.max_bytes = max_bytes
        self.cached: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.num_bytes = 0
        self.num_encoded = 0  # images run through the tower (the rest came from the cache)

    def step_rows(self, images: list[StepImage]) -> ImageRows | None:
        """The rows and features of a step's images (None: the step has none)."""
        if not images:
            return None
        features = self._features(images)
        rows = [torch.arange(image.first_row, image.first_row + image.num_rows)
                for image in images]
        parts = [features[image.content_hash][image.first_feature :
                                              image.first_feature + image.num_rows]
                 for image in images]
        return torch.cat(rows).to(self.device), torch.cat(parts)

    def _features(self, images: list[StepImage]) -> dict[bytes, torch.Tensor]:
        """Each distinct image's feature rows [rows, hidden]: the cached ones, and the rest
        from one tower call over all of them."""
        found: dict[bytes, torch.Tensor] = {}
        missing: dict[bytes, np.ndarray] = {}
        for image in images:
            key = image.content_hash
            if key in self.cached:
                self.cached.move_to_end(key)
                found[key] = self.cached[key]
            elif key not in missing:
                missing[key] = image.pixels
        if missing:
            out = self._encode(list(missing.values()))
            self.num_encoded += len(missing)
            for key, features in zip(missing, out, strict=True):
                found[key] = features
                self._keep(key, features)
        return found

    @torch.inference_mode()
    def _encode(self, images: list[np.ndarray]) -> list[torch.Tensor]:
        """Each image's feature rows [rows, hidden]: Gemma 3's fixed-size images in one
        batch; Qwen3.5's (patches and a grid each, attended apart) one by one."""
        normalized = [self.normalize(pixels) for pixels in images]
        if isinstance(normalized[0], tuple):  # (patches [P, C * T * p * p], grid (t, h, w))
            return [self.tower(torch.from_numpy(patches).to(self.device, self.dtype), [grid])
                    for patches, grid in normalized]
        batch = torch.from_numpy(np.stack(normalized)).to(self.device, self.dtype)
        return list(self.tower(batch))  # [N, rows, hidden]

    def _keep(self, key: bytes, features: torch.Tensor) -> None:
        """Cache `features`, evicting the least recently used past the byte budget."""
        size = features.numel() * features.element_size()
        if size > self.max_bytes:
            return
        self.cached[key] = features
        self.num_bytes += size
        while self.num_bytes > self.max_bytes:
            _, old = self.cached.popitem(last=False)
            self.num_bytes -= old.numel() * old.element_size()
