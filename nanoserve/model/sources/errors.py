"""The one error a model source raises: a line naming the model, the cause and the fix."""

from __future__ import annotations


class ModelSourceError(ValueError):
    """A model named by the user cannot be had: unknown repository, gated without a token, no
    network, a missing quant, a failed checksum, a full disk, offline without the file. The
    message is one line that names the model, says what went wrong and what to do; the CLI
    prints it as it is (a ValueError is a user's error there) and the HTTP APIs answer it."""

    def __init__(self, model: str, cause: str, fix: str | None = None) -> None:
        self.model = model
        self.cause = cause
        self.fix = fix
        super().__init__(f"model {model!r}: {cause}" + (f"; {fix}" if fix else ""))


class ModelNotPulledError(ModelSourceError):
    """A name that is not in the local store, asked for where nothing may be downloaded (a
    router without --allow-pull, as Ollama answers a chat for a model it lacks)."""


class ModelNotFoundError(ModelSourceError):
    """The registry or the hub has no such model (or tag, or quant): a 404 to an HTTP client,
    where other failures of a pull are the upstream's (502)."""
