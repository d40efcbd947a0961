"""One behaviour suite, two backends: the embedded sampler (actors/sampler.py) and the fake SGLang server
(tests/sglang_fake.py, built from the pinned release's fixture), both through the real client
(t1async/sampler_client.py) and the real weight sync (t1async/weight_sync.py) over a real gloo group."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from sglang_fake import FakeSGLangServer
from t1async.actors.sampler import EmbeddedSampler
from t1async.config import ModelConfig, SamplerConfig
from t1async.model import Qwen3MoeForCausalLM
from t1async.sampler_client import HttpSampler, SamplerError, flush_cache, post_json, weight_version
from t1async.weight_sync import DistributedWeightSync, WeightSyncError, plan_buckets

CFG = ModelConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
PARAMS = {"max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "stop_token_ids": [3]}
SHAPE = dict(num_layers=CFG.num_hidden_layers, top_k=CFG.num_experts_per_tok, num_experts=CFG.num_experts)


def make_fake(**kw) -> FakeSGLangServer:
    kw.setdefault("token_delay_s", 0.01)
    kw.setdefault("group_timeout_s", 60)
    return FakeSGLangServer(num_layers=CFG.num_hidden_layers, top_k=CFG.num_experts_per_tok, num_experts=CFG.num_experts,
                            vocab_size=CFG.vocab_size, **kw)


class Backend:
    """A started sampler of either kind: ``url``, ``hold()`` (a context keeping one request running)."""

    def __init__(self, kind: str):
        self.kind = kind
        if kind == "embedded":
            self.server = EmbeddedSampler(CFG, SamplerConfig(), seed=0)
            self.url = self.server.url()
        else:
            self.server = make_fake(token_delay_s=0.01)
            self.url = self.server.url

    def slow_down(self, gate: threading.Event) -> None:
        """Make every request run until ``gate`` is set (embedded: generation waits on it; fake:
        tokens come every 10 ms and the request asks for many)."""
        if self.kind == "embedded":
            orig = self.server.engine.generate

            def gated(*a, **k):
                gate.wait(30)
                return orig(*a, **k)
            self.server.engine.generate = gated

    def shutdown(self) -> None:
        self.server.shutdown()


@pytest.fixture(params=["embedded", "fake"])
def backend(request):
    b = Backend(request.param)
    yield b
    b.shutdown()


def policy() -> Qwen3MoeForCausalLM:
    torch.manual_seed(7)
    return Qwen3MoeForCausalLM(CFG).eval()


def test_publish_in_buckets_then_generate_real_shapes(backend):
    model = policy()
    sync = DistributedWeightSync("gloo", timeout_s=30, bucket_mb=0.05)  # ~50 KiB buckets: several per publish
    assert len(plan_buckets(model.named_parameters(), sync.bucket_bytes)) > 3
    sync.connect([backend.url])
    try:
        sync.publish(model.named_parameters(), 0)
        assert weight_version(backend.url) == "0"
        for name in ("model.embed_tokens.weight", "model.layers.1.mlp.experts.3.down_proj.weight", "lm_head.weight"):
            got = post_json(backend.url, "/get_weights_by_name", {"name": name, "truncate_size": 50})
            assert got == pytest.approx(model.get_parameter(name).detach().reshape(-1)[:50].tolist()), name
        client = HttpSampler(backend.url, **SHAPE)
        prompt = [11, 12, 13, 14, 15]
        r = client.generate(prompt, PARAMS, routed_experts_start_len=2)
        assert r.weight_version == 0 and r.finish_reason in ("stop", "length")
        assert r.routed_experts.shape == (len(prompt) + len(r.output_ids) - 1 - 2, CFG.num_hidden_layers,
                                          CFG.num_experts_per_tok)
        assert len(r.logprobs) == len(r.output_ids) and all(lp <= 0 for lp in r.logprobs)
        with torch.no_grad():
            model.lm_head.weight.add_(1.0)
        sync.publish(model.named_parameters(), 1)
        assert client.generate(prompt, PARAMS).weight_version == 1
        got = post_json(backend.url, "/get_weights_by_name", {"name": "lm_head.weight", "truncate_size": 5})
        assert got == pytest.approx(model.lm_head.weight.detach().reshape(-1)[:5].tolist())
        assert sync.last_pause_s > 0
        # a third version: the embedded sampler receives into the buffers that held version 0
        with torch.no_grad():
            model.model.layers[0].mlp.experts[1].up_proj.weight.mul_(-1)
        sync.publish(model.named_parameters(), 2)
        for name, p in model.named_parameters():
            got = post_json(backend.url, "/get_weights_by_name", {"name": name, "truncate_size": 8})
            assert got == pytest.approx(p.detach().reshape(-1)[:8].tolist()), name
    finally:
        sync.close()


def test_retired_weight_version_route_and_plain_text_flush(backend):
    with pytest.raises(SamplerError, match="HTTP 404"):
        post_json(backend.url, "/get_weight_version", method="GET")
    assert "flushed" in flush_cache(backend.url).lower()


def test_flush_cache_is_refused_while_a_request_runs(backend):
    model = policy()
    sync = DistributedWeightSync("gloo", timeout_s=30)
    sync.connect([backend.url])
    try:
        sync.publish(model.named_parameters(), 0)
        gate = threading.Event()
        backend.slow_down(gate)
        client = HttpSampler(backend.url, **SHAPE)
        t = threading.Thread(target=client.generate, args=([5, 6, 7], dict(PARAMS, max_new_tokens=150, stop_token_ids=[])))
        t.start()
        refused = None
        deadline = time.monotonic() + 5
        while refused is None and time.monotonic() < deadline:
            try:
                flush_cache(backend.url)
                time.sleep(0.01)
            except SamplerError as e:
                refused = str(e)
        gate.set()
        t.join(30)
        assert refused is not None and "HTTP 400" in refused
        assert "flushed" in flush_cache(backend.url).lower()  # nothing running any more
    finally:
        sync.close()


def test_pause_holds_new_requests_until_continue(backend):
    sync = DistributedWeightSync("gloo", timeout_s=30)
    sync.connect([backend.url])
    try:
        sync.publish(policy().named_parameters(), 0)
        post_json(backend.url, "/pause_generation", {"mode": "abort"})
        client = HttpSampler(backend.url, **SHAPE)
        done = []
        t = threading.Thread(target=lambda: done.append(client.generate([5, 6, 7], PARAMS)))
        t.start()
        t.join(0.5)
        assert not done  # held while paused
        post_json(backend.url, "/continue_generation", {})
        t.join(30)
        assert done and done[0].weight_version == 0
    finally:
        sync.close()


def test_pause_abort_ends_a_running_sglang_request_and_the_client_resends_it():
    fake = make_fake(token_delay_s=0.02)
    try:
        client = HttpSampler(fake.url, **SHAPE)
        fake.weight_version = "4"
        out = []
        t = threading.Thread(target=lambda: out.append(client.generate([5, 6, 7], dict(PARAMS, max_new_tokens=40,
                                                                                          stop_token_ids=[]))))
        t.start()
        time.sleep(0.2)  # running
        post_json(fake.url, "/pause_generation", {"mode": "abort"})  # returns once it was aborted
        fake.weight_version = "5"
        post_json(fake.url, "/continue_generation", {})
        t.join(30)
        assert client.aborted_retries == 1
        assert out[0].weight_version == 5 and len(out[0].output_ids) == 40  # sampled whole by the new weights
    finally:
        fake.shutdown()


@pytest.mark.parametrize("fault", [None, "minus_one", "out_of_range"])
def test_missing_or_bad_routing_is_an_error_naming_the_server_flag(fault):
    fake = make_fake(enable_return_routed_experts=fault is not None, routing_fault=fault)
    try:
        fake.weight_version = "0"
        with pytest.raises(SamplerError, match="--enable-return-routed-experts"):
            HttpSampler(fake.url, **SHAPE).generate([5, 6, 7], PARAMS)
    finally:
        fake.shutdown()


def test_fake_rejects_unknown_and_missing_fields_like_the_release_schema():
    fake = make_fake()
    try:
        with pytest.raises(SamplerError, match="422.*names"):
            post_json(fake.url, "/update_weights_from_distributed", {"dtypes": [], "shapes": []})
        with pytest.raises(SamplerError, match="422.*timeout_s"):  # the embedded-only extension
            post_json(fake.url, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                               "rank_offset": 1, "world_size": 2, "timeout_s": 5})
        with pytest.raises(SamplerError, match="422.*modee"):
            post_json(fake.url, "/pause_generation", {"modee": "abort"})
        assert fake.rejected == {"/update_weights_from_distributed": 1, "/init_weights_update_group": 1,
                                 "/pause_generation": 1}
    finally:
        fake.shutdown()


def test_tp2_server_joins_with_sglang_recipe_next_to_tp1_and_embedded():
    """World = 1 learner + 2 (a TP=2 server: two processes joining with torch's own helper, ranks
    rank_offset + tp_rank) + 1 (TP=1 server) + 1 (embedded sampler): one gloo group, one publish."""
    tp2, tp1 = make_fake(tp_size=2), make_fake(tp_size=1)
    emb = EmbeddedSampler(CFG, SamplerConfig(), seed=0)
    model = policy()
    sync = DistributedWeightSync("gloo", timeout_s=60, bucket_mb=0.1)
    try:
        sync.connect([tp2.url, tp1.url, emb.url()])
        sync.publish(model.named_parameters(), 3)  # the fake fails unless both TP ranks got identical bytes
        for url in (tp2.url, tp1.url, emb.url()):
            assert weight_version(url) == "3"
            got = post_json(url, "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 64})
            assert got == pytest.approx(model.model.norm.weight.detach().tolist())
    finally:
        sync.close()
        for s in (tp2, tp1, emb):
            s.shutdown()


def test_failed_update_takes_the_sampler_out_of_service_and_reloads_the_others():
    """A sampler that refuses the update stays paused (never serves partial weights) and leaves the
    group; the other is sent the whole update again in a new group and serves the new version."""
    bad = EmbeddedSampler(CFG, SamplerConfig(), seed=0)
    good = make_fake()
    model = policy()
    sync = DistributedWeightSync("gloo", timeout_s=30, bucket_mb=0.05)
    try:
        sync.connect([bad.url(), good.url])
        sync.publish(model.named_parameters(), 0)
        extra = list(model.named_parameters()) + [("not.in.the.model", torch.zeros(3))]  # refused by the embedded one
        with pytest.raises(WeightSyncError, match="out of service"):
            sync.publish(extra, 1)
        assert list(sync.failed) == [bad.url()]
        assert weight_version(good.url) == "1" and weight_version(bad.url()) == "0"  # embedded: atomic, old weights
        assert bad._paused and not good._paused
        sync.publish(model.named_parameters(), 2)  # a new group without the failed sampler
        assert weight_version(good.url) == "2" and weight_version(bad.url()) == "0"
    finally:
        sync.close()
        bad.shutdown()
        good.shutdown()
