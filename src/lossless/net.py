"""Local networking the server, the llama.cpp peer, the benchmarks and the tests share."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on now (the OS's pick). Another process may take it before the
    caller binds it: callers that start a server retry on another port where the bind fails."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
