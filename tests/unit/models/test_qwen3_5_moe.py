"""Qwen3.5-MoE text decoder (t1async/models/qwen3_5_moe.py): parity with transformers' own
``Qwen3_5MoeForCausalLM`` in float32 on the same weights, routing replay, the hybrid cache (incremental,
chunked and packed decoding), the embedded engine's prefix cache, config.json in and out, and checkpoints
that transformers loads."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import t1async.models.qwen3_5_moe as q35
from t1async.config import ModelConfig
from t1async.config.model_folder import resolve_model
from t1async.models.hf_folder import ModelFolderError
from t1async.models.model import PackedSegments
from t1async.models.qwen3_5_moe import HybridCache, Qwen3_5MoeForCausalLM, config_from_hf, config_to_hf
from t1async.sampling.engine import Engine, SamplingParams
from tests.support.qwen3_5_moe import TINY_QWEN35

transformers = pytest.importorskip("transformers")

TINY = TINY_QWEN35
L, K = 4, 2


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: on the shared 2-core machine more threads only contend (and a tiny model's
    forward takes 100x longer)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _folder(tmp: Path, d: dict) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(d))
    return tmp


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(ModelConfig, our model, transformers' model) with the same weights: non-trivial norms, decays and
    conv, and a decisive router (no near-ties in top-k for 1e-7 differences to flip)."""
    folder = _folder(tmp_path_factory.mktemp("q35"), config_to_hf(config_from_hf(TINY)))
    cfg = resolve_model(ModelConfig(path=str(folder)))
    torch.manual_seed(0)
    ours = Qwen3_5MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith("norm.weight") or name.endswith(("dt_bias", "A_log")):
                p.add_(0.2 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
            elif name.endswith("conv1d.weight"):
                p.normal_(0.0, 0.3)
            else:
                p.normal_(0.0, 0.04)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder)).eval()
    assert type(hf).__name__ == "Qwen3_5MoeForCausalLM"
    hf.load_state_dict(ours.state_dict(), strict=True)  # same names, experts fused as transformers stores them
    return cfg, ours, hf


def _ids(B: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("B,T", [(2, 48), (1, 150), (2, 512)])  # 1, 3 and 8 chunks of the chunkwise delta rule
def test_log_probs_match_transformers_on_the_same_weights(tiny, B, T):
    _, ours, hf = tiny
    ids = _ids(B, T)
    mask = torch.ones(B, T, dtype=torch.long)
    if B == 2:
        mask[1, 30:] = 0  # right padding: causal, so the real tokens do not see it
        ids[1, 30:] = 0
    with torch.no_grad():
        out = ours(ids, return_routing=True)
        ref = hf(ids, attention_mask=mask).logits
    diff = (out.logits.log_softmax(-1) - ref.float().log_softmax(-1)).abs()[mask.bool()]
    assert diff.max().item() <= 1e-5
    assert out.routed_experts.shape == (B, T, L, K) and out.routed_experts.dtype == torch.int64
    assert out.hidden.shape == (B, T, TINY["hidden_size"])


def test_replaying_the_recorded_routing_reproduces_the_logits_bitwise(tiny):
    _, ours, _ = tiny
    ids = _ids(2, 40, seed=2)
    with torch.no_grad():
        out = ours(ids, return_routing=True)
        again = ours(ids, routed_experts=out.routed_experts.to(torch.int32), return_routing=True)
    assert torch.equal(again.logits, out.logits)
    assert torch.equal(again.routed_experts, out.routed_experts)
    assert torch.equal(again.router_experts, out.routed_experts)


def test_replaying_other_experts_uses_exactly_those_and_the_router_gets_a_gradient(tiny):
    _, ours, _ = tiny
    ids = _ids(1, 24, seed=3)
    with torch.no_grad():
        own = ours(ids, return_routing=True).routed_experts
    other = (own + 3) % TINY["num_experts"]  # distinct ids per row, none of the router's own choice
    out = ours(ids, routed_experts=other, return_routing=True)
    assert torch.equal(out.routed_experts, other)
    assert torch.equal(out.router_experts[:, :, 0], own[:, :, 0])  # later layers see the replayed experts' output
    out.logits.log_softmax(-1)[0, :, 7].sum().backward()
    try:
        for i in range(L):
            g = ours.model.layers[i].mlp.gate.weight.grad
            assert g is not None and g.abs().sum() > 0
    finally:
        ours.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match="routed_experts must have shape"):
        ours(ids, routed_experts=other[:, :, :2])


