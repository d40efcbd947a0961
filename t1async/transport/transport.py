"""Trajectory transport: rollout actors (DEALER) -> learner (ROUTER), acknowledged, at least once.

Trajectories do not travel through Ray's object store. The learner binds one ROUTER socket;
every rollout actor connects a DEALER socket to it.

Messages (ZeroMQ multipart; the ROUTER sees the peer's identity frame first)::

    actor -> learner   [b"t1async/1", key, frame]      key = trajectory id (utf-8), frame =
                                                         t1async.trajectory.encode(...)
    learner -> actor   [b"ACK" | b"REJ", key, reason]   ACK: durably stored (or a duplicate of a
                                                         stored one); REJ: invalid, quarantined,
                                                         never resend (a malformed envelope, wrong
                                                         protocol or key included: REJ with the key
                                                         frame as sent, empty if none)

Delivery guarantee: at least once on the wire, exactly once into the learner's receive log.
:class:`ZmqSender` writes each trajectory to its on-disk spool (t1async/transport/spool.py) before sending
(and sends it from there) and frees it only on ACK/REJ; it resends whatever was in flight when
the connection broke (a killed or restarted learner) once it is re-established, and anything
whose ACK is overdue. The learner appends to its receive log (t1async/transport/delivery.py), fsyncs per
``transport.log_fsync``, then ACKs; a key it already holds is ACKed again and not stored twice.

Backpressure and memory: an actor holds at most ``window_messages``/``window_bytes`` unACKed
frames in flight (and in memory, about 2 x window_bytes at worst); the rest waits in its spool,
and :meth:`ZmqSender.send` blocks while the spool holds ``spool_max_*``. The learner reads the
socket only while its decoded queue has room (bytes and messages), so a stalled learner stops
ACKing, the actors' windows fill, their spools fill, and their ``send`` waits.

Authentication (``transport.curve``): CurveZMQ with a ZAP handler (``zmq.auth.thread.
ThreadAuthenticator``) that accepts only the public keys in ``keys_dir/authorized``: a peer
without one cannot complete the handshake, so it can neither push nor read an ACK.

Sources: ZeroMQ guide ch. 3-4 (ROUTER/DEALER, reliable request-reply), RFC 26/27 (CurveZMQ, ZAP).
"""

from __future__ import annotations

import collections
import os
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import zmq
from loguru import logger
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from t1async.trajectory import EncodedTrajectory
from t1async.transport.keys import ClientKeys, ServerKeys, client_keys, server_keys
from t1async.transport.spool import Spool, SpoolEntry

PROTOCOL = b"t1async/1"
ACK, REJECT = b"ACK", b"REJ"
MAX_KEY_BYTES = 128


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


@dataclass
class Delivery:
    """One message received by the learner.

    Attributes:
        key: the trajectory id the sender gave ("" if the envelope had none).
        frame: the payload, a read-only zero-copy view of the ZeroMQ message.
        peer: the sender's ROUTER identity (where the ACK goes).
        error: set when the envelope itself is malformed (then ``frame`` may be empty).
        reply_key: the key frame's bytes as sent (at most ``MAX_KEY_BYTES``; empty when there was
            none), so that a malformed envelope is answered too (REJ with that key and the error).
    """

    key: str
    frame: memoryview
    peer: bytes
    error: str | None = None
    reply_key: bytes = b""


class TrajectorySender(Protocol):
    """Rollout-actor side: hand over a finished trajectory; delivery is the sender's business.

    ``stats.rejections`` lists, in order, the reason of each trajectory the learner rejected.
    """

    stats: SenderStats

    def send(self, key: str, frame: bytes | memoryview | EncodedTrajectory) -> None: ...
    def flush(self, timeout_s: float) -> bool: ...
    def close(self) -> None: ...


class TrajectoryReceiver(Protocol):
    """Learner side: take messages, answer each with :meth:`ack` once it is stored or rejected."""

    endpoint: str

    def recv(self, timeout_s: float) -> Delivery | None: ...
    def ack(self, delivery: Delivery, ok: bool, reason: str = "") -> None: ...
    def close(self) -> None: ...


@dataclass
class _Item:
    entry: SpoolEntry
    frame: Any = None  # a view of the spool file's mapping, or None: mapped again when sent
    sent_at: float = 0.0
    sends: int = 0
    tracker: Any = None  # zmq.MessageTracker of the last zero-copy send (None: copied, or not sent)


