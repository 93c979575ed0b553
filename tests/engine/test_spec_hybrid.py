"""Speculative decoding on Qwen3.5 hybrids never changes a token: a verify step keeps the
DeltaNet states after each draft row and the state after the last accepted row becomes the
sequence's (engine/draft_states.py), so every output, logprob included, equals the run without
drafts: greedy and seeded, batched, in chunks, through preemption, with prefix-cache hits whose
snapshots lie inside verify chunks, and for n > 1.

The model is a tiny random Qwen3.5 whose layers' outputs are damped (`ECHO_DAMPING`), so its
greedy text falls into runs of one token that n-gram and suffix drafts predict: drafts are kept
and rejected in every test (asserted), and the layers still move every logprob, so a state left
past a rejected draft would show. Weights are int8 (quantized at load), whose matmuls' bits do
not depend on a step's rows, so on and off are compared bit for bit.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from nanoserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from nanoserve.engine.build import build_engine_core
from nanoserve.engine.core import EngineCore
from nanoserve.engine.draft_states import DraftStates
from nanoserve.engine.request import Request
from nanoserve.engine.scheduler import ScheduledRequest
from nanoserve.engine.state_cache import StateSnapshots
from nanoserve.sampling_params import SamplingParams
from nanoserve.speculative_config import SpeculativeConfig

VOCAB = 49152  # the default model's tokenizer
ECHO_DAMPING = 0.22  # the layers' output projections scaled by this: mostly runs, not all
NUM_DRAFTS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(temperature=0.1, top_p=0.9, seed=5, max_tokens=30, ignore_eos=True,
                        logprobs=2)


def write_echo_qwen35(path: Path, tokenizer: Any) -> Path:
    """The tiny hybrid (three Gated DeltaNet layers per full attention one, 8 layers), tied
    embeddings, its o_proj, out_proj and down_proj damped, written to `path`."""
    import transformers

    config = transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=8,
        max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
        initializer_range=0.05, tie_word_embeddings=True, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    torch.manual_seed(67)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
                param.mul_(ECHO_DAMPING)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def echo_qwen35(tmp_path_factory: pytest.TempPathFactory, default_tokenizer: Any) -> Path:
    return write_echo_qwen35(tmp_path_factory.mktemp("echo-qwen35"), default_tokenizer)


def engine(path: Path, method: str | None, *, num_blocks: int = 256,
           max_num_batched_tokens: int = 2048, enable_prefix_caching: bool = True,
           mamba_block_size: int = 256) -> EngineCore:
    """An int8 engine on the CPU; `method` names the drafts (None: none)."""
    drafts = None if method is None else SpeculativeConfig.parse(
        f'{{"method": "{method}", "num_speculative_tokens": {NUM_DRAFTS}}}')
    return build_engine_core(EngineConfig(
        model=ModelConfig(model=str(path), device="cpu", dtype="float32",
                          quantization="int8", kernel_tuning="off"),
        cache=CacheConfig(num_blocks=num_blocks, enable_prefix_caching=enable_prefix_caching,
                          mamba_block_size=mamba_block_size),
        scheduler=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                  draft_proposer=drafts, num_speculative_tokens=NUM_DRAFTS,
                                  speculative_max_rows=64)))


def outputs(core: EngineCore, prompts: dict[str, list[int]], params: SamplingParams,
            leaders: dict[str, str] | None = None) -> dict[str, Any]:
    """Each request's (token ids, logprobs, cached prompt tokens), all added at once."""
    for rid, ids in prompts.items():
        core.add_request(rid, ids, params, prefill_leader=(leaders or {}).get(rid))
    got: dict[str, Any] = {rid: ([], [], 0) for rid in prompts}
    while core.has_unfinished():
        for out in core.step():
            tokens, logprobs, _ = got[out.request_id]
            got[out.request_id] = (tokens + out.new_token_ids,
                                   logprobs + list(out.new_logprobs or []),
                                   out.num_cached_tokens)
    return got


def random_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def assert_drafts_kept_and_rejected(core: EngineCore) -> None:
    stats = core.stats
    assert stats.spec_decode_num_draft_tokens > 0, "no drafts were proposed"
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens, (
        f"want some drafts kept and some rejected: {stats.spec_decode_num_accepted_tokens} "
        f"of {stats.spec_decode_num_draft_tokens}")


PROMPTS = {f"p{i}": random_ids(9 + 5 * i, seed=10 + i) * 2 for i in range(4)}


@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_batched_outputs_and_logprobs_equal_without_drafts(
        echo_qwen35: Path, method: str, params: SamplingParams) -> None:
    off = outputs(engine(echo_qwen35, None), PROMPTS, params)
    on_engine = engine(echo_qwen35, method)
    assert outputs(on_engine, PROMPTS, params) == off
    assert_drafts_kept_and_rejected(on_engine)


