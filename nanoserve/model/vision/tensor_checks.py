"""A vision tower's tensor taken from what a checkpoint holds, checked against the shape its
config gives, with an error that names the file, the tensor and what was expected."""

from __future__ import annotations

import torch


def checked_tensor(tensors: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], *,
                   source: object, expected: str, device: torch.device,
                   dtype: torch.dtype) -> torch.Tensor:
    """`tensors[name]` on `device` in `dtype`, contiguous; a ValueError where it is missing
    (naming `expected`, the checkpoint that would hold it) or has another shape."""
    if name not in tensors:
        raise ValueError(f"{source}: the vision tensor {name!r} is missing; expected "
                         f"{expected}")
    tensor = tensors[name]
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{source}: the vision tensor {name!r} has shape "
                         f"{tuple(tensor.shape)}, expected {shape} from the config")
    return tensor.to(device=device, dtype=dtype).contiguous()
