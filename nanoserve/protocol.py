"""Every message that crosses a process boundary, as msgspec structs encoded with msgpack.

API server -> engine core: EngineRequest, AbortRequests, Shutdown.
Engine core -> API server: EngineReady (once), EngineOutputs (each step, and after inputs
that change the engine's state while it is idle), RequestError, EngineDead.

Token ids and numbers only: text is made in the API server. Never pickle: a message is decoded
into exactly these types or refused (msgspec validates while decoding).
"""

from __future__ import annotations

import msgspec

from nanoserve.sampling_params import SamplingParams


class TokenLogprobs(msgspec.Struct, array_like=True):
    """One position's logprobs: the chosen token's, and the N most likely tokens'."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top_ids: list[int]
    top_logprobs: list[float]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step produced for one (engine) request."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    stop_reason: int | str | None = None  # the stop token id that ended it, if any
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    new_logprobs: list[TokenLogprobs] | None = None  # one per new token, if asked
    prompt_logprobs: list[TokenLogprobs] | None = None  # prompt tokens 1.., with the first


class SchedulerStats(msgspec.Struct, array_like=True):
    """The engine core's gauges, and its counters since start-up (prefix-cache figures are in
    tokens, as vLLM counts them). The engine core keeps one, current after each call."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_computed_tokens: int = 0  # tokens run through the model (prefill and decode)
    sample_seconds: float = 0.0  # time inside the sampler
    kv_blocks_in_use: int = 0  # blocks held by requests (the usage gauge, counted)


# -- API server -> engine core ------------------------------------------------------------------
class EngineRequest(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    client_index: int  # which API server gets the outputs
    prefill_leader: str | None = None


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


EngineInput = EngineRequest | AbortRequests | Shutdown


# -- engine core -> API server ------------------------------------------------------------------
class EngineReady(msgspec.Struct, tag=True, array_like=True):
    """Sent once the model is loaded: what the API server must know to validate requests."""

    model_name: str
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    logits_processors: list[str]  # 'module:Class' of each loaded processor


class EngineOutputs(msgspec.Struct, tag=True, array_like=True):
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    timestamp: float


class RequestError(msgspec.Struct, tag=True, array_like=True):
    """The engine refused a request at admission (the API server normally catches it first)."""

    request_id: str
    message: str


class EngineDead(msgspec.Struct, tag=True, array_like=True):
    message: str


EngineMessage = EngineReady | EngineOutputs | RequestError | EngineDead

_encoder = msgspec.msgpack.Encoder()
_input_decoder = msgspec.msgpack.Decoder(EngineInput)
_message_decoder = msgspec.msgpack.Decoder(EngineMessage)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode_input(data: bytes) -> EngineInput:
    return _input_decoder.decode(data)


def decode_message(data: bytes) -> EngineMessage:
    return _message_decoder.decode(data)
