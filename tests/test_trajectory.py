"""Wire format: round trips, zero-copy decode, and a typed error for each broken invariant."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from t1async.trajectory import SCHEMA_VERSION, Trajectory, TrajectoryError, decode, encode, experts_dtype


def make_traj(T: int = 12, layers: int = 3, top_k: int = 2, num_experts: int = 8, seed: int = 0) -> Trajectory:
    rng = np.random.default_rng(seed)
    mask = np.zeros(T, dtype=np.uint8)
    mask[4:7] = 1
    mask[9:T] = 1
    lp = np.where(mask == 1, -rng.random(T), 0.0).astype(np.float32)
    versions = np.where(mask == 1, 3, -1).astype(np.int32)
    return Trajectory(
        task="t", actor_id=1, token_ids=rng.integers(0, 4096, T).astype(np.uint32), loss_mask=mask, logprobs=lp,
        versions=versions, turn_offsets=np.array([[4, 7], [9, T]], dtype=np.int32),
        routed_experts=rng.integers(0, num_experts, (T - 1, layers, top_k)).astype(np.uint8), num_experts=num_experts,
        reward=2.0, passed=2, total=3, resolved=False, finish_reason="max_turns", tests=[("a", True), ("b[x y]", True), ("c", False)],
    )


def test_round_trip_preserves_every_field():
    t = make_traj()
    d = decode(encode(t), num_experts=8, num_layers=3, top_k=2, max_version=3)
    for name in ("token_ids", "loss_mask", "logprobs", "versions", "turn_offsets", "routed_experts"):
        np.testing.assert_array_equal(getattr(d, name), getattr(t, name))
    assert (d.task, d.actor_id, d.reward, d.passed, d.total, d.resolved, d.tests) == (
        t.task, t.actor_id, t.reward, t.passed, t.total, t.resolved, t.tests)
    assert d.trajectory_id == t.trajectory_id and d.min_version == 3


def test_decode_is_zero_copy_view_over_frame():
    frame = encode(make_traj(T=64))
    d = decode(frame)
    assert not d.token_ids.flags.owndata and not d.token_ids.flags.writeable


def test_arrays_travel_as_raw_bytes_not_lists():
    msg = msgpack.unpackb(encode(make_traj()), raw=False)
    assert isinstance(msg["token_ids"]["data"], bytes)
    assert msg["routed_experts"]["dtype"] == "|u1"
    assert msg["schema_version"] == SCHEMA_VERSION


def test_experts_dtype_is_smallest_unsigned():
    assert experts_dtype(8) == np.uint8 and experts_dtype(256) == np.uint8
    assert experts_dtype(257) == np.uint16 and experts_dtype(70000) == np.uint32


def test_expert_id_zero_is_valid():
    t = make_traj()
    t.routed_experts[:] = 0
    assert decode(encode(t)).routed_experts.max() == 0


def _mutated(fn):
    msg = msgpack.unpackb(encode(make_traj()), raw=False)
    fn(msg)
    return msgpack.packb(msg, use_bin_type=True)


@pytest.mark.parametrize("field,mutate", [
    ("schema_version", lambda m: m.__setitem__("schema_version", 99)),
    ("loss_mask", lambda m: m["loss_mask"].__setitem__("data", b"\x02" * 12)),
    ("logprobs", lambda m: m["logprobs"].__setitem__("shape", [11])),
    ("routed_experts", lambda m: m["routed_experts"].__setitem__("shape", [12, 3, 2])),
    ("routed_experts", lambda m: m["routed_experts"].__setitem__("data", b"\x09" * (11 * 6))),
    ("turn_offsets", lambda m: m["turn_offsets"].__setitem__("data", np.array([[9, 12], [4, 7]], "<i4").tobytes())),
    ("token_ids", lambda m: m["token_ids"].__setitem__("dtype", "<f8")),
    ("reward", lambda m: m.__setitem__("reward", "high")),
    ("tests", lambda m: m.__setitem__("tests", [["a", 1]])),
])
def test_broken_invariants_raise_typed_error_naming_field(field, mutate):
    with pytest.raises(TrajectoryError) as e:
        decode(_mutated(mutate))
    assert e.value.field == field


def test_schema_mismatch_names_both_versions():
    with pytest.raises(TrajectoryError, match=r"schema 99.*schema 1"):
        decode(_mutated(lambda m: m.__setitem__("schema_version", 99)))


def test_version_ahead_of_learner_is_refused():
    with pytest.raises(TrajectoryError, match="ahead"):
        decode(encode(make_traj()), max_version=2)


def test_model_shape_mismatch_is_refused():
    with pytest.raises(TrajectoryError):
        decode(encode(make_traj()), num_layers=4)


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=300))
def test_garbage_frames_raise_only_typed_errors(data):
    with pytest.raises(TrajectoryError):
        decode(data)


@settings(max_examples=40, deadline=None)
@given(T=st.integers(10, 200), layers=st.integers(1, 6), top_k=st.integers(1, 4), ne=st.sampled_from([2, 8, 300]),
       seed=st.integers(0, 1000))
def test_round_trip_property(T, layers, top_k, ne, seed):
    t = make_traj(T, layers, top_k, ne, seed)
    t.routed_experts = t.routed_experts.astype(experts_dtype(ne))
    d = decode(encode(t), num_experts=ne)
    np.testing.assert_array_equal(d.routed_experts, t.routed_experts)
    np.testing.assert_array_equal(d.logprobs, t.logprobs)