def test_gradient_checkpointing_gives_the_same_loss_and_gradients(tiny):
    """The learner's activation checkpointing (``model.gradient_checkpointing``) recomputes each layer,
    delta rule and conv included: same loss, same gradients."""
    _, ours, _ = tiny
    ids = _ids(2, 70, seed=9)  # two chunks
    grads = []
    try:
        for ckpt in (False, True):
            ours.model.gradient_checkpointing = ckpt
            loss = ours(ids).logits.log_softmax(-1)[..., 5].sum()
            loss.backward()
            grads.append((loss.detach(), {n: p.grad.clone() for n, p in ours.named_parameters()}))
            ours.zero_grad(set_to_none=True)
    finally:
        ours.model.gradient_checkpointing = False
    (l0, g0), (l1, g1) = grads
    assert torch.equal(l0, l1) and g0.keys() == g1.keys()
    assert all(torch.equal(g0[n], g1[n]) for n in g0)
    assert g0["model.layers.0.linear_attn.A_log"].abs().sum() > 0


def test_new_cache_holds_kv_and_per_linear_layer_conv_and_recurrent_state(tiny):
    _, ours, _ = tiny
    cache = ours.new_cache(16)
    assert isinstance(cache, HybridCache) and cache.truncatable is False and cache.seq_len == 0
    with torch.no_grad():
        ours(_ids(1, 5), kv_cache=cache)
    assert cache.seq_len == 5
    conv_dim = 2 * 2 * 16 + 4 * 16
    assert sorted(cache.conv) == sorted(cache.recurrent) == [0, 1, 2]
    assert all(c.shape == (1, conv_dim, 3) for c in cache.conv.values())
    assert all(s.shape == (1, 4, 16, 16) and s.dtype == torch.float32 for s in cache.recurrent.values())
    assert len(cache._k) == 1 and cache._k[0].shape[2] >= 5  # the one full-attention layer's keys


@pytest.mark.parametrize("splits", [[20] + [1] * 10, [7, 7, 6] + [1] * 10])
def test_incremental_decoding_equals_one_full_forward(tiny, splits):
    _, ours, _ = tiny
    ids = _ids(1, 30, seed=4)
    with torch.no_grad():
        full = ours(ids, return_routing=True)
        cache, logits, routing, a = ours.new_cache(30), [], [], 0
        for n in splits:
            o = ours(ids[:, a:a + n], kv_cache=cache, return_routing=True)
            logits.append(o.logits)
            routing.append(o.routed_experts)
            a += n
    assert (torch.cat(logits, 1) - full.logits).abs().max().item() <= 1e-5
    assert torch.equal(torch.cat(routing, 1), full.routed_experts)


def test_a_packed_forward_equals_each_sequence_fed_alone(tiny):
    """Bitwise, over a schedule mixing prefill chunks and decode steps: each sequence's token mixer runs
    on its own tokens and state, the projections and experts are batch-invariant (row-padded Linear), and
    the few float32 transcendentals over all packed rows are rounded from float64."""
    _, ours, _ = tiny
    seqs = [_ids(1, n, seed=10 + n)[0] for n in (6, 15, 20)]
    steps = [[4, 10, 19], [1, 5, 1], [1, 0, 0]]  # tokens per sequence per forward (0: not in it)
    packed = [ours.new_cache() for _ in seqs]
    alone = [ours.new_cache() for _ in seqs]
    with torch.no_grad():
        for step in steps:
            run = [(i, n) for i, n in enumerate(step) if n]
            ids = torch.cat([seqs[i][packed[i].seq_len:packed[i].seq_len + n] for i, n in run])
            logits, routed = ours.forward_packed(ids, PackedSegments([packed[i] for i, _ in run], [n for _, n in run]))
            a = 0
            for j, (i, n) in enumerate(run):
                one = seqs[i][alone[i].seq_len:alone[i].seq_len + n]
                lo, ro = ours.forward_packed(one, PackedSegments([alone[i]], [n]))
                assert torch.equal(logits[j], lo[0]) and torch.equal(routed[a:a + n], ro)
                a += n
        for s, c in zip(seqs, packed):
            assert c.seq_len == len(s)
            last = ours.forward_packed(s[:1], PackedSegments([c], [1]))[0][0]  # one more token on its cache
            ref = ours(torch.cat([s, s[:1]])[None]).logits[0, -1]
            assert (last - ref).abs().max().item() <= 1e-5


