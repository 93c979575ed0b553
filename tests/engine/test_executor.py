"""The executor/worker seam: a step crosses it as data only.

`InProcessExecutor(serialize=True)` sends every step input and output through msgpack, as a
multi-process executor will: the engine's outputs must not change, which shows the worker
needs nothing but the step input (no request, no scheduler, no shared Python objects).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from helpers import make_engine

from nanoserve.engine.drafts import load_draft_proposer
from nanoserve.engine.executor import InProcessExecutor
from nanoserve.protocol import (
    NewSequence,
    PromptLogprobsRows,
    StepInput,
    decode_step,
    encode,
)
from nanoserve.sampling_params import SamplingParams


def _outputs(engine: Any, requests: dict[str, tuple[list[int], SamplingParams]]
             ) -> dict[str, Any]:
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    got: dict[str, Any] = {}
    while engine.has_unfinished():
        for out in engine.step():
            entry = got.setdefault(out.request_id, [[], [], None, None])
            entry[0] += out.new_token_ids
            entry[1] += [(e.token_id, e.logprob, e.top_ids) for e in out.new_logprobs or ()]
            entry[2] = out.finish_reason
            if out.prompt_logprobs is not None:
                entry[3] = [(e.token_id, e.logprob) for e in out.prompt_logprobs]
    return got


def test_steps_through_msgpack_give_the_same_outputs(tiny_model_dir: Any) -> None:
    requests = {
        "greedy": ([5, 6, 7, 8, 9] * 7, SamplingParams(temperature=0, max_tokens=12,
                                                        logprobs=2, prompt_logprobs=1)),
        "seeded": ([11, 12, 13], SamplingParams(temperature=1.0, seed=3, max_tokens=12,
                                                presence_penalty=0.5, logprobs=1)),
        "json": ([20, 21], SamplingParams(temperature=0.7, seed=4, max_tokens=8,
                                          structured_outputs={"regex": "[ab]{3,6}"})),
    }
    direct = _outputs(make_engine(tiny_model_dir("llama")), requests)
    engine = make_engine(tiny_model_dir("llama"))
    worker = engine.executor.worker
    engine.executor = InProcessExecutor(worker, serialize=True)
    assert _outputs(engine, requests) == direct
    assert direct["greedy"][3] is not None and len(direct["json"][0]) >= 3


def test_step_input_round_trips_with_its_arrays() -> None:
    step = StepInput(
        token_ids=np.arange(5, dtype=np.int64), positions=np.array([3, 0, 1, 2, 3]),
        cache_index=np.array([19, 32, 33, 34, 35]), query_start_loc=np.array([0, 1, 5]),
        context_lens=np.array([4, 4], dtype=np.int32),
        block_table=np.array([[1, 7], [2, 0]], dtype=np.int32), num_decodes=1,
        logits_rows=np.array([0, 4]), sample_slots=np.array([3, 0]),
        sample_positions=np.array([2, 0]), draft_token_ids=np.array([-1, -1]),
        num_sample_rows=np.array([1, 1]), grammar_rows=np.zeros(0, dtype=np.int64),
        grammar_bitmask=np.full((0, 4), -1, dtype=np.int32),
        prompt_logprobs=[PromptLogprobsRows(1, 1, [6, 7, 8], 2)],
        new_sequences=[NewSequence(0, SamplingParams(max_tokens=3), [5, 6, 7, 8], [], 9)],
        released_slots=[2])
    back = decode_step(encode(step))
    for name in step.__struct_fields__:
        mine, theirs = getattr(step, name), getattr(back, name)
        if isinstance(mine, np.ndarray):
            assert theirs.dtype == mine.dtype and np.array_equal(theirs, mine), name
        else:
            assert theirs == mine, name


@pytest.mark.parametrize(("spec", "message"), [
    ("nope", "must be written 'module:Class'"),
    ("no_such_module_here:X", "cannot import 'no_such_module_here'"),
    ("json:NoSuchName", "no such name"),
    ("json:dumps", "has no propose"),
])
def test_a_bad_draft_proposer_is_a_clear_error(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_draft_proposer(spec)
