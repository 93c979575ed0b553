"""`nanoserve pull`, `nanoserve list` and `nanoserve rm`: Ollama's commands for the models
pulled by name (model/sources/store.py), which `nanoserve serve NAME` and a `--models-dir`
router then serve by that name.

    nanoserve pull qwen3.5:0.8b              an Ollama name, from the registry
    nanoserve pull hf.co/org/repo:Q4_K_M     a hub repository's GGUF file (org/repo too)
    nanoserve list                           NAME, ID, SIZE, MODIFIED, FROM
    nanoserve rm qwen3.5:0.8b                and the files no other model uses

A failure is a ModelSourceError (a ValueError): the CLI prints its one line and exits 1.
"""

from __future__ import annotations

import argparse
import time

from nanoserve.model.sources.errors import ModelSourceError
from nanoserve.model.sources.fetch import pull_model
from nanoserve.model.sources.progress import TerminalProgress
from nanoserve.model.sources.store import find_pulled, list_pulled, models_home, remove_pulled

_TIME_UNITS = (("year", 365 * 86400), ("month", 30 * 86400), ("week", 7 * 86400),
               ("day", 86400), ("hour", 3600), ("minute", 60), ("second", 1))


def add_model_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The `pull`, `list` and `rm` subcommands on `nanoserve`'s parser."""
    pull = sub.add_parser("pull", help="download a model by name (Ollama's or the hub's), "
                          "with a progress bar per file")
    pull.add_argument("name", help="qwen3.5:0.8b, org/repo, org/repo:Q4_K_M, "
                      "hf.co/org/repo:Q4_K_M, host:port/namespace/model:tag")
    pull.add_argument("--hf-token", default=None,
                      help="a hub token for a gated or private repository (default: HF_TOKEN "
                           "or the one `hf auth login` stored)")
    pull.set_defaults(func=cmd_pull)
    listing = sub.add_parser("list", aliases=["ls"], help="the models pulled by name")
    listing.set_defaults(func=cmd_list)
    rm = sub.add_parser("rm", help="remove pulled models, and the files no other model uses")
    rm.add_argument("names", nargs="+", metavar="NAME")
    rm.set_defaults(func=cmd_rm)


def cmd_pull(args: argparse.Namespace) -> int:
    pulled = pull_model(args.name, token=args.hf_token, progress=TerminalProgress())
    print(f"pulled {pulled.name} ({human_bytes(pulled.size)}); serve it with: "
          f"nanoserve serve {pulled.name}")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    """The pulled models as `ollama list` prints them, with where each came from."""
    now = time.time()
    rows = [("NAME", "ID", "SIZE", "MODIFIED", "FROM")]
    rows += [(m.name, m.digest.removeprefix("sha256:")[:12], human_bytes(m.size),
              human_time(now - m.modified_at), m.source) for m in list_pulled()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("    ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False))
              + "    " + row[-1])
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    for name in args.names:
        pulled = find_pulled(name)
        if pulled is None or not remove_pulled(name):
            raise ModelSourceError(name, "is not pulled on this machine",
                                   "`nanoserve list` shows the pulled models")
        note = "" if pulled.path.is_relative_to(models_home()) else (
            " (its files stay in huggingface_hub's cache, which other tools share: "
            "`hf cache delete` frees them)")
        print(f"deleted '{pulled.name}'{note}")
    return 0


def human_bytes(size: int) -> str:
    """Bytes as Ollama prints them: decimal units, "98 MB", "1.3 GB"."""
    value = float(size)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000:
            return f"{value:.0f} {unit}" if value >= 10 or unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"


def human_time(seconds: float) -> str:
    """An age as Ollama prints one: "About an hour ago", "3 days ago"."""
    for unit, length in _TIME_UNITS:
        count = int(seconds // length)
        if count > 1:
            return f"{count} {unit}s ago"
        if count == 1:
            return f"About {'an' if unit == 'hour' else 'a'} {unit} ago"
    return "Less than a second ago"
