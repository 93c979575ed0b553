"""The kernels' schedule (`csrc/schedule.h`) as Python holds it: when bytes are fetched and how
work is split, never what is computed, so every schedule gives the same bits.

A `Schedule` is today's constants (`DEFAULT`) with the tuner's choices over them; `flat()` is
what each kernel module's `set_schedule` takes (`native.set_kernel_schedule` sets it in every
module this process loads). The candidate sets are what the tuner times (`tuner.py`); the
figures that made today's constants the defaults are beside them in the C++ headers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# csrc/gguf_blocks.h's packed layouts, in its enum's order, and the GGUF types each holds
LAYOUTS = ("U4H", "U4F", "U5H", "U5F", "S8H", "S8F2")
LAYOUT_OF_TYPE = {3: "U4H", 2: "U4F", 12: "U4F", 7: "U5H", 6: "U5F", 13: "U5F", 8: "S8H",
                  14: "S8F2"}
TYPE_NAMES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K",
              14: "Q6_K"}
# _mm_prefetch's hints, as schedule.h numbers them
HINTS = {"none": 0, "nta": 1, "t2": 2, "t1": 3, "t0": 4}
ROW_CLASSES = (1, 8)  # a row class's representative: one row; 2 rows and more (below wide)

# what the tuner may choose from
PREFETCH_HINTS = ("nta", "t0", "t1", "t2")
PREFETCH_BYTES = (512, 1024, 2048, 4096, 8192, 16384)
ATTENTION_HINTS = ("t1", "t0", "t2", "nta", "none")
# the keys decode attention reads a step of its walk: 1, 2 or 4 tiles (csrc/paged_attend.h);
# the 32-key tile, where the softmax rescales, stays: every size gives the same bits. On a
# 2-core AMD Zen 3 (one thread, batch 1-32, contexts 256 and 2,048, 16 layers of 8x64 caches;
# a loaded machine) 32 won nearly everywhere: 64 took 0.94-1.11x its time, 128 0.99-1.61x
ATTENTION_BLOCK_TOKENS = (32, 64, 128)
WIDE_MIN_ROWS = (16, 24, 32, 48, 64, 128, 256)
PAIRS_MIN_ROWS = (1, 2, 4, 8, 16)  # the avx512 tier's pairs kernel from this many rows
AMX_MIN_ROWS = (1, 4, 8, 16, 32, 64, 128)  # the amx tiers' tiles from this many rows
DEFAULT_AMX_MIN_ROWS = 16
# the value columns a DeltaNet strip carries through a sequence's tokens (csrc/delta_net.h): W
# FMA chains of 8 columns, W = 1, 2, 4 or 8 (8 spills registers on AVX2; still timed). Every
# width gives the same bits; 32 (four chains) is the width the kernel was written with
DELTA_NET_STRIP_COLUMNS = (32, 8, 16, 64)
DEFAULT_STRIP = DELTA_NET_STRIP_COLUMNS[0]
SPIN_US = (0, 5, 10, 20, 50)
GRAIN_BYTES = (4096, 16384, 65536)


@dataclass(frozen=True)
class Prefetch:
    """A streamed weight's software prefetch: the hint, and how many bytes ahead."""

    hint: str = "nta"
    bytes: int = 1024

    def __post_init__(self) -> None:
        if self.hint not in HINTS:
            raise ValueError(f"prefetch hint {self.hint!r} is not one of {list(HINTS)}")
        if not 0 <= self.bytes <= 1 << 20:
            raise ValueError(f"prefetch distance {self.bytes} is not in [0, 1 MiB]")

    @property
    def label(self) -> str:
        if self.hint == "none":
            return "none"
        return f"{self.hint.upper()} {self.bytes // 1024} KB" if self.bytes >= 1024 \
            else f"{self.hint.upper()} {self.bytes} B"


def prefetch_candidates() -> list[Prefetch]:
    return [Prefetch("none", 0)] + [Prefetch(h, b) for h in PREFETCH_HINTS
                                    for b in PREFETCH_BYTES]


_DEFAULT_WEIGHTS = tuple((Prefetch(), Prefetch()) for _ in LAYOUTS)


