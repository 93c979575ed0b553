"""`nanoserve bench chaos`, bounded: misbehaving clients on the tiny model, then nothing leaked."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from shared_server import shared_server

from nanoserve.bench.chaos import plan, run_chaos


def chaos_args(**overrides: Any) -> argparse.Namespace:
    values = dict(num_requests=48, concurrency=16, disconnect_share=1 / 3, timeout_share=1 / 6,
                  slow_share=0.1, input_len=32, output_len=48, api_key=None, model=None, seed=3,
                  endpoints="completions,chat,messages,responses")
    return argparse.Namespace(**{**values, **overrides})


def test_plan_gives_each_behaviour_its_share() -> None:
    behaviours = plan(200, chaos_args())
    assert (behaviours.count("disconnect"), behaviours.count("timeout"),
            behaviours.count("slow"), behaviours.count("finish")) == (67, 33, 20, 80)
    assert plan(200, chaos_args()) == behaviours  # seeded


def test_chaos_leaves_nothing_behind(request: pytest.FixtureRequest,
                                    tiny_model_dir: Any) -> None:
    # the tiny model, no flags: test_server_port.py's first server too (which then checks it
    # still answers); it must exit 0 at the session's end
    server = shared_server(request, str(tiny_model_dir("llama")))
    report = run_chaos(server.url, chaos_args(), pid=server.proc.pid)
    print("\n".join(report.lines()))
    assert {o.endpoint for o in report.outcomes} == {"completions", "chat", "messages",
                                                     "responses"}
    assert not [o.error for o in report.outcomes if o.error and "HTTP" in o.error]
    cut = [o for o in report.outcomes if o.behaviour == "disconnect"]
    assert cut and not any(o.completed for o in cut)
    assert not report.unfinished_survivors, report.unfinished_survivors[:2]
    assert not report.mismatches, report.mismatches[:2]
    assert (report.after.running, report.after.waiting, report.after.kv_blocks_in_use) == (0, 0, 0)
    growth = report.rss_growth
    assert growth is not None and growth < 0.10, f"resident memory grew {growth:.1%}"
