"""Trajectory transport: rollout actors PUSH msgpack frames over ZeroMQ straight to the learner's PULL.

Trajectories do not travel through Ray's object store. The learner binds one PULL socket; every
rollout actor connects a PUSH socket to it. Both sides have bounded queues (ZeroMQ high-water
marks): when the learner's queue is full, ZeroMQ stops reading from the actors, whose send queue
then fills, and :meth:`TrajectorySender.send` blocks (backpressure; memory stays bounded).

Source: ZeroMQ guide, "Divide and Conquer" (PUSH/PULL pipeline) and ``ZMQ_SNDHWM``/``ZMQ_RCVHWM``.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from typing import Protocol

import zmq


class TransportError(RuntimeError):
    """The transport could not bind, connect or send in time."""


def make_endpoint(scheme: str, host: str, port: int) -> str:
    """The address the learner binds: ``tcp://host:port`` (port 0: any free port) or ``ipc://...``.

    Raises:
        TransportError: ``scheme`` is neither ``tcp`` nor ``ipc``.
    """
    if scheme == "tcp":
        return f"tcp://{host}:{port}" if port else f"tcp://{host}:*"
    if scheme == "ipc":
        return f"ipc://{os.path.join(tempfile.gettempdir(), f't1async-{uuid.uuid4().hex[:12]}.sock')}"
    raise TransportError(f"transport.scheme {scheme!r} is not supported: use 'tcp' or 'ipc'")


class TrajectorySender(Protocol):
    """Rollout-actor side of the transport."""

    def send(self, frame: bytes) -> None: ...
    def close(self) -> None: ...


class TrajectoryReceiver(Protocol):
    """Learner side of the transport."""

    endpoint: str

    def recv(self, timeout_s: float) -> bytes | None: ...
    def close(self) -> None: ...


class ZmqSender:
    """PUSH socket connected to the learner.

    Args:
        endpoint: the learner's bound address (``tcp://...`` or ``ipc://...``).
        sndhwm: messages queued locally before :meth:`send` blocks.
        send_timeout_s: longest a send may block on a full queue before
            :class:`TransportError` (the caller keeps the trajectory and may retry).
    """

    def __init__(self, endpoint: str, *, sndhwm: int = 8, send_timeout_s: float = 600.0):
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, sndhwm)
        self._sock.setsockopt(zmq.SNDTIMEO, int(send_timeout_s * 1000))
        self._sock.setsockopt(zmq.LINGER, 5000)
        self._sock.connect(endpoint)
        self.endpoint = endpoint

    def send(self, frame: bytes) -> None:
        """Queue one frame for the learner; blocks while the queue is full.

        Raises:
            TransportError: the queue stayed full for ``send_timeout_s``.
        """
        try:
            self._sock.send(frame, copy=False)
        except zmq.Again:
            raise TransportError(f"learner at {self.endpoint} did not take a trajectory in time") from None

    def close(self) -> None:
        """Flush what is queued (up to 5 s) and close."""
        self._sock.close()


class ZmqReceiver:
    """PULL socket the learner binds.

    Args:
        endpoint: address to bind (``tcp://host:*`` picks a free port; see :func:`make_endpoint`).
        rcvhwm: messages ZeroMQ queues before it stops reading from senders.

    Attributes:
        endpoint: the address actually bound (with the chosen port), for senders to connect to.
    """

    def __init__(self, endpoint: str, *, rcvhwm: int = 64):
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, rcvhwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as e:
            raise TransportError(f"cannot bind the trajectory socket at {endpoint}: {e}; pick another transport.port") from None
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)

    def recv(self, timeout_s: float) -> bytes | None:
        """One frame, or None if none arrived within ``timeout_s`` seconds."""
        if not self._poller.poll(int(timeout_s * 1000)):
            return None
        return self._sock.recv(copy=True)

    def close(self) -> None:
        """Close the socket (queued frames are discarded)."""
        self._sock.close()
