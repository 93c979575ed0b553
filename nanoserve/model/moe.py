"""A mixture-of-experts MLP (Qwen2-MoE, Qwen3-MoE): the router, and the experts run with the
tokens grouped by expert.

The router is transformers' (`Qwen3MoeTopKRouter`), op for op: logits = x @ router.T, a float32
softmax over the experts, the top k, divided by their sum when `norm_topk_prob`. Then, per step,
each expert that any token chose runs once, over all the rows routed to it, through the same
matmul calls a dense MLP makes (the op table's `bind_matmul`: oneDNN on the exact path, the
quantized kernel on the fused one) and the table's `silu_mul`; its rows are weighted and added
back into their tokens in expert order, as transformers' eager experts do (`index_add_` into
zeros), so the exact path sums each token's k terms in the same order. Qwen2-MoE adds a shared
expert that every token runs, scaled by sigmoid(x @ shared_expert_gate.T).

Under tensor parallelism each rank holds every expert's slice of the intermediate rows (and of
the shared expert's) and the whole router: every rank routes the same tokens the same way, its
down projections give partial sums, and the decoder layer all-reduces the block's output as it
does a dense MLP's.

Why grouped: a batch of T tokens needs at most min(E, T k) expert matmuls of several rows each,
where a per-token loop makes T k one-row calls; a decode step (T = 1) runs k experts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.model.arch import ArchConfig
from nanoserve.model.fused_ops import Matmul
from nanoserve.model.layer_ops import OpTable


class ExpertWeights(nn.Module):
    """One gated MLP (an expert, or the shared expert): gate and up fused into one matmul
    weight [2 I, hidden], then down [hidden, I]."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = _param(2 * intermediate_size, hidden_size)
        self.down_proj = _param(hidden_size, intermediate_size)


class MoeBlock(nn.Module):
    """A MoE layer's MLP weights: the router [E, hidden] (float, whole on every rank), E
    experts, and Qwen2-MoE's shared expert with its gate [1, hidden]."""

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        moe = arch.moe
        assert moe is not None, "a MoE block needs the model's MoeConfig"
        self.num_experts_per_tok = moe.num_experts_per_tok
        self.norm_topk_prob = moe.norm_topk_prob
        self.gate = _param(moe.num_experts, arch.hidden_size)
        self.experts = nn.ModuleList(ExpertWeights(arch.hidden_size, moe.moe_intermediate_size)
                                     for _ in range(moe.num_experts))
        shared = moe.shared_expert_intermediate_size
        self.shared_expert = ExpertWeights(arch.hidden_size, shared) if shared else None
        self.shared_expert_gate = _param(1, arch.hidden_size) if shared else None

    def gated_mlps(self) -> list[ExpertWeights]:
        """Every expert, then the shared one: the owners of the block's matmul weights."""
        shared = [] if self.shared_expert is None else [self.shared_expert]
        return [*self.experts, *shared]


def route(x: torch.Tensor, router: torch.Tensor, top_k: int, norm_topk_prob: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, hidden] -> (weights [T, k] in x's dtype, expert ids [T, k]), each token's k
    experts by falling probability: transformers' Qwen3MoeTopKRouter, op for op."""
    logits = F.linear(x, router)  # [T, E]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def _mlp(gate_up: Matmul, down: Matmul, silu_mul: Callable[[torch.Tensor], torch.Tensor]
         ) -> Matmul:
    def mlp(x: torch.Tensor) -> torch.Tensor:
        return down(silu_mul(gate_up(x)))
    return mlp


class BoundMoe:
    """A MoeBlock's weights bound to an op table: x [T, hidden] -> [T, hidden], the block's
    output (a partial sum under tensor parallelism, reduced by the caller)."""

    __slots__ = ("experts", "norm_topk_prob", "router", "shared", "shared_gate", "top_k")

    def __init__(self, block: MoeBlock, table: OpTable) -> None:
        def bind(weights: ExpertWeights) -> Matmul:
            return _mlp(table.bind_matmul(weights.gate_up_proj),
                        table.bind_matmul(weights.down_proj), table.silu_mul)

        self.router = block.gate
        self.top_k, self.norm_topk_prob = block.num_experts_per_tok, block.norm_topk_prob
        self.experts = [bind(expert) for expert in block.experts]  # type: ignore[arg-type]
        shared = block.shared_expert
        self.shared = None if shared is None else bind(shared)
        self.shared_gate = block.shared_expert_gate

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(x, self.router, self.top_k, self.norm_topk_prob)
        out = run_experts(x, weights, ids, self.experts)
        if self.shared is not None and self.shared_gate is not None:
            shared = self.shared(x)
            out = out + torch.sigmoid(F.linear(x, self.shared_gate)) * shared
        return out


def run_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                experts: list[Matmul]) -> torch.Tensor:
    """sum_j weights[t, j] * experts[ids[t, j]](x[t]) for every token t: x [T, hidden],
    weights and ids [T, k] -> [T, hidden]. Each chosen expert runs once, on its rows (tokens
    ascending), and they are added into zeros in expert order."""
    top_k = ids.shape[1]
    flat_ids = ids.reshape(-1)  # [T k], token by token
    order = torch.argsort(flat_ids, stable=True)  # the (token, slot) pairs grouped by expert
    # the one read back to the host a MoE layer makes: slicing the groups needs their sizes
    # (a sync per layer on a GPU, as transformers' own loop over the experts hit)
    counts = torch.bincount(flat_ids, minlength=len(experts)).tolist()
    tokens = order // top_k  # [T k] the token of each pair, grouped by expert
    scales = weights.reshape(-1, 1)[order]  # [T k, 1]
    out = torch.zeros_like(x)
    start = 0
    for expert, count in zip(experts, counts, strict=True):
        if count == 0:
            continue
        rows = tokens[start : start + count]
        out.index_add_(0, rows, expert(x.index_select(0, rows)) * scales[start : start + count])
        start += count
    return out


def _param(*shape: int) -> nn.Parameter:
    """A placeholder on the meta device (no memory, no init); the loader puts the weights in."""
    return nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)
