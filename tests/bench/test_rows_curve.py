"""`bench step --rows-curve`: every step of the curve scores all its rows."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from helpers import make_engine

from nanoserve.bench.step import format_rows_curve, rows_curve
from nanoserve.protocol import StepInput, StepOutput


def test_the_curve_scores_one_plus_k_rows_per_step(tiny_model_dir: Any) -> None:
    engine = make_engine(tiny_model_dir("llama"), quantization="none")
    rows_seen: list[int] = []
    inner = engine.executor

    class Counting:
        def execute_step(self, step: StepInput) -> StepOutput:
            rows_seen.append(int(step.num_sample_rows.sum()))
            return inner.execute_step(step)

        def shutdown(self) -> None:
            inner.shutdown()

    engine.executor = Counting()  # type: ignore[assignment]
    curve = rows_curve(engine, context_len=32, max_drafts=2, repeats=2)
    assert [rows for rows, _ in curve] == [1, 2, 3]
    assert all(seconds > 0 for _, seconds in curve)
    assert rows_seen[-9:] == [1, 1, 1, 2, 2, 2, 3, 3, 3]  # warm-up + 2 timed, per shape
    assert not engine.has_unfinished()
    assert "| 3 |" in format_rows_curve(curve, 32)
