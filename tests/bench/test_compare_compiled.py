"""`bench step --compare-compiled`: the kernels' layer loop under torch.compile stands in for the
native stack inside the engine, gives its bits, and the engine gets its own stack back; on the
tiny model, with Inductor's Python wrapper (the C++ one compiles for minutes)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from helpers import make_engine

from nanoserve.bench import compiled
from nanoserve.bench.compiled import compare_compiled, format_compiled


def test_compiled_layers_give_the_native_bits_inside_the_engine(tiny_model_dir: Any,
                                                               monkeypatch: Any) -> None:
    engine = make_engine(tiny_model_dir("llama"), quantization="int8")
    calls = []
    forward = compiled.CompiledLayers.forward

    def counting(self: Any, *args: Any) -> Any:
        calls.append(args[0].shape[0])  # the step's tokens
        return forward(self, *args)

    monkeypatch.setattr(compiled.CompiledLayers, "forward", counting)
    figures = compare_compiled(engine, [1, 2], context_len=16, repeats=1, rounds=1,
                               cpp_wrapper=False)
    assert [(batch, same) for batch, _, _, _, same in figures] == [(1, True), (2, True)]
    assert all(native > 0 and took > 0 and seconds > 0
               for _, native, took, seconds, _ in figures)
    # the bit check, then a warm-up and one timed step inside the engine, per batch
    assert calls == [1, 1, 1, 2, 2, 2]
    plan = engine.runner.plan
    assert type(plan.layer_stack).__name__ == "LayerStack" and not engine.has_unfinished()
    table = format_compiled(figures, rounds=1)
    assert "| 1 | " in table and "| 2 | " in table and "| yes |" in table
