"""Live sampler membership, in one process with real embedded samplers over HTTP and a real gloo
broadcast: a joiner gets the current weights before it serves without pausing the others, a departed
or dead member never holds a publish, rollout requests go to another sampler when theirs is gone,
and the restart back-off every supervised role shares. (tests/e2e/test_sampler_service_e2e.py runs the
launch process's pool end to end.)"""

from __future__ import annotations

import time

import pytest
import torch

from t1async.actors.sampler import EmbeddedSampler
from t1async.config import ModelConfig, SamplerConfig
from t1async.models.model import Qwen3MoeForCausalLM
from t1async.sampling.sampler_client import HttpSampler, RoutedSampler, SamplerUnavailable
from t1async.service.sampler_pool import Backoff
from t1async.weights.distributed import DistributedWeightSync
from t1async.weights.protocol import WeightSyncError

CFG = ModelConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
PARAMS = {"max_new_tokens": 4, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "stop_token_ids": [3]}


def client(url: str) -> HttpSampler:
    return HttpSampler(url, num_layers=CFG.num_hidden_layers, top_k=CFG.num_experts_per_tok, timeout_s=30)


def count_pauses(sampler: EmbeddedSampler) -> list[int]:
    calls = [0]
    inner = sampler.http.handle_pause

    def pause(body):
        calls[0] += 1
        return inner(body)

    sampler.http.handle_pause = pause  # the HTTP handler looks the route up on the instance
    return calls


@pytest.fixture()
def samplers():
    ss = [EmbeddedSampler(CFG, SamplerConfig(), seed=i) for i in range(3)]
    yield ss
    for s in ss:
        s.shutdown()


@pytest.fixture()
def policy():
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(CFG).eval()


def test_a_joiner_gets_the_current_version_before_serving_without_pausing_the_others(samplers, policy):
    a, b, _ = samplers
    sync = DistributedWeightSync("gloo", timeout_s=30)
    try:
        sync.connect([a.url()])
        sync.publish(policy.named_parameters(), 0)
        with pytest.raises(SamplerUnavailable, match="503"):  # no weights yet: refused, so a client goes elsewhere
            client(b.url()).generate([5, 6, 7], PARAMS)
        sync.set_members([a.url(), b.url()])
        assert sync.joiners() == [b.url()]
        pauses = count_pauses(a)
        sync.load(policy.named_parameters(), 0, sync.joiners())
        assert pauses[0] == 0 and not a.http._paused  # the sampler in service was neither paused nor regrouped
        assert b.version == 0 and sync.joiners() == [] and sync.held == {a.url(): 0, b.url(): 0}
        assert client(b.url()).generate([5, 6, 7], PARAMS).weight_version == 0
        assert b.stats()["not_ready"] == 1 and b.stats()["first_request"]["weight_version"] == 0

        with torch.no_grad():
            for p in policy.parameters():
                p.add_(0.01)
        sync.publish(policy.named_parameters(), 1)  # the next publish re-forms the group with both
        assert sync.last_form_s > 0 and pauses[0] == 1 and sync.urls == [a.url(), b.url()]
        for s in (a, b):
            assert s.version == 1 and torch.equal(s.engine.model.lm_head.weight, policy.lm_head.weight)
        sync.publish(policy.named_parameters(), 2)  # a normal publish: no re-form
        assert sync.last_form_s == 0 and a.version == b.version == 2
    finally:
        sync.close()


def test_departed_and_dead_members_never_hold_a_publish(samplers, policy):
    a, b, c = samplers
    sync = DistributedWeightSync("gloo", timeout_s=60)
    try:
        sync.connect([a.url(), b.url(), c.url()])
        sync.publish(policy.named_parameters(), 0)
        assert b.drain(timeout_s=5) == 0
        with pytest.raises(SamplerUnavailable, match="503.*draining"):
            client(b.url()).generate([5, 6, 7], PARAMS)
        sync.set_members([a.url(), c.url()])  # b scaled down: it leaves at the next publish
        t0 = time.monotonic()
        sync.publish(policy.named_parameters(), 1)
        assert sync.urls == [a.url(), c.url()] and b.version == 0 and a.version == c.version == 1

        c.shutdown()  # died unnoticed while b comes back (scaled up): the re-form probes, leaves c out at once
        sync.set_members([a.url(), b.url(), c.url()])
        with pytest.raises(WeightSyncError, match="out of service") as e:
            sync.publish(policy.named_parameters(), 2)
        assert c.url() in str(e.value) and list(sync.failed) == [c.url()] and a.version == b.version == 2
        assert time.monotonic() - t0 < 20  # not the 60 s rendezvous timeout

        b.shutdown()  # died with no membership change: its pause fails, a is reloaded in a new group
        with pytest.raises(WeightSyncError, match="out of service"):
            sync.publish(policy.named_parameters(), 3)
        assert sorted(sync.failed) == sorted([b.url(), c.url()]) and a.version == 3 and not a.http._paused
        sync.set_members([a.url()])  # the pool replaced them: failures of departed samplers are forgotten
        sync.publish(policy.named_parameters(), 4)
        assert sync.failed == {} and a.version == 4
        sync.set_members([])  # every sampler gone (restarting): the version waits for the joiners
        sync.publish(policy.named_parameters(), 5)
        assert sync.last_pause_s == 0 and a.version == 4
    finally:
        sync.close()


