"""uvicorn's server, with a stop that does not wait on TLS clients' goodbyes.

When uvicorn stops it closes each idle keep-alive connection. Over plain TCP that close is
immediate; over TLS asyncio first sends a close_notify and waits for the client's, up to its
`ssl_shutdown_timeout` of 30 s. An HTTP client holding a pooled connection (the OpenAI SDK's
httpx pool, a browser tab) does not read it, so every `--ssl-*` server took 30 s to stop
while any client was still alive. Here a connection with no request in progress and nothing
left to send is aborted instead: what the 30 s would end in, without the wait. A connection
still answering is left to finish, and aborted once its last bytes are out.
"""

from __future__ import annotations

import asyncio
import socket

import uvicorn

_POLL_S = 0.05


class ClosingServer(uvicorn.Server):
    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        reaper = (asyncio.get_running_loop().create_task(self._abort_idle_tls())
                  if self.config.is_ssl else None)
        try:
            await super().shutdown(sockets)
        finally:
            if reaper is not None:
                reaper.cancel()

    async def _abort_idle_tls(self) -> None:
        while True:
            for connection in list(self.server_state.connections):
                transport = getattr(connection, "transport", None)
                cycle = getattr(connection, "cycle", None)
                answered = cycle is None or cycle.response_complete
                if transport is not None and answered and transport.get_write_buffer_size() == 0:
                    transport.abort()
            await asyncio.sleep(_POLL_S)