def test_chunked_prefill_and_preemption(echo_qwen35: Path) -> None:
    """Chunks of 7 tokens and a cache too small for every request: preempted requests
    recompute their states from the start, drafts or not."""
    off = outputs(engine(echo_qwen35, None), PROMPTS, SEEDED)
    on_engine = engine(echo_qwen35, "ngram", num_blocks=9, max_num_batched_tokens=7)
    assert outputs(on_engine, PROMPTS, SEEDED) == off
    assert on_engine.stats.num_preemptions > 0, "the small cache should preempt"
    assert_drafts_kept_and_rejected(on_engine)


def test_prefix_hits_resume_states_kept_from_verify_chunks(echo_qwen35: Path) -> None:
    """A conversation turn by turn, a snapshot at every block (so block boundaries fall inside
    verify chunks, accepted and rejected): each turn finds its past in the cache and gives
    what an engine without drafts or a prefix cache gives."""
    warm = engine(echo_qwen35, "ngram", mamba_block_size=16)
    cold = engine(echo_qwen35, None, enable_prefix_caching=False)
    history = random_ids(40, seed=300)
    for turn in range(3):
        (tokens, logprobs, cached), = outputs(warm, {f"t{turn}": history}, GREEDY).values()
        (cold_tokens, cold_logprobs, _), = outputs(cold, {f"t{turn}": history},
                                                   GREEDY).values()
        assert (tokens, logprobs) == (cold_tokens, cold_logprobs), f"turn {turn}"
        if turn:  # the last turn's output, drafted, found up to its last full block
            assert cached >= len(history) - 16 - 5, f"turn {turn}: {cached} of {len(history)}"
        history = history + tokens + random_ids(5, seed=301 + turn)
    assert_drafts_kept_and_rejected(warm)
    # a second conversation sharing the first one's opening
    shared = {"b": history[:70] + random_ids(10, seed=310)}
    (tokens, logprobs, cached), = outputs(warm, shared, SEEDED).values()
    assert cached >= 64
    assert (tokens, logprobs) == outputs(cold, shared, SEEDED)["b"][:2]


def test_n_samples_fork_states_and_draft_alone(echo_qwen35: Path) -> None:
    """n > 1: samples after the first start from the leader's prompt snapshot; each draws
    what it draws without drafts."""
    prompt = random_ids(37, seed=600)
    prompts = {f"s{i}": prompt for i in range(3)}
    leaders = {"s1": "s0", "s2": "s0"}
    off = outputs(engine(echo_qwen35, None), prompts, SEEDED, leaders)
    on_engine = engine(echo_qwen35, "suffix")
    assert outputs(on_engine, prompts, SEEDED, leaders) == off
    assert_drafts_kept_and_rejected(on_engine)


class _Hashes:
    """A KV cache's `block_hashes`, of a request's tokens one block of 4 each."""

    def block_hashes(self, request: Request) -> list[bytes]:
        return [bytes(request.all_token_ids[: 4 * (n + 1)])
                for n in range(request.num_tokens // 4)]


def test_only_committed_positions_reach_the_prefix_cache() -> None:
    """A verify chunk over positions 7..11 (known token 7, drafts at 8..11) of live slot 3,
    a snapshot at every block of 4 (after tokens 7 and 11): the live slot gets the state
    after the last accepted row back from its draft slot, and only boundaries at committed
    positions are published, from the row's draft slot or, for the chunk's last row, the
    live slot; the bonus token after the accepted drafts is not computed yet, so a boundary
    there waits (the state after that row is a rejected draft's)."""
    slot_of_row = [30 + 3 * NUM_DRAFTS + row for row in range(NUM_DRAFTS)]  # 42..45
    for kept, want in ((0, [(3, 42), (20, 42)]), (1, [(3, 43), (20, 42)]),
                       (3, [(3, 45), (20, 42)]),  # the bonus token ends a block: not yet
                       (4, [(20, 42), (21, 3)])):
        states = StateSnapshots(first_slot=20, count=4, block_size=4, interval=4)
        drafts = DraftStates(first_slot=30, num_drafts=NUM_DRAFTS)
        request = Request("r", list(range(1, 9)), GREEDY)
        request.slot, request.num_computed_tokens = 3, 7
        s = ScheduledRequest(request, 7, 5, [9, 10, 11, 12])
        snapshots: list[tuple[int, int]] = []
        drafts.plan([s], [0], snapshots)
        assert snapshots == list(enumerate(slot_of_row))
        for token in [9, 10, 11, 12, 13][: kept + 1]:
            request.append_output_token(token)
        request.num_computed_tokens = 7 + kept + 1
        drafts.commit([s], [kept + 1], states, _Hashes())  # type: ignore[arg-type]
        assert drafts.take_pending() == want, kept
        assert drafts.take_pending() == []
        assert len(states.by_hash) == len(want) - (kept < NUM_DRAFTS)
