"""The trajectory: one episode's exact token stream and everything the learner needs, and its wire format.

All wire types live here. A rollout actor builds a :class:`Trajectory`, :func:`encode` turns it
into one frame (:class:`EncodedTrajectory` gives it as parts to write without a copy first), the transport
carries the frame to the learner, and :func:`decode` gives back
read-only numpy views over the received frame (zero-copy) after checking every invariant below.

Frame layout (schema version 3; all integers little-endian)::

    offset 0   magic     4 bytes  b"T1TJ"
    offset 4   H         uint32   length of the header
    offset 8   header    H bytes  msgpack map: "schema_version" (int), the scalar fields,
                                  "tests", and "arrays": {name: {"dtype", "shape", "offset",
                                  "nbytes"}}
    padding to a multiple of 64 bytes (zeros)
    data       each array's raw bytes, C order, at data start + "offset"; every offset is a
               multiple of 64, so each array is aligned to 64 bytes relative to the frame
               start (and naturally aligned whenever the frame buffer is 8-aligned, which
               malloc and ZeroMQ guarantee)

Arrays never travel as msgpack lists (a list of a million ints costs 16 ms to pack) nor as
msgpack ``bin`` (unpacking ``bin`` copies it): the header is small and the data is viewed in
place. A frame that does not start with the magic is tried as a schema-1 message (a plain
msgpack map) so that an old sender gets an error naming both versions, never a mis-read.

Arrays (T = tokens in the stream; L = MoE layers; K = experts per token):

==============  ================  ===========  ==============================================
field           shape             dtype        meaning
==============  ================  ===========  ==============================================
token_ids       [T]               <u4          the episode's whole stream, exactly as sampled
                                               (prompt, sampled turns, repair, observations)
loss_mask       [T]               |u1          1 on ids the sampler sampled, else 0 (only 0/1)
logprobs        [T]               <f4          sampler log-prob of token i (finite, <= 0 where
                                               the mask is 1; 0 by convention elsewhere)
versions        [T]               <i4          weight version that sampled token i (>= 0 and
                                               not ahead of the learner where the mask is 1;
                                               -1 by convention elsewhere)
turn_offsets    [turns, 2]        <i4          [start, end) of each turn's sampled span:
                                               non-empty, increasing, inside [1, T]; every
                                               mask-1 token lies in a span
turn_status     [turns]           |u1          how each turn ended, one code per row of
                                               turn_offsets (:data:`TURN_STATUS`): 0 normal,
                                               1 cut at max_new_tokens (its command was run
                                               anyway: ``env.run_cut_commands``), 2 aborted by
                                               the sampler (command not run), 3 the command
                                               timed out, 4 the sandbox refused part of the
                                               command (a resource limit), 5 cut at
                                               max_new_tokens and its command not run, 6-11 a
                                               malformed tool call (:data:`TOOL_CALL_ERRORS`,
                                               not run). Where several apply, the sampler's
                                               (2, 5, 1) wins over the tool call's (6-11) and
                                               the command's (4, then 3). Added in schema 3.
routed_experts  [T - 1, L, K]     |u1/<u2/<u4  expert ids chosen for input position i at each
                                               MoE layer, in the smallest unsigned dtype that
                                               holds ``num_experts`` (:func:`experts_dtype`);
                                               every id < num_experts; id 0 is a real expert.
                                               The last token has no row: it was never fed
                                               back to the sampler.
==============  ================  ===========  ==============================================

Scalars: ``trajectory_id`` (str, 1-128 chars, unique; the key for de-duplication),
``task`` (task name), ``actor_id`` (int >= 0, the rollout actor), ``num_experts`` (int > 0),
``reward`` (float, finite: tests passed), ``passed``/``total`` (ints, 0 <= passed <= total),
``resolved`` (bool: every test passed and total > 0), ``finish_reason`` (str: how the episode
ended, set by t1async/rollout/episode.py: ``end_signal``, ``max_turns``, ``timeout`` (the agent's time
budget was spent), ``context_full`` (the next turn would not fit the model's context)),
``started_at``/``finished_at`` (float, seconds since the Unix epoch, started <= finished),
``verifier_error`` (str or nil: set when the reward is unknown, i.e. the verifier crashed,
printed no test summary or could not collect its tests for a module its environment lacks, see
t1async/envs/verifier.py; the learner never trains on such a trajectory. A verifier timeout is not
one: it arrives as reward 0 with the failed test ``verifier_timeout``, as the harnesses score it),
``tests`` (list of ``[name: str, passed: bool]``),
``drift_tokens`` and ``template_mismatches`` (ints >= 0: TITO counters, see t1async/rollout/episode.py),
``agent`` (str, 1-64 printable characters: who drove the episode, a ``rollout.agent`` name such as
``builtin`` or ``codex``; optional in the header, absent reads as ``builtin``, so frames of senders
that predate it decode unchanged).
"""

