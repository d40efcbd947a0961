"""A corrupt latest checkpoint does not block a resume: every checkpoint carries a manifest (size
and SHA-256 per file); a resume takes the newest that verifies, names the bad one in one line
and moves it aside. Checkpoints written before manifests existed still load."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from t1async.actors.learner import Learner
from t1async.config import LearnerConfig, TransportConfig, WeightSyncConfig
from t1async.learner.checkpoints import (
    MANIFEST,
    latest_checkpoint,
    resumable_checkpoint,
    resume_from_nothing,
    rotate_checkpoints,
    untrusted_checkpoints,
    verify_checkpoint,
)
from tests.support.checkpoints import write_checkpoint
from tests.support.learner_fakes import MODEL


def test_commit_writes_a_manifest_and_verify_names_what_is_wrong(tmp_path):
    path = write_checkpoint(tmp_path, 1)
    files = json.loads((path / MANIFEST).read_text())["files"]
    assert sorted(files) == ["model.safetensors", "trainer_state.json"] and files["model.safetensors"]["bytes"] == 700
    assert verify_checkpoint(path) is None
    data = bytearray((path / "model.safetensors").read_bytes())
    data[10] ^= 0xFF  # same size, one byte flipped
    (path / "model.safetensors").write_bytes(bytes(data))
    assert verify_checkpoint(path) == "model.safetensors's SHA-256 differs from its manifest"
    (path / "model.safetensors").write_bytes(b"short")
    assert verify_checkpoint(path) == "model.safetensors has 5 bytes, its manifest says 700"
    (path / "model.safetensors").unlink()
    assert verify_checkpoint(path) == "model.safetensors is missing"
    (path / MANIFEST).write_text("{trunc")
    assert verify_checkpoint(path) == f"{MANIFEST} cannot be read (JSONDecodeError)"


def test_a_resume_falls_back_past_corrupt_checkpoints_and_sets_them_aside(tmp_path):
    for step in (1, 2, 3):
        write_checkpoint(tmp_path, step)
    (tmp_path / "step_000003" / "model.safetensors").write_bytes(b"torn")
    (tmp_path / "step_000002" / MANIFEST).unlink()
    (tmp_path / "step_000002" / "trainer_state.json").unlink()  # no manifest and no state: not a checkpoint
    path, lines = resumable_checkpoint(tmp_path)
    assert path == tmp_path / "step_000001"
    assert lines == [f"checkpoint step_000003 failed verification (model.safetensors has 4 bytes, its manifest says "
                     f"700); moved aside to {tmp_path / 'step_000003.corrupt'}",
                     f"checkpoint step_000002 failed verification (no trainer_state.json); moved aside to "
                     f"{tmp_path / 'step_000002.corrupt'}"]
    assert latest_checkpoint(tmp_path) == path and resumable_checkpoint(tmp_path) == (path, [])
    rotate_checkpoints(tmp_path, keep_last=1)
    assert (tmp_path / "step_000003.corrupt").is_dir()  # kept for a look, never rotated away


def test_a_run_whose_checkpoints_all_fail_is_not_resumed_from_the_initial_weights(tmp_path):
    assert untrusted_checkpoints(tmp_path / "none") is None  # never checkpointed: the receive log is replayed
    for step in (1, 2):
        write_checkpoint(tmp_path, step)
    assert untrusted_checkpoints(tmp_path) is None
    data = bytearray((tmp_path / "step_000002" / "model.safetensors").read_bytes())
    data[3] ^= 1
    (tmp_path / "step_000002" / "model.safetensors").write_bytes(bytes(data))  # same size, other bytes
    (tmp_path / "step_000001" / "model.safetensors").write_bytes(b"")
    assert untrusted_checkpoints(tmp_path, digests=False) is None  # sizes alone: step 2 looks whole
    assert untrusted_checkpoints(tmp_path) == (
        f"no checkpoint in {tmp_path} can be trusted (step_000002: model.safetensors's SHA-256 differs from its "
        "manifest; step_000001: model.safetensors has 0 bytes, its manifest says 700)")
    assert resumable_checkpoint(tmp_path)[0] is None  # moves both aside ...
    assert untrusted_checkpoints(tmp_path) == (  # ... and a later resume still refuses
        f"no checkpoint in {tmp_path} can be trusted (set aside as corrupt: step_000001.corrupt, step_000002.corrupt)")
    write_checkpoint(tmp_path, 3)
    assert untrusted_checkpoints(tmp_path) is None


def test_a_checkpoint_without_a_manifest_is_loaded_as_before(tmp_path):
    path = write_checkpoint(tmp_path, 4)
    (path / MANIFEST).unlink()  # as written before manifests existed
    assert verify_checkpoint(path) is None and resumable_checkpoint(tmp_path) == (path, [])


def test_a_learner_resumes_from_the_newest_intact_checkpoint(tmp_path):
    """Two real checkpoints; the newer one's weights are torn (as by a crash or a bad disk): the
    resumed learner restores step 1 with its weights and says which checkpoint it set aside."""
    cfg = LearnerConfig(max_steps=4, batch_size=1, routing_replay=False, batch_timeout_s=30, episodes_per_step=0)
    learner = Learner(cfg, MODEL, TransportConfig(curve=False), WeightSyncConfig(), str(tmp_path), seed=0)
    try:
        learner.loop.step = 1
        learner.save_checkpoint()
        step1 = {n: p.detach().clone() for n, p in learner.policy.named_parameters()}
        with torch.no_grad():
            for p in learner.policy.parameters():
                p.add_(1.0)
        learner.loop.step = 2
        learner.save_checkpoint()
    finally:
        learner.close()
    bad = tmp_path / "checkpoints" / "step_000002" / "model.safetensors"
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    again = Learner(dataclasses.replace(cfg, resume=True), MODEL, TransportConfig(curve=False), WeightSyncConfig(), str(tmp_path),
                    seed=0)
    try:
        assert again.step == 1 and again.resumed["checkpoint"].endswith("step_000001")
        [line] = again.resumed["set_aside"]
        assert line.startswith("checkpoint step_000002 failed verification (model.safetensors has ")
        assert "step_000002.corrupt" in line and "\n" not in line
        for n, p in again.policy.named_parameters():
            assert torch.equal(p, step1[n]), n
    finally:
        again.close()
    assert (tmp_path / "checkpoints" / "step_000002.corrupt").is_dir()
    one = tmp_path / "checkpoints" / "step_000001" / "optimizers.pt"
    data = bytearray(one.read_bytes())
    data[len(data) // 2] ^= 0xFF
    one.write_bytes(bytes(data))  # the last one left: same size, other bytes
    with pytest.raises(RuntimeError, match="cannot resume: no checkpoint in .* can be trusted .*set aside as corrupt: "
                                           "step_000001.corrupt, step_000002.corrupt"):
        Learner(dataclasses.replace(cfg, resume=True), MODEL,
                TransportConfig(curve=False), WeightSyncConfig(), str(tmp_path), seed=0)




def test_a_resume_whose_checkpoints_are_all_gone_is_refused_unless_asked_for(tmp_path):
    """Issue 42: with every checkpoint deleted, a resume started again from random weights with one
    INFO line and cut metrics.jsonl back. The learner notes each checkpoint beside the receive log,
    so it knows the run had some: refused in one line, unless ``learner.resume_from_scratch``."""
    cfg = LearnerConfig(max_steps=4, batch_size=1, routing_replay=False, batch_timeout_s=30, episodes_per_step=0)
    learner = Learner(cfg, MODEL, TransportConfig(curve=False), WeightSyncConfig(), str(tmp_path), seed=0)
    try:
        assert resume_from_nothing(tmp_path) is None  # nothing written yet: a resume replays the receive log
        learner.loop.step = 3
        learner.save_checkpoint()
    finally:
        learner.close()
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
    assert resume_from_nothing(tmp_path) is None  # the checkpoint is there
    shutil.rmtree(tmp_path / "checkpoints")
    why = resume_from_nothing(tmp_path)
    assert why == (f"the run wrote checkpoint step_000003 before (receive_log/checkpointed) and metrics.jsonl reaches "
                   f"step 3, but {tmp_path / 'checkpoints'} holds no checkpoint now")
    with pytest.raises(RuntimeError, match=r"cannot resume: the run wrote checkpoint step_000003 .* add "
                                           r"learner.resume_from_scratch=true"):
        Learner(dataclasses.replace(cfg, resume=True), MODEL,
                TransportConfig(curve=False), WeightSyncConfig(), str(tmp_path), seed=0)
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3  # not cut back
    again = Learner(dataclasses.replace(cfg, resume=True, resume_from_scratch=True), MODEL, TransportConfig(curve=False),
                    WeightSyncConfig(), str(tmp_path), seed=0)
    try:
        assert again.step == 0 and again.resumed["checkpoint"] is None
    finally:
        again.close()