@dataclass
class SenderStats:
    """Counters of one sender (messages unless named otherwise)."""

    sent: int = 0
    resent: int = 0
    acked: int = 0
    rejected: int = 0
    connects: int = 0
    handshake_failures: int = 0
    adopted: int = 0
    rejections: list[str] = field(default_factory=list)
    rejected_keys: list[str] = field(default_factory=list)
    """Trajectory ids of the rejections, aligned with ``rejections``."""


class ZmqSender:
    """Reliable DEALER sender with an on-disk spool (see the module docstring).

    Args:
        endpoint: the learner's bound address (``tcp://...`` or ``ipc://...``).
        spool_dir: shared spool folder (adopts dead senders' spools there); None: private temp.
        window_messages, window_bytes: most frames/bytes in flight (sent, not yet ACKed).
        spool_max_messages, spool_max_bytes: :meth:`send` waits while the spool holds more.
        send_timeout_s: longest :meth:`send` waits for spool room before :class:`TransportError`.
        ack_timeout_s: resend a frame whose ACK is this overdue.
        curve: client keys (CurveZMQ) or None for plain ZMTP.
        sndhwm: ZeroMQ send high-water mark (messages).
        on_ack: called on the I/O thread as ``on_ack(key, ok, reason)`` once per trajectory
            when the learner's first ACK (``ok`` True) or REJ (False, with its reason) frees it;
            it must return quickly (it delays the next ACK); an exception in it is logged and
            ignored.

    One I/O thread owns the socket: it sends from the spool, takes ACKs, and resends after
    every reconnect; :meth:`send` only writes the spool and wakes it.
    """

    def __init__(self, endpoint: str, *, spool_dir: str | None = None, window_messages: int = 64,
                 window_bytes: int = 256 << 20, spool_max_messages: int = 256, spool_max_bytes: int = 4 << 30,
                 send_timeout_s: float = 3600.0, ack_timeout_s: float = 300.0, curve: ClientKeys | None = None,
                 sndhwm: int = 8, on_ack: Callable[[str, bool, str], None] | None = None):
        self.endpoint = endpoint
        self.on_ack = on_ack
        self.window_messages, self.window_bytes = max(1, window_messages), window_bytes
        self.spool_max_messages, self.spool_max_bytes = max(1, spool_max_messages), spool_max_bytes
        self.send_timeout_s, self.ack_timeout_s = send_timeout_s, ack_timeout_s
        self.stats = SenderStats()
        self._spool = Spool(spool_dir, free_slots=self.window_messages, free_bytes=window_bytes)
        self._cond = threading.Condition()
        self._pending: collections.deque[_Item] = collections.deque(_Item(e) for e in self._spool.adopt_orphans())
        self.stats.adopted = len(self._pending)
        self._inflight: dict[str, _Item] = {}
        self._mem_bytes = 0  # bytes of frames held in memory (pending cache + in flight)
        self._closing = False
        self._wake_r, self._wake_w = os.pipe()  # send() -> I/O thread: "the queue grew"
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        ctx = zmq.Context.instance()
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.SNDHWM, sndhwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)  # queue only to a live, authenticated connection
        if curve is not None:
            self._sock.curve_secretkey, self._sock.curve_publickey = curve.secret, curve.public
            self._sock.curve_serverkey = curve.server_public
        self._monitor = self._sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        self._sock.connect(endpoint)
        self._thread = threading.Thread(target=self._io_loop, name="trajectory-sender", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, endpoint: str, cfg: Any, *, client: str = "rollout", **kwargs: Any) -> "ZmqSender":
        """A sender configured by a ``TransportConfig`` (keys from ``cfg.keys_dir`` when ``cfg.curve``);
        ``kwargs`` (``spool_dir``, ``on_ack``) override or add to it."""
        args: dict[str, Any] = dict(
            spool_dir=cfg.spool_dir or None, window_messages=cfg.window_messages, window_bytes=cfg.window_bytes,
            spool_max_messages=cfg.spool_max_messages, spool_max_bytes=cfg.spool_max_bytes,
            send_timeout_s=cfg.send_timeout_s, ack_timeout_s=cfg.ack_timeout_s, sndhwm=cfg.sndhwm,
            curve=client_keys(cfg.keys_dir, client) if cfg.curve else None)
        return cls(endpoint, **{**args, **kwargs})

    # ---- caller side --------------------------------------------------------------------
    def send(self, key: str, frame: bytes | memoryview | EncodedTrajectory) -> None:
        """Spool ``frame`` under ``key`` (its trajectory id) and queue it; returns once it is in the spool.

        ``frame`` is a frame's bytes, or an :class:`~t1async.trajectory.EncodedTrajectory`, whose
        arrays are written straight into the spool file (one copy in all; the file's mapping is
        what is sent, zero-copy). Blocks while the spool is full (the learner is slow or away).

        Raises:
            TransportError: no spool room within ``send_timeout_s``, or the sender is closed.
            OSError: the disk has no room for the spool file.
        """
        nbytes = frame.nbytes if isinstance(frame, EncodedTrajectory) else memoryview(frame).nbytes
        deadline = time.monotonic() + self.send_timeout_s
        with self._cond:
            while len(self._spool) and (len(self._spool) >= self.spool_max_messages
                                        or self._spool.nbytes + nbytes > self.spool_max_bytes):
                left = deadline - time.monotonic()
                if self._closing or left <= 0:
                    raise TransportError(f"learner at {self.endpoint} acknowledged nothing for {self.send_timeout_s} s;"
                                         f" {len(self._spool)} trajectories ({self._spool.nbytes} bytes) are spooled")
                self._cond.wait(min(left, 1.0))
        entry = self._spool.put(key, frame.parts() if isinstance(frame, EncodedTrajectory) else frame)
        with self._cond:
            keep = self._mem_bytes + nbytes <= self.window_bytes
            if keep:  # mapped until ACKed; beyond that the file waits unmapped and is mapped when sent
                self._mem_bytes += nbytes
            else:
                self._spool.release(entry)
            self._pending.append(_Item(entry, self._spool.frame(entry) if keep else None))
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"!")
        except BlockingIOError:
            pass  # the pipe is full: the I/O thread is already due to wake

    def unacknowledged(self) -> int:
        """Trajectories spooled and not yet ACKed (or REJected)."""
        return len(self._spool)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every spooled trajectory is ACKed; True if that happened within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self._spool):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.2))
        return True

    def close(self, flush_timeout_s: float = 5.0) -> None:
        """Wait up to ``flush_timeout_s`` for ACKs, then stop; unACKed trajectories stay spooled."""
        if self._thread.is_alive() and not self._closing:
            self.flush(flush_timeout_s)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._wake()
        self._thread.join(timeout=5)
        self._spool.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # ---- I/O thread ---------------------------------------------------------------------
    def _io_loop(self) -> None:
        """Consumes the spool queue (woken by send) and ACKs; produces sends and resends.

        Wakes on an ACK, a connection event, a send(), or every 50 ms; stopped by close().
        """
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while not self._closing:
                events = dict(poller.poll(50))
                if self._wake_r in events:
                    while True:
                        try:
                            os.read(self._wake_r, 4096)
                        except BlockingIOError:
                            break
                if self._monitor in events:
                    self._on_monitor()
                if self._sock in events:
                    self._on_acks()
                self._resend_overdue()
                self._fill_window()
        except Exception as e:  # the spool keeps everything; log loudly, a new sender resends it
            logger.opt(exception=e).error("trajectory sender to {} stopped", self.endpoint)
        finally:
            self._monitor.close(linger=0)
            self._sock.close(linger=0)

    def _requeue_inflight(self) -> None:
        with self._cond:
            items = sorted(self._inflight.values(), key=lambda it: it.entry.seq)
            self._inflight.clear()
            self._pending.extendleft(reversed(items))

    def _on_monitor(self) -> None:
        while self._monitor.poll(0):
            ev = recv_monitor_message(self._monitor)["event"]
            if ev == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.stats.connects += 1
                if self.stats.connects > 1:
                    # A reconnect. A frame sent after DISCONNECTED was handled but before ZeroMQ
                    # dropped the dead pipe is lost without another event: resend everything still
                    # in flight (at least once; the learner de-duplicates by trajectory id).
                    self._requeue_inflight()
            elif ev == zmq.EVENT_DISCONNECTED:
                # What was in flight on the dead connection may be lost (or stored with its ACK
                # lost): resend it all once reconnected (IMMEDIATE: nothing leaves before that);
                # the learner de-duplicates by trajectory id.
                self._requeue_inflight()
                logger.warning("trajectory sender: learner at {} disconnected; {} trajectories spooled",
                               self.endpoint, len(self._spool))
            else:
                self.stats.handshake_failures += 1
                if self.stats.handshake_failures in (1, 10, 100) or self.stats.handshake_failures % 1000 == 0:
                    logger.error("learner at {} refused the handshake ({} times): its CURVE keys do not accept "
                                 "this actor; check transport.curve and transport.keys_dir on both sides",
                                 self.endpoint, self.stats.handshake_failures)

    def _on_acks(self) -> None:
        while True:
            try:
                parts = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(parts) != 3 or parts[0] not in (ACK, REJECT):
                logger.warning("trajectory sender: ignored a malformed reply of {} parts", len(parts))
                continue
            key = parts[1].decode("utf-8", "replace")
            with self._cond:
                item = self._inflight.pop(key, None)
                # The file is overwritten later only if no send may still read it (a requeued
                # item, or a zero-copy send ZeroMQ has not released: then it is unlinked instead).
                reuse = item is not None and (item.tracker is None or item.tracker.done)
                if not self._spool.remove(key, reuse=reuse):
                    continue  # a second ACK of a resent trajectory
                if item is not None and item.frame is not None:
                    self._mem_bytes -= item.entry.nbytes
                reason = parts[2].decode("utf-8", "replace")
                if parts[0] == ACK:
                    self.stats.acked += 1
                else:
                    self.stats.rejected += 1
                    self.stats.rejections.append(reason[:200])
                    self.stats.rejected_keys.append(key)
                    logger.error("learner rejected trajectory {}: {}", key, reason)
                self._cond.notify_all()
            if self.on_ack is not None:
                try:
                    self.on_ack(key, parts[0] == ACK, reason)
                except Exception as e:  # a caller's bug must not stop deliveries
                    logger.opt(exception=e).error("trajectory sender: on_ack callback failed for {}", key)

    def _resend_overdue(self) -> None:
        now = time.monotonic()
        if any(now - it.sent_at > self.ack_timeout_s for it in self._inflight.values()):
            logger.warning("trajectory sender: ACK overdue from {}; resending {} in flight", self.endpoint,
                           len(self._inflight))
            self._requeue_inflight()

    def _fill_window(self) -> None:
        while True:
            with self._cond:
                if not self._pending or len(self._inflight) >= self.window_messages:
                    return
                item = self._pending[0]
                if item.entry.key not in self._spool:
                    self._pending.popleft()  # ACKed while queued for a resend
                    if item.frame is not None:
                        self._mem_bytes -= item.entry.nbytes
                    continue
                inflight_bytes = sum(it.entry.nbytes for it in self._inflight.values())
                if self._inflight and inflight_bytes + item.entry.nbytes > self.window_bytes:
                    return
            if item.frame is None:
                item.frame = self._spool.frame(item.entry)
                with self._cond:
                    self._mem_bytes += item.entry.nbytes
            copy = item.entry.nbytes < 65536
            try:
                tracker = self._sock.send_multipart([PROTOCOL, item.entry.key.encode(), item.frame], flags=zmq.NOBLOCK,
                                                    copy=copy, track=not copy)
            except zmq.Again:
                return  # no live connection yet (IMMEDIATE) or its queue is full: try again later
            with self._cond:
                self._pending.popleft()
                item.tracker = tracker
                item.sent_at, item.sends = time.monotonic(), item.sends + 1
                self._inflight[item.entry.key] = item
                self.stats.sent += 1
                self.stats.resent += item.sends > 1


