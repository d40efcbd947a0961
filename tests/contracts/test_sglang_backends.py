"""One behaviour suite, two backends: the embedded sampler (t1async/actors/sampler.py: t1async/sampling/embedded_http.py,
t1async/weights/receiver.py) and the fake SGLang server
(tests/support/sglang_fake.py, built from the pinned release's fixture), both through the real client
(t1async/sampling/sampler_client.py) and the real weight sync (t1async/weights/), in both of its modes:
``distributed`` over a real gloo group, ``tensor`` through named shared memory (the fake's TP workers
are other processes that open it)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from t1async.actors.sampler import EmbeddedSampler
from t1async.config import ModelConfig, SamplerConfig
from t1async.models.model import Qwen3MoeForCausalLM
from t1async.sampling.sampler_client import HttpSampler, SamplerError, flush_cache, post_json, weight_version
from t1async.weights.buckets import pack_parameters, plan_buckets
from t1async.weights.distributed import DistributedWeightSync
from t1async.weights.handles import serialize_named_tensors
from t1async.weights.protocol import WeightSyncError
from t1async.weights.tensor import TensorWeightSync
from tests.support import FIXTURES
from tests.support.sglang_fake import FakeSGLangServer

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


def make_sync(mode: str, **kw) -> DistributedWeightSync | TensorWeightSync:
    """The learner's side in ``mode`` (distributed: gloo)."""
    return DistributedWeightSync("gloo", **kw) if mode == "distributed" else TensorWeightSync(**kw)


@pytest.fixture(params=["distributed", "tensor"])
def mode(request):
    return request.param


@pytest.mark.slow
def test_publish_in_buckets_then_generate_real_shapes(backend, mode):
    model = policy()
    sync = make_sync(mode, timeout_s=30, bucket_mb=0.05)  # ~50 KiB buckets: several per publish
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_pause_holds_new_requests_until_continue(backend, mode):
    sync = make_sync(mode, timeout_s=30)
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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
        assert bad.http._paused and not good._paused
        sync.publish(model.named_parameters(), 2)  # a new group without the failed sampler
        assert weight_version(good.url) == "2" and weight_version(bad.url()) == "0"
    finally:
        sync.close()
        bad.shutdown()
        good.shutdown()


# ---- weight_sync.mode=tensor (SGLang /update_weights_from_tensor) -----------------------------------

TENSOR_BODY = {"serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests", "weight_version"}


def _fresh_generation(state: dict[str, torch.Tensor], prompt: list[int], params: dict):
    """What a fresh engine loaded with ``state`` samples for ``prompt`` (the sampler's engine settings)."""
    from t1async.sampling.engine import Engine, SamplingParams

    model = Qwen3MoeForCausalLM(CFG).eval()
    model.load_state_dict(state, strict=True)
    sc = SamplerConfig()
    engine = Engine(model, seed=0, prefix_cache=sc.prefix_cache, prefill_chunk=sc.prefill_chunk, max_batch=sc.max_batch)
    return engine.generate(prompt, SamplingParams(**params))


