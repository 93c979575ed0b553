"""Custom logits processors: a small interface, and where nanoserve finds them.

A processor is a class. The engine makes one instance at start-up and calls it each step, after
the built-in penalties and before the thinking budget and temperature, with the rows of the
requests it said it acts on. Like vLLM's (`vllm/v1/sample/logits_processor/interface.py`), a
processor gets data, never the engine's request object: each sequence reaches it as a frozen
`SequenceData(slot, params, prompt_token_ids, output_token_ids, seed)`, whose token-id lists
the engine grows in place (read them; never change them). Per-request arguments travel in
`SamplingParams.extra_args`. The interface:

    validate_params(cls, params: SamplingParams) -> None       # classmethod, at admission
    add_request(self, seq: SequenceData) -> bool               # True: act on this sequence
    remove_request(self, slot: int) -> None                    # its slot was released
    apply(self, logits: Tensor, batch: ProcessorBatch) -> None  # each step, in place

`ProcessorBatch` holds the step's rows this processor acts on: `rows` (indices into `logits`),
`rows_gpu`, `slots`, `seqs` (each row's `SequenceData`) and `num_pending`. With speculative
decoding a request owns several rows in a step, one per draft position; row j's `seqs` entry
ends with the j draft tokens before it (`num_pending[i]` of them, not yet committed), so a
processor that reads `output_token_ids` sees what a one-token decode would. A class that keeps
state across steps must not take pending tokens into it; it declares `supports_speculation =
True` once it handles them, and until then the requests it acts on get no drafts. For example:

    class BanToken(LogitsProcessor):
        '''extra_args={"ban_token": id}: that token is never drawn.'''

        @classmethod
        def validate_params(cls, params):           # at admission: refuse bad arguments
            token = (params.extra_args or {}).get("ban_token")
            if token is not None and not isinstance(token, int):
                raise ValueError(f"extra_args['ban_token'] must be a token id, got {token!r}")

        def add_request(self, seq):                 # True: act on this sequence
            self.token[seq.slot] = (seq.params.extra_args or {}).get("ban_token")
            return self.token[seq.slot] is not None

        def apply(self, logits, batch):             # edit only your rows, in place
            for row, slot in zip(batch.rows, batch.slots):
                logits[row, self.token[slot]] = float("-inf")

Processors are loaded from `--logits-processors module:Class[,module:Class]` (or
`LLM(logits_processors=[...])`) and from every installed entry point of the group
`nanoserve.logits_processors`.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from nanoserve.plugins import import_named
from nanoserve.sample.sequence import SequenceData
from nanoserve.sampling_params import SamplingParams

if TYPE_CHECKING:  # the API process loads the classes to check requests' arguments, no tensors
    import torch

ENTRY_POINT_GROUP = "nanoserve.logits_processors"


@dataclass
class ProcessorBatch:
    """The rows of one step that a processor acts on."""

    rows: np.ndarray  # row indices into the step's logits
    rows_gpu: torch.Tensor
    slots: np.ndarray  # each row's slot
    seqs: list[SequenceData]  # each row's sequence: params, prompt and output token ids
    # [rows] int64: draft tokens at the end of each row's output_token_ids, not yet committed
    num_pending: np.ndarray | None = None


class LogitsProcessor:
    """Base class of custom logits processors (see the module docstring)."""

    # True: `apply` is right for draft rows (it reads `num_pending`, or keeps no state across
    # steps); False: the requests this processor acts on take no draft tokens
    supports_speculation = False

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        self.num_slots = num_slots
        self.vocab_size = vocab_size
        self.device = device

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        """Raise ValueError (naming the argument and value) for arguments this processor
        cannot take. Called when a request enters the engine, before it runs."""

    def add_request(self, seq: SequenceData) -> bool:
        """The sequence now occupies `seq.slot`; return True if this processor acts on it."""
        return False

    def remove_request(self, slot: int) -> None:
        """The sequence in `slot` finished or was preempted."""

    def apply(self, logits: torch.Tensor, batch: ProcessorBatch) -> None:
        """Edit `logits[batch.rows]` in place ([num_rows_in_step, vocab] float32)."""
        raise NotImplementedError


def resolve_processor(spec: str) -> type[LogitsProcessor]:
    """'package.module:ClassName' -> the class, or a ValueError saying what is wrong."""
    module_name, _, class_name = spec.partition(":")
    cls = import_named(spec, "logits processor")
    if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
        raise ValueError(f"logits processor {spec!r}: {class_name!r} in {module_name!r} is not a "
                         "subclass of nanoserve.sample.logits_processor.LogitsProcessor")
    return cls


def load_processor_classes(specs: Sequence[str | type[LogitsProcessor]] = ()
                           ) -> list[type[LogitsProcessor]]:
    """Installed entry points first, then the given specs; each class once."""
    found: list[type[LogitsProcessor]] = []
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        cls = entry_point.load()
        if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
            raise ValueError(f"entry point {entry_point.name!r} of {ENTRY_POINT_GROUP} is not a "
                             "LogitsProcessor subclass")
        found.append(cls)
    for spec in specs:
        found.append(resolve_processor(spec) if isinstance(spec, str) else spec)
    return list(dict.fromkeys(found))
