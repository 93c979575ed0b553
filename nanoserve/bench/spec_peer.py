"""llama.cpp's `llama-server` with its own n-gram speculation: the peer of `nanoserve bench spec`.

Each `--peer-spec-types` entry is one llama-server configuration: `none`, or a `--spec-type`
value of the built binary (`ngram-simple`, `ngram-mod`, ...) with its draft length set to
`--num-speculative-tokens` through that type's own flag (llama.cpp has no common one for the
n-gram types). Lookup lengths stay llama.cpp's defaults (ngram-mod matches 24 tokens and
drafts only when all of its tokens chain), but for ngram-simple's 12: it drafts nothing when
its lookup is longer than its draft (common/ngram-map.cpp), so it looks up min(12, draft
length) tokens. `--peer-args` overrides any of them. A configuration runs one server per
concurrency level of the plan, a slot per stream (`--parallel level`), as `bench serve` does.

Both servers are timed by the same load client. It keeps the bytes of each of the peer's
responses, from which llama-server's acceptance is read afterwards: the `timings` object of its
last chunk carries `draft_n` (tokens drafted) and `draft_n_accepted`, when it drafted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from nanoserve.bench.load_client import sse_data

# The flag that sets each n-gram type's draft length in the vendored llama.cpp (its
# common/arg.cpp); `--spec-draft-n-max` is for draft models only, `ngram-cache` drafts 8.
DRAFT_LENGTH_FLAGS = {
    "ngram-simple": "--spec-ngram-simple-size-m",
    "ngram-map-k": "--spec-ngram-map-k-size-m",
    "ngram-map-k4v": "--spec-ngram-map-k4v-size-m",
    "ngram-mod": "--spec-ngram-mod-n-max",
}
_NGRAM_SIMPLE_LOOKUP = 12  # llama.cpp's default --spec-ngram-simple-size-n
PEER_PREFIX = "llama:"
# Room for the longest workload prompt (~500 tokens with the chat template) and the output.
_PROMPT_ROOM = 1024


@dataclass(frozen=True)
class Drafts:
    """Draft counts over some requests. `num_drafts` (steps that drafted) is None where the
    server does not say (llama-server counts only tokens)."""

    num_drafts: float | None = 0.0
    num_draft_tokens: float = 0.0
    num_accepted: float = 0.0

    def __add__(self, other: Drafts) -> Drafts:
        steps = None if self.num_drafts is None or other.num_drafts is None \
            else self.num_drafts + other.num_drafts
        return Drafts(steps, self.num_draft_tokens + other.num_draft_tokens,
                      self.num_accepted + other.num_accepted)

    @property
    def accepted_per_draft_token(self) -> float | None:
        return self.num_accepted / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a drafting step commits: its accepted drafts plus the model's own token."""
        if not self.num_drafts:
            return None
        return 1.0 + self.num_accepted / self.num_drafts


def peer_label(spec_type: str) -> str:
    """The name of a llama-server configuration in the report."""
    return PEER_PREFIX + spec_type


def peer_spec_types(args: argparse.Namespace) -> list[str]:
    """The llama-server configurations to run: none with `--no-peer` or an empty list."""
    if args.no_peer:
        return []
    return [t.strip() for t in args.peer_spec_types.split(",") if t.strip()]


def peer_server_args(spec_type: str, num_draft_tokens: int) -> list[str]:
    """llama-server's flags for one configuration (`none`: no speculation)."""
    if spec_type == "none":
        return []
    flag = DRAFT_LENGTH_FLAGS.get(spec_type)
    length = [flag, str(num_draft_tokens)] if flag else []
    if spec_type == "ngram-simple":  # a lookup longer than the draft never drafts
        length += ["--spec-ngram-simple-size-n", str(min(_NGRAM_SIMPLE_LOOKUP, num_draft_tokens))]
    return ["--spec-type", spec_type, *length]


def timings_drafts(responses: Sequence[bytes | bytearray]) -> Drafts:
    """The sum of `draft_n` / `draft_n_accepted` over each response's last `timings` object
    (cumulative within a response); zero where no response drafted."""
    total = Drafts(num_drafts=None)
    for body in responses:
        timings = _last_timings(body.decode(errors="replace"))
        drafted, accepted = timings.get("draft_n"), timings.get("draft_n_accepted")
        if isinstance(drafted, int) and isinstance(accepted, int):
            total = total + Drafts(None, float(drafted), float(accepted))
    return total


def _last_timings(body: str) -> dict[str, object]:
    """The last `timings` object of an SSE stream, or of a whole (non-streamed) JSON body."""
    payloads = [p for line in body.splitlines() if (p := sse_data(line))] or [body]
    timings: dict[str, object] = {}
    for payload in payloads:
        if '"timings"' not in payload:  # most chunks: skip the JSON parse
            continue
        with contextlib.suppress(json.JSONDecodeError):
            chunk = json.loads(payload)
            if isinstance(chunk, dict) and isinstance(chunk.get("timings"), dict):
                timings = chunk["timings"]
    return timings


@contextlib.contextmanager
def peer_server(binary: Path, gguf: Path, spec_type: str, parallel: int,
                args: argparse.Namespace) -> Iterator[tuple[str, str]]:
    """One llama-server configuration on a free port until the block ends; yields its URL and
    the setting it runs in ("default", or `--no-repack` where the default one dies at start)."""
    from nanoserve.bench.llama_server import start_healthy_llama_server, stop_process
    from nanoserve.bench.serve import HEALTH_TIMEOUT_S, free_port

    port = free_port()
    extra = peer_server_args(spec_type, args.num_speculative_tokens) + args.peer_args.split()
    process, setting = start_healthy_llama_server(
        binary, gguf, port, HEALTH_TIMEOUT_S, extra_args=extra, parallel=parallel,
        ctx_size=parallel * (args.max_tokens + _PROMPT_ROOM),
        threads=args.llama_server_threads or os.cpu_count() or 1)
    try:
        yield f"http://127.0.0.1:{port}", setting
    finally:
        stop_process(process)


def add_peer_args(p: argparse.ArgumentParser) -> None:
    """The flags of the llama-server peer."""
    p.add_argument("--peer-spec-types", default="none,ngram-simple,ngram-mod",
                   help="llama-server configurations: `none` or a --spec-type of llama.cpp, "
                        "comma-separated, an empty string for none (default: %(default)s)")
    p.add_argument("--no-peer", action="store_true", help="do not run llama-server")
    p.add_argument("--peer-args", default="",
                   help="extra flags for every llama-server, one string")
    p.add_argument("--llama-server-threads", type=int, default=None,
                   help="llama-server --threads (default: the number of CPUs)")
