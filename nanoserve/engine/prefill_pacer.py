"""How many prompt tokens a step may carry while other requests decode, from measured step times.

A prompt's chunk rides in the same forward pass as the running decodes, so the streams wait for
it: a 512-token chunk at a 6,000-token context is a step of ~1 s on a 2-core CPU, against ~5 ms
for the decodes alone. A fixed token cap (`--long-prefill-token-threshold`) cannot bound that,
because a prompt token's cost grows with the context it attends to. The pacer keeps the step
near `factor` times a decode-only step instead (`--prefill-pacing`):

- A prompt token at position p costs `1 + p / K` units: one for its share of the matmuls, and
  its attention over p keys, where K = (a token's matmul multiply-adds) / (its attention
  multiply-adds per key) / ATTENTION_COST_RATIO, read from the model's shape.
- The engine reports each step's time. Decode-only steps give D, the streams' step alone (a
  moving average). Steps with decodes and prompt tokens give the seconds a unit costs beside
  them, (step - D) / units (a moving average too, so it follows the machine and the context).
- A step with decodes may then carry (factor - 1) * D worth of units, but never fewer than
  `MIN_CHUNK_TOKENS` tokens of a prompt (or what is left of it). Each step reads the weights
  and every request's cached keys and values, whatever its rows, so tiny chunks cost nearly as
  much as larger ones and make the prompt wait far longer. Measured on a 2-core Zen 4 with the
  default model, a 6,000-token prompt beside running streams: pacing down to single tokens
  made its first token 5-7x later (one token at that context took a step of 15-30 ms against
  4.4 ms for the decode alone); floors of 16, 32 and 64 tokens gave the streams a p99 gap of
  126-206, 165-226 and 352-407 ms and the prompt's first token 2x, 1.15x and 1.2x later than
  unpaced (whose p99 gap is ~2 s): docs/benchmarks.md, "Pacing a long prompt beside running
  streams". Floors of 4 and 2, with a few prompt rows attended in blocks beside the decodes
  (csrc/team_forward.h), still left the streams' p99 at 3.6-8.8x their gap alone for a 2-2.5x
  later first token: every prompt row at that context reads the whole context ("An int8
  cache's prompt in tiles, prompt rows by blocks beside decodes, ...").

Only prompts longer than the step budget are paced (the scheduler's `_paced`): a shorter one
stalls the streams for one step at most. Nothing is capped before D is known or when no request
decodes (a prompt alone runs at the full budget). The cap only changes how a prompt is
chunked, never a token's result: attention and the matmuls give each row the same bits in any
chunk (the engine's invariance tests).
"""

from __future__ import annotations

import math

# Seconds per multiply-add of attention over those of the quantized matmuls, measured on a 2-core
# Zen 4 (docs/benchmarks.md, "Pacing a long prompt beside running streams"); only the shape of
# the cost curve depends on it, the measured unit cost absorbs the rest.
ATTENTION_COST_RATIO = 4.0
# before the first step beside decodes is measured, a prompt takes this many units
FIRST_UNITS = 32.0
SMOOTHING = 0.3  # weight of the newest step in the moving averages
# the smallest prompt chunk beside decodes (16, 32 and 64 measured, see above)
MIN_CHUNK_TOKENS = 32


def tokens_per_unit_of_context(hidden_size: int, intermediate_size: int, num_layers: int,
                               num_heads: int, num_kv_heads: int, head_dim: int) -> float:
    """K: how many keys of context cost as much as one token's matmuls."""
    projections = hidden_size * head_dim * (2 * num_heads + 2 * num_kv_heads) \
        + 3 * hidden_size * intermediate_size
    attention_per_key = 2 * num_heads * head_dim  # q·k, then p·v
    return projections / attention_per_key / ATTENTION_COST_RATIO


class PrefillPacer:
    """The prompt-token allowance of the next step, learned from the steps before it."""

    def __init__(self, factor: float, context_scale: float) -> None:
        """`factor`: a step with decodes and prompt tokens aims at factor x a decode-only step;
        `context_scale`: K above (`tokens_per_unit_of_context`)."""
        if factor <= 1.0:
            raise ValueError(f"the pacing factor must be > 1, got {factor}")
        self.factor = factor
        self.context_scale = context_scale
        self.decode_seconds: float | None = None  # D
        self.unit_seconds: float | None = None

    def units(self, start: int, num_tokens: int) -> float:
        """The cost of prompt tokens [start, start + num_tokens), in units."""
        n = num_tokens
        return n + (n * start + n * (n - 1) / 2) / self.context_scale

    def chunk(self, start: int, num_tokens: int, units: float) -> int:
        """A prompt chunk of up to `num_tokens` from `start`, cut to `units` but not below
        MIN_CHUNK_TOKENS (nor above `num_tokens`)."""
        return min(num_tokens, max(MIN_CHUNK_TOKENS, self.tokens_within(start, units)))

    def tokens_within(self, start: int, units: float) -> int:
        """The most tokens from `start` whose cost fits `units` (0 if not even one)."""
        k = self.context_scale
        # n^2 / 2k + n (1 + (start - 1/2) / k) - units = 0
        b = 1.0 + (start - 0.5) / k
        n = (-b + math.sqrt(b * b + 2.0 * units / k)) * k
        n = max(0, int(n))
        while n > 0 and self.units(start, n) > units:  # floating point at the edge
            n -= 1
        return n

    def allowance(self) -> float | None:
        """Units the next step may carry beside its decodes; None: no cap (D not known yet)."""
        if self.decode_seconds is None:
            return None
        if self.unit_seconds is None:
            return FIRST_UNITS
        return (self.factor - 1.0) * self.decode_seconds / self.unit_seconds

    def observe(self, num_decodes: int, prompt_units: float, seconds: float) -> None:
        """One finished step: its decoding requests, its prompt tokens' units, its wall time."""
        if num_decodes == 0:
            return  # a prompt alone says nothing about the streams' step
        if prompt_units == 0:
            self.decode_seconds = _blend(self.decode_seconds, seconds)
        elif self.decode_seconds is not None:
            # a step barely slower than D (noise) must not make units look free
            extra = max(seconds - self.decode_seconds, 0.1 * self.decode_seconds)
            self.unit_seconds = _blend(self.unit_seconds, extra / prompt_units)


def _blend(average: float | None, value: float) -> float:
    return value if average is None else (1 - SMOOTHING) * average + SMOOTHING * value
