"""glm4_moe (GLM-4.5/4.6) on the megatron learner, built from megatron-core's own modules
(t1async/learner/megatron/families/glm4_moe.py), against the torch learner (transformers' own Glm4MoeForCausalLM)
on a tiny folder saved by transformers itself: the weight converter (bitwise, both ways, every rank layout),
log-probs and routing with and without replay, the expert-bias buffer, one learner step, checkpoints, the memory
plan, and what megatron-core cannot express."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_learner import assert_same_metrics, weight_gap

from t1async.config import GenerationConfig, LearnerConfig, ModelConfig, TransportConfig, WeightSyncConfig
from t1async.config.model_folder import resolve_model
from t1async.learner.megatron.families.convert import CRITIC, POLICY, merge_tp, pack_qkv, shard_tp
from t1async.learner.rl import routing_differs
from t1async.learner.torch_backend import TorchBackend, ValueModel
from t1async.models.families import load_model
from t1async.models.hf_folder import weight_specs
from tests.support.glm4 import glm4_folder

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
pytest.importorskip("transformers")
megatron_backend = pytest.importorskip("t1async.learner.megatron.backend", reason="megatron-core is not installed")
from t1async.learner.megatron.families import (  # noqa: E402
    from_converter,
    glm4_moe,  # noqa: E402
    hf_to_megatron,
    megatron_to_hf,
    to_converter,
)
from t1async.learner.megatron.plan import Layout, plan_layout  # noqa: E402

MegatronBackend = megatron_backend.MegatronBackend


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``name -> folder``: ``glm`` (GLM4_TINY), ``no_qk_norm`` (GLM-4.5-Air's attention: no q/k norms),
    ``ungrouped`` (the same weights, n_group 1: the control that group-limited routing acts)."""
    root = tmp_path_factory.mktemp("glm4")
    return {"glm": glm4_folder(root / "glm"), "no_qk_norm": glm4_folder(root / "noqk", use_qk_norm=False),
            "ungrouped": glm4_folder(root / "ungrouped", n_group=1, topk_group=1)}


GAP_TOL = 5e-5
"""Largest relative gap between the torch and megatron backends' weights after one AdamW step. Float summation
order differs between the two and between CPUs' kernels: 1.42e-5 on an AVX-512 host (2026-12-08), under 1e-5 on the
hosts before it; Adam's first step is about lr * sign(grad), so a gradient entry near 0 moves its weight a whole
step either way. The smallest move is 8.6e-4, 17x above this bound (the qwen3_5_moe parity uses the same)."""


def _cfg(folder) -> ModelConfig:
    return resolve_model(ModelConfig(path=str(folder)))


def _rows(B: int, T: int, cfg: ModelConfig, seed: int = 0) -> torch.Tensor:
    """[B, T, L_moe, K] distinct expert ids per row (as a sampler records; GLM's dense first layers have none)."""
    g = torch.Generator().manual_seed(seed)
    L = len(glm4_moe.moe_layer_pattern(cfg)) - glm4_moe.settings(cfg)["first_dense"]
    rows = torch.stack([torch.randperm(cfg.num_experts, generator=g)[:cfg.num_experts_per_tok]
                        for _ in range(B * T * L)])
    return rows.view(B, T, L, cfg.num_experts_per_tok)


# ----------------------------------------------------------------------------- converter


