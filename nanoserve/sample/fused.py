"""The draw's common path in C++ (`nanoserve/csrc/sampling.cpp`), for logits on the CPU.

What it computes: for each row it is given, the token the PyTorch path would choose from the
processed logits. Greedy rows: the argmax (the first one, as `torch.argmax`). Random rows:
temperature, min-p, top-k and top-p exactly as truncation.py defines them (ties included), then
Gumbel-max with noise.py's counter-based noise (same row key, hash and 24-bit uniform). Each row
is one task, read once or twice, with no [rows, vocab] temporaries; the per-slot parameters are
read in place through the batch's slots, so a step gathers nothing.

The kernel's exp and log are not PyTorch's: they agree within one float ulp (the noise, checked
for every uniform) and 2.7 ulps (top-p's mass fractions). A row whose token could turn on that
difference (a top-p mass within 2^-20 of top_p, two best scores within ~3e-5, NaN or infinite
logits) comes back undecided, and the sampler runs the PyTorch path on it; so the two paths draw
the same tokens, and a row's token depends only on its own logits, parameters, seed and
position. Undecided, on the default model's logits: none of 3,840 random rows of the bench's
mix; 0.2% of a grid of every setting up to temperature 1.5 and top_p 0.99. On flat
distributions with top_p >= 0.95 (steps of ~1e-5 in mass near the cut) up to ~5%.

Measured with `nanoserve bench sampler` (shared 2-core machine, interleaved runs, medians): see
the Sampler section of docs/benchmarks.md for the figures before and after.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import torch

from nanoserve.native import load_kernels
from nanoserve.sample.stages import SamplingBatch
from nanoserve.sample.state import SamplingState

UNDECIDED = -1


def load_sampling_kernels(device: torch.device) -> ModuleType | None:
    """The compiled kernel for logits on `device`, or None (not the CPU, or no compiler)."""
    return load_kernels("sampling") if device.type == "cpu" else None


def draw_rows(kernels: ModuleType, logits: torch.Tensor, batch: SamplingBatch,
              state: SamplingState, rows: np.ndarray) -> np.ndarray:
    """Tokens for `rows` of the batch ([n] int64, host): argmax for greedy slots, the draw for
    random ones; UNDECIDED where the PyTorch path must decide."""
    tokens = kernels.sample_rows(
        logits, torch.from_numpy(rows), batch.slots_gpu, batch.positions,
        torch.from_numpy(state.uses["random"]), state.temperature, state.top_k, state.top_p,
        state.log_min_p, state.seed)
    return tokens.numpy()
