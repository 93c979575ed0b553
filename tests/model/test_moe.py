"""Mixture of experts (moe.py) against transformers: the router op for op, the grouped experts
against transformers' eager loop, and tiny random Qwen3-MoE (renormalised top 2 of 8 with a
dense layer; top 3 of 4 not renormalised, every second layer sparse) and Qwen2-MoE (shared
expert, qkv bias) checkpoints equal to transformers in logits, greedy tokens (alone and batched
with chunked prefills and preemption) and logprobs. Then the quantized path (the fused op
table, off the native dense stack) and tensor parallelism's partial sums."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import hf_model, make_engine, run_to_completion
from moe_checkpoints import tiny_moe_config, write_tiny_moe
from test_equivalence import assert_logits_match, assert_tokens_match, random_prompts

from nanoserve.model.fused_ops import kernels
from nanoserve.model.layer_ops import EXACT_OPS
from nanoserve.model.loader import load_arch, load_model
from nanoserve.model.moe import BoundMoe, group_by_expert, route, run_experts, run_token
from nanoserve.model.parallel import TensorParallelGroup
from nanoserve.sampling_params import SamplingParams

KINDS = ("qwen3_moe", "qwen3_moe_unnormed", "qwen2_moe")
CPU = torch.device("cpu")


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory,
                 default_tokenizer: Any) -> Callable[[str], Path]:
    """kind -> a directory holding that tiny MoE checkpoint (written once per session)."""
    made: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in made:
            made[kind] = write_tiny_moe(kind, tmp_path_factory.mktemp(f"tiny-{kind}"),
                                        default_tokenizer)
        return made[kind]

    return make


@cache
def reference(path: str) -> Any:
    return hf_model(path)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_the_router_is_transformers_op_for_op(norm_topk_prob: bool) -> None:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = tiny_moe_config("qwen3_moe")
    config.norm_topk_prob = norm_topk_prob
    torch.manual_seed(0)
    router = Qwen3MoeTopKRouter(config)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(37, config.hidden_size)
    _, their_weights, their_ids = router(x)
    weights, ids = route(x, router.weight, config.num_experts_per_tok, norm_topk_prob)
    assert torch.equal(ids, their_ids) and torch.equal(weights, their_weights)


def test_grouped_experts_equal_transformers_eager_loop() -> None:
    """Each expert once over its rows, added in expert order: transformers' eager experts
    (a loop over the experts hit, index_add_ into zeros) up to matmul summation order."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = tiny_moe_config("qwen3_moe_unnormed")  # top 3: the order of the sum shows
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    experts = Qwen3MoeExperts(config)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.2)
    torch.nn.init.normal_(experts.down_proj, std=0.2)
    x = torch.randn(50, config.hidden_size)
    weights, ids = route(x, torch.randn(config.num_experts, config.hidden_size),
                         config.num_experts_per_tok, False)
    with torch.no_grad():
        theirs = experts(x, ids, weights)
        mlps = [lambda rows, e=e: F.linear(  # type: ignore[misc]
            EXACT_OPS.silu_mul(F.linear(rows, experts.gate_up_proj[e])), experts.down_proj[e])
            for e in range(config.num_experts)]
        ours = run_experts(x, group_by_expert(ids, weights, config.num_experts), mlps)
    assert len(ids.unique()) == config.num_experts  # every expert ran on some rows
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    # one token (a decode step) skips the grouping: the same products and sums, bit for bit
    for t in range(3):
        one = slice(t, t + 1)
        grouped = run_experts(x[one], group_by_expert(ids[one], weights[one],
                                                      config.num_experts), mlps)
        assert torch.equal(run_token(x[one], weights[one], ids[one], mlps), grouped)


