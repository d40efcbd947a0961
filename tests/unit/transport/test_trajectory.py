"""Wire format: round trips of every field, zero-copy aligned decode, typed errors, SGLang routed experts."""

from __future__ import annotations

import base64
import struct

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from t1async.trajectory import (
    ALIGN,
    MAGIC,
    SCHEMA_VERSION,
    TURN_CUT_NOT_RUN,
    TURN_STATUS,
    Trajectory,
    TrajectoryError,
    decode,
    encode,
    experts_dtype,
    routed_experts_from_sglang,
)
from tests.support.trajectories import make_traj

ARRAYS = ("token_ids", "loss_mask", "logprobs", "versions", "turn_offsets", "turn_status", "routed_experts")
SCALARS = ("trajectory_id", "task", "actor_id", "num_experts", "reward", "passed", "total", "resolved", "finish_reason",
           "started_at", "finished_at", "verifier_error", "tests", "drift_tokens", "template_mismatches", "agent",
           "schema_version")


def split(frame: bytes) -> tuple[dict, bytes]:
    """(header map, data section) of a frame."""
    _, hlen = struct.unpack_from("<4sI", frame)
    start = -(-(8 + hlen) // ALIGN) * ALIGN
    return msgpack.unpackb(frame[8:8 + hlen], raw=False), frame[start:]


def join(header: dict, data: bytes) -> bytes:
    head = msgpack.packb(header, use_bin_type=True)
    start = -(-(8 + len(head)) // ALIGN) * ALIGN
    return struct.pack("<4sI", MAGIC, len(head)) + head + bytes(start - 8 - len(head)) + data


def assert_same(d: Trajectory, t: Trajectory) -> None:
    for name in ARRAYS:
        np.testing.assert_array_equal(getattr(d, name), getattr(t, name), err_msg=name)
        assert getattr(d, name).dtype == np.asarray(getattr(t, name)).dtype, name
    for name in SCALARS:
        assert getattr(d, name) == getattr(t, name), name


def test_round_trip_preserves_every_field():
    t = make_traj()
    d = decode(encode(t), num_experts=8, num_layers=3, top_k=2, max_version=3)
    assert_same(d, t)
    assert d.min_version == 3
    assert d.turn_status.tolist() == [TURN_CUT_NOT_RUN, 0]


def test_turn_status_defaults_to_normal_and_encode_refuses_codes_that_would_wrap():
    t = make_traj()
    t.turn_status = None
    t.__post_init__()
    assert t.turn_status.dtype == np.uint8 and t.turn_status.tolist() == [0, 0]
    t.turn_status = np.array([0, 257], dtype=np.int64)  # would wrap to 1 (length_cut) in uint8
    with pytest.raises(TrajectoryError) as e:
        encode(t)
    assert e.value.field == "turn_status"


def test_decode_is_an_aligned_zero_copy_view_over_the_frame():
    frame = encode(make_traj(T=64))
    d = decode(frame)
    base = np.frombuffer(frame, np.uint8).ctypes.data
    for name in ARRAYS:
        a = getattr(d, name)
        assert not a.flags.owndata and not a.flags.writeable, name
        assert (a.ctypes.data - base) % ALIGN == 0, name  # 64-byte aligned relative to the frame
        assert base <= a.ctypes.data < base + len(frame), name


def test_arrays_travel_as_raw_bytes_not_lists_and_experts_use_the_smallest_dtype():
    header, data = split(encode(make_traj()))
    assert header["schema_version"] == SCHEMA_VERSION
    assert header["arrays"]["routed_experts"]["dtype"] == "|u1"
    assert header["arrays"]["token_ids"] == {"dtype": "<u4", "shape": [12], "offset": 0, "nbytes": 48}
    assert all(isinstance(v, (int, float, str, bool, list, type(None))) for k, v in header.items() if k != "arrays")


def test_experts_dtype_is_smallest_unsigned():
    assert experts_dtype(8) == np.uint8 and experts_dtype(256) == np.uint8
    assert experts_dtype(257) == np.uint16 and experts_dtype(70000) == np.uint32


def test_expert_id_zero_is_valid_and_all_ids_of_a_full_dtype_pass():
    t = make_traj()
    t.routed_experts[:] = 0
    assert decode(encode(t)).routed_experts.max() == 0
    full = make_traj(num_experts=256)
    full.routed_experts[:] = 255
    assert decode(encode(full), num_experts=256).routed_experts.max() == 255


def test_encode_refuses_ids_that_would_wrap():
    t = make_traj()
    t.routed_experts = t.routed_experts.astype(np.int32)
    t.routed_experts[0, 0, 0] = 8
    with pytest.raises(TrajectoryError, match="expert ids span"):
        encode(t)
    t.routed_experts[0, 0, 0] = -1
    with pytest.raises(TrajectoryError) as e:
        encode(t)
    assert e.value.field == "routed_experts"


def _mutated(fn) -> bytes:
    header, data = split(encode(make_traj()))
    data = bytearray(data)
    fn(header, data)
    return join(header, bytes(data))


def _set_array(header, data, name, values):
    spec = header["arrays"][name]
    raw = np.asarray(values, dtype=spec["dtype"]).tobytes()
    data[spec["offset"]:spec["offset"] + len(raw)] = raw


@pytest.mark.parametrize("field,mutate", [
    ("schema_version", lambda h, d: h.__setitem__("schema_version", 99)),
    ("loss_mask", lambda h, d: _set_array(h, d, "loss_mask", [2] * 12)),
    ("loss_mask", lambda h, d: _set_array(h, d, "loss_mask", [1] + [0] * 11)),
    ("logprobs", lambda h, d: h["arrays"]["logprobs"].__setitem__("shape", [11])),
    ("logprobs", lambda h, d: _set_array(h, d, "logprobs", [np.nan] * 12)),
    ("versions", lambda h, d: _set_array(h, d, "versions", [-5] * 12)),
    ("routed_experts", lambda h, d: h["arrays"]["routed_experts"].__setitem__("shape", [12, 3, 2])),
    ("routed_experts", lambda h, d: _set_array(h, d, "routed_experts", [9] * 66)),
    ("routed_experts", lambda h, d: h["arrays"]["routed_experts"].update(dtype="<u2", nbytes=132)),
    ("routed_experts", lambda h, d: h["arrays"]["routed_experts"].__setitem__("offset", 1 << 20)),
    ("turn_offsets", lambda h, d: _set_array(h, d, "turn_offsets", [[9, 12], [4, 7]])),
    ("turn_offsets", lambda h, d: _set_array(h, d, "turn_offsets", [[4, 7], [9, 13]])),
    ("turn_status", lambda h, d: _set_array(h, d, "turn_status", [0, 12])),  # an unknown code (6-11 are tool-call errors)
    ("turn_status", lambda h, d: h["arrays"]["turn_status"].update(shape=[1], nbytes=1)),  # not one per turn
    ("turn_status", lambda h, d: h["arrays"]["turn_status"].update(dtype="<u2", nbytes=4)),
    ("turn_status", lambda h, d: h["arrays"].pop("turn_status")),
    ("token_ids", lambda h, d: h["arrays"]["token_ids"].__setitem__("dtype", "<f8")),
    ("token_ids", lambda h, d: h["arrays"]["token_ids"].__setitem__("offset", 3)),
    ("reward", lambda h, d: h.__setitem__("reward", "high")),
    ("reward", lambda h, d: h.__setitem__("reward", float("inf"))),
    ("tests", lambda h, d: h.__setitem__("tests", [["a", 1]])),
    ("trajectory_id", lambda h, d: h.__setitem__("trajectory_id", "")),
    ("actor_id", lambda h, d: h.__setitem__("actor_id", -1)),
    ("actor_id", lambda h, d: h.__setitem__("actor_id", True)),
    ("passed", lambda h, d: h.__setitem__("passed", 4)),
    ("resolved", lambda h, d: h.__setitem__("resolved", True)),
    ("finished_at", lambda h, d: h.__setitem__("finished_at", 0.5)),
    ("drift_tokens", lambda h, d: h.__setitem__("drift_tokens", -1)),
    ("arrays", lambda h, d: h.__setitem__("arrays", [])),
    ("verifier_error", lambda h, d: h.__setitem__("verifier_error", 3)),
    ("agent", lambda h, d: h.__setitem__("agent", 3)),
    ("agent", lambda h, d: h.__setitem__("agent", "")),
    ("agent", lambda h, d: h.__setitem__("agent", "a\nb")),
])
def test_broken_invariants_raise_typed_error_naming_field(field, mutate):
    with pytest.raises(TrajectoryError) as e:
        decode(_mutated(mutate))
    assert e.value.field == field


def test_the_agent_travels_and_a_header_without_it_reads_builtin():
    """``agent`` (who drove the episode) round-trips; a frame from a sender that predates it decodes as builtin."""
    t = make_traj()
    t.agent = "mini-swe-agent"
    assert decode(encode(t)).agent == "mini-swe-agent"
    header, data = split(encode(t))
    del header["agent"]
    assert decode(join(header, data)).agent == "builtin"


def test_schema_mismatch_names_both_versions():
    with pytest.raises(TrajectoryError, match=rf"schema 99.*schema {SCHEMA_VERSION}.*newer"):
        decode(_mutated(lambda h, d: h.__setitem__("schema_version", 99)))


def test_schema_1_message_is_refused_naming_both_versions():
    old = msgpack.packb({"schema_version": 1, "task": "t", "token_ids": {"dtype": "<u4", "shape": [1], "data": b"abcd"}})
    with pytest.raises(TrajectoryError, match=rf"schema 1, this learner reads schema {SCHEMA_VERSION}") as e:
        decode(old)
    assert e.value.field == "schema_version"


def test_version_ahead_of_learner_is_refused():
    with pytest.raises(TrajectoryError, match="ahead") as e:
        decode(encode(make_traj()), max_version=2)
    assert e.value.field == "versions"


def test_model_shape_mismatch_is_refused():
    for kw in ({"num_layers": 4}, {"top_k": 3}, {"num_experts": 16}):
        with pytest.raises(TrajectoryError):
            decode(encode(make_traj()), **kw)


def test_truncated_frames_raise_only_typed_errors():
    frame = encode(make_traj(T=40))
    header, data = split(frame)
    spec = header["arrays"]["routed_experts"]  # the last array; only zero padding follows it
    end = len(frame) - len(data) + spec["offset"] + spec["nbytes"]
    for n in range(0, end, 7):
        with pytest.raises(TrajectoryError):
            decode(frame[:n])
    assert decode(frame[:end]).num_tokens == 40


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=300))
def test_garbage_frames_raise_only_typed_errors(data):
    with pytest.raises(TrajectoryError):
        decode(data)
    with pytest.raises(TrajectoryError):
        decode(MAGIC + data)


