"""Launch's ``sampler.backend: sglang`` path: servers started per sampler (the real launch code, a stand-in
``sglang.launch_server`` module running the fake server), attach to running ones, health timeouts."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from t1async.config import SamplerConfig
from t1async.sampling.sampler_client import post_json, weight_version
from t1async.sampling.sglang_server import SGLangStartError, sglang_command, start_servers, stop_servers
from tests.support import TESTS
from tests.support.sglang_fake import FakeSGLangServer

PKG = TESTS / "fake_sglang_pkg"


def test_launch_starts_one_server_per_sampler_with_routing_on_and_stops_them(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(PKG), os.environ.get("PYTHONPATH", "")]))
    cfg = SamplerConfig(backend="sglang", num_samplers=2, tp_size=2, model_path="/models/x", start_timeout_s=120)
    assert "--enable-return-routed-experts" in sglang_command(cfg, 1234)
    procs, urls = start_servers(cfg, tmp_path)
    try:
        assert len(urls) == 2 and len(set(urls)) == 2
        for i, u in enumerate(urls):
            assert weight_version(u) == "-1"  # no weights from the learner yet
            assert post_json(u, "/server_info", method="GET")["tp_size"] == 2
            log = (tmp_path / "logs" / f"sglang{i}.log").read_text()
            assert f"CUDA_VISIBLE_DEVICES={2 * i},{2 * i + 1}" in log
    finally:
        stop_servers(procs)
    assert all(p.poll() is not None for p in procs)


@pytest.mark.slow
def test_attach_waits_for_health_and_names_the_dead_server():
    fake = FakeSGLangServer(num_layers=2, top_k=2, num_experts=4, vocab_size=512)
    try:
        procs, urls = start_servers(SamplerConfig(backend="sglang", urls=[fake.url + "/"]), Path("/nonexistent"))
        assert procs == [] and urls == [fake.url]
    finally:
        fake.shutdown()
    t0 = time.monotonic()
    with pytest.raises(SGLangStartError, match="127.0.0.1:9.*start_timeout_s"):
        start_servers(SamplerConfig(backend="sglang", urls=["http://127.0.0.1:9"], start_timeout_s=1.5), Path("/x"))
    assert time.monotonic() - t0 < 10
