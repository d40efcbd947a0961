"""The sender's spool with real files: slots are reused in place, frames read back exactly, and a
dead owner's files are adopted (or left alone when they are not spooled trajectories)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from t1async.trajectory import EncodedTrajectory, Trajectory, decode, encode
from t1async.transport.spool import Spool, _capacity


def _traj(T: int = 300, seed: int = 0) -> Trajectory:
    rng = np.random.default_rng(seed)
    mask = np.zeros(T, np.uint8)
    mask[T // 2:] = 1
    return Trajectory(task="t", actor_id=0, token_ids=rng.integers(0, 4096, T).astype(np.uint32), loss_mask=mask,
                      logprobs=np.where(mask == 1, -rng.random(T), 0).astype(np.float32),
                      versions=np.where(mask == 1, 0, -1).astype(np.int32),
                      turn_offsets=np.array([[T // 2, T]], np.int32),
                      routed_experts=rng.integers(0, 8, (T - 1, 2, 2)).astype(np.uint8), num_experts=8,
                      reward=1.0, passed=1, total=2, resolved=False, finish_reason="end_signal",
                      tests=[("a", True), ("b", False)], started_at=1.0, finished_at=2.0)


def _inode(path) -> int:
    return os.stat(path).st_ino


def test_acknowledged_file_is_overwritten_in_place_with_the_exact_new_frame(tmp_path):
    sp = Spool(tmp_path, free_slots=4)
    big, small = EncodedTrajectory(_traj(3000, seed=1)), encode(_traj(200, seed=2))
    e1 = sp.put("one", big.parts())
    assert bytes(sp.frame(e1)) == big.tobytes()
    inode = _inode(e1.path)
    assert sp.remove("one") and len(sp) == 0 and sp.nbytes == 0
    e2 = sp.put("two", small)  # smaller frame: the same file, longer than the frame
    assert _inode(e2.path) == inode and os.path.getsize(e2.path) >= len(small)
    assert bytes(sp.frame(e2)) == small  # no byte of the older, longer frame leaks in
    assert decode(sp.frame(e2)).num_tokens == 200
    assert sorted(p.name for p in sp.dir.iterdir()) == sorted(["lock", e2.path.name])
    sp.close()


def test_a_file_a_send_may_still_read_is_not_reused(tmp_path):
    sp = Spool(tmp_path, free_slots=4)
    e1 = sp.put("one", b"x" * 1000)
    view = sp.frame(e1)  # as a zero-copy send would hold it
    inode = _inode(e1.path)
    sp.remove("one", reuse=False)
    e2 = sp.put("two", b"y" * 1000)
    assert _inode(e2.path) != inode and bytes(view) == b"x" * 1000  # the old view still reads its own bytes
    sp.close()


def test_free_files_are_bounded_in_count_and_bytes(tmp_path):
    sp = Spool(tmp_path, free_slots=2, free_bytes=10 << 20)
    for i in range(4):
        sp.put(f"k{i}", b"z" * 100)
    for i in range(4):
        sp.remove(f"k{i}")
    assert len(list(sp.dir.glob("free-*"))) == 2
    sp2 = Spool(tmp_path / "b", free_slots=8, free_bytes=_capacity(3 << 20))
    for i in range(3):
        sp2.put(f"k{i}", b"z" * (3 << 20))
    for i in range(3):
        sp2.remove(f"k{i}")
    assert len(list(sp2.dir.glob("free-*"))) == 1  # a second 3.5 MiB file would pass free_bytes
    sp.close()
    sp2.close()
    assert not list(tmp_path.glob("*/free-*")) and not list(tmp_path.glob("b/*/free-*"))


def test_dead_owner_is_adopted_in_send_order_and_foreign_files_are_left(tmp_path):
    dead = Spool(tmp_path)
    frames = {f"k{i}": encode(_traj(100 + 50 * i, seed=i)) for i in range(3)}
    for k, f in frames.items():
        dead.put(k, f)
    dead.remove("k1")  # becomes a free file: never adopted
    foreign = dead.dir / "000000000099.notanumber.k9.traj"
    foreign.write_bytes(b"junk")
    dead_dir = dead.dir
    os.close(dead._lock_fd)  # the owner dies without close(): its lock goes with it  # noqa: SLF001
    sp = Spool(tmp_path)
    adopted = sp.adopt_orphans()
    assert [e.key for e in adopted] == ["k0", "k2"]
    assert [bytes(sp.frame(e)) for e in adopted] == [frames["k0"], frames["k2"]]
    assert foreign.exists() and dead_dir.exists()  # not ours to delete: a different version wrote it
    sp.close()


def test_keys_with_a_slash_or_nul_are_refused(tmp_path):
    sp = Spool(tmp_path)
    for bad in ("", "a/b", "a\x00b"):
        with pytest.raises(ValueError, match="spool key"):
            sp.put(bad, b"x")
    assert len(sp) == 0
    sp.close()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 200_000), st.booleans()), min_size=1, max_size=30))
def test_any_put_remove_sequence_reads_back_what_was_put(tmp_path_factory, ops):
    sp = Spool(tmp_path_factory.mktemp("s"), free_slots=3, free_bytes=1 << 20)
    live: dict[str, bytes] = {}
    for i, (k, n, remove) in enumerate(ops):
        key = f"k{k}"
        if remove and key in live:
            assert sp.remove(key)
            del live[key]
        else:
            live[key] = bytes([i % 251]) * n
            sp.put(key, [live[key][: n // 3], live[key][n // 3:]])
    assert len(sp) == len(live) and sp.nbytes == sum(map(len, live.values()))
    for key, data in live.items():
        assert bytes(sp.frame(sp._entries[key])) == data  # noqa: SLF001
    sp.close()
