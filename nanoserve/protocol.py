"""Every message that crosses a process boundary, as msgspec structs encoded with msgpack.

API server -> engine core: EngineRequest, AbortRequests, Shutdown.
Engine core -> API server: EngineReady (once), EngineOutputs (each step, and after inputs
that change the engine's state while it is idle), RequestError, EngineDead, and
EngineStartFailed in place of EngineReady. A pooling request
(an EngineRequest with `pooling_params`) comes back as one EngineCoreOutput with no tokens and
its vector in `pooled`.

Engine core -> workers: StepInput (each step); workers -> engine core: StepOutput. Rank 0 ->
tensor-parallel ranks 1..N-1: StepInput (published), then WorkerShutdown.

Token ids and numbers only: text is made in the API server. Never pickle: a message is decoded
into exactly these types or refused (msgspec validates while decoding). A step's arrays travel
as numpy buffers (a msgpack extension: dtype, shape, bytes), not as lists of Python ints.
"""

from __future__ import annotations

import msgspec
import numpy as np

from nanoserve.pooling_params import PoolingParams
from nanoserve.sampling_params import SamplingParams


class TokenLogprobs(msgspec.Struct, array_like=True):
    """One position's logprobs: the chosen token's, and the N most likely tokens'."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top_ids: list[int]
    top_logprobs: list[float]


class PromptProgress(msgspec.Struct, array_like=True):
    """How far a request's prompt is computed, after one of its prefill chunks (llama-server's
    `prompt_progress`, asked with `return_progress`): `processed` counts the cached part too."""

    total: int  # the prompt's tokens
    cache: int  # of them, served by the prefix cache
    processed: int  # cached + computed so far
    time_ms: int  # since its prompt's first chunk was scheduled


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step produced for one (engine) request. A request that asked for
    `return_progress` also gets one per prefill chunk: on the output of its first token for the
    chunk that ends the prompt, else on an output of its own, with no tokens and no finish."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    stop_reason: int | str | None = None  # the stop token id that ended it, if any
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    new_logprobs: list[TokenLogprobs] | None = None  # one per new token, if asked
    prompt_logprobs: list[TokenLogprobs] | None = None  # prompt tokens 1.., with the first
    # a pooling request's result, once its prompt is done: [dimensions] float32 (task
    # "embed") or [len(logit_token_ids)] float32 logits (task "score")
    pooled: np.ndarray | None = None
    prompt_progress: PromptProgress | None = None  # this step's prefill chunk, if asked


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
    # speculative decoding, as vLLM counts it: requests that drafted in a step, their draft
    # tokens, the drafts kept, and the drafts kept at each draft position (0 = the first)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)
    num_steps: int = 0  # steps that ran the model
    propose_seconds: float = 0.0  # time in the draft proposer (`nanoserve bench proposer`)
    # the prefix cache's disk tier (engine/kv_disk.py): blocks read back and missed, bytes
    kv_disk_hits: int = 0
    kv_disk_misses: int = 0
    kv_disk_bytes_read: int = 0
    kv_disk_bytes_written: int = 0


# -- API server -> engine core ------------------------------------------------------------------
class ImageInput(msgspec.Struct, array_like=True):
    """One image of a prompt: where its placeholder tokens lie, what it is, and its pixels as
    the model's processor resized them (model/vision/)."""

    offset: int  # the prompt index of its first placeholder token
    length: int  # its placeholder tokens, one feature row of the vision tower each
    content_hash: bytes  # 16 bytes of the decoded image: the prefix cache's and encoder's key
    pixels: np.ndarray  # uint8 [H, W, 3], resized (normalized where the tower runs)
    # (t, h, w) in patches, as transformers' image_grid_thw: where the model's RoPE is
    # multimodal (Qwen3.5), its placeholders' 3-D positions; (1, 1, 1) where it is not
    grid: tuple[int, int, int] = (1, 1, 1)

    @property
    def end(self) -> int:
        return self.offset + self.length