def test_the_engine_answers_a_request_batched_with_others_as_alone(tiny):
    """Continuous batching: three concurrent requests get bitwise the tokens, log-probs and routed experts
    each gets alone."""
    ours = copy.deepcopy(tiny[1])  # an engine re-lays its model's weights (column-major): keep the fixture's
    prompts = [_ids(1, n, seed=20 + n)[0].tolist() for n in (5, 9, 14)]
    params = [SamplingParams(max_new_tokens=4 + i, temperature=1.0, sampling_seed=i) for i in range(3)]
    alone = [Engine(ours, prefix_cache=0, prefill_chunk=4).generate(p, q) for p, q in zip(prompts, params)]
    eng = Engine(ours, prefix_cache=0, prefill_chunk=4)
    reqs = [eng.submit(p, q) for p, q in zip(prompts, params)]
    eng.run_until_done(reqs)
    assert eng.forward_sequences > eng.forwards  # batched
    for r, a in zip(reqs, alone):
        b = r.result()
        assert b.output_ids == a.output_ids and b.output_logprobs == a.output_logprobs
        assert (b.routed_experts == a.routed_experts).all()


def test_engine_prefix_cache_on_and_off_agree_over_a_two_turn_continuation(tiny):
    """A recurrent cache resumes only when its whole sequence is a prefix of the new request; either way the
    tokens, log-probs and routed experts are those of the engine without a prefix cache."""
    ours = copy.deepcopy(tiny[1])  # an engine re-lays its model's weights (column-major): keep the fixture's
    params = SamplingParams(max_new_tokens=6, temperature=1.0, sampling_seed=5)
    prompt = _ids(1, 12, seed=6)[0].tolist()
    cached, plain = Engine(ours, prefix_cache=8), Engine(ours, prefix_cache=0)
    turns = []
    for eng in (cached, plain):
        first = eng.generate(prompt, params)
        nxt = prompt + first.output_ids + [3, 4, 5]  # the sampled ids, then an observation
        diverged = prompt[:6] + [9, 9]  # shares only a part of the cached sequence: not resumable
        turns.append((first, eng.generate(nxt, params), eng.generate(diverged, params)))
    assert cached.cache_hits == 1 and cached.cached_tokens == len(prompt) + len(turns[0][0].output_ids) - 1
    for a, b in zip(*turns):
        assert a.output_ids == b.output_ids
        assert max(abs(x - y) for x, y in zip(a.output_logprobs, b.output_logprobs)) <= 1e-5
        assert a.routed_experts.shape == (a.prompt_tokens + len(a.output_ids) - 1, L, K)
        assert (a.routed_experts == b.routed_experts).all()


def test_save_pretrained_loads_in_transformers_and_back_with_matching_logits(tiny, tmp_path):
    cfg, ours, _ = tiny
    files = ours.save_pretrained(tmp_path)
    assert files == ["model.safetensors"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).float().eval()
    back = Qwen3_5MoeForCausalLM.from_pretrained(tmp_path).eval()
    ids = _ids(1, 20, seed=7)
    with torch.no_grad():
        a, b, c = ours(ids).logits, hf(ids).logits, back(ids).logits
    assert (a.log_softmax(-1) - b.log_softmax(-1)).abs().max().item() <= 1e-5
    assert torch.equal(a, c)


def test_a_checkpoint_with_one_tensor_per_expert_loads_as_the_fused_one(tiny, tmp_path):
    """The routed experts stored per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``, the layout of
    released Qwen MoE checkpoints), in two shards with an index: loaded into the fused parameters, bitwise
    the same model; one expert's tensor missing is refused, naming the parameter it leaves incomplete."""
    cfg, ours, _ = tiny
    _folder(tmp_path, config_to_hf(config_from_hf(TINY)))
    sd: dict[str, torch.Tensor] = {}
    for k, v in ours.state_dict().items():
        if k.endswith("mlp.experts.gate_up_proj"):
            p, inter = k[:-len("gate_up_proj")], v.shape[1] // 2
            for e in range(v.shape[0]):
                sd[f"{p}{e}.gate_proj.weight"], sd[f"{p}{e}.up_proj.weight"] = v[e, :inter].clone(), v[e, inter:].clone()
        elif k.endswith("mlp.experts.down_proj"):
            for e in range(v.shape[0]):
                sd[f"{k[:-len('down_proj')]}{e}.down_proj.weight"] = v[e].clone()
        else:
            sd[k] = v.contiguous()
    assert not any(k.endswith(("gate_up_proj", "experts.down_proj")) for k in sd)
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for f, ks in shards.items():
        save_file({k: sd[k] for k in ks}, str(tmp_path / f))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    back = Qwen3_5MoeForCausalLM.from_pretrained(tmp_path)
    for (k, a), (k2, b) in zip(ours.state_dict().items(), back.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k
    ids = _ids(1, 12, seed=9)
    with torch.no_grad():
        assert torch.equal(back(ids).logits, ours(ids).logits)
    gone = "model.layers.1.mlp.experts.3.up_proj.weight"
    f = next(f for f, ks in shards.items() if gone in ks)
    save_file({k: sd[k] for k in shards[f] if k != gone}, str(tmp_path / f))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    del index["weight_map"][gone]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelFolderError, match="model.layers.1.mlp.experts.gate_up_proj"):
        Qwen3_5MoeForCausalLM.from_pretrained(tmp_path)


