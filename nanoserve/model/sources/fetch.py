"""A model as the user gives it (a path, a hub name, an Ollama name) → the local path the loader
takes, downloading it first where it is a name not yet here.

`local_model` is what `nanoserve serve/chat/bench`, `LLM(...)` and the router's model servers
call at the edge; `pull_model` is `nanoserve pull`, Ollama's `/api/pull` and the router's
`--allow-pull`. Both record what they fetch (store.py), so `nanoserve list` shows it and a
router finds it by the name it was pulled as.
"""

from __future__ import annotations

import time
from pathlib import Path

from nanoserve.config import hub_environment
from nanoserve.model.gguf_split import gguf_model_files
from nanoserve.model.model_path import DEFAULT_MODEL_ALIASES, resolve_model_path
from nanoserve.model.sources.errors import ModelNotPulledError, ModelSourceError
from nanoserve.model.sources.hub import fetch_from_hub
from nanoserve.model.sources.names import HubName, ModelName, RegistryName, parse_model_name
from nanoserve.model.sources.progress import ProgressSink, no_progress
from nanoserve.model.sources.registry import pull_from_registry
from nanoserve.model.sources.store import PulledModel, find_pulled, record_pulled

__all__ = ["ModelNotPulledError", "ModelSourceError", "local_model", "pull_model"]


def local_model(model: str | None, *, revision: str | None = None, token: str | None = None,
                progress: ProgressSink = no_progress, may_download: bool = True) -> Path:
    """The file or directory to load for `model`: the default model's GGUF for None or its
    name, a path as it is (FileNotFoundError naming it when it is missing), a name from the
    store or, if `may_download`, fetched now (ModelNotPulledError if not). Raises
    ModelSourceError naming the cause and the fix when a name cannot be had."""
    if model in DEFAULT_MODEL_ALIASES:
        return resolve_model_path(model)
    assert model is not None
    name = parse_model_name(model, revision)
    if name is None:
        return resolve_model_path(model)
    pulled = find_pulled(str(name)) if revision is None else None
    if pulled is not None and pulled.path.exists():
        return pulled.path
    if not may_download:
        raise ModelNotPulledError(str(name), "not pulled on this machine",
                                  f"run `nanoserve pull {name}` first")
    return fetch(name, token=token, progress=progress).path


def pull_model(model: str, *, token: str | None = None,
               progress: ProgressSink = no_progress) -> PulledModel:
    """Fetch `model` (a hub or Ollama name) whether or not it is here, and record it: Ollama's
    pull, which also checks that what is here is whole and current."""
    name = parse_model_name(model)
    if name is None:
        raise ModelSourceError(model, "not a model name (it is a path)",
                               "serve a local file by its path; pull takes names such as "
                               "org/repo, org/repo:Q4_K_M, hf.co/org/repo:Q4_K_M or "
                               "qwen3.5:0.8b")
    return fetch(name, token=token, progress=progress)


def fetch(name: ModelName, *, token: str | None = None,
          progress: ProgressSink = no_progress) -> PulledModel:
    """Download `name` (or find it whole in the cache) and record it in the store."""
    if isinstance(name, RegistryName):
        return pull_from_registry(name, progress=progress)  # it records what it pulls
    assert isinstance(name, HubName)
    path = fetch_from_hub(name, token=token, progress=progress)
    pulled = PulledModel(name=str(name), source=_hub_source(name), path=path,
                         size=_size_on_disk(path), digest=_hub_digest(path),
                         modified_at=time.time())
    record_pulled(pulled)
    return pulled


def _hub_source(name: HubName) -> str:
    endpoint = hub_environment().endpoint  # the one fetch_from_hub used
    return f"{endpoint}/{name.repo}" + (f"@{name.revision}" if name.revision else "")


def _size_on_disk(path: Path) -> int:
    """Bytes of the model's files: a checkpoint directory's, or a GGUF file's with its other
    split parts."""
    files = list(path.iterdir()) if path.is_dir() else gguf_model_files(path)
    return sum(f.stat().st_size for f in files if f.is_file())


def _hub_digest(path: Path) -> str:
    """The cache's blob name of the model file (the LFS sha256 it was checked against)."""
    target = path.resolve() if not path.is_dir() else None
    return f"sha256:{target.name}" if target is not None and len(target.name) == 64 else ""
