"""Qwen3-MoE model: HF parity, checkpoints, routing replay (R3), KV cache, padding."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

from t1async.config import ModelConfig
from t1async.models.model import KVCache, Qwen3MoeForCausalLM, model_config_from_hf, model_config_to_hf

CFG = ModelConfig(vocab_size=512, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=48, rope_theta=5000.0)


def _model(cfg: ModelConfig = CFG, seed: int = 0) -> Qwen3MoeForCausalLM:
    """A model with non-trivial norms and a decisive router (no near-ties in top-k, which would
    let 1e-7 float differences between implementations flip an expert)."""
    torch.manual_seed(seed)
    m = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.08)
    return m


def _ids(B=2, T=20, seed=1, vocab=CFG.vocab_size):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (B, T), generator=g)


def _to_hf_layout(sd: dict, hf_keys: set[str], cfg: ModelConfig) -> dict:
    """Our per-expert state dict in whatever layout the installed transformers uses: newer
    transformers (v5) fuse each layer's experts into gate_up_proj [E, 2I, H] / down_proj [E, H, I]."""
    if any(k.endswith("mlp.experts.gate_up_proj") for k in hf_keys):
        out = {k: v for k, v in sd.items() if ".mlp.experts." not in k}
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}.mlp.experts"
            out[f"{p}.gate_up_proj"] = torch.stack([
                torch.cat([sd[f"{p}.{e}.gate_proj.weight"], sd[f"{p}.{e}.up_proj.weight"]], 0)
                for e in range(cfg.num_experts)])
            out[f"{p}.down_proj"] = torch.stack([sd[f"{p}.{e}.down_proj.weight"]
                                                 for e in range(cfg.num_experts)])
        return out
    return dict(sd)


def test_parameter_names_are_hf_names():
    m = Qwen3MoeForCausalLM(CFG)
    keys = set(m.state_dict())
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(CFG.num_hidden_layers):
        p = f"model.layers.{i}."
        expected |= {p + f"self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
        expected |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight", p + "mlp.gate.weight"}
        expected |= {p + f"mlp.experts.{e}.{n}.weight" for e in range(CFG.num_experts)
                     for n in ("gate_proj", "up_proj", "down_proj")}
    assert keys == expected
    assert m.state_dict()["model.layers.0.mlp.gate.weight"].shape == (CFG.num_experts, CFG.hidden_size)
    assert set(dict(m.named_parameters())) == expected


def test_hf_config_round_trip_and_rejects_other_models():
    d = model_config_to_hf(CFG)
    assert d["model_type"] == "qwen3_moe" and d["architectures"] == ["Qwen3MoeForCausalLM"]
    assert d["decoder_sparse_step"] == 1 and d["mlp_only_layers"] == []
    assert model_config_from_hf(d) == CFG
    v5 = {k: v for k, v in d.items() if k != "rope_theta"}
    v5["rope_parameters"] = {"rope_type": "default", "rope_theta": 123.0}
    assert model_config_from_hf(v5).rope_theta == 123.0
    with pytest.raises(ValueError, match="model_type"):
        model_config_from_hf({**d, "model_type": "llama"})
    with pytest.raises(ValueError, match="dense"):
        model_config_from_hf({**d, "mlp_only_layers": [0]})


def test_logits_match_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    m = _model()
    m.save_pretrained(tmp_path)
    hf_cfg = transformers.AutoConfig.from_pretrained(tmp_path)
    hf_cfg._attn_implementation = "eager"
    hf = transformers.Qwen3MoeForCausalLM(hf_cfg).eval()
    hf.load_state_dict(_to_hf_layout(m.state_dict(), set(hf.state_dict()), CFG), strict=True)
    ids = _ids()
    with torch.no_grad():
        ours = m(ids).logits
        theirs = hf(input_ids=ids).logits.float()
    assert (ours - theirs).abs().max().item() < 1e-4


def test_save_pretrained_loads_in_transformers_auto_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    m = _model(seed=3)
    m.save_pretrained(tmp_path)
    cfg_json = json.loads((tmp_path / "config.json").read_text())
    assert cfg_json["torch_dtype"] == "float32" and cfg_json["model_type"] == "qwen3_moe"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).float().eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    ids = _ids(seed=4)
    with torch.no_grad():
        diff = (m(ids).logits - hf(input_ids=ids).logits.float()).abs().max().item()
    assert diff < 1e-4


def test_from_pretrained_accepts_fused_expert_layout(tmp_path):
    m = _model(seed=5)
    m.save_pretrained(tmp_path)
    hf_like = {f"model.layers.{i}.mlp.experts.gate_up_proj" for i in range(CFG.num_hidden_layers)}
    fused = _to_hf_layout(m.state_dict(), hf_like, CFG)
    save_file({k: v.contiguous() for k, v in fused.items()}, str(tmp_path / "model.safetensors"))
    m2 = Qwen3MoeForCausalLM.from_pretrained(tmp_path)
    for k, v in m.state_dict().items():
        assert torch.equal(v, m2.state_dict()[k]), k


@pytest.mark.parametrize("tie", [False, True])
def test_save_load_round_trip(tmp_path, tie):
    cfg = dataclasses.replace(CFG, tie_word_embeddings=tie)
    m = _model(cfg, seed=6)
    m.save_pretrained(tmp_path)
    m2 = Qwen3MoeForCausalLM.from_pretrained(tmp_path).eval()
    assert m2.cfg == cfg
    assert m.state_dict().keys() == m2.state_dict().keys()
    for k, v in m.state_dict().items():
        assert torch.equal(v, m2.state_dict()[k]), k
    if tie:
        assert m2.lm_head.weight is m2.model.embed_tokens.weight
    ids = _ids(seed=7)
    with torch.no_grad():
        assert torch.equal(m(ids).logits, m2(ids).logits)