@pytest.mark.parametrize("ep,pp", [(1, 1), (2, 1), (1, 2), (4, 2)])
def test_glm4_converter_round_trip_is_bitwise_across_expert_and_pipeline_ranks(folders, ep, pp):
    """Policy and critic in the torch model's names (fused experts, the expert-bias buffer) -> every (expert,
    pipeline) rank's Megatron tensors -> back: bit for bit, the same names; the dense first layer has a dense MLP
    and no router, each MoE layer its router, expert bias and shared expert."""
    cfg = _cfg(folders["glm"])
    policy = load_model(cfg)
    for layout, sd in ((POLICY, policy.state_dict()), (CRITIC, ValueModel(policy).state_dict())):
        torch.manual_seed(1)
        sd = {k: torch.randn_like(v) for k, v in sd.items()}
        back: dict[str, torch.Tensor] = {}
        for pr in range(pp):
            for er in range(ep):
                mg = hf_to_megatron(to_converter(cfg, sd), cfg, layout, ep_rank=er, ep_size=ep, pp_rank=pr, pp_size=pp)
                if pr == 0:
                    assert "decoder.layers.0.mlp.linear_fc1.weight" in mg and not any(
                        k.startswith("decoder.layers.0.mlp.router") for k in mg)
                    assert {"decoder.layers.1.mlp.router.expert_bias", "decoder.layers.1.mlp.shared_experts.linear_fc1"
                            ".weight", "decoder.layers.1.self_attention.linear_qkv.bias"} <= set(mg)
                assert sum(".local_experts." in k and k.endswith("fc2.weight") for k in mg) == (
                    sum(glm4_moe.moe_layer_pattern(cfg)[pr * 4 // pp:(pr + 1) * 4 // pp]) * 8 // ep)
                for k, v in megatron_to_hf(mg, cfg, layout, ep_rank=er, ep_size=ep, pp_rank=pr, pp_size=pp).items():
                    assert k not in back or torch.equal(back[k], v)  # shared weights identical on every EP rank
                    back[k] = v
        out = from_converter(cfg, back)
        assert out.keys() == sd.keys() and all(torch.equal(out[k], sd[k]) for k in sd), layout.trunk


def test_glm4_tensor_parallel_slices_merge_back_bitwise_and_the_qkv_bias_follows_the_weights_rows(folders):
    """shard_tp / merge_tp over 2 ranks round-trip GLM's Megatron tensors (qkv bias, dense and shared MLPs
    included); and the packed bias lines up with the packed weight: Megatron's ``x W^T + b`` is the packing of
    transformers' q, k, v projections."""
    cfg = _cfg(folders["glm"])
    sd = to_converter(cfg, load_model(cfg).state_dict())
    mg = hf_to_megatron(sd, cfg)
    parts = [shard_tp(mg, POLICY, r, 2) for r in range(2)]
    assert parts[0]["decoder.layers.0.self_attention.linear_qkv.bias"].shape[0] == (4 + 2 * 2) * 16 // 2
    merged = merge_tp(parts, POLICY)
    assert merged.keys() == mg.keys() and all(torch.equal(merged[k], mg[k]) for k in mg)
    x = torch.randn(5, cfg.hidden_size)
    p = "model.layers.1.self_attn."
    want = pack_qkv(*(F.linear(x, sd[f"{p}{n}_proj.weight"], sd[f"{p}{n}_proj.bias"]).t() for n in "qkv"), cfg).t()
    got = F.linear(x, mg["decoder.layers.1.self_attention.linear_qkv.weight"],
                   mg["decoder.layers.1.self_attention.linear_qkv.bias"])
    assert torch.allclose(got, want, atol=1e-6)


# ----------------------------------------------------------------------------- parity


def _backends(cfg: ModelConfig, generation=GenerationConfig()):
    """Both backends from the same folder; the critic head made non-zero (the same in both)."""
    lc = LearnerConfig()
    torch.manual_seed(0)
    tb = TorchBackend(lc, cfg, generation)
    with torch.no_grad():
        tb.critic.head.weight.normal_(0.0, 0.5)
        tb.critic.head.bias.fill_(0.3)
    mb = MegatronBackend(lc, cfg, generation)
    mb._load_hf("critic", tb.critic.state_dict())
    return tb, mb


@pytest.mark.parametrize("which", ["glm", "no_qk_norm"])
def test_glm4_log_probs_routing_and_values_equal_the_torch_learner_and_transformers(folders, which):
    """Own routing and replay: log-probs within float32 noise of the torch learner's and of transformers' own
    forward (the same weights, loaded from the folder by each); the routing each records is the same set of
    experts; replay uses exactly the sampler's rows; the critic's values agree."""
    cfg = _cfg(folders[which])
    tb, mb = _backends(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 25), generator=torch.Generator().manual_seed(3))
    inp, tgt = ids[:, :-1], ids[:, 1:]
    replay = _rows(2, 24, cfg, seed=5)
    with torch.no_grad():
        hf = tb.policy.hf(inp).logits.float().log_softmax(-1).gather(-1, tgt[..., None])[..., 0]  # transformers alone
    out = {}
    for rep in (None, replay):
        a = tb.policy_logprobs(inp, tgt, rep, grad=False, routing=True)
        b = mb.policy_logprobs(inp, tgt, rep, grad=False, routing=True)
        diff = float((a.logp - b.logp).abs().max())
        print(f"{which} replay={rep is not None}: log-prob max|diff| megatron vs torch {diff:.2e}"
              + ("" if rep is not None else f", vs transformers {float((hf - b.logp).abs().max()):.2e}"))
        assert diff < 1e-5 and torch.equal(a.outside, b.outside)
        assert b.routed_experts.shape == (2, 24, 3, 2)
        assert not routing_differs(a.routed_experts, b.routed_experts).any()
        assert not routing_differs(a.router_experts, b.router_experts).any()
        out[rep is not None] = b
    assert float((hf - out[False].logp).abs().max()) < 1e-5
    assert torch.equal(out[True].routed_experts, replay)  # routing diff 0 against the sampler's rows
    assert routing_differs(out[True].router_experts, replay).any()  # the control: replay overrode the router
    assert float((out[True].logp - out[False].logp).abs().max()) > 1e-3  # and changed the log-probs
    va, vb = tb.values(inp, grad=False), mb.values(inp, grad=False)
    print(f"{which}: values max|diff| {float((va - vb).abs().max()):.2e}")
    assert float(va.abs().min()) > 0 and float((va - vb).abs().max()) < 1e-5


def test_glm4_group_limit_and_expert_bias_decide_routing_so_the_parity_above_tests_them(folders):
    """The controls of the parity test: on the same weights, dropping the group limit (n_group 1) or zeroing the
    score-correction bias changes which experts the router picks, so equal routing above needs both right."""
    ids = torch.randint(0, 256, (2, 25), generator=torch.Generator().manual_seed(3))[:, :-1]
    lc = LearnerConfig(critic=False)
    grouped = TorchBackend(lc, _cfg(folders["glm"]), GenerationConfig())
    ungrouped = TorchBackend(lc, _cfg(folders["ungrouped"]), GenerationConfig())
    a = grouped.policy_logprobs(ids, ids, None, grad=False, routing=True).router_experts
    assert routing_differs(a, ungrouped.policy_logprobs(ids, ids, None, grad=False, routing=True).router_experts).any()
    with torch.no_grad():
        for n, b in grouped.policy.named_buffers():
            if n.endswith("e_score_correction_bias"):
                assert float(b.abs().max()) > 0
                b.zero_()
    assert routing_differs(a, grouped.policy_logprobs(ids, ids, None, grad=False, routing=True).router_experts).any()


def test_glm4_layer_recompute_and_lm_head_chunks_are_exact(folders):
    """``learner.max_tokens_per_chunk=8`` on 39 positions (dense and MoE layers recomputed in the backward, the
    replayed or RECORDed experts kept per layer, the LM head a chunk at a time) against one pass: the same
    log-probs, routing and gradients of every policy and critic weight (dense MLP, shared experts, qkv biases
    included; no weight without a gradient but experts no token reached)."""
    cfg = _cfg(folders["glm"])
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
    inp, tgt, replay = ids[:, :-1], ids[:, 1:], _rows(2, 39, cfg, seed=4)
    out = {}
    for chunk in (0, 8):
        mb = MegatronBackend(LearnerConfig(max_tokens_per_chunk=chunk), cfg, GenerationConfig(temperature=0.7))
        with torch.no_grad():
            mb.critic.output_layer.weight.normal_(generator=torch.Generator().manual_seed(0))
        for rep in (replay, None):
            mb.zero_grad()
            fwd = mb.policy_logprobs(inp, tgt, rep, grad=True, routing=True)
            mb.backward(fwd.logp.sum() + mb.values(inp, grad=True).pow(2).sum())
            out[chunk, rep is None] = fwd, {f"{m}.{k}": p.grad.clone() for m, model in
                                            (("policy", mb.policy), ("critic", mb.critic))
                                            for k, p in model.named_parameters()}
    for own in (False, True):
        (f0, g0), (f8, g8) = out[0, own], out[8, own]
        gap, worst = max((float((g0[k] - g8[k]).norm() / g0[k].norm().clamp(min=1e-12)), k) for k in g0)
        print(f"glm4_moe ({worst}) {'own routing' if own else 'replay'}: recompute + chunks vs one pass: log-prob max|diff| "
              f"{float((f0.logp - f8.logp).abs().max()):.2e}; gradients, max relative difference {gap:.2e}")
        assert float((f0.logp - f8.logp).abs().max()) < 1e-6 and torch.equal(f0.routed_experts, f8.routed_experts)
        # every weight got a gradient, but experts the routers' own choice never reached (the critic's always, the
        # policy's with own routing): replay's random rows reach every policy expert
        zero = [k for k, g in g0.items() if not float(g.abs().sum()) and not (
            ".local_experts." in k and (own or k.startswith("critic.")))]
        assert g0.keys() == g8.keys() and gap < 1e-5 and not zero, zero
    assert routing_differs(out[8, True][0].routed_experts, replay).any()  # the control: replay mattered


def _learner(tmp_path, backend: str, cfg: ModelConfig, **kw):
    from t1async.actors.learner import Learner

    lc = LearnerConfig(batch_size=2, lr=1e-3, backend=backend, routing_replay=True, episodes_per_step=0, **kw)  # (no tokenizer)
    return Learner(lc, cfg, TransportConfig(curve=False), WeightSyncConfig(), str(tmp_path / f"{backend}-run"), seed=0)


def _batch(cfg: ModelConfig):
    from test_learner import synthetic

    batch = [synthetic(0, 1, reward=2.0), synthetic(0, 2, reward=0.0)]
    for i, t in enumerate(batch):
        t.routed_experts = _rows(1, t.routed_experts.shape[0], cfg, seed=i)[0].numpy().astype(np.uint8)
        t.num_experts = cfg.num_experts
    return batch


def _bias(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in sd.items() if k.endswith("e_score_correction_bias")}


def test_glm4_one_learner_step_matches_the_torch_backend_and_keeps_the_expert_bias(folders, tmp_path):
    """One learner update with replay on both backends from the same folder: the same metrics (routing diff 0),
    parameters after the AdamW step within 1e-5 relative, the expert-bias buffer unchanged on both (it has no
    gradient; megatron-core moves it only in finalize_model_grads, which the learner does not call). The megatron
    checkpoint is the torch learner's: the folder's names and layout, loaded back bitwise by the torch model."""
    cfg = _cfg(folders["glm"])
    given = _bias(load_model(cfg).state_dict())
    out = {}
    for backend in ("torch", "megatron"):
        learner = _learner(tmp_path, backend, cfg)
        try:
            b = learner.backend
            before = {k: v.detach().clone() for k, v in b.hf_weights()}
            metrics = learner.loop._train_step(_batch(cfg))
            state = b.hf_state() if backend == "megatron" else b.policy.state_dict()
            out[backend] = metrics, {k: v.detach().clone() for k, v in b.hf_weights()}, _bias(state)
            if backend == "megatron":
                b.save(tmp_path / "ckpt")
                saved = load_model(cfg, tmp_path / "ckpt").state_dict()
                assert all(torch.equal(saved[k], v.cpu()) for k, v in state.items())
                assert weight_specs(tmp_path / "ckpt").keys() == weight_specs(cfg.path).keys()
        finally:
            learner.close()
    (mt, wt, bt), (mm, wm, bm) = out["torch"], out["megatron"]
    assert_same_metrics(mt, mm)
    assert mm["routing_diff_frac"] == mt["routing_diff_frac"] == 0
    assert wm.keys() == wt.keys() and not any(k.endswith("e_score_correction_bias") for k in wm)
    rel, moved = weight_gap(wt, wm, before)
    print(f"glm4_moe: params after one step, max over tensors of |torch - megatron| / |torch| = {rel:.2e}; "
          f"smallest relative move {moved:.2e}")
    # every tensor moved (the routers, weights of std 1, by 8.6e-4 of their norm), both backends alike to GAP_TOL
    assert rel < GAP_TOL and moved > 1e-4
    assert bt.keys() == bm.keys() == given.keys() and len(given) == 3
    assert all(torch.equal(bt[k], given[k]) and torch.equal(bm[k].cpu(), given[k]) for k in given)


def test_glm4_settings_megatron_core_cannot_express_are_refused_in_one_line(tmp_path, capsys):
    """norm_topk_prob false (megatron-core's sigmoid router always normalises top-k > 1) and a group limit whose
    top-k // topk_group is not 2 (it ranks groups by that many scores, GLM by 2): one line naming the setting and
    the megatron-core source line, before any model is built."""
    for kw, words in (({"norm_topk_prob": False}, "moe_utils.py:724"),
                      ({"n_group": 4, "topk_group": 2, "num_experts_per_tok": 2}, "moe_utils.py:553")):
        cfg = _cfg(glm4_folder(tmp_path / str(len(kw)), **kw))
        with pytest.raises(ValueError, match=words) as e:
            megatron_backend.transformer_config(cfg, replay=True, dtype=torch.float32, device=torch.device("cpu"))
        assert "\n" not in str(e.value) and "learner.backend=torch" in str(e.value)
    # and the launch refuses it before anything starts (no run directory made)
    from tests.support.cli import LOCAL, assert_main_one_line

    capsys.readouterr()  # (transformers' save_pretrained progress bars)
    assert_main_one_line(capsys, ["launch", LOCAL, f"run.dir={tmp_path / 'run'}", "learner.backend=megatron",
                                  f"model.path={tmp_path / '1'}"], "learner.backend=megatron", "moe_utils.py:724")
    assert not (tmp_path / "run").exists()


def test_glm4_5_air_real_config_maps_onto_megatron_cores_transformer_config():
    """The shipped GLM-4.5-Air config.json (tests/fixtures/real_configs/) through the mapping: megatron-core's own
    TransformerConfig accepts it (its __post_init__ checks run) with GLM's values; no weights are built."""
    from t1async.learner.megatron.plan import load_model_config
    from tests.support import FIXTURES

    cfg = load_model_config(FIXTURES / "real_configs" / "glm-4.5-air.json")
    tc = megatron_backend.transformer_config(cfg, replay=True, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert tc.moe_layer_freq == [0] + [1] * 45 and tc.num_layers == 46 and tc.ffn_hidden_size == 10944
    assert (tc.moe_ffn_hidden_size, tc.moe_shared_expert_intermediate_size, tc.num_moe_experts) == (1408, 1408, 128)
    assert (tc.moe_router_score_function, tc.moe_router_enable_expert_bias, tc.moe_router_topk) == ("sigmoid", True, 8)
    assert tc.moe_router_group_topk is None and tc.moe_router_topk_scaling_factor == 1.0
    assert tc.add_qkv_bias and not tc.qk_layernorm and (tc.num_query_groups, tc.kv_channels) == (8, 128)
    assert glm4_moe.gpt_kwargs(cfg) == {"rotary_percent": 0.5}


def test_glm4_tensor_parallel_that_does_not_divide_the_dense_layers_width_is_refused_before_ranks_start(tmp_path):
    """tensor_parallel=2 with a dense first layer of width 51 (its gate and up halves would split unevenly): one line
    naming intermediate_size, before any rank starts (no Ray here)."""
    cfg = _cfg(glm4_folder(tmp_path / "odd", intermediate_size=51))
    lc = LearnerConfig(megatron=dataclasses.replace(LearnerConfig().megatron, tensor_parallel=2))
    with pytest.raises(ValueError, match="'intermediate_size': 51") as e:
        MegatronBackend(lc, cfg, GenerationConfig())
    assert "\n" not in str(e.value) and "tensor_parallel=2" in str(e.value)


# ----------------------------------------------------------------------------- memory plan


def test_glm4_planned_bytes_equal_what_the_megatron_learner_allocates(folders):
    """t1async plan counts glm4_moe as the learner allocates it: one rank (the backend itself: policy, critic and
    reference parameters), and every rank of multi-rank layouts (the converter's shards, bfloat16, norms float32)."""
    cfg = _cfg(folders["glm"])
    lc = LearnerConfig(backend="megatron", kl_coef=0.1,
                       megatron=dataclasses.replace(LearnerConfig().megatron, device="cpu"))
    b = MegatronBackend(lc, cfg, GenerationConfig())
    try:
        plan = plan_layout(cfg, lc, Layout())[0]
        for name, model in (("policy", b.policy), ("critic", b.critic), ("reference", b.reference)):
            assert getattr(plan, name).params == sum(p.numel() * p.element_size() for p in model.parameters()), name
        critic = ValueModel(load_model(cfg)).state_dict()
    finally:
        b.close()
    policy = load_model(cfg).state_dict()
    lc = dataclasses.replace(lc, megatron=dataclasses.replace(lc.megatron, dtype="bfloat16"))
    for lay in (Layout(2, 1, 1), Layout(1, 2, 1), Layout(1, 1, 2), Layout(2, 2, 2)):
        plans = plan_layout(cfg, lc, lay)
        for pp in range(lay.pipeline):
            for ep in range(lay.expert):
                for tp in range(lay.tensor):
                    for which, sd, layout in (("policy", policy, POLICY), ("critic", critic, CRITIC)):
                        part = shard_tp(hf_to_megatron(to_converter(cfg, sd), cfg, layout, ep_rank=ep,
                                                       ep_size=lay.expert, pp_rank=pp, pp_size=lay.pipeline),
                                        layout, tp, lay.tensor)
                        got = sum(t.numel() * (4 if "norm" in k or (k.startswith("output_layer") and which == "critic")
                                               else 2) for k, t in part.items() if not k.endswith("expert_bias"))
                        assert getattr(plans[pp], which).params == got, (str(lay), which, pp, ep, tp)


# ----------------------------------------------------------------------------- several ranks (Ray, gloo)


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray (the follower ranks are Ray actors), shut down after this module's tests."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("tp,ep,pp", [(1, 2, 1), (2, 1, 1), (1, 1, 2)])
def test_glm4_two_rank_learner_step_matches_the_torch_backend(folders, tmp_path, local_ray, tp, ep, pp):
    """tests/unit/learner/test_megatron.py's two-rank parity for glm4_moe: expert parallelism (4 of the 8 experts
    per rank, the shared expert and the dense layer replicated), tensor parallelism (qkv bias, dense and shared
    MLPs split, sequence parallelism) or pipeline parallelism (stage 0: the dense layer and MoE layer 1; stage 1:
    MoE layers 2 and 3, its routers replaying rows 1 and 2). Log-probs with replay and with the routers' own
    choice within 1e-5 of the torch learner's, the same routing, the same metrics, parameters after the step
    within 1e-5 relative, the gathered checkpoint state (expert bias included) the torch learner's names."""
    cfg = _cfg(folders["glm"])
    out = {}
    for backend, (t_, e_, p_) in (("torch", (1, 1, 1)), ("megatron", (tp, ep, pp))):
        mc = dataclasses.replace(LearnerConfig().megatron, expert_parallel=e_, tensor_parallel=t_,
                                 pipeline_parallel=p_, timeout_s=60.0)
        learner = _learner(tmp_path, backend, cfg, megatron=mc)
        try:
            b = learner.backend
            before = {k: v.detach().clone() for k, v in b.hf_weights()}
            t = _batch(cfg)[0]
            ids = torch.from_numpy(t.token_ids.astype(np.int64))[None]
            replay = torch.from_numpy(t.routed_experts.astype(np.int64))[None]
            fwd = b.policy_logprobs(ids[:, :-1], ids[:, 1:], replay, grad=False, routing=True)
            free = b.policy_logprobs(ids[:, :-1], ids[:, 1:], None, grad=False, routing=True)
            metrics = learner.loop._train_step(_batch(cfg))
            state = b.hf_state() if backend == "megatron" else b.policy.state_dict()
            out[backend] = fwd, free, metrics, {k: v.detach().clone() for k, v in b.hf_weights()}, state
        finally:
            learner.close()
    (ft, freet, mt, wt, st), (fm, freem, mm, wm, sm) = out["torch"], out["megatron"]
    lp, lp_free = float((ft.logp - fm.logp).abs().max()), float((freet.logp - freem.logp).abs().max())
    print(f"glm4_moe TP={tp} EP={ep} PP={pp} vs torch: log-prob max|diff| {lp:.2e} (replay), {lp_free:.2e} (own routing)")
    assert lp < 1e-5 and lp_free < 1e-5 and torch.equal(ft.outside, fm.outside)
    assert torch.equal(fm.routed_experts, replay)
    assert not routing_differs(freet.routed_experts, freem.routed_experts).any()
    assert not routing_differs(ft.router_experts, fm.router_experts).any()
    assert_same_metrics(mt, mm)
    assert mm["routing_diff_frac"] == mt["routing_diff_frac"] == 0
    assert wm.keys() == wt.keys() and sm.keys() == st.keys()
    assert all(torch.equal(sm[k].cpu(), st[k]) for k in st if k.endswith("e_score_correction_bias"))
    rel, moved = weight_gap(wt, wm, before)
    print(f"glm4_moe TP={tp} EP={ep} PP={pp}: params after one step, max over tensors of |torch - megatron| / |torch| "
          f"= {rel:.2e}; smallest relative move {moved:.2e}")
    assert rel < GAP_TOL and moved > 1e-4


def test_glm4_float32_megatron_checkpoint_of_a_bfloat16_folder_resumes_its_exact_weights(tmp_path):
    """A bfloat16 folder (as GLM releases are) trained by the float32 megatron learner: the checkpoint's folder holds
    the weights rounded to bfloat16 (the folder's layout and dtype, as the torch learner writes it) and optimizers.pt
    the exact float32 parameters (``policy_masters``), which a resume, on either backend, restores bit for bit."""
    from tests.support.glm4 import glm4_model

    glm4_model().to(torch.bfloat16).save_pretrained(str(tmp_path / "bf16"))
    cfg = _cfg(tmp_path / "bf16")
    b = MegatronBackend(LearnerConfig(), cfg, GenerationConfig())
    with torch.no_grad():
        for p in b.policy.parameters():  # weights no bfloat16 number holds
            p.add_(1e-4 * torch.randn_like(p))
    want = {k: v.clone() for k, v in b.hf_weights()}
    b.save(tmp_path / "ckpt")
    assert weight_specs(tmp_path / "ckpt")["model.embed_tokens.weight"][1] == torch.bfloat16
    resumed = MegatronBackend(LearnerConfig(), cfg, GenerationConfig(), init=tmp_path / "ckpt")
    rounded = dict(resumed.hf_weights())
    assert any(not torch.equal(rounded[k], v) for k, v in want.items())  # the control: the folder alone rounds
    resumed.load_state(tmp_path / "ckpt")
    assert all(torch.equal(v, want[k]) for k, v in resumed.hf_weights())
    tb = TorchBackend(LearnerConfig(), cfg, GenerationConfig(), init=str(tmp_path / "ckpt"))
    tb.load_state(tmp_path / "ckpt")
    assert all(torch.equal(p, want[k]) for k, p in tb.policy.named_parameters())
