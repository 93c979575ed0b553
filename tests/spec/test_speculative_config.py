"""`--speculative-config`: vLLM's JSON, checked at start-up, and the engine speculating with it
(outputs equal to speculation off: the drafts only change how many tokens a step commits)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from nanoserve.config import EngineConfig
from nanoserve.engine.drafts import load_draft_proposer
from nanoserve.engine_args import EngineArgs
from nanoserve.sampling_params import SamplingParams
from nanoserve.spec.ngram import NgramProposer
from nanoserve.spec.suffix import SuffixProposer
from nanoserve.speculative_config import SpeculativeConfig


def test_vllm_spelling_parses_from_json_and_dicts() -> None:
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, '
                                     '"prompt_lookup_min": 2, "prompt_lookup_max": 4}')
    assert config == SpeculativeConfig("ngram", 3, 2, 4)
    assert SpeculativeConfig.parse({"method": "suffix"}) == SpeculativeConfig("suffix")
    assert SpeculativeConfig.parse(None) is None
    scheduler = EngineArgs(speculative_config='{"method": "suffix", '
                                              '"num_speculative_tokens": 6}').to_config().scheduler
    assert scheduler.num_speculative_tokens == 6
    assert scheduler.draft_proposer == SpeculativeConfig("suffix", 6)


@pytest.mark.parametrize(("value", "message"), [
    ("{oops", "must be a JSON object"),
    ("[1]", "must be an object"),
    ('{"method": "eagle"}', "method must be one of ngram, suffix, mtp, got 'eagle'"),
    ('{"num_speculative_tokens": 4}', "method must be one of"),
    ('{"method": "ngram", "suffix_decoding_max_tree_depth": 8}',
     "suffix_decoding_max_tree_depth is not a field of method 'ngram'"),
    ('{"method": "ngram", "num_speculative_tokens": 0}',
     "num_speculative_tokens must be in [1, 16], got 0"),
    ('{"method": "ngram", "num_speculative_tokens": "4"}', "must be int, got '4'"),
    ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3}',
     "prompt_lookup_max must be in [5, 64], got 3"),
    ('{"method": "suffix", "suffix_decoding_min_token_prob": 2}', "must be in [0, 1], got 2"),
    ('{"method": "suffix", "suffix_decoding_max_cached_requests": -1}',
     "suffix_decoding_max_cached_requests must be in [0, 100000], got -1"),
    ('{"method": "ngram", "suffix_decoding_max_cached_requests": 8}',
     "suffix_decoding_max_cached_requests is not a field of method 'ngram'"),
])
def test_bad_values_are_start_up_errors_naming_the_field(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        EngineArgs(speculative_config=value).to_config()


def test_the_config_reaches_the_engine_process_as_msgpack() -> None:
    config = EngineArgs(speculative_config='{"method": "suffix", "suffix_decoding_max_tree_depth'
                                           '": 8, "suffix_decoding_max_cached_requests": 5}'
                        ).to_config()
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(config), type=EngineConfig)
    proposer = load_draft_proposer(decoded.scheduler.draft_proposer)
    assert isinstance(proposer, SuffixProposer) and proposer.max_depth == 8
    assert proposer.max_cached_requests == 5
    ngram = EngineArgs(speculative_config='{"method": "ngram"}').to_config()
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(ngram), type=EngineConfig)
    assert isinstance(load_draft_proposer(decoded.scheduler.draft_proposer), NgramProposer)


def test_not_both_a_proposer_class_and_a_config() -> None:
    with pytest.raises(ValueError, match="not both"):
        EngineArgs(speculative_config='{"method": "ngram"}',
                   draft_proposer="spec.ngram:NgramProposer").to_config()


PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, lit the "
           "great lamp, and wrote the weather in a small leather book.")


def run_engine(speculative_config: str | None, prompt: list[int],
               params: list[SamplingParams]) -> tuple[list[list[int]], int, Any]:
    """Each request's output ids, the number of steps and the engine's stats, on the default
    model's gguf path."""
    from nanoserve.engine.build import build_engine_core

    engine = build_engine_core(EngineArgs(device="cpu", dtype="float32", quantization="gguf",
                                   kv_cache_memory_gb=0.0625,
                                   speculative_config=speculative_config).to_config())
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", prompt, p)
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(params))}
    steps = 0
    while engine.has_unfinished():
        steps += 1
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
    return list(outputs.values()), steps, engine.stats


@pytest.mark.slow
def test_speculation_commits_several_tokens_and_changes_none() -> None:
    """A copying prompt on the default model: with ngram or suffix drafts, greedy and seeded
    outputs (batched together) equal speculation off, in fewer steps."""
    from nanoserve.model.gguf_file import GGUFFile
    from nanoserve.model.loader import default_model_path
    from nanoserve.model.tokenizer import load_tokenizer_from_gguf

    tokenizer = load_tokenizer_from_gguf(GGUFFile(default_model_path()))
    prompt = tokenizer.encode(f"Copy this sentence twice.\n{PASSAGE}\n{PASSAGE}\n")
    params = [SamplingParams(temperature=0.0, max_tokens=32),
              SamplingParams(temperature=0.7, top_p=0.9, seed=11, max_tokens=32)]
    plain, plain_steps, plain_stats = run_engine(None, prompt, params)
    assert plain_stats.spec_decode_num_drafts == 0 and plain_stats.num_steps == plain_steps
    for config in ('{"method": "ngram"}', '{"method": "suffix"}'):
        drafted, steps, stats = run_engine(config, prompt, params)
        assert drafted == plain, config
        assert steps < plain_steps, (config, steps, plain_steps)
        assert stats.num_steps == steps and stats.propose_seconds > 0.0
        # vLLM's counters: kept drafts, per position never more than the position before
        assert 0 < stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
        per_position = stats.spec_decode_num_accepted_tokens_per_pos
        assert sum(per_position) == stats.spec_decode_num_accepted_tokens
        assert per_position == sorted(per_position, reverse=True)
