"""Embedded samplers over real HTTP + a real gloo weight broadcast from a learner-side model."""

from __future__ import annotations

import time

import pytest
import torch

from t1async.actors.sampler import EmbeddedSampler
from t1async.config import ModelConfig, SamplerConfig
from t1async.models.batch_invariance import column_major_parameters, is_column_major
from t1async.models.logprobs import token_logprobs
from t1async.models.model import Qwen3MoeForCausalLM
from t1async.sampling.sampler_client import HttpSampler, SamplerError, post_json
from t1async.weights.distributed import DistributedWeightSync

CFG = ModelConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
PARAMS = {"max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "stop_token_ids": [3]}


@pytest.fixture()
def samplers():
    ss = [EmbeddedSampler(CFG, SamplerConfig(), seed=i) for i in range(2)]
    yield ss
    for s in ss:
        s.shutdown()


def test_broadcast_reaches_every_sampler_and_answers_match_learner(samplers):
    clients = [HttpSampler(s.url(), num_layers=CFG.num_hidden_layers, top_k=CFG.num_experts_per_tok) for s in samplers]
    with pytest.raises(SamplerError, match="503"):
        clients[0].generate([5, 6, 7], PARAMS)  # no weights yet: refused, not served from random init

    torch.manual_seed(123)
    policy = Qwen3MoeForCausalLM(CFG).eval()
    sync = DistributedWeightSync("gloo", timeout_s=30)
    sync.connect([s.url() for s in samplers])
    sync.publish(policy.named_parameters(), 0)
    for s in samplers:
        for name, p in policy.named_parameters():
            assert torch.equal(p, s.engine.model.get_parameter(name)), name
        assert post_json(s.url(), "/model_info", method="GET")["weight_version"] == "0"

    prompt = [11, 12, 13, 14, 15]
    r = clients[1].generate(prompt, PARAMS)
    assert r.weight_version == 0
    n = len(r.output_ids)
    assert r.routed_experts.shape == (len(prompt) + n - 1, CFG.num_hidden_layers, CFG.num_experts_per_tok)
    # the learner, teacher-forcing the same ids, sees the sampler's log-probs and routing
    ids = torch.tensor([prompt + r.output_ids])
    with torch.no_grad():
        out = policy(ids[:, :-1], return_routing=True)
    lp = token_logprobs(out.logits, ids[:, 1:])[0, len(prompt) - 1:]
    torch.testing.assert_close(lp, torch.tensor(r.logprobs), atol=1e-4, rtol=0)
    assert torch.equal(out.routed_experts[0].sort(-1).values, torch.tensor(r.routed_experts).long().sort(-1).values)

    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01)
    sync.publish(policy.named_parameters(), 1)
    assert all(c.generate(prompt, PARAMS).weight_version == 1 for c in clients)
    assert all(torch.equal(policy.lm_head.weight, s.engine.model.lm_head.weight) for s in samplers)
    for s in samplers:  # the swap kept the engine's layout: every matmul weight column-major, no copy in the pause
        assert all(is_column_major(p) for p in column_major_parameters(s.engine.model).values())
        assert s.engine.model.model.layers[0].mlp.experts[0].down_proj.weight.untyped_storage().data_ptr() in {
            b.untyped_storage().data_ptr() for pool in s.receiver._recv_pools for b in pool}
    sync.close()


def test_bad_generate_requests_get_400_with_reason(samplers):
    url = samplers[0].url()
    with pytest.raises(SamplerError, match="400.*input_ids"):
        post_json(url, "/generate", {"text": "hello"})
    with pytest.raises(SamplerError, match="400.*sampling_params"):
        post_json(url, "/generate", {"input_ids": [1, 2], "sampling_params": {"frequency_penalty": 1.0}})
    with pytest.raises(SamplerError, match="404"):
        post_json(url, "/nope", {})
    with pytest.raises(SamplerError, match="400.*timeout_s must be a positive"):
        post_json(url, "/init_weights_update_group", {"backend": "gloo", "master_address": "127.0.0.1",
                                                      "master_port": 1, "rank_offset": 1, "world_size": 2,
                                                      "group_name": "g", "timeout_s": 0})


def test_sampler_side_of_the_group_gives_up_after_weight_sync_timeout(samplers):
    """weight_sync.timeout_s reaches the sampler too: a receive whose broadcast never comes fails
    after about that long (not the sampler's former fixed 120 s)."""
    url = samplers[0].url()
    sync = DistributedWeightSync("gloo", timeout_s=2.0)
    sync.connect([url])
    try:
        body = {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[CFG.vocab_size, CFG.hidden_size]],
                "group_name": "t1async-weights", "weight_version": "0"}
        t0 = time.monotonic()
        with pytest.raises(SamplerError, match="HTTP 400"):  # the learner never broadcasts this tensor
            post_json(url, "/update_weights_from_distributed", body, timeout_s=30)
        waited = time.monotonic() - t0
        assert 1.5 <= waited < 10, waited
        assert samplers[0].version == -1  # nothing was swapped in
    finally:
        sync.close()


def test_a_packed_policy_publishes_views_not_copies_and_trains_and_saves_unchanged(tmp_path):
    """:func:`pack_parameters` lays the policy out in publish order: every bucket's bytes are then a
    view of the parameters (no concatenation), byte-identical to the copied concatenation; the
    forward, an optimizer step and a checkpoint round trip are unchanged by the packing."""
    import copy

    from t1async.models.model import Qwen3MoeForCausalLM
    from t1async.weights.buckets import pack_parameters, plan_buckets

    cfg = ModelConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    torch.manual_seed(0)
    plain = Qwen3MoeForCausalLM(cfg)
    packed = copy.deepcopy(plain)
    assert pack_parameters(packed)
    ids = torch.randint(0, 64, (1, 12))
    assert torch.equal(packed(ids).logits, plain(ids).logits)
    for m in (plain, packed):  # one identical step each
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        m(ids).logits.logsumexp(-1).sum().backward()
        opt.step()
    buckets = plan_buckets(packed.named_parameters(), 4096)  # several buckets
    assert len(buckets) > 2
    ref = plan_buckets(plain.named_parameters(), 4096)
    storage = next(packed.parameters()).untyped_storage().data_ptr()
    for b, r in zip(buckets, ref):
        flat = b.flatten()
        assert flat.untyped_storage().data_ptr() == storage  # a view of the policy: nothing copied
        assert b.names == r.names and torch.equal(flat, r.flatten())  # the same bytes as the trained unpacked one
        if len(r.tensors) > 1:  # unpacked, several tensors: copied
            assert r.flatten().untyped_storage().data_ptr() != r.tensors[0].untyped_storage().data_ptr()
    assert any(len(r.tensors) > 1 for r in ref)
    packed.save_pretrained(tmp_path / "ckpt")
    back = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert all(torch.equal(p, plain.get_parameter(n)) for n, p in back.named_parameters())
