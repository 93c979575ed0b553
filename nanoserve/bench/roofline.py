"""A decode step beside its matmuls alone: how close the engine runs to the machine's floor.

"The matmuls alone" are the step's matrix products, run back to back with nothing else: every
layer's projections (qkv, o, gate/up, down; a MoE layer's k experts) and the LM head on `batch`
rows, with the model's own (packed) weights and kernels, plus attention's two products (QK^T
and PV) over contiguous keys and values of the step's context length. Everything else in a
real step (norms, RoPE, gathering KV blocks, softmax, sampling, Python) is overhead on top of
that floor.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from nanoserve.bench.timing import median_seconds
from nanoserve.engine.core import EngineCore
from nanoserve.model.linear import linear
from nanoserve.model.llama import CausalLM, DecoderLayer
from nanoserve.sampling_params import SamplingParams


@dataclass
class MatmulTimes:
    projections: float  # seconds
    attention: float

    @property
    def total(self) -> float:
        return self.projections + self.attention


def start_decoding(engine: EngineCore, batch: int, context_len: int, num_steps: int,
                   tag: str) -> list[str]:
    """Add `batch` random-token requests and step until every one is decoding; their ids.

    Each gets enough `max_tokens` to decode through `num_steps` more steps."""
    rng = random.Random(1)
    vocab = engine.model_info.arch.vocab_size
    # Early requests decode while later ones still prefill (chunked): room for all those steps.
    budget = engine.config.scheduler.max_num_batched_tokens
    prefill_steps = batch * context_len // max(1, budget - batch) + 2
    params = SamplingParams(temperature=0.0, max_tokens=prefill_steps + num_steps + 8,
                            ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, [rng.randrange(3, vocab) for _ in range(context_len)],
                           params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()  # prefill everything first
    if len(engine.scheduler.running) != batch:
        raise RuntimeError(f"only {len(engine.scheduler.running)} of {batch} requests fit the "
                           "KV cache and sequence cap at once; raise --kv-cache-memory")
    return ids


def measure_decode_step(engine: EngineCore, batch: int, context_len: int,
                        repeats: int = 10) -> float:
    """Median seconds of one engine step with `batch` requests decoding at ~context_len."""
    ids = start_decoding(engine, batch, context_len, repeats, "roofline")
    seconds = median_seconds(engine.step, repeats)
    for request_id in ids:
        engine.abort(request_id)
    return seconds


def _step_mlps(layer: DecoderLayer) -> list[tuple[Any, Any]]:
    """(gate_up, down) of each MLP a row runs through: the dense one, or a MoE layer's first
    k experts (standing in for the k its router picks) and its shared expert."""
    moe = layer.moe
    if moe is None:
        return [(layer.gate_up_proj, layer.down_proj)]
    mlps = [*moe.experts[: moe.num_experts_per_tok]]
    if moe.shared_expert is not None:
        mlps.append(moe.shared_expert)
    return [(mlp.gate_up_proj, mlp.down_proj) for mlp in mlps]


@torch.inference_mode()
def measure_matmuls(model: CausalLM, batch: int, context_len: int,
                    repeats: int = 10) -> MatmulTimes:
    arch = model.arch
    device = model.norm.device  # the embedding may be a quantized weight
    dtype = model.norm.dtype

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype)

    x = rand(batch, arch.hidden_size)
    attn_out = rand(batch, arch.q_size)
    mlps = [_step_mlps(layer) for layer in model.decoder_layers]
    acts = {w.shape[1]: rand(batch, w.shape[1]) for layer in mlps for _, w in layer}

    def projections() -> None:
        for layer, mlp in zip(model.decoder_layers, mlps, strict=True):
            linear(x, layer.qkv_proj, layer.qkv_bias)
            linear(attn_out, layer.o_proj)
            for gate_up, down in mlp:
                linear(x, gate_up)
                linear(acts[down.shape[1]], down)
        linear(x, model.lm_head)

    group = arch.num_heads // arch.num_kv_heads
    q = rand(batch, arch.num_kv_heads, group, arch.head_dim)
    keys = rand(batch, arch.num_kv_heads, context_len, arch.head_dim)
    values = rand(batch, arch.num_kv_heads, context_len, arch.head_dim)

    def attention() -> None:
        for _ in model.layers:
            scores = torch.matmul(q, keys.transpose(-1, -2))  # [B, Hkv, group, L]
            torch.matmul(scores, values)  # [B, Hkv, group, D]

    return MatmulTimes(median_seconds(projections, repeats), median_seconds(attention, repeats))
