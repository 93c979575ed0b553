"""A GGUF file's recommended sampling settings (`general.sampling.*`, as llama.cpp writes and
reads them) become the request defaults, llama.cpp's samplers among them; a request's own
values win."""

from __future__ import annotations

from nanoserve.model.frontend import gguf_sampling_defaults
from nanoserve.sampling_params import SamplingParams

METADATA = {"general.sampling.temp": 0.7, "general.sampling.top_k": 20,
            "general.sampling.penalty_repeat": 1.1, "general.sampling.penalty_last_n": 32,
            "general.sampling.xtc_probability": 0.5, "general.sampling.xtc_threshold": 0.2,
            "general.sampling.mirostat": 2, "general.sampling.mirostat_tau": 4.0,
            "general.sampling.mirostat_eta": 0.2, "general.name": "not a sampling key"}


def test_a_ggufs_sampling_keys_are_the_defaults() -> None:
    params = SamplingParams.from_generation_config(gguf_sampling_defaults(METADATA))
    assert (params.temperature, params.top_k, params.repetition_penalty) == (0.7, 20, 1.1)
    assert (params.repeat_last_n, params.xtc_probability, params.xtc_threshold) == (32, 0.5,
                                                                                     0.2)
    assert (params.mirostat, params.mirostat_tau, params.mirostat_eta) == (2, 4.0, 0.2)
    assert params.has_penalty_window and params.uses_llama_draw


def test_the_requests_values_win() -> None:
    params = SamplingParams.from_generation_config(
        gguf_sampling_defaults(METADATA), mirostat=0, repeat_last_n=-1, temperature=0.0)
    assert (params.mirostat, params.repeat_last_n, params.is_greedy) == (0, -1, True)
    assert not params.uses_llama_draw  # greedy: the draw samplers are off