@dataclass(frozen=True)
class Schedule:
    """Every schedule choice of the kernels (see csrc/schedule.h for each one's meaning)."""

    weights: tuple[tuple[Prefetch, ...], ...] = _DEFAULT_WEIGHTS  # [layout][row class]
    attention_hint: str = "t1"
    wide_min_rows: int = 16
    pairs_min_rows: int = 16
    amx_min_rows: int = DEFAULT_AMX_MIN_ROWS
    spin_us: int = 10
    grain_bytes: int = 16384
    attention_block_tokens: int = ATTENTION_BLOCK_TOKENS[0]
    delta_net_strip_columns: int = DELTA_NET_STRIP_COLUMNS[0]

    def __post_init__(self) -> None:
        if len(self.weights) != len(LAYOUTS) or any(len(w) != len(ROW_CLASSES)
                                                     for w in self.weights):
            raise ValueError("a schedule has a prefetch per layout and row class")
        if self.attention_hint not in HINTS:
            raise ValueError(f"attention hint {self.attention_hint!r} is not one of "
                             f"{list(HINTS)}")
        if self.attention_block_tokens not in ATTENTION_BLOCK_TOKENS:
            raise ValueError(f"attention_block_tokens {self.attention_block_tokens} is not one "
                             f"of {list(ATTENTION_BLOCK_TOKENS)}")
        if self.delta_net_strip_columns not in DELTA_NET_STRIP_COLUMNS:
            raise ValueError(f"delta_net_strip_columns {self.delta_net_strip_columns} is not "
                             f"one of {sorted(DELTA_NET_STRIP_COLUMNS)}")
        if self.wide_min_rows < WIDE_MIN_ROWS[0]:
            raise ValueError(f"wide_min_rows is at least {WIDE_MIN_ROWS[0]}, got "
                             f"{self.wide_min_rows}")

    def prefetch(self, layout: str, rows: int) -> Prefetch:
        return self.weights[LAYOUTS.index(layout)][row_class(rows)]

    def with_prefetch(self, layout: str, rows: int, prefetch: Prefetch) -> Schedule:
        i, j = LAYOUTS.index(layout), row_class(rows)
        layout_row = tuple(prefetch if k == j else p for k, p in enumerate(self.weights[i]))
        weights = tuple(layout_row if k == i else w for k, w in enumerate(self.weights))
        return replace(self, weights=weights)

    @classmethod
    def from_flat(cls, flat: list[int]) -> Schedule:
        """The inverse of `flat`; a list from before attention_block_tokens or
        delta_net_strip_columns (a value or two fewer) reads with their defaults."""
        names = {number: name for name, number in HINTS.items()}
        weight_values = 2 * len(LAYOUTS) * len(ROW_CLASSES)
        pairs = iter(zip(flat[0:weight_values:2], flat[1:weight_values:2], strict=True))
        weights = tuple(tuple(Prefetch(names[h], b) for h, b in (next(pairs), next(pairs)))
                        for _ in LAYOUTS)
        rest = flat[weight_values:]
        if len(rest) == 6:
            rest = [rest[0], ATTENTION_BLOCK_TOKENS[0], *rest[1:]]
        if len(rest) == 7:
            rest = [*rest, DELTA_NET_STRIP_COLUMNS[0]]
        attention, block, wide, pairs_from, amx_from, spin, grain, strip = rest
        return cls(weights, names[attention], wide, pairs_from, amx_from, spin, grain, block,
                   strip)

    def flat(self) -> list[int]:
        """What `set_schedule` takes (schedule.h's `set_flat`)."""
        out: list[int] = []
        for layout in self.weights:
            for p in layout:
                out += [HINTS[p.hint], p.bytes]
        return [*out, HINTS[self.attention_hint], self.attention_block_tokens,
                self.wide_min_rows, self.pairs_min_rows, self.amx_min_rows, self.spin_us,
                self.grain_bytes, self.delta_net_strip_columns]

    def describe(self, layouts: list[str] | None = None, tier: str | None = None) -> str:
        """One line for logs and /get_server_info: which kernel runs which rows in `tier`, the
        prefetch of the given layouts (all that differ from the defaults when None), then the
        rest."""
        parts = []
        if tier in ("amx", "amx-emu"):
            parts.append(f"{tier} tiles from {self.amx_min_rows} rows, avx512 below")
        for layout in LAYOUTS:
            rows = self.weights[LAYOUTS.index(layout)]
            if (layouts is None and rows != _DEFAULT_WEIGHTS[0]) or (layouts and layout
                                                                      in layouts):
                names = "/".join(TYPE_NAMES[t] for t, lay in LAYOUT_OF_TYPE.items()
                                 if lay == layout)
                parts.append(f"{names} prefetch {rows[0].label} (1 row), {rows[1].label} "
                             "(more)")
        parts.append(f"attention prefetch {self.attention_hint.upper()}, "
                     f"{self.attention_block_tokens} keys a step")
        parts.append(f"wide form from {self.wide_min_rows} rows")
        if self.pairs_min_rows < self.wide_min_rows:
            parts.append(f"pairs from {self.pairs_min_rows} rows")
        parts.append(f"barrier spin {self.spin_us} us")
        if self.delta_net_strip_columns != DEFAULT_STRIP:
            parts.append(f"DeltaNet strips of {self.delta_net_strip_columns} columns")
        return "; ".join(parts)


def row_class(rows: int) -> int:
    return 0 if rows <= 1 else 1


DEFAULT = Schedule()


def running_schedule() -> Schedule:
    """The schedule this process's kernels run (`native.set_kernel_schedule`'s, else DEFAULT)."""
    from nanoserve.native import kernel_schedule

    flat = kernel_schedule()
    return DEFAULT if flat is None else Schedule.from_flat(flat)