@pytest.mark.parametrize("kind", KINDS)
def test_which_layers_are_moe_follows_transformers(kind: str, tiny_moe_dir: Any) -> None:
    path = str(tiny_moe_dir(kind))
    arch = load_arch(path)
    layers = reference(path).model.layers
    assert arch.moe is not None
    assert arch.moe.sparse_layers == tuple(i for i, layer in enumerate(layers)
                                           if hasattr(layer.mlp, "experts"))
    assert 0 < len(arch.moe.sparse_layers) < arch.num_layers or kind == "qwen2_moe"


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_moe_prefill_logits_match_transformers(kind: str, tiny_moe_dir: Any) -> None:
    path = str(tiny_moe_dir(kind))
    prompts = random_prompts(reference(path).config.vocab_size, seed=1)
    assert_logits_match(make_engine(path), reference(path),
                        [prompts["p1"], prompts["p33"], prompts["p300"]])


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_moe_greedy_tokens_match_transformers(kind: str, tiny_moe_dir: Any) -> None:
    """Alone, and all prompts together in 48-token steps with preemption (test_equivalence)."""
    path = str(tiny_moe_dir(kind))
    assert_tokens_match(path, reference(path), reference(path).config.vocab_size)


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
def test_tiny_moe_logprobs_match_transformers(kind: str, tiny_moe_dir: Any) -> None:
    path = str(tiny_moe_dir(kind))
    prompt = [3, 14, 15, 92, 65, 35, 8979, 323, 846]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=5,
                            prompt_logprobs=3)
    engine = make_engine(path)
    engine.add_request("lp", prompt, params)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    tokens = [o.new_token_ids[0] for o in outs]
    with torch.inference_mode():
        full = reference(path)(torch.tensor([prompt + tokens])).logits[0].log_softmax(-1)
    first = outs[0].prompt_logprobs
    assert first is not None and len(first) == len(prompt) - 1
    for i, entry in enumerate(first):
        assert entry.logprob == pytest.approx(float(full[i, prompt[i + 1]]), abs=1e-4)
    for step, out in enumerate(outs):
        (entry,) = out.new_logprobs
        row = full[len(prompt) - 1 + step]
        assert entry.token_id == int(row.argmax()) and entry.top_ids == row.topk(5).indices.tolist()
        assert entry.top_logprobs == pytest.approx(row.topk(5).values.tolist(), abs=1e-4)


@pytest.mark.skipif(kernels() is None, reason="fused_ops kernel unavailable")
def test_a_quantized_moe_runs_the_fused_table_in_the_python_layer_loop(tiny_moe_dir: Any
                                                                       ) -> None:
    """int8 weights on the CPU: the fused op table binds the experts' quantized matmuls, and
    the plan keeps the MoE model off the native dense stack; its logits are the exact
    table's on the same weights within the int8 activation rounding's reach."""
    path = tiny_moe_dir("qwen2_moe")
    engine = make_engine(path, quantization="int8", max_num_batched_tokens=48)
    prompts = random_prompts(reference(str(path)).config.vocab_size, seed=3)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out = run_to_completion(engine, {k: prompts[k] for k in ("p1", "p17", "p100")}, greedy)
    plan = engine.runner.plan
    assert plan.use_fused_ops is True and plan.layer_stack is None
    assert all(len(tokens) == 6 for tokens in out.values())
    from test_equivalence import prefill_logits

    fused = prefill_logits(engine, prompts["p33"])
    plan.use_fused_ops = False
    exact_table = prefill_logits(engine, prompts["p33"])
    assert ((fused - exact_table).norm() / exact_table.norm()).item() < 5e-3


def test_tensor_parallel_ranks_hold_expert_slices_whose_partial_sums_add_up(
        tiny_moe_dir: Any) -> None:
    """Two ranks, loaded in one process (no collective): each holds every expert with half
    its intermediate rows (and the shared expert's half) and the whole router; their MoE
    blocks' outputs on the same input add up to TP 1's (the layer all-reduces them)."""
    path = str(tiny_moe_dir("qwen2_moe"))
    whole = load_model(path, CPU, torch.float32, 64, "none").model
    parts = [load_model(path, CPU, torch.float32, 64, "none", TensorParallelGroup(r, 2)).model
             for r in range(2)]
    moe = parts[0].arch.moe
    assert moe is not None and whole.arch.moe is not None
    assert (moe.moe_intermediate_size, moe.shared_expert_intermediate_size) == (16, 32)
    layer = whole.decoder_layers[0].moe
    assert layer is not None
    torch.manual_seed(0)
    x = torch.randn(9, whole.arch.hidden_size)
    with torch.inference_mode():
        expected = BoundMoe(layer, EXACT_OPS)(x)
        partials = []
        for part in parts:
            block = part.decoder_layers[0].moe
            assert block is not None and torch.equal(block.gate, layer.gate)
            partials.append(BoundMoe(block, EXACT_OPS)(x))
    torch.testing.assert_close(partials[0] + partials[1], expected, rtol=1e-5, atol=1e-6)
