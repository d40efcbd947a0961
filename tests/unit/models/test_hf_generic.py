"""The generic transformers path (t1async/models/hf_generic.py) on a tiny random glm4_moe, float32."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors import safe_open

transformers = pytest.importorskip("transformers")

from t1async.models.hf_generic import HFMoeForCausalLM, adapter_for  # noqa: E402
from t1async.models.model import PackedSegments  # noqa: E402

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
            topk_group=1, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
            max_position_embeddings=256)


def _hf(**kw):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.Glm4MoeConfig(**{**TINY, **kw}),
                                                       dtype=torch.float32)
    with torch.no_grad():  # a bias that matters for the choice, as a trained GLM's does
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    return hf


@pytest.fixture(scope="module")
def model():
    return HFMoeForCausalLM.wrap(_hf())


def _ids(B=2, T=9, seed=1):
    return torch.randint(0, 512, (B, T), generator=torch.Generator().manual_seed(seed))


def test_record_matches_transformers_forward_and_router_choice(model):
    ids = _ids()
    seen = []
    hooks = [model.hf.model.layers[i].mlp.gate.register_forward_hook(lambda m, a, out: seen.append(out[2].clone()))
             for i in (1, 2)]
    try:
        with torch.no_grad():
            out = model(ids, return_routing=True)
            n = len(seen)
            ref = model.hf(ids).logits.float()  # transformers alone: our hooks pass through outside our forward
    finally:
        for h in hooks:
            h.remove()
    assert model.routed_layers == 2 and model.cfg.num_experts == 8
    assert torch.equal(out.logits.log_softmax(-1), ref.log_softmax(-1))
    assert out.routed_experts.shape == (2, 9, 2, 2) and out.routed_experts.dtype == torch.int64
    chosen = torch.stack([s.view(2, 9, 2) for s in seen[:n]], 2)
    assert torch.equal(out.routed_experts, chosen) and torch.equal(out.router_experts, chosen)
    assert torch.equal(torch.stack([s.view(2, 9, 2) for s in seen[n:]], 2), chosen)  # transformers chose the same


def test_replay_recorded_is_bitwise_and_other_ids_are_used_with_router_gradient(model):
    ids = _ids()
    with torch.no_grad():
        rec = model(ids, return_routing=True)
        again = model(ids, routed_experts=rec.routed_experts.to(torch.int32), return_routing=True)
    assert torch.equal(again.logits, rec.logits) and torch.equal(again.routed_experts, rec.routed_experts)

    g = torch.Generator().manual_seed(3)  # distinct valid ids per row, mostly not the router's
    other = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(2 * 9 * 2)]).view(2, 9, 2, 2)
    block = model.hf.model.layers[2].mlp
    io = {}
    h = block.register_forward_hook(lambda m, a, out: io.update(x=a[0].detach(), y=out.detach()))
    try:
        out = model(ids, routed_experts=other, return_routing=True)
    finally:
        h.remove()
    assert torch.equal(out.routed_experts, other)
    assert not torch.equal(out.router_experts, other)
    # layer 2's MoE block by hand: sigmoid scores at the given ids, normalised, scaled; experts from their weights
    x = io["x"].reshape(-1, 64)
    s = torch.sigmoid(x @ block.gate.weight.T).gather(1, other[:, :, 1].reshape(-1, 2))
    w = s / s.sum(-1, keepdim=True) * 2.5
    ex = block.experts
    y = block.shared_experts(x)
    for k in range(2):
        e = other[:, :, 1, k].reshape(-1)
        gate, up = torch.einsum("nh,nih->ni", x, ex.gate_up_proj[e]).chunk(2, -1)
        y = y + w[:, k:k + 1] * torch.einsum("ni,nhi->nh", torch.nn.functional.silu(gate) * up, ex.down_proj[e])
    torch.testing.assert_close(io["y"].reshape(-1, 64), y, atol=1e-5, rtol=1e-5)
    out.logits.log_softmax(-1)[..., 0].sum().backward()
    for i in (1, 2):
        gw = model.hf.model.layers[i].mlp.gate.weight.grad
        assert gw is not None and gw.abs().sum() > 0
    assert not model.hf.model.layers[1].mlp.gate.e_score_correction_bias.requires_grad  # a buffer in GLM
    model.zero_grad(set_to_none=True)


def test_replay_survives_gradient_checkpointing_and_a_deep_copy(model):
    ids = _ids(seed=5)
    g = torch.Generator().manual_seed(4)
    other = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(2 * 9 * 2)]).view(2, 9, 2, 2)
    out = model(ids, routed_experts=other)
    out.logits.sum().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    model.model.gradient_checkpointing = True
    try:
        ck = model(ids, routed_experts=other)
        model(ids)  # another forward before the backward: the recompute must still replay `other`
        ck.logits.sum().backward()
    finally:
        model.model.gradient_checkpointing = False
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], atol=1e-6, rtol=1e-5, msg=n)
    model.zero_grad(set_to_none=True)
    trunk = copy.deepcopy(model.model)  # the critic's warm start: its hooks record into its own state
    hidden, used, _ = trunk(ids, torch.arange(9).expand(2, 9), None, None)
    torch.testing.assert_close(hidden, model.model(ids, torch.arange(9).expand(2, 9), None, None)[0])
    assert used.shape == (2, 9, 2, 2)


def test_incremental_decoding_and_packed_forward_match_full_forward(model):
    ids = _ids(B=1, T=12, seed=7)
    with torch.no_grad():
        full = model(ids, return_routing=True)
        cache = model.new_cache(12)
        assert cache.truncatable and cache.seq_len == 0
        pre = model(ids[:, :8], kv_cache=cache, return_routing=True, logits_to_keep=1)
        steps = [pre.logits[:, -1]]
        routed = [pre.routed_experts]
        for t in range(8, 12):
            o = model(ids[:, t:t + 1], kv_cache=cache, return_routing=True)
            steps.append(o.logits[:, -1])
            routed.append(o.routed_experts)
        assert cache.seq_len == 12
        torch.testing.assert_close(torch.stack(steps, 1), full.logits[:, 7:], atol=1e-5, rtol=0)
        assert torch.equal(torch.cat(routed, 1), full.routed_experts)
        cache.seq_len = 8  # rollback, then the same continuation again
        o = model(ids[:, 8:12], kv_cache=cache, return_routing=True)
        torch.testing.assert_close(o.logits, full.logits[:, 8:], atol=1e-5, rtol=0)
        with pytest.raises(ValueError, match="only be set lower"):
            cache.seq_len = 20

        a, b = _ids(B=1, T=5, seed=8)[0], _ids(B=1, T=3, seed=9)[0]
        ca, cb = model.new_cache(), model.new_cache()
        model.forward_packed(a[:4], PackedSegments([ca], [4]))
        logits, rows = model.forward_packed(torch.cat([a[4:], b]), PackedSegments([ca, cb], [1, 3]))
        alone_a, alone_b = model(a[None], return_routing=True), model(b[None], return_routing=True)
        lone_logits, lone_rows = model.forward_packed(b, PackedSegments([model.new_cache()], [3]))
    assert torch.equal(logits[1], lone_logits[0]) and torch.equal(rows[1:], lone_rows)  # b fed alone
    torch.testing.assert_close(logits[0], alone_a.logits[0, -1], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits[1], alone_b.logits[0, -1], atol=1e-5, rtol=0)
    assert torch.equal(rows[0], alone_a.routed_experts[0, 4]) and torch.equal(rows[1:], alone_b.routed_experts[0])
    with pytest.raises(ValueError, match="sum to"):
        model.forward_packed(b, PackedSegments([model.new_cache()], [2]))


def test_unsupported_model_type_is_refused_in_one_line():
    with pytest.raises(ValueError) as e:
        adapter_for("mixtral")
    msg = str(e.value)
    assert "\n" not in msg and "'mixtral'" in msg and "supported model types: glm4_moe" in msg
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, num_local_experts=2)
    with pytest.raises(ValueError, match="supported model types: glm4_moe"):
        HFMoeForCausalLM.wrap(transformers.AutoModelForCausalLM.from_config(cfg))


def test_from_pretrained_and_save_pretrained_round_trip_through_transformers(tmp_path, model):
    model.save_pretrained(tmp_path / "a")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "a", dtype=torch.float32)
    back = HFMoeForCausalLM.from_pretrained(tmp_path / "a")
    assert back.routed_layers == back.cfg.routed_layers == 2 and back.cfg.num_experts == 8
    assert back.cfg.path == str(tmp_path / "a")
    with torch.device("meta"):  # the run's ModelConfig builds the same architecture (a families.build)
        shell = HFMoeForCausalLM(back.cfg)
    assert {k: v.shape for k, v in shell.state_dict().items()} == {k: v.shape for k, v in model.state_dict().items()}
    assert back.state_dict().keys() == model.state_dict().keys() == hf.state_dict().keys()
    with safe_open(str(tmp_path / "a" / "model.safetensors"), "pt") as f:  # transformers' checkpoint layout
        written = {k: f.get_tensor(k) for k in f.keys()}
    mine = model.checkpoint_state_dict()
    assert mine.keys() == written.keys() and "model.layers.1.mlp.experts.7.down_proj.weight" in mine
    assert all(torch.equal(mine[k], written[k]) for k in written)
    ids = _ids(seed=11)
    with torch.no_grad():
        ref = model(ids, return_routing=True)
        got = back(ids, return_routing=True)
        theirs = hf(ids).logits
    assert torch.equal(got.logits, ref.logits) and torch.equal(got.routed_experts, ref.routed_experts)
    assert torch.equal(theirs, ref.logits)
    back.save_pretrained(tmp_path / "b")
    again = HFMoeForCausalLM.from_pretrained(tmp_path / "b")
    for (k, v), w in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(v, w), k
