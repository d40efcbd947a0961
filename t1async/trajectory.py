"""The trajectory: one episode's exact token stream and everything the learner needs, and its wire format.

All wire types live here. A trajectory is built by a rollout actor, encoded with msgpack, pushed
over ZeroMQ, decoded and validated by the learner. Arrays travel as raw little-endian bytes with
their dtype and shape (``{"dtype": "<u4", "shape": [T], "data": b"..."}``), never as msgpack lists
(a list of a million ints costs 16 ms to pack; the bytes cost about 1 ms, see DESIGN.md).

Token alignment (T = number of tokens in the stream):

================  ===========================  ========  =============================================
field             shape                        dtype     meaning
================  ===========================  ========  =============================================
token_ids         [T]                          uint32    the episode's whole stream, exactly as sampled
                                                         (prompt, sampled turns, repair, observations)
loss_mask         [T]                          uint8     1 on ids the sampler sampled, else 0
logprobs          [T]                          float32   sampler log-prob of token i (0 where mask 0)
versions          [T]                          int32     weight version that sampled token i (-1 where
                                                         mask 0)
turn_offsets      [turns, 2]                   int32     [start, end) of each turn's sampled span
routed_experts    [T - 1, layers, top_k]       uint8/16  experts chosen for input position i at each
                                                         MoE layer; the last token has no row (it was
                                                         never fed back to the sampler)
================  ===========================  ========  =============================================

Decoding gives numpy views over the received frame (zero-copy) and validates every invariant;
a message that breaks one raises :class:`TrajectoryError` naming the field.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

SCHEMA_VERSION = 1
"""Version of the wire schema; a message with another version is refused, never mis-read."""


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
    """One finished episode, aligned token by token (see the module docstring for shapes).

    ``tests`` holds ``(test name, passed)`` pairs from the verifier; ``reward`` is the number of
    tests passed (dense reward); ``resolved`` means every test passed and there was at least one.
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
    trajectory_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    started_at: float = 0.0
    finished_at: float = field(default_factory=time.time)
    schema_version: int = SCHEMA_VERSION

    @property
    def num_tokens(self) -> int:
        """Tokens in the stream (T)."""
        return int(self.token_ids.shape[0])

    @property
    def min_version(self) -> int:
        """Oldest weight version among the sampled tokens (staleness is measured from it)."""
        sampled = self.versions[self.loss_mask.astype(bool)]
        return int(sampled.min()) if sampled.size else -1


_ARRAYS = {
    # name: (allowed dtypes, ndim)
    "token_ids": (("<u4",), 1),
    "loss_mask": (("|u1",), 1),
    "logprobs": (("<f4",), 1),
    "versions": (("<i4",), 1),
    "turn_offsets": (("<i4",), 2),
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
}


def _pack_array(a: np.ndarray) -> dict[str, Any]:
    a = np.ascontiguousarray(a)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return {"dtype": a.dtype.str, "shape": list(a.shape), "data": a.data}


def encode(traj: Trajectory) -> bytes:
    """Serialise a trajectory to one msgpack frame.

    Returns:
        bytes: a msgpack map with ``schema_version``, the scalar fields, ``tests`` as
        ``[[name, passed], ...]`` and each array as ``{"dtype", "shape", "data"}`` raw bytes.
    """
    msg: dict[str, Any] = {"schema_version": traj.schema_version}
    for name in _SCALARS:
        msg[name] = getattr(traj, name)
    msg["verifier_error"] = traj.verifier_error
    msg["tests"] = [[str(n), bool(p)] for n, p in traj.tests]
    want = {
        "token_ids": np.uint32,
        "loss_mask": np.uint8,
        "logprobs": np.float32,
        "versions": np.int32,
        "turn_offsets": np.int32,
        "routed_experts": experts_dtype(traj.num_experts),
    }
    for name, dt in want.items():
        msg[name] = _pack_array(np.asarray(getattr(traj, name), dtype=dt))
    return msgpack.packb(msg, use_bin_type=True)


