"""A host loopback port served on the loopback of another network namespace (a container's).

A named harness in a ``container`` sandbox talks to the rollout actor's endpoint, which listens on the
host's ``127.0.0.1:PORT``; the container keeps its own network (``--network=none`` unless the task allows
internet). :class:`LoopbackRelay` opens a listening socket on ``127.0.0.1:PORT`` *inside* the container's
network namespace (a helper thread enters it with ``setns(2)`` on ``/proc/PID/ns/net``, creates the socket
and exits: a socket keeps the namespace it was made in) and relays every connection accepted there, byte for
byte, to ``127.0.0.1:PORT`` of the host. So the harness uses the same URL as in a bubblewrap sandbox, and the
container gains exactly that one port and nothing else (no route, no DNS, no other host port).

Needs ``CAP_SYS_ADMIN`` over the container's network namespace: t1async as host root with a rootful engine
(this machine); the rollout actor refuses a harness in a container otherwise, at start
(t1async/rollout/harnesses.py ``check_sandbox``).
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
from typing import Sequence

from loguru import logger

from ..protocol import SandboxError

CLONE_NEWNET = 0x40000000
"""``setns(2)`` namespace type of a network namespace (linux/sched.h)."""

CHUNK = 65536
"""Bytes read per ``recv`` by a relay pump."""


def _setns(path: str) -> None:
    """Move the calling thread into the network namespace at ``path`` (``/proc/PID/ns/net``).

    Raises:
        OSError: the namespace could not be opened or entered (errno from ``setns(2)``).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def listen_in_namespace(netns: str, port: int, host: str = "127.0.0.1") -> socket.socket:
    """A TCP socket listening on ``host:port`` inside the network namespace ``netns`` (a path such as
    ``/proc/PID/ns/net``), made by a helper thread that enters it and exits (the caller's own thread
    never changes namespace).

    Raises:
        SandboxError: the namespace could not be entered or the port bound there (one line).
    """
    made: dict = {}

    def make() -> None:
        try:
            _setns(netns)
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
            s.listen(64)
            made["socket"] = s
        except OSError as exc:
            made["error"] = exc

    thread = threading.Thread(target=make, name="netns-listen", daemon=True)
    thread.start()
    thread.join()
    if "socket" not in made:
        raise SandboxError(f"could not serve {host}:{port} inside the network namespace {netns}: {made.get('error')}; "
                           "it needs root (CAP_SYS_ADMIN) and a rootful engine; is the container still running?")
    return made["socket"]


class LoopbackRelay:
    """Host ``127.0.0.1:PORT`` served on ``127.0.0.1:PORT`` of the network namespace ``netns`` (see the module
    docstring). Use :meth:`start`, then :meth:`close` (idempotent; closes the listeners, which hold the
    namespace, and every relayed connection).

    Args:
        netns: path of the target namespace, ``/proc/PID/ns/net`` of a process in it.
        ports: host loopback ports to serve there, each at the same number.
    """

    def __init__(self, netns: str, ports: Sequence[int]):
        self.netns = netns
        self.ports = tuple(int(p) for p in ports)
        self.connections = 0
        """How many connections were accepted (all ports)."""
        self._listeners: list[socket.socket] = []
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False

    def start(self) -> None:
        """Listen on every port inside the namespace and start relaying.

        Raises:
            SandboxError: a port could not be served there (see :func:`listen_in_namespace`).
        """
        for port in self.ports:
            listener = listen_in_namespace(self.netns, port)
            self._listeners.append(listener)
            threading.Thread(target=self._accept, args=(listener, port), name=f"relay-{port}", daemon=True).start()

    def _accept(self, listener: socket.socket, port: int) -> None:
        while True:
            try:
                inside, _ = listener.accept()
            except OSError:
                return  # closed
            try:
                outside = socket.create_connection(("127.0.0.1", port), timeout=30)
                outside.settimeout(None)
            except OSError as exc:
                logger.warning("relay of port {}: the host endpoint refused a connection: {}", port, exc)
                inside.close()
                continue
            with self._lock:
                if self._closed:
                    inside.close()
                    outside.close()
                    return
                self.connections += 1
                self._open.update((inside, outside))
            pair = [inside, outside, 2]  # the two sockets and the pumps still running
            for a, b in ((inside, outside), (outside, inside)):
                threading.Thread(target=self._pump, args=(a, b, pair), name=f"relay-{port}-pump", daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, pair: list) -> None:
        """Copy ``src`` to ``dst`` until EOF, then half-close ``dst``; the last pump out closes both."""
        try:
            while True:
                data = src.recv(CHUNK)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        with self._lock:
            pair[2] -= 1
            if pair[2] == 0:
                for s in pair[:2]:
                    self._open.discard(s)
                    s.close()

    def close(self) -> None:
        """Stop listening and close every relayed connection. Idempotent."""
        with self._lock:
            self._closed = True
            victims = [*self._listeners, *self._open]
            self._listeners, self._open = [], set()
        for s in victims:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
