"""`nanoserve bench …`: programs that print figures beside a peer measured in the same run.

Only the CLI imports bench (bench/cli.py adds the subcommands), and bench never imports
entrypoints/: the benchmarks that run the offline engine are handed an `LLMFactory` by the CLI
and use what they get through `OfflineLLM`, the part of `nanoserve.LLM` they need.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # torch stays unloaded until a benchmark runs
    from nanoserve.engine.core import EngineCore
    from nanoserve.engine_args import EngineArgs
    from nanoserve.outputs import RequestOutput
    from nanoserve.sampling_params import SamplingParams


class OfflineLLM(Protocol):
    """What the benchmarks use of `nanoserve.LLM`."""

    engine: EngineCore
    tokenizer: Any

    def generate(self, prompts: Sequence[dict[str, Any]], sampling_params: SamplingParams,
                 *, use_tqdm: bool) -> list[RequestOutput]: ...


LLMFactory = Callable[["EngineArgs"], OfflineLLM]
