"""`bench route`: on a small shared-prefix trace, cache-aware routing over 2 simulated replicas
keeps the prefix hits of one, round-robin loses some, and both replicas serve."""

from __future__ import annotations

from pathlib import Path

import pytest

from nanoserve.bench.route import Workload, shared_prefix_trace
from nanoserve.bench.route_sim import simulate
from nanoserve.entrypoints.cli import main

SMALL = Workload(num_groups=8, prompts_per_group=8, prefix_len=256, suffix_len=32,
                 output_len=32, arrival_rate=0.5, num_blocks=256)


def test_cache_aware_keeps_one_replicas_hits_round_robin_does_not() -> None:
    trace = shared_prefix_trace(SMALL)
    assert len(trace) == 64 and len({tuple(p[:256]) for _, p, _ in trace}) == 8
    one = simulate(SMALL, "cache_aware", 1, trace)
    aware = simulate(SMALL, "cache_aware", 2, trace)
    spread = simulate(SMALL, "round_robin", 2, trace)
    # at most 7 of a group's 8 prompts find its 16 prefix blocks: 7/8 x 256/288
    assert 0.5 < one.hit_rate <= 7 / 8 * 256 / 288
    assert aware.hit_rate >= 0.9 * one.hit_rate
    assert spread.hit_rate <= aware.hit_rate - 0.05  # a group's first visit to each replica
    assert spread.max_over_mean == pytest.approx(1.0)
    assert aware.max_over_mean < 1.5  # both replicas serve (2.0: one took everything)


def test_the_command_prints_every_policy_and_replica_count(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "route", "--groups", "4", "--prompts-per-group", "4",
                 "--replicas", "1,2", "--num-blocks", "128"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if line.startswith(("cache_aware", "round_robin"))]
    assert [(r[0], r[1]) for r in rows] == [("cache_aware", "1"), ("cache_aware", "2"),
                                            ("round_robin", "1"), ("round_robin", "2")]
    assert rows[0][3] == rows[2][3] == "100%"


def test_a_saved_trace_replays_to_the_same_figures(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "route", "--groups", "4", "--prompts-per-group", "4", "--replicas", "2",
            "--num-blocks", "128"]
    saved = tmp_path / "trace.jsonl"
    assert main([*args, "--save-trace", str(saved)]) == 0
    generated = capsys.readouterr().out.splitlines()
    assert len(saved.read_text().splitlines()) == 16
    assert main([*args, "--trace", str(saved)]) == 0
    replayed = capsys.readouterr().out.splitlines()
    assert replayed[0].startswith(f"16 requests from {saved}")
    assert replayed[1:] == generated[1:]


def test_a_request_larger_than_an_engine_is_refused() -> None:
    tiny = Workload(num_blocks=8)
    with pytest.raises(ValueError, match="needs 24 blocks; --num-blocks is 8"):
        simulate(tiny, "cache_aware", 1, [(0.0, [1] * 320, 64)])