class ZmqReceiver:
    """ROUTER socket the learner binds; see the module docstring for the messages.

    Args:
        endpoint: address to bind (``tcp://host:*`` picks a free port; see :func:`make_endpoint`).
        rcvhwm: messages ZeroMQ queues before it stops reading from senders.
        max_message_bytes: a larger message drops the sender's connection (ZMQ_MAXMSGSIZE).
        curve: the learner's keys (CurveZMQ + ZAP allow-list) or None for plain ZMTP.

    Attributes:
        endpoint: the address actually bound (with the chosen port), for senders to connect to.
        refused_handshakes: with ``curve``, connections refused before any message: ``auth`` (a key the
            ZAP handler does not accept), ``protocol`` and ``other`` (no CurveZMQ handshake at all: a
            plain or forged sender; libzmq reports it as ``protocol`` or as ``other``, no detail, depending
            on which side notices the mechanism mismatch first); counted from the
            socket's monitor as :meth:`recv` runs (the learner's status shows them as
            ``refused_handshakes``), the first ones and then every 100th logged.

    Not thread-safe: one thread calls :meth:`recv` and :meth:`ack`.
    """

    def __init__(self, endpoint: str, *, rcvhwm: int = 64, max_message_bytes: int = 4 << 30,
                 curve: ServerKeys | None = None):
        self._ctx = zmq.Context()  # own context: one ZAP handler per context
        self._auth = None
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.RCVHWM, rcvhwm)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.refused_handshakes = {"auth": 0, "protocol": 0, "other": 0}
        self._monitor = None
        if curve is not None:
            self._monitor = self._sock.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
            self._auth = ThreadAuthenticator(self._ctx)
            self._auth.start()
            self._auth.configure_curve(domain="*", location=str(curve.authorized_dir))
            self._sock.curve_server = True
            self._sock.curve_secretkey, self._sock.curve_publickey = curve.secret, curve.public
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as e:
            self.close()
            raise TransportError(f"cannot bind the trajectory socket at {endpoint}: {e}; set transport.host to an address of "
                                 "this machine and transport.port to a free port (0: any)") from None
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        if self._monitor is not None:
            self._poller.register(self._monitor, zmq.POLLIN)

    @classmethod
    def from_config(cls, cfg: Any) -> "ZmqReceiver":
        """A receiver configured by a ``TransportConfig`` (keys from ``cfg.keys_dir`` when ``cfg.curve``)."""
        return cls(make_endpoint(cfg.scheme, cfg.host, cfg.port), rcvhwm=cfg.rcvhwm,
                   max_message_bytes=cfg.max_message_bytes, curve=server_keys(cfg.keys_dir) if cfg.curve else None)

    def recv(self, timeout_s: float) -> Delivery | None:
        """One message, or None if none arrived within ``timeout_s`` seconds.

        A malformed envelope comes back as a :class:`Delivery` with ``error`` set.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            events = dict(self._poller.poll(max(0, int((deadline - time.monotonic()) * 1000))))
            if self._monitor is not None and self._monitor in events:
                self._count_refused()
            if self._sock in events:
                break
            if time.monotonic() >= deadline:
                return None
        parts = self._sock.recv_multipart(copy=False)
        peer = parts[0].bytes
        raw_key = parts[2].bytes[:MAX_KEY_BYTES] if len(parts) > 2 else b""
        if len(parts) != 4:
            return Delivery("", memoryview(b""), peer, f"envelope of {len(parts) - 1} parts, expected "
                                                          f"[{PROTOCOL.decode()}, key, frame]", raw_key)
        if parts[1].bytes != PROTOCOL:
            return Delivery("", memoryview(b""), peer, f"protocol {parts[1].bytes[:40]!r}, expected "
                                                          f"{PROTOCOL.decode()!r} (sender and learner of different "
                                                          "t1async versions?)", raw_key)
        try:
            key = parts[2].bytes.decode("utf-8")
        except UnicodeDecodeError:
            return Delivery("", memoryview(b""), peer, "key is not utf-8", raw_key)
        frame = parts[3].buffer
        if not key or len(parts[2].bytes) > MAX_KEY_BYTES or not key.isprintable():
            return Delivery("", frame, peer, f"key {key[:40]!r} is not 1-{MAX_KEY_BYTES} printable bytes", raw_key)
        return Delivery(key, frame, peer)

    def _count_refused(self) -> None:
        """Count the handshakes the monitor reports as failed (:attr:`refused_handshakes`)."""
        while self._monitor is not None and self._monitor.poll(0):
            ev = recv_monitor_message(self._monitor)
            kind = {zmq.EVENT_HANDSHAKE_FAILED_AUTH: "auth",
                    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol"}.get(ev["event"], "other")
            self.refused_handshakes[kind] += 1
            n = sum(self.refused_handshakes.values())
            if n <= 10 or n % 100 == 0:
                logger.warning("trajectory socket: refused a connection that did not authenticate ({}; {} so far): "
                               "only processes holding the run's CurveZMQ keys (transport.keys_dir) may send",
                               kind, n)

    def ack(self, delivery: Delivery, ok: bool, reason: str = "") -> None:
        """Answer ACK (stored; the sender forgets it) or REJ (invalid; the sender forgets it too).

        A malformed envelope (no valid key) is answered with its key frame as sent
        (:attr:`Delivery.reply_key`, empty when it had none), so that its sender hears why.
        """
        key = delivery.key.encode() if delivery.key else delivery.reply_key
        try:
            self._sock.send_multipart([delivery.peer, ACK if ok else REJECT, key, reason.encode()[:1000]],
                                      flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the sender is gone or its queue is full: it resends and gets a duplicate ACK

    def close(self) -> None:
        """Close the socket and the authenticator (queued messages are discarded)."""
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
        self._sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()