from __future__ import annotations

import base64
import binascii
import itertools
import math
import os
import struct
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

SCHEMA_VERSION = 3
"""Version of the wire schema; a message with another version is refused, never mis-read
(3 added ``turn_status``)."""
MAGIC = b"T1TJ"
ALIGN = 64
_PREAMBLE = struct.Struct("<4sI")
MAX_ID_CHARS = 128
MAX_AGENT_CHARS = 64

HISTORY_BREAK = "history_break"
"""``finish_reason`` of an external agent's segment that ended because the agent's next request broke its
history (t1async/rollout/endpoint/agent.py); the learner counts them per agent."""

TURN_OK = 0
"""The turn ended normally (a stop id, or text the sampler ended without hitting a limit)."""
TURN_LENGTH_CUT = 1
"""The sampler cut the turn at ``max_new_tokens`` (finish_reason ``length``); its command was run anyway."""
TURN_ABORTED = 2
"""The sampler aborted the turn (finish_reason ``abort``, which SGLang returns); its command was not run."""
TURN_COMMAND_TIMEOUT = 3
"""The turn's command overran its timeout and its processes were killed."""
TURN_SANDBOX_REFUSED = 4
"""The sandbox refused part of the turn's command (a process, memory or disk limit)."""
TURN_CUT_NOT_RUN = 5
"""The sampler cut the turn at ``max_new_tokens`` and its command was not run (the default)."""
TOOL_CALL_ERRORS = {6: "no_tool_call", 7: "unbalanced", 8: "bad_json", 9: "unknown_tool", 10: "bad_arguments",
                    11: "multiple_calls"}
"""``turn_status`` code -> reason of a malformed tool call (``env.action_format`` tool_call, see
t1async/rollout/actions.py): the call was not run, the agent saw an error observation."""
TOOL_CALL_CODES = {reason: code for code, reason in TOOL_CALL_ERRORS.items()}
"""Reason -> ``turn_status`` code of a malformed tool call (the inverse of :data:`TOOL_CALL_ERRORS`)."""
TURN_STATUS = {TURN_OK: "ok", TURN_LENGTH_CUT: "length_cut", TURN_ABORTED: "aborted",
               TURN_COMMAND_TIMEOUT: "command_timeout", TURN_SANDBOX_REFUSED: "sandbox_refused",
               TURN_CUT_NOT_RUN: "length_cut_not_run",
               **{code: f"tool_call_{reason}" for code, reason in TOOL_CALL_ERRORS.items()}}
"""Every known ``turn_status`` code and its name (the name is the metrics key)."""


