"""The order in which launch starts its roles (the Ray edge faked: an actor factory and ``ray.get``
that record what happens): the learner is created alongside the embedded samplers, before launch
waits for them to serve, and joins their weight group only once they serve; SGLang servers keep
their order (the servers first, then the learner). Before, the learner was created only after
every sampler served, so each launch waited for the two start-ups one after the other."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from t1async.actors.learner import Learner
from t1async.actors.sampler import EmbeddedSampler
from t1async.config import load_config
from t1async.service import launch


class _Ref:
    """What a faked ``.remote()`` call returns: ``ray.get`` records ``what`` and returns ``value``."""

    def __init__(self, events: list[str], what: str, value):
        self.events, self.what, self.value = events, what, value


def _fake_ray(monkeypatch, events: list[str], fail: str = ""):
    """A fake actor factory and ``ray.get``/``ray.kill``; ``fail``: the ``ray.get`` that raises Ray's error."""

    def get(refs):
        for ref in refs if isinstance(refs, list) else [refs]:
            events.append(f"wait {ref.what}")
            if ref.what == fail:
                raise launch.ray.exceptions.RayActorError()
        return [r.value for r in refs] if isinstance(refs, list) else refs.value

    def actor(cls, name):
        def remote(*args, **kwargs):
            events.append(f"create {name}")
            if cls is EmbeddedSampler:
                return SimpleNamespace(url=SimpleNamespace(remote=lambda: _Ref(events, f"{name} url",
                                                                               f"http://127.0.0.1:1{name[-1]}")))
            assert cls is Learner
            return SimpleNamespace(endpoint=SimpleNamespace(remote=lambda: _Ref(events, "learner endpoint", "tcp://x:1")),
                                   connect_samplers=SimpleNamespace(
                                       remote=lambda urls: _Ref(events, f"learner joins {','.join(urls)}", 0)))
        return SimpleNamespace(remote=remote)

    monkeypatch.setattr(launch.ray, "get", get)
    monkeypatch.setattr(launch.ray, "kill", lambda handle: events.append("kill learner"))
    return actor


def test_the_learner_starts_alongside_the_embedded_samplers_and_joins_them_once_they_serve(monkeypatch, tmp_path):
    events: list[str] = []
    actor = _fake_ray(monkeypatch, events)
    cfg = load_config(None, ["sampler.num_samplers=2"])
    roles: dict = {}
    learner, endpoint, urls = launch.start_samplers_and_learner(cfg, actor, tmp_path, roles)
    assert events == ["create sampler0", "create sampler1", "create learner",  # before any sampler serves
                      "wait sampler0 url", "wait sampler1 url", "wait learner endpoint",
                      "wait learner joins http://127.0.0.1:10,http://127.0.0.1:11"]
    assert endpoint == "tcp://x:1" and urls == ["http://127.0.0.1:10", "http://127.0.0.1:11"]
    assert len(roles["samplers"]) == 2 and "sglang_servers" not in roles


def test_a_sampler_that_fails_to_start_takes_the_learner_started_beside_it_down(monkeypatch, tmp_path):
    """The sampler's error reaches launch as before (Ray's error); the learner started alongside is
    killed, and no sampler is left in the roles to ask for statistics."""
    events: list[str] = []
    actor = _fake_ray(monkeypatch, events, fail="sampler0 url")
    roles: dict = {}
    with pytest.raises(launch.ray.exceptions.RayActorError):
        launch.start_samplers_and_learner(load_config(None, []), actor, tmp_path, roles)
    assert events == ["create sampler0", "create learner", "wait sampler0 url", "kill learner"] and roles == {}


def test_a_learner_that_fails_to_start_is_one_line_and_killed(monkeypatch, tmp_path):
    events: list[str] = []
    actor = _fake_ray(monkeypatch, events, fail="learner endpoint")
    with pytest.raises(launch.LearnerStartFailed, match=f"^the learner failed to start: .*{tmp_path}/logs/learner.log"):
        launch.start_samplers_and_learner(load_config(None, []), actor, tmp_path, {})
    assert events[-2:] == ["wait learner endpoint", "kill learner"]


def test_sglang_servers_start_before_the_learner_as_before(monkeypatch, tmp_path):
    events: list[str] = []
    actor = _fake_ray(monkeypatch, events)
    monkeypatch.setattr(launch, "start_servers", lambda *a: (events.append("start sglang servers")
                                                            or ["proc"], ["http://127.0.0.1:30000"]))
    cfg = load_config(None, ["sampler.backend=sglang"])
    roles: dict = {}
    _, _, urls = launch.start_samplers_and_learner(cfg, actor, tmp_path, roles)
    assert events == ["start sglang servers", "create learner", "wait learner endpoint",
                      "wait learner joins http://127.0.0.1:30000"]
    assert roles == {"sglang_servers": ["proc"], "samplers": []} and urls == ["http://127.0.0.1:30000"]
