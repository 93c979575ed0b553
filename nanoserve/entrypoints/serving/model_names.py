"""The names a model answers to: one rule for every route of a model's server and for the router
of `--models-dir`, which must agree (the router relays the body with the client's `model` in it,
and the model's server checks it again).

A model answers to its served name, to its model file's name (`x.gguf`) and stem (`x`), or its
directory's name, and to each of these with Ollama's default tag, `:latest`, which Ollama's
clients add to a name given without a tag; a model named with that tag (`smollm2:latest`, as a
pull records `smollm2`) answers to the name without it too. Another tag is another model, as in
Ollama.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

DEFAULT_TAG = "latest"


def model_aliases(name: str, path: str | Path | None = None) -> frozenset[str]:
    """Every name the model served as `name` from `path` answers to (see the module)."""
    bases = {name, name.removesuffix(f":{DEFAULT_TAG}")}
    if path is not None and str(path):
        file = Path(path)
        bases.add(file.name)
        if file.suffix == ".gguf":
            bases.add(file.stem)
    return frozenset(bases | {f"{base}:{DEFAULT_TAG}" for base in bases})


class ModelNames:
    """Which of a server's models a client's name means."""

    def __init__(self, models: Mapping[str, str | Path | None]) -> None:
        """`models`: each model's own name → the file or directory it is served from."""
        self.names = tuple(models)
        self._by_alias: dict[str, str] = {}
        for name, path in models.items():
            for alias in sorted(model_aliases(name, path)):
                self._by_alias.setdefault(alias, name)
        self._by_alias.update({name: name for name in models})  # a name beats another's alias

    def resolve(self, asked: str) -> str | None:
        """The model `asked` names, or None if it names none of them."""
        return self._by_alias.get(asked)
