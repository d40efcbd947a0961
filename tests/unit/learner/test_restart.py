"""Lossless learner restart: a restart makes nothing stale (t1async/learner/timeline.py)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from test_learner import MODEL, FakeController, synthetic

from t1async.actors.learner import Learner
from t1async.actors.sampler import EmbeddedSampler
from t1async.config import LearnerConfig, SamplerConfig, TransportConfig, WeightSyncConfig
from t1async.learner.timeline import TIMELINE_FILE, VersionTimeline
from t1async.trajectory import encode
from t1async.transport.transport import ZmqSender

CFG = LearnerConfig(max_steps=6, batch_size=1, publish_every=1, max_staleness=1, batch_timeout_s=5, lr=1e-3)


def test_timeline_maps_weight_versions_across_lives(tmp_path):
    tl = VersionTimeline()
    assert [tl.at(v) for v in (-1, 0, 7)] == [-1, 0, 7]  # a run that never resumed: the identity
    tl.rebase(6, 2)  # life 2 published its checkpoint's weights (timeline 2) as version 6
    tl.rebase(9, 4)  # life 3 resumed at timeline 4 and published as version 9
    assert [tl.at(v) for v in range(12)] == [0, 1, 2, 3, 4, 5, 2, 3, 4, 4, 5, 6]
    # the oldest token by timeline, not by weight version: 6 (timeline 2) is older than 5
    assert tl.oldest(np.array([5, 6, 6], np.int32)) == 2 and tl.oldest(np.array([], np.int32)) == -1
    with pytest.raises(ValueError, match="not after the last timeline start"):
        tl.rebase(9, 5)
    tl.save(tmp_path / TIMELINE_FILE, fsync=True)
    assert VersionTimeline.load(tmp_path / TIMELINE_FILE).starts == [(6, 2), (9, 4)]
    assert VersionTimeline.load(tmp_path / "absent.json").starts == []
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="bad.json is not a version timeline"):
        VersionTimeline.load(tmp_path / "bad.json")


def _lost_life(run_dir, sampler_urls: list[str]) -> list:
    """A learner that checkpointed at step 2 (version 2), then published versions 3-5 and died;
    its receive log holds what it received after the checkpoint, sampled at versions 2-5 (each
    within the bound of the version it was received at). Returns those trajectories."""
    learner = Learner(CFG, MODEL, TransportConfig(curve=False), WeightSyncConfig(timeout_s=30), str(run_dir), seed=0)
    try:
        assert learner.connect_samplers(sampler_urls) == 0
        for step in (1, 2):
            learner.loop.step = step
            learner.publisher.publish(learner.step, advance=True)
        learner.save_checkpoint()
        backlog = []
        for step in (3, 4, 5):
            t = synthetic(version=learner.version, seed=step)
            learner.inbox.log.append(t.trajectory_id, encode(t))
            backlog.append(t)
            learner.loop.step = step
            learner.publisher.publish(learner.step, advance=True)  # (steps 3-5 trained and published, then lost)
        t = synthetic(version=5, seed=6)  # received, not trained yet
        learner.inbox.log.append(t.trajectory_id, encode(t))
        backlog.append(t)
        assert learner.version == 5
    finally:
        learner.close()  # (no final checkpoint: killed)
    return backlog


def test_a_resumed_learner_trains_its_backlog_without_stale_drops(tmp_path):
    """Backlog sampled at versions 2-5; the learner restarts from step 2 and publishes its
    checkpoint's weights as version 6. Measured in weight versions (main) the backlog is 4, 3 and
    2 versions stale (bound 1) and dropped; measured in timeline versions it trains as it would
    have without the kill, and admission is told the checkpoint's timeline version first."""
    backlog = _lost_life(tmp_path, [])
    again = Learner(dataclasses.replace(CFG, resume=True), MODEL, TransportConfig(curve=False), WeightSyncConfig(),
                    str(tmp_path), seed=0)
    ctl = FakeController()
    try:
        assert again.connect_samplers([]) == 6  # a new name for the checkpoint's weights
        status = again.run(ctl)
    finally:
        again.close()
    assert status["dropped"]["stale"] == 0 and status["dropped_stale_restart"] == 0
    assert status["trained"] == len(backlog) and status["step"] == 6
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["staleness_max"] for r in rows] == [0, 0, 0, 0]
    assert [(r["version"], r["timeline_version"]) for r in rows] == [(7, 3), (8, 4), (9, 5), (10, 6)]
    assert ctl.versions == [2, 3, 4, 5, 6]  # admission rewinds to the checkpoint, then follows the re-training
    assert VersionTimeline.load(tmp_path / "receive_log" / TIMELINE_FILE).starts == [(6, 2)]


def test_the_samplers_keep_the_lost_lifes_weights_until_the_learner_re_trains_past_them(tmp_path):
    """A real sampler holds version 5 when the learner dies. The resumed learner (timeline 2)
    leaves it serving version 5 instead of sending the checkpoint's older weights, publishes
    nothing while it re-trains steps 3-5, then publishes version 6 at timeline 6 (no new
    timeline start); an episode in flight on version 5 arriving after the backlog trains too."""
    sampler = EmbeddedSampler(MODEL, SamplerConfig(), seed=0)
    try:
        backlog = _lost_life(tmp_path, [sampler.url()])
        assert sampler.version == 5
        again = Learner(dataclasses.replace(CFG, resume=True, max_steps=7), MODEL, TransportConfig(curve=False),
                        WeightSyncConfig(timeout_s=30), str(tmp_path), seed=0)
        ctl = FakeController()
        try:
            assert again.connect_samplers([sampler.url()]) == 5 and sampler.version == 5
            tx = ZmqSender(again.endpoint())
            late = synthetic(version=5, seed=7)
            tx.send(late.trajectory_id, encode(late))
            status = again.run(ctl)
            tx.close()
        finally:
            again.close()
        assert status["dropped"]["stale"] == 0 and status["trained"] == len(backlog) + 1
        rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert [(r["version"], r["timeline_version"]) for r in rows] == [(5, 3), (5, 4), (5, 5), (6, 6), (7, 7)]
        assert [r["staleness_max"] for r in rows] == [0, 0, 0, 0, 1] and sampler.version == 7
        assert ctl.versions == [2, 3, 4, 5, 6, 7]
        assert not (tmp_path / "receive_log" / TIMELINE_FILE).exists()  # versions and timeline agree again
    finally:
        sampler.shutdown()


def test_soak_draws_its_victims_from_the_roles_given_and_refuses_an_unknown_one():
    from t1async.commands.soak import DEFAULT_VICTIMS, ROLE_TITLES, soak

    assert set(DEFAULT_VICTIMS) == set(ROLE_TITLES)
    with pytest.raises(ValueError, match=r"soak roles \['learnr'\]: each must be one of"):
        soak("configs/local.yaml", 1, 20, [], roles=("learnr",))  # (refused before anything starts)
