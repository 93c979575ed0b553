"""huggingface_hub's and the network's failures as the one line a user reads: the model, the
cause and the fix (a ModelSourceError).

huggingface_hub is imported when a failure is explained, not with this module: the launcher
checks a model's name before it imports anything heavy.
"""

from __future__ import annotations

import errno
from typing import TYPE_CHECKING

from nanoserve.model.sources.errors import ModelSourceError
from nanoserve.model.sources.hub_download import ChecksumMismatch
from nanoserve.model.sources.hub_files import RepoFile, gguf_files, offered_quants
from nanoserve.model.sources.names import DEFAULT_GGUF_QUANT, HubName

if TYPE_CHECKING:
    from nanoserve.config import HubEnvironment


def hub_errors() -> tuple[type[BaseException], ...]:
    """What a fetch from the hub raises that `explain` answers: huggingface_hub's HTTP errors,
    httpx2's transport errors, OSError (a full disk, a cut transfer, offline without the file)
    and ChecksumMismatch."""
    import httpx2

    return httpx2.HTTPError, OSError, ChecksumMismatch


def explain(name: HubName, error: BaseException, hub: HubEnvironment, token: str | None
            ) -> ModelSourceError:
    """The one-line answer for a fetch of `name` that failed with `error`."""
    import httpx2
    from huggingface_hub import errors as hf

    model, repo, page = str(name), name.repo, f"{hub.endpoint}/{name.repo}"
    if isinstance(error, ChecksumMismatch):
        return ModelSourceError(model, f"{error.path} failed its checksum ({error.algorithm} "
                                f"{error.got[:12]}…, the hub lists {error.want[:12]}…) and was "
                                "deleted", "run again to download it anew")
    if isinstance(error, hf.GatedRepoError):
        cause = (f"{repo} is gated and the token given has no access to it" if token
                 else f"{repo} is gated: its files need a Hugging Face token")
        return ModelSourceError(model, cause, f"accept its terms at {page}, then pass "
                                "--hf-token or set HF_TOKEN")
    if isinstance(error, hf.RepositoryNotFoundError):
        return ModelSourceError(model, f"no repository {repo} at {hub.endpoint}",
                                "check the name (org/repo or org/repo:QUANT); a private one "
                                "needs --hf-token or HF_TOKEN")
    if isinstance(error, hf.RevisionNotFoundError):
        return ModelSourceError(model, f"{repo} has no revision {name.revision!r}",
                                f"give a branch, tag or commit listed at {page}")
    if isinstance(error, hf.RemoteEntryNotFoundError):
        return ModelSourceError(model, f"{repo} lists a file it does not serve ({error})",
                                "try again later, or another revision")
    if isinstance(error, hf.HfHubHTTPError):
        status = error.response.status_code
        return ModelSourceError(model, f"{hub.endpoint} answered HTTP {status}",
                                "try again later")
    if isinstance(error, hf.OfflineModeIsEnabled | hf.LocalEntryNotFoundError):
        return ModelSourceError(model, f"offline (HF_HUB_OFFLINE) and {repo}'s files are not "
                                f"all in the cache {hub.cache_dir}",
                                "unset HF_HUB_OFFLINE to download them")
    if isinstance(error, httpx2.ConnectError | httpx2.TimeoutException):
        what = "did not answer in time" if isinstance(error, httpx2.TimeoutException) else (
            f"cannot be reached ({_one_line(error)})")
        return ModelSourceError(model, f"the hub {hub.endpoint} {what}",
                                "check the network connection and HF_ENDPOINT, or set "
                                "HF_HUB_OFFLINE=1 to serve what the cache holds")
    if isinstance(error, httpx2.TransportError) or _is_short_transfer(error):
        return ModelSourceError(model, f"the transfer was interrupted ({_one_line(error)})",
                                "run again: the download resumes where it stopped")
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return ModelSourceError(model, f"the disk holding {hub.cache_dir} is full "
                                f"({_one_line(error)})", "free space there, or set "
                                "HF_HUB_CACHE to a disk with room, and run again")
    if isinstance(error, OSError):
        return ModelSourceError(model, f"cannot write the cache {hub.cache_dir} "
                                f"({_one_line(error)})", "set HF_HOME or HF_HUB_CACHE to a "
                                "writable directory")
    return ModelSourceError(model, _one_line(error))


def missing_gguf(name: HubName, files: list[RepoFile], chosen: list[RepoFile] | None, *,
                 where: str) -> ModelSourceError:
    """The error for a GGUF name `choose_gguf` found nothing for (`chosen` None), or whose
    split file lacks a part ([]); `where` is the repository's address, or the cache."""
    model = str(name)
    if chosen == []:
        return ModelSourceError(model, f"a part of the split {name.quant or 'GGUF'} file is "
                                f"missing from {where}", "name another quant")
    quants = offered_quants(files)
    if not gguf_files(files):
        return ModelSourceError(model, f"{where} holds no .gguf file (nor a safetensors "
                                "checkpoint)", "name a GGUF repository, or a checkpoint "
                                "without :QUANT")
    asked = name.quant or DEFAULT_GGUF_QUANT
    offered = HubName(name.repo, quants[0], name.revision, name.is_gguf)
    return ModelSourceError(model, f"{where} has no {asked} file; it offers "
                            f"{', '.join(quants)}", f"name one of them, as {offered}")


def _is_short_transfer(error: BaseException) -> bool:
    """http_get's error when fewer bytes came than the file's size."""
    return isinstance(error, OSError) and "Consistency check failed" in str(error)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__
