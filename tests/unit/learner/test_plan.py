"""``t1async plan`` held to the truth on CPU: the planner's parameter, gradient, master and moment bytes equal the
tensors the megatron learner really allocates (one rank: the backend itself; every multi-rank layout: the learner's
own converter shards for each rank, and its real ZeRO-1 optimiser), its activation estimate is compared with the
tensors a real forward keeps for the backward, it answers for the shipped real configs, and the launch refuses a
layout that does not fit."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch

from t1async.config import ConfigError, GenerationConfig, LearnerConfig, ModelConfig
from t1async.learner.backend import ShardedAdamW
from t1async.learner.megatron.plan import GiB, Layout, check_layout_fits, load_model_config, plan_layout
from t1async.models.model import Qwen3MoeForCausalLM
from tests.support import FIXTURES

megatron_backend = pytest.importorskip("t1async.learner.megatron.backend", reason="megatron-core is not installed")
from t1async.learner.megatron import families  # noqa: E402
from t1async.learner.megatron.families.convert import CRITIC, POLICY, hf_to_megatron, shard_tp  # noqa: E402

REAL = FIXTURES / "real_configs"
MODEL = ModelConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


def _learner(dtype: str, **kw) -> LearnerConfig:
    return LearnerConfig(backend="megatron", kl_coef=0.1, **kw,
                         megatron=dataclasses.replace(LearnerConfig().megatron, dtype=dtype, device="cpu"))


def _bytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_planned_bytes_equal_what_the_one_rank_megatron_learner_allocates(dtype):
    """Parameters of policy, critic and reference; after one AdamW step: gradients, float32 masters, moments."""
    warnings.filterwarnings("ignore")
    lc = _learner(dtype)
    b = megatron_backend.MegatronBackend(lc, MODEL, GenerationConfig())
    try:
        plan = plan_layout(MODEL, lc, Layout())[0]
        for name, model, opt in (("policy", b.policy, b.policy_opt), ("critic", b.critic, b.critic_opt),
                                 ("reference", b.reference, None)):
            ps = list(model.parameters())
            want = getattr(plan, name)
            assert want.params == _bytes(ps), name
            if opt is None:
                assert want.grads == want.masters == want.moments == 0
                continue
            for p in ps:
                p.grad = torch.ones_like(p)
            opt.step()
            assert want.grads == _bytes(p.grad for p in ps), name
            assert want.masters == _bytes(m for m, p in zip(opt.masters, opt.params) if m is not p), name
            assert want.moments == _bytes(v for st in opt.state.values() for k, v in st.items()
                                          if k in ("exp_avg", "exp_avg_sq")), name
    finally:
        b.close()


@pytest.mark.parametrize("lay", [Layout(2, 1, 1), Layout(1, 2, 1), Layout(1, 1, 2), Layout(2, 1, 2), Layout(1, 2, 2)],
                         ids=str)
def test_planned_parameters_equal_the_learners_shards_on_every_layout(lay):
    """Each rank's Megatron state dict, as the learner's converter cuts it (hf_to_megatron, then shard_tp: what
    build_gpt loads and checks covers the model exactly): its bytes in bfloat16 (norms float32) are the plan's."""
    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(MODEL).state_dict()
    critic = {f"backbone.{k.removeprefix('model.')}": v for k, v in hf.items() if not k.startswith("lm_head")}
    critic |= {"head.weight": torch.zeros(1, MODEL.hidden_size), "head.bias": torch.zeros(1)}
    lc = _learner("bfloat16", critic=True)
    plans = plan_layout(MODEL, lc, lay)
    for pp in range(lay.pipeline):
        for ep in range(lay.expert):
            for tp in range(lay.tensor):
                for which, sd, layout in (("policy", hf, POLICY), ("critic", critic, CRITIC)):
                    part = shard_tp(hf_to_megatron(sd, MODEL, layout, ep_rank=ep, ep_size=lay.expert, pp_rank=pp,
                                                   pp_size=lay.pipeline), layout, tp, lay.tensor)
                    got = sum(t.numel() * (4 if "norm" in k or k.startswith("output_layer") and which == "critic"
                                           else 2) for k, t in part.items())
                    assert getattr(plans[pp], which).params == got, (str(lay), which, pp, ep, tp)


