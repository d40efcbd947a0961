"""qwen3_5_moe on the megatron learner, built from megatron-core's own modules (GatedDeltaNet, gated attention,
shared expert with its gate): the HF <-> Megatron converter (bitwise, every expert/pipeline/tensor rank), the CPU
stand-in for fla's kernels against megatron-core's own torch delta rule, log-probs and routing against our torch model
and transformers, one learner step against the torch backend. The multi-rank layouts are in test_megatron.py's
parametrized two-rank test."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from test_learner import assert_same_metrics, weight_gap

from t1async.config import GenerationConfig, LearnerConfig, TransportConfig, WeightSyncConfig
from t1async.learner.megatron.families import (
    from_converter,
    hf_to_megatron,
    megatron_to_hf,
    merge_tp,
    shard_tp,
    to_converter,
)
from t1async.learner.megatron.families.convert import CRITIC, POLICY
from t1async.learner.megatron.families.qwen3_5_moe import pack_gated_qkv
from t1async.learner.rl import routing_differs
from t1async.learner.torch_backend import TorchBackend, ValueModel
from t1async.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, text_config
from tests.support.qwen3_5_moe import perturb, qwen35_folder

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
megatron_backend = pytest.importorskip("t1async.learner.megatron.backend", reason="megatron-core is not installed")
MegatronBackend = megatron_backend.MegatronBackend


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread (the shared 2-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny qwen3_5_moe folder's ModelConfig (tests/support/qwen3_5_moe.py)."""
    return qwen35_folder(tmp_path_factory.mktemp("q35"))


def _states(cfg, seed: int = 0):
    """(policy, critic) HF state dicts of a perturbed model: every tensor distinct."""
    torch.manual_seed(seed)
    policy = Qwen3_5MoeForCausalLM(cfg)
    perturb(policy, seed)
    critic = ValueModel(policy)
    with torch.no_grad():
        critic.head.weight.normal_()
        critic.head.bias.fill_(0.3)
    return policy.state_dict(), critic.state_dict()


