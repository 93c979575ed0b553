"""A mixture-of-experts MLP (Qwen2-MoE, Qwen3-MoE): the router, and the experts run with the
tokens grouped by expert.

The router is transformers' (`Qwen3MoeTopKRouter`), op for op: logits = x @ router.T, a float32
softmax over the experts, the top k, divided by their sum when `norm_topk_prob`. Then, per step,
each expert that any token chose runs once, over all the rows routed to it, through the same
matmul calls a dense MLP makes (the op table's `bind_matmul`: oneDNN on the exact path, the
quantized kernel on the fused one) and the table's `silu_mul`; each row's output is weighted,
and a token's k terms are added in expert order, the order in which transformers' eager experts
add them (`index_add_` into zeros), so the exact path sums them as it does. Qwen2-MoE adds a
shared expert that every token runs, scaled by sigmoid(x @ shared_expert_gate.T). The routing's
small ops run on one thread (`_one_thread`).

Under tensor parallelism each rank holds every expert's slice of the intermediate rows (and of
the shared expert's) and the whole router: every rank routes the same tokens the same way, its
down projections give partial sums, and the decoder layer all-reduces the block's output as it
does a dense MLP's.

Why grouped: a batch of T tokens needs at most min(E, T k) expert matmuls of several rows each,
where a per-token loop makes T k one-row calls; a decode step (T = 1) runs k experts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

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
    output (a partial sum under tensor parallelism, reduced by the caller). `act` is the
    layer's gated activation, the table's `silu_mul` unless given."""

    __slots__ = ("experts", "norm_topk_prob", "router", "shared", "shared_gate", "top_k")

    def __init__(self, block: MoeBlock, table: OpTable,
                 act: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        def bind(weights: ExpertWeights) -> Matmul:
            return _mlp(table.bind_matmul(weights.gate_up_proj),
                        table.bind_matmul(weights.down_proj), act or table.silu_mul)

        self.router = block.gate
        self.top_k, self.norm_topk_prob = block.num_experts_per_tok, block.norm_topk_prob
        self.experts = [bind(expert) for expert in block.experts]  # type: ignore[arg-type]
        shared = block.shared_expert
        self.shared = None if shared is None else bind(shared)
        self.shared_gate = block.shared_expert_gate

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # 1) route, and group the (token, expert) pairs by expert (not one token's)
        with _one_thread(x):
            weights, ids = route(x, self.router, self.top_k, self.norm_topk_prob)
            groups = None if x.shape[0] == 1 else group_by_expert(ids, weights,
                                                                   len(self.experts))
            shared_scale = (None if self.shared_gate is None  # [T, 1]
                            else torch.sigmoid(F.linear(x, self.shared_gate)))
        # 2) each chosen expert once, over its rows
        out = (run_experts(x, groups, self.experts) if groups is not None
               else run_token(x, weights, ids, self.experts))
        # 3) Qwen2-MoE's shared expert, which every token runs
        if self.shared is not None and shared_scale is not None:
            out = out + shared_scale * self.shared(x)
        return out


@dataclass(frozen=True, slots=True)
class ExpertGroups:
    """A step's (token, slot) pairs grouped by expert. Pair p is token p // k and that
    token's (p % k)-th expert in ascending expert order."""

    order: torch.Tensor  # [T k] the pairs, expert by expert (tokens ascending within one)
    counts: list[int]  # [E] pairs per expert, on the host
    scales: torch.Tensor  # [T k, 1] each pair's routing weight
    top_k: int


def group_by_expert(ids: torch.Tensor, weights: torch.Tensor, num_experts: int
                    ) -> ExpertGroups:
    """ids, weights [T, k] (route's) -> the pairs grouped by expert; each token's experts
    sorted first, so that its terms are summed in expert order, as transformers' eager loop
    over the experts adds them."""
    ids, slots = ids.sort(dim=1)
    flat_ids = ids.reshape(-1)  # [T k]
    order = torch.argsort(flat_ids, stable=True)
    # the one read back to the host a MoE layer makes: slicing the groups needs their sizes
    # (a sync per layer on a GPU, as transformers' own loop over the experts hit)
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    return ExpertGroups(order, counts, weights.gather(1, slots).reshape(-1, 1), ids.shape[1])


def run_experts(x: torch.Tensor, groups: ExpertGroups, experts: list[Matmul]) -> torch.Tensor:
    """sum over each token t's pairs of scale * expert(x[t]): x [T, hidden] -> [T, hidden].
    Each expert runs once, on all its rows; a token's k terms are then added in expert order
    ((t0 + t1) + t2: transformers' index_add_ into zeros, whose 0 + t0 is t0)."""
    num_tokens, top_k = x.shape[0], groups.top_k
    terms = x.new_empty(num_tokens * top_k, x.shape[1])  # [T k, hidden], pair by pair
    start = 0
    for expert, count in zip(experts, groups.counts, strict=True):
        if count == 0:
            continue
        pairs = groups.order[start : start + count]
        rows = x.index_select(0, pairs // top_k)
        # index_copy_, not index_add_ into the output: each pair is written once, and CPU
        # index_add_ forks threads even for a few rows (~0.5 ms against 5 us, measured)
        terms.index_copy_(0, pairs, expert(rows) * groups.scales.index_select(0, pairs))
        start += count
    per_token = terms.view(num_tokens, top_k, -1)
    out = per_token[:, 0]
    for slot in range(1, top_k):
        out = out + per_token[:, slot]
    return out


def run_token(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              experts: list[Matmul]) -> torch.Tensor:
    """`run_experts` for one token, x [1, hidden] (a decode step of one request): its k
    experts in expert order: the same products and sums, without the grouping's ops (an
    upcycled SmolLM2 layer at one row: 108 us against 188; docs/benchmarks.md)."""
    expert_ids = ids[0].tolist()  # the host read, as the grouping's
    out: torch.Tensor | None = None
    for slot in sorted(range(len(expert_ids)), key=expert_ids.__getitem__):
        term = experts[expert_ids[slot]](x) * weights[:, slot : slot + 1]
        out = term if out is None else out + term
    assert out is not None, "a token has at least one expert"
    return out


@contextlib.contextmanager
def _one_thread(x: torch.Tensor) -> Iterator[None]:
    """torch's CPU ops on one thread inside: the router's and the grouping's ops are a few
    microseconds of work on a few rows, and each forks both threads where it runs on two
    (on 2 busy cores the router's matmul at 8 rows took 3.4 us on one thread, ~140 us on two;
    switching costs 0.4 us: docs/benchmarks.md, "Mixture of experts")."""
    if x.device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _param(*shape: int) -> nn.Parameter:
    """A placeholder on the meta device (no memory, no init); the loader puts the weights in."""
    return nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)
