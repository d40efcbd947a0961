"""Continuous batching is exact per sequence: batched == alone, bitwise, for ids, log-probs,
routed experts and weight versions; weight swaps wait for in-flight requests."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from t1async.actors.sampler import EmbeddedSampler
from t1async.config import ModelConfig, SamplerConfig
from t1async.models.model import KVCache, PackedSegments, Qwen3MoeForCausalLM
from t1async.sampling.engine import Engine, GenerateOutput, SamplingParams
from t1async.sampling.sampler_client import HttpSampler

# default init (std 0.02): routers are close to ties, so any numerical difference that batching
# introduced would flip some expert or sampled id somewhere in these runs
CFG = ModelConfig(vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=48, max_position_embeddings=256)
L, K = CFG.num_hidden_layers, CFG.num_experts_per_tok


def _model(dtype=torch.float32, seed: int = 0) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(CFG).to(dtype).eval()


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(4, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# prompts of different lengths; different limits, stop ids and filters, so sequences finish apart
REQUESTS = [
    (_prompt(3, 1), SamplingParams(max_new_tokens=9, temperature=1.0, sampling_seed=11)),
    (_prompt(23, 2), SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.9, top_k=20, sampling_seed=12)),
    (_prompt(11, 3), SamplingParams(max_new_tokens=14, temperature=1.3, sampling_seed=13,
                                    stop_token_ids=list(range(4, 40)))),
    (_prompt(40, 4), SamplingParams(max_new_tokens=6, temperature=0.0)),
    (_prompt(1, 5), SamplingParams(max_new_tokens=12, temperature=1.0, top_k=7, sampling_seed=15)),
]


def assert_same(a: GenerateOutput, b: GenerateOutput) -> None:
    """Bitwise equal answers."""
    assert a.output_ids == b.output_ids
    assert a.output_logprobs == b.output_logprobs  # Python floats: exact equality
    assert a.finish_reason == b.finish_reason and a.prompt_tokens == b.prompt_tokens
    assert a.weight_version == b.weight_version
    assert a.routed_experts.dtype == b.routed_experts.dtype and a.routed_experts.shape == b.routed_experts.shape
    np.testing.assert_array_equal(a.routed_experts, b.routed_experts)


def test_packed_forward_is_bitwise_the_lone_forward():
    m = _model()
    chunks = [_prompt(n, 20 + n) for n in (1, 2, 3, 5, 9, 17)]
    with torch.no_grad():
        alone = []
        for ids in chunks:
            lg, rows = m.forward_packed(torch.tensor(ids), PackedSegments([KVCache()], [len(ids)]))
            alone.append((lg[0], rows))
        caches = [KVCache() for _ in chunks]
        lg, rows = m.forward_packed(torch.tensor([t for c in chunks for t in c]),
                                    PackedSegments(caches, [len(c) for c in chunks]))
    a = 0
    for i, ids in enumerate(chunks):
        assert torch.equal(lg[i], alone[i][0])
        assert torch.equal(rows[a:a + len(ids)], alone[i][1])
        assert caches[i].seq_len == len(ids)
        a += len(ids)
    with pytest.raises(ValueError, match="sum to"):
        m.forward_packed(torch.tensor([1, 2, 3]), PackedSegments([KVCache()], [2]))
    c = KVCache()
    with pytest.raises(ValueError, match="twice"):
        m.forward_packed(torch.tensor([1, 2]), PackedSegments([c, c], [1, 1]))


@pytest.mark.parametrize("dtype,chunk", [(torch.float32, 0), (torch.float32, 5), (torch.bfloat16, 0)])
def test_batched_equals_alone_per_sequence(dtype, chunk):
    m = _model(dtype)
    alone = []
    for ids, p in REQUESTS:
        alone.append(Engine(m, seed=3, prefill_chunk=chunk).generate(ids, p, routed_experts_start_len=len(ids) // 2))
    e = Engine(m, seed=3, prefill_chunk=chunk)
    reqs = [e.submit(ids, p, routed_experts_start_len=len(ids) // 2) for ids, p in REQUESTS[:3]]
    e.step()
    e.step()  # the last two join mid-flight, while the first ones decode
    reqs += [e.submit(ids, p, routed_experts_start_len=len(ids) // 2) for ids, p in REQUESTS[3:]]
    sizes = []
    while not all(r.done.is_set() for r in reqs):
        sizes.append(e.step())
    assert max(sizes) == len(REQUESTS) and e.forward_sequences > e.forwards  # really batched
    assert len({len(r.result().output_ids) for r in reqs}) >= 3  # and finished at different steps
    for r, a in zip(reqs, alone):
        assert_same(r.result(), a)


def test_engine_drawn_seeds_follow_submission_order():
    """Without sampling_seed each request's generator is seeded from the engine's generator in
    submission order: a batch equals the same requests sent one after another."""
    m = _model()
    p = SamplingParams(max_new_tokens=10, temperature=1.0)
    prompts = [_prompt(n, 40 + n) for n in (4, 9, 2, 15)]
    serial = Engine(m, seed=5)
    alone = [serial.generate(ids, p) for ids in prompts]
    e = Engine(m, seed=5)
    reqs = [e.submit(ids, p) for ids in prompts]
    e.run_until_done(reqs)
    for r, a in zip(reqs, alone):
        assert_same(r.result(), a)
    assert len({tuple(a.output_ids) for a in alone}) == len(prompts)


def test_multi_turn_episodes_batched_equal_alone_with_prefix_cache():
    m = _model()
    p = SamplingParams(max_new_tokens=7, temperature=1.0, stop_token_ids=[5, 6, 7])

    def episodes(e: Engine, concurrent: bool) -> list[list[GenerateOutput]]:
        streams = [_prompt(n, 60 + n) for n in (6, 13, 3)]
        outs: list[list[GenerateOutput]] = [[] for _ in streams]
        for turn in range(3):
            params = [SamplingParams(**{**p.__dict__, "sampling_seed": 100 * turn + i}) for i in range(len(streams))]
            if concurrent:
                reqs = [e.submit(s, q) for s, q in zip(streams, params)]
                e.run_until_done(reqs)
                res = [r.result() for r in reqs]
            else:
                res = [e.generate(s, q) for s, q in zip(streams, params)]
            for i, r in enumerate(res):
                outs[i].append(r)
                streams[i] = streams[i] + r.output_ids + [1, 2 + turn]  # observation tokens
        return outs

    batched, ref = Engine(m), Engine(m)
    b, a = episodes(batched, True), episodes(ref, False)
    assert batched.cache_hits == ref.cache_hits == 6  # every later turn reused its prefix
    for eb, ea in zip(b, a):
        for x, y in zip(eb, ea):
            assert_same(x, y)


def test_weight_swap_waits_for_in_flight_requests():
    m = _model()
    new = _model(seed=9).state_dict()
    p = SamplingParams(max_new_tokens=30, temperature=1.0, sampling_seed=1)
    ids = _prompt(8, 77)
    before = Engine(_model()).generate(ids, p)
    e = Engine(m)
    e.start()
    try:
        with e.between_requests():
            e.weight_version = 4
        first = e.submit(ids, p)
        while e.forwards == 0:  # in flight
            threading.Event().wait(0.001)
        with e.between_requests():  # returns only after `first` finished
            assert first.done.is_set()
            m.load_state_dict(new)
            e.weight_version = 5
        second = e.submit(ids, p)
        assert_same(first.result(timeout=60), GenerateOutput(**{**before.__dict__, "weight_version": 4}))
        after = second.result(timeout=60)
        assert after.weight_version == 5 and after.output_logprobs != before.output_logprobs
        ref = Engine(_model(seed=9)).generate(ids, p)
        assert after.output_ids == ref.output_ids and after.output_logprobs == ref.output_logprobs
    finally:
        e.stop()


def test_weights_written_mid_request_fail_it_loudly():
    m = _model()
    e = Engine(m)
    r = e.submit(_prompt(5, 1), SamplingParams(max_new_tokens=5))
    e.step()
    with torch.no_grad():
        m.lm_head.weight.mul_(2.0)  # outside between_requests
    e.run_until_done([r])
    with pytest.raises(RuntimeError, match="between_requests"):
        r.result()
    assert e.generate(_prompt(5, 1), SamplingParams(max_new_tokens=2)).output_ids  # still serving


def test_http_sampler_batches_concurrent_requests_exactly():
    s = EmbeddedSampler(CFG, SamplerConfig(), seed=0)
    try:
        s.load_weights(_model().state_dict(), 3)
        client = HttpSampler(s.url(), num_layers=L, top_k=K)
        want = [Engine(_model()).generate(ids, p) for ids, p in REQUESTS]
        got: list = [None] * len(REQUESTS)
        barrier = threading.Barrier(len(REQUESTS))

        def run(i: int) -> None:
            ids, p = REQUESTS[i]
            barrier.wait()
            got[i] = client.generate(ids, {k: v for k, v in p.__dict__.items() if v is not None})

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(REQUESTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for g, w in zip(got, want):
            assert g.output_ids == w.output_ids and g.weight_version == 3
            np.testing.assert_array_equal(np.asarray(g.logprobs, np.float32), np.asarray(w.output_logprobs, np.float32))
            np.testing.assert_array_equal(g.routed_experts, w.routed_experts)
        assert s.stats()["forward_sequences"] > s.stats()["forwards"]  # some forwards carried several
    finally:
        s.shutdown()


def test_stop_fails_requests_still_queued_instead_of_leaving_their_callers_waiting():
    """Engine.stop: a request queued behind a running one (max_batch 1) and the running one
    are finished with EngineStopped, so a caller blocked in result() wakes up with an error."""
    from t1async.sampling.engine import EngineStopped

    e = Engine(_model(), max_batch=1)
    p = SamplingParams(max_new_tokens=200, stop_token_ids=[])
    first = e.submit(_prompt(5, 1), p)
    second = e.submit(_prompt(5, 2), p)
    e.step()  # `first` is now running, `second` waits for its slot
    e.stop()  # no thread was started: nothing else would ever finish them
    for req in (first, second):
        assert req.done.is_set()
        with pytest.raises(EngineStopped, match="engine was stopped"):
            req.result(timeout=0)