def test_a_model_built_from_sizes_saves_a_qwen3_5_config(tmp_path):
    """Without a folder's config.json the saved config is the Qwen3.5 text config, not Qwen3-MoE's."""
    cfg = ModelConfig(vocab_size=256, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16, rope_theta=2000.0)
    m = Qwen3_5MoeForCausalLM(cfg)
    assert m.config.rope_theta == 2000.0
    m.save_pretrained(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    assert d["model_type"] == "qwen3_5_moe_text" and d["rope_parameters"]["rope_theta"] == 2000.0
    assert d["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert torch.equal(Qwen3_5MoeForCausalLM.from_pretrained(tmp_path).lm_head.weight, m.lm_head.weight)


def test_a_conditional_generation_checkpoint_loads_its_text_decoder(tiny, tmp_path, monkeypatch):
    """config.json with a nested text_config (mtp_* keys and the interleaved MRoPE sections inside it,
    vision_config beside it), weights under model.language_model.* plus vision and MTP tensors: the decoder
    loads (as transformers' Qwen3_5MoeForCausalLM loads it: same logits), the rest is skipped, and one
    warning names the ignored keys."""
    cfg, ours, _ = tiny
    text = {**config_to_hf(config_from_hf(TINY)), "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False}
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [1, 1, 0], "mrope_interleaved": True}
    outer = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
             "text_config": text, "image_token_id": 248056, "tie_word_embeddings": False,
             "vision_config": {"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 32,
                               "out_hidden_size": 64}}
    _folder(tmp_path, outer)
    sd = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v.contiguous()
          for k, v in ours.state_dict().items()}
    sd["mtp.fc.weight"] = torch.zeros(2, 2)
    sd["model.visual.patch_embed.proj.weight"] = torch.zeros(2, 2)
    save_file(sd, str(tmp_path / "model.safetensors"))
    monkeypatch.setattr(q35, "_warned", set())
    seen: list[str] = []
    sink = q35.logger.add(lambda m: seen.append(str(m)), level="WARNING")
    try:
        back = Qwen3_5MoeForCausalLM.from_pretrained(tmp_path)
        config_from_hf(outer)  # the same keys again: no second warning
    finally:
        q35.logger.remove(sink)
    assert len(seen) == 1
    for key in ("image_token_id", "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings", "vision_config"):
        assert key in seen[0]
    assert back.config == ours.config and back.routed_layers == L
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).float().eval()  # its text decoder, too
    ids = _ids(1, 10, seed=8)
    with torch.no_grad():
        a, b = back(ids).logits, hf(ids).logits
        assert torch.equal(a, ours(ids).logits)
    assert (a.log_softmax(-1) - b.log_softmax(-1)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("edit,match", [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling"),
    ({"layer_types": ["linear_attention"] * 3}, "layer_types"),
    ({"layer_types": ["linear_attention"] * 3 + ["sliding_attention"]}, "layer_types"),
    ({"linear_num_key_heads": 3}, "linear_num_key_heads"),
])
def test_config_from_hf_refuses_what_it_cannot_run_naming_the_key(edit, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf({**TINY, **edit})


def test_config_round_trips_and_the_default_layer_pattern_is_transformers(tmp_path):
    c = config_from_hf(TINY)
    assert config_from_hf(config_to_hf(c)) == c
    hf = transformers.AutoConfig.from_pretrained(_folder(tmp_path, config_to_hf(c)))
    assert list(hf.layer_types) == list(c.layer_types) and hf.rope_parameters["rope_theta"] == 5000.0
    d = {k: v for k, v in TINY.items() if k != "layer_types"} | {"num_hidden_layers": 8}
    assert list(config_from_hf(d).layer_types) == list(transformers.Qwen3_5MoeTextConfig(**d).layer_types)


def test_a_model_config_that_disagrees_with_its_config_json_is_refused():
    """cfg's sizes are what the engine and the replay checks read: they must be the decoder's."""
    d = config_to_hf(config_from_hf(TINY))
    with pytest.raises(ValueError, match="num_experts=8 .* num_experts=16"):
        Qwen3_5MoeForCausalLM(ModelConfig(vocab_size=512, hidden_size=64, num_hidden_layers=4,
                                          hf_config={**d, "num_experts": 16}))