@pytest.mark.parametrize("packed", [False, True])
def test_tensor_publish_is_bitwise_and_the_sampler_generates_with_those_weights(packed):
    """Every weight of the embedded sampler equals the learner's bit for bit after a tensor-mode
    publish, its version is the published one, and what it samples (ids and log-probs) is what a
    fresh engine loaded with the learner's weights samples; a second version changes both."""
    model = policy()
    if packed:
        assert pack_parameters(model)  # each bucket a view of the policy: sent without a copy
    emb = EmbeddedSampler(CFG, SamplerConfig(), seed=0)
    sync = TensorWeightSync(timeout_s=30, bucket_mb=0.05)
    params = dict(PARAMS, max_new_tokens=12, stop_token_ids=[], sampling_seed=1234)
    prompt = [11, 12, 13, 14, 15]
    try:
        sync.connect([emb.url()])
        outs = []
        for version in (0, 1):
            if version:
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(1.5)
            sync.publish(model.named_parameters(), version)
            assert weight_version(emb.url()) == str(version) and sync.held == {emb.url(): version}
            got = dict(emb.engine.model.named_parameters())
            for n, p in model.named_parameters():
                assert torch.equal(got[n], p), n
                assert got[n].untyped_storage().data_ptr() != p.untyped_storage().data_ptr()  # a copy, not the learner's
            r = HttpSampler(emb.url(), **SHAPE).generate(prompt, params)
            want = _fresh_generation({n: p.detach().clone() for n, p in model.named_parameters()}, prompt, params)
            assert r.weight_version == version
            assert r.output_ids == want.output_ids and r.logprobs == want.output_logprobs
            outs.append(r.logprobs)
        assert outs[0] != outs[1]
        assert sync.last_pause_s > 0 and sync.last_form_s == 0
    finally:
        sync.close()
        emb.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["shape", "name", "dtype"])
def test_tensor_payload_with_a_bad_tensor_is_refused_naming_it_and_nothing_is_swapped(fault):
    """A bucket holding a tensor of the wrong shape, an unknown name or a non-float dtype: the
    embedded sampler answers 400 naming it, keeps version 0's weights entirely (earlier buckets of
    the same update were staged, never swapped in) and is taken out of service (left paused), while
    a fake SGLang server next to it (which checks no names) takes the update and goes on serving."""
    model = policy()
    emb, fake = EmbeddedSampler(CFG, SamplerConfig(), seed=0), make_fake()
    sync = TensorWeightSync(timeout_s=30, bucket_mb=0.05)
    target = "model.layers.1.mlp.experts.3.down_proj.weight"  # an expert: sent in one of the last buckets
    try:
        sync.connect([emb.url(), fake.url])
        sync.publish(model.named_parameters(), 0)
        before = {n: p.detach().clone() for n, p in emb.engine.model.named_parameters()}
        named = [(n, p.detach() + 1) for n, p in model.named_parameters()]  # every weight changes
        i = [n for n, _ in named].index(target)
        bad_name = target if fault != "name" else "model.layers.1.mlp.experts.9.down_proj.weight"
        bad = {"shape": named[i][1][:-1], "name": named[i][1], "dtype": named[i][1].double()}[fault]
        named[i] = (bad_name, bad)
        assert len(plan_buckets(named, sync.bucket_bytes)) > 3
        # the refusal itself, over HTTP: 400 naming the tensor
        with pytest.raises(SamplerError, match=f"HTTP 400.*{bad_name}"):
            post_json(emb.url(), "/update_weights_from_tensor", {
                "serialized_named_tensors": [serialize_named_tensors([(bad_name, bad)])], "load_format": None,
                "flush_cache": True, "abort_all_requests": False, "weight_version": "7"})
        # through the learner's side: out of service, the other sampler updated
        with pytest.raises(WeightSyncError, match="out of service") as e:
            sync.publish(named, 1)
        assert bad_name in str(e.value) and list(sync.failed) == [emb.url()] and bad_name in sync.failed[emb.url()]
        assert weight_version(emb.url()) == "0" and emb.http._paused and not emb.receiver._staged
        for n, p in emb.engine.model.named_parameters():
            assert torch.equal(p, before[n]), n  # atomic: not one bucket of version 1 swapped in
        assert weight_version(fake.url) == "1" and not fake._paused
        got = post_json(fake.url, "/get_weights_by_name", {"name": "lm_head.weight", "truncate_size": 4})
        assert got == pytest.approx((model.lm_head.weight.detach() + 1).reshape(-1)[:4].tolist())
        sync.publish(model.named_parameters(), 2)  # the failed sampler is left out from now on
        assert weight_version(fake.url) == "2" and weight_version(emb.url()) == "0"
    finally:
        sync.close()
        emb.shutdown()
        fake.shutdown()


