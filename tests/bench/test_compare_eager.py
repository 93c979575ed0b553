"""`bench step --compare-eager`: both layer paths timed on one engine, which is left as found."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from helpers import make_engine

from nanoserve.bench.eager import compare_eager, format_eager


def test_both_paths_are_timed_and_the_engine_is_left_as_found(tiny_model_dir: Any) -> None:
    engine = make_engine(tiny_model_dir("llama"), quantization="int8")
    model = engine.loaded.model
    seen: list[bool] = []
    forward = model.forward

    def recording(*args: Any) -> Any:
        seen.append(model.use_native_layers)
        return forward(*args)

    model.forward = recording
    figures = compare_eager(engine, [1, 2], context_len=16, repeats=2, rounds=2)
    assert [batch for batch, _, _ in figures] == [1, 2]
    assert all(native > 0 and eager > 0 for _, native, eager in figures)
    assert True in seen and False in seen
    assert model.use_native_layers is True and not engine.has_unfinished()
    assert format_eager(figures, rounds=2).splitlines()[-1].startswith("| 2 |")