def test_replay_with_recorded_routing_reproduces_logits():
    m = _model()
    ids = _ids()
    with torch.no_grad():
        rec = m(ids, return_routing=True)
        assert rec.routed_experts.shape == (2, 20, CFG.num_hidden_layers, CFG.num_experts_per_tok)
        assert rec.routed_experts.dtype == torch.int64
        rep = m(ids, routed_experts=rec.routed_experts.to(torch.int32), return_routing=True)
    torch.testing.assert_close(rep.logits, rec.logits, rtol=0, atol=1e-6)
    assert torch.equal(rep.routed_experts, rec.routed_experts)


def test_replay_with_other_experts_changes_logits_and_is_reported():
    m = _model()
    ids = _ids()
    with torch.no_grad():
        rec = m(ids, return_routing=True)
        other = (rec.routed_experts + 1) % CFG.num_experts  # still distinct per token
        rep = m(ids, routed_experts=other, return_routing=True)
    assert torch.equal(rep.routed_experts, other)
    assert (rep.logits - rec.logits).abs().max() > 1e-3


def test_router_gets_gradient_under_replay():
    m = _model().train()
    ids = _ids()
    with torch.no_grad():
        routing = m(ids, return_routing=True).routed_experts
    routing = (routing + 3) % CFG.num_experts  # replay something the router would not choose
    out = m(ids, routed_experts=routing)
    torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, CFG.vocab_size), ids[:, 1:].reshape(-1)).backward()
    for i in range(CFG.num_hidden_layers):
        g = m.model.layers[i].mlp.gate.weight.grad
        assert g is not None and g.abs().sum() > 0, i
    unused = set(range(CFG.num_experts)) - set(routing[:, :, 0].flatten().tolist())
    for e in unused:  # experts not replayed get no gradient
        assert m.model.layers[0].mlp.experts[e].up_proj.weight.grad is None


def test_replay_expert_zero_is_valid():
    m = _model()
    ids = _ids(B=1, T=5)
    r = torch.zeros(1, 5, CFG.num_hidden_layers, CFG.num_experts_per_tok, dtype=torch.long)
    r[..., 1] = 1
    with torch.no_grad():
        out = m(ids, routed_experts=r, return_routing=True)
    assert torch.equal(out.routed_experts, r)


def test_replay_validation_errors():
    m = _model()
    ids = _ids(B=1, T=5)
    L, K = CFG.num_hidden_layers, CFG.num_experts_per_tok
    with pytest.raises(ValueError, match=r"\(1, 5, 3, 2\)"):
        m(ids, routed_experts=torch.zeros(1, 4, L, K, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[0, num_experts=8\)"):
        m(ids, routed_experts=torch.full((1, 5, L, K), 8))
    with pytest.raises(ValueError, match="num_experts"):
        m(ids, routed_experts=torch.full((1, 5, L, K), -1))
    with pytest.raises(ValueError, match="integer"):
        m(ids, routed_experts=torch.zeros(1, 5, L, K))


def test_kv_cache_incremental_decode_matches_full_forward():
    m = _model()
    ids = _ids(B=1, T=24)
    with torch.no_grad():
        full = m(ids, return_routing=True)
        cache = KVCache(capacity=4)  # small on purpose: exercises growth
        parts = [m(ids[:, :10], kv_cache=cache, return_routing=True)]
        for t in range(10, 16):  # one token at a time
            parts.append(m(ids[:, t:t + 1], kv_cache=cache, return_routing=True))
        parts.append(m(ids[:, 16:], kv_cache=cache, return_routing=True))  # chunk after a prefix
    assert cache.seq_len == 24
    inc = torch.cat([p.logits for p in parts], 1)
    torch.testing.assert_close(inc, full.logits, rtol=0, atol=1e-5)
    assert torch.equal(torch.cat([p.routed_experts for p in parts], 1), full.routed_experts)


def test_logits_to_keep_returns_the_last_positions():
    m = _model()
    ids = _ids()
    with torch.no_grad():
        full, last = m(ids), m(ids, logits_to_keep=3)
    assert last.logits.shape == (2, 3, CFG.vocab_size) and last.hidden.shape == full.hidden.shape
    torch.testing.assert_close(last.logits, full.logits[:, -3:], rtol=0, atol=1e-6)


def test_right_padded_batch_needs_no_mask():
    m = _model()
    a, b = _ids(B=1, T=12, seed=8), _ids(B=1, T=7, seed=9)
    batch = torch.cat([a, torch.cat([b, torch.zeros(1, 5, dtype=torch.long)], 1)], 0)
    with torch.no_grad():
        out = m(batch).logits
        torch.testing.assert_close(out[0], m(a).logits[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(out[1, :7], m(b).logits[0], rtol=0, atol=1e-5)


def test_bfloat16_forward_returns_float32_logits():
    m = _model().to(torch.bfloat16)
    with torch.no_grad():
        out = m(_ids(), return_routing=True)
    assert out.logits.dtype == torch.float32 and out.hidden.dtype == torch.bfloat16
    assert torch.isfinite(out.logits).all()


def test_bad_config_raises():
    with pytest.raises(ValueError, match="divide"):
        Qwen3MoeForCausalLM(dataclasses.replace(CFG, num_key_value_heads=3))
