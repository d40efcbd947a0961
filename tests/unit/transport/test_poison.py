"""Poison trajectories: checked at receipt against the run's own facts, REJected with a reason,
counted by reason, quarantined in bounded space, never trained; a poisoned receive log replays
without a crash; a trajectory that still makes a step fail is quarantined and the step retried.

(tests/e2e/test_service_poison.py sends the same poison to a real ``t1async launch``.)"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading

import numpy as np
import pytest
import zmq

import t1async.transport.inbox as inbox_module
from t1async.actors.learner import Learner
from t1async.config import ConfigError, LearnerConfig, TransportConfig, WeightSyncConfig, load_config
from t1async.trajectory import Trajectory, TrajectoryError, encode
from t1async.transport.delivery import ReceiveLog
from t1async.transport.intake import RunFacts, check_trajectory, context_limit
from t1async.transport.quarantine import Quarantine
from t1async.transport.transport import ACK, PROTOCOL, REJECT
from tests.support.learner_fakes import MODEL, FakeController, synthetic

FACTS = RunFacts(vocab_size=MODEL.vocab_size, num_experts=MODEL.num_experts, num_layers=MODEL.num_hidden_layers,
                 top_k=MODEL.num_experts_per_tok)


def poisoned(kind: str, seed: int = 1) -> Trajectory:
    """A trajectory of tests/unit/learner/test_learner.py with one fault of ``kind``; ``ok``: none."""
    t = synthetic(version=0, seed=seed, reward=1.0)
    if kind == "token":
        ids = t.token_ids.copy()
        ids[15] = MODEL.vocab_size  # one past the embedding (a sampled position)
        t.token_ids = ids
    elif kind == "reward":
        t.reward = -1e30
    elif kind == "reward_high":
        t.reward, t.passed, t.total = 5.0, 2, 2
        t.tests, t.resolved = [("a", True), ("b", True)], True
    elif kind == "reward_vs_tests":
        t.reward = 2.0  # 1 of 2 tests passed
    elif kind == "tests":
        t.tests = [("a", True)]  # total says 2
    elif kind == "resolved":
        t.reward, t.passed, t.tests = 2.0, 2, [("a", True), ("b", True)]  # resolved stays False
    elif kind == "experts_repeat":
        re = t.routed_experts.copy()
        re[3, 1] = [2, 2]
        t.routed_experts = re
    elif kind == "logprob_nan":
        lp = t.logprobs.copy()
        lp[2] = np.nan  # off the loss mask: decode's own check looks only at sampled positions
        t.logprobs = lp
    elif kind != "ok":
        raise ValueError(kind)
    t.trajectory_id = f"{kind}-{seed}"
    return t


@pytest.mark.parametrize("kind,field", [("token", "token_ids"), ("reward", "reward"), ("reward_high", "reward"),
                                        ("reward_vs_tests", "reward"), ("tests", "total"), ("resolved", "resolved"),
                                        ("experts_repeat", "routed_experts"), ("logprob_nan", "logprobs")])
def test_intake_check_names_the_field_at_fault(kind, field):
    check_trajectory(poisoned("ok"), FACTS, max_version=0)
    with pytest.raises(TrajectoryError) as e:
        check_trajectory(poisoned(kind), FACTS, max_version=0)
    assert e.value.field == field


def test_intake_check_knows_the_run_not_only_the_frame():
    t = poisoned("ok")
    with pytest.raises(TrajectoryError, match="never published"):
        check_trajectory(synthetic(version=3, seed=1), FACTS, max_version=2)
    with pytest.raises(TrajectoryError, match="model.num_experts 3"):
        check_trajectory(t, dataclasses.replace(FACTS, num_experts=3))
    with pytest.raises(TrajectoryError, match="top-1"):
        check_trajectory(t, dataclasses.replace(FACTS, top_k=1))
    t.verifier_error, t.reward, t.passed, t.tests = "verifier timed out", 2.0, 2, [("a", True), ("b", True)]
    check_trajectory(t, dataclasses.replace(FACTS, reward="binary"))  # not resolved: its verifier failed
    with pytest.raises(ValueError, match="learner.reward"):
        RunFacts(vocab_size=8, num_experts=2, num_layers=1, top_k=1, reward="shaped")


def test_intake_refuses_a_trajectory_longer_than_the_model_or_the_run_holds():
    """Issue 42: 16,384 tokens against a context of 8,192 were ACKed and stalled the learner."""
    t = synthetic(version=0, seed=1, T=40)
    check_trajectory(t, dataclasses.replace(FACTS, max_tokens=40))  # exactly the context: trained
    with pytest.raises(TrajectoryError, match="40 tokens, more than the 39") as e:
        check_trajectory(t, dataclasses.replace(FACTS, max_tokens=39))
    assert e.value.field == "length"
    assert context_limit(8192) == 8192 and context_limit(8192, 4096) == 4096 and context_limit(8192, 16384) == 8192
    with pytest.raises(ValueError, match="max_tokens"):
        dataclasses.replace(FACTS, max_tokens=-1)


def test_quarantine_keeps_a_capped_prefix_with_metadata_and_evicts_the_oldest(tmp_path):
    q = Quarantine(tmp_path / "q", prefix_bytes=1000, max_bytes=3000, max_files=10, fsync=False)
    big = np.random.default_rng(0).bytes(3 << 20)  # a 3 MB garbage message
    assert q.put(big, reason="<frame>", error="not a frame", key="k0") == 0
    meta = json.loads((tmp_path / "q" / "000001.json").read_text())
    assert (tmp_path / "q" / "000001.prefix").read_bytes() == big[:1000]
    assert meta["size"] == len(big) and meta["sha256"] == hashlib.sha256(big).hexdigest()
    assert meta["reason"] == "<frame>" and meta["key"] == "k0" and meta["prefix_bytes"] == 1000 and meta["time"] > 0
    evicted = sum(q.put(big, reason="<frame>", error="x" * 500, key=f"k{i}") for i in range(1, 5))
    on_disk = sum(p.stat().st_size for p in (tmp_path / "q").iterdir())
    assert on_disk <= 3000 and on_disk == q.nbytes and evicted == q.evicted == 5 - len(q) > 0
    assert not (tmp_path / "q" / "000001.json").exists() and (tmp_path / "q" / "000005.json").exists()
    assert q.put(big, reason="<frame>", error="x" * 5000, key="k9") == 1 and q.evicted == evicted + 1  # alone too big
    again = Quarantine(tmp_path / "q", prefix_bytes=1000, max_bytes=3000, max_files=1, fsync=False)  # a resume
    assert again.nbytes == on_disk and again.put(b"x", reason="r", error="e") == len(q)
    assert (tmp_path / "q" / "000006.json").exists()  # numbering continues after the earlier life's
    assert Quarantine(tmp_path / "n", max_files=0).put(big, reason="r", error="e") == 1
    assert not (tmp_path / "n").exists()


def test_quarantine_bounds_are_config_keys():
    cfg = load_config(None, ["transport.quarantine_prefix_bytes=0", "transport.quarantine_max_bytes=1000"])
    assert cfg.transport.quarantine_max_bytes == 1000 and cfg.transport.quarantine_max_files == 1000
    with pytest.raises(ConfigError, match="transport.quarantine_max_files"):
        load_config(None, ["transport.quarantine_max_files=-1"])


def _learner(tmp_path, max_context_tokens: int = 0, model=MODEL, **kw) -> Learner:
    cfg = LearnerConfig(**{"max_steps": 1, "batch_size": 2, "batch_timeout_s": 60, "publish_every": 100,
                           "episodes_per_step": 0, **kw})
    return Learner(cfg, model, TransportConfig(curve=False, log_fsync="never", quarantine_prefix_bytes=512), WeightSyncConfig(),
                   str(tmp_path), seed=0, max_context_tokens=max_context_tokens)


@pytest.mark.parametrize("context,run_max", [(48, 0), (8192, 48)])
def test_a_trajectory_past_the_context_is_rejected_at_receipt_counted_and_never_stored(tmp_path, context, run_max):
    """The model's context (``model.max_position_embeddings``) and the run's ``env.max_context_tokens``
    both bound what intake takes: longer is REJ ``length``, counted, quarantined, not in the receive log."""
    learner = _learner(tmp_path, max_context_tokens=run_max,
                       model=dataclasses.replace(MODEL, max_position_embeddings=context))
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(learner.endpoint())
    try:
        long, fits = synthetic(version=0, seed=1, T=96), synthetic(version=0, seed=2, T=48)
        long.trajectory_id, fits.trajectory_id = "long-1", "fits-1"
        for t in (long, fits):
            sock.send_multipart([PROTOCOL, t.trajectory_id.encode(), encode(t)])
        replies = {}
        while len(replies) < 2 and sock.poll(20_000):
            kind, key, reason = sock.recv_multipart()
            replies[key.decode()] = (kind, reason.decode())
        assert replies["fits-1"] == (ACK, "")
        assert replies["long-1"][0] == REJECT and "96 tokens, more than the 48" in replies["long-1"][1]
        assert learner.inbox.queue.get(5.0).trajectory_id == "fits-1" and learner.inbox.queue.qsize() == 0
        st = learner.status()
        assert st["rejected_by"] == {"length": 1} and st["rejected"] == 1 and st["received"] == 1
        assert "long-1" not in learner.inbox.log and "fits-1" in learner.inbox.log
    finally:
        sock.close()
        learner.close()


def test_bad_token_and_huge_negative_reward_are_rejected_at_receipt_never_queued(tmp_path):
    learner = _learner(tmp_path)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(learner.endpoint())
    try:
        sent = [poisoned("token"), poisoned("reward"), poisoned("ok")]
        for t in sent:
            sock.send_multipart([PROTOCOL, t.trajectory_id.encode(), encode(t)])
        replies = {}
        while len(replies) < 3 and sock.poll(20_000):
            kind, key, reason = sock.recv_multipart()
            replies[key.decode()] = (kind, reason.decode())
        assert replies["ok-1"] == (ACK, "")
        assert replies["token-1"][0] == REJECT and "outside the vocabulary of 256" in replies["token-1"][1]
        assert replies["reward-1"][0] == REJECT and "-1e+30 is outside [0, 2]" in replies["reward-1"][1]
        assert learner.inbox.queue.get(5.0).trajectory_id == "ok-1" and learner.inbox.queue.qsize() == 0
        st = learner.status()
        assert st["rejected"] == 2 and st["rejected_by"] == {"token_ids": 1, "reward": 1} and st["received"] == 1
        assert "token-1" not in learner.inbox.log  # never stored: a resume cannot replay it
        metas = [json.loads(p.read_text()) for p in sorted((tmp_path / "quarantine").glob("*.json"))]
        assert [m["key"] for m in metas] == ["token-1", "reward-1"] and all(m["prefix_bytes"] == 512 for m in metas)
        assert all(p.stat().st_size == 512 for p in (tmp_path / "quarantine").glob("*.prefix"))
        assert metas[0]["size"] == len(encode(sent[0])) > 512
    finally:
        sock.close()
        learner.close()


def test_a_large_garbage_message_is_quarantined_as_a_capped_prefix_not_whole(tmp_path):
    """A 3 MB message that is no trajectory used to be stored whole in quarantine/ (a 300 MB one
    became a 300 MB file); with the default bounds only its first 64 KiB and its metadata stay."""
    learner = Learner(LearnerConfig(max_steps=0, episodes_per_step=0), MODEL, TransportConfig(curve=False, log_fsync="never"),
                      WeightSyncConfig(), str(tmp_path), seed=0)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(learner.endpoint())
    try:
        junk = np.random.default_rng(1).bytes(3 << 20)
        sock.send_multipart([PROTOCOL, b"junk-1", junk])
        assert sock.poll(20_000) and sock.recv_multipart()[:2] == [REJECT, b"junk-1"]
        kept = sum(p.stat().st_size for p in (tmp_path / "quarantine").iterdir())
        assert kept < TransportConfig(curve=False).quarantine_prefix_bytes + 4096
        meta = json.loads(next((tmp_path / "quarantine").glob("*.json")).read_text())
        assert meta["size"] == len(junk) and meta["sha256"] == hashlib.sha256(junk).hexdigest()
    finally:
        sock.close()
        learner.close()


def _write_log(run_dir, trajs: list[Trajectory]) -> None:
    log = ReceiveLog(run_dir / "receive_log", fsync="never")
    for t in trajs:
        log.append(t.trajectory_id, encode(t))
    log.close()


def test_resume_over_a_poisoned_receive_log_skips_the_bad_record_and_trains_the_rest(tmp_path):
    """A receive log holding a record the step cannot take (an id past the vocabulary, stored by a
    learner that did not check it) used to end every resume with IndexError; now the replay
    refuses it (quarantined, counted, never trained) and a later resume does not even replay it."""
    good = [poisoned("ok", seed=s) for s in (1, 2, 3, 4)]
    _write_log(tmp_path, [good[0], poisoned("token", seed=9), good[1], poisoned("reward", seed=8), good[2], good[3]])
    learner = _learner(tmp_path, resume=True)
    try:
        st = learner.run(FakeController())
        assert st["step"] == 1 and st["trained"] == 2 and st["rejected_by"] == {"token_ids": 1, "reward": 1}
        assert {m["source"] for m in (json.loads(p.read_text()) for p in (tmp_path / "quarantine").glob("*.json"))} == {"replay"}
    finally:
        learner.close()
    assert (tmp_path / "quarantine" / "ids.txt").read_text().split() == ["token-9", "reward-8"]
    # killed before its next checkpoint: the ids ledger alone keeps the next life from replaying them
    for ckpt in (tmp_path / "checkpoints").glob("step_*"):
        for f in ckpt.iterdir():
            f.unlink()
        ckpt.rmdir()
    again = _learner(tmp_path, resume=True, resume_from_scratch=True)  # (the checkpoints are gone on purpose)
    try:
        st = again.run(FakeController())
        assert st["step"] == 1 and st["rejected"] == 0 and st["trained"] == 2 and st["replayed"] >= 2
    finally:
        again.close()


def test_a_trajectory_that_makes_a_step_fail_is_quarantined_and_the_step_retried_without_it(tmp_path, monkeypatch):
    """A bug of ours lets a poison trajectory through the intake check: the step raises, the probe
    blames that one trajectory, it is quarantined (``step_failed``) and the step trains the rest."""
    monkeypatch.setattr(inbox_module, "check_trajectory", lambda *a, **k: None)  # the check "misses" it
    bad, ok = poisoned("token", seed=9), poisoned("ok", seed=1)
    _write_log(tmp_path, [bad, ok])
    learner = _learner(tmp_path, resume=True, max_steps=1)
    ctl = FakeController()
    try:
        result: dict = {}
        th = threading.Thread(target=lambda: result.update(learner.run(ctl)))
        th.start()
        th.join(timeout=60)
        assert not th.is_alive()
        assert result["step"] == 1 and result["trained"] == 1 and result["rejected_by"] == {"step_failed": 1}
        assert "token-9" in learner.loop._consumed and learner.loop._consumed.recent["token-9"] == -1
        assert [d.split(":")[0] for d in ctl.discarded] == ["quarantined"]  # its admission slot returned
        meta = json.loads(next((tmp_path / "quarantine").glob("*.json")).read_text())
        assert meta["source"] == "step" and "IndexError" in meta["error"] and meta["key"] == "token-9"
    finally:
        learner.close()
    assert (tmp_path / "quarantine" / "ids.txt").read_text().split() == ["token-9"]
