"""The HTTP listening socket: bound once, in the launcher, and never shared with another server.

The launcher binds before it starts the engine, so a taken port fails in well under a second
with one line that names the address and, where Linux says, the process that holds it. The
socket has no SO_REUSEPORT: with it, a second `nanoserve serve` on a busy port used to start
silently and take half the connections. `--api-server-count N` processes share this one
socket by inheriting it (as vLLM's API-server processes do), not by binding the port again.
SO_REUSEADDR stays: on Linux it lets a restart bind over connections left in TIME_WAIT, and
it never lets two sockets listen on one address.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

_LISTEN = "0A"  # the TCP state code of a listening socket in /proc/net/tcp


class AddressInUseError(OSError):
    """The address is taken; the message names it and what holds it."""


def bind_listening_socket(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port), or AddressInUseError if anything listens there."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno != errno.EADDRINUSE:
            raise
        holder = port_holder(port)
        held_by = f" (held by {holder})" if holder else ""
        raise AddressInUseError(
            e.errno, f"cannot listen on {_shown(host, port)}: address already in use"
                     f"{held_by}; stop that server or choose another --port") from None
    sock.listen(2048)
    return sock


def port_holder(port: int) -> str | None:
    """'pid 1234 (nanoserve)' for the process listening on `port`, read from /proc; None where
    that cannot be read (another OS, or another user's process)."""
    inodes = _listening_inodes(port)
    if not inodes:
        return None
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    name = (proc / "comm").read_text().strip()
                    return f"pid {proc.name} ({name})"
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return None


def _listening_inodes(port: int) -> set[str]:
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == _LISTEN and int(local.rsplit(":", 1)[1], 16) == port:
                inodes.add(inode)
    return inodes


def _shown(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
