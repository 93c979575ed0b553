"""`bench step --compare-compiled`: the decoder layers as one native region against the same
kernels' layer loop compiled by `torch.compile`, the alternative issue 22 names.

The compiled loop is the fused Python layer loop (llama.py's `BoundDecoderLayer.forward` over
layer_ops.py's fused table) written over the kernels' dispatcher ops (`torch.ops.nanoserve.*`,
registered for the CPU key, each given a fake implementation here so Dynamo can trace it), and
compiled whole (`fullgraph`) by Inductor with its C++ wrapper. The kernels are the same, in
the same order, so the hidden states must be the native stack's bit for bit; the comparison
checks that on one step before it times anything. It stands in for the native stack inside
the engine (the runner's `ForwardPlan.swap_layer_stack`), so whole steps are timed,
interleaved with the native ones on one engine, as `--compare-eager` does.

Measured on the 2-core Zen 1 (docs/benchmarks.md): the graph is the nine kernel calls a layer
with nothing to fuse between them, so it runs as the dispatcher path does, each kernel its own
parallel region; the C++ wrapper takes the Python out of the eager loop but not the fork/joins.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from typing import Any, cast

import torch

from nanoserve.bench.roofline import start_decoding
from nanoserve.bench.timing import median_seconds
from nanoserve.engine.core import EngineCore
from nanoserve.engine.model_runner import ModelRunner
from nanoserve.model.llama import CausalLM
from nanoserve.model.native_layers import native_module
from nanoserve.model.quant_linear import QuantizedWeight


@functools.cache
def register_fakes() -> None:
    """Shapes of the kernels' dispatcher ops, for tracing (once a process: a second
    registration of the same op raises)."""
    assert native_module() is not None, "the kernels load (and register their ops) first"
    fake = torch.library.register_fake

    @fake("nanoserve::packed_matmul")
    def _(x: torch.Tensor, packed: torch.Tensor, ggml_type: int, n: int, k: int,
          wide: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty(x.shape[0], n)

    @fake("nanoserve::rms_norm")
    def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.empty_like(x)

    @fake("nanoserve::add_rms_norm")
    def _(hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
          eps: float) -> torch.Tensor:
        return torch.empty_like(hidden)

    @fake("nanoserve::silu_mul")
    def _(gate_up: torch.Tensor) -> torch.Tensor:
        return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)

    @fake("nanoserve::rope_store")
    def _(qkv: torch.Tensor, bias: Any, q_norm: Any, k_norm: Any, eps: float,
          cos_table: torch.Tensor, *rest: Any) -> torch.Tensor:
        k_cache = rest[-3]  # [Hkv, blocks, block_size, row]; qkv [T, (H + 2 Hkv) * D]
        head_dim = cos_table.shape[1]
        num_heads = qkv.shape[1] // head_dim - 2 * k_cache.shape[0]
        return qkv.new_empty(qkv.shape[0], num_heads, head_dim)

    @fake("nanoserve::decode_attention")
    def _(*args: Any) -> None:
        return None


class CompiledLayers:
    """The native stack's `forward`, as the kernels' layer loop under `torch.compile`."""

    def __init__(self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 table_width: int, cpp_wrapper: bool = True) -> None:
        arch = model.arch
        register_fakes()
        # every projection a packed quantized weight, as the native stack it stands in for
        self.layers = [(layer, [cast(QuantizedWeight, w).packed_args() for w in (
            layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)], k, v)
            for layer, (k, v) in zip(model.decoder_layers, kv_caches, strict=True)]
        self.final_norm, self.eps = model.norm, arch.rms_norm_eps
        self.scale = 1.0 / math.sqrt(arch.head_dim)
        # Static shapes: the block table is padded to its full width (a step's grows with its
        # longest context), so a batch size compiles once. (With dynamic shapes Inductor 2.13
        # failed in its scheduler, KeyError 'op8'.)
        self.table_width = table_width
        self.compiled = torch.compile(self._loop, fullgraph=True, dynamic=False,
                                      options={"cpp_wrapper": cpp_wrapper})

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor, cache_index: torch.Tensor, block_table: torch.Tensor,
                context_lens: torch.Tensor) -> torch.Tensor:
        padding = self.table_width - block_table.shape[1]  # block 0 where no context reads
        table = torch.nn.functional.pad(block_table, (0, padding)) if padding else block_table
        return self.compiled(hidden, cos, sin, positions, cache_index, table, context_lens)

    def _loop(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              positions: torch.Tensor, cache_index: torch.Tensor, block_table: torch.Tensor,
              context_lens: torch.Tensor) -> torch.Tensor:
        ops, eps = torch.ops.nanoserve, self.eps
        delta = None
        for layer, (qkv_w, o_w, gate_up_w, down_w), k_cache, v_cache in self.layers:
            x = (ops.rms_norm(hidden, layer.input_layernorm, eps) if delta is None
                 else ops.add_rms_norm(hidden, delta, layer.input_layernorm, eps))
            qkv = ops.packed_matmul(x, *qkv_w)
            q = ops.rope_store(qkv, layer.qkv_bias, layer.q_norm, layer.k_norm, eps, cos, sin,
                               positions, k_cache, v_cache, cache_index)
            attn = torch.empty_like(q)
            ops.decode_attention(q, k_cache, v_cache, block_table, context_lens, self.scale,
                                 attn)
            o = ops.packed_matmul(attn.view(q.shape[0], -1), *o_w)
            x = ops.add_rms_norm(hidden, o, layer.post_attention_layernorm, eps)
            delta = ops.packed_matmul(ops.silu_mul(ops.packed_matmul(x, *gate_up_w)), *down_w)
        assert delta is not None, "a model has at least one layer"
        return ops.add_rms_norm(hidden, delta, self.final_norm, eps)


class _Recorder:
    """Stands in for a stack for one step and keeps its inputs (hidden as it came in)."""

    def __init__(self, stack: Any) -> None:
        self.stack = stack
        self.args: tuple[torch.Tensor, ...] | None = None

    def forward(self, hidden: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        self.args = (hidden.clone(), *rest)
        return self.stack.forward(hidden, *rest)


def compare_compiled(engine: EngineCore, batch_sizes: list[int], context_len: int,
                     repeats: int, rounds: int = 6, cpp_wrapper: bool = True
                     ) -> list[tuple[int, float, float, float, bool]]:
    """(batch, native step seconds, compiled step seconds, seconds to compile, whether one
    step's final hidden states were the same bits), medians over interleaved rounds."""
    runner = engine.runner
    assert isinstance(runner, ModelRunner), "a benchmark runs a model (no zero-cost runner)"
    model, plan = runner.model, runner.plan
    if model.arch.gemma4 is not None or model.is_hybrid:  # (CompiledLayers: dense layers)
        raise RuntimeError("--compare-compiled times the dense families' layer; Gemma 4's "
                           "and a hybrid's native stacks are compared with --compare-eager")
    figures: list[tuple[int, float, float, float, bool]] = []
    for batch in batch_sizes:
        ids = start_decoding(engine, batch, context_len, 2 * rounds * (repeats + 1) + 3,
                             "compiled")
        native = plan.layer_stack
        if native is None:
            raise RuntimeError("the layers do not run as one native call here: "
                               "--compare-compiled needs the fused CPU path, packed weights "
                               "and one rank, without --enforce-eager")
        compiled = CompiledLayers(model, engine.runner.kv_caches,
                                  engine.block_table.table.shape[1], cpp_wrapper)
        recorder = _Recorder(native)
        plan.swap_layer_stack(recorder)
        engine.step()
        assert recorder.args is not None, "the step ran the layer stack"
        hidden, *rest = recorder.args
        start = time.perf_counter()  # the first call traces and compiles
        got = compiled.forward(hidden.clone(), *rest)
        compile_seconds = time.perf_counter() - start
        same = torch.equal(got, native.forward(hidden.clone(), *rest))
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(rounds):
            for is_native in (True, False):
                plan.swap_layer_stack(native if is_native else compiled)
                times[is_native].append(median_seconds(engine.step, repeats))
        plan.swap_layer_stack(native)
        for request_id in ids:
            engine.abort(request_id)
        figures.append((batch, statistics.median(times[True]), statistics.median(times[False]),
                        compile_seconds, same))
    return figures


def format_compiled(figures: list[tuple[int, float, float, float, bool]],
                    rounds: int = 6) -> str:
    lines = [f"decoder layers: one native region vs the kernels' layer loop under torch.compile "
             f"(Inductor), medians of {rounds} interleaved rounds",
             "| batch | native | compiled | compiled / native | compiling | same bits |",
             "|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {batch} | {native * 1e3:.2f} ms | {compiled * 1e3:.2f} ms | "
              f"{compiled / native:.2f}x | {seconds:.0f} s | {'yes' if same else 'NO'} |"
              for batch, native, compiled, seconds, same in figures]
    return "\n".join(lines)
