"""Frozen configuration of the HTTP server around the engine (`nanoserve serve`'s server
flags): what one request may ask (`RequestLimits`) and the server's own settings
(`ServerConfig`), built once by the CLI. The engine's configuration is config.py's.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Pillow refuses to open an image past twice its `Image.MAX_IMAGE_PIXELS` (89,478,485): its
# decompression-bomb guard, which a larger --max-image-pixels could not lift
PILLOW_MAX_PIXELS = 2 * 89_478_485


@dataclass(frozen=True)
class ImageLimits:
    """What the images of one request may be (entrypoints/serving/images.py checks them, each
    past its limit a 400 naming the part)."""

    # images per prompt: vLLM's --limit-mm-per-prompt and its default; a model without a vision
    # tower takes none, whatever this says
    max_images: int = 999
    # pixels per image, read from the header before anything is decoded: 50 MP holds an 8K
    # screenshot or a phone camera's photo, and its decoded RGBA (200 MB) stays bounded
    max_pixels: int = 50_000_000
    # bytes per image (a data URL's decoded bytes, a fetched body): Anthropic's API takes 5 MB,
    # OpenAI's 20 MB; the request body limit (--max-request-body-bytes) applies first
    max_bytes: int = 20 * 1024 * 1024
    # hosts whose http(s) image URLs are fetched (vLLM's --allowed-media-domains); empty: none,
    # so no request can make the server reach the network unless its operator says so
    allowed_media_domains: tuple[str, ...] = ()
    # seconds a fetch may take (vLLM's VLLM_IMAGE_FETCH_TIMEOUT and its default)
    fetch_timeout: float = 5.0

    def __post_init__(self) -> None:
        if self.max_images < 0:
            raise ValueError(f"--limit-mm-per-prompt's image count must be >= 0, got "
                             f"{self.max_images}")
        if not 1 <= self.max_pixels <= PILLOW_MAX_PIXELS:
            raise ValueError(f"--max-image-pixels must be in [1, {PILLOW_MAX_PIXELS}] (past it "
                             f"Pillow refuses to decode), got {self.max_pixels}")
        if self.max_bytes < 1:
            raise ValueError(f"--max-image-bytes must be >= 1, got {self.max_bytes}")
        if not self.fetch_timeout > 0:
            raise ValueError(f"--image-fetch-timeout must be > 0 seconds, got "
                             f"{self.fetch_timeout}")


def parse_mm_limits(text: str) -> int:
    """`--limit-mm-per-prompt` as vLLM takes it, JSON (`{"image": 4}`, `{"image": {"count":
    4}}`) or `image=4,video=0`, to the image count. Other modalities are accepted at 0 only
    (vLLM commands often turn video off): this server reads images alone."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError:
        raw = dict(item.split("=", 1) for item in text.split(",") if "=" in item)
        if not raw:
            raise ValueError(f"--limit-mm-per-prompt must be JSON such as '{{\"image\": 4}}' "
                             f"or image=4, got {text!r}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--limit-mm-per-prompt must be an object such as "
                         f"'{{\"image\": 4}}', got {text!r}")
    counts = {}
    for modality, value in raw.items():
        count = value.get("count", 999) if isinstance(value, dict) else value
        try:
            counts[modality] = int(count)
        except (TypeError, ValueError):
            raise ValueError(f"--limit-mm-per-prompt: {modality} must be a count, got "
                             f"{value!r}") from None
    others = [name for name, count in counts.items() if name != "image" and count != 0]
    if others:
        raise ValueError(f"--limit-mm-per-prompt: this server reads images only; "
                         f"{', '.join(others)} may only be 0")
    return counts.get("image", ImageLimits.max_images)


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask of the server. Past each limit the request gets a 4xx in
    OpenAI's error shape naming the field, the value and the limit (entrypoints/serving/limits.py);
    context length and logprobs are bounded by the engine's own settings (max_model_len,
    max_logprobs)."""

    # 4 MiB holds a 128k-token context as text or as token ids with room to spare (TGI's
    # --payload-limit is 2 MB); anything bigger is refused before it is read.
    max_request_body_bytes: int = 4 * 1024 * 1024
    # OpenAI's own maximum for `n`: no client written for OpenAI's API sends more, pass@k runs
    # (n up to 100) still fit, and one request stays at 2x the default running batch
    # (max_num_seqs 64). vLLM's cap (16384) only stops absurd values: n=1000000 was accepted here
    # and stalled every other client for ~40 s.
    max_n: int = 128
    max_stop_strings: int = 4  # OpenAI's and vLLM's limit
    # the stop checker holds back up to len(stop)-1 characters and tests each prefix per token:
    # quadratic in the length, so a bound keeps hostile stop strings cheap
    max_stop_string_length: int = 256
    # bad words are matched against each sample's output in Python on every step: 200,000 words
    # in one request made the other requests of its batch 12x slower. vLLM's cap is 128 words
    # (each word is also held to max_stop_string_length)
    max_bad_words: int = 128
    # seconds from admission until a request is aborted (its KV blocks freed) and answered with
    # HTTP 408 (in a stream: an error event); None = no deadline, as vLLM (a client that gives
    # up and disconnects already aborts its request)
    request_timeout: float | None = None
    # A client that stops reading its stream: once its unread updates have waited this many
    # seconds, or this many have piled up, its request is aborted (KV blocks freed) and its
    # updates dropped, so it holds neither memory nor a batch slot. Ten times the slowest
    # inter-token gap measured under load here (~3 s at 32 streams on 2 cores), and OpenAI's
    # ~3 tokens per update x 4,096 is more than any max_tokens this server allows by default.
    slow_reader_timeout: float = 30.0
    max_unread_updates: int = 4096
    images: ImageLimits = field(default_factory=ImageLimits)

    def __post_init__(self) -> None:
        for name in ("max_request_body_bytes", "max_n", "max_stop_strings",
                     "max_stop_string_length", "max_bad_words", "max_unread_updates"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {self.request_timeout}")
        if not self.slow_reader_timeout > 0:
            raise ValueError(
                f"slow_reader_timeout must be > 0 seconds, got {self.slow_reader_timeout}")


@dataclass(frozen=True)
class ServerConfig:
    """The OpenAI-compatible server around the engine."""

    host: str = "127.0.0.1"
    port: int = 8000
    # every route but /health needs one of these (empty: no key asked for); read_api_keys
    api_keys: tuple[str, ...] = ()
    # TLS, as vLLM and uvicorn spell it: the PEM certificate chain (which may hold the key)
    # and its key; with ssl_ca_certs and ssl_cert_reqs (ssl.CERT_REQUIRED: 2), client
    # certificates too. None: plain HTTP
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0  # ssl.CERT_NONE
    served_model_name: str | None = None  # None = the model's own name
    reasoning_parser: str | None = None  # "qwen3" | "deepseek_r1"
    # "hermes" | "llama3_json" | "qwen3_coder": reads tool_choice="auto" (None: the template's)
    tool_call_parser: str | None = None
    # /v1/rerank and /score: "cosine" (of the two texts' embeddings) or "yes_no" (the logit of
    # "yes" against "no" after a judging prompt, Qwen3-Reranker's method). On the default
    # model, 16 hand-made queries x 4 documents: cosine puts the answer first 11 times (MRR
    # 0.82), yes_no 6 (MRR 0.64; chance: 4, 0.52), and cosine takes a third of the time.
    score_method: str = "cosine"
    chat_template: str | None = None  # the Jinja text that replaces the tokenizer's template
    api_server_count: int = 1
    shutdown_timeout: float = 30.0  # seconds in-flight requests may take to finish on a stop
    max_in_flight: int = 512  # past this many sequences (requests times n) in flight: 429
    generation_config: str = "auto"  # "auto": the model's defaults; "vllm": vLLM's defaults
    log_level: str = "info"
    limits: RequestLimits = field(default_factory=RequestLimits)
    # origins a browser page may call the API from (CORS); empty = no CORS headers at all
    allowed_origins: tuple[str, ...] = ()
    # request logs carry ids and sizes; prompt text and sampling parameters only when asked
    log_requests: bool = False
    # the chat page at / and the dashboard at /dashboard (entrypoints/web/); --no-web-ui: off
    web_ui: bool = True
    # take Claude Code's `x-anthropic-billing-header: ...; cch=...;` line off the start of a
    # system prompt, so its requests share the prefix cache (anthropic/billing_header.py)
    strip_billing_header: bool = True
    # a `--models-dir` router's model server: SIGTERM, SIGINT and SIGHUP are the router's to
    # act on; this server drains on the router's SIGUSR1 alone (engine/stop_signals.py)
    stopped_by_parent: bool = False

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"

    def tls_options(self) -> dict[str, Any]:
        """uvicorn.Config's TLS arguments (none without a certificate)."""
        if not self.ssl_certfile:
            return {}
        return {"ssl_certfile": self.ssl_certfile, "ssl_keyfile": self.ssl_keyfile,
                "ssl_ca_certs": self.ssl_ca_certs, "ssl_cert_reqs": self.ssl_cert_reqs}