@pytest.mark.slow
def test_tensor_bodies_match_the_pinned_release_and_every_tp_rank_decodes_its_entry():
    """The fake records each /update_weights_from_tensor body: exactly the five fields t1async sends,
    all fields of the release's dataclass (required ones present), one serialized entry per TP rank
    (TP=2 and TP=1 servers in one publish), weight_version and flush_cache on the last bucket only.
    Each TP worker process decodes its own entry through the release's SafeUnpickler rule and the
    ranks must agree byte for byte; a list one entry short is refused."""
    import json

    schema = json.loads((FIXTURES / "sglang_schema.json").read_text())
    fields = {f["name"]: f for f in schema["classes"]["UpdateWeightsFromTensorReqInput"]["fields"]}
    assert schema["routes"]["/update_weights_from_tensor"]["body"] == "UpdateWeightsFromTensorReqInput"
    tp2, tp1 = make_fake(tp_size=2), make_fake(tp_size=1)
    model = policy()
    sync = TensorWeightSync(timeout_s=60, bucket_mb=0.1)
    try:
        sync.connect([tp2.url, tp1.url])
        sync.publish(model.named_parameters(), 5)
        n_buckets = len(plan_buckets(model.named_parameters(), sync.bucket_bytes))
        for fake in (tp2, tp1):
            assert weight_version(fake.url) == "5" and len(fake.tensor_bodies) == n_buckets > 1
            for k, body in enumerate(fake.tensor_bodies):
                assert set(body) == TENSOR_BODY and set(body) <= set(fields)
                assert {n for n, f in fields.items() if f["required"]} <= set(body)
                assert len(body["serialized_named_tensors"]) == fake.tp_size
                last = k == n_buckets - 1
                assert body["weight_version"] == ("5" if last else None) and body["flush_cache"] is last
                assert body["load_format"] is None and body["abort_all_requests"] is False
            for name in ("model.embed_tokens.weight", "model.layers.1.mlp.experts.3.up_proj.weight"):
                got = post_json(fake.url, "/get_weights_by_name", {"name": name, "truncate_size": 64})
                assert got == pytest.approx(model.get_parameter(name).detach().reshape(-1)[:64].tolist())
        short = dict(tp2.tensor_bodies[0], serialized_named_tensors=tp2.tensor_bodies[0]["serialized_named_tensors"][:1])
        with pytest.raises(SamplerError, match="HTTP 400.*one per TP rank"):
            post_json(tp2.url, "/update_weights_from_tensor", short)
        with pytest.raises(SamplerError, match="422.*serialized_named_tensors"):
            post_json(tp1.url, "/update_weights_from_tensor", {"load_format": None})
    finally:
        sync.close()
        tp2.shutdown()
        tp1.shutdown()


class _Exploit:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.path}",)


def test_tensor_payload_that_is_not_tensors_is_refused_by_both_and_never_run(tmp_path):
    """A pickle is code: a payload calling os.system is refused (400) by the embedded sampler's
    allow-list and by the fake's copy of SGLang's SafeUnpickler rule, and nothing runs."""
    import base64
    import pickle

    mark = tmp_path / "ran"
    payload = base64.b64encode(pickle.dumps([("lm_head.weight", _Exploit(str(mark)))])).decode()
    body = {"serialized_named_tensors": [payload], "load_format": None, "flush_cache": True,
            "abort_all_requests": False, "weight_version": "1"}
    emb, fake = EmbeddedSampler(CFG, SamplerConfig(), seed=0), make_fake()
    try:
        with pytest.raises(SamplerError, match="HTTP 400.*refused"):
            post_json(emb.url(), "/update_weights_from_tensor", body)
        with pytest.raises(SamplerError, match="HTTP 400.*Blocked unsafe"):
            post_json(fake.url, "/update_weights_from_tensor", body)
        assert not mark.exists() and weight_version(emb.url()) == "-1"
    finally:
        emb.shutdown()
        fake.shutdown()