@st.composite
def trajectories(draw) -> Trajectory:
    """Every field drawn: lengths, turns, dtypes of routed experts, unicode text, extreme scalars."""
    turns = draw(st.integers(1, 6))
    bounds = sorted(draw(st.lists(st.integers(1, 300), min_size=2 * turns, max_size=2 * turns, unique=True)))
    spans = [(bounds[2 * i], bounds[2 * i + 1]) for i in range(turns)]
    T = spans[-1][1]
    layers, top_k = draw(st.integers(1, 5)), draw(st.integers(1, 4))
    ne = draw(st.sampled_from([1, 2, 7, 8, 128, 255, 256, 257, 1000, 65536, 65537]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    mask = np.zeros(T, np.uint8)
    for s, e in spans:
        mask[s:e] = rng.integers(0, 2, e - s)
        mask[e - 1] = 1
    sampled = mask == 1
    lp = np.where(sampled, -rng.exponential(2.0, T), rng.standard_normal(T)).astype(np.float32)
    versions = np.where(sampled, rng.integers(0, 2**31 - 1, T), rng.integers(-5, 5, T)).astype(np.int32)
    passed_total = draw(st.tuples(st.integers(0, 50), st.integers(0, 50)).map(sorted))
    text = st.text(max_size=30)
    started = draw(st.floats(0, 2e9))
    return Trajectory(
        task=draw(text), actor_id=draw(st.integers(0, 2**63 - 1)),
        token_ids=rng.integers(0, 2**32 - 1, T, dtype=np.uint64).astype(np.uint32), loss_mask=mask, logprobs=lp,
        versions=versions, turn_offsets=np.array(spans, np.int32),
        turn_status=rng.choice(np.array(sorted(TURN_STATUS), np.uint8), turns),
        routed_experts=rng.integers(0, ne, (T - 1, layers, top_k)).astype(experts_dtype(ne)), num_experts=ne,
        reward=draw(st.floats(-1e6, 1e6)), passed=passed_total[0], total=passed_total[1],
        resolved=draw(st.booleans()) and passed_total[0] == passed_total[1] > 0,
        finish_reason=draw(st.sampled_from(["end_signal", "max_turns", "timeout", "context_full", ""])),
        tests=draw(st.lists(st.tuples(text, st.booleans()), max_size=5)), verifier_error=draw(st.none() | text),
        trajectory_id=draw(st.text(st.characters(min_codepoint=33, max_codepoint=0x2FFF), min_size=1, max_size=64)
                           .filter(str.isprintable)),
        started_at=started, finished_at=started + draw(st.floats(0, 1e5)),
        drift_tokens=draw(st.integers(0, 1000)), template_mismatches=draw(st.integers(0, 1000)),
    )


@settings(max_examples=80, deadline=None)
@given(trajectories())
def test_round_trip_property_every_field(t):
    d = decode(encode(t), num_experts=t.num_experts, num_layers=t.routed_experts.shape[1],
               top_k=t.routed_experts.shape[2], max_version=int(t.versions[t.loss_mask == 1].max()))
    assert_same(d, t)


# ---- SGLang routed experts ----------------------------------------------------------------------
def _b64(a) -> str:
    return base64.b64encode(np.asarray(a, "<i4").tobytes()).decode()


def test_sglang_routed_experts_decode_to_the_wire_dtype_with_expert_zero_valid():
    ids = np.array([[[0, 1], [7, 0]], [[3, 0], [0, 0]], [[0, 0], [0, 2]]])  # rows = prompt 3 + output 1 - 1
    out = routed_experts_from_sglang(_b64(ids), rows=3, layers=2, top_k=2, num_experts=8)
    assert out.dtype == np.uint8 and out.shape == (3, 2, 2)
    np.testing.assert_array_equal(out, ids)
    raw = routed_experts_from_sglang(_b64(ids), rows=3, layers=2, top_k=2)
    assert raw.dtype == np.dtype("<i4")
    assert routed_experts_from_sglang("", rows=0, layers=2, top_k=2, num_experts=8).shape == (0, 2, 2)


@pytest.mark.parametrize("payload,rows,match", [
    (_b64(np.zeros((3, 2, 2))), 4, r"holds 3 rows.*exactly 4 rows"),
    (_b64(np.zeros((3, 2, 2))), 2, r"holds 3 rows.*exactly 2 rows"),
    (_b64(np.zeros(13)), 3, r"holds 3 rows \+ 1 ids"),
    (_b64(np.full((3, 2, 2), 8)), 3, r"expert id 8 >= num_experts 8"),
    (_b64(np.full((3, 2, 2), -1)), 3, r"negative expert id"),
    ("not base64!", 3, r"not base64"),
    (base64.b64encode(b"abcdef").decode(), 3, r"whole number of int32"),
    (_b64(np.zeros((3, 2, 2))), -1, r"rows -1"),
])
def test_sglang_routed_experts_edge_cases_raise_typed_errors(payload, rows, match):
    with pytest.raises(TrajectoryError, match=match) as e:
        routed_experts_from_sglang(payload, rows=rows, layers=2, top_k=2, num_experts=8)
    assert e.value.field == "routed_experts"