def test_qwen3_5_moe_planned_bytes_equal_the_megatron_learners_on_one_rank_and_its_shards_on_every_layout(tmp_path):
    """The tiny qwen3_5_moe folder (Gated DeltaNet and gated attention layers, gated shared experts): the plan's
    parameter bytes equal what the one-rank megatron learner allocates (megatron-core's GatedDeltaNet, attention
    and shared experts, bfloat16 with float32 norms) for policy, critic and reference, and on every layout (EP x TP
    x PP) each rank's share as the learner's converter cuts it: the layers counted on their stage, the Gated DeltaNet
    weights split over TP as megatron splits them."""
    from t1async.learner.torch_backend import ValueModel
    from t1async.models.qwen3_5_moe import Qwen3_5MoeForCausalLM
    from tests.support.qwen3_5_moe import qwen35_folder

    warnings.filterwarnings("ignore")
    cfg = qwen35_folder(tmp_path / "q35")
    lc = _learner("bfloat16", critic=True)
    b = megatron_backend.MegatronBackend(lc, cfg, GenerationConfig())
    try:
        plan = plan_layout(cfg, lc, Layout())[0]
        for name, model in (("policy", b.policy), ("critic", b.critic), ("reference", b.reference)):
            assert getattr(plan, name).params == _bytes(model.parameters()), name
    finally:
        b.close()
    torch.manual_seed(0)
    policy = Qwen3_5MoeForCausalLM(cfg)
    hf, critic = policy.state_dict(), ValueModel(policy).state_dict()
    for lay in (Layout(2, 1, 1), Layout(1, 2, 1), Layout(1, 1, 2), Layout(2, 2, 2), Layout(1, 4, 4)):
        plans = plan_layout(cfg, lc, lay)
        for pp in range(lay.pipeline):
            for ep in range(lay.expert):
                for tp in range(lay.tensor):
                    for which, sd, layout in (("policy", hf, POLICY), ("critic", critic, CRITIC)):
                        mg = families.hf_to_megatron(families.to_converter(cfg, sd), cfg, layout, ep_rank=ep,
                                                     ep_size=lay.expert, pp_rank=pp, pp_size=lay.pipeline)
                        part = families.shard_tp(mg, layout, tp, lay.tensor, cfg)
                        got = sum(t.numel() * (4 if "norm" in k or k.startswith("output_layer") and which == "critic"
                                               else 2) for k, t in part.items())
                        assert getattr(plans[pp], which).params == got, (str(lay), which, pp, ep, tp)


def test_planned_zero1_optimiser_bytes_equal_sharded_adamw():
    """expert_parallel=2 with learner.megatron.distributed_optimizer: the real ShardedAdamW of rank 0 of 2 over that
    rank's bfloat16 parameters (its own experts plus the replicated rest) holds the plan's masters and moments."""
    torch.manual_seed(0)
    lay = Layout(1, 1, 2)
    plan = plan_layout(MODEL, _learner("bfloat16"), lay)[0].policy
    part = hf_to_megatron(Qwen3MoeForCausalLM(MODEL).state_dict(), MODEL, POLICY, ep_rank=0, ep_size=2)
    params = {k: torch.nn.Parameter(v.to(torch.float32 if "norm" in k else torch.bfloat16)) for k, v in part.items()}
    opt = ShardedAdamW([p for k, p in params.items() if ".experts." in k],
                       [p for k, p in params.items() if ".experts." not in k], lr=1e-3, weight_decay=0.0,
                       group=None, rank=0, size=2)
    for p in params.values():
        p.grad = torch.ones_like(p)
    opt.own.step()
    opt.shard.grad = torch.ones_like(opt.shard)
    opt.opt.step()  # (the shard's own AdamW; the all-gather after it needs the group)
    masters = _bytes([m for m, p in zip(opt.own.masters, opt.own.params) if m is not p] + [opt.shard])
    moments = _bytes(v for o in (opt.own.opt, opt.opt) for st in o.state.values() for k, v in st.items()
                     if k in ("exp_avg", "exp_avg_sq"))
    assert (plan.masters, plan.moments) == (masters, moments)
    assert plan.params == _bytes(params.values())


