"""EngineArgs: every engine setting in one flat dataclass, with its default and its help text.

The CLI's engine flags (`add_cli_args`, `from_cli_args`), `LLM(...)`'s keyword arguments and the
benchmarks' engines all come from here, and `to_config()` builds the frozen EngineConfig from
it. Each default is read from the config dataclass that owns it, so none is written twice.

It sits beside config.py, below entrypoints/ and bench/, so both can build engines from it;
and it imports no torch, so `nanoserve --help` builds every flag without loading it.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from nanoserve.config import (
    DEFAULT_MODEL_NAME,
    KERNEL_TUNING_MODES,
    KV_CACHE_DTYPES,
    LOAD_BALANCE_METHODS,
    MAMBA_SSM_CACHE_DTYPES,
    POOLING_METHODS,
    QUANTIZATION_MODES,
    SCHEDULING_POLICIES,
    CacheConfig,
    EngineConfig,
    GiB,
    KVEventsConfig,
    ModelConfig,
    ParallelConfig,
    SamplerConfig,
    SchedulerConfig,
)
from nanoserve.speculative_config import SpeculativeConfig


def _arg(default: Any, help: str, flag: str | None = None, **argparse_kwargs: Any) -> Any:
    """A field with its CLI flag: `--field-name` unless `flag` says otherwise."""
    return field(default=default, metadata={"help": help, "flag": flag, **argparse_kwargs})


def _comma_separated(text: str) -> tuple[str, ...]:
    return tuple(s for s in text.split(",") if s)


@dataclass(frozen=True)
class EngineArgs:
    """The engine's settings as the user gives them: flat, with flags and keyword names."""

    model: str | None = _arg(
        ModelConfig.model, "a local HF model directory or .gguf file, or a name: org/repo, "
        "org/repo:QUANT (a GGUF repository's file), hf.co/org/repo:QUANT, an Ollama name "
        f"such as qwen3.5:0.8b (default: {DEFAULT_MODEL_NAME})")
    revision: str | None = _arg(
        None, "with a hub name: the branch, tag or commit to fetch (default: the main branch)")
    hf_token: str | None = _arg(
        None, "with a hub name: the token of a gated or private repository (default: HF_TOKEN "
        "or the one `hf auth login` stored)")
    mmproj: str | None = _arg(
        ModelConfig.mmproj, "llama.cpp's multimodal projector GGUF: the vision tower of a GGUF "
        "model, so its prompts may carry images (as llama-server's --mmproj)")
    device: str = _arg(ModelConfig.device, "auto | cpu | cuda | cuda:N")
    dtype: str = _arg(ModelConfig.dtype, "auto | float32 | bfloat16 | float16 "
                      "(auto: float32 on CPU, bfloat16 on CUDA)")
    quantization: str = _arg(
        ModelConfig.quantization,
        "how matmul weights are held: auto (a GGUF file's own blocks, else float) | gguf | "
        "int8 (Q8_0 blocks) | fp16 | none (exact float32) (default: %(default)s)",
        choices=QUANTIZATION_MODES)
    max_model_len: int | None = _arg(
        ModelConfig.max_model_len, "the longest prompt + output (default: the model's context, "
        "capped by what the KV cache holds)", type=int)
    max_num_seqs: int = _arg(SchedulerConfig.max_num_seqs,
                             "requests running at once (default: %(default)s)", type=int)
    max_num_batched_tokens: int = _arg(
        SchedulerConfig.max_num_batched_tokens,
        "tokens in one forward pass; smaller chunks long prefills finer, which lowers "
        "time-to-first-token under load (default: %(default)s)", type=int)
    long_prefill_token_threshold: int = _arg(
        SchedulerConfig.long_prefill_token_threshold,
        "the most prompt tokens one request computes in a step, so that a long prompt does not "
        "stall the streams already decoding for long; 0: only --max-num-batched-tokens caps it "
        "(default: %(default)s)", type=int)
    prefill_pacing: float = _arg(
        SchedulerConfig.prefill_pacing,
        "while requests decode, cut the chunks of prompts longer than --max-num-batched-tokens "
        "so a step takes about this many times a decode-only step (measured as it runs), so "
        "the streams keep their pace beside a long prompt; 0: off (default: %(default)s)",
        type=float, metavar="FACTOR")
    scheduling_policy: str = _arg(
        SchedulerConfig.scheduling_policy,
        "fcfs: requests in arrival order; priority: by each request's `priority` (lower "
        "first, ties by arrival), the lowest preempted first (default: %(default)s)",
        choices=SCHEDULING_POLICIES)
    kv_cache_memory_gb: float | None = _arg(
        None, "KV cache size in GiB (default: on CPU 1, or less where --max-num-seqs sequences at "
        "the full context need less; 90%% of free GPU memory)",
        flag="--kv-cache-memory", type=float, metavar="GIB")
    num_kv_blocks: int | None = _arg(
        CacheConfig.num_blocks, "KV cache size in blocks, instead of --kv-cache-memory",
        type=int)
    block_size: int = _arg(CacheConfig.block_size,
                           "token positions per KV-cache block (default: %(default)s)", type=int)
    kv_cache_dtype: str = _arg(
        CacheConfig.kv_cache_dtype,
        "element type of the KV cache: auto (float16 on the CPU with quantized weights, else "
        "the model's dtype) | float32 | float16 (half the memory and decode-attention reads; "
        "keys and values rounded to 11 significant bits) | int8 (a quarter of float32's "
        "bytes; each key and value head scaled to int8 by its largest magnitude; CPU with the "
        "attention kernel built) (default: %(default)s)",
        choices=KV_CACHE_DTYPES)
    enable_prefix_caching: bool = _arg(
        CacheConfig.enable_prefix_caching, "do not reuse the KV blocks of shared prompt prefixes",
        flag="--no-prefix-caching", action="store_false")
    mamba_block_size: int = _arg(
        CacheConfig.mamba_block_size, "hybrid models (Qwen3.5): the tokens between two "
        "snapshots of a sequence's Gated DeltaNet states, where a cached prefix can end (a "
        "prompt's last two full blocks are kept too) (default: %(default)s)", type=int)
    mamba_ssm_cache_dtype: str = _arg(
        CacheConfig.mamba_ssm_cache_dtype, "hybrid models (Qwen3.5): the element type of the "
        "Gated DeltaNet recurrent states: auto (float32) | float32 | bfloat16 | float16 (half "
        "the state memory, so twice the prefix-cache snapshots; the state rounded after every "
        "token, which moves logprobs slightly; the conv states stay float32) "
        "(default: %(default)s)", choices=MAMBA_SSM_CACHE_DTYPES)
    kv_cache_disk: str | None = _arg(
        CacheConfig.kv_cache_disk, "a folder for the prefix cache's disk tier: blocks evicted "
        "from RAM (and every cached block at shutdown) are kept there, by their prefix's hash "
        "and the model's fingerprint, and read back on a RAM miss, across restarts (default: "
        "off)", metavar="DIR")
    kv_cache_disk_gb: float = _arg(
        CacheConfig.kv_cache_disk_bytes / GiB, "the disk tier's size in GiB; the least "
        "recently used files go past it (default: %(default)s)", flag="--kv-cache-disk-size",
        type=float, metavar="GIB")
    seed: int | None = _arg(ModelConfig.seed, "where unseeded requests get their seeds from "
                            "(default: %(default)s)", type=int)
    logits_processors: Sequence[str | type] = _arg(
        SamplerConfig.logits_processors, "custom logits processors to load (entry points of "
        "the group nanoserve.logits_processors are always loaded)",
        type=_comma_separated, metavar="MODULE:CLASS[,...]")
    max_logprobs: int = _arg(SamplerConfig.max_logprobs,
                             "the most top-N logprobs a request may ask for "
                             "(default: %(default)s)", type=int)
    draft_proposer: str | None = _arg(
        SchedulerConfig.draft_proposer, "a class that proposes draft tokens, scored several per "
        "step and kept only where they equal the model's own draws (engine/drafts.py)",
        metavar="MODULE:CLASS")
    num_speculative_tokens: int = _arg(
        SchedulerConfig.num_speculative_tokens,
        "the most draft tokens a request takes per step, with --draft-proposer "
        "(default: %(default)s)", type=int)
    speculative_max_rows: int = _arg(
        SchedulerConfig.speculative_max_rows,
        "drafts are proposed only while a step's decode rows plus drafts stay within this and "
        "no prompt chunk waits (default: %(default)s)", type=int)
    # JSON text from the flag; LLM(speculative_config=...) may pass the dict itself
    speculative_config: str | None = _arg(
        None, 'speculative decoding without a draft model, as vLLM spells it: JSON such as '
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 3, '
        '"prompt_lookup_max": 5}\' or \'{"method": "suffix"}\' (default: off)',
        metavar="JSON")
    pooling: str = _arg(
        ModelConfig.pooling, "how /v1/embeddings pools a prompt's final hidden states: last "
        "(the last token's, for decoder models) | mean (every token's average; no prefix-cache "
        "hits) (default: %(default)s)", choices=POOLING_METHODS)
    kernel_tuning: str = _arg(
        ModelConfig.kernel_tuning,
        "the CPU kernels' schedule (prefetch, thresholds, tier), measured on this CPU: cached "
        "(timed at the first start on a machine, then read from ~/.cache/nanoserve/tune) | "
        "force (timed again) | off (the built-in constants, for A/B runs) "
        "(default: %(default)s)", choices=KERNEL_TUNING_MODES)
    enforce_eager: bool = _arg(
        ModelConfig.enforce_eager, "run the decoder layers as a Python loop over the kernels, "
        "not as one native call (the same arithmetic; for comparing and debugging)",
        action="store_true")
    tensor_parallel_size: int = _arg(
        ParallelConfig.tensor_parallel_size,
        "processes the model's weights and KV cache are split over, on this host or across "
        "--nnodes (rank 0 is the engine core; the model's heads, KV heads or MLP rows must "
        "split evenly, or the start-up error names the sizes that do) (default: %(default)s)",
        type=int)
    data_parallel_size: int = _arg(
        ParallelConfig.data_parallel_size,
        "engine cores behind the API servers, each with its own KV and prefix cache and its "
        "share of this host's cores (nanoserve serve only) (default: %(default)s)", type=int)
    load_balance_method: str = _arg(
        ParallelConfig.load_balance_method,
        "how a request's engine core is picked with --data-parallel-size > 1: cache_aware "
        "(where its prompt's leading blocks were sent before, unless the loads are "
        "imbalanced) | round_robin (default: %(default)s)", choices=LOAD_BALANCE_METHODS)
    nnodes: int = _arg(ParallelConfig.nnodes, "nodes the tensor-parallel ranks are spread "
                       "over, each with --tensor-parallel-size / --nnodes of them "
                       "(default: %(default)s)", type=int)
    node_rank: int = _arg(ParallelConfig.node_rank, "this node's place among --nnodes: 0 runs "
                          "the engine core and the API, the others --headless "
                          "(default: %(default)s)", type=int)
    master_addr: str | None = _arg(
        None, "node 0's address, where every rank meets, with --nnodes > 1 (default: "
        f"{ParallelConfig.master_addr} on one node)")
    master_port: int | None = _arg(
        ParallelConfig.master_port, "node 0's port for the ranks' rendezvous, with --nnodes > 1 "
        "(default: one the OS picks on one node)", type=int)
    headless: bool = _arg(ParallelConfig.headless, "run this node's tensor-parallel ranks "
                          "only: no API server, no engine core (--node-rank > 0)",
                          action="store_true")
    kv_events_config: str | None = _arg(
        None, "publish the prefix cache's stored and evicted blocks for a router, vLLM's JSON: "
        "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": "
        "\"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\"}' (default: off)",
        metavar="JSON")
    zero_cost_runner: bool = _arg(
        ModelConfig.zero_cost_runner, "benchmark the frontend: skip the model, emit tokens at once",
        flag="--zero-cost-engine", action="store_true")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Add one flag per field, in an "engine" group, with the field's default and help."""
        group = parser.add_argument_group("engine")
        for f in fields(cls):
            options = dict(f.metadata)
            flag = options.pop("flag") or "--" + f.name.replace("_", "-")
            group.add_argument(flag, dest=f.name, default=f.default, **options)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The EngineArgs of parsed flags (a parser that `add_cli_args` filled)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    def to_config(self) -> EngineConfig:
        """The frozen config the engine core is built from."""
        return EngineConfig(
            model=ModelConfig(model=self.model, mmproj=self.mmproj, device=self.device,
                              dtype=self.dtype,
                              max_model_len=self.max_model_len, seed=self.seed,
                              quantization=self.quantization, pooling=self.pooling,
                              zero_cost_runner=self.zero_cost_runner,
                              enforce_eager=self.enforce_eager,
                              kernel_tuning=self.kernel_tuning),
            cache=CacheConfig(
                block_size=self.block_size, num_blocks=self.num_kv_blocks,
                kv_cache_memory_bytes=None if self.kv_cache_memory_gb is None
                else int(self.kv_cache_memory_gb * GiB),
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_dtype=self.kv_cache_dtype, mamba_block_size=self.mamba_block_size,
                mamba_ssm_cache_dtype=self.mamba_ssm_cache_dtype,
                kv_cache_disk=self.kv_cache_disk,
                kv_cache_disk_bytes=int(self.kv_cache_disk_gb * GiB)),
            scheduler=self._scheduler_config(),
            sampler=SamplerConfig(logits_processors=tuple(self.logits_processors),
                                  max_logprobs=self.max_logprobs),
            parallel=self._parallel_config(),
            kv_events=KVEventsConfig() if self.kv_events_config is None
            else KVEventsConfig.from_json(self.kv_events_config),
        )

    def _parallel_config(self) -> ParallelConfig:
        parallel = ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size, nnodes=self.nnodes,
            data_parallel_size=self.data_parallel_size,
            load_balance_method=self.load_balance_method,
            node_rank=self.node_rank, master_port=self.master_port, headless=self.headless,
            master_addr=self.master_addr or ParallelConfig.master_addr)
        if self.nnodes > 1 and self.master_addr is None:  # no default that could be wrong
            raise ValueError(f"--nnodes {self.nnodes} needs --master-addr (node 0's address, "
                             "which every node can reach)")
        if self.data_parallel_size > 1 and self.kv_events_config is not None:
            # engine core k publishes on the ports plus k: a port that cannot move, or ports
            # that would collide, fail here rather than in an engine core at start
            KVEventsConfig.from_json(self.kv_events_config).check_data_parallel(
                self.data_parallel_size)
        return parallel

    def _scheduler_config(self) -> SchedulerConfig:
        speculative = SpeculativeConfig.parse(self.speculative_config)
        if speculative is not None and self.draft_proposer is not None:
            raise ValueError("give --speculative-config or --draft-proposer, not both")
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            prefill_pacing=self.prefill_pacing, scheduling_policy=self.scheduling_policy,
            draft_proposer=speculative or self.draft_proposer,
            speculative_max_rows=self.speculative_max_rows,
            num_speculative_tokens=speculative.num_speculative_tokens if speculative
            else self.num_speculative_tokens)