# the environment's key, when no --api-key or --api-key-file is given (vLLM reads VLLM_API_KEY)
API_KEY_VARIABLES = ("NANOSERVE_API_KEY", "VLLM_API_KEY")


def read_api_keys(given: list[str] | None, key_file: str | None) -> tuple[str, ...]:
    """The keys a server accepts: each `--api-key` (repeated, or comma-separated as
    llama-server takes them) and each non-blank line of `--api-key-file` (blanks around a key
    are not part of it; a line starting with # is a comment); with neither, the environment's
    (API_KEY_VARIABLES, comma-separated too). ValueError names the flag where a source gives
    nothing usable."""
    keys = [key.strip() for value in given or () for key in value.split(",") if key.strip()]
    if given and not keys:
        raise ValueError(f"--api-key must name a key, got {given[0]!r}")
    if key_file is not None:
        try:
            lines = Path(key_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--api-key-file {key_file!r} cannot be read: {e}") from None
        from_file = [line.strip() for line in lines
                     if line.strip() and not line.strip().startswith("#")]
        if not from_file:
            raise ValueError(f"--api-key-file {key_file!r} holds no key (one key a line)")
        keys += from_file
    if not keys:
        for variable in API_KEY_VARIABLES:
            keys = [key.strip() for key in os.environ.get(variable, "").split(",")
                    if key.strip()]
            if keys:
                break
    return tuple(dict.fromkeys(keys))  # in order, each once


def check_tls_files(certfile: str | None, keyfile: str | None, ca_certs: str | None) -> None:
    """ValueError naming the flag where a TLS file is missing, or a key comes without its
    certificate."""
    if keyfile and not certfile:
        raise ValueError("--ssl-keyfile needs --ssl-certfile (the certificate the key is for)")
    for flag, path in (("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile),
                       ("--ssl-ca-certs", ca_certs)):
        if path is not None and not Path(path).is_file():
            raise ValueError(f"{flag} {path!r}: no such file")