class TrajectoryError(ValueError):
    """A trajectory message is malformed or breaks an invariant; ``field`` names the culprit."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"trajectory field {field_name!r}: {message}")
        self.field = field_name


def experts_dtype(num_experts: int) -> np.dtype:
    """Smallest unsigned dtype that holds expert ids ``0 .. num_experts - 1``."""
    if num_experts <= 0:
        raise ValueError(f"num_experts must be positive, got {num_experts}")
    for dt in (np.uint8, np.uint16, np.uint32):
        if num_experts - 1 <= np.iinfo(dt).max:
            return np.dtype(dt)
    raise ValueError(f"num_experts {num_experts} does not fit uint32")


@dataclass
class Trajectory:
    """One finished episode, aligned token by token (see the module docstring for every field).

    ``tests`` holds ``(test name, passed)`` pairs from the verifier; ``reward`` is the number of
    tests passed (dense reward); ``resolved`` means every test passed and there was at least one.
    ``turn_status`` defaults to every turn normal (uint8 zeros, one per row of ``turn_offsets``).
    """

    task: str
    actor_id: int
    token_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    turn_offsets: np.ndarray
    routed_experts: np.ndarray
    num_experts: int
    reward: float
    passed: int
    total: int
    resolved: bool
    finish_reason: str
    tests: list[tuple[str, bool]] = field(default_factory=list)
    verifier_error: str | None = None
    trajectory_id: str = field(default_factory=lambda: new_trajectory_id())
    started_at: float = 0.0
    finished_at: float = field(default_factory=time.time)
    drift_tokens: int = 0
    """Loss-mask-1 positions whose id differs from the id the sampler returned (TITO: must be 0)."""
    template_mismatches: int = 0
    """Turns where the chat template would render the history differently from the stream
    (the stream wins; counted, see t1async/rollout/episode.py)."""
    agent: str = "builtin"
    """Who drove the episode: the ``rollout.agent`` name drawn for it (t1async/rollout/agent_mix.py)."""
    turn_status: np.ndarray | None = None
    """[turns] uint8 code of how each turn ended (:data:`TURN_STATUS`); None: every turn normal."""
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.turn_status is None:
            self.turn_status = np.zeros(len(self.turn_offsets), dtype=np.uint8)

    @property
    def num_tokens(self) -> int:
        """Tokens in the stream (T)."""
        return int(self.token_ids.shape[0])

    @property
    def min_version(self) -> int:
        """Oldest weight version among the sampled tokens (staleness is measured from it)."""
        sampled = self.versions[self.loss_mask.astype(bool)]
        return int(sampled.min()) if sampled.size else -1


_ID_STREAM: tuple[int, str, Any] = (-1, "", None)  # (pid, stream, counter) of this process


def new_trajectory_id() -> str:
    """A fresh id ``<stream>-<seq>``: ``stream`` is 16 hex digits drawn once per process (a
    rollout actor's life), ``seq`` counts up from 0 in that process. The learner's consumed-id
    ledger (:class:`t1async.transport.delivery.ConsumedLedger`) keeps one high-water mark per stream
    instead of every id, so its size does not grow with the trajectories trained."""
    global _ID_STREAM
    pid, stream, counter = _ID_STREAM
    if pid != os.getpid():  # first call, or a forked child: a stream of its own
        _ID_STREAM = pid, stream, counter = os.getpid(), uuid.uuid4().hex[:16], itertools.count()
    return f"{stream}-{next(counter)}"


_ARRAYS = {
    # name: (allowed dtypes, ndim)
    "token_ids": (("<u4",), 1),
    "loss_mask": (("|u1",), 1),
    "logprobs": (("<f4",), 1),
    "versions": (("<i4",), 1),
    "turn_offsets": (("<i4",), 2),
    "turn_status": (("|u1",), 1),
    "routed_experts": (("|u1", "<u2", "<u4"), 3),
}
_SCALARS = {
    "trajectory_id": str,
    "task": str,
    "actor_id": int,
    "num_experts": int,
    "reward": float,
    "passed": int,
    "total": int,
    "resolved": bool,
    "finish_reason": str,
    "started_at": float,
    "finished_at": float,
    "drift_tokens": int,
    "template_mismatches": int,
}
_MAX_DIM = 1 << 40


def _wire_arrays(traj: Trajectory) -> dict[str, np.ndarray]:
    """The arrays as contiguous little-endian arrays of their wire dtypes (checked casts)."""
    ne_dt = experts_dtype(traj.num_experts)
    out = {}
    for name, dt in (("token_ids", "<u4"), ("loss_mask", "|u1"), ("logprobs", "<f4"), ("versions", "<i4"),
                     ("turn_offsets", "<i4"), ("turn_status", "|u1"), ("routed_experts", ne_dt.newbyteorder("<"))):
        a = np.asarray(getattr(traj, name))
        if name == "routed_experts" and a.dtype != ne_dt and a.size:
            lo, hi = int(a.min()), int(a.max())  # a wider dtype must not wrap silently
            if lo < 0 or hi >= traj.num_experts:
                raise TrajectoryError(name, f"expert ids span [{lo}, {hi}], num_experts is {traj.num_experts}")
        if name == "turn_status" and a.dtype != np.uint8 and a.size and (int(a.min()) < 0 or int(a.max()) > 255):
            raise TrajectoryError(name, f"codes span [{int(a.min())}, {int(a.max())}]; known codes are {TURN_STATUS}")
        out[name] = np.ascontiguousarray(a, dtype=dt)
    return out


class EncodedTrajectory:
    """A trajectory laid out as one frame (layout in the module docstring), not yet copied anywhere.

    ``nbytes`` is the frame's size; :meth:`parts` gives it as buffers over the arrays themselves
    (the sender writes them straight into its spool file, which it then sends from: one copy in
    all) and :meth:`tobytes` joins them into new bytes. Building one costs the header only (a few
    microseconds); writing it costs one copy of the arrays (about 1.5 ms for 13 MB).

    Raises:
        TrajectoryError: ``routed_experts`` holds ids that do not fit ``num_experts``, or
            ``turn_status`` codes that do not fit uint8.
    """

    def __init__(self, traj: Trajectory):
        header: dict[str, Any] = {"schema_version": traj.schema_version}
        for name in _SCALARS:
            header[name] = getattr(traj, name)
        header["verifier_error"] = traj.verifier_error
        header["agent"] = traj.agent
        header["tests"] = [[str(n), bool(p)] for n, p in traj.tests]
        self._arrays = _wire_arrays(traj)
        specs, offset = {}, 0
        for name, a in self._arrays.items():
            specs[name] = {"dtype": a.dtype.str, "shape": list(a.shape), "offset": offset, "nbytes": a.nbytes}
            offset += -(-a.nbytes // ALIGN) * ALIGN
        header["arrays"] = specs
        head = msgpack.packb(header, use_bin_type=True)
        self._data_start = -(-(_PREAMBLE.size + len(head)) // ALIGN) * ALIGN
        self._head = _PREAMBLE.pack(MAGIC, len(head)) + head
        self.nbytes = self._data_start + offset
        """Size of the frame in bytes."""

    def parts(self) -> list[Any]:
        """The frame as buffers to write back to back (header, zero padding, each array and its
        padding): the arrays themselves, not copies."""
        out: list[Any] = [self._head, bytes(self._data_start - len(self._head))]
        for a in self._arrays.values():
            out.append(a.reshape(-1).view(np.uint8).data)
            pad = -a.nbytes % ALIGN
            if pad:
                out.append(bytes(pad))
        return out

    def tobytes(self) -> bytes:
        """The frame as new bytes (one copy of the arrays)."""
        return b"".join(self.parts())


def encode(traj: Trajectory) -> bytes:
    """Serialise a trajectory to one frame (layout in the module docstring); see :class:`EncodedTrajectory`.

    Raises:
        TrajectoryError: ``routed_experts`` holds ids that do not fit ``num_experts``, or
            ``turn_status`` codes that do not fit uint8.
    """
    return EncodedTrajectory(traj).tobytes()


def _read_header(frame: memoryview) -> tuple[dict, int]:
    """The header map and the data section's start offset; checks magic and schema version."""
    if len(frame) < _PREAMBLE.size or bytes(frame[:4]) != MAGIC:
        _refuse_unframed(frame)
    _, hlen = _PREAMBLE.unpack_from(frame, 0)
    if _PREAMBLE.size + hlen > len(frame):
        raise TrajectoryError("<frame>", f"header of {hlen} bytes overruns a frame of {len(frame)} bytes")
    try:
        header = msgpack.unpackb(frame[_PREAMBLE.size:_PREAMBLE.size + hlen], raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise TrajectoryError("<header>", f"not a msgpack map ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict):
        raise TrajectoryError("<header>", f"top level is {type(header).__name__}, expected a map")
    sv = header.get("schema_version")
    if sv != SCHEMA_VERSION:
        raise TrajectoryError("schema_version", _schema_message(sv))
    return header, -(-(_PREAMBLE.size + hlen) // ALIGN) * ALIGN


def _schema_message(sv: Any) -> str:
    side = "newer" if isinstance(sv, int) and sv > SCHEMA_VERSION else "older"
    return (f"message has schema {sv!r}, this learner reads schema {SCHEMA_VERSION}; run rollout actors and "
            f"learner from the same t1async version (the sender is {side})")


def _refuse_unframed(frame: memoryview) -> None:
    """A frame without the magic: name the schema if it is an older plain-msgpack message."""
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception:
        msg = None
    if isinstance(msg, dict) and "schema_version" in msg:
        raise TrajectoryError("schema_version", _schema_message(msg["schema_version"]))
    raise TrajectoryError("<frame>", f"does not start with {MAGIC!r}: not a t1async trajectory frame")


def _view_array(specs: Any, name: str, frame: memoryview, data_start: int) -> np.ndarray:
    dtypes, ndim = _ARRAYS[name]
    spec = specs.get(name) if isinstance(specs, dict) else None
    if not isinstance(spec, dict):
        raise TrajectoryError(name, "missing or not an array map {dtype, shape, offset, nbytes}")
    dt, shape, off, nbytes = spec.get("dtype"), spec.get("shape"), spec.get("offset"), spec.get("nbytes")
    if dt not in dtypes:
        raise TrajectoryError(name, f"dtype {dt!r} is not one of {dtypes}")
    if not isinstance(shape, list) or len(shape) != ndim or not all(
            type(s) is int and 0 <= s < _MAX_DIM for s in shape):
        raise TrajectoryError(name, f"shape {shape!r} is not {ndim} non-negative ints")
    if type(off) is not int or type(nbytes) is not int or off < 0 or off % ALIGN:
        raise TrajectoryError(name, f"offset {off!r} is not a non-negative multiple of {ALIGN}")
    itemsize = np.dtype(dt).itemsize
    expected = math.prod(shape) * itemsize
    if nbytes != expected:
        raise TrajectoryError(name, f"{nbytes} bytes for shape {shape} of {dt} (expected {expected})")
    begin = data_start + off
    if begin + nbytes > len(frame):
        raise TrajectoryError(name, f"bytes [{begin}, {begin + nbytes}) overrun a frame of {len(frame)} bytes")
    return np.frombuffer(frame, dtype=dt, count=math.prod(shape), offset=begin).reshape(shape)


def decode(frame: bytes | bytearray | memoryview, *, num_experts: int | None = None, num_layers: int | None = None,
           top_k: int | None = None, max_version: int | None = None) -> Trajectory:
    """Decode and validate one frame; the arrays are read-only numpy views over ``frame`` (no copy).

    Args:
        frame: the bytes received from the socket (kept alive by the returned views).
        num_experts, num_layers, top_k: the learner's model shape; when given, routed experts must
            match it.
        max_version: the learner's current weight version; no sampled token may claim a newer one.

    Raises:
        TrajectoryError: naming the first field that is missing, mistyped or inconsistent,
            including a ``schema_version`` other than :data:`SCHEMA_VERSION` (both are named).
    """
    mv = memoryview(frame).cast("B") if not isinstance(frame, memoryview) or frame.format != "B" else frame
    if not mv.readonly:
        mv = mv.toreadonly()
    header, data_start = _read_header(mv)
    kw: dict[str, Any] = {}
    for name, typ in _SCALARS.items():
        v = header.get(name)
        if typ is float and type(v) is int:
            v = float(v)
        if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
            raise TrajectoryError(name, f"expected {typ.__name__}, got {type(v).__name__}")
        kw[name] = v
    ve = header.get("verifier_error")
    if ve is not None and not isinstance(ve, str):
        raise TrajectoryError("verifier_error", "expected a string or nil")
    agent = header.get("agent", "builtin")
    if not isinstance(agent, str):
        raise TrajectoryError("agent", f"expected str, got {type(agent).__name__}")
    tests = header.get("tests")
    if not isinstance(tests, list) or not all(
        isinstance(t, list) and len(t) == 2 and isinstance(t[0], str) and isinstance(t[1], bool) for t in tests
    ):
        raise TrajectoryError("tests", "expected a list of [name: str, passed: bool]")
    specs = header.get("arrays")
    if not isinstance(specs, dict):
        raise TrajectoryError("arrays", "missing or not a map of array specs")
    arrays = {name: _view_array(specs, name, mv, data_start) for name in _ARRAYS}
    traj = Trajectory(**kw, **arrays, tests=[(n, p) for n, p in tests], verifier_error=ve, agent=agent,
                      schema_version=SCHEMA_VERSION)
    validate(traj, num_experts=num_experts, num_layers=num_layers, top_k=top_k, max_version=max_version)
    return traj


def _check_scalars(traj: Trajectory) -> None:
    tid = traj.trajectory_id
    if not (isinstance(tid, str) and 0 < len(tid) <= MAX_ID_CHARS and tid.isprintable()):
        raise TrajectoryError("trajectory_id", f"{tid!r} is not 1-{MAX_ID_CHARS} printable characters")
    if not (isinstance(traj.agent, str) and 0 < len(traj.agent) <= MAX_AGENT_CHARS and traj.agent.isprintable()):
        raise TrajectoryError("agent", f"{traj.agent!r} is not 1-{MAX_AGENT_CHARS} printable characters")
    for name in ("actor_id", "drift_tokens", "template_mismatches"):
        if getattr(traj, name) < 0:
            raise TrajectoryError(name, f"{getattr(traj, name)} is negative")
    if traj.num_experts <= 0 or traj.num_experts > 1 << 32:
        raise TrajectoryError("num_experts", f"{traj.num_experts} is not in [1, 2**32]")
    if not math.isfinite(traj.reward):
        raise TrajectoryError("reward", f"{traj.reward} is not finite")
    if not (0 <= traj.passed <= traj.total):
        raise TrajectoryError("passed", f"{traj.passed} passed of {traj.total} tests")
    if traj.resolved and not (traj.total > 0 and traj.passed == traj.total):
        raise TrajectoryError("resolved", "resolved requires every test passed and at least one test")
    if not (math.isfinite(traj.started_at) and math.isfinite(traj.finished_at)) or traj.started_at > traj.finished_at:
        raise TrajectoryError("finished_at", f"started_at {traj.started_at} is after finished_at {traj.finished_at}")


def validate(traj: Trajectory, *, num_experts: int | None = None, num_layers: int | None = None,
             top_k: int | None = None, max_version: int | None = None) -> None:
    """Check every invariant of the module docstring (about 0.3 ms for 32k tokens x 48 layers x top-8).

    Raises:
        TrajectoryError: naming the first field that breaks an invariant.
    """
    _check_scalars(traj)
    T = traj.num_tokens
    if traj.token_ids.ndim != 1 or T < 2:
        raise TrajectoryError("token_ids", f"shape {traj.token_ids.shape}; a trajectory needs a prompt and a sampled token")
    for name in ("loss_mask", "logprobs", "versions"):
        a = getattr(traj, name)
        if a.shape != (T,):
            raise TrajectoryError(name, f"shape {a.shape} != token_ids shape ({T},)")
    if traj.loss_mask.dtype != np.uint8:
        raise TrajectoryError("loss_mask", f"dtype {traj.loss_mask.dtype} is not uint8")
    mask = traj.loss_mask
    if mask.max() > 1:
        raise TrajectoryError("loss_mask", "values must be 0 or 1")
    sampled = mask.view(bool)
    if not sampled.any():
        raise TrajectoryError("loss_mask", "no sampled token in the trajectory")
    if sampled[0]:
        raise TrajectoryError("loss_mask", "the first token cannot be sampled (there is no prompt)")
    lp = traj.logprobs[sampled]
    if not np.all(np.isfinite(lp)) or np.any(lp > 1e-4):
        raise TrajectoryError("logprobs", "sampled log-probs must be finite and <= 0")
    v = traj.versions[sampled]
    if v.min() < 0:
        raise TrajectoryError("versions", "a sampled token has a negative weight version")
    if max_version is not None and v.max() > max_version:
        raise TrajectoryError("versions", f"version {int(v.max())} is ahead of the learner's {max_version}")
    _check_turns(traj.turn_offsets, sampled, T)
    _check_turn_status(traj.turn_status, traj.turn_offsets.shape[0])
    _check_experts(traj, num_experts, num_layers, top_k)


def _check_turns(off: np.ndarray, sampled: np.ndarray, T: int) -> None:
    if off.ndim != 2 or off.shape[1] != 2 or off.shape[0] == 0:
        raise TrajectoryError("turn_offsets", f"shape {off.shape} is not [turns >= 1, 2]")
    flat = off.reshape(-1).astype(np.int64)
    if np.any(flat[1:] < flat[:-1]) or flat[0] < 1 or flat[-1] > T or np.any(off[:, 1] <= off[:, 0]):
        raise TrajectoryError("turn_offsets", "spans must be non-empty, increasing and inside [1, T]")
    edges = np.zeros(T + 1, dtype=np.int32)  # +1 at each span start, -1 at each end: cumsum marks the spans
    edges[off[:, 0]] += 1
    edges[off[:, 1]] -= 1
    in_turn = np.cumsum(edges[:T], dtype=np.int32) > 0
    if np.any(sampled & ~in_turn):
        raise TrajectoryError("loss_mask", "a sampled token lies outside every turn span")


_KNOWN_STATUS = np.zeros(256, dtype=bool)
_KNOWN_STATUS[list(TURN_STATUS)] = True


def _check_turn_status(status: np.ndarray, turns: int) -> None:
    if not isinstance(status, np.ndarray) or status.dtype != np.uint8 or status.shape != (turns,):
        shape = getattr(status, "shape", None)
        raise TrajectoryError("turn_status", f"must be uint8 of shape ({turns},), one code per turn; got "
                                             f"{getattr(status, 'dtype', type(status).__name__)} of shape {shape}")
    unknown = status[~_KNOWN_STATUS[status]]
    if unknown.size:
        raise TrajectoryError("turn_status", f"unknown code {int(unknown[0])}; known codes are {TURN_STATUS}")


def _check_experts(traj: Trajectory, num_experts: int | None, num_layers: int | None, top_k: int | None) -> None:
    re, T = traj.routed_experts, traj.num_tokens
    if re.ndim != 3 or re.shape[0] != T - 1:
        raise TrajectoryError("routed_experts", f"shape {re.shape} must be [T-1={T - 1}, layers, top_k]")
    if num_layers is not None and re.shape[1] != num_layers:
        raise TrajectoryError("routed_experts", f"{re.shape[1]} layers, the model has {num_layers}")
    if top_k is not None and re.shape[2] != top_k:
        raise TrajectoryError("routed_experts", f"top_k {re.shape[2]}, the model routes to {top_k}")
    ne = num_experts if num_experts is not None else traj.num_experts
    if traj.num_experts != ne:
        raise TrajectoryError("num_experts", f"{traj.num_experts}, the model has {ne}")
    want = experts_dtype(ne)
    if re.dtype != want:
        raise TrajectoryError("routed_experts", f"dtype {re.dtype} is not {want}, the smallest that holds {ne} experts")
    # One pass over the ids (memory bound: ~0.2 ms for 12.6 M uint8); skipped when every value of
    # the dtype is a valid id (256 experts in uint8, 65536 in uint16).
    if re.size and ne < 1 << (8 * re.dtype.itemsize) and int(re.max()) >= ne:
        raise TrajectoryError("routed_experts", f"expert id {int(re.max())} >= num_experts {ne}")


def routed_experts_from_sglang(b64: str | bytes, *, rows: int, layers: int, top_k: int,
                               num_experts: int | None = None) -> np.ndarray:
    """Decode SGLang's ``meta_info["routed_experts"]`` into this format's routed-experts array.

    SGLang (0.5.7+, server flag ``--enable-return-routed-experts``) returns base64 of raw int32,
    row-major, shape ``[prompt_len + output_len - 1 - start_len, layers, top_k]``; docs/sglang.md, "The pinned protocol".
    Expert id 0 is a real expert, never padding, and the row count must match exactly.

    Args:
        b64: the base64 text (or bytes) of the field.
        rows: expected rows, ``prompt_len + output_len - 1 - routed_experts_start_len``.
        layers, top_k: the model's MoE layers and experts per token.
        num_experts: when given, every id must be < it and the result has :func:`experts_dtype`;
            otherwise the result stays int32 (ids must still be >= 0).

    Returns:
        ``[rows, layers, top_k]`` array (a read-only view when it stays int32).

    Raises:
        TrajectoryError: (field ``routed_experts``) not base64, not whole int32 values, a row
            count other than ``rows``, or an id out of range.
    """
    if rows < 0 or layers <= 0 or top_k <= 0:
        raise TrajectoryError("routed_experts", f"expected rows {rows} >= 0 with layers {layers}, top_k {top_k} > 0")
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError, TypeError) as e:
        raise TrajectoryError("routed_experts", f"not base64 ({e})") from None
    if len(raw) % 4:
        raise TrajectoryError("routed_experts", f"{len(raw)} bytes is not a whole number of int32 ids")
    flat = np.frombuffer(raw, dtype="<i4")
    per_row = layers * top_k
    if flat.size != rows * per_row:
        got = f"{flat.size // per_row} rows" + (f" + {flat.size % per_row} ids" if flat.size % per_row else "")
        raise TrajectoryError("routed_experts", f"holds {got} of {layers} layers x {top_k}, expected exactly {rows} rows "
                                                "(prompt + output - 1 - start_len)")
    arr = flat.reshape(rows, layers, top_k)
    if arr.size and int(arr.min()) < 0:
        raise TrajectoryError("routed_experts", f"negative expert id {int(arr.min())}")
    if num_experts is None:
        return arr
    if arr.size and int(arr.max()) >= num_experts:
        raise TrajectoryError("routed_experts", f"expert id {int(arr.max())} >= num_experts {num_experts}")
    return arr.astype(experts_dtype(num_experts))
