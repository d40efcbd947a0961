"""The Megatron-core learner backend against the torch one: the weight converter (bitwise), forward
parity with and without routing replay, RECORD vs the torch model's routing, one learner step,
checkpoints, and multi-process expert- and tensor-parallel runs over gloo (CPU)."""

from __future__ import annotations

import dataclasses
import json
import socket
import warnings

import numpy as np
import pytest
import torch
from test_learner import assert_same_metrics, weight_gap

from t1async.config import GenerationConfig, LearnerConfig, ModelConfig, TransportConfig, WeightSyncConfig
from t1async.learner.megatron.families.convert import CRITIC, POLICY, hf_to_megatron, megatron_to_hf, merge_tp, pack_qkv, shard_tp
from t1async.learner.rl import routing_differs
from t1async.learner.torch_backend import TorchBackend, ValueModel
from t1async.models.logprobs import EMBEDDED, SGLANG, token_logprobs
from t1async.models.model import Qwen3MoeForCausalLM

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
megatron_backend = pytest.importorskip("t1async.learner.megatron.backend", reason="megatron-core is not installed")
MegatronBackend = megatron_backend.MegatronBackend

# 4 query heads in 2 groups (the qkv layout matters), head_dim != hidden / heads, 4 experts top-2
MODEL = ModelConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, rope_theta=5000.0)


def _hf(cfg: ModelConfig = MODEL, seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: torch.randn_like(v) for k, v in Qwen3MoeForCausalLM(cfg).state_dict().items()}


def _distinct_rows(B: int, T: int, cfg: ModelConfig = MODEL, seed: int = 0) -> torch.Tensor:
    """[B, T, L, K] expert ids, K distinct per row (as a sampler records)."""
    g = torch.Generator().manual_seed(seed)
    n = B * T * cfg.num_hidden_layers
    rows = torch.stack([torch.randperm(cfg.num_experts, generator=g)[:cfg.num_experts_per_tok] for _ in range(n)])
    return rows.view(B, T, cfg.num_hidden_layers, cfg.num_experts_per_tok)


# ----------------------------------------------------------------------------- converter


@pytest.mark.parametrize("ep,pp", [(1, 1), (2, 1), (1, 2), (4, 2)])
def test_converter_round_trip_is_bitwise_across_simulated_expert_and_pipeline_ranks(ep, pp):
    hf = _hf()
    for layout, sd in ((POLICY, hf), (CRITIC, ValueModel(Qwen3MoeForCausalLM(MODEL)).state_dict())):
        sd = {k: torch.randn_like(v) for k, v in sd.items()}
        back: dict[str, torch.Tensor] = {}
        for pr in range(pp):
            for er in range(ep):
                mg = hf_to_megatron(sd, MODEL, layout, ep_rank=er, ep_size=ep, pp_rank=pr, pp_size=pp)
                assert sum(k.startswith("decoder.layers.") and k.endswith("input_layernorm.weight") for k in mg) == 2 // pp
                for k, v in megatron_to_hf(mg, MODEL, layout, ep_rank=er, ep_size=ep, pp_rank=pr, pp_size=pp).items():
                    assert k not in back or torch.equal(back[k], v)  # shared weights identical on every EP rank
                    back[k] = v
        assert back.keys() == sd.keys()
        assert all(torch.equal(back[k], sd[k]) and back[k].dtype == sd[k].dtype for k in sd)


