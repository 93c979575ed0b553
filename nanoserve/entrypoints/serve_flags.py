"""`nanoserve serve`'s flags that guard the server: what one request may ask, what images it
may send, which keys it must present and TLS (read into server_config.py's settings)."""

from __future__ import annotations

import argparse

from nanoserve.server_config import ImageLimits, RequestLimits, ServerConfig, parse_mm_limits


def add_key_and_tls_args(parser: argparse.ArgumentParser) -> None:
    """Who may call the server (its keys: server_config.read_api_keys) and over what (TLS)."""
    g = parser.add_argument_group("keys and TLS")
    g.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every "
                        "route but /health; repeat it, or separate keys by commas, for "
                        "several (default: NANOSERVE_API_KEY or VLLM_API_KEY, else none)")
    g.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="more keys, one a line (blank lines and # comments skipped)")
    g.add_argument("--ssl-certfile", "--ssl-cert-file", dest="ssl_certfile", default=None,
                   metavar="FILE", help="serve HTTPS with this PEM certificate (chain)")
    g.add_argument("--ssl-keyfile", "--ssl-key-file", dest="ssl_keyfile", default=None,
                   metavar="FILE", help="the certificate's private key (PEM), unless the "
                                        "certificate file holds it")
    g.add_argument("--ssl-ca-certs", default=None, metavar="FILE",
                   help="CA certificates for client certificates (with --ssl-cert-reqs)")
    g.add_argument("--ssl-cert-reqs", type=int, choices=(0, 1, 2),
                   default=ServerConfig.ssl_cert_reqs,
                   help="client certificates: 0 none, 1 optional, 2 required (Python's "
                        "ssl.CERT_*) (default: %(default)s)")


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    """Limits that protect the server from one request (defaults and reasons: RequestLimits)."""
    g = parser.add_argument_group("limits")
    g.add_argument("--max-request-body-bytes", type=int,
                   default=RequestLimits.max_request_body_bytes,
                   help="larger request bodies get HTTP 413 (default: %(default)s)")
    g.add_argument("--max-n", type=int, default=RequestLimits.max_n,
                   help="the most samples (n) one request may ask for (default: %(default)s)")
    g.add_argument("--max-stop-strings", type=int, default=RequestLimits.max_stop_strings,
                   help="the most stop strings one request may give (default: %(default)s)")
    g.add_argument("--max-stop-string-length", type=int,
                   default=RequestLimits.max_stop_string_length,
                   help="the longest stop string (and bad word), in characters "
                        "(default: %(default)s)")
    g.add_argument("--max-bad-words", type=int, default=RequestLimits.max_bad_words,
                   help="the most bad_words one request may give (default: %(default)s)")
    g.add_argument("--request-timeout", type=float, default=RequestLimits.request_timeout,
                   metavar="SECONDS",
                   help="abort a request this long after admission and answer HTTP 408 "
                        "(default: no deadline)")
    g.add_argument("--slow-reader-timeout", type=float,
                   default=RequestLimits.slow_reader_timeout, metavar="SECONDS",
                   help="abort a stream whose client has left updates unread this long "
                        "(default: %(default)s)")
    g.add_argument("--max-unread-updates", type=int, default=RequestLimits.max_unread_updates,
                   help="abort a stream once this many updates wait unread (default: "
                        "%(default)s)")


def add_image_args(parser: argparse.ArgumentParser) -> None:
    """What images one request may send (defaults and reasons: ImageLimits)."""
    g = parser.add_argument_group("images")
    g.add_argument("--limit-mm-per-prompt", default=None, metavar="JSON",
                   help='the most images one prompt may carry, as vLLM\'s: \'{"image": 4}\' '
                        f"(default: {ImageLimits.max_images}; none for a model without a "
                        "vision tower)")
    g.add_argument("--max-image-pixels", type=int, default=ImageLimits.max_pixels,
                   help="the most pixels (width x height) of one image, read from its header "
                        "before it is decoded (default: %(default)s)")
    g.add_argument("--max-image-bytes", type=int, default=ImageLimits.max_bytes,
                   help="the most bytes of one encoded image, sent or fetched "
                        "(default: %(default)s)")
    g.add_argument("--allowed-media-domains", nargs="+", default=[], metavar="HOST",
                   help="hosts whose http(s) image URLs the server fetches (default: none; "
                        "images are sent as data: URLs)")
    g.add_argument("--image-fetch-timeout", type=float, default=ImageLimits.fetch_timeout,
                   metavar="SECONDS",
                   help="seconds one image URL's fetch may take (default: %(default)s)")


def image_limits(args: argparse.Namespace) -> ImageLimits:
    count = ImageLimits.max_images if args.limit_mm_per_prompt is None \
        else parse_mm_limits(args.limit_mm_per_prompt)
    return ImageLimits(max_images=count, max_pixels=args.max_image_pixels,
                       max_bytes=args.max_image_bytes,
                       allowed_media_domains=tuple(args.allowed_media_domains),
                       fetch_timeout=args.image_fetch_timeout)