def _unpack_array(msg: dict, name: str) -> np.ndarray:
    dtypes, ndim = _ARRAYS[name]
    spec = msg.get(name)
    if not isinstance(spec, dict):
        raise TrajectoryError(name, "missing or not an array map {dtype, shape, data}")
    dt, shape, data = spec.get("dtype"), spec.get("shape"), spec.get("data")
    if dt not in dtypes:
        raise TrajectoryError(name, f"dtype {dt!r} is not one of {dtypes}")
    if not isinstance(shape, list) or len(shape) != ndim or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise TrajectoryError(name, f"shape {shape!r} is not {ndim} non-negative ints")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TrajectoryError(name, "data is not raw bytes")
    dtype = np.dtype(dt)
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(data) != expected:
        raise TrajectoryError(name, f"{len(data)} bytes for shape {shape} of {dt} (expected {expected})")
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def decode(frame: bytes | memoryview, *, num_experts: int | None = None, num_layers: int | None = None,
           top_k: int | None = None, max_version: int | None = None) -> Trajectory:
    """Decode and validate one msgpack frame (arrays are read-only numpy views over ``frame``).

    Args:
        frame: the bytes received from the socket.
        num_experts, num_layers, top_k: the learner's model shape; when given, routed experts must
            match it.
        max_version: the learner's current weight version; no token may claim a newer one.

    Raises:
        TrajectoryError: naming the first field that is missing, mistyped or inconsistent,
            including a ``schema_version`` other than :data:`SCHEMA_VERSION`.
    """
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise TrajectoryError("<frame>", f"not a msgpack message ({type(e).__name__}: {e})") from None
    if not isinstance(msg, dict):
        raise TrajectoryError("<frame>", f"top level is {type(msg).__name__}, expected a map")
    sv = msg.get("schema_version")
    if sv != SCHEMA_VERSION:
        raise TrajectoryError("schema_version", f"message has schema {sv!r}, this learner reads schema {SCHEMA_VERSION}")
    kw: dict[str, Any] = {}
    for name, typ in _SCALARS.items():
        v = msg.get(name)
        if typ is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
            raise TrajectoryError(name, f"expected {typ.__name__}, got {type(v).__name__}")
        kw[name] = v
    ve = msg.get("verifier_error")
    if ve is not None and not isinstance(ve, str):
        raise TrajectoryError("verifier_error", "expected a string or nil")
    tests = msg.get("tests")
    if not isinstance(tests, list) or not all(
        isinstance(t, list) and len(t) == 2 and isinstance(t[0], str) and isinstance(t[1], bool) for t in tests
    ):
        raise TrajectoryError("tests", "expected a list of [name: str, passed: bool]")
    arrays = {name: _unpack_array(msg, name) for name in _ARRAYS}
    traj = Trajectory(**kw, **arrays, tests=[(n, p) for n, p in tests], verifier_error=ve, schema_version=sv)
    validate(traj, num_experts=num_experts, num_layers=num_layers, top_k=top_k, max_version=max_version)
    return traj


def validate(traj: Trajectory, *, num_experts: int | None = None, num_layers: int | None = None,
             top_k: int | None = None, max_version: int | None = None) -> None:
    """Check every alignment invariant of a trajectory (see the module docstring).

    Raises:
        TrajectoryError: naming the first field that breaks an invariant.
    """
    T = traj.num_tokens
    if T < 2:
        raise TrajectoryError("token_ids", f"{T} tokens; a trajectory needs a prompt and a sampled token")
    for name in ("loss_mask", "logprobs", "versions"):
        n = getattr(traj, name).shape[0]
        if n != T:
            raise TrajectoryError(name, f"length {n} != token_ids length {T}")
    mask = traj.loss_mask
    if mask.size and mask.max() > 1:
        raise TrajectoryError("loss_mask", "values must be 0 or 1")
    if not mask.any():
        raise TrajectoryError("loss_mask", "no sampled token in the trajectory")
    if mask[0]:
        raise TrajectoryError("loss_mask", "the first token cannot be sampled (there is no prompt)")
    lp = traj.logprobs[mask.astype(bool)]
    if not np.all(np.isfinite(lp)) or np.any(lp > 1e-4):
        raise TrajectoryError("logprobs", "sampled log-probs must be finite and <= 0")
    v = traj.versions[mask.astype(bool)]
    if v.min() < 0:
        raise TrajectoryError("versions", "a sampled token has a negative weight version")
    if max_version is not None and v.max() > max_version:
        raise TrajectoryError("versions", f"version {int(v.max())} is ahead of the learner's {max_version}")
    off = traj.turn_offsets
    if off.ndim != 2 or off.shape[1] != 2 or off.shape[0] == 0:
        raise TrajectoryError("turn_offsets", f"shape {off.shape} is not [turns >= 1, 2]")
    flat = off.reshape(-1).astype(np.int64)
    if np.any(flat[1:] < flat[:-1]) or flat[0] < 1 or flat[-1] > T or np.any(off[:, 1] <= off[:, 0]):
        raise TrajectoryError("turn_offsets", "spans must be non-empty, increasing and inside [1, T]")
    in_turn = np.zeros(T, dtype=bool)
    for s, e in off:
        in_turn[s:e] = True
    if np.any(mask.astype(bool) & ~in_turn):
        raise TrajectoryError("loss_mask", "a sampled token lies outside every turn span")
    re = traj.routed_experts
    if re.ndim != 3 or re.shape[0] != T - 1:
        raise TrajectoryError("routed_experts", f"shape {re.shape} must be [T-1={T - 1}, layers, top_k]")
    if num_layers is not None and re.shape[1] != num_layers:
        raise TrajectoryError("routed_experts", f"{re.shape[1]} layers, the model has {num_layers}")
    if top_k is not None and re.shape[2] != top_k:
        raise TrajectoryError("routed_experts", f"top_k {re.shape[2]}, the model routes to {top_k}")
    ne = num_experts if num_experts is not None else traj.num_experts
    if traj.num_experts != ne:
        raise TrajectoryError("num_experts", f"{traj.num_experts}, the model has {ne}")
    if re.size and int(re.max()) >= ne:
        raise TrajectoryError("routed_experts", f"expert id {int(re.max())} >= num_experts {ne}")
    if not (0 <= traj.passed <= traj.total):
        raise TrajectoryError("passed", f"{traj.passed} passed of {traj.total} tests")
    if traj.resolved and not (traj.total > 0 and traj.passed == traj.total):
        raise TrajectoryError("resolved", "resolved requires every test passed and at least one test")