def test_converter_layouts_match_megatron_conventions():
    hf = _hf()
    mg = hf_to_megatron(hf, MODEL, ep_rank=1, ep_size=2, pp_rank=1, pp_size=2)
    hd, per = MODEL.head_dim, MODEL.num_attention_heads // MODEL.num_key_value_heads
    qkv = mg["decoder.layers.0.self_attention.linear_qkv.weight"]  # global layer 1 (pipeline offset 1)
    q, k, v = (hf[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
    for g in range(MODEL.num_key_value_heads):  # group g: its query heads, then k_g, then v_g
        rows = qkv[g * (per + 2) * hd:(g + 1) * (per + 2) * hd]
        assert torch.equal(rows[:per * hd], q[g * per * hd:(g + 1) * per * hd])
        assert torch.equal(rows[per * hd:(per + 1) * hd], k[g * hd:(g + 1) * hd])
        assert torch.equal(rows[(per + 1) * hd:], v[g * hd:(g + 1) * hd])
    assert torch.equal(qkv, pack_qkv(q, k, v, MODEL))
    # EP rank 1 of 2 holds global experts 2, 3 as local 0, 1; fc1 = cat(gate, up), fc2 = down
    fc1 = mg["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"]
    e2 = "model.layers.1.mlp.experts.2."
    assert torch.equal(fc1, torch.cat([hf[e2 + "gate_proj.weight"], hf[e2 + "up_proj.weight"]]))
    assert torch.equal(mg["decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"],
                       hf["model.layers.1.mlp.experts.3.down_proj.weight"])
    assert torch.equal(mg["decoder.layers.0.mlp.router.weight"], hf["model.layers.1.mlp.gate.weight"])
    assert torch.equal(mg["decoder.layers.0.pre_mlp_layernorm.weight"], hf["model.layers.1.post_attention_layernorm.weight"])
    assert "embedding.word_embeddings.weight" not in mg and "output_layer.weight" in mg  # last stage only
    with pytest.raises(KeyError, match="no HF name"):
        megatron_to_hf({"decoder.layers.0.mlp.experts.linear_fc1.weight": fc1}, MODEL)


@pytest.mark.parametrize("tp,ep", [(2, 1), (4, 1), (2, 2)])
def test_tensor_parallel_slices_merge_back_bitwise_and_follow_megatrons_layout(tp, ep):
    """shard_tp then merge_tp is the identity (every name, bit for bit, dtype kept) for the policy
    and the critic; the slices are Megatron's: rank r holds query groups [r G/TP, (r+1) G/TP) of
    linear_qkv, columns of linear_proj and linear_fc2, rows r of the vocabulary, and
    [gate_r; up_r] of linear_fc1; norms, router and the critic's head are whole everywhere."""
    cfg = dataclasses.replace(MODEL, num_attention_heads=8, num_key_value_heads=4)
    torch.manual_seed(1)
    for layout, sd in ((POLICY, Qwen3MoeForCausalLM(cfg).state_dict()),
                       (CRITIC, ValueModel(Qwen3MoeForCausalLM(cfg)).state_dict())):
        sd = {j: torch.randn_like(v) for j, v in sd.items()}
        for er in range(ep):
            whole = hf_to_megatron(sd, cfg, layout, ep_rank=er, ep_size=ep)
            parts = [shard_tp(whole, layout, r, tp) for r in range(tp)]
            back = merge_tp(parts, layout)
            assert back.keys() == whole.keys()
            assert all(torch.equal(back[j], whole[j]) and back[j].dtype == whole[j].dtype for j in whole)
            hd, per, G = cfg.head_dim, cfg.num_attention_heads // cfg.num_key_value_heads, cfg.num_key_value_heads
            qkv = whole["decoder.layers.1.self_attention.linear_qkv.weight"]
            fc1 = whole["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"]
            gate, up = fc1.chunk(2)
            j = cfg.moe_intermediate_size // tp
            for r, part in enumerate(parts):
                rows = (per + 2) * hd * (G // tp)
                assert torch.equal(part["decoder.layers.1.self_attention.linear_qkv.weight"], qkv[r * rows:(r + 1) * rows])
                assert torch.equal(part["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"],
                                   torch.cat([gate[r * j:(r + 1) * j], up[r * j:(r + 1) * j]]))
                cols = cfg.num_attention_heads * hd // tp
                assert torch.equal(part["decoder.layers.1.self_attention.linear_proj.weight"],
                                   whole["decoder.layers.1.self_attention.linear_proj.weight"][:, r * cols:(r + 1) * cols])
                assert torch.equal(part["decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight"],
                                   whole["decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight"][:, r * j:(r + 1) * j])
                v = cfg.vocab_size // tp
                assert torch.equal(part["embedding.word_embeddings.weight"],
                                   whole["embedding.word_embeddings.weight"][r * v:(r + 1) * v])
                for k in ("decoder.layers.0.mlp.router.weight", "decoder.layers.0.self_attention.q_layernorm.weight",
                          "decoder.final_layernorm.weight"):
                    assert part[k] is whole[k]
                if layout is CRITIC:
                    assert part["output_layer.weight"] is whole["output_layer.weight"]  # the value head: whole
                else:
                    assert torch.equal(part["output_layer.weight"], whole["output_layer.weight"][r * v:(r + 1) * v])
    with pytest.raises(ValueError, match="must divide dimension 0"):
        shard_tp(hf_to_megatron(_hf(), MODEL), POLICY, 0, 3)


# ----------------------------------------------------------------------------- replay rows


def test_replay_rows_are_sequence_major_with_spread_distinct_padding_and_refuse_repeated_ids():
    r = _distinct_rows(2, 5)
    rows = megatron_backend.replay_rows(r, MODEL.num_experts, lengths=torch.tensor([5, 3]))
    assert len(rows) == MODEL.num_hidden_layers and rows[0].shape == (10, 2)
    assert torch.equal(rows[1][2 * 4 + 0], r[0, 4, 1]) and torch.equal(rows[1][2 * 1 + 1], r[1, 1, 1])  # s * B + b
    # the two padded positions (sequence 1, tokens 3 and 4) take distinct, spread rows: slots 0-1, 2-3
    assert torch.equal(rows[0][2 * 3 + 1], torch.tensor([0, 1])) and torch.equal(rows[0][2 * 4 + 1], torch.tensor([2, 3]))
    ep2 = megatron_backend.replay_rows(r, MODEL.num_experts, lengths=torch.tensor([5, 3]), expert_parallel=2)
    # over 2 expert-parallel ranks (experts 0-1, 2-3) consecutive slots alternate ranks
    assert torch.equal(ep2[1][2 * 3 + 1], torch.tensor([0, 2])) and torch.equal(ep2[1][2 * 4 + 1], torch.tensor([1, 3]))
    r[1, 2, 0] = torch.tensor([3, 3])
    with pytest.raises(ValueError, match="sequence 1, token 2, layer 0.*distinct"):
        megatron_backend.replay_rows(r, MODEL.num_experts)


def test_deal_rows_gives_each_rank_a_contiguous_chunk_filled_up_with_row_0():
    deal = megatron_backend.deal_rows
    assert [c.tolist() for c in deal(5, 2)] == [[0, 1, 2], [3, 4, 0]]
    assert [c.tolist() for c in deal(1, 2)] == [[0], [0]]  # rank 1: a dummy row only
    assert [c.tolist() for c in deal(4, 2)] == [[0, 1], [2, 3]]
    assert [c.tolist() for c in deal(5, 4)] == [[0, 1], [2, 3], [4, 0], [0, 0]]
    assert [c.tolist() for c in deal(3, 1)] == [[0, 1, 2]]
    with pytest.raises(ValueError, match="must be >= 1"):
        deal(0, 2)


# ----------------------------------------------------------------------------- parity


def _backends(generation=GenerationConfig(), kl_coef=0.0, semantics=EMBEDDED):
    """Both backends from the same seeded init; the critic head made non-zero (same in both)."""
    cfg = LearnerConfig(kl_coef=kl_coef)
    torch.manual_seed(0)
    tb = TorchBackend(cfg, MODEL, generation, semantics=semantics)
    with torch.no_grad():
        for n, p in tb.policy.named_parameters():  # a decisive router: no near-ties to flip on 1e-7
            if n.endswith("mlp.gate.weight"):
                p.normal_(0.0, 1.0)
        tb.critic.head.weight.normal_(0.0, 0.5)
        tb.critic.head.bias.fill_(0.3)
    torch.manual_seed(0)  # the same init as tb's before the edit (its KL reference)
    mb = MegatronBackend(cfg, MODEL, generation, semantics=semantics)
    megatron_backend.load_megatron(mb.policy, hf_to_megatron(tb.policy.state_dict(), MODEL))
    megatron_backend.load_megatron(mb.critic, hf_to_megatron(tb.critic.state_dict(), MODEL, CRITIC))
    return tb, mb


@pytest.mark.parametrize("generation", [GenerationConfig(), GenerationConfig(temperature=0.7, top_p=0.9, top_k=50)])
def test_forward_parity_with_the_torch_backend_with_and_without_replay(generation):
    tb, mb = _backends(generation)
    ids = torch.randint(0, MODEL.vocab_size, (2, 25), generator=torch.Generator().manual_seed(3))
    inp, tgt = ids[:, :-1], ids[:, 1:]
    replay = _distinct_rows(2, 24, seed=5)
    for rep in (None, replay):
        a = tb.policy_logprobs(inp, tgt, rep, grad=False, routing=True)
        b = mb.policy_logprobs(inp, tgt, rep, grad=False, routing=True)
        diff = float((a.logp - b.logp).abs().max())
        print(f"replay={rep is not None}: log-prob max|diff| {diff:.2e}")
        assert diff < 1e-5 and torch.equal(a.outside, b.outside)
        assert torch.equal(a.routed_experts, b.routed_experts)
        assert not routing_differs(a.router_experts, b.router_experts).any()
    assert torch.equal(b.routed_experts, replay)
    assert routing_differs(b.router_experts, replay).any()  # the control: replay overrode the router's own choice
    va, vb = tb.values(inp, grad=False), mb.values(inp, grad=False)
    print(f"values max|diff| {float((va - vb).abs().max()):.2e}")
    assert float(va.abs().min()) > 0 and float((va - vb).abs().max()) < 1e-5
    # the replayed forward really differs from the free one (so the parity above is not vacuous)
    free = mb.policy_logprobs(inp, tgt, None, grad=False, routing=False).logp
    assert float((free - b.logp).abs().max()) > 1e-3


def test_sdpa_core_attention_equals_megatrons_dot_product_attention_without_the_square_scores():
    """t1async.learner.megatron.model.SdpaAttention against megatron-core's DotProductAttention (the local
    spec's) on the same query, keys and values, 4 heads in 2 query groups, 96 positions: the same
    context (to 1e-5) and the same gradients of query, keys and values (to 1e-5 of their largest
    element); autograd keeps no
    ``[b, heads, s, s]`` tensor for its backward (DotProductAttention keeps its probabilities)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from t1async.learner.megatron.model import SdpaAttention

    megatron_backend.init_megatron(torch.device("cpu"))
    tc = megatron_backend.transformer_config(MODEL, replay=False, dtype=torch.float32, device=torch.device("cpu"))
    s, b, heads, groups, hn = 96, 2, MODEL.num_attention_heads, MODEL.num_key_value_heads, MODEL.head_dim
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, b, n, hn, generator=g) for n in (heads, groups, groups))
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)[None, None]  # True: masked (DotProductAttention on CPU)
    out, grads, big = {}, {}, {}
    for name, cls in (("dot", DotProductAttention), ("sdpa", SdpaAttention)):
        attn = cls(tc, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        kept = []

        def pack(t, kept=kept):
            kept.append((tuple(t.shape), t.dtype, t.untyped_storage().data_ptr()))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            o = attn(*xs, mask, attn_mask_type=AttnMaskType.causal)
        o.pow(2).sum().backward()
        out[name], grads[name] = o.detach(), [x.grad for x in xs]
        big[name] = {ptr for shape, dtype, ptr in kept if shape[-2:] == (s, s) and dtype.is_floating_point}
    assert out["sdpa"].shape == (s, b, heads * hn)
    diff = float((out["dot"] - out["sdpa"]).abs().max())
    gdiff = max(float((a - c).abs().max() / a.abs().max()) for a, c in zip(grads["dot"], grads["sdpa"]))
    print(f"SDPA vs DotProductAttention: context max|diff| {diff:.2e}, input gradients {gdiff:.2e} relative; "
          f"float [s, s] tensors kept for the backward (distinct storages): {len(big['dot'])} vs {len(big['sdpa'])}")
    assert diff < 1e-5 and gdiff < 1e-5
    assert big["dot"] and not big["sdpa"]


def test_megatron_record_equals_the_torch_models_routed_experts():
    tb, mb = _backends()
    ids = torch.randint(0, MODEL.vocab_size, (3, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = tb.policy(ids, return_routing=True).routed_experts
    got = mb.policy_logprobs(ids, ids, None, grad=False, routing=True).routed_experts  # RouterReplay RECORD
    assert got.shape == want.shape == (3, 16, MODEL.num_hidden_layers, MODEL.num_experts_per_tok)
    assert torch.equal(got, want)  # same experts, same (descending-probability) order
    assert all(rr.router_replay.recorded_topk_idx is None for rr in mb._routers)  # cleared after the forward


def _learner(tmp_path, backend, replay, model: ModelConfig = MODEL, **kw):
    from t1async.actors.learner import Learner

    if model.path:  # a model folder without a tokenizer: no transcripts
        kw.setdefault("episodes_per_step", 0)
    cfg = LearnerConfig(batch_size=2, lr=1e-3, backend=backend, routing_replay=replay, **kw)
    return Learner(cfg, model, TransportConfig(curve=False), WeightSyncConfig(), str(tmp_path / f"{backend}-{replay}"), seed=0)


def _batch(model: ModelConfig = MODEL):
    from test_learner import synthetic

    batch = [synthetic(0, 1, reward=2.0), synthetic(0, 2, reward=0.0)]
    for i, t in enumerate(batch):
        t.routed_experts = _distinct_rows(1, t.routed_experts.shape[0], model, seed=i)[0].numpy().astype(np.uint8)
        t.num_experts = model.num_experts
    return batch


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    """The tiny qwen3_5_moe folder's ModelConfig (tests/support/qwen3_5_moe.py): Gated DeltaNet and gated attention
    layers, 8 experts top-2 and a gated shared expert."""
    from tests.support.qwen3_5_moe import qwen35_folder

    return qwen35_folder(tmp_path_factory.mktemp("qwen35"))


@pytest.mark.parametrize("replay", [True, False])
def test_one_learner_step_matches_the_torch_backend(tmp_path, replay):
    out = {}
    for backend in ("torch", "megatron"):
        learner = _learner(tmp_path, backend, replay)
        try:
            before = dict(learner.backend.hf_weights())
            before = {k: v.detach().clone() for k, v in before.items()}
            out[backend] = learner.loop._train_step(_batch()), {k: v.detach().clone() for k, v in learner.backend.hf_weights()}
        finally:
            learner.close()
    (mt, wt), (mm, wm) = out["torch"], out["megatron"]
    assert_same_metrics(mt, mm)
    assert mm["routing_diff_frac"] == mt["routing_diff_frac"] and mm["phase"] == "rl"
    rel, moved = weight_gap(wt, wm, before)
    print(f"replay={replay}: params after one step, max over tensors of |torch - megatron| / |torch| = {rel:.2e}; "
          f"smallest relative move {moved:.2e}")
    assert rel < 1e-5 and moved > 1e-3  # the step moved every matrix, and both backends moved it alike


def test_padded_micro_batches_train_like_one_trajectory_per_forward(tmp_path):
    """learner.micro_batch_tokens on the megatron backend: five trajectories of 8 to 40 tokens in
    one right-padded forward (padding replays the distinct ids Megatron needs) give the metrics and
    weights of one forward per trajectory, with replay and a KL penalty."""
    out = {}
    for mbt in (0, 4096):
        learner = _learner(tmp_path / str(mbt), "megatron", True, kl_coef=0.1, micro_batch_tokens=mbt)
        try:
            out[mbt] = learner.loop._train_step(_varied_batch()), {k: v.detach().clone() for k, v in learner.backend.hf_weights()}
        finally:
            learner.close()
    (m1, w1), (mb, wb) = out[0], out[4096]
    assert_same_metrics(m1, mb)
    assert m1["routing_diff_frac"] == mb["routing_diff_frac"] == 0.0
    assert weight_gap(w1, wb, w1)[0] < 1e-5


def _trained_checkpoint(tmp_path, **kw):
    """A megatron learner (``kw``: _learner's) after one step: (its checkpoint folder, its policy's HF
    weights, its critic's HF weights)."""
    learner = _learner(tmp_path, "megatron", True, **kw)
    try:
        learner.loop._train_step(_batch())
        learner.loop.step = 1
        ckpt = learner.save_checkpoint()
        hf = {k: v.clone() for k, v in learner.backend.hf_weights()}
        critic = learner.backend.critic_hf_state()
    finally:
        learner.close()
    return ckpt, hf, critic


def test_checkpoint_is_hugging_face_and_a_run_can_switch_backend(tmp_path):
    ckpt, hf, critic = _trained_checkpoint(tmp_path)
    loaded = Qwen3MoeForCausalLM.from_pretrained(ckpt)  # what samplers, eval and transformers read
    assert all(torch.equal(p, hf[n]) for n, p in loaded.named_parameters())
    assert json.loads((ckpt / "config.json").read_text())["model_type"] == "qwen3_moe"
    # resume the megatron run's checkpoint with the torch backend: same policy and critic
    tb = TorchBackend(LearnerConfig(), MODEL, GenerationConfig(), ckpt)
    assert tb.load_state(ckpt) is False  # another backend's optimiser layout: fresh optimisers
    assert all(torch.equal(p, critic[n]) for n, p in tb.critic.named_parameters())


def test_kl_reference_parity():
    tb, mb = _backends(kl_coef=0.1)
    ids = torch.randint(0, MODEL.vocab_size, (1, 12), generator=torch.Generator().manual_seed(6))
    # the references are the initial policies (before the router edit in _backends): equal to each other
    ref = tb.reference_logprobs(ids, ids)
    assert float((ref - mb.reference_logprobs(ids, ids)).abs().max()) < 1e-5
    assert float((ref - mb.policy_logprobs(ids, ids, None, grad=False, routing=False).logp).abs().max()) > 1e-3


# ----------------------------------------------------------------------------- tied embeddings

TIED = dataclasses.replace(MODEL, tie_word_embeddings=True)


def test_tied_converter_writes_no_output_layer_and_refuses_an_lm_head_that_is_not_the_embedding():
    torch.manual_seed(0)
    hf = dict(Qwen3MoeForCausalLM(TIED).named_parameters())  # a tied model's parameters: no lm_head.weight
    assert "lm_head.weight" not in hf
    meg = hf_to_megatron(hf, TIED)
    assert "output_layer.weight" not in meg and "embedding.word_embeddings.weight" in meg
    back = megatron_to_hf(meg, TIED)
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)
    # a state dict holding the tied head as well (state_dict() lists it): the same Megatron weights
    assert set(hf_to_megatron({**hf, "lm_head.weight": hf["model.embed_tokens.weight"].clone()}, TIED)) == set(meg)
    with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
        hf_to_megatron({**hf, "lm_head.weight": torch.randn_like(hf["model.embed_tokens.weight"])}, TIED)


def test_tied_embeddings_megatron_matches_the_torch_model_and_round_trips_a_tied_checkpoint(tmp_path):
    """A tied HF checkpoint without lm_head.weight: the Megatron backend builds from it (random
    init too), its logits equal the torch model's, one learner step moves both alike, and its
    checkpoint is again tied HF without lm_head.weight, loading bitwise into the torch model."""
    from safetensors import safe_open

    from t1async.actors.learner import Learner

    torch.manual_seed(0)
    src = Qwen3MoeForCausalLM(TIED)
    with torch.no_grad():
        src.model.embed_tokens.weight.normal_(0.0, 0.5)  # a head that matters (it is the embedding)
    src.save_pretrained(tmp_path / "init")
    with safe_open(str(tmp_path / "init" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    MegatronBackend(LearnerConfig(), TIED, GenerationConfig())  # random init: starts (main: unexpected output_layer)
    mb = MegatronBackend(LearnerConfig(), TIED, GenerationConfig(), tmp_path / "init")
    assert mb.policy.output_layer.weight is None and mb.policy.share_embeddings_and_output_weights
    ids = torch.randint(0, TIED.vocab_size, (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = src(ids).logits
        got = mb.policy.output_layer.logits(mb._run(mb.policy, ids)).float()
    print(f"tied logits max|torch - megatron| {float((want - got).abs().max()):.2e}")
    assert got.shape == want.shape and float((want - got).abs().max()) < 1e-5
    assert float(want.std()) > 0.1
    out = {}
    for backend in ("torch", "megatron"):
        cfg = LearnerConfig(batch_size=2, lr=1e-3, backend=backend, init_checkpoint=str(tmp_path / "init"))
        learner = Learner(cfg, TIED, TransportConfig(curve=False), WeightSyncConfig(), str(tmp_path / backend), seed=0)
        try:
            metrics = learner.loop._train_step(_batch())
            learner.loop.step = 1
            ckpt = learner.save_checkpoint()
            out[backend] = metrics, {k: v.detach().clone() for k, v in learner.backend.hf_weights()}, ckpt
        finally:
            learner.close()
    (mt, wt, _), (mm, wm, ckpt) = out["torch"], out["megatron"]
    assert set(wm) == set(wt) and "lm_head.weight" not in wm
    assert_same_metrics(mt, mm)
    rel, moved = weight_gap(wt, wm, dict(src.named_parameters()))
    assert rel < 1e-5 and moved > 1e-3
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    loaded = Qwen3MoeForCausalLM.from_pretrained(ckpt)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert all(torch.equal(p, wm[n]) for n, p in loaded.named_parameters())


# ----------------------------------------------------------------------------- two processes


def _ep_worker(rank: int, port: int, hf: dict, ids: torch.Tensor, replay: torch.Tensor, result_dir: str) -> None:
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    megatron_backend.init_megatron(torch.device("cpu"), expert_parallel=2)
    model = megatron_backend.build_gpt(MODEL, hf, replay=True, ep_rank=rank, ep_size=2)
    routers = [layer.mlp.router for layer in model.decoder.layers]
    mask = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).triu(1)[None, None]
    pos = torch.arange(ids.shape[1])[None]
    res = {"experts": sorted(megatron_to_hf({n: p.detach() for n, p in model.named_parameters()}, MODEL,
                                            ep_rank=rank, ep_size=2))}
    for rr in routers:
        rr.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
    res["free"] = model.output_layer.logits(model(ids, pos, mask))  # (GPTModel returns the final hidden states)
    res["record"] = torch.stack([rr.router_replay.get_recorded_indices() for rr in routers], 1)  # [T, L, K]
    for rr, row in zip(routers, megatron_backend.replay_rows(replay, MODEL.num_experts)):
        rr.router_replay.clear_indices()
        rr.router_replay.set_target_indices(row)
        rr.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    logits = model.output_layer.logits(model(ids, pos, mask))
    logits.float().logsumexp(-1).sum().backward()
    res["replay"] = logits.detach()
    res["expert_grad"] = float(sum(p.grad.abs().sum() for n, p in model.named_parameters() if "local_experts" in n))
    torch.save(res, f"{result_dir}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_process_expert_parallel_gloo_matches_the_torch_model(tmp_path):
    """expert_parallel=2 over gloo on CPU: each process holds 2 of the 4 experts (the converter's
    EP offsets, on Megatron's real expert numbering); logits with and without replay and the
    RECORDed routing equal the torch model's."""
    import torch.multiprocessing as mp

    torch.manual_seed(0)
    policy = Qwen3MoeForCausalLM(MODEL).eval()
    with torch.no_grad():
        for layer in policy.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 1.0)
    hf = {k: v.clone() for k, v in policy.state_dict().items()}
    ids = torch.randint(0, MODEL.vocab_size, (1, 12), generator=torch.Generator().manual_seed(7))
    replay = _distinct_rows(1, 12, seed=8)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_ep_worker, args=(port, hf, ids, replay, str(tmp_path)), nprocs=2, start_method="spawn")
    with torch.no_grad():
        free = policy(ids, return_routing=True)
        rep = policy(ids, routed_experts=replay).logits
    per_rank = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r, res in enumerate(per_rank):
        assert float((res["free"] - free.logits).abs().max()) < 1e-5
        assert float((res["replay"] - rep).abs().max()) < 1e-5
        assert torch.equal(res["record"], free.routed_experts[0])
        assert res["expert_grad"] > 0
        experts = {int(k.split(".")[5]) for k in res["experts"] if ".experts." in k}
        assert experts == {2 * r, 2 * r + 1}


def test_megatron_sizes_that_do_not_divide_are_refused_with_the_reason():
    for key, match in (("tensor_parallel", "tensor_parallel=2 must divide each of .*'num_key_value_heads': 1"),
                       ("pipeline_parallel", "pipeline_parallel=3 must divide model.num_hidden_layers=2"),
                       ("expert_parallel", "must divide model.num_experts=4")):
        cfg = LearnerConfig(megatron=dataclasses.replace(LearnerConfig().megatron, **{key: 2 if key == "tensor_parallel"
                                                                                      else 3}))
        with pytest.raises(ValueError, match=match):  # (one key/value head: no tensor-parallel split of 2)
            MegatronBackend(cfg, dataclasses.replace(MODEL, num_key_value_heads=1), GenerationConfig())
    cfg = LearnerConfig(megatron=dataclasses.replace(LearnerConfig().megatron, pipeline_parallel=2))
    with pytest.raises(ValueError, match="tie_word_embeddings"):  # embedding and LM head on two stages
        MegatronBackend(cfg, dataclasses.replace(MODEL, tie_word_embeddings=True), GenerationConfig())


@pytest.mark.slow
def test_bench_learner_reports_both_backends_on_the_same_step(capsys):
    from t1async.cli import main

    assert main(["bench", "learner", "--batch", "1", "--seq", "8", "--steps", "2", "--warmup", "0"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    t, m = out["results"]["torch"], out["results"]["megatron"]
    assert t["tokens_per_s"] > 0 and m["tokens_per_s"] > 0 and out["megatron_over_torch"] > 0
    assert t["parameters"] == m["parameters"] == 4_396_416
    assert len(t["step_s_all"]) == len(m["step_s_all"]) == 2
    # same init, batch and steps: the second step's loss agrees too (the first step moved both alike)
    assert m["policy_loss_last"] == pytest.approx(t["policy_loss_last"], rel=1e-4, abs=1e-7)


def test_critic_off_builds_no_critic_and_checkpoints_without_one(tmp_path):
    """``learner.critic: false`` on the megatron backend: no critic GPTModel, no critic optimiser,
    no critic.safetensors; values() says why it cannot answer; a torch run resumed from it with
    the critic on starts that critic afresh."""
    cfg = LearnerConfig(critic=False, advantage="group")
    torch.manual_seed(0)
    mb = MegatronBackend(cfg, MODEL, GenerationConfig())
    assert mb.critic is None and mb.critic_opt is None
    with pytest.raises(RuntimeError, match="learner.critic is false"):
        mb.values(torch.zeros(1, 4, dtype=torch.long), grad=False)
    mb.save(tmp_path)
    assert (tmp_path / "model.safetensors").exists() and not (tmp_path / "critic.safetensors").exists()
    assert mb.load_state(tmp_path) is True
    tb = TorchBackend(LearnerConfig(), MODEL, GenerationConfig(), tmp_path)
    assert tb.load_state(tmp_path) is False and tb.critic is not None


# ----------------------------------------------------------------------------- expert parallelism, 2 ranks


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray (the follower ranks are Ray actors), shut down after this module's tests."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _ep(n: int = 2, tp: int = 1, pp: int = 1):
    return dataclasses.replace(LearnerConfig().megatron, expert_parallel=n, tensor_parallel=tp, pipeline_parallel=pp,
                               timeout_s=60.0)


@pytest.mark.parametrize("family", ["qwen3_moe", pytest.param("qwen3_5_moe", marks=pytest.mark.slow)])
@pytest.mark.parametrize("tp,ep,pp", [(1, 2, 1), (2, 1, 1), (1, 1, 2)])
def test_two_rank_learner_step_matches_the_torch_backend(tmp_path, local_ray, request, tp, ep, pp, family):
    """learner.megatron.expert_parallel=2, tensor_parallel=2 (with sequence parallelism) or
    pipeline_parallel=2, rank 0 in this process, rank 1 a Ray actor, gloo: the same batch through
    one learner update as the torch backend from the same weights, replay on. Log-probs and
    routing equal (one sequence of 39 positions: with EP rank 1 forwards a dummy row; with TP the
    sequence is padded to 40 and each rank's routers see its half; with PP each stage replays and
    records its own layer); the step's metrics (grad_norm included: it sees whether each token
    reached its experts once and whether the gradients of whole and sliced weights were summed over
    the right ranks) and the gathered parameters after the AdamW step agree.

    qwen3_5_moe (megatron-core's GatedDeltaNet: under TP its in_proj sections, conv1d, A_log and dt_bias split by
    head): the same, the weights within 5e-5 relative (AdamW's first step moves an element by lr * g / (|g| + eps): an element
    whose gradient is near eps = 1e-8 moves by what g's float32 noise makes of it; test_megatron_qwen3_5_moe.py) and the
    move measured on its matrices (A_log and dt_bias move less than 1e-3 of their norm in one step)."""
    model = MODEL if family == "qwen3_moe" else request.getfixturevalue("qwen35")
    out = {}
    for backend, (t_, e_, p_) in (("torch", (1, 1, 1)), ("megatron", (tp, ep, pp))):
        learner = _learner(tmp_path, backend, True, model, megatron=_ep(e_, t_, p_))
        try:
            b = learner.backend
            before = {k: v.detach().clone() for k, v in b.hf_weights()}
            t = _batch(model)[0]
            ids = torch.from_numpy(t.token_ids.astype(np.int64))[None]
            replay = torch.from_numpy(t.routed_experts.astype(np.int64))[None]
            fwd = b.policy_logprobs(ids[:, :-1], ids[:, 1:], replay, grad=False, routing=True)
            free = b.policy_logprobs(ids[:, :-1], ids[:, 1:], None, grad=False, routing=True)
            metrics = learner.loop._train_step(_batch(model))
            if backend == "torch":  # its expert gradients' norm before clipping (the step clipped: norm > 1)
                clipped = sum(float(p.grad.pow(2).sum()) for k, p in b.policy.named_parameters() if ".experts." in k)
                metrics["expert_grad_norm"] = clipped ** 0.5 * (metrics["grad_norm"] + 1e-6) / learner.cfg.max_grad_norm
            else:
                metrics["expert_grad_norm"] = b.last_expert_grad_norm
            out[backend] = fwd, free, metrics, {k: v.detach().clone() for k, v in b.hf_weights()}, b.num_parameters()
        finally:
            learner.close()
    (ft, freet, mt, wt, nt), (fm, freem, mm, wm, nm) = out["torch"], out["megatron"]
    lp = float((ft.logp - fm.logp).abs().max())
    lp_free = float((freet.logp - freem.logp).abs().max())
    print(f"TP={tp} EP={ep} PP={pp} vs torch: log-prob max|diff| {lp:.2e} (replay), {lp_free:.2e} (own routing)")
    assert lp < 1e-5 and lp_free < 1e-5 and torch.equal(ft.outside, fm.outside)
    assert torch.equal(freet.routed_experts, freem.routed_experts)  # RECORD across both ranks' experts
    assert not routing_differs(ft.router_experts, fm.router_experts).any()
    assert_same_metrics(mt, mm)
    assert mm["routing_diff_frac"] == mt["routing_diff_frac"] == 0 and mt["grad_norm"] > learner.cfg.max_grad_norm
    # each token reached its experts once (rank 0 row 0, rank 1 row 1): the expert gradients are the true ones
    assert mm["expert_grad_norm"] == pytest.approx(mt["expert_grad_norm"], rel=1e-4) and mt["expert_grad_norm"] > 1e-3
    assert wm.keys() == wt.keys() and nm == nt == sum(v.numel() for v in wt.values())
    rel, moved = weight_gap(wt, wm, before)
    if family == "qwen3_5_moe":
        moved = weight_gap({k: w for k, w in wt.items() if w.dim() >= 2}, wm, before)[1]
    print(f"{family} TP={tp} EP={ep} PP={pp}: params after one step, max over tensors of |torch - megatron| / |torch| = "
          f"{rel:.2e}; smallest relative move {moved:.2e}; grad_norm torch {mt['grad_norm']:.6g} megatron "
          f"{mm['grad_norm']:.6g}; expert grad norm torch {mt['expert_grad_norm']:.6g} megatron "
          f"{mm['expert_grad_norm']:.6g}")
    assert rel < (1e-5 if family == "qwen3_moe" else 5e-5) and moved > 1e-3


def _varied_batch(model: ModelConfig = MODEL):
    """tests/unit/learner/test_learner.py's five trajectories of 8 to 40 tokens, each with its own routed-expert rows."""
    from test_learner import varied_batch

    out = varied_batch()
    for i, t in enumerate(out):
        t.routed_experts = _distinct_rows(1, t.routed_experts.shape[0], model, seed=i)[0].numpy().astype(np.uint8)
        t.num_experts = model.num_experts
    return out


@pytest.mark.parametrize("mbt,tp,ep,pp,family", [(0, 1, 2, 1, "qwen3_moe"), (4096, 2, 2, 1, "qwen3_moe"),
                                                 (4096, 1, 2, 2, "qwen3_moe"),
                                                 pytest.param(4096, 2, 2, 1, "qwen3_5_moe", marks=pytest.mark.slow)])
def test_multi_rank_data_parallel_split_of_varied_lengths_matches_the_torch_backend(tmp_path, local_ray, request, mbt,
                                                                                     tp, ep, pp, family):
    """Five trajectories of 8 to 40 tokens, replay and a KL penalty on, over expert_parallel=2,
    tensor_parallel=2, both (4 ranks), or expert_parallel=2 x pipeline_parallel=2 (4 ranks):
    ``micro_batch_tokens=4096`` gives one right-padded micro-batch of B=5 (EP rank 0 forwards rows
    0-2, EP rank 1 rows 3-4 and a dummy row), ``0`` gives five micro-batches of B=1 (with EP, rank
    1 forwards only a dummy row; with TP, odd lengths are padded to even ones). The learner's
    metrics and the parameters after its AdamW step equal the torch backend's; every forward held
    ceil(B / EP) rows on each rank. qwen3_5_moe on EP 2 x TP 2 (the ZeRO-1 optimizer on): the same, its weights
    held as in test_two_rank_learner_step_matches_the_torch_backend."""
    model = MODEL if family == "qwen3_moe" else request.getfixturevalue("qwen35")
    out = {}
    for backend, (t_, e_, p_) in (("torch", (1, 1, 1)), ("megatron", (tp, ep, pp))):
        learner = _learner(tmp_path, backend, True, model, megatron=_ep(e_, t_, p_), kl_coef=0.1,
                           micro_batch_tokens=mbt)
        try:
            before = {k: v.detach().clone() for k, v in learner.backend.hf_weights()}
            metrics = learner.loop._train_step(_varied_batch(model))
            counts = learner.backend.forward_counts() if backend == "megatron" else None
            out[backend] = metrics, {k: v.detach().clone() for k, v in learner.backend.hf_weights()}, counts
        finally:
            learner.close()
    (mt, wt, _), (mm, wm, counts) = out["torch"], out["megatron"]
    assert_same_metrics(mt, mm)
    assert mm["routing_diff_frac"] == mt["routing_diff_frac"] == 0 and mm["phase"] == "rl" and mm["kl_ref"] > 0
    rel, moved = weight_gap(wt, wm, before)
    if family == "qwen3_5_moe":
        moved = weight_gap({k: w for k, w in wt.items() if w.dim() >= 2}, wm, before)[1]
    print(f"{family} TP={tp} EP={ep} PP={pp} split, micro_batch_tokens={mbt}: params after one step, "
          "max over tensors of |torch - megatron| / "
          f"|torch| = {rel:.2e}; smallest relative move {moved:.2e}; grad_norm torch {mt['grad_norm']:.6g} "
          f"megatron {mm['grad_norm']:.6g}; forwards per rank {counts}")
    assert rel < (1e-5 if family == "qwen3_moe" else 5e-5) and moved > 1e-3
    # per micro-batch: old values, then policy, reference and values (ppo_epochs=1): 4 forwards on each rank
    micro = 1 if mbt else 5
    per = -(-5 // ep) if mbt else 1
    assert len(counts) == tp * ep * pp and all(c["forwards"] == 4 * micro and c["rows"] == 4 * micro * per for c in counts)
    assert all(c["tokens"] % tp == 0 for c in counts)  # sequence parallelism: every forward's length a multiple of TP


def test_each_rank_forwards_only_its_rows_and_rank_0_returns_the_whole_micro_batch(local_ray):
    """2 ranks, B=5 rows of 9 positions: each rank's model sees ceil(5/2)=3 rows per forward
    (rank 1: rows 3, 4 and a dummy copy of row 0), and rank 0 returns [5, 9] outputs in row order
    equal to the torch backend's; B=1: rank 1 forwards one dummy row, rank 0 returns [1, 9]."""
    cfg = LearnerConfig(kl_coef=0.1, megatron=_ep(2))
    torch.manual_seed(0)
    tb = TorchBackend(cfg, MODEL, GenerationConfig())
    torch.manual_seed(0)
    mb = MegatronBackend(cfg, MODEL, GenerationConfig())
    try:
        ids = torch.randint(0, MODEL.vocab_size, (5, 10), generator=torch.Generator().manual_seed(2))
        inp, tgt, replay = ids[:, :-1], ids[:, 1:], _distinct_rows(5, 9, seed=3)
        start = mb.forward_counts()
        assert len(start) == 2 and start[0] == start[1]
        got = mb.policy_logprobs(inp, tgt, replay, grad=False, routing=True)
        want = tb.policy_logprobs(inp, tgt, replay, grad=False, routing=True)
        assert got.logp.shape == got.outside.shape == (5, 9) and got.outside.dtype == torch.bool
        assert float((got.logp - want.logp).abs().max()) < 1e-5 and torch.equal(got.outside, want.outside)
        assert torch.equal(got.routed_experts, replay) and not routing_differs(got.router_experts,
                                                                              want.router_experts).any()
        v = mb.values(inp, grad=False)
        assert v.shape == (5, 9) and float((v - tb.values(inp, grad=False)).abs().max()) < 1e-5
        ref = mb.reference_logprobs(inp, tgt)
        assert ref.shape == (5, 9) and float((ref - tb.reference_logprobs(inp, tgt)).abs().max()) < 1e-5
        after = mb.forward_counts()
        for r in range(2):
            assert {k: after[r][k] - start[r][k] for k in after[r]} == {"forwards": 3, "rows": 9, "tokens": 81}, r
        one = mb.policy_logprobs(inp[3:4], tgt[3:4], replay[3:4], grad=True, routing=False)
        assert one.logp.shape == (1, 9) and one.logp.requires_grad
        assert float((one.logp.detach() - want.logp[3:4]).abs().max()) < 1e-5
        mb.backward(one.logp.sum())  # rank 1 backpropagates its dummy row with a zero output gradient
        last = mb.forward_counts()
        for r in range(2):
            assert last[r]["rows"] - after[r]["rows"] == 1 and last[r]["tokens"] - after[r]["tokens"] == 9
    finally:
        mb.close()


@pytest.mark.parametrize("tp,ep,pp", [(1, 2, 1), (1, 1, 2)])  # TP merge: the bitwise slice test above
def test_two_rank_checkpoint_is_one_hf_checkpoint_that_one_process_loads_bitwise(tmp_path, local_ray, tp, ep, pp):
    """A 2-rank backend's checkpoint (expert-, tensor- or pipeline-parallel): one HF
    model.safetensors with all 4 experts and both layers, whole (both ranks' experts, slices or
    stages), loaded bitwise by transformers-style loading, the torch backend and a 1-rank megatron
    backend (which start their optimisers fresh); a 2-rank resume restores both ranks' optimiser
    state."""
    ckpt, hf, critic = _trained_checkpoint(tmp_path, megatron=_ep(ep, tp, pp))
    assert {p.name for p in ckpt.iterdir()} >= {"model.safetensors", "config.json", "critic.safetensors",
                                               "optimizers.pt", "optimizers-rank1.pt"}
    assert {int(k.split(".")[5]) for k in hf if ".experts." in k} == {0, 1, 2, 3}
    loaded = Qwen3MoeForCausalLM.from_pretrained(ckpt)
    assert dict(loaded.named_parameters()).keys() == hf.keys()
    assert all(torch.equal(p, hf[n]) for n, p in loaded.named_parameters())
    tb = TorchBackend(LearnerConfig(), MODEL, GenerationConfig(), ckpt)
    assert tb.load_state(ckpt) is False  # another backend's optimiser layout: fresh optimisers
    assert all(torch.equal(p, hf[n]) for n, p in tb.policy.named_parameters())
    assert all(torch.equal(p, critic[n]) for n, p in tb.critic.named_parameters())
    one = MegatronBackend(LearnerConfig(), MODEL, GenerationConfig(), ckpt)
    assert one.load_state(ckpt) is False  # 1 rank vs 2: fresh optimisers
    assert one.hf_state().keys() == hf.keys() and all(torch.equal(v, hf[k]) for k, v in one.hf_state().items())
    assert all(torch.equal(v, critic[k]) for k, v in one.critic_hf_state().items())
    del one
    two = MegatronBackend(LearnerConfig(megatron=_ep(ep, tp, pp)), MODEL, GenerationConfig(), ckpt)
    try:
        assert two.load_state(ckpt) is True
        assert all(torch.equal(v, hf[k]) for k, v in two.hf_state().items())
        assert all(torch.equal(v, critic[k]) for k, v in two.critic_hf_state().items())
        two.save(tmp_path / "again")
    finally:
        two.close()
    with pytest.raises(RuntimeError, match="ranks were closed"):  # never rank 0's experts alone
        two.hf_state()
    for name in ("optimizers.pt", "optimizers-rank1.pt"):  # both ranks' AdamW moments restored and saved again
        a, b = (torch.load(d / name, weights_only=True)["policy"] for d in (ckpt, tmp_path / "again"))
        # (expert parallelism: the distributed optimizer's own weights' and replicated shard's AdamW states)
        for part in ("own", "shard") if ep > 1 else (None,):
            sa, sb = (a[part], b[part]) if part else (a, b)
            assert sa["state"] and len(sa["state"]) == len(sb["state"])
            for i, st in sa["state"].items():
                assert all(torch.equal(st[k], sb["state"][i][k]) for k in ("exp_avg", "exp_avg_sq"))


@pytest.mark.parametrize("tp,ep,pp", [(2, 1, 1), (1, 1, 2)])
def test_gathered_gradients_of_two_ranks_are_the_torch_backends(local_ray, tp, ep, pp):
    """hf_grads after a step (the clip has summed them over the ranks; max_grad_norm 1e9 leaves them unscaled): every
    policy gradient, gathered from both ranks' slices or stages under the torch model's names, equals the torch
    backend's on the same loss to 1e-6 of the largest (what ``t1async bench megatron-parity`` reports per layout)."""
    cfg = LearnerConfig(max_grad_norm=1e9, megatron=_ep(ep, tp, pp))
    torch.manual_seed(0)
    tb = TorchBackend(cfg, MODEL, GenerationConfig())
    mb = MegatronBackend(cfg, MODEL, GenerationConfig())
    try:
        mb._call("load_hf", "policy", sd=tb.policy.state_dict())
        ids = torch.randint(0, MODEL.vocab_size, (2, 17), generator=torch.Generator().manual_seed(2))
        w = torch.randn(2, 16, generator=torch.Generator().manual_seed(3))
        grads = []
        for b in (tb, mb):
            b.zero_grad()
            out = b.policy_logprobs(ids[:, :-1], ids[:, 1:], _distinct_rows(2, 16, seed=4), grad=True, routing=False)
            b.backward((out.logp * w).sum())
            b.step(policy=True, policy_lr=0.0)
            grads.append(mb.hf_grads() if b is mb else {k: p.grad.clone() for k, p in b.policy.named_parameters()})
    finally:
        mb.close()
    want, got = grads
    assert got.keys() == want.keys() and all(got[k].shape == want[k].shape for k in want)
    top = max(float(g.abs().max()) for g in want.values())
    assert top > 0 and max(float((want[k] - got[k]).abs().max()) for k in want) < 1e-6 * top


def test_weights_loaded_after_the_sharded_optimizer_was_built_are_the_ones_its_next_step_keeps(local_ray):
    """expert_parallel=2 with the distributed optimizer: weights loaded into policy and critic after the backend built
    its optimisers (a resume's critic, a resume onto another layout, exact policy masters) survive a step at learning
    rate 0 bit for bit; the optimiser's float32 shard used to keep the weights of before the load and its all-gather
    wrote them back (found by ``t1async bench megatron-parity``: parameters 1.5x off after one step)."""
    mb = MegatronBackend(LearnerConfig(megatron=_ep(2)), MODEL, GenerationConfig())
    try:
        assert isinstance(mb.policy_opt, megatron_backend.ShardedAdamW)
        want = _hf(seed=5)
        critic = {k: v + 0.25 for k, v in mb.critic_hf_state().items()}
        mb._call("load_hf", "policy", sd=want)
        mb._call("load_hf", "critic", sd=critic)
        mb.zero_grad()
        mb.step(policy=True, policy_lr=0.0)
        got, got_critic = mb.hf_state(), mb.critic_hf_state()
    finally:
        mb.close()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert all(torch.equal(got_critic[k], critic[k]) for k in critic)


def test_a_killed_follower_rank_fails_the_next_call_naming_it(local_ray):
    """A follower rank killed between calls: the next call raises RankFailed naming rank 1 within
    seconds (not after the timeout), and every later call raises it again."""
    import time

    from t1async.learner.megatron.ranks import RankFailed

    torch.manual_seed(0)
    mb = MegatronBackend(LearnerConfig(megatron=_ep(2)), MODEL, GenerationConfig())
    try:
        ids = torch.randint(0, MODEL.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
        assert mb.values(ids, grad=False).shape == (1, 8)
        local_ray.kill(mb._ranks.handles[0], no_restart=True)
        t0 = time.monotonic()
        with pytest.raises(RankFailed, match=r"rank 1 \(.* pid \d+\) failed: .*killed"):
            mb.policy_logprobs(ids, ids, None, grad=True, routing=False)
            mb.values(ids, grad=False)
        took = time.monotonic() - t0
        print(f"killed follower named after {took:.2f} s: {mb._ranks.failed}")
        assert took < 20
        with pytest.raises(RankFailed, match="rank 1"):
            mb.values(ids, grad=False)
    finally:
        mb.close()


def test_a_follower_killed_by_signal_fails_the_collective_naming_it(local_ray):
    """SIGKILL to a follower's process, then a call that goes straight into its collectives (no
    check of the followers first): gloo fails (connection closed) and the error still names rank 1
    and its pid, well before timeout_s."""
    import os
    import signal
    import time

    from t1async.learner.megatron.ranks import RankFailed

    torch.manual_seed(0)
    mb = MegatronBackend(LearnerConfig(megatron=_ep(2)), MODEL, GenerationConfig())
    try:
        ids = torch.randint(0, MODEL.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
        mb.policy_logprobs(ids, ids, None, grad=False, routing=False)
        where = mb._ranks.where(1)
        os.kill(int(where.split()[-1]), signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RankFailed, match=f"rank 1 \\({where}\\)"):  # _call without its check first:
            mb._ranks.run(lambda: (mb._ranks.announce("forward_values", (ids, False, 1)),  # the collective fails
                                   mb._forward_values(ids, False, 1)))
        took = time.monotonic() - t0
        print(f"SIGKILLed follower named after {took:.2f} s: {mb._ranks.failed}")
        assert took < 30
    finally:
        mb.close()


def test_a_stuck_follower_rank_times_out_instead_of_hanging(local_ray):
    """A follower alive but not answering (SIGSTOP): rank 0's collective gives up after
    learner.megatron.timeout_s (3 s here) and says so, instead of waiting forever."""
    import os
    import signal
    import time

    from t1async.learner.megatron.ranks import RankFailed

    torch.manual_seed(0)
    mb = MegatronBackend(LearnerConfig(megatron=dataclasses.replace(_ep(2), timeout_s=3.0)), MODEL, GenerationConfig())
    pid = int(mb._ranks.where(1).split()[-1])
    try:
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(RankFailed, match="timeout_s=3"):
            mb.hf_state()  # gathers every rank's experts: waits on rank 1
        took = time.monotonic() - t0
        print(f"stuck follower: gave up after {took:.1f} s: {mb._ranks.failed[:200]}")
        assert took < 30
    finally:
        os.kill(pid, signal.SIGCONT)
        mb.close()


def _saved_bytes(fn):
    """(fn(), bytes of the tensors autograd saved for the backward while fn ran in this process)."""
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved[0]


def test_both_backends_score_sglang_tokens_as_sglang_reports_them():
    """``sampler.backend: sglang`` at temperature 0.7, top-p 0.8, top-k 20: the torch and megatron
    backends (one pass, and the LM head in chunks of 8) score each token as SGLang reports it, the
    tempered softmax over the whole vocabulary, not renormalised over the kept set; their KL
    reference scores the same way."""
    gen = GenerationConfig(temperature=0.7, top_p=0.8, top_k=20)
    tb, mb = _backends(gen, kl_coef=0.1, semantics=SGLANG)
    ids = torch.randint(0, MODEL.vocab_size, (2, 25), generator=torch.Generator().manual_seed(3))
    inp, tgt = ids[:, :-1], ids[:, 1:]
    with torch.no_grad():
        logits, ref_logits = tb.policy(inp).logits, tb.reference(inp).logits
    want, want_ref = (torch.log_softmax(x.float() / gen.temperature, -1).gather(-1, tgt[..., None])[..., 0]
                      for x in (logits, ref_logits))
    assert torch.equal(token_logprobs(logits, tgt, 0.7, 20, 0.8, semantics=SGLANG), want)
    renorm = token_logprobs(logits, tgt, 0.7, 20, 0.8, semantics=EMBEDDED)
    assert float((renorm - want).min()) > 1e-3  # the control: renormalising would differ on every token
    for chunk in (0, 8):
        tb.cfg.max_tokens_per_chunk = mb.cfg.max_tokens_per_chunk = chunk
        for backend in (tb, mb):
            got = backend.policy_logprobs(inp, tgt, None, grad=False, routing=False)
            assert float((got.logp - want).abs().max()) < 1e-5, (backend.name, chunk)
            assert bool(got.outside.any())  # some sampled ids lie outside the joint set: counted, not rescored
            if chunk:
                assert float((backend.reference_logprobs(inp, tgt) - want_ref).abs().max()) < 1e-5


@pytest.mark.parametrize("tp,ep,pp,family", [(1, 1, 1, "qwen3_moe"), (2, 1, 1, "qwen3_moe"), (1, 2, 2, "qwen3_moe"),
                                              pytest.param(1, 1, 1, "qwen3_5_moe", marks=pytest.mark.slow)])
def test_megatron_long_sequences_recompute_layers_and_chunk_the_lm_head_exactly(local_ray, request, tp, ep, pp, family):
    """``learner.max_tokens_per_chunk=8`` on 39-position sequences, at temperature 0.7 and top-p 0.9,
    on one process, tensor_parallel=2 and expert_parallel=2 x pipeline_parallel=2: the megatron
    backend runs its LM head and log-probs a chunk at a time and recomputes every decoder layer in
    the backward (t1async/learner/megatron/model.py ``LayerRecompute``), the sampler's experts replayed
    there. Against chunk 0 (one pass, every activation kept): the same log-probs and outside flags,
    the same routing when the router's own choice is RECORDed, and the same gradients of every
    weight of rank 0's policy and critic; autograd saved under a third of the bytes in the policy's
    forward on rank 0 (the control that the layers were recomputed at all). qwen3_5_moe on one process: its
    Gated DeltaNet layers recomputed as well."""
    model = MODEL if family == "qwen3_moe" else request.getfixturevalue("qwen35")
    ids = torch.randint(0, model.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
    inp, tgt, replay = ids[:, :-1], ids[:, 1:], _distinct_rows(2, 39, model, seed=4)
    out = {}
    for chunk in (0, 8):
        cfg = LearnerConfig(max_tokens_per_chunk=chunk, megatron=_ep(ep, tp, pp))
        torch.manual_seed(0)
        mb = MegatronBackend(cfg, model, GenerationConfig(temperature=0.7, top_p=0.9))
        try:
            with torch.no_grad():
                mb.critic.output_layer.weight.normal_() if pp == 1 else None  # (rank 0 holds the critic's head)
            grads = {}
            for rep in (replay, None):  # the sampler's experts replayed; the router's own, RECORDed
                mb.zero_grad()
                fwd, saved = _saved_bytes(lambda mb=mb, rep=rep: mb.policy_logprobs(inp, tgt, rep, grad=True, routing=True))
                mb.backward(fwd.logp.sum() + mb.values(inp, grad=True).pow(2).sum())
                grads[rep is None] = fwd, saved, {f"{m}.{k}": p.grad.clone() for m, model in
                                                  (("policy", mb.policy), ("critic", mb.critic))
                                                  for k, p in model.named_parameters()}
            out[chunk] = grads
        finally:
            mb.close()
    for own in (False, True):
        (f0, s0, g0), (f8, s8, g8) = out[0][own], out[8][own]
        gap = max(float((g0[k] - g8[k]).norm() / g0[k].norm().clamp(min=1e-12)) for k in g0)
        print(f"{family} TP={tp} EP={ep} PP={pp} {'own routing' if own else 'replay'}: recompute + chunks vs one pass: "
              f"log-prob max|diff| {float((f0.logp - f8.logp).abs().max()):.2e}; gradients, max over tensors of "
              f"relative difference {gap:.2e}; saved for the backward {s8} vs {s0} bytes")
        assert float((f0.logp - f8.logp).abs().max()) < 1e-6 and torch.equal(f0.outside, f8.outside)
        assert bool(f0.outside.any()) and torch.equal(f0.routed_experts, f8.routed_experts)
        # (with pipeline stages the critic's head, on the last one, stays zero: rank 0's critic gets none)
        zero = [k for k, g in g0.items() if not float(g.abs().sum()) and not (pp > 1 and k.startswith("critic."))]
        assert g0.keys() == g8.keys() and gap < 1e-5 and not zero, zero
        assert s8 < s0 / 3
    # the control: replay mattered (the router's own experts are others, and so are the log-probs)
    assert routing_differs(out[8][True][0].routed_experts, replay).any()
    assert float((out[8][True][0].logp - out[8][False][0].logp).abs().max()) > 1e-3


def test_a_recompute_that_routes_otherwise_than_its_forward_fails_loudly():
    """Activation recompute must rebuild the forward's activations: a router whose own choice
    changed between the forward and the recompute (here: its weight edited in between, as a
    non-deterministic kernel would) raises instead of backpropagating through other experts."""
    torch.manual_seed(0)
    mb = MegatronBackend(LearnerConfig(max_tokens_per_chunk=8), MODEL, GenerationConfig())
    ids = torch.randint(0, MODEL.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))
    fwd = mb.policy_logprobs(ids[:, :-1], ids[:, 1:], None, grad=True, routing=False)
    with torch.no_grad():
        mb._routers[0].weight.neg_()
    with pytest.raises(RuntimeError, match="chose other experts than in the forward"):
        mb.backward(fwd.logp.sum())


def test_bench_expert_parallel_refuses_sizes_the_model_cannot_split_before_starting(capsys):
    """``t1async bench expert-parallel`` with a rank count that does not divide the model: one line
    naming the flag and the sizes that do, rc 2, before Ray or any timing starts."""
    from t1async.cli import main

    for args, want in ((["--ranks", "3"], "--ranks 3 must divide the local model's 8 experts: one of [1, 2, 4, 8]"),
                       (["--tensor-parallel", "3"], "--tensor-parallel 3 must divide"),
                       (["--pipeline-parallel", "3"], "--pipeline-parallel 3 must divide the local model's 4 layers")):
        assert main(["bench", "expert-parallel", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("t1async: error: bench expert-parallel:") and want in err and err.count("\n") == 1, err


def _moments(opt) -> int:
    """Elements of AdamW's first moments an optimiser of the backend keeps on this rank."""
    parts = [opt.own.opt, opt.opt] if hasattr(opt, "shard") else [opt.opt]
    return sum(st["exp_avg"].numel() for o in parts for st in o.state.values())


def test_distributed_optimizer_shards_the_replicated_weights_and_steps_them_bit_for_bit(tmp_path, local_ray):
    """expert_parallel=2, two learner steps on five trajectories, with the distributed optimizer
    (the default) and without: the gathered weights after them are bitwise equal, and rank 0 keeps
    AdamW moments for its experts and half of the replicated weights only."""
    out = {}
    for sharded in (False, True):
        mc = dataclasses.replace(_ep(2), distributed_optimizer=sharded)
        learner = _learner(tmp_path, "megatron", True, megatron=mc, micro_batch_tokens=4096)
        try:
            for _ in range(2):
                learner.loop._train_step(_varied_batch())
            b = learner.backend
            replicated = sum(p.numel() for k, p in b.policy.named_parameters() if ".local_experts." not in k)
            out[sharded] = {k: v.clone() for k, v in b.hf_weights()}, _moments(b.policy_opt), replicated
            if sharded:
                assert b.policy_opt.shard.numel() == -(-replicated // 2)
        finally:
            learner.close()
    (w_off, m_off, rep), (w_on, m_on, _) = out[False], out[True]
    print(f"distributed optimizer, EP=2: rank 0's AdamW first moments {m_on} elements against {m_off} "
          f"({rep} replicated weights)")
    assert w_on.keys() == w_off.keys() and all(torch.equal(w_on[k], w_off[k]) for k in w_on)
    assert m_on == m_off - rep + -(-rep // 2)