def _rows(cfg, B: int, T: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = B * T * cfg.num_hidden_layers
    rows = torch.stack([torch.randperm(cfg.num_experts, generator=g)[:cfg.num_experts_per_tok] for _ in range(n)])
    return rows.view(B, T, cfg.num_hidden_layers, cfg.num_experts_per_tok)


# ----------------------------------------------------------------------------- converter


@pytest.mark.parametrize("ep,pp,tp", [(1, 1, 1), (2, 1, 1), (1, 2, 1), (4, 2, 2), (2, 1, 2)])
def test_converter_round_trip_is_bitwise_on_every_expert_pipeline_and_tensor_rank(model, ep, pp, tp):
    """Policy and critic: every rank's Megatron tensors (to_converter: the fused experts one tensor per expert, then
    hf_to_megatron, shard_tp), merged (merge_tp) and converted back (megatron_to_hf), joined (from_converter: the
    routed experts stacked back into the fused 3D tensors) give the HF state dict bit for bit; shared weights are
    identical on every expert-parallel rank."""
    for layout, sd in zip((POLICY, CRITIC), _states(model)):
        back: dict[str, torch.Tensor] = {}
        for pr in range(pp):
            for er in range(ep):
                mg = hf_to_megatron(to_converter(model, sd), model, layout, ep_rank=er, ep_size=ep, pp_rank=pr, pp_size=pp)
                mg = merge_tp([shard_tp(mg, layout, r, tp, model) for r in range(tp)], layout, model)
                for k, v in megatron_to_hf(mg, model, layout, ep_rank=er, ep_size=ep, pp_rank=pr, pp_size=pp).items():
                    assert k not in back or torch.equal(back[k], v), k
                    back[k] = v
        back = from_converter(model, back)
        assert back.keys() == sd.keys()
        assert all(torch.equal(back[k], sd[k]) and back[k].dtype == sd[k].dtype for k in sd)


def test_converter_layouts_are_megatron_cores(model):
    """The gated attention's linear_qkv is group-major [q heads; gate heads; k; v] (megatron's
    get_query_key_value_tensors with output_gate); in_proj is [qkv; z; b; a]; routed experts from the fused tensors
    (or one tensor per expert, as released checkpoints name them: the same Megatron tensors);
    the shared expert's fc1 is [gate; up] and its gate is gate_weight; and under TP=2 rank r holds
    [q_r, k_r, v_r, z_r, b_r, a_r] of in_proj, [q_r, k_r, v_r] of conv1d and its value heads of A_log and dt_bias."""
    c = text_config(model)
    hf, _ = _states(model)
    mg = hf_to_megatron(hf, model, ep_rank=1, ep_size=2)
    hd, per = c.head_dim, c.num_attention_heads // c.num_key_value_heads
    qkv = mg["decoder.layers.3.self_attention.linear_qkv.weight"]
    qp = hf["model.layers.3.self_attn.q_proj.weight"].view(c.num_attention_heads, 2, hd, -1)  # per head: q, gate
    k, v = hf["model.layers.3.self_attn.k_proj.weight"], hf["model.layers.3.self_attn.v_proj.weight"]
    for g in range(c.num_key_value_heads):
        rows = qkv[g * (2 * per + 2) * hd:(g + 1) * (2 * per + 2) * hd]
        heads = range(g * per, (g + 1) * per)
        assert torch.equal(rows[:per * hd], torch.cat([qp[h, 0] for h in heads]))
        assert torch.equal(rows[per * hd:2 * per * hd], torch.cat([qp[h, 1] for h in heads]))
        assert torch.equal(rows[2 * per * hd:(2 * per + 1) * hd], k[g * hd:(g + 1) * hd])
        assert torch.equal(rows[(2 * per + 1) * hd:], v[g * hd:(g + 1) * hd])
    assert torch.equal(qkv, pack_gated_qkv(hf["model.layers.3.self_attn.q_proj.weight"], k, v, c))
    per_expert = {k: v for k, v in hf.items() if ".mlp.experts." not in k}  # a released checkpoint's expert names
    for i in range(model.num_hidden_layers):
        gu, dn = hf[f"model.layers.{i}.mlp.experts.gate_up_proj"], hf[f"model.layers.{i}.mlp.experts.down_proj"]
        for e in range(c.num_experts):
            x = f"model.layers.{i}.mlp.experts.{e}."
            per_expert[x + "gate_proj.weight"], per_expert[x + "up_proj.weight"] = gu[e].chunk(2)
            per_expert[x + "down_proj.weight"] = dn[e]
    again = hf_to_megatron(per_expert, model, ep_rank=1, ep_size=2)
    assert again.keys() == mg.keys() and all(torch.equal(again[k], mg[k]) for k in mg)
    la = "model.layers.0.linear_attn."
    assert torch.equal(mg["decoder.layers.0.self_attention.in_proj.weight"],
                       torch.cat([hf[la + f"in_proj_{n}.weight"] for n in ("qkv", "z", "b", "a")]))
    assert torch.equal(mg["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"],
                       hf["model.layers.0.mlp.experts.gate_up_proj"][c.num_experts // 2])  # EP rank 1's first
    assert torch.equal(mg["decoder.layers.0.mlp.shared_experts.linear_fc1.weight"],
                       torch.cat([hf["model.layers.0.mlp.shared_expert.gate_proj.weight"],
                                  hf["model.layers.0.mlp.shared_expert.up_proj.weight"]]))
    assert torch.equal(mg["decoder.layers.0.mlp.shared_experts.gate_weight"], hf["model.layers.0.mlp.shared_expert_gate.weight"])
    qk, vd, hv = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim, \
        c.linear_num_value_heads
    whole = mg["decoder.layers.0.self_attention.in_proj.weight"].split([qk, qk, vd, vd, hv, hv])
    conv = mg["decoder.layers.0.self_attention.conv1d.weight"].split([qk, qk, vd])
    for r in range(2):
        part = shard_tp(mg, POLICY, r, 2, model)
        assert torch.equal(part["decoder.layers.0.self_attention.in_proj.weight"],
                           torch.cat([w.chunk(2)[r] for w in whole]))
        assert torch.equal(part["decoder.layers.0.self_attention.conv1d.weight"], torch.cat([w.chunk(2)[r] for w in conv]))
        for n in ("A_log", "dt_bias"):
            assert torch.equal(part[f"decoder.layers.0.self_attention.{n}"],
                               mg[f"decoder.layers.0.self_attention.{n}"].chunk(2)[r])
        assert torch.equal(part["decoder.layers.0.self_attention.out_proj.weight"],
                           mg["decoder.layers.0.self_attention.out_proj.weight"].chunk(2, 1)[r])
        assert part["decoder.layers.0.self_attention.out_norm.weight"] is mg["decoder.layers.0.self_attention.out_norm.weight"]


# ----------------------------------------------------------------------------- megatron-core's modules, CPU stand-in


def test_the_model_is_megatron_cores_gated_delta_net_gated_attention_and_gated_shared_expert(model):
    """build_gpt makes GatedDeltaNet layers where layer_types says linear_attention (megatron's own pattern from
    linear_attention_freq), SelfAttention with the output gate elsewhere, and SharedExpertMLP with its gate."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    megatron_backend.init_megatron(torch.device("cpu"))
    hf, _ = _states(model)
    gpt = megatron_backend.build_gpt(model, hf, replay=True)
    kinds = [type(layer.self_attention) for layer in gpt.decoder.layers]
    assert kinds == [GatedDeltaNet if t == "linear_attention" else SelfAttention for t in text_config(model).layer_types]
    assert gpt.config.attention_output_gate and gpt.config.layernorm_zero_centered_gamma
    assert all(isinstance(layer.mlp.shared_experts, SharedExpertMLP) and layer.mlp.shared_experts.use_shared_expert_gate
               for layer in gpt.decoder.layers)


def test_cpu_stand_in_equals_megatron_cores_own_torch_delta_rule():
    """The shim behind fla's chunk_gated_delta_rule interface ([B, T, H, D], q scaled inside) against megatron-core's
    torch_chunk_gated_delta_rule (its deterministic-mode reference) on the same inputs, 150 tokens (3 chunks)."""
    from megatron.core.ssm.gated_delta_net import torch_chunk_gated_delta_rule

    from t1async.learner.megatron.families.qwen3_5_moe import _fla_l2norm, chunk_gated_delta_rule

    g = torch.Generator().manual_seed(0)
    B, T, H, D = 2, 150, 4, 16
    q, k = (_fla_l2norm(torch.randn(B, T, H, D, generator=g)) for _ in range(2))
    v = torch.randn(B, T, H, D, generator=g)
    decay = -torch.rand(B, T, H, generator=g)
    beta = torch.rand(B, T, H, generator=g)
    ours, _ = chunk_gated_delta_rule(q, k, v, g=decay, beta=beta)
    theirs, _ = torch_chunk_gated_delta_rule(q, k, v, g=decay, beta=beta)
    diff = float((ours - theirs).abs().max())
    print(f"delta rule: shim vs megatron-core's torch reference max|diff| {diff:.2e} (outputs up to "
          f"{float(theirs.abs().max()):.2f})")
    assert ours.shape == theirs.shape == (B, T, H, D) and diff < 1e-5


# ----------------------------------------------------------------------------- parity


def _backends(model, kl_coef: float = 0.0):
    """Both backends on the folder's weights (the critic head made non-zero, the same in both)."""
    cfg = LearnerConfig(kl_coef=kl_coef)
    torch.manual_seed(0)
    tb = TorchBackend(cfg, model, GenerationConfig())
    with torch.no_grad():
        tb.critic.head.weight.normal_(0.0, 0.5)
        tb.critic.head.bias.fill_(0.3)
    torch.manual_seed(0)
    mb = MegatronBackend(cfg, model, GenerationConfig())
    mb._load_hf("critic", tb.critic.state_dict())
    return tb, mb


def test_log_probs_routing_and_values_match_the_torch_model_and_transformers(model):
    """Two sequences of 150 tokens (3 chunks of the delta rule): log-probs within float32 noise of our torch model
    and of transformers' Qwen3_5MoeForCausalLM on the same folder, with the sampler's routing replayed (routing diff
    0) and with the routers' own choice (RECORD equal to the torch model's); values as the torch critic's (to 1e-5 relative)."""
    transformers = pytest.importorskip("transformers")
    tb, mb = _backends(model)
    try:
        ids = torch.randint(0, model.vocab_size, (2, 151), generator=torch.Generator().manual_seed(3))
        inp, tgt = ids[:, :-1], ids[:, 1:]
        replay = _rows(model, 2, 150, seed=5)
        hf = transformers.AutoModelForCausalLM.from_pretrained(model.path).eval()
        with torch.no_grad():
            ref = hf(inp).logits.float().log_softmax(-1).gather(-1, tgt[..., None])[..., 0]
        for rep in (None, replay):
            a = tb.policy_logprobs(inp, tgt, rep, grad=False, routing=True)
            b = mb.policy_logprobs(inp, tgt, rep, grad=False, routing=True)
            diff = float((a.logp - b.logp).abs().max())
            line = f"replay={rep is not None}: megatron vs torch log-prob max|diff| {diff:.2e}"
            if rep is None:
                line += f", vs transformers {float((ref - b.logp).abs().max()):.2e}"
                assert float((ref - b.logp).abs().max()) < 1e-5
            print(line)
            assert diff < 1e-5 and torch.equal(a.outside, b.outside)
            assert torch.equal(a.routed_experts, b.routed_experts)
            assert not routing_differs(a.router_experts, b.router_experts).any()
        assert torch.equal(b.routed_experts, replay)  # routing diff 0 against the sampler's rows
        assert routing_differs(b.router_experts, replay).any()  # the control: replay overrode the routers
        free = mb.policy_logprobs(inp, tgt, None, grad=False, routing=False).logp
        assert float((free - b.logp).abs().max()) > 1e-3  # the replayed forward really differs
        va, vb = tb.values(inp, grad=False), mb.values(inp, grad=False)
        print(f"values max|diff| {float((va - vb).abs().max()):.2e} (values up to {float(va.abs().max()):.2f})")
        assert float(va.abs().min()) > 0 and float((va - vb).abs().max()) < 1e-5 * max(1.0, float(va.abs().max()))
    finally:
        mb.close()


def _batch(model):
    from test_learner import synthetic

    batch = [synthetic(0, 1, reward=2.0), synthetic(0, 2, reward=0.0)]
    for i, t in enumerate(batch):
        t.routed_experts = _rows(model, 1, t.routed_experts.shape[0], seed=i)[0].numpy().astype(np.uint8)
        t.num_experts = model.num_experts
    return batch


@pytest.mark.slow
def test_one_learner_step_matches_the_torch_backend(model, tmp_path):
    """The same batch through one learner update on both backends (replay on): the step's metrics (loss, grad
    norm, ...) equal to 1e-5 relative, and the weights after AdamW's step: every tensor within 5e-5 relative of the
    torch backend's (AdamW's first step moves an element by lr * g / (|g| + eps): an element whose gradient is near
    eps = 1e-8 moves by what g's float32 noise makes of it; docs/results/2026-12-07-megatron-qwen3_5_moe.md), while
    every matrix moved by more than 1e-3 of its norm."""
    from t1async.actors.learner import Learner

    out = {}
    for backend in ("torch", "megatron"):
        cfg = LearnerConfig(batch_size=2, lr=1e-3, backend=backend, routing_replay=True, episodes_per_step=0)
        learner = Learner(cfg, model, TransportConfig(curve=False), WeightSyncConfig(), str(tmp_path / backend), seed=0)
        try:
            before = {k: v.detach().clone() for k, v in learner.backend.hf_weights()}
            metrics = learner.loop._train_step(_batch(model))
            out[backend] = metrics, {k: v.detach().clone() for k, v in learner.backend.hf_weights()}
        finally:
            learner.close()
    (mt, wt), (mm, wm) = out["torch"], out["megatron"]
    assert_same_metrics(mt, mm)
    assert mm["routing_diff_frac"] == mt["routing_diff_frac"] == 0
    assert wm.keys() == wt.keys()
    rel, _ = weight_gap(wt, wm, before)
    _, moved = weight_gap({k: w for k, w in wt.items() if w.dim() >= 2}, wm, before)
    print(f"params after one step, max over tensors of |torch - megatron| / |torch| = {rel:.2e}; smallest relative "
          f"move of a matrix {moved:.2e}; grad_norm torch {mt['grad_norm']:.6g} megatron {mm['grad_norm']:.6g}")
    assert rel < 5e-5 and moved > 1e-3


def test_checkpoint_is_the_familys_hugging_face_folder_and_the_torch_backend_resumes_it(model, tmp_path):
    """The megatron backend's checkpoint of moved weights: our torch model's loader reads it as the backend holds
    it (every tensor bitwise, the routed experts fused back), and the torch backend resumes policy and critic."""
    mb = MegatronBackend(LearnerConfig(), model, GenerationConfig())
    try:
        with torch.no_grad():  # weights the model folder does not hold
            for p in (*mb.policy.parameters(), *mb.critic.parameters()):
                p.add_(0.01 * torch.randn_like(p))
        ckpt = tmp_path / "ckpt"
        mb.save(ckpt)
        hf, critic = mb.hf_state(), mb.critic_hf_state()
    finally:
        mb.close()
    loaded = Qwen3_5MoeForCausalLM.from_pretrained(ckpt)
    assert dict(loaded.named_parameters()).keys() == hf.keys()
    assert all(torch.equal(p, hf[n]) for n, p in loaded.named_parameters())
    tb = TorchBackend(LearnerConfig(), model, GenerationConfig(), ckpt)
    assert tb.load_state(ckpt) is False  # another backend's optimiser layout: fresh optimisers
    assert all(torch.equal(p, hf[n]) for n, p in tb.policy.named_parameters())
    assert all(torch.equal(p, critic[n]) for n, p in tb.critic.named_parameters())


def test_tensor_parallel_sizes_count_the_gated_delta_net_heads_and_a_bad_size_is_refused_in_one_line(model):
    """learner.megatron.tensor_parallel must also divide the linear-attention key and value heads (megatron-core's
    TransformerConfig asserts it) and the shared expert's width: the config's choices and the backend say so."""
    import dataclasses

    from t1async.config import tensor_parallel_choices, tensor_parallel_sizes

    sizes = tensor_parallel_sizes(model)
    assert sizes["linear_num_key_heads"] == 2 and sizes["shared_expert_intermediate_size"] == 48
    odd = dataclasses.replace(model, hf_config={**model.hf_config, "linear_num_key_heads": 1})
    assert tensor_parallel_choices(model) == [1, 2] and tensor_parallel_choices(odd) == [1]
    lc = LearnerConfig(megatron=dataclasses.replace(LearnerConfig().megatron, tensor_parallel=2))
    with pytest.raises(ValueError, match="tensor_parallel=2 must divide .*'linear_num_key_heads': 1"):
        MegatronBackend(lc, odd, GenerationConfig())


def test_kl_reference_matches_the_torch_backends_and_stays_when_the_policy_moves(model):
    """learner.kl_coef > 0: the megatron reference (the folder's weights, converted as the policy's) scores tokens as
    the torch backend's reference does; moving the policy leaves it where it was."""
    tb, mb = _backends(model, kl_coef=0.1)
    try:
        ids = torch.randint(0, model.vocab_size, (2, 40), generator=torch.Generator().manual_seed(6))
        ref = tb.reference_logprobs(ids, ids)
        diff = float((ref - mb.reference_logprobs(ids, ids)).abs().max())
        print(f"reference log-prob max|diff| {diff:.2e}")
        assert diff < 1e-5
        with torch.no_grad():
            for p in mb.policy.parameters():
                p.add_(0.05 * torch.randn_like(p))
        assert float((ref - mb.reference_logprobs(ids, ids)).abs().max()) < 1e-5
        assert float((ref - mb.policy_logprobs(ids, ids, None, grad=False, routing=False).logp).abs().max()) > 1e-3
    finally:
        mb.close()


def test_a_tied_head_reads_the_embedding_and_scores_as_the_torch_model(tmp_path):
    """tie_word_embeddings: the megatron policy has no output_layer weight of its own (megatron-core's
    share_embeddings_and_output_weights), scores as the torch backend, and writes back no lm_head.weight."""
    tied = qwen35_folder(tmp_path / "tied", tie_word_embeddings=True)
    tb, mb = _backends(tied)
    try:
        assert "output_layer.weight" not in dict(mb.policy.named_parameters())
        ids = torch.randint(0, tied.vocab_size, (2, 40), generator=torch.Generator().manual_seed(2))
        a = tb.policy_logprobs(ids, ids, None, grad=False, routing=True)
        b = mb.policy_logprobs(ids, ids, None, grad=False, routing=True)
        assert float((a.logp - b.logp).abs().max()) < 1e-5 and torch.equal(a.routed_experts, b.routed_experts)
        assert "lm_head.weight" not in mb.hf_state()
    finally:
        mb.close()
