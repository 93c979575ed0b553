"""A request as the engine core sees it: token ids, progress, blocks, and why it finished."""

from __future__ import annotations

import enum

import numpy as np

from nanoserve.pooling_params import PoolingParams
from nanoserve.protocol import ImageInput, TokenLogprobs
from nanoserve.sampling_params import SamplingParams
from nanoserve.structured.manager import SequenceGrammar


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # waiting again, its KV cache dropped; it recomputes when readmitted
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6  # the engine could not go on (a grammar that failed or refused a token)

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {3: "stop", 4: "length", 5: "abort", 6: "error"}.get(int(self))


class Request:
    """One sequence being generated, or a prompt being pooled (`pooling_params` set: it is
    prefilled like any prompt, samples nothing, and finishes when its prompt is computed).
    `num_computed_tokens` counts tokens whose KV is cached."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: tuple[int, ...] = (),
                 pooling_params: PoolingParams | None = None,
                 pooling_method: str = "last") -> None:
        self.request_id = request_id
        # the sampler's SequenceData shares these two lists: extend them in place, never rebind
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)  # prompt + output, appended in place
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.stop_token_ids = frozenset(params.stop_token_ids)  # checked on every new token
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_computed_tokens = 0
        self.block_hashes: list[bytes] = []  # prefix-cache keys of its full blocks, grown lazily
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at admission
        # perf_counter when its prompt's first chunk ran (read for `return_progress` only)
        self.prompt_started: float | None = None
        self.sampling_seed = 0  # the seed the sampler uses: params.seed, or drawn at admission
        self.arrival = 0  # its arrival number in the scheduler (the priority policy's tiebreak)
        self.slot: int | None = None  # row in the sampler's per-slot state while running
        # a hybrid model's prefix hit: the snapshot slot its DeltaNet states start from, or
        # -1 (zeros); set where its cached prefix is looked up (engine/state_cache.py)
        self.state_source = -1
        # n > 1: the first sample, whose prompt blocks this one waits for and then shares
        self.prefill_leader: Request | None = None
        # prompt logprobs computed so far (positions 1..), handed out with the first token
        self.prompt_logprobs: list[TokenLogprobs] = []
        # structured outputs: the grammar this sequence's tokens must follow (None: free)
        self.grammar: SequenceGrammar | None = None
        # proposed continuations, scored in its next decode step (speculative decoding)
        self.draft_token_ids: list[int] = []
        # how often this request's drafts have been kept lately (an average over its drafting
        # steps, 1.0 until it has drafted), and the steps it has gone without drafting
        self.draft_acceptance = 1.0
        self.tenant = ""  # the digest of the API key it came with (SequenceData.tenant)
        self.steps_without_drafts = 0
        # a custom logits processor of its sampler slot cannot see draft rows (the worker
        # says so when the slot is added: StepOutput.draft_refusing_slots)
        self.refuses_drafts = False
        # mirostat's mu after the committed output (the worker's, each step): a preempted
        # request's sampler slot starts again from it (None: not sampled with mirostat yet)
        self.mirostat_mu: float | None = None
        # prefill only: what to pool once the prompt is computed, and how ("last" | "mean";
        # a "score" request reads the last position whatever the engine's --pooling)
        self.pooling_params = pooling_params
        is_embed = pooling_params is not None and pooling_params.task == "embed"
        self.pooling_method = pooling_method if is_embed else "last"
        # the prompt's images, in order: their placeholder tokens' spans and pixels
        self.images: list[ImageInput] = []
        # multimodal RoPE (Qwen3.5, a prompt with images): its prompt's (t, h, w) positions
        # [3, P] and the shift of every later token's (engine/rope_positions.py)
        self.rope_positions: np.ndarray | None = None
        self.rope_delta = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_pooling(self) -> bool:
        return self.pooling_params is not None

    @property
    def computes_every_position(self) -> bool:
        """True when every prompt position must run through the model, so the request takes
        no prefix-cache hits: prompt logprobs read each position's logits, a mean pools each
        position's hidden state (the last position, always computed, is all a "last" needs)."""
        return self.params.prompt_logprobs is not None or (
            self.is_pooling and self.pooling_method == "mean")

    @property
    def waits_for_leader(self) -> bool:
        """True while the leader is running but has not computed its whole prompt."""
        leader = self.prefill_leader
        return (leader is not None and leader.status == RequestStatus.RUNNING
                and leader.num_computed_tokens < leader.num_prompt_tokens)

    @property
    def waits_for_grammar(self) -> bool:
        """True until its grammar has compiled (a failed compile keeps it waiting until the
        engine finishes it with an error)."""
        return self.grammar is not None and not self.grammar.is_ready

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}"
                f", output={self.num_output_tokens}, computed={self.num_computed_tokens})")