def test_a_request_whose_sampler_is_gone_goes_to_another_and_waits_for_one_to_serve(samplers, policy):
    a, b, _ = samplers
    for s in (a, b):
        s.load_weights(dict(policy.state_dict()), 0)
    routes = [[a.url(), b.url()]]
    r = RoutedSampler([a.url(), b.url()], actor_id=0, make_client=client, routes=lambda: routes[0],
                      unavailable_for_s=10, retry_wait_s=0.1)
    r.begin_episode()
    assert r.url == a.url() and r.generate([5, 6, 7], PARAMS).weight_version == 0
    a.shutdown()  # it dies between two turns of the episode; routing has not caught up yet
    assert r.generate([5, 6, 7, 8], PARAMS).weight_version == 0
    assert r.url == b.url() and r.rerouted == 1 and b.stats()["requests"] == 1

    routes[0] = []  # none serving (every sampler restarting): the request waits for one
    b.drain(timeout_s=1)

    def back_in_service():
        time.sleep(0.5)
        routes[0] = [c.url()]

    import threading

    c = samplers[2]
    c.load_weights(dict(policy.state_dict()), 0)
    threading.Thread(target=back_in_service).start()
    assert r.generate([5, 6], PARAMS).weight_version == 0 and r.url == c.url() and r.rerouted == 2

    routes[0] = []
    c.shutdown()
    r.unavailable_for_s = 0.5
    with pytest.raises(SamplerUnavailable, match="no sampler answered"):  # counted by the controller by this reason
        r.generate([5, 6], PARAMS)


def test_backoff_doubles_starts_a_new_row_after_useful_work_and_gives_up():
    b = Backoff(limit=3, base_s=5.0, max_s=12.0)
    assert [b.next_wait(False) for _ in range(4)] == [5.0, 10.0, 12.0, None]
    assert b.next_wait(True) == 5.0 and b.restarts == 4 and b.in_row == 1
    assert Backoff(limit=0).next_wait(True) is None


def _until(cond, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.05)
    return cond()


def test_the_learner_loads_joiners_while_idle_and_publishes_anew_only_when_none_serves(tmp_path):
    """Waiting for a batch with the weights of version v, the learner gives joiners v at once; once
    a step moved the policy, a joiner waits for the next publish, unless no other sampler holds
    weights (then nothing would ever reach that publish: the policy goes out as a new version)."""
    import threading

    from t1async.actors.learner import Learner
    from t1async.config import LearnerConfig, TransportConfig, WeightSyncConfig
    from t1async.trajectory import encode
    from t1async.transport.transport import ZmqSender
    from tests.support.learner_fakes import MODEL, FakeController, synthetic

    a, b, c = (EmbeddedSampler(MODEL, SamplerConfig(), seed=i) for i in range(3))
    cfg = LearnerConfig(max_steps=0, batch_size=1, publish_every=2, max_staleness=2, batch_timeout_s=60)
    learner = Learner(cfg, MODEL, TransportConfig(curve=False), WeightSyncConfig(timeout_s=30), str(tmp_path), seed=0)
    tx = None
    try:
        learner.connect_samplers([a.url()])
        th = threading.Thread(target=learner.run, args=(FakeController(),), daemon=True)
        th.start()
        pauses = count_pauses(a)
        learner.set_samplers([a.url(), b.url()])
        assert _until(lambda: b.version == 0) and pauses[0] == 0 and learner.version == 0

        tx = ZmqSender(learner.endpoint())
        traj = synthetic(version=0, seed=1)
        tx.send(traj.trajectory_id, encode(traj))
        assert _until(lambda: learner.step == 1)  # the policy moved; publish_every=2: no publish yet
        learner.set_samplers([a.url(), b.url(), c.url()])
        time.sleep(1.5)  # three idle rounds of the learner
        assert c.version == -1 and learner.version == 0  # a and b serve: c waits for the next publish

        learner.set_samplers([c.url()])  # a and b gone (dead, scaled down): nothing would publish again
        assert _until(lambda: c.version == 1) and learner.version == 1 and a.version == b.version == 0
        # held is recorded once the publish returns (after /continue_generation), later than c.version
        assert _until(lambda: learner.status()["weight_group"]["held"] == {c.url(): 1})
    finally:
        learner.stop()
        if tx is not None:
            tx.close()
        learner.close()
        for s in (a, b, c):
            s.shutdown()


def test_sampler_count_is_live_for_embedded_samplers_only_and_checked(tmp_path):
    from t1async.config import load_config
    from t1async.service.control import parse_changes
    from t1async.service.service import Service

    assert parse_changes(["sampler.num_samplers=3"]) == {"sampler.num_samplers": 3}

    class Pool:  # the pool's side is the e2e test's (tests/e2e/test_sampler_service_e2e.py)
        target = 1

        def scale(self, m):
            self.target = m

    cfg = load_config("configs/local.yaml", ["run.tensorboard=false"])
    pool = Pool()
    svc = Service(cfg, tmp_path, {}, lambda: None, lambda names: None, samplers=pool)
    assert svc.scale({"changes": {"sampler.num_samplers": 3}})["applied"] == {"sampler.num_samplers": 3}
    assert pool.target == 3 and svc.cfg.sampler.num_samplers == 3
    with pytest.raises(ValueError, match="sampler.num_samplers=0 is invalid"):
        svc.scale({"changes": {"sampler.num_samplers": 0}})
    sglang = Service(cfg, tmp_path, {}, lambda: None, lambda names: None, samplers=None)
    with pytest.raises(ValueError, match="only with sampler.backend=embedded"):
        sglang.scale({"changes": {"sampler.num_samplers": 2}})
    assert '"sampler.num_samplers": 3' in (tmp_path / "config_history.jsonl").read_text()
