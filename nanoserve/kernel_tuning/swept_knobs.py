"""The schedule's knobs the tuner times on sweeps of their own, one knob a shape class: decode
attention's KV-row prefetch hint and its walk step (`AttentionWork`), the DeltaNet strips
(`DeltaNetWork`). Each says which `Schedule` field it sets, the key its cache entry keeps the
choice under ({key: choice}), its candidates (the default first), the sweeps a candidate is
timed on and the bytes they read (the rate column of `nanoserve tune`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from nanoserve.kernel_tuning.schedule import (
    ATTENTION_BLOCK_TOKENS,
    ATTENTION_HINTS,
    DELTA_NET_STRIP_COLUMNS,
)
from nanoserve.kernel_tuning.workloads import (
    BLOCK_SWEEPS,
    HINT_SWEEPS,
    STRIP_SWEEPS,
    AttentionWork,
    DeltaNetWork,
)


@dataclass(frozen=True)
class SweptKnob:
    name: str  # the shape class: its cache entry's name and its rows' label
    field: str  # the Schedule field it sets
    entry_key: str
    candidates: tuple[Any, ...]
    sweeps: tuple[Callable[[], Callable[[], None]], ...]  # each makes one sweep's run
    num_bytes: int  # what the sweeps read, all together
    label: Callable[[Any], str]  # a candidate's label in the rows


def swept_knobs(attention: AttentionWork | None, delta: DeltaNetWork | None
                ) -> list[SweptKnob]:
    """The knobs of this model's work, in the order they are tuned."""
    knobs = []
    if attention is not None:
        knobs.append(SweptKnob(
            attention.name, "attention_hint", "hint", ATTENTION_HINTS,
            tuple(partial(attention.sweep, *sweep) for sweep in HINT_SWEEPS),
            len(HINT_SWEEPS) * attention.num_bytes, str.upper))
        knobs.append(SweptKnob(
            attention.name.replace("attention", "attention blocking", 1),
            "attention_block_tokens", "block_tokens", ATTENTION_BLOCK_TOKENS,
            tuple(partial(attention.sweep, *sweep) for sweep in BLOCK_SWEEPS),
            len(BLOCK_SWEEPS) * attention.num_bytes, lambda keys: f"{keys} keys a step"))
    if delta is not None:
        knobs.append(SweptKnob(
            delta.name, "delta_net_strip_columns", "columns", DELTA_NET_STRIP_COLUMNS,
            tuple(partial(delta.sweep, *sweep) for sweep in STRIP_SWEEPS),
            sum(delta.num_bytes(n, layers or delta.num_layers) for n, _, layers in STRIP_SWEEPS),
            lambda columns: f"{columns} columns"))
    return knobs
