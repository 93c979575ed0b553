"""`bench step`: buckets, each step beside its floor, and `--compare-eager` (both layer paths
timed on one engine, which is left as found), on the tiny model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from helpers import make_engine

from nanoserve.bench.step import run_step_profile


def test_bench_step_prints_buckets_floors_and_both_layer_paths(tiny_model_dir: Any,
                                                               capsys: Any) -> None:
    engine = make_engine(tiny_model_dir("llama"), quantization="int8")
    plan = engine.runner.plan  # the runner's choice of the layers' path
    seen: list[bool] = []
    forward = plan.forward

    def recording(*args: Any) -> Any:
        seen.append(plan.use_native_layers)
        return forward(*args)

    plan.forward = recording
    args = argparse.Namespace(batch_sizes="1,2", context_len=16, repeats=1, compare_eager=True,
                              compare_compiled=False, rows_curve=0)
    profiles = run_step_profile(engine, args)
    printed = capsys.readouterr().out
    assert [p.batch for p in profiles] == [1, 2]
    assert "| **step** |" in printed and "step / floor |" in printed
    assert "eager / native |" in printed
    for table in ("step / floor |", "eager / native |"):  # a row for each batch in each
        (section,) = [block for block in printed.split("\n\n") if table in block]
        rows = [line for line in section.splitlines() if line.startswith(("| 1 | ", "| 2 | "))]
        assert len(rows) == 2, section
    # the int8 kernel's instruction peak beside the floors, its table only for batches whose
    # matmuls run outside the one region (here the one region holds them all)
    assert "instruction peak: the many-row kernel on data in L1" in printed
    assert "of the kernel peak |" in printed
    assert True in seen and False in seen  # both paths ran
    assert plan.use_native_layers is True and not engine.has_unfinished()
