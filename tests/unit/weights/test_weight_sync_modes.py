"""``weight_sync.mode``: the config value, the learner's side it builds, and launch's same-machine rule
for ``tensor`` (CUDA IPC / shared memory). The protocol itself is in tests/contracts/test_sglang_backends.py."""

from __future__ import annotations

import pytest
import torch

from t1async.actors.learner import Learner
from t1async.actors.sampler import EmbeddedSampler
from t1async.config import ConfigError, LearnerConfig, ModelConfig, SamplerConfig, TransportConfig, WeightSyncConfig, load_config
from t1async.models.batch_invariance import column_major_parameters, is_column_major
from t1async.weights.distributed import DistributedWeightSync
from t1async.weights.factory import make_weight_sync
from t1async.weights.protocol import WeightSyncError
from t1async.weights.tensor import TensorWeightSync

MODEL = ModelConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


@pytest.mark.parametrize("value", ["ipc", "Tensor", "nccl"])
def test_an_unknown_mode_is_one_line_naming_the_key_and_the_choices(value):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"weight_sync.mode={value}"])
    msg = str(e.value)
    assert "\n" not in msg and "weight_sync.mode" in msg and "invalid" in msg
    assert "'distributed'" in msg and "'tensor'" in msg
    with pytest.raises(WeightSyncError) as e:
        make_weight_sync(WeightSyncConfig(mode=value))
    assert "\n" not in str(e.value) and "weight_sync.mode" in str(e.value)


def test_the_default_stays_distributed_and_tensor_builds_the_tensor_side():
    assert load_config(None, []).weight_sync.mode == "distributed"
    assert isinstance(make_weight_sync(WeightSyncConfig()), DistributedWeightSync)
    assert isinstance(make_weight_sync(load_config(None, ["weight_sync.mode=tensor"]).weight_sync), TensorWeightSync)


def test_learner_in_tensor_mode_publishes_its_packed_policy_to_an_embedded_sampler(tmp_path):
    """The learner's own wiring (make_weight_sync from WeightSyncConfig): version 0 at connect, then a
    change made in place to the (packed, now shared-memory) policy reaches the sampler bit for bit."""
    sampler = EmbeddedSampler(MODEL, SamplerConfig(), seed=0)
    learner = Learner(LearnerConfig(max_steps=0, episodes_per_step=0), MODEL, TransportConfig(curve=False),
                      WeightSyncConfig(mode="tensor", timeout_s=30, bucket_mb=0.02), str(tmp_path), seed=0)
    try:
        assert isinstance(learner.publisher.sync, TensorWeightSync)
        assert learner.connect_samplers([sampler.url()]) == 0 and sampler.version == 0
        for step in (1, 2):
            with torch.no_grad():
                for p in learner.policy.parameters():
                    p.add_(0.01 * step)  # as an optimizer step writes them
            learner.publisher.sync.publish(learner.backend.hf_weights(), step)
            got = dict(sampler.engine.model.named_parameters())
            assert sampler.version == step
            assert all(torch.equal(got[n], p) for n, p in learner.policy.named_parameters())
            # received straight into the engine's (column-major) layout
            assert all(is_column_major(p) for p in column_major_parameters(sampler.engine.model).values())
    finally:
        learner.close()
        sampler.shutdown()


def test_launch_refuses_tensor_mode_with_samplers_on_another_host():
    from t1async.service.preflight import check_weight_sync_hosts

    remote = ["weight_sync.mode=tensor", "sampler.backend=sglang", "sampler.urls=[http://192.0.2.7:30000]"]
    with pytest.raises(ConfigError) as e:
        check_weight_sync_hosts(load_config(None, remote))
    msg = str(e.value)
    assert "\n" not in msg and "192.0.2.7" in msg and "weight_sync.mode=distributed" in msg
    with pytest.raises(ConfigError, match="sampler.host"):
        check_weight_sync_hosts(load_config(None, ["weight_sync.mode=tensor", "sampler.host=192.0.2.7"]))
    for ok in (["weight_sync.mode=tensor", "sampler.backend=sglang", "sampler.urls=[http://127.0.0.1:30000,http://localhost:30001]"],
               ["weight_sync.mode=tensor"],  # embedded samplers on 127.0.0.1
               ["sampler.backend=sglang", "sampler.urls=[http://192.0.2.7:30000]"]):  # distributed: anywhere
        check_weight_sync_hosts(load_config(None, ok))


def test_tensor_mode_on_cpu_refuses_before_pausing_when_shared_memory_is_too_small(monkeypatch):
    """A container's /dev/shm (64 MiB by default) smaller than the policy: one line, nobody paused,
    the sampler keeps serving what it had (writing past the limit would kill the learner: SIGBUS)."""
    import os

    from t1async.models.model import Qwen3MoeForCausalLM
    from t1async.sampling.sampler_client import weight_version

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(MODEL).eval()
    sampler = EmbeddedSampler(MODEL, SamplerConfig(), seed=0)
    sync = TensorWeightSync(timeout_s=30, bucket_mb=0.02)
    real = os.statvfs("/dev/shm")

    class Tiny:
        f_bavail, f_frsize = 1, real.f_frsize
    try:
        sync.connect([sampler.url()])
        monkeypatch.setattr(os, "statvfs", lambda path: Tiny())
        with pytest.raises(WeightSyncError) as e:
            sync.publish(model.named_parameters(), 0)
        assert "\n" not in str(e.value) and "/dev/shm" in str(e.value) and "MiB" in str(e.value)
        assert not sampler.http._paused and weight_version(sampler.url()) == "-1" and not sync.failed
        monkeypatch.undo()
        sync.publish(model.named_parameters(), 0)
        assert weight_version(sampler.url()) == "0"
    finally:
        sync.close()
        sampler.shutdown()