class EngineRequest(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    client_index: int  # which API server gets the outputs
    prefill_leader: str | None = None
    pooling_params: PoolingParams | None = None  # set: prefill only, a vector comes back
    tenant: str = ""  # the digest of the API key the request presented ("" without one)
    images: list[ImageInput] = []  # in prompt order, their placeholders in prompt_token_ids


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
    hidden_size: int = 0  # the length of an embedding (task "embed" without dimensions)
    pooling: str = "last"  # how embeddings pool the prompt's hidden states (--pooling)
    engine_index: int = 0  # which data-parallel engine core (vLLM's `engine_index`)
    cpu_isa: str = ""  # the CPU kernels' instruction-set tier (native.py), "" where none run
    kernel_schedule: str = ""  # the CPU kernels' schedule, in one line (kernel_tuning/)
    scheduling_policy: str = "fcfs"  # --scheduling-policy: whether `priority` may be set


class EngineOutputs(msgspec.Struct, tag=True, array_like=True):
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    timestamp: float
    engine_index: int = 0  # the data-parallel engine core that sent them


class RequestError(msgspec.Struct, tag=True, array_like=True):
    """The engine refused a request at admission (the API server normally catches it first)."""

    request_id: str
    message: str


class EngineDead(msgspec.Struct, tag=True, array_like=True):
    message: str
    engine_index: int = 0


class EngineStartFailed(msgspec.Struct, tag=True, array_like=True):
    """The engine core could not start (the model, its files, the memory): `reason` is the one
    line a user reads, `traceback` is for `--log-level debug`."""

    reason: str
    traceback: str
    engine_index: int = 0


EngineMessage = EngineReady | EngineOutputs | RequestError | EngineDead | EngineStartFailed

# -- engine core -> workers: one step, as data ------------------------------------------------
class NewSequence(msgspec.Struct, array_like=True):
    """A sequence given a slot this step: what the worker's sampler keeps for it."""

    slot: int
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty after a preemption: the output so far
    seed: int  # the seed of its draws: params.seed, or drawn at admission
    mirostat_mu: float | None = None  # after a preemption: mirostat's mu where it stopped


class PromptLogprobsRows(msgspec.Struct, array_like=True):
    """Rows of the flat batch whose logits give prompt logprobs for one scheduled request."""

    request_index: int  # into the step's requests
    first_row: int  # row j predicts target_token_ids[j]
    target_token_ids: list[int]
    num_logprobs: int


class PoolingRows(msgspec.Struct, array_like=True):
    """Rows of the flat batch that hold one pooling request's prompt chunk this step.

    A "last" pooling (or a "score") request gets an entry only for the chunk that ends its
    prompt; a "mean" one for every chunk, whose rows the worker adds to its slot's running sum.
    """

    request_index: int  # into the step's requests
    slot: int  # the request's slot: a mean's running sum is kept by it across chunks
    first_row: int
    num_rows: int
    is_first: bool  # the chunk starts at position 0: a mean starts from zero
    is_last: bool  # the chunk ends the prompt: the request's vector comes back this step
    num_prompt_tokens: int
    method: str  # "last" | "mean"
    params: PoolingParams


class StepImage(msgspec.Struct, array_like=True):
    """A run of one image's placeholder rows in a step: the vision tower's feature rows
    [first_feature, first_feature + num_rows) of the image replace the embeddings of the flat
    batch's rows [first_row, first_row + num_rows)."""

    first_row: int
    first_feature: int
    num_rows: int
    content_hash: bytes  # the encoder cache's key
    pixels: np.ndarray  # uint8 [S, S, 3], for the tower where the cache misses


class StepInput(msgspec.Struct, tag=True, array_like=True):
    """One step for every worker: flat arrays, no engine objects (the worker never sees a
    request or the scheduler). R requests are scheduled, T tokens computed, S rows sampled.

    Requests come in batch order: the first `num_decodes` compute one token each, then the
    rest (prefill chunks, and decodes that verify draft tokens) compute runs of tokens.
    """

    token_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    cache_index: np.ndarray  # [T] int64, where each token's keys and values are written
    query_start_loc: np.ndarray  # [R + 1] int64, request i's tokens are rows [q[i], q[i+1])
    context_lens: np.ndarray  # [R] int32, tokens in the cache after this step
    block_table: np.ndarray  # [R, max_blocks] int32, each request's blocks (padded)
    num_decodes: int
    logits_rows: np.ndarray  # [S] int64, rows of the flat batch that are sampled
    sample_slots: np.ndarray  # [S] int64, the sampler slot of each sampled row
    sample_positions: np.ndarray  # [S] int64, the output index each row draws
    # [S] int64: the draft token a row's draw is checked against; -1 for a request's last row
    draft_token_ids: np.ndarray
    num_sample_rows: np.ndarray  # [num_sampling_requests] int64, rows per request, in order
    grammar_rows: np.ndarray  # [G] int64, sampled rows with a grammar
    grammar_bitmask: np.ndarray  # [G, ceil(vocab / 32)] int32, filled by the core
    prompt_logprobs: list[PromptLogprobsRows]
    new_sequences: list[NewSequence]
    released_slots: list[int]  # slots freed since the last step, cleared before new ones
    pooling: list[PoolingRows] = []  # prefill-only requests' rows to pool
    # models with several KV layer groups (model/kv_groups.py): groups 1.. have block tables
    # and cache rows of their own (block_table and cache_index above are group 0's)
    group_block_tables: list[np.ndarray] = []  # per group, [R, max_blocks] int32
    group_cache_index: list[np.ndarray] = []  # per group, [T] int64
    # hybrid models (engine/state_pool.py): each request's state slot [R], in batch order;
    # the admitted requests' states set before the forward, (slot, snapshot slot or -1 for
    # zeros); and the rows after which a state is copied to a snapshot slot, (row, slot)
    seq_slots: list[int] = []
    state_inits: list[tuple[int, int]] = []
    state_snapshots: list[tuple[int, int]] = []
    # images (model/vision/): the placeholder rows this step computes; and where a model
    # attends both ways inside an image (Gemma 3), each token's key end [T] int32: its
    # position + 1, or its image's end (empty: a causal step)
    images: list[StepImage] = []
    key_ends: np.ndarray = msgspec.field(default_factory=lambda: np.zeros(0, np.int32))
    # multimodal RoPE (Qwen3.5): each token's (t, h, w) position [3, T] int64 where a request
    # of the step has images (engine/rope_positions.py); [3, 0]: the positions above
    rope_positions: np.ndarray = msgspec.field(
        default_factory=lambda: np.zeros((3, 0), np.int64))

    @property
    def num_requests(self) -> int:
        return len(self.context_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class WorkerShutdown(msgspec.Struct, tag=True, array_like=True):
    """Rank 0 to its tensor-parallel workers: no more steps, leave the group and exit."""


WorkerMessage = StepInput | WorkerShutdown


class StepOutput(msgspec.Struct, array_like=True):
    """What a step's sampling gave (from the worker of rank 0)."""

    sampled_token_ids: list[int]  # [S], one per sampled row
    # [num_sampling_requests]: tokens each request commits, 1 + its accepted draft tokens
    num_accepted: list[int]
    logprobs: list[TokenLogprobs | None]  # [S]; None where not asked
    prompt_logprobs: list[list[TokenLogprobs]]  # one list per StepInput.prompt_logprobs entry
    sample_seconds: float = 0.0  # time in the grammar mask and the sampler
    # one vector per StepInput.pooling entry that `is_last`, in order (float32)
    pooled: list[np.ndarray] = []
    # the slots added this step whose sequence a custom logits processor keeps from drafts
    draft_refusing_slots: list[int] = []
    # per sampling request (num_sample_rows order), the next drafts of a drafter that runs in
    # the worker (the model's MTP head: engine/mtp_drafter.py); [] without one
    draft_token_ids: list[list[int]] = []
    # slot -> mirostat's mu after this step's committed tokens (mirostat slots that sampled)
    mirostat_mu: dict[int, float] = {}


_ARRAY_EXT = 1  # msgpack extension code of a numpy array


def _encode_array(value: object) -> msgspec.msgpack.Ext:
    if not isinstance(value, np.ndarray):
        raise NotImplementedError(f"cannot encode {type(value).__name__}")
    array = np.ascontiguousarray(value)
    # a one-byte type's str has no byte order but "|" ("|u1"), the header's separator: "="
    dtype = array.dtype.str.replace("|", "=")
    header = f"{dtype}|{','.join(map(str, array.shape))}|".encode()
    return msgspec.msgpack.Ext(_ARRAY_EXT, header + array.tobytes())


def _decode_array(code: int, data: memoryview) -> np.ndarray:
    if code != _ARRAY_EXT:
        raise ValueError(f"unknown msgpack extension {code}")
    dtype, shape, _ = bytes(data[:80]).split(b"|", 2)
    offset = len(dtype) + len(shape) + 2
    dims = tuple(int(n) for n in shape.split(b",") if n)
    return np.frombuffer(data[offset:], dtype=np.dtype(dtype.decode())).reshape(dims).copy()


_encoder = msgspec.msgpack.Encoder(enc_hook=_encode_array)
_input_decoder = msgspec.msgpack.Decoder(EngineInput, ext_hook=_decode_array)
_message_decoder = msgspec.msgpack.Decoder(EngineMessage, ext_hook=_decode_array)
_step_decoder = msgspec.msgpack.Decoder(StepInput, ext_hook=_decode_array)
_worker_decoder = msgspec.msgpack.Decoder(WorkerMessage, ext_hook=_decode_array)
_step_output_decoder = msgspec.msgpack.Decoder(StepOutput, ext_hook=_decode_array)


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode_step(data: bytes) -> StepInput:
    return _step_decoder.decode(data)


def decode_worker_message(data: bytes) -> WorkerMessage:
    return _worker_decoder.decode(data)


def decode_step_output(data: bytes) -> StepOutput:
    return _step_output_decoder.decode(data)


def decode_input(data: bytes) -> EngineInput:
    return _input_decoder.decode(data)


def decode_message(data: bytes) -> EngineMessage:
    return _message_decoder.decode(data)
