"""Plugins named on the command line as 'module:Class' (logits processors, draft proposers)."""

from __future__ import annotations

import importlib
from typing import Any


def import_named(spec: str, what: str) -> Any:
    """'package.module:Name' -> the object (None if the module has no such name), or a
    ValueError naming `what` when the spec is malformed or its module cannot be imported."""
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise ValueError(f"{what} {spec!r} must be written 'module:Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{what} {spec!r}: cannot import {module_name!r} ({e})") from None
    return getattr(module, name, None)
