"""An engine core that cannot start says why in one line.

Whatever building the engine raises (an architecture nanoserve does not run, a GGUF file it
cannot read, a KV cache larger than the memory) goes to every API server as
`EngineStartFailed`: the reason a user reads, which names the cause and the fix, and the
traceback, which the API server logs only at `--log-level debug`. The process then exits 1;
nothing prints a traceback of its own on the terminal.
"""

from __future__ import annotations

import contextlib
import traceback

import zmq

from nanoserve.protocol import EngineStartFailed, encode

# for an API server that has not bound its socket yet (it imports its HTTP stack while this
# process loads the model: on a busy 2-core machine seconds after a failure here); the
# launcher kills this process when its API server is gone
_SEND_WAIT_MS = 60_000


def start_failure_reason(error: BaseException) -> str:
    """The one line for `error`: nanoserve's own errors already name the cause and the fix;
    anything else is named by its type, with the memory's usual fixes where it ran out."""
    text = " ".join(str(error).split())  # one line, whatever the message's own layout
    if _is_out_of_memory(error, text):
        return (f"not enough memory to load the model and its KV cache ({text}); lower "
                "--kv-cache-memory, --max-num-seqs or --max-model-len, or use a smaller "
                "quantization of the model")
    if isinstance(error, (ValueError, FileNotFoundError, NotImplementedError)) and text:
        return text
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _is_out_of_memory(error: BaseException, text: str) -> bool:
    return isinstance(error, MemoryError) or "can't allocate memory" in text \
        or "out of memory" in text.lower()


def report_start_failure(error: BaseException, output_addresses: list[str],
                         engine_index: int) -> None:
    """Tell every API server why this engine core could not start (waits up to a minute for
    each to take it)."""
    message = encode(EngineStartFailed(start_failure_reason(error),
                                       traceback.format_exc(limit=30), engine_index))
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        for address in output_addresses:
            sock = context.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDTIMEO, _SEND_WAIT_MS)
            sock.setsockopt(zmq.LINGER, _SEND_WAIT_MS)
            sock.connect(address)
            with contextlib.suppress(zmq.ZMQError):
                sock.send(message)
            sock.close()
    finally:
        context.term()