def _kept_for_backward(fn, params) -> int:
    """Bytes of the distinct storages autograd keeps for the backward while ``fn`` runs (weights left out)."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        k = t.untyped_storage().data_ptr()
        if k not in skip:
            seen[k] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_activation_estimate_is_within_a_bound_of_what_a_forward_keeps(dtype, capsys):
    """No recompute (learner.max_tokens_per_chunk 0): the plan's policy and critic activations against the tensors
    the megatron model's forward keeps for its backward, 1,024 tokens. The estimate may run high (it is a budget)
    but not low by more than 10 %, nor above 1.5x."""
    warnings.filterwarnings("ignore")
    cfg = dataclasses.replace(MODEL, vocab_size=512, hidden_size=64, head_dim=16, num_experts=8,
                              moe_intermediate_size=32)
    T = 1024
    lc = _learner(dtype, max_tokens_per_chunk=0, micro_batch_tokens=T)
    lc = dataclasses.replace(lc, kl_coef=0.0)
    b = megatron_backend.MegatronBackend(lc, cfg, GenerationConfig())
    try:
        inp, tgt = torch.randint(0, 512, (1, T)), torch.randint(0, 512, (1, T))
        kept = {"policy": _kept_for_backward(lambda: b.policy_logprobs(inp, tgt, None, grad=True, routing=False),
                                             b.policy.parameters()),
                "critic": _kept_for_backward(lambda: b.values(inp, grad=True), b.critic.parameters())}
    finally:
        b.close()
    plan = plan_layout(cfg, lc, Layout(), T)[0]
    for name, measured in kept.items():
        ratio = getattr(plan, name).activations / measured
        with capsys.disabled():
            print(f"\n{dtype} {name}: planned {getattr(plan, name).activations} B, kept {measured} B, ratio {ratio:.2f}")
        assert 0.9 <= ratio <= 1.5, (name, ratio)


REAL_TOTALS = {"qwen3_5-122b-a10b.json": 122e9, "qwen3_5-35b-a3b.json": 35e9, "glm-4.5-air.json": 106e9}


@pytest.mark.parametrize("name", sorted(REAL_TOTALS))
def test_plan_answers_for_the_shipped_real_configs(name, capsys):
    from t1async.cli import main

    assert main(["plan", str(REAL / name), "--gpus", "64", "--gpu-memory", "80", "--json", "learner.backend=megatron",
                 "learner.megatron.dtype=bfloat16"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert abs(rep["parameters"] / REAL_TOTALS[name] - 1) < 0.02
    assert rep["fits"] and all(f["bytes"] <= 80 * GiB and f["ranks"] <= 64 for f in rep["fits"])
    one = rep["stages"][0]["policy"]
    assert abs(one["params"] / (2 * rep["parameters"]) - 1) < 0.01  # bfloat16, one rank (layout 1 x 1 x 1)


@pytest.mark.slow
def test_plan_answers_for_qwen3_30b_a3b(capsys):
    """(slow: transformers-free but 18k expert modules built on the meta device)"""
    from t1async.cli import main

    assert main(["plan", str(REAL / "qwen3-30b-a3b.json"), "--gpu-memory", "80", "--json",
                 "learner.backend=megatron", "learner.megatron.dtype=bfloat16"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert abs(rep["parameters"] / 30.5e9 - 1) < 0.02 and rep["fits"]


def test_a_layout_that_does_not_fit_or_divide_is_refused_in_one_line():
    lc = _learner("bfloat16", critic=True)
    with pytest.raises(ConfigError) as e:
        check_layout_fits(MODEL, lc, 0.0001)
    msg = str(e.value)
    assert "\n" not in msg and "GiB" in msg and "T1 x S1 x P1" in msg and "params" in msg
    assert check_layout_fits(MODEL, lc, 1.0) > 0
    with pytest.raises(ConfigError, match="expert_parallel=3 does not divide num_experts=4"):
        plan_layout(MODEL, lc, Layout(1, 1, 3))
    with pytest.raises(ConfigError, match="pipeline_parallel=3 does not divide num_hidden_layers=2"):
        plan_layout(MODEL, lc, Layout(1, 3, 1))


def test_launch_preflight_refuses_a_layout_larger_than_the_stated_gpu_memory(tmp_path, capsys):
    from tests.support.cli import LOCAL, assert_main_one_line

    assert_main_one_line(capsys, ["launch", LOCAL, f"run.dir={tmp_path / 'run'}", "learner.backend=megatron",
                                  "learner.megatron.gpu_memory_gib=0.0001"],
                         "learner.megatron.gpu_memory_gib=0.0001", "GiB")
    assert not (tmp_path / "run").exists()


def test_load_model_config_reads_a_bare_config_json_and_refuses_a_missing_path(tmp_path):
    cfg = load_model_config(REAL / "glm-4.5-air.json")
    assert (cfg.model_type, cfg.num_experts, cfg.num_hidden_layers) == ("glm4_moe", 128, 46)
    with pytest.raises(ConfigError, match="no such model folder"):
        load_model_config(tmp_path / "nope.json")
