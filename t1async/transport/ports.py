"""Network ports: a TCP port free on a host now (weight-group rendezvous, SGLang servers)."""

from __future__ import annotations

import socket


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now (the rendezvous needs the port before rank 0 binds it).

    Another process may take it before the caller binds it; callers that start a server on it
    report that as their own start failure.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
