"""A model given by name (`org/repo`, `org/repo:QUANT`, `hf.co/...`, `qwen3.5:0.8b`) made a local
path before any engine starts, for `nanoserve serve`, `chat`, `generate`, `bench`, `tune` and
`LLM(...)`: the download happens here, in the process the user watches, with a bar per file,
and the engine is given the path (model/sources/fetch.py). A path is checked here too, so a
mistyped one is one line before any process starts.
"""

from __future__ import annotations

from dataclasses import replace

from nanoserve.engine_args import EngineArgs
from nanoserve.model.model_path import DEFAULT_MODEL_ALIASES
from nanoserve.model.sources.fetch import local_model
from nanoserve.model.sources.names import parse_model_name
from nanoserve.model.sources.progress import ProgressSink, TerminalProgress


def with_local_model(engine_args: EngineArgs,
                     progress: ProgressSink | None = None) -> tuple[EngineArgs, str | None]:
    """`engine_args` with its model as the local file or directory to load, and the name the
    model was given by (None for a path or the default model), which vLLM serves it as."""
    path = local_model(engine_args.model, revision=engine_args.revision,
                       token=engine_args.hf_token, progress=progress or TerminalProgress())
    model = engine_args.model
    if model in DEFAULT_MODEL_ALIASES or parse_model_name(model or "") is None:
        return engine_args, None
    return replace(engine_args, model=str(path)), model
